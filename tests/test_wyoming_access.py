"""Who may use the Wyoming port: the protocol has no authentication, so `--wyoming-allow` lists the
client networks it admits, a token server refuses to open it beyond loopback without that list, and
a connection from outside the list is closed before anything it sent is read. Driven by the real
`wyoming` package's client against the app on loopback."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest

from fakes import FakeWhistle
from harness.servers import free_port
from whistle_stream.service.config import ServiceConfig, admitted, networks
from whistle_stream.service.server import build_app


def test_a_token_server_opens_wyoming_beyond_loopback_only_with_an_allow_list():
    with pytest.raises(ValueError, match="--wyoming-allow listing the client networks"):
        ServiceConfig(host="0.0.0.0", token="t", wyoming_port=10300)
    ServiceConfig(host="0.0.0.0", token="t", wyoming_port=10300, wyoming_allow=("192.168.1.0/24",))
    ServiceConfig(host="127.0.0.1", token="t", wyoming_port=10300)        # loopback: only this machine
    ServiceConfig(host="0.0.0.0", wyoming_port=10300)                     # no token: today's behaviour, with a warning
    ServiceConfig(host="0.0.0.0", token="t")                              # no Wyoming port


def test_serve_refuses_to_start_and_says_why():
    done = subprocess.run([sys.executable, "-m", "whistle_stream.cli", "serve", "--host", "0.0.0.0", "--port", "0",
                           "--token", "t", "--wyoming-port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Wyoming protocol has no authentication" in done.stderr and "--wyoming-allow" in done.stderr, done.stderr


@pytest.mark.parametrize("entry", ["192.168.1.0/33", "home", "10.0.0.0/8;10.1.0.0/16"])
def test_a_bad_allow_entry_is_named_with_what_is_accepted(entry):
    with pytest.raises(ValueError, match=f"wyoming_allow entry {entry!r} is not a network; accepted: addresses"):
        ServiceConfig(wyoming_port=10300, wyoming_allow=(entry,))


def test_the_list_is_the_whole_list():
    allow = networks(("192.168.1.0/24", "fd00::/8"))
    assert admitted("192.168.1.20", allow) and admitted("fd00::5%eth0", allow)
    assert admitted("::ffff:192.168.1.20", allow)                  # IPv4 seen by a dual-stack socket
    assert not admitted("127.0.0.1", allow) and not admitted("::1", allow)     # loopback only when listed
    assert not admitted("192.168.2.1", allow) and not admitted("?", allow)


async def _describe(port: int):
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe

    try:
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Describe().event())
            return await asyncio.wait_for(client.read_event(), 10)
    except (ConnectionError, OSError):
        return None          # the server closed: a reset instead of the end of the stream


async def _transcribe(port: int):
    """Everything Home Assistant sends for one command; what came back (None: the server closed)."""
    from wyoming.asr import Transcribe
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    try:
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Transcribe(language="en").event())
            await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
            for _ in range(10):
                await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=b"\0\1" * 1024).event())
            await client.write_event(AudioStop().event())
            return await asyncio.wait_for(client.read_event(), 10)
    except (ConnectionError, OSError):
        return None          # the server closed first: the writes hit a reset


async def _app(allow: tuple[str, ...]):
    config = ServiceConfig(port=0, processes=1, workers=1, token="t", wyoming_port=free_port(), wyoming_allow=allow)
    return await build_app(model=FakeWhistle(), config=config).start()


async def test_an_address_outside_the_list_is_closed_unread_logged_and_counted(caplog):
    app = await _app(("10.0.0.0/8",))
    try:
        with caplog.at_level(logging.WARNING, logger="whistle"):
            assert await _describe(app.wyoming_port) is None
            assert await _transcribe(app.wyoming_port) is None
        assert app.metrics.sessions.labels("wyoming")._value.get() == 0       # nothing transcribed
        assert app.metrics.wyoming_refused._value.get() == 2
        assert b"whistle_wyoming_refused_connections_total 2.0" in app.metrics.text()
        refused = [r for r in caplog.records if r.getMessage() == "wyoming_refused"]
        assert len(refused) == 2, [r.getMessage() for r in caplog.records]
    finally:
        await app.drain()


async def test_a_listed_address_is_served():
    app = await _app(("127.0.0.0/8",))
    try:
        info = await _describe(app.wyoming_port)
        assert info is not None and info.type == "info"
        answer = await _transcribe(app.wyoming_port)
        assert answer is not None and answer.type in ("transcript-start", "transcript"), answer
        assert app.metrics.wyoming_refused._value.get() == 0
    finally:
        await app.drain()


async def test_without_an_allow_list_the_start_up_says_the_port_is_open(caplog):
    config = ServiceConfig(port=0, processes=1, workers=1, wyoming_port=free_port())
    with caplog.at_level(logging.WARNING, logger="whistle"):
        app = await build_app(model=FakeWhistle(), config=config).start()
    try:
        assert any(r.getMessage() == "wyoming_open" for r in caplog.records), caplog.records
    finally:
        await app.drain()


async def test_wyoming_listens_only_once_the_model_is_warm():
    """A client (Home Assistant, the add-on's health check) never meets a Wyoming server that
    cannot transcribe yet: before the warm-up the port is closed, after it `describe` answers."""
    port = free_port()
    app = await build_app(model=FakeWhistle(), config=ServiceConfig(port=0, processes=1, workers=1,
                                                                    wyoming_port=port)).start(warm=False)
    try:
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        await app.warm()
        info = await _describe(port)
        assert info is not None and info.type == "info" and app.wyoming_port == port
    finally:
        await app.drain()
