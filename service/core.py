"""One live session's behaviour, without I/O: the core every transport drives.

    core = SessionCore(model, P.parse_query(query), SessionLimits(), session_id="abc")
    messages = core.open()                 # [Ready]; the engine stream is open
    messages = core.audio(frame_bytes)     # [Committed | Partial ...]
    messages = core.control(text_frame)    # [Committed | Partial | Final | Error ...]
    messages = core.finish("close")        # [... Final]

The core decodes and resamples audio, runs the VAD and the engine's silence gate (only at the
start of an utterance), schedules passes through the engine, ends utterances at end of speech,
maps engine times back to session times, enforces the session's limits and returns the ordered
server messages of `protocol.Session`. It never sleeps, reads a socket or starts a thread.

A transport that must not block while the engine works splits each call in two: `receive(frame)`
is cheap (decode, check, limits, VAD) and returns typed work items; `execute(items)` runs them
through the engine (on a worker thread) and returns the messages. `audio`, `control` and
`finish` are exactly `execute(receive(...))`. Timeouts, back-pressure and capacity stay with the
transport (`service.server`, `whistle-listen --local`).
"""

from __future__ import annotations

import hmac
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence
from urllib.parse import parse_qsl

import numpy as np

from . import protocol as P
from .audio import AudioPath, Chunk, EndOfSpeech, TimeMap


# ---------------------------------------------------------------------------------------------
# What the core needs of the engine

class EngineDims(Protocol):
    languages: Sequence[str]
    rate: int


class EngineStream(Protocol):
    """`whistle_stream.streaming.StreamSession`'s surface."""

    passes: int

    def feed(self, audio: np.ndarray) -> dict: ...
    def finalize(self) -> dict: ...
    def finish(self) -> dict: ...
    def configure(self, keywords=None) -> None: ...


class Engine(Protocol):
    """`whistle_stream.Whistle`'s surface."""

    name: str
    dims: EngineDims

    def open_stream(self, language: str | None = None, keywords=None, step_s: float = 1.0) -> EngineStream: ...
    def is_speech(self, pcm: np.ndarray) -> bool: ...
    def warmup(self) -> float: ...


class Observer(Protocol):
    """Where the core reports what a transport measures (metrics); every method is optional."""

    def audio(self, seconds: float) -> None: ...
    def passes(self, count: int, seconds_each: float) -> None: ...
    def commit_latency(self, seconds: float) -> None: ...


class _NoObserver:
    def audio(self, seconds: float) -> None:
        pass

    def passes(self, count: int, seconds_each: float) -> None:
        pass

    def commit_latency(self, seconds: float) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Settings and work items

@dataclass(frozen=True)
class SessionLimits:
    """The per-session part of the service settings (`ServiceConfig.limits()`)."""

    step_s: float = 1.0                      # engine step
    max_session_seconds: float = 4 * 3600.0  # audio seconds one session may send
    control_rate: float = 10.0               # control messages per second (token bucket refill)
    control_burst: int = 20                  # ... and bucket size
    vad_aggressiveness: int = 2              # webrtcvad 0..3
    end_of_speech_ms: int = 600              # trailing non-speech that ends an utterance


@dataclass(frozen=True)
class Feed:
    """Speech for the engine, in order."""
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class SpeechEnded:
    """The VAD heard the end of an utterance."""
    at: float


@dataclass(frozen=True)
class FinalizeNow:
    """The client asked to commit everything received so far."""


@dataclass(frozen=True)
class Reconfigure:
    keywords: tuple[str, ...]


@dataclass(frozen=True)
class FinishNow:
    """The session ends: commit everything, then `final` with this reason."""
    reason: str


Work = Feed | SpeechEnded | FinalizeNow | Reconfigure | FinishNow


@dataclass(frozen=True)
class Received:
    """What one client frame asks for: work for the engine, and whether the client closed."""
    work: tuple[Work, ...] = ()
    close: bool = False


