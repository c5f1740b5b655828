"""One live session's transport around its `SessionCore`, whatever carries its frames.

    runner = SessionRunner(app, WebSocketChannel(conn), config, make_dialect=lambda core: NativeDialect())
    await runner.run()

A `Channel` moves frames (a WebSocket, or a Wyoming connection's events); a dialect translates
them to the core's messages and the core's messages back (our own protocol, Deepgram, Wyoming,
OpenAI Realtime). The runner owns the rest, the same for every dialect: one engine call in flight
per session, the bounded send queue, the idle timeout, slow clients, the drain's interrupt.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from typing import Any, Callable, Protocol

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from whistle_stream import allocator

from . import protocol as P
from .core import Feed, FinishNow, SessionCore, SessionLimits, Work
from .observe import MetricsObserver, log_event


class ChannelClosed(Exception):
    """The peer is gone: nothing more can be read or sent."""


class Channel(Protocol):
    async def recv(self) -> Any: ...                 # the next client frame; raises ChannelClosed
    async def send(self, item: Any) -> None: ...     # one outgoing frame; raises ChannelClosed
    async def close(self, code: int | None, reason: str) -> None: ...   # the session is over
    def abort(self) -> None: ...                     # drop the connection at once (a slow client)


class WebSocketChannel:
    """A websockets server connection as a `Channel`."""

    def __init__(self, conn: ServerConnection):
        self.conn = conn

    async def recv(self):
        try:
            return await self.conn.recv()
        except ConnectionClosed as e:
            raise ChannelClosed() from e

    async def send(self, item) -> None:
        try:
            await self.conn.send(item)
        except ConnectionClosed as e:
            raise ChannelClosed() from e

    async def close(self, code: int | None, reason: str) -> None:
        try:
            await self.conn.close(code if code is not None else P.CloseCode.NORMAL, reason[:60])
        except ConnectionClosed:
            pass

    def abort(self) -> None:
        if self.conn.transport is not None:
            self.conn.transport.abort()


class Dialect(Protocol):
    name: str
    turn_over: bool   # the dialect decided the turn is over: the session ends as if the client closed it

    def incoming(self, frame: Any) -> Any: ...       # a frame -> a core frame, or a P.DialectInput
    def outgoing(self, message: P.ServerMessage) -> list: ...   # a core message -> frames to send
    def speech_started(self, at: float) -> list: ...             # the VAD heard speech begin


class NativeDialect:
    """Our own protocol (/v1/listen): frames pass through, messages go out as their JSON."""

    name = "native"
    turn_over = False

    def incoming(self, frame):
        return frame

    def outgoing(self, message: P.ServerMessage) -> list:
        return [P.encode(message)]

    def speech_started(self, at: float) -> list:
        return []


class SessionRunner:
    """One session's transport around its `SessionCore`, on the event loop.

    receive: frames -> dialect.incoming -> core.receive (cheap) -> work queue
    worker:  queued work, one executor call at a time -> core.execute -> outgoing queue
    sender:  outgoing queue -> channel (bounded; a client that does not read is disconnected)

    `app` is the service (`server.App`): its engine pool, model, settings, metrics and resume
    secret. `make_dialect(core)` makes the session's `Dialect` (given the core, for a dialect that
    reads the session's counters; default: our protocol). `resumable`: sessions of this dialect
    get resume tokens.
    """

    def __init__(self, app, channel: Channel, config: P.SessionConfig, limits: SessionLimits | None = None,
                 make_dialect: Callable[[SessionCore], Dialect] | None = None, resumable: bool = True):
        self.app, self.channel, self.config = app, channel, config
        self.id = uuid.uuid4().hex[:12]
        self.core = SessionCore(app.model, config, limits or app.limits, session_id=self.id,
                                observer=MetricsObserver(app.metrics),
                                resume_secret=app.resume_secret if resumable else None,
                                resume_ttl=app.config.resume_ttl)
        self.dialect: Dialect = make_dialect(self.core) if make_dialect is not None else NativeDialect()
        self.task = asyncio.current_task()
        c = app.config
        self._work: deque[Work] = deque()
        self._wake = asyncio.Event()
        self._outgoing: asyncio.Queue = asyncio.Queue(maxsize=c.send_queue)
        self._interrupt = asyncio.get_running_loop().create_future()
        self._slow = False

    @property
    def session(self) -> P.Session:
        return self.core.session

    # -- control -----------------------------------------------------------------------------
    def interrupt(self, reason: str, close_code: int, error: P.Error | None = None) -> None:
        """End the session from outside the receive loop (shutdown, engine failure, slow client)."""
        if not self._interrupt.done():
            self._interrupt.set_result((reason, close_code, error))

    def _log(self, event: str, level: int = logging.INFO, **fields) -> None:
        log_event(event, level, session=self.id, **fields)

    def _emit(self, messages) -> None:
        self._put(frame for m in messages for frame in self.dialect.outgoing(m))
        self._end_of_turn()

    def _end_of_turn(self) -> None:
        """The dialect ended the turn (Wyoming: our VAD heard its end): the session closes now, as
        if the client had closed it, and the final answer goes out without waiting for it."""
        if self.dialect.turn_over:
            self.interrupt("end_of_turn", P.CloseCode.NORMAL)

    def _put(self, texts) -> None:
        for text in texts:
            try:
                self._outgoing.put_nowait(text)
            except asyncio.QueueFull:
                self._disconnect_slow("send queue full")
                return

    def _disconnect_slow(self, why: str) -> None:
        if self._slow:
            return
        self._slow = True
        self.app.metrics.rejects.labels(P.ErrorCode.SLOW_CLIENT.value).inc()
        self._log("slow_client", logging.WARNING, detail=why)
        self.interrupt("slow_client", P.CloseCode.POLICY)
        self.channel.abort()

    def _queue(self, work) -> None:
        if work:
            self._work.extend(work)
            self._wake.set()

    # -- tasks -------------------------------------------------------------------------------
    async def run(self) -> None:
        c = self.config
        resuming = c.resume is not None
        try:
            ready = await self.app.engine(self.core.open)
        except P.ProtocolError as e:     # a bad resume token, or the engine refused the language or a keyword
            if resuming:
                self.app.metrics.resumes.labels("refused").inc()
            await refuse(self.app.metrics, self.channel, self.dialect, e.code, e.message)
            return
        except Exception:
            self._log("open_failed", logging.ERROR, exc_info=True)
            await refuse(self.app.metrics, self.channel, self.dialect, P.ErrorCode.INTERNAL,
                         "the engine could not open a stream")
            return
        if resuming:
            self.app.metrics.resumes.labels("resumed").inc()
            self.id = self.core.session.session_id
            self._log("session_resumed", seq=ready[0].seq, replay_from=ready[0].replay_from)
        self.app.metrics.sessions.labels(self.dialect.name).inc()
        self._log("session_open", dialect=self.dialect.name, sample_rate=c.sample_rate, encoding=c.encoding,
                  vad=c.vad, language=c.language, keywords=len(c.keywords))
        sender = asyncio.create_task(self._send_loop())
        self._emit(ready)
        worker = asyncio.create_task(self._work_loop())
        try:
            reason, close_code, error = await self._receive_loop()
            await self._end(reason, close_code, error, worker, sender)
        finally:
            for t in (worker, sender):
                t.cancel()
            self._log("session_closed", audio_seconds=round(self.session.audio_seconds, 3),
                      passes=self.session.passes, committed=self.session.seq)
            allocator.release()   # what the session's threads freed goes back to the system

    async def _receive_loop(self):
        """Read frames until the session should end; returns (reason, close code, error message)."""
        idle = self.app.config.idle_timeout
        while True:
            recv = asyncio.ensure_future(self.channel.recv())
            done, _ = await asyncio.wait({recv, self._interrupt}, timeout=idle,
                                         return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                if self._interrupt.done():
                    return self._interrupt.result()
                self.app.metrics.rejects.labels(P.ErrorCode.IDLE_TIMEOUT.value).inc()
                return ("idle_timeout", P.CloseCode.POLICY,
                        P.Error(P.ErrorCode.IDLE_TIMEOUT, f"no frame for {idle:g} s"))
            try:
                frame = recv.result()
            except ChannelClosed:
                return ("disconnected", None, None)
            try:
                given = self.dialect.incoming(frame)
                if not isinstance(given, P.DialectInput):
                    given = P.DialectInput(messages=(given,))
                self._put(given.replies)
                for message in given.messages:
                    received = self.core.receive(message)
                    self._put(out for item in received.work if isinstance(item, Feed) for c in item.chunks
                              if c.first for out in self.dialect.speech_started(c.start))
                    self._end_of_turn()
                    self._queue(received.work)
                    if received.close:
                        return ("close", P.CloseCode.NORMAL, None)
            except P.ProtocolError as e:
                self.app.metrics.rejects.labels(e.code.value).inc()
                self._log("protocol_error", logging.WARNING, code=e.code.value, detail=e.message)
                error = P.Error(e.code, e.message)
                if e.fatal:
                    return (e.code.value, e.close_code, error)
                self._emit([error])
            except Exception:   # a dialect's bug on a strange frame: logged, the frame refused, the session goes on
                self._log("dialect_error", logging.ERROR, exc_info=True)
                self.app.metrics.rejects.labels(P.ErrorCode.BAD_MESSAGE.value).inc()
                self._emit([P.Error(P.ErrorCode.BAD_MESSAGE, "this frame could not be read; it was dropped")])

    async def _end(self, reason, close_code, error, worker, sender) -> None:
        work = self.core.end(reason)
        if reason in ("disconnected", "slow_client"):
            return
        # Keep reading (and dropping) what the client still sends: unread frames would stall the
        # closing handshake behind them.
        discard = asyncio.create_task(self._discard())
        if error is not None:
            self._emit([error])
        if not self.core.failed:
            self._queue(work)
            await worker
        if self.core.failed:
            if reason != P.ErrorCode.INTERNAL.value:
                self._emit([P.Error(P.ErrorCode.INTERNAL, "the engine failed on this session")])
            close_code = P.CloseCode.INTERNAL
        try:
            self._outgoing.put_nowait(None)  # the sender stops after what is queued
            await asyncio.wait_for(sender, self.app.config.send_timeout)
        except (asyncio.QueueFull, asyncio.TimeoutError):
            pass
        await self.channel.close(close_code, reason)
        discard.cancel()

    async def _discard(self) -> None:
        try:
            while True:
                await self.channel.recv()
        except ChannelClosed:
            pass

    async def _send_loop(self) -> None:
        timeout = self.app.config.send_timeout
        while True:
            text = await self._outgoing.get()
            if text is None:
                return
            try:
                await asyncio.wait_for(self.channel.send(text), timeout)
            except asyncio.TimeoutError:
                self._disconnect_slow(f"a send blocked for {timeout:g} s")
                return
            except ChannelClosed:
                return

    async def _work_loop(self) -> None:
        """Queued work in order, everything queued so far in one executor call (a backlog is
        caught up at once), one call at a time for this session."""
        try:
            while True:
                while not self._work:
                    self._wake.clear()
                    await self._wake.wait()
                batch = list(self._work)
                self._work.clear()
                self._emit(await self.app.engine(self.core.execute, batch))
                if any(isinstance(item, FinishNow) for item in batch):
                    return
        except Exception:
            self._log("engine_error", logging.ERROR, exc_info=True)
            self.app.metrics.rejects.labels(P.ErrorCode.INTERNAL.value).inc()
            self.interrupt(P.ErrorCode.INTERNAL.value, P.CloseCode.INTERNAL,
                           P.Error(P.ErrorCode.INTERNAL, "the engine failed on this session"))



async def refuse(metrics, channel: Channel, dialect: Dialect, code: P.ErrorCode, message: str) -> None:
    """Refuse a session before or as it opens: the dialect's error, then the channel closed with the
    code's close code."""
    metrics.rejects.labels(code.value).inc()
    log_event("rejected", level=logging.WARNING, reason=code.value, dialect=dialect.name, detail=message)
    try:
        for frame in dialect.outgoing(P.Error(code, message)):
            await channel.send(frame)
    except ChannelClosed:
        pass
    await channel.close(P.FATAL_ERRORS.get(code, P.CloseCode.POLICY), code.value)
