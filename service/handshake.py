"""Who may open a session, and in which dialect: the one admission rule every dialect applies,
and the WebSocket handshakes (our protocol at /v1/listen, Deepgram's, OpenAI Realtime's).

    refused = admission(app, authorization, query)   # None, or the ProtocolError to answer with
    await open_session(app, connection)              # websockets' handler for an upgraded request

`app` is the service (`server.App`): its settings, metrics, model and capacity.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import Callable

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request

from . import deepgram, realtime
from . import protocol as P
from .core import SessionCore, check_token
from .observe import log_event
from .runner import Dialect, NativeDialect, SessionRunner, WebSocketChannel, refuse


def admission(app, authorization: str | None, query: str, *, authorize: bool = True) -> P.ProtocolError | None:
    """Why a new session or upload is refused, or None: the token first (it alone decides, even
    when other parameters are bad), then a drain or a model still loading, then capacity. Each
    dialect answers the error in its own words (status, event or message)."""
    if authorize:
        try:
            check_token(app.config.token, authorization, query)
        except P.ProtocolError as e:
            return e
    if app.draining:
        return P.ProtocolError(P.ErrorCode.SHUTTING_DOWN, "the server is shutting down; reconnect")
    if not app.ready:
        return P.ProtocolError(P.ErrorCode.NOT_READY, "the model is loading; retry")
    if app.full:
        return P.ProtocolError(P.ErrorCode.SERVER_FULL, f"the server is at its limit of {app.config.max_sessions} "
                               "sessions and uploads; retry later")
    return None


def origin_refused(app, request: Request) -> str | None:
    """Why a browser's Origin is refused (counted and logged), or None when it may connect:
    requests without an Origin (non-browser clients) always pass."""
    origin = request.headers.get("Origin")
    allowed = app.config.allowed_origins
    if origin is None or not allowed or origin in allowed:
        return None
    app.metrics.rejects.labels("origin").inc()
    log_event("rejected", level=logging.WARNING, reason="origin", origin=origin[:100])
    return f"Origin {origin[:100]!r} is not allowed"


DEEPGRAM_STATUS = {P.ErrorCode.UNAUTHORIZED: (401, "INVALID_AUTH"), P.ErrorCode.SERVER_FULL: (429, "TOO_MANY_REQUESTS")}


def deepgram_refusal(app, request: Request) -> deepgram.DeepgramError | None:
    """Deepgram's clients read a refusal at the handshake, as Deepgram's HTTP error body."""
    query = request.path.partition("?")[2]
    try:
        refused = origin_refused(app, request)
        if refused is not None:
            raise deepgram.DeepgramError(403, refused, "Forbidden")
        error = admission(app, request.headers.get("Authorization"), query)
        if error is not None:
            status, kind = DEEPGRAM_STATUS.get(error.code, (503, "Unavailable"))
            message = ("missing or wrong API key; send 'Authorization: Token <key>'"
                       if error.code == P.ErrorCode.UNAUTHORIZED else error.message)
            raise deepgram.DeepgramError(status, message, kind)
        deepgram.parse_query(query, app.model.dims.languages)
    except deepgram.DeepgramError as e:
        app.metrics.rejects.labels("deepgram_" + str(e.status)).inc()
        log_event("rejected", level=logging.WARNING, reason="deepgram", status=e.status, detail=e.message)
        return e
    return None


async def open_session(app, conn: ServerConnection) -> None:
    """Run the session of an upgraded WebSocket in the dialect its path names, or refuse it in
    that dialect's words."""
    request = conn.request
    assert request is not None   # websockets hands over a connection after its handshake
    path, _, query = request.path.partition("?")
    channel = WebSocketChannel(conn)
    beta = "realtime=v1" in request.headers.get("OpenAI-Beta", "")
    # how a refusal before the session speaks: Realtime's error event, else our protocol's
    refusing: Dialect = (realtime.Dialect(app.model_name, app.model.dims.languages, audio_seconds=lambda: 0.0,
                                          beta=beta) if path == realtime.PATH else NativeDialect())
    make_dialect: Callable[[SessionCore], Dialect] = lambda core: refusing
    refused = admission(app, request.headers.get("Authorization"), query)
    if refused is not None:
        await refuse(app.metrics, channel, refusing, refused.code, refused.message)
        return
    limits, resumable = app.limits, True
    languages = app.model.dims.languages
    try:
        if path == deepgram.LISTEN_PATH:   # checked at the handshake already (deepgram_refusal)
            session_config, options = deepgram.parse_query(query, languages)
            if options.end_of_speech_ms is not None:
                limits = dataclasses.replace(limits, end_of_speech_ms=options.end_of_speech_ms)
            make_dialect = partial(_deepgram_dialect, options, app.model_name)
        elif path == realtime.PATH:
            realtime.check_query(query)
            session_config, resumable = realtime.session_config(), False
            make_dialect = partial(_realtime_dialect, app.model_name, languages, beta)
        else:
            session_config = P.parse_query(query, languages)
    except (P.ProtocolError, deepgram.DeepgramError) as e:
        code = getattr(e, "code", P.ErrorCode.BAD_REQUEST)
        # the query failed before the session's dialect was made: refused in the path's own words
        code = code if isinstance(code, P.ErrorCode) else P.ErrorCode.BAD_REQUEST
        await refuse(app.metrics, channel, refusing, code, e.message)
        return
    await app.run_session(SessionRunner(app, channel, session_config, limits, make_dialect, resumable=resumable))


def _deepgram_dialect(options: deepgram.Options, model: str, core: SessionCore) -> deepgram.Dialect:
    return deepgram.Dialect(options, model, audio_seconds=lambda: core.session.audio_seconds)


def _realtime_dialect(model: str, languages, beta: bool, core: SessionCore) -> realtime.Dialect:
    return realtime.Dialect(model, languages, audio_seconds=lambda: core.session.audio_seconds, beta=beta)
