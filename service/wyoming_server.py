"""The Wyoming server: Home Assistant's speech-to-text over TCP, in the same process as the
WebSocket service, sharing its model, capacity, limits, metrics and drain.

    whistle-stream serve --wyoming-port 10300 [--wyoming-zeroconf]

One connection may run several transcriptions, one after another; each is a session of the
service (`runner.SessionRunner` with `wyoming.Dialect`), counted against --max-sessions.
Events are read here with limits the `wyoming` package's reader lacks (a header line, its data
and its payload each bounded), so that a malformed or oversized event gets an `error` event naming
what was wrong instead of a silent disconnect or an unbounded read; they are written with the
package's own `async_write_event`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
from typing import Any

from wyoming.asr import Transcribe
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.event import Event, async_write_event
from wyoming.info import Describe
from wyoming.ping import Ping, Pong

from . import protocol as P
from . import wyoming as W
from .config import admitted, networks
from .params import model_language
from .handshake import admission
from .observe import log_event
from .runner import ChannelClosed, SessionRunner

MAX_HEADER_BYTES = 16 * 1024      # one event's JSON header line
MAX_DATA_BYTES = 64 * 1024        # its data block
SERVICE_TYPE = "_wyoming._tcp.local."


class FramingError(Exception):
    """The byte stream is not Wyoming events: the connection cannot go on after it."""


async def read_event(reader: asyncio.StreamReader, max_payload: int) -> Event | None:
    """The next event, or None at the end of the stream. Raises FramingError."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise FramingError("the connection ended inside an event header") from e
    except asyncio.LimitOverrunError as e:
        raise FramingError(f"an event header longer than {MAX_HEADER_BYTES} bytes") from e
    try:
        header = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise FramingError(f"an event header that is not JSON: {line[:60]!r}") from e
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise FramingError('an event header is a JSON object with a string "type"')
    data = header.get("data") or {}
    data_length, payload_length = header.get("data_length") or 0, header.get("payload_length") or 0
    for name, value, limit in (("data_length", data_length, MAX_DATA_BYTES),
                               ("payload_length", payload_length, max_payload)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise FramingError(f"{name} {value!r} is not accepted; 0 to {limit} bytes")
    if not isinstance(data, dict):
        raise FramingError("an event's data is a JSON object")
    try:
        if data_length:
            extra = json.loads(await reader.readexactly(data_length))
            if not isinstance(extra, dict):
                raise FramingError("an event's data is a JSON object")
            data = {**data, **extra}
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError as e:
        raise FramingError("the connection ended inside an event") from e
    except (ValueError, RecursionError) as e:
        raise FramingError("an event's data block is not JSON") from e
    return Event(type=header["type"], data=data, payload=payload)


class Connection:
    """One TCP connection: describe, ping, and transcriptions one after another. It is also the
    `runner.Channel` of the transcription it is running: the runner reads that transcription's
    events from here and writes its answers through `send`."""

    def __init__(self, server: "WyomingServer", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server, self.app = server, server.app
        self.reader, self.writer = reader, writer
        self.lock = asyncio.Lock()
        self.language: str | None = None
        self.silence_ms: int | None = None          # the next transcription's end of speech (None: the service's)
        self.events: asyncio.Queue | None = None    # the running transcription's events
        self.session: asyncio.Task | None = None
        self.gone = False

    # -- runner.Channel ----------------------------------------------------------------------
    async def recv(self) -> Any:
        queue = self.events
        if queue is None:
            raise ChannelClosed()
        event = await queue.get()
        if event is None:
            raise ChannelClosed()
        return event

    async def send(self, event: Event) -> None:
        if self.gone:
            raise ChannelClosed()
        try:
            async with self.lock:
                await async_write_event(event, self.writer)
        except (ConnectionError, OSError) as e:
            self.gone = True
            raise ChannelClosed() from e

    async def close(self, code: int | None, reason: str) -> None:
        """The transcription is over (the connection stays open for the next one)."""
        queue, self.events = self.events, None
        if queue is not None:
            queue.put_nowait(None)

    def abort(self) -> None:
        self.gone = True
        self.writer.transport.abort()

    # -- the connection ----------------------------------------------------------------------
    async def error(self, code: P.ErrorCode, message: str) -> None:
        self.app.metrics.rejects.labels(code.value).inc()
        log_event("rejected", level=logging.WARNING, reason=code.value, dialect="wyoming", detail=message)
        try:
            await self.send(W.error_event(code, message))
        except ChannelClosed:
            pass

    async def run(self) -> None:
        max_payload = self.app.config.max_frame_bytes
        try:
            while not self.gone:
                try:
                    event = await read_event(self.reader, max_payload)
                except FramingError as e:
                    await self.error(P.ErrorCode.BAD_MESSAGE, str(e))
                    break
                if event is None:
                    break
                await self.handle(event)
        except (ConnectionError, OSError):
            pass
        finally:
            self.gone = True
            await self.close(None, "disconnected")
            if self.session is not None:
                await asyncio.gather(self.session, return_exceptions=True)
            self.writer.close()

    async def handle(self, event: Event) -> None:
        if self.session is not None:
            if not self.session.done():
                if self.events is not None:
                    self.events.put_nowait(event)
                if AudioStop.is_type(event.type):   # answered before the next event is read
                    await asyncio.gather(self.session, return_exceptions=True)
                    self.session = None
                return
            if AudioChunk.is_type(event.type):
                return   # the transcription ended early (its error was sent): its audio is dropped up to its stop
            self.session = None
            if AudioStop.is_type(event.type):
                return
        if Describe.is_type(event.type):
            await self.send(self.server.info())
        elif Ping.is_type(event.type):
            await self.send(Pong(text=Ping.from_event(event).text).event())
        elif Transcribe.is_type(event.type):
            try:
                language = model_language((event.data or {}).get("language"), self.app.model.dims.languages)
            except ValueError as e:
                await self.error(P.ErrorCode.BAD_REQUEST, str(e))
                return
            try:
                silence_ms = W.check_sensitivity((event.data or {}).get("vad_sensitivity"))
            except P.ProtocolError as e:
                await self.error(e.code, e.message)
                return
            self.language = language
            self.silence_ms = silence_ms
        elif AudioStart.is_type(event.type):
            await self.start(event)
        elif AudioChunk.is_type(event.type) or AudioStop.is_type(event.type):
            await self.error(P.ErrorCode.NOT_READY, f"{event.type} before audio-start")
        else:
            await self.error(P.ErrorCode.UNKNOWN_TYPE, f"unknown event type {event.type[:40]!r}; accepted: describe, "
                             "ping, transcribe, audio-start, audio-chunk, audio-stop")

    async def start(self, event: Event) -> None:
        app = self.app
        try:
            audio = W.Format.of(event)
        except P.ProtocolError as e:
            await self.error(e.code, e.message)
            return
        refused = admission(app, None, "", authorize=False)   # Wyoming has no credentials
        if refused is not None:
            await self.error(refused.code, refused.message)
            return
        # a transcribe names the next transcription only
        language, silence_ms, self.language, self.silence_ms = self.language, self.silence_ms, None, None
        limits = app.limits if silence_ms is None else dataclasses.replace(app.limits, end_of_speech_ms=silence_ms)
        end_of_turn = app.config.wyoming_end_of_turn
        self.events = asyncio.Queue()
        runner = SessionRunner(app, self, W.session_config(audio, language), limits,
                               make_dialect=lambda core: W.Dialect(audio, language, end_of_turn), resumable=False)
        self.session = asyncio.ensure_future(app.run_session(runner))


class WyomingServer:
    """The TCP listener, started and stopped with the app."""

    def __init__(self, app):
        self.app = app
        self.server: asyncio.base_events.Server | None = None
        self.port: int | None = None
        self.connections: set[asyncio.Task] = set()
        self._zeroconf = None
        self.allow = networks(app.config.wyoming_allow)   # empty: any address

    def info(self) -> Event:
        app = self.app
        languages = app.model.dims.languages
        if app.demo_model:
            about = (f"whistle-stream's demo model ({', '.join(languages)}): it hears only its own command "
                     "vocabulary (numbers, times, timers, lights, calls, reminders) in synthetic voices; "
                     "for real voices run Whistle")
        else:
            about = f"Whistle, Cactus Compute's speech-to-text model ({', '.join(languages)})"
        return W.info_event(app.model_name, languages, app.version, about, app.config.wyoming_end_of_turn)

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._connection, host, port, limit=MAX_HEADER_BYTES)
        self.port = self.server.sockets[0].getsockname()[1]
        log_event("wyoming_listening", host=host, port=self.port, allow=[str(n) for n in self.allow])
        if not self.allow:
            log_event("wyoming_open", level=logging.WARNING, host=host, port=self.port,
                      detail="the Wyoming port has no authentication: whoever reaches it transcribes "
                             "(--wyoming-allow admits only the networks it lists)")
        return self.port

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self.allow and not admitted(address, self.allow):
            # closed before any event is read: nothing the client sent is looked at
            self.app.metrics.wyoming_refused.inc()
            log_event("wyoming_refused", level=logging.WARNING, peer=address,
                      detail="the address is outside --wyoming-allow")
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None   # a connection is served by its own task
        self.connections.add(task)
        try:
            await Connection(self, reader, writer).run()
        finally:
            self.connections.discard(task)

    async def advertise(self, host: str) -> None:
        """`_wyoming._tcp.local.` over mDNS (zeroconf), as Wyoming servers announce themselves."""
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

        address = host if host not in ("0.0.0.0", "", "::") else _local_address()
        name = f"whistle-stream-{socket.gethostname()[:40]}"
        info = AsyncServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=self.port,
                                addresses=[socket.inet_aton(address)], properties={"version": self.app.version})
        self._zeroconf = AsyncZeroconf(interfaces=[address], ip_version=IPVersion.V4Only)
        await self._zeroconf.async_register_service(info)
        log_event("wyoming_zeroconf", service=f"{name}.{SERVICE_TYPE}", address=address, port=self.port)

    def stop_listening(self) -> None:
        if self.server is not None:
            self.server.close()

    async def close(self) -> None:
        self.stop_listening()
        if self._zeroconf is not None:
            await self._zeroconf.async_unregister_all_services()
            await self._zeroconf.async_close()
        for task in list(self.connections):
            task.cancel()
        if self.connections:
            await asyncio.gather(*self.connections, return_exceptions=True)


def _local_address() -> str:
    """This host's address on the default route (for the mDNS record of a server on 0.0.0.0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("224.0.0.251", 5353))   # no packet is sent: a UDP connect only picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
