"""HTTP on the WebSocket port: health, readiness, metrics, the captions page, the models list and
the OpenAI-compatible upload endpoint; and the checks that refuse a WebSocket at its handshake.

    routes = Routes(app, web_root)
    ws_serve(..., process_request=routes.get, create_connection=diverting(routes.post, ...))

`get` answers what websockets reads (GET, and the upgrade: None lets the upgrade go on); `post`
answers the requests `service.http` diverts (POST, HEAD). `app` is the service (`server.App`).
"""

from __future__ import annotations

import hashlib
import http
from pathlib import Path

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from . import deepgram, openai_api, realtime
from . import protocol as P
from .core import check_token
from .handshake import admission, deepgram_refusal, origin_refused
from .http import Reply, Request as HttpRequest
from .observe import log_event

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


def response(status: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8") -> Response:
    body = body.encode() if isinstance(body, str) else body
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store"), ("Connection", "close")])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def page(request: Request, file: Path, kind: str) -> Response:
    """A file of the captions page: its content type, a Content-Security-Policy that allows only
    the page's own files and its WebSocket, and revalidation by ETag."""
    try:
        body = file.read_bytes()
    except OSError:
        return response(404, "not found\n")
    tag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    host = request.headers.get("Host", "").strip()
    sockets = f" ws://{host} wss://{host}" if host and all(c not in host for c in " ;,'\"") else ""
    policy = (f"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'"
              f"{sockets}; media-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors *")
    out = response(304, b"", kind) if request.headers.get("If-None-Match") == tag else response(200, body, kind)
    del out.headers["Cache-Control"]   # websockets' Headers add a value on assignment
    out.headers["Cache-Control"] = "no-cache"
    out.headers["ETag"] = tag
    out.headers["Content-Security-Policy"] = policy
    out.headers["X-Content-Type-Options"] = "nosniff"
    return out


class Routes:
    """The service's HTTP answers. `web_root`: the captions page's folder, or None for no page."""

    def __init__(self, app, web_root: Path | None = None):
        self.app = app
        self.static = ({} if web_root is None else
                       {path: (Path(web_root) / name, kind) for path, (name, kind) in STATIC.items()})

    def get(self, connection: ServerConnection, request: Request) -> Response | None:
        """A GET, or a WebSocket upgrade (None: let it go on)."""
        app = self.app
        path = request.path.partition("?")[0]
        if path == deepgram.LISTEN_PATH:
            refused = deepgram_refusal(app, request)
            return None if refused is None else response(refused.status, refused.body(), "application/json")
        if path in (LISTEN_PATH, realtime.PATH):
            origin = origin_refused(app, request)
            if origin is not None:
                return response(403, origin + "\n")
            # the token and capacity are refused inside the session, as the protocol's error message
            error = admission(app, None, "", authorize=False)
            if error is not None and error.code != P.ErrorCode.SERVER_FULL:
                app.metrics.rejects.labels("draining" if app.draining else "not_ready").inc()
                return response(503, error.message + "\n")
            return None
        if path == "/healthz":
            return response(200, "ok\n")
        if path == "/readyz":
            ok = app.accepting
            return response(200 if ok else 503, "ready\n" if ok else "not ready\n")
        if path == "/metrics":
            return response(200, app.metrics.text(), CONTENT_TYPE_LATEST)
        if path == MODELS_PATH:
            try:
                check_token(app.config.token, request.headers.get("Authorization"), request.path.partition("?")[2])
            except P.ProtocolError as e:
                denied = _openai_refusal(app, e)
                return response(denied.status, denied.body(), "application/json")
            return response(200, openai_api.models_body(app.model_name), "application/json")
        if path in self.static:
            return page(request, *self.static[path])
        return response(404, "not found\n")

    async def post(self, request: HttpRequest, body: bytes) -> Reply:
        """A request websockets does not take (POST, HEAD): the transcription endpoint, or an error."""
        app = self.app
        path, _, query = request.path.partition("?")
        try:
            if path != TRANSCRIPTIONS_PATH:
                if request.method == "HEAD" and path in ("/healthz", "/readyz"):
                    ok = path == "/healthz" or app.accepting
                    return Reply(200 if ok else 503, b"", "text/plain; charset=utf-8")
                raise openai_api.ApiError(404 if request.method == "POST" else 405,
                                          f"no {request.method} {path[:100]}; POST {TRANSCRIPTIONS_PATH} "
                                          "transcribes a file, /v1/listen is the WebSocket")
            if request.method != "POST":
                raise openai_api.ApiError(405, f"{TRANSCRIPTIONS_PATH} takes POST")
            refused = admission(app, request.headers.get("authorization"), query)
            if refused is not None:   # counted by its code, not its status
                return _reply(_openai_refusal(app, refused))
            form = openai_api.parse_form(request.headers.get("content-type", ""), body, app.model.dims.languages)
            app.requests_open += 1
            try:
                content_type, out = await app.engine(self._transcribe, form)
            finally:
                app.requests_open -= 1
            log_event("transcribed", bytes=len(form.audio), format=form.response_format)
            return Reply(200, out, content_type)
        except openai_api.ApiError as e:
            app.metrics.rejects.labels("http_" + str(e.status)).inc()
            return _reply(e)

    def _transcribe(self, form: openai_api.TranscriptionRequest) -> tuple[str, bytes]:
        """On a worker: decode the upload, transcribe it by utterance, render the response."""
        app = self.app
        pcm = openai_api.decode_audio(form)
        seconds = len(pcm) / app.model.dims.rate
        if seconds > app.config.max_upload_seconds:
            raise openai_api.ApiError(413, f"the file holds {seconds:.0f} s of audio; at most "
                                      f"{app.config.max_upload_seconds:g} s", param="file")
        app.metrics.audio_seconds.inc(seconds)
        try:
            result = app.model.transcribe(pcm, language=form.language, keywords=list(form.keywords) or None,
                                          word_timestamps=form.word_times)
        except ValueError as e:   # the engine refused a keyword phrase
            raise openai_api.ApiError(400, str(e)[:300], param="prompt") from e
        return openai_api.render(result, form, seconds)


def _reply(error: openai_api.ApiError) -> Reply:
    headers = (("Retry-After", "1"),) if error.status == 503 else ()
    return Reply(error.status, error.body(), "application/json", headers)


def _openai_refusal(app, error: P.ProtocolError) -> openai_api.ApiError:
    """The admission rule's refusal in OpenAI's words (counted by its code)."""
    app.metrics.rejects.labels(error.code.value).inc()
    if error.code == P.ErrorCode.UNAUTHORIZED:
        return openai_api.ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <token>'",
                                   code="invalid_api_key")
    return openai_api.ApiError(503, error.message, type="server_error", code=error.code.value)