class TokenBucket:
    """`rate` tokens a second up to `burst`; `take()` spends one if there is one."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = float(burst)
        self.at = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


def check_token(expected: str | None, authorization: str | None, query: str = "") -> None:
    """The auth decision: pass when no token is required, or when the `Authorization: Bearer`
    (or Deepgram's `Token`) header, else the raw query string's `token`, equals it. The token alone decides, before the
    other parameters are parsed. Raises ProtocolError(unauthorized)."""
    if expected is None:
        return
    scheme, _, value = (authorization or "").partition(" ")
    given = value.strip() if scheme.lower() in ("bearer", "token") and value.strip() else None
    if given is None:
        given = next((v for k, v in parse_qsl(query, keep_blank_values=True) if k == "token"), None)
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        raise P.ProtocolError(P.ErrorCode.UNAUTHORIZED, "missing or wrong token; send "
                              "'Authorization: Bearer <token>' or ?token=<token>")


# ---------------------------------------------------------------------------------------------
# The core

class SessionCore:
    """One session over a shared engine. Not thread-safe: `receive` may run on one thread and
    `execute` on another, but each of them one call at a time, in order."""

    def __init__(self, engine: Engine, config: P.SessionConfig, limits: SessionLimits = SessionLimits(),
                 *, session_id: str = "local", observer: Observer | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engine, self.config, self.limits = engine, config, limits
        self.session = P.Session(session_id, config, engine.name, engine.dims.languages)
        self.observer = observer or _NoObserver()
        self.clock = clock
        self.path = AudioPath(config.sample_rate, step_s=limits.step_s, vad=config.vad,
                              aggressiveness=limits.vad_aggressiveness,
                              end_of_speech_ms=limits.end_of_speech_ms)
        self.time_map = TimeMap()
        self.bucket = TokenBucket(limits.control_rate, limits.control_burst, clock)
        self.stream: EngineStream | None = None
        self.failed = False            # the engine raised: no more engine calls
        self._utterance_fed = False    # audio of the current utterance reached the engine
        self._passes_seen = 0
        self._arrivals: deque = deque()  # (session seconds received so far, clock time)

    # -- plain calls -------------------------------------------------------------------------
    def open(self) -> list[P.ServerMessage]:
        """Open the engine stream; returns [Ready]. Raises ProtocolError(bad_request) when the
        engine refuses the language or a keyword."""
        c = self.config
        try:
            self.stream = self.engine.open_stream(language=c.language, keywords=list(c.keywords) or None,
                                                  step_s=self.limits.step_s)
        except ValueError as e:
            raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, str(e)[:300]) from e
        self._passes_seen = self.stream.passes
        return [self.session.ready()]

    def audio(self, data: bytes) -> list[P.ServerMessage]:
        """A binary frame -> the messages it produced. Raises ProtocolError."""
        return self.execute(self.receive(data).work)

    def control(self, text: str) -> list[P.ServerMessage]:
        """A text frame -> the messages it produced. Raises ProtocolError."""
        return self.execute(self.receive(text).work)

    def finish(self, reason: str) -> list[P.ServerMessage]:
        """End the session: everything committed, then `final` with `reason`."""
        return self.execute(self.end(reason))

    # -- the cheap half ----------------------------------------------------------------------
    def receive(self, frame: bytes | str) -> Received:
        """A client frame -> work for the engine. Raises ProtocolError (bad audio, a bad or
        rate-limited control message, the audio limit, a message out of order)."""
        if isinstance(frame, (bytes, bytearray, memoryview)):
            return Received(self._receive_audio(bytes(frame)))
        if not self.bucket.take():
            raise P.ProtocolError(P.ErrorCode.RATE_LIMITED, f"more than {self.limits.control_rate:g} "
                                  "control messages per second")
        message = self.session.check(P.decode_text(frame))
        if isinstance(message, P.Finalize):
            return Received((*self._events(self.path.flush()), FinalizeNow()))
        if isinstance(message, P.Configure):
            return Received((Reconfigure(message.keywords),))
        return Received(close=isinstance(message, P.Close))

    def end(self, reason: str) -> tuple[Work, ...]:
        """The session ends (the client closed, a limit, a timeout, shutdown): the work that
        commits what is left and answers `final`."""
        self.session.closing()
        return (*self._events(self.path.flush(last=True)), FinishNow(reason))

    def _receive_audio(self, data: bytes) -> tuple[Work, ...]:
        samples = P.decode_audio(data, self.config.encoding)
        self.session.check(P.Audio(data))
        seconds = self.session.audio_seconds
        self.observer.audio(len(samples) / self.config.sample_rate)
        self._arrivals.append((seconds, self.clock()))
        limit = self.limits.max_session_seconds
        if seconds > limit:
            raise P.ProtocolError(P.ErrorCode.SESSION_LIMIT, f"this session reached its limit of "
                                  f"{limit:g} audio seconds")
        return self._events(self.path.push(samples))

    @staticmethod
    def _events(events) -> tuple[Work, ...]:
        out: list[Work] = []
        for event in events:
            if isinstance(event, Chunk):
                if out and isinstance(out[-1], Feed):
                    out[-1] = Feed(out[-1].chunks + (event,))
                else:
                    out.append(Feed((event,)))
            elif isinstance(event, EndOfSpeech):
                out.append(SpeechEnded(event.at))
        return tuple(out)

    # -- the engine half ---------------------------------------------------------------------
    def execute(self, work: Sequence[Work]) -> list[P.ServerMessage]:
        """Run work items through the engine, in order; consecutive feeds become one engine call
        (a backlog is caught up in one pass schedule). Engine errors propagate, and mark the core
        failed: a transport then ends the session with `internal`."""
        out: list[P.ServerMessage] = []
        pending: list[Chunk] = []
        try:
            for item in work:
                if isinstance(item, Feed):
                    pending.extend(item.chunks)
                    continue
                if pending:
                    out += self._feed(pending)
                    pending = []
                out += self._run(item)
            if pending:
                out += self._feed(pending)
        except Exception:
            self.failed = True
            raise
        return out

    def _run(self, item: Work) -> list[P.ServerMessage]:
        if isinstance(item, SpeechEnded):
            if not self._utterance_fed:
                return []
            self._utterance_fed = False
            return self._publish(self.stream.finalize(), end_of_speech=True)
        if isinstance(item, FinalizeNow):
            return self._publish(self.stream.finalize(), final="finalize")
        if isinstance(item, Reconfigure):
            try:
                self.stream.configure(keywords=list(item.keywords))
            except ValueError as e:   # the engine refused a keyword: the old ones stay
                return [P.Error(P.ErrorCode.BAD_MESSAGE, str(e)[:300])]
            return []
        if isinstance(item, FinishNow):
            return self._publish(self.stream.finish(), final=item.reason)
        raise TypeError(f"not a work item: {item!r}")

    def _feed(self, chunks: list[Chunk]) -> list[P.ServerMessage]:
        if not self._utterance_fed and self.config.vad:
            # §8: the engine's gate judges an utterance's first audio; later chunks of an
            # utterance that has begun always reach the engine (a quiet word inside a sentence).
            first = next((i for i, c in enumerate(chunks) if self.engine.is_speech(c.audio)), None)
            if first is None:
                return []
            chunks = chunks[first:]
        for c in chunks:
            self.time_map.add(c)
        self._utterance_fed = True
        audio = chunks[0].audio if len(chunks) == 1 else np.concatenate([c.audio for c in chunks])
        return self._publish(self.stream.feed(audio))

    def _publish(self, d: dict, *, end_of_speech: bool = False, final: str | None = None) -> list[P.ServerMessage]:
        passes = self.stream.passes - self._passes_seen
        self._passes_seen = self.stream.passes
        if passes:
            self.observer.passes(passes, float(d.get("pass_ms", 0.0)) / 1000 / passes)
        d = dict(d, words=[dict(w, start=self.time_map(w["start"]), end=self.time_map(w["end"]))
                           for w in d.get("words", ())])
        now = self.clock()
        for w in d["words"]:
            arrived = self._arrived(w["end"])
            if arrived is not None:
                self.observer.commit_latency(max(0.0, now - arrived))
        if final is None:
            return self.session.results(d, end_of_speech=end_of_speech, passes=passes)
        return self.session.final(d, final, passes=passes)

    def _arrived(self, t: float) -> float | None:
        """Clock time at which session second `t` had been received (None: not known)."""
        while len(self._arrivals) > 1 and self._arrivals[1][0] < t - 5.0:
            self._arrivals.popleft()   # keep a few seconds before the oldest word still to commit
        for seconds, at in self._arrivals:
            if seconds >= t:
                return at
        return self._arrivals[-1][1] if self._arrivals else None
