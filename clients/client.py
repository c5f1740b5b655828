"""A small async client for the /v1/listen protocol (docs/protocol.md).

    async with ListenClient("ws://127.0.0.1:8000", language="en") as client:
        await client.send_audio(pcm_float32_16k)          # or raw bytes in the session encoding
        final = await client.close()                       # commits everything, returns Final
        print(final.text)

Messages arrive as typed `service.protocol` dataclasses through `async for m in client` (or are
collected in `client.messages` when `close()`/`finalize()` wait for their `final`).

Sessions resume by default (`resume=True`): the client keeps the audio after the latest
`replay_from` (`ReplayBuffer`, at most `REPLAY_LIMIT_S` seconds), and when the connection drops
(network errors, or close codes 1001, 1006, 1011, 1012, 1013) it reconnects with backoff using
the latest resume token, replays that audio, and carries on: the caller sees one stream of
`committed` messages whose seq runs on without gaps or repeats. If the server stops settling
audio (replay_from stays behind for longer than the limit), the oldest audio is dropped; a resume
that then needs it is impossible, and the client continues in a new session from the audio it
still has (words in the dropped stretch are lost; seq and word times still run on).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from urllib.parse import urlencode, urlsplit

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.typing import Origin

from whistle_stream.service import protocol as P


class ClientError(Exception):
    """A failure the user can act on; `str(e)` says what happened and what to do."""


class ServerUnreachable(ClientError):
    pass


class AuthFailed(ClientError):
    pass


class SessionEnded(ClientError):
    """The server closed the session; `code` is the close code, `error` its last error message."""

    def __init__(self, message: str, code: int | None = None, error: P.Error | None = None):
        super().__init__(message)
        self.code, self.error = code, error


RETRYABLE_CLOSE = {P.CloseCode.GOING_AWAY, P.CloseCode.TRY_AGAIN, 1006}
RESUMABLE_CLOSE = {P.CloseCode.GOING_AWAY, 1006, P.CloseCode.INTERNAL, 1012, P.CloseCode.TRY_AGAIN}
REPLAY_LIMIT_S = 35.0   # audio kept for a replay: a 30 s utterance buffer and some margin
REPLAY_FRAME_S = 1.0    # replayed audio goes out in frames of this many seconds


class ReplayBuffer:
    """The session's audio (in its encoding) from the latest settled point on, bounded."""

    def __init__(self, sample_rate: int, width: int, limit_s: float = REPLAY_LIMIT_S):
        self.rate, self.width = sample_rate, width
        self.limit = int(limit_s * sample_rate) * width
        self.start = 0          # byte offset in the session's audio of data[0]
        self.data = bytearray()

    @property
    def end(self) -> int:
        return self.start + len(self.data)

    @property
    def seconds(self) -> float:
        return len(self.data) / self.width / self.rate

    def add(self, data: bytes) -> None:
        self.data += data
        over = len(self.data) - self.limit
        if over > 0:   # the server has not settled this much: keep the newest audio only
            self.settle_bytes(self.start + over)

    def settle(self, seconds: float) -> None:
        """Audio before `seconds` of the session is settled: drop it."""
        self.settle_bytes(int(round(seconds * self.rate)) * self.width)

    def settle_bytes(self, offset: int) -> None:
        drop = min(len(self.data), max(0, offset - self.start))
        if drop:
            del self.data[:drop]
            self.start += drop

    def since(self, seconds: float) -> bytes | None:
        """The audio from `seconds` on, or None when some of it was dropped already."""
        offset = int(round(seconds * self.rate)) * self.width
        if offset < self.start:
            return None
        return bytes(self.data[offset - self.start:])


def check_server_url(server: str) -> str:
    """A server URL as the client uses it: ws://, wss://, http:// or https:// with a host (and
    port). Raises ClientError saying what is accepted."""
    parts = urlsplit(server.strip())
    try:
        parts.port   # raises ValueError for a port that is not a number
        port_ok = True
    except ValueError:
        port_ok = False
    if not port_ok or parts.scheme not in ("ws", "wss", "http", "https") or not parts.hostname:
        raise ClientError(f"the server must be a URL like ws://127.0.0.1:8000 (ws, wss, http or https "
                          f"with a host), got {server!r}")
    return server.strip()


