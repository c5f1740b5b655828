"""Requests with a body (POST) on the WebSocket server's port, one exchange per connection, and the
request line's length limit.

websockets answers GET requests itself (the handshake, and `process_request` for health, metrics,
the page and /v1/models), but refuses any request with a body. `diverting(handler)` gives
`websockets.serve` a connection class that looks at the first bytes of each connection: a GET goes
on to websockets as before; any other method is handed to an `Exchange`, which reads one HTTP/1.1
request with h11 (bounded in bytes and time), awaits `handler(request, body)` and writes its
`Reply`, then closes the connection.

websockets has no documented API for either, so this module is the one place that reaches into
its internals (`ServerConnection.request_rcvd`, `.connection_lost_waiter`, `.transport`,
`http11.MAX_LINE_LENGTH`); pyproject.toml pins websockets to the major version the tests cover,
and tests/test_websockets_internals.py fails first, by name, when one of them moves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import h11
from websockets import http11 as websockets_http11
from websockets.asyncio.server import ServerConnection

from .openai_api import ApiError

log = logging.getLogger("whistle.service")

# A request line holds the query; one with an over-long resume token should reach
# protocol.parse_query, which refuses it with bad_resume, instead of websockets' bare HTTP 414 at 8 KB.
MAX_REQUEST_LINE = 32 * 1024
websockets_http11.MAX_LINE_LENGTH = max(websockets_http11.MAX_LINE_LENGTH, MAX_REQUEST_LINE)


@dataclass(frozen=True)
class Request:
    method: str
    path: str                      # with the query string
    headers: dict[str, str]        # lower-case names


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = field(default_factory=tuple)


Handler = Callable[[Request, bytes], Awaitable[Reply]]


class _Inert:
    """Stands in for the transport in the websockets connection once the socket is handed over."""

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return True

    def get_extra_info(self, name, default=None):
        return default


class Exchange(asyncio.Protocol):
    """One HTTP/1.1 request and its reply over a transport taken from websockets."""

    def __init__(self, transport: asyncio.Transport, handler: Handler, max_body: int, timeout: float):
        self.transport, self.handler, self.max_body = transport, handler, max_body
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        self.request: Request | None = None
        self.body = bytearray()
        self.task: asyncio.Task | None = None
        self.timer = asyncio.get_running_loop().call_later(timeout, self._timeout)

    def data_received(self, data: bytes) -> None:
        if self.task is not None:
            return   # the request is complete; anything after it is ignored (one exchange a connection)
        try:
            self.conn.receive_data(data)
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                if isinstance(event, h11.Request):
                    self.request = Request(event.method.decode(), event.target.decode("ascii", "replace"),
                                           {k.decode().lower(): v.decode("latin-1") for k, v in event.headers})
                    size = self.request.headers.get("content-length")
                    if size is not None and size.isdecimal() and int(size) > self.max_body:
                        self._reply(Reply(413, _error(f"the body is {int(size)} bytes; at most {self.max_body}")))
                        return
                elif isinstance(event, h11.Data):
                    self.body += event.data
                    if len(self.body) > self.max_body:
                        self._reply(Reply(413, _error(f"the body is over {self.max_body} bytes")))
                        return
                elif isinstance(event, h11.EndOfMessage):
                    self.task = asyncio.ensure_future(self._handle())
                    return
                elif isinstance(event, h11.ConnectionClosed):
                    self.transport.close()
                    return
        except h11.RemoteProtocolError as e:
            self._reply(Reply(400, _error(f"not a valid HTTP/1.1 request: {e}")))

    def connection_lost(self, exc) -> None:
        self.timer.cancel()
        if self.task is not None:
            self.task.cancel()

    def _timeout(self) -> None:
        if self.task is None:
            self._reply(Reply(408, _error("the request did not arrive in time")))

    async def _handle(self) -> None:
        assert self.request is not None   # handled once the whole request has arrived
        try:
            reply = await self.handler(self.request, bytes(self.body))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("http_handler_failed")
            reply = Reply(500, _error("the server failed on this request", "server_error"))
        self._reply(reply)

    def _reply(self, reply: Reply) -> None:
        self.timer.cancel()
        if self.transport.is_closing():
            return
        headers = [("Content-Type", reply.content_type), ("Content-Length", str(len(reply.body))),
                   ("Connection", "close"), ("Server", "whistle-stream"), *reply.headers]
        try:
            out = self.conn.send(h11.Response(status_code=reply.status, headers=headers))
            out += self.conn.send(h11.Data(data=reply.body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:   # the request was malformed before h11 saw a whole one
            out = (f"HTTP/1.1 {reply.status} Error\r\nContent-Type: {reply.content_type}\r\n"
                   f"Content-Length: {len(reply.body)}\r\nConnection: close\r\n\r\n").encode() + reply.body
        self.transport.write(out)
        self.transport.close()


def _error(message: str, kind: str = "invalid_request_error") -> bytes:
    """The error body of the only endpoint that takes a body (OpenAI's shape)."""
    return ApiError(0, message, type=kind).body()


def diverting(handler: Handler, max_body: int, timeout: float) -> type[ServerConnection]:
    """A ServerConnection class for `websockets.serve(create_connection=...)` that hands requests
    other than GET to `handler` (see the module docstring)."""

    class DivertingConnection(ServerConnection):
        _diverted = False
        _sniffed = False

        def data_received(self, data: bytes) -> None:
            if not self._sniffed:
                self._sniffed = True
                if not data.startswith(b"GET ") and data[:1].isalpha() and b" " in data[:16]:
                    self._divert(data)
                    return
            super().data_received(data)

        def _divert(self, data: bytes) -> None:
            transport = self.transport
            exchange = Exchange(transport, handler, max_body, timeout)
            transport.set_protocol(exchange)
            self._diverted = True
            self.transport = _Inert()  # type: ignore[assignment]  # websockets' own timeouts now abort nothing
            if not self.request_rcvd.done():
                self.request_rcvd.set_result(None)
            exchange.data_received(data)

        async def handshake(self, *args, **kwargs) -> None:
            await asyncio.wait([self.request_rcvd, self.connection_lost_waiter],
                               return_when=asyncio.FIRST_COMPLETED)
            if self._diverted:
                return
            await super().handshake(*args, **kwargs)

    return DivertingConnection
