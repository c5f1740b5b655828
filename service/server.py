"""The live transcription service: WebSocket sessions on one shared model, plus HTTP operations.

    app = build_app(model=Whistle(path), config=ServiceConfig(port=0))
    async with app:                      # binds, warms the JIT, then /readyz says 200
        print(app.url)                   # ws://127.0.0.1:PORT
        await app.wait_closed()          # until app.drain() (SIGTERM) has finished the sessions

or `serve(model=..., config=...)` / `main(argv)`, which also install the SIGTERM/SIGINT drain.
The event loop only moves bytes: every engine call runs on a bounded thread pool, one call in
flight per session, and the protocol logic lives in `service.protocol` (Sans-I/O).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import http
import json
import logging
import signal
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from websockets.asyncio.server import Server, ServerConnection, serve as ws_serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from whistle_stream import __version__, allocator
from whistle_stream.frontend import warm_signal

from . import deepgram, openai_api, realtime, wyoming_server
from . import protocol as P
from .config import ServiceConfig, add_serve_arguments, config_from_args
from .core import SessionCore, SessionLimits, check_token
from .http import Reply, Request as HttpRequest, diverting
from .observe import Metrics, log_event, setup_logging
from .resume import random_secret
from .runner import Dialect, NativeDialect, SessionRunner, WebSocketChannel, refuse

LISTEN_PATH = "/v1/listen"
TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
MODELS_PATH = "/v1/models"
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/captions.js": ("captions.js", "text/javascript; charset=utf-8"),
          "/subtitles.js": ("subtitles.js", "text/javascript; charset=utf-8"),
          "/tap-worklet.js": ("tap-worklet.js", "text/javascript; charset=utf-8"),
          "/captions.css": ("captions.css", "text/css; charset=utf-8"),
          "/favicon.svg": ("favicon.svg", "image/svg+xml"),
          "/favicon.ico": ("favicon.svg", "image/svg+xml")}


def _response(status: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8") -> Response:
    body = body.encode() if isinstance(body, str) else body
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store"), ("Connection", "close")])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def load_engine(config: ServiceConfig, initializer=None, initargs: tuple = ()):
    """The engine the settings ask for: the model in this process, or served by worker processes
    (each calls initializer(*initargs) first: `workers.ProcessEngine`)."""
    if config.processes > 1:
        from .workers import ProcessEngine
        return ProcessEngine(config.model, processes=config.processes, initializer=initializer, initargs=initargs)
    from whistle_stream import Whistle
    return Whistle(config.model)


def engine_threads(config: ServiceConfig) -> int:
    """Threads that run engine calls. With worker processes a thread mostly waits on a pipe, and
    calls for one process wait their turn: enough threads that every process always has one."""
    return config.workers if config.processes == 1 else max(config.workers, 4 * config.processes)


class App:
    """The service: model, worker pool, metrics, sessions and the WebSocket server."""

    def __init__(self, model=None, config: ServiceConfig | None = None, web_root: Path | None = None):
        self.config = config or ServiceConfig()
        self.limits = limits_of(self.config)
        self.resume_shared = self.config.resume_secret is not None
        secret = self.config.resume_secret
        self.resume_secret = secret.encode() if secret is not None else random_secret()
        self.model = model
        self._owns_model = model is None   # loaded here, so closed here (worker processes)
        self.metrics = Metrics()
        allocator.limit_arenas()   # before the pool's threads allocate: see whistle_stream.allocator
        self.pool = ThreadPoolExecutor(max_workers=engine_threads(self.config), thread_name_prefix="engine")
        self.sessions: set[SessionRunner] = set()
        self.requests_open = 0   # transcription uploads on the engine now
        self.ready = False
        self.draining = False
        self.server: Server | None = None
        self.port: int | None = None
        self.wyoming_port: int | None = None
        # The captions page, when the caller serves one (the command line passes the clients' folder).
        self._static = ({} if web_root is None else
                        {path: (Path(web_root) / name, kind) for path, (name, kind) in STATIC.items()})
        self._closed = asyncio.Event()
        self.wyoming = wyoming_server.WyomingServer(self) if self.config.wyoming_port else None

    # -- engine ------------------------------------------------------------------------------
    async def engine(self, fn, *args):
        """Run a CPU-heavy engine call on the worker pool, never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(fn, *args))

    def _load_and_warm(self) -> float:
        t0 = time.perf_counter()
        done = threading.Event()
        threading.Thread(target=_say_compiling, args=(done,), name="compile-progress", daemon=True).start()
        try:
            if self.model is None:
                self.model = load_engine(self.config)
            self.model.warmup()   # every kernel compiled once (cache=True makes later starts fast)
        finally:
            done.set()
        # The gate, then one short session through the core's whole pass schedule.
        signal_ = warm_signal(self.model.dims.rate)
        self.model.is_speech(signal_)
        # the warm-up's own audio counts against no session's limit (a --max-session-seconds under its
        # 1.5 s stopped the start)
        core = SessionCore(self.model, P.SessionConfig(encoding="pcm_f32le", vad=False),
                           dataclasses.replace(self.limits, max_session_seconds=float("inf")), session_id="warmup")
        core.open()
        core.audio(signal_.tobytes())
        core.finish("close")
        return time.perf_counter() - t0

    async def warm(self) -> None:
        """Load the model if none was given and run one short pass so the JIT is compiled."""
        try:
            seconds = await self.engine(self._load_and_warm)
        except Exception as e:
            if not self.draining:
                raise
            # stopped during start-up: the drain closed the engine (its workers) under the warm-up
            log_event("warm_interrupted", detail=f"{type(e).__name__}: {e}"[:300])
            return
        self.ready = True
        log_event("ready", model=getattr(self.model, "name", "?"), warm_s=round(seconds, 3),
                  workers=self.config.workers, processes=len(getattr(self.model, "workers", ())) or 1,
                  languages=list(self.model.dims.languages))
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        page = f"http://{host}:{self.port}/" if self._static else "(no page: --web-root not given)"
        log_event("open", page=page, websocket=f"ws://{host}:{self.port}{LISTEN_PATH}")
        note = getattr(self.model, "note", None)
        if note:
            log_event("model_note", note=note)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def version(self) -> str:
        return __version__

    @property
    def demo_model(self) -> bool:
        """The bundled demo model runs (it hears only its own vocabulary in synthetic voices)."""
        return getattr(self.model, "kind", None) == "demo"

    @property
    def url(self) -> str:
        return f"ws://{self.config.host}:{self.port}"

    async def start(self, warm: bool = True) -> "App":
        c = self.config
        self.server = await ws_serve(
            self._handle, c.host, c.port, process_request=self._route, max_size=c.max_frame_bytes,
            create_connection=diverting(self._http, c.max_upload_bytes + 65536, c.request_timeout),
            max_queue=16, write_limit=2 ** 16, ping_interval=20, ping_timeout=20, close_timeout=5,
            server_header="whistle-stream", logger=logging.getLogger("whistle.websockets"))
        self.port = self.server.sockets[0].getsockname()[1]
        log_event("listening", host=c.host, port=self.port, max_sessions=c.max_sessions)
        if not self.resume_shared:
            log_event("resume_secret", level=logging.WARNING, detail="no --resume-secret: resume tokens are "
                      "signed with a random secret and resume sessions on this process only")
        if self.wyoming is not None:
            port = await self.wyoming.start(c.host, c.wyoming_port)
            if c.wyoming_zeroconf:
                await self.wyoming.advertise(c.host)
            self.wyoming_port = port
        if warm:
            await self.warm()
        return self

    async def drain(self) -> None:
        """Stop accepting, finish every open session (committed text, final, close 1001)."""
        if self.draining:
            return
        self.draining = True
        open_ = list(self.sessions)
        log_event("draining", sessions=len(open_))
        if self.server is not None:
            self.server.server.close()  # the listening socket only; sessions keep running
        if self.wyoming is not None:
            self.wyoming.stop_listening()
        for runner in open_:
            runner.interrupt("shutdown", P.CloseCode.GOING_AWAY)
        tasks = [r.task for r in open_ if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.drain_timeout)
        await self.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close(close_connections=True)
            await self.server.wait_closed()
        if self.wyoming is not None:
            await self.wyoming.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_model and hasattr(self.model, "close"):
            await asyncio.get_running_loop().run_in_executor(None, self.model.close)
        log_event("closed")
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def __aenter__(self) -> "App":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        if not self._closed.is_set():
            await self.drain()

    # -- HTTP --------------------------------------------------------------------------------
    def _route(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.partition("?")[0]
        if path == deepgram.LISTEN_PATH:
            return self._route_deepgram(request)
        if path in (LISTEN_PATH, realtime.PATH):
            refused = self._origin_refused(request)
            if refused is not None:
                return _response(403, refused + "\n")
            if self.draining:
                self.metrics.rejects.labels("draining").inc()
                return _response(503, "shutting down\n")
            if not self.ready:
                self.metrics.rejects.labels("not_ready").inc()
                return _response(503, "model loading\n")
            return None
        if path == "/healthz":
            return _response(200, "ok\n")
        if path == "/readyz":
            ok = self.accepting
            return _response(200 if ok else 503, "ready\n" if ok else "not ready\n")
        if path == "/metrics":
            return _response(200, self.metrics.text(), CONTENT_TYPE_LATEST)
        if path == MODELS_PATH:
            denied = self._authorize_http(request.headers.get("Authorization"), request.path.partition("?")[2])
            if denied is not None:
                return _response(denied.status, denied.body(), "application/json")
            return _response(200, openai_api.models_body(self.model_name), "application/json")
        if path in self._static:
            return self._page(request, *self._static[path])
        return _response(404, "not found\n")

    @property
    def full(self) -> bool:
        """Live sessions and transcription uploads together are at --max-sessions."""
        return len(self.sessions) + self.requests_open >= self.config.max_sessions

    @property
    def accepting(self) -> bool:
        """Ready for new sessions and requests: the model is warm and no drain has begun."""
        return self.ready and not self.draining

    def _origin_refused(self, request: Request) -> str | None:
        """Why a browser's Origin is refused (counted and logged), or None when it may connect:
        requests without an Origin (non-browser clients) always pass."""
        origin = request.headers.get("Origin")
        allowed = self.config.allowed_origins
        if origin is None or not allowed or origin in allowed:
            return None
        self.metrics.rejects.labels("origin").inc()
        log_event("rejected", level=logging.WARNING, reason="origin", origin=origin[:100])
        return f"Origin {origin[:100]!r} is not allowed"

    def _route_deepgram(self, request: Request) -> Response | None:
        """The Deepgram dialect refuses at the handshake, with Deepgram's HTTP error body."""
        query = request.path.partition("?")[2]
        try:
            refused = self._origin_refused(request)
            if refused is not None:
                raise deepgram.DeepgramError(403, refused, "Forbidden")
            try:
                check_token(self.config.token, request.headers.get("Authorization"), query)
            except P.ProtocolError as e:
                raise deepgram.DeepgramError(401, "missing or wrong API key; send 'Authorization: Token <key>'",
                                             "INVALID_AUTH") from e
            if not self.accepting:
                raise deepgram.DeepgramError(503, "the server is shutting down or loading; retry", "Unavailable")
            if self.full:
                raise deepgram.DeepgramError(429, f"the server is at its limit of {self.config.max_sessions} "
                                             "sessions; retry later", "TOO_MANY_REQUESTS")
            deepgram.parse_query(query, self.model.dims.languages)
        except deepgram.DeepgramError as e:
            self.metrics.rejects.labels("deepgram_" + str(e.status)).inc()
            log_event("rejected", level=logging.WARNING, reason="deepgram", status=e.status, detail=e.message)
            return _response(e.status, e.body(), "application/json")
        return None

    def _page(self, request: Request, file: Path, kind: str) -> Response:
        """A file of the captions page: its content type, a Content-Security-Policy that allows
        only the page's own files and its WebSocket, and revalidation by ETag."""
        try:
            body = file.read_bytes()
        except OSError:
            return _response(404, "not found\n")
        tag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        host = request.headers.get("Host", "").strip()
        sockets = f" ws://{host} wss://{host}" if host and all(c not in host for c in " ;,'\"") else ""
        policy = (f"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'"
                  f"{sockets}; media-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors *")
        if request.headers.get("If-None-Match") == tag:
            response = _response(304, b"", kind)
        else:
            response = _response(200, body, kind)
        del response.headers["Cache-Control"]   # websockets' Headers add a value on assignment
        response.headers["Cache-Control"] = "no-cache"
        response.headers["ETag"] = tag
        response.headers["Content-Security-Policy"] = policy
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    # -- HTTP with a body: the OpenAI-compatible transcription endpoint ----------------------
    @property
    def model_name(self) -> str:
        return getattr(self.model, "name", "whistle")

    def _authorize_http(self, authorization: str | None, query: str) -> openai_api.ApiError | None:
        try:
            check_token(self.config.token, authorization, query)
        except P.ProtocolError as e:
            self.metrics.rejects.labels(e.code.value).inc()
            return openai_api.ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <token>'",
                                       code="invalid_api_key")
        return None

    async def _http(self, request: HttpRequest, body: bytes) -> Reply:
        """A request websockets does not take (POST): the transcription endpoint, or an error."""
        path, _, query = request.path.partition("?")
        try:
            if path != TRANSCRIPTIONS_PATH:
                if request.method == "HEAD" and path in ("/healthz", "/readyz"):
                    ok = path == "/healthz" or self.accepting
                    return Reply(200 if ok else 503, b"", "text/plain; charset=utf-8")
                raise openai_api.ApiError(404 if request.method == "POST" else 405,
                                          f"no {request.method} {path[:100]}; POST {TRANSCRIPTIONS_PATH} "
                                          "transcribes a file, /v1/listen is the WebSocket")
            if request.method != "POST":
                raise openai_api.ApiError(405, f"{TRANSCRIPTIONS_PATH} takes POST")
            denied = self._authorize_http(request.headers.get("authorization"), query)
            if denied is not None:
                raise denied
            if not self.accepting:
                raise openai_api.ApiError(503, "the server is " + ("shutting down" if self.draining else
                                          "loading its model") + "; retry", type="server_error")
            form = openai_api.parse_form(request.headers.get("content-type", ""), body,
                                         self.model.dims.languages)
            if self.full:
                self.metrics.rejects.labels(P.ErrorCode.SERVER_FULL.value).inc()
                raise openai_api.ApiError(503, f"the server is at its limit of {self.config.max_sessions} "
                                          "sessions and requests; retry later", type="server_error",
                                          code="server_full")
            self.requests_open += 1
            try:
                content_type, out = await self.engine(self._transcribe_upload, form)
            finally:
                self.requests_open -= 1
            log_event("transcribed", bytes=len(form.audio), format=form.response_format)
            return Reply(200, out, content_type)
        except openai_api.ApiError as e:
            if e.status != 401:
                self.metrics.rejects.labels("http_" + str(e.status)).inc()
            headers = (("Retry-After", "1"),) if e.status == 503 else ()
            return Reply(e.status, e.body(), "application/json", headers)

    def _transcribe_upload(self, form: openai_api.TranscriptionRequest) -> tuple[str, bytes]:
        """On a worker: decode the upload, transcribe it by utterance, render the response."""
        pcm = openai_api.decode_audio(form)
        seconds = len(pcm) / self.model.dims.rate
        if seconds > self.config.max_upload_seconds:
            raise openai_api.ApiError(413, f"the file holds {seconds:.0f} s of audio; at most "
                                      f"{self.config.max_upload_seconds:g} s", param="file")
        self.metrics.audio_seconds.inc(seconds)
        try:
            result = self.model.transcribe(pcm, language=form.language, keywords=list(form.keywords) or None,
                                           word_timestamps=form.word_times)
        except ValueError as e:   # the engine refused a keyword phrase
            raise openai_api.ApiError(400, str(e)[:300], param="prompt") from e
        return openai_api.render(result, form, seconds)

    # -- WebSocket ---------------------------------------------------------------------------
    async def _handle(self, conn: ServerConnection) -> None:
        request = conn.request
        assert request is not None   # websockets hands over a connection after its handshake
        path, _, query = request.path.partition("?")
        channel = WebSocketChannel(conn)
        beta = "realtime=v1" in request.headers.get("OpenAI-Beta", "")
        # how a refusal before the session speaks: Realtime's error event, else our protocol's
        refusing: Dialect = (realtime.Dialect(self.model_name, self.model.dims.languages, audio_seconds=lambda: 0.0,
                                              beta=beta) if path == realtime.PATH else NativeDialect())
        make_dialect: Callable[[SessionCore], Dialect] = lambda core: refusing
        if self.draining:   # the handshake passed just before the drain began
            await refuse(self.metrics, channel, refusing, P.ErrorCode.SHUTTING_DOWN,
                         "the server is shutting down; reconnect")
            return
        try:
            check_token(self.config.token, request.headers.get("Authorization"), query)
        except P.ProtocolError as e:   # the token alone decides, even if other parameters are bad
            await refuse(self.metrics, channel, refusing, e.code, e.message)
            return
        if self.full:
            await refuse(self.metrics, channel, refusing, P.ErrorCode.SERVER_FULL, f"the server is at its limit of "
                         f"{self.config.max_sessions} sessions; retry later")
            return
        limits, resumable = self.limits, True
        languages = self.model.dims.languages
        try:
            if path == deepgram.LISTEN_PATH:   # checked at the handshake already (_route)
                session_config, options = deepgram.parse_query(query, languages)
                if options.end_of_speech_ms is not None:
                    limits = dataclasses.replace(limits, end_of_speech_ms=options.end_of_speech_ms)
                make_dialect = partial(_deepgram_dialect, options, self.model_name)
            elif path == realtime.PATH:
                realtime.check_query(query)
                session_config, resumable = realtime.session_config(), False
                make_dialect = partial(_realtime_dialect, self.model_name, languages, beta)
            else:
                session_config = P.parse_query(query, languages)
        except (P.ProtocolError, deepgram.DeepgramError) as e:
            code = getattr(e, "code", P.ErrorCode.BAD_REQUEST)
            # the query failed before the session's dialect was made: refused in the path's own words
            code = code if isinstance(code, P.ErrorCode) else P.ErrorCode.BAD_REQUEST
            await refuse(self.metrics, channel, refusing, code, e.message)
            return
        await self.run_session(SessionRunner(self, channel, session_config, limits, make_dialect, resumable=resumable))

    async def run_session(self, runner: SessionRunner) -> None:
        """Run one live session of any dialect, counted against --max-sessions and drained with
        the service."""
        runner.task = asyncio.current_task()
        self.sessions.add(runner)
        self.metrics.sessions_open.inc()
        try:
            await runner.run()
        finally:
            self.sessions.discard(runner)
            self.metrics.sessions_open.dec()