def listen_url(server: str, *, sample_rate: int = P.DEFAULT_SAMPLE_RATE, encoding: str = "pcm_s16le",
               language: str | None = None, keywords=(), token: str | None = None,
               vad: bool = True) -> str:
    """The /v1/listen URL with its query parameters. Raises ClientError for a malformed server URL."""
    base = check_server_url(server).rstrip("/")
    if base.startswith("http"):
        base = "ws" + base[4:]
    if not base.endswith("/v1/listen"):
        base += "/v1/listen"
    params = [("sample_rate", str(sample_rate)), ("encoding", encoding)]
    if language:
        params.append(("language", language))
    params += [("keyword", k) for k in keywords]
    if token:
        params.append(("token", token))
    if not vad:
        params.append(("vad", "false"))
    return base + "?" + urlencode(params)


def to_pcm(audio, encoding: str = "pcm_s16le") -> bytes:
    """float32 samples in [-1, 1] (or bytes, passed through) -> the session encoding's bytes."""
    if isinstance(audio, (bytes, bytearray, memoryview)):
        return bytes(audio)
    audio = np.asarray(audio, dtype=np.float32)
    if encoding == "pcm_f32le":
        return audio.astype("<f4").tobytes()
    return (np.clip(audio, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()


class ListenClient:
    def __init__(self, server: str = "ws://127.0.0.1:8000", *, sample_rate: int = P.DEFAULT_SAMPLE_RATE,
                 encoding: str = "pcm_s16le", language: str | None = None, keywords=(),
                 token: str | None = None, vad: bool = True, origin: str | None = None,
                 retries: int = 0, backoff: float = 0.5, max_backoff: float = 8.0,
                 open_timeout: float = 10.0, on_retry=None, resume: bool = True, resume_retries: int = 10,
                 on_reconnect=None):
        self.server = server
        self.encoding = encoding
        self.url = listen_url(server, sample_rate=sample_rate, encoding=encoding, language=language,
                              keywords=keywords, vad=vad)
        self.resume, self.resume_retries = resume, resume_retries
        self.on_reconnect = on_reconnect   # on_reconnect(error | None): reconnecting (error), back (None)
        self.replay = ReplayBuffer(sample_rate, P.ENCODINGS[encoding])
        self.resume_token: str | None = None
        self.seq = 0                # the last seq handed to the caller
        self._seq_offset = 0        # a session started afresh after a failed resume: its seq and
        self._time_offset = 0.0     # ... times continue the earlier ones'
        self._generation = 0
        self._recovering = asyncio.Lock()
        self._close_sent = False
        self.reconnects = 0
        self.token = token
        self.origin = origin
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.open_timeout = open_timeout
        self.on_retry = on_retry   # on_retry(attempt, retries, delay_s, error): a retry is coming
        self.ws: ClientConnection | None = None
        self.ready: P.Ready | None = None
        self.messages: list[P.ServerMessage] = []   # every message received, in order
        self.committed: list[P.Committed] = []
        self.last_error: P.Error | None = None

    # -- connection --------------------------------------------------------------------------
    async def connect(self) -> P.Ready:
        """Open a session and wait for `ready`, retrying with exponential backoff + jitter.

        Raises ServerUnreachable (no server, or one not ready yet), AuthFailed (4401: wrong token),
        SessionEnded, or ClientError for what no retry mends (a wrong URL or path).
        """
        attempt = 0
        while True:
            try:
                return await self._connect_once()
            except (ServerUnreachable, SessionEnded) as e:
                retryable = isinstance(e, ServerUnreachable) or e.code in RETRYABLE_CLOSE
                if not retryable or attempt >= self.retries:
                    raise
                error = e
            attempt += 1
            delay = self._backoff_delay(attempt)
            if self.on_retry is not None:
                self.on_retry(attempt, self.retries, delay, error)
            await asyncio.sleep(delay)

    def _backoff_delay(self, attempt: int) -> float:
        """Exponential backoff with jitter: seconds before retry `attempt` (1, 2, ...)."""
        return min(self.max_backoff, self.backoff * 2 ** (attempt - 1)) * (0.75 + 0.5 * random.random())

    @property
    def _ws(self) -> ClientConnection:
        """The open connection (every use comes after `connect`)."""
        if self.ws is None:
            raise ClientError("not connected: call connect() first")
        return self.ws

    async def _connect_once(self, resume: str | None = None) -> P.Ready:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        url = self.url if resume is None else self.url.split("?")[0] + "?" + urlencode({"resume": resume})
        try:
            self.ws = await connect(url, additional_headers=headers, origin=Origin(self.origin) if self.origin else None,
                                    open_timeout=self.open_timeout, max_size=2 ** 22)
        except InvalidStatus as e:
            status = e.response.status_code
            body = e.response.body.decode("utf-8", "replace").strip()
            if status == 403:
                raise ClientError(f"the server refused this origin: {body}") from e
            if status == 404:
                raise ClientError(f"{self.server} has no /v1/listen (HTTP 404): check the URL, which should be "
                                  "the server's address such as ws://127.0.0.1:8000") from e
            if status in (502, 503, 504):   # loading, draining, or a balancer with no replica ready
                raise ServerUnreachable(f"{self.server} answered HTTP {status}: {body}") from e
            raise ClientError(f"{self.server} refused the session (HTTP {status}): {body}") from e
        except InvalidURI as e:
            raise ClientError(f"the server must be a URL like ws://127.0.0.1:8000, got {self.server!r}") from e
        except (OSError, asyncio.TimeoutError, InvalidHandshake) as e:   # refused, timed out, cut mid-handshake
            raise ServerUnreachable(f"cannot reach {self.server}: {e.__class__.__name__}: {e} "
                                    "(is `whistle-stream serve` running?)") from e
        message = await self._receive_plain()
        while isinstance(message, P.Error):   # refused: the close code that follows says why
            self.last_error = message
            message = await self._receive_plain()    # raises AuthFailed / SessionEnded at the close
        if not isinstance(message, P.Ready):
            raise SessionEnded(f"expected ready, got {P.encode(message)}")
        if self.ready is None:
            self.messages.append(message)
            self.ready = message
        return message

    async def _receive_plain(self) -> P.ServerMessage:
        try:
            return P.decode_server(await self._ws.recv())
        except ConnectionClosed as e:
            raise self._ended(e) from e

    @staticmethod
    def _close_code(e: ConnectionClosed) -> int:
        """The close code the server sent; 1006 when the connection dropped without one."""
        return e.rcvd.code if e.rcvd is not None else 1006

    def _ended(self, e: ConnectionClosed) -> ClientError:
        code = self._close_code(e)
        if code == P.CloseCode.UNAUTHORIZED:
            return AuthFailed("authentication failed: the server rejected the token "
                              "(pass --token or set WHISTLE_TOKEN)")
        detail = f": {self.last_error.code.value}: {self.last_error.message}" if self.last_error else ""
        return SessionEnded(f"the server closed the session (code {code}){detail}", code, self.last_error)

    async def receive(self) -> P.ServerMessage:
        """The next server message. Raises SessionEnded/AuthFailed when the session closed (and
        could not be resumed)."""
        while True:
            generation = self._generation
            try:
                text = await self._ws.recv()
            except ConnectionClosed as e:
                if not self._resumable(e):
                    raise self._ended(e) from e
                await self._recover(generation, e)
                continue
            message = self._adopt(P.decode_server(text))
            if message is None:
                continue
            self.messages.append(message)
            if isinstance(message, P.Committed):
                self.committed.append(message)
            elif isinstance(message, P.Error):
                self.last_error = message
            return message

    # -- resume ------------------------------------------------------------------------------
    def _resumable(self, e: ConnectionClosed) -> bool:
        return self.resume and self.ready is not None and self._close_code(e) in RESUMABLE_CLOSE

    def _adopt(self, message: P.ServerMessage) -> P.ServerMessage | None:
        """A message as the caller sees it (None: not for the caller): the resume token taken,
        seq and times carried across fresh sessions, a drain's `final` and error swallowed when
        the session will resume."""
        if isinstance(message, (P.Committed, P.Final)) and message.resume:
            self.resume_token = message.resume
            self.replay.settle(message.replay_from or 0.0)
        if self.resume and not self._close_sent and (
                (isinstance(message, P.Final) and message.reason == "shutdown")
                or (isinstance(message, P.Error) and message.code is P.ErrorCode.SHUTTING_DOWN)):
            return None
        if isinstance(message, P.Committed):
            if self._seq_offset or self._time_offset:
                shift = self._time_offset
                message = dataclasses.replace(
                    message, seq=message.seq + self._seq_offset,
                    words=tuple(dataclasses.replace(w, start=w.start + shift, end=w.end + shift)
                                for w in message.words))
            if message.seq <= self.seq:
                return None   # already delivered (the server replayed a commit)
            self.seq = message.seq
        elif isinstance(message, P.Final):
            message = dataclasses.replace(message, seq=message.seq + self._seq_offset)
        return message

    async def _recover(self, generation: int, error: Exception) -> None:
        """Reconnect after a drop: resume with the latest token and replay, or start afresh from
        the audio still held. One recovery at a time; a caller that saw an older connection fail
        waits for the recovery in progress."""
        async with self._recovering:
            if self._generation != generation:
                return
            if self.on_reconnect is not None:
                self.on_reconnect(error)
            attempt = 0
            while True:
                try:
                    await self._reopen()
                    break
                except AuthFailed:
                    raise
                except (ServerUnreachable, SessionEnded) as e:
                    retryable = isinstance(e, ServerUnreachable) or e.code in RESUMABLE_CLOSE
                    if isinstance(e, SessionEnded) and e.code == P.CloseCode.BAD_RESUME:
                        self.resume_token = None     # the token is no good: start afresh
                    elif not retryable or attempt >= self.resume_retries:
                        raise
                attempt += 1
                delay = self._backoff_delay(attempt)
                if self.on_retry is not None:
                    self.on_retry(attempt, self.resume_retries, delay, error)
                await asyncio.sleep(delay)
            self.reconnects += 1
            self._generation += 1
            if self.on_reconnect is not None:
                self.on_reconnect(None)

    async def _reopen(self) -> None:
        ready = await self._connect_once(resume=self.resume_token)
        if ready.resumed:
            audio = self.replay.since(ready.replay_from)
            if audio is None:    # dropped already: this session cannot continue; start afresh
                await self._ws.close()
                self.resume_token = None
                ready = await self._connect_once(resume=None)
        if not ready.resumed:
            # A new session hears the audio still held, from its start: seq and times run on.
            self._seq_offset, self._time_offset = self.seq, self.replay.start / self.replay.width / self.replay.rate
            audio = bytes(self.replay.data)
        step = int(REPLAY_FRAME_S * self.replay.rate) * self.replay.width
        assert audio is not None   # resumed with the audio still held, or a new session sent it all
        for i in range(0, len(audio), step):
            await self._ws.send(audio[i:i + step])
        if self._close_sent:
            await self._ws.send(json.dumps({"type": "close"}))

    def __aiter__(self):
        return self

    async def __anext__(self) -> P.ServerMessage:
        try:
            return await self.receive()
        except SessionEnded as e:
            if e.code == P.CloseCode.NORMAL:
                raise StopAsyncIteration
            raise

    async def __aenter__(self) -> "ListenClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        if self.ws is not None:
            await self.ws.close()

    # -- sending -----------------------------------------------------------------------------
    async def send_audio(self, audio) -> None:
        """Send float32 samples at the session rate (or bytes already in the session encoding)."""
        data = to_pcm(audio, self.encoding)
        if self.resume:
            self.replay.add(data)
        generation = self._generation
        try:
            await self._ws.send(data)
        except ConnectionClosed as e:
            if not self._resumable(e):
                raise self._ended(e) from e
            await self._recover(generation, e)   # the replay includes this frame

    async def _send_json(self, obj: dict) -> None:
        if obj.get("type") == "close":
            self._close_sent = True
        generation = self._generation
        try:
            await self._ws.send(json.dumps(obj))
        except ConnectionClosed as e:
            if not self._resumable(e):
                raise self._ended(e) from e
            await self._recover(generation, e)   # a close is sent again after the replay

    async def keepalive(self) -> None:
        await self._send_json({"type": "keepalive"})

    async def configure(self, keywords) -> None:
        await self._send_json({"type": "configure", "keywords": list(keywords)})

    async def request_close(self) -> None:
        """Send `close` without waiting: the `final` and the close arrive through `receive()`."""
        await self._send_json({"type": "close"})

    async def _until_final(self) -> P.Final:
        while True:
            message = await self.receive()
            if isinstance(message, P.Final):
                return message

    async def finalize(self) -> P.Final:
        """Commit everything sent so far and wait for the `final`; the session stays open."""
        await self._send_json({"type": "finalize"})
        return await self._until_final()

    async def close(self) -> P.Final:
        """Commit everything, wait for the `final` and the server's close."""
        await self.request_close()
        final = await self._until_final()
        await self._ws.wait_closed()
        return final

    @property
    def transcript(self) -> str:
        """The text of every `committed` received, across resumes."""
        return "".join(c.text for c in self.committed)

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.committed)
