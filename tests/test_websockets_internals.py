"""The websockets internals service/http.py relies on, each named, so that an upgrade that moves
one fails here first (pyproject.toml pins the major version these tests cover)."""

from __future__ import annotations

import asyncio
import inspect
import re
import tomllib
from importlib import metadata
from pathlib import Path

import websockets
import websockets.asyncio.connection
from websockets import http11
from websockets.asyncio.server import ServerConnection
from websockets.server import ServerProtocol

from whistle_stream.service import http

ROOT = Path(__file__).resolve().parent.parent


def test_the_installed_websockets_is_inside_the_pinned_range():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["server"]
    (pin,) = [p for p in pins if p.startswith("websockets")]
    low, high = re.fullmatch(r"websockets>=(\d+)(?:\.\d+)*,<(\d+)", pin.split("#")[0].strip()).groups()
    major = int(metadata.version("websockets").split(".")[0])
    assert int(low) <= major < int(high), (pin, websockets.__version__)


def test_the_request_line_limit_is_a_module_integer_that_http_raised():
    assert isinstance(http11.MAX_LINE_LENGTH, int)
    assert http11.MAX_LINE_LENGTH >= http.MAX_REQUEST_LINE
    # read at call time by the request parser, so raising it at import takes effect
    assert "MAX_LINE_LENGTH" in inspect.getsource(http11.parse_line)


def test_the_connection_has_the_waiters_and_hooks_the_diverting_class_uses():
    async def made() -> ServerConnection:
        return ServerConnection(ServerProtocol(), server=None)   # type: ignore[arg-type]

    connection = asyncio.run(made())
    assert isinstance(connection.request_rcvd, asyncio.Future)
    assert isinstance(connection.connection_lost_waiter, asyncio.Future)
    for hook in ("data_received", "handshake", "connection_made"):
        assert callable(getattr(ServerConnection, hook, None)), hook
    # the transport the diverting class swaps for an inert one is the attribute websockets writes to
    assert "self.transport = transport" in inspect.getsource(websockets.asyncio.connection.Connection.connection_made)