def _deepgram_dialect(options: deepgram.Options, model: str, core: SessionCore) -> deepgram.Dialect:
    return deepgram.Dialect(options, model, audio_seconds=lambda: core.session.audio_seconds)


def _realtime_dialect(model: str, languages, beta: bool, core: SessionCore) -> realtime.Dialect:
    return realtime.Dialect(model, languages, audio_seconds=lambda: core.session.audio_seconds, beta=beta)


# A start still warming up after this long is compiling the kernels (a first start): say so, then
# how long it has taken every COMPILE_TICK_S.
COMPILE_NOTICE_S = 3.0
COMPILE_TICK_S = 10.0


def _say_compiling(done: threading.Event) -> None:
    t0 = time.perf_counter()
    if done.wait(COMPILE_NOTICE_S):
        return
    log_event("compiling")
    while not done.wait(COMPILE_TICK_S):
        log_event("compiling", elapsed_s=round(time.perf_counter() - t0))


def limits_of(config: ServiceConfig) -> SessionLimits:
    """The per-session settings of the service's settings."""
    return SessionLimits(**{f.name: getattr(config, f.name) for f in dataclasses.fields(SessionLimits)})


def build_app(model=None, config: ServiceConfig | None = None, web_root: Path | None = None) -> App:
    """An App around `model` (None: load the configured model at start). Not started yet."""
    return App(model=model, config=config, web_root=web_root)


async def serve(model=None, config: ServiceConfig | None = None, web_root: Path | None = None) -> None:
    """Run the service until SIGTERM/SIGINT, then drain and return."""
    app = build_app(model, config, web_root)
    loop = asyncio.get_running_loop()
    await app.start(warm=False)
    def on_signal(sig: signal.Signals) -> None:
        log_event("signal", signal=sig.name)
        asyncio.ensure_future(app.drain())

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError):
            pass
    await app.warm()
    await app.wait_closed()


def main(argv=None, *, model=None, web_root: Path | None = None) -> int:
    """`whistle-stream serve ...`: parse flags (+ WHISTLE_* env), serve until SIGTERM, exit 0."""
    parser = add_serve_arguments(argparse.ArgumentParser(
        prog="whistle-stream serve", description="Serve live transcription over WebSockets."))
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    setup_logging(config.log_level, config.log_format)
    try:
        import uvloop
        run: Callable = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve(model=model, config=config, web_root=web_root))
    except (OSError, ValueError) as e:   # port in use, no model, a model file that does not parse
        log_event("startup_failed", logging.ERROR, detail=str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
