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
transport (`service.runner` for every dialect, `whistle-listen --local`).
"""

from __future__ import annotations

import dataclasses
import hmac
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence
from urllib.parse import parse_qsl

import numpy as np

from whistle_stream.results import KernelPath, StreamUpdate, Warmup
from whistle_stream.rules import CONTEXT_PAUSE_S

from . import protocol as P
from . import resume as R
from .config import DEFAULTS
from .params import model_language
from .audio import AudioPath, Chunk, EndOfSpeech, TimeMap


# ---------------------------------------------------------------------------------------------
# What the core needs of the engine

class EngineDims(Protocol):
    languages: Sequence[str]
    rate: int


class EngineStream(Protocol):
    """`whistle_stream.streaming.StreamSession`'s surface."""

    passes: int

    def feed(self, audio: np.ndarray, catch_up: bool = False) -> StreamUpdate: ...
    # JSON-able; "buffer_start" and "received": stream samples at the model's rate; compact: smaller,
    # without the last pass's reading
    def checkpoint(self, compact: bool = False) -> dict: ...
    # audio: the utterance's last audio, fed first, its passes left to the finalize
    # keep_context: the VAD ended the utterance, not the speaker's sentence (the passes after it
    # still read words that stop mid-sentence)
    def finalize(self, audio: np.ndarray | None = None, keep_context: bool = False) -> StreamUpdate: ...
    def finish(self, audio: np.ndarray | None = None) -> StreamUpdate: ...
    def configure(self, keywords=None) -> None: ...


class Engine(Protocol):
    """`whistle_stream.Whistle`'s surface."""

    name: str
    dims: EngineDims

    def open_stream(self, language: str | None = None, keywords=None, step_s: float = 1.0,
                    beams: int | None = None) -> EngineStream: ...
    def restore_stream(self, state: dict, keywords=None, beams: int | None = None) -> EngineStream: ...
    def is_speech(self, pcm: np.ndarray) -> bool: ...
    def warmup(self) -> Warmup: ...
    def kernel_path(self) -> KernelPath: ...


class Observer(Protocol):
    """Where the core reports what a transport measures (metrics); every method is optional."""

    def audio(self, seconds: float) -> None: ...
    def passes(self, count: int, seconds_each: float) -> None: ...
    def commit_latency(self, seconds: float) -> None: ...
    def replayed(self, seconds: float) -> None: ...
    def caught_up(self) -> None: ...


class _NoObserver:
    def audio(self, seconds: float) -> None:
        pass

    def passes(self, count: int, seconds_each: float) -> None:
        pass

    def commit_latency(self, seconds: float) -> None:
        pass

    def replayed(self, seconds: float) -> None:
        pass

    def caught_up(self) -> None:
        pass


# A live session whose oldest audio waiting for the engine was whole this long ago has fallen
# behind: its next engine call skips the passes a later one reads again (`SessionCore._behind`).
CATCH_UP_LAG_S = 1.0
# Audio arriving at most this much ahead of the wall clock since the session's first frame is live
# (a microphone's frames, give or take network jitter); a client sending faster is not, so a file
# sent at once is read with a pass per step however busy the server is.
LIVE_SLACK_S = 0.5


# ---------------------------------------------------------------------------------------------
# Settings and work items

@dataclass(frozen=True)
class SessionLimits:
    """The per-session part of the service settings (`server.limits_of(ServiceConfig)`); each
    default and its meaning are ServiceConfig's field of the same name."""

    step_s: float = DEFAULTS.step_s
    max_session_seconds: float = DEFAULTS.max_session_seconds
    control_rate: float = DEFAULTS.control_rate
    control_burst: int = DEFAULTS.control_burst
    vad_aggressiveness: int = DEFAULTS.vad_aggressiveness
    end_of_speech_ms: int = DEFAULTS.end_of_speech_ms
    language: str | None = DEFAULTS.language     # of a session that names none
    keywords: tuple[str, ...] = DEFAULTS.keywords
    beams: int = DEFAULTS.beams


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
class Reopen:
    """The session's settings changed before its first audio (`protocol.Retune`): a new engine
    stream with this language (None: detected) and these keywords."""
    language: str | None
    keywords: tuple[str, ...]


@dataclass(frozen=True)
class FinishNow:
    """The session ends: commit everything, then `final` with this reason (suspend: commit
    nothing more; the session resumes elsewhere)."""
    reason: str
    suspend: bool = False


@dataclass(frozen=True)
class Mark:
    """The audio path's state after the frame whose work comes before it: once that work has run,
    engine and path agree, and the resume tokens of the messages it made are sealed here."""
    path: dict


Work = Feed | SpeechEnded | FinalizeNow | Reconfigure | Reopen | FinishNow | Mark


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
                 clock: Callable[[], float] = time.monotonic, resume_secret: bytes | None = None,
                 resume_ttl: float = R.DEFAULT_TTL_S, wall_clock: Callable[[], float] = time.time):
        self.engine, self.config, self.limits = engine, config, limits
        self.session = P.Session(session_id, config, engine.name, engine.dims.languages,
                                 getattr(engine, "note", None))
        self.observer = observer or _NoObserver()
        self.clock = clock
        self.rate = engine.dims.rate      # the model's samples per second: engine sample counts -> seconds
        self.path = self._new_path()
        self.time_map = TimeMap(self.rate)
        self.bucket = TokenBucket(limits.control_rate, limits.control_burst, clock)
        self.stream: EngineStream | None = None
        self.failed = False            # the engine raised: no more engine calls
        self._utterance_fed = False    # audio of the current utterance reached the engine
        self._said_until: float | None = None  # session seconds where the audio fed last ended
        self._passes_seen = 0
        # (session seconds received so far, clock time): appended by the cheap half (the event
        # loop's thread), read by the engine half (a pool thread), so always under the lock
        self._arrivals: deque = deque()
        self._arrivals_lock = threading.Lock()
        self._pace: tuple[float, float] | None = None  # (session seconds, clock) where live audio began
        self.resume_secret, self.resume_ttl, self.wall_clock = resume_secret, resume_ttl, wall_clock
        self.resumed = False
        self.replay_from = 0.0      # where the client's replay starts (a resumed session)
        self._replay_until = 0.0    # ... and where the audio the earlier session had ends

    # -- plain calls -------------------------------------------------------------------------
    def open(self) -> list[P.ServerMessage]:
        """Open the engine stream; returns [Ready]. Raises ProtocolError(bad_request) when the
        engine refuses the language or a keyword."""
        c = self.config
        if c.resume is not None:
            self._resume(c.resume)
            return [self.session.ready(resumed=True, replay_from=self.replay_from)]
        try:
            self.stream = self._open_stream(c.language, c.keywords)
        except ValueError as e:
            raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, str(e)[:300]) from e
        self._passes_seen = self.stream.passes
        return [self.session.ready()]

    def _open_stream(self, language: str | None, keywords: tuple[str, ...]) -> EngineStream:
        """The engine stream of a session's language and keywords, the service's where it named none."""
        lim = self.limits
        return self.engine.open_stream(language=language or lim.language, keywords=list(keywords or lim.keywords) or None,
                                       step_s=lim.step_s, beams=lim.beams)

    def _new_path(self) -> AudioPath:
        c, lim = self.config, self.limits
        return AudioPath(c.sample_rate, rate=self.rate, step_s=lim.step_s, vad=c.vad,
                         aggressiveness=lim.vad_aggressiveness, end_of_speech_ms=lim.end_of_speech_ms)

    # -- resume ------------------------------------------------------------------------------
    def _token_state(self, path: dict, compact: bool = False) -> dict:
        """Everything a fresh core needs to continue this session (no audio), with the audio
        path as `path` (the state that matches the engine's); compact: the engine's smaller
        checkpoint."""
        c, engine = self.config, self._live.checkpoint(compact=compact)
        buffer_s, received_s = engine["buffer_start"] / self.rate, engine["received"] / self.rate
        refill = self.time_map.session_ranges(buffer_s, received_s)
        start = min([a for a, _ in refill] + [AudioPath.replay_start(path, self.rate)])
        return {"sid": self.session.session_id,
                "cfg": [c.sample_rate, c.encoding, c.language, list(self.session.keywords), c.vad],
                "seq": self.session.seq, "lang": self.session.language, "step": self.limits.step_s,
                "from": start, "fed": self._utterance_fed, "engine": engine, "path": path,
                "time": self.time_map.state(buffer_s), "refill": refill}

    def token(self, path: dict) -> tuple[str | None, float | None]:
        """(resume token, replay_from seconds) for the session as it stands, with the audio path
        as `path`, or (None, None) without a secret. A state too large for a token drops the last
        pass's hypothesis (the resumed stream then waits one pass longer to agree)."""
        if self.resume_secret is None or self.stream is None:
            return None, None
        state = self._token_state(path)
        token = R.seal(state, self.resume_secret, self.wall_clock(), self.resume_ttl)
        if token is None:
            state = self._token_state(path, compact=True)
            token = R.seal(state, self.resume_secret, self.wall_clock(), self.resume_ttl)
        return token, state["from"] / self.rate

    def _resume(self, token: str) -> None:
        if self.resume_secret is None:
            raise P.ProtocolError(P.ErrorCode.BAD_RESUME, "this server does not resume sessions")
        state = R.unseal(token, self.resume_secret, self.wall_clock())
        try:
            rate, encoding, language, keywords, vad = state["cfg"]
            given = self.config.given
            mine = {"sample_rate": rate, "encoding": encoding, "language": language, "vad": vad}
            for name, value in mine.items():
                if name in given and getattr(self.config, name) != value:
                    raise P.ProtocolError(P.ErrorCode.BAD_RESUME, f"resume token refused: {name} "
                                          f"{getattr(self.config, name)!r} differs from the session's {value!r}")
            if "keyword" in given and tuple(self.config.keywords) != tuple(keywords):
                raise P.ProtocolError(P.ErrorCode.BAD_RESUME, "resume token refused: keyword differs from the "
                                      "session's")
            if float(state["step"]) != self.limits.step_s:
                raise P.ProtocolError(P.ErrorCode.BAD_RESUME, f"resume token refused: the session ran "
                                      f"{state['step']:g} s steps, this server {self.limits.step_s:g} s")
            self.config = P.SessionConfig(sample_rate=int(rate), encoding=str(encoding), language=language,
                                          keywords=tuple(keywords), vad=bool(vad))
            self.path = self._new_path()
            self.session = P.Session(str(state["sid"]), self.config, self.engine.name, self.engine.dims.languages,
                                     getattr(self.engine, "note", None))
            start = int(state["from"])
            self.replay_from = start / self.rate
            self.session.resume(int(state["seq"]), self.replay_from, str(state["lang"]), tuple(keywords))
            self.stream = self.engine.restore_stream(state["engine"], keywords=list(keywords) or None,
                                                     beams=self.limits.beams)
            self.time_map.restore(state["time"])
            self.path.restore(state["path"], start, [tuple(r) for r in state["refill"]])
            self._replay_until = (int(state["path"]["position"]) + int(state["path"]["tail"])) / self.rate
            self._utterance_fed = bool(state["fed"])
        except P.ProtocolError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise P.ProtocolError(P.ErrorCode.BAD_RESUME, f"resume token refused: its state does not fit "
                                  f"this server ({e})") from e
        self._passes_seen = self.stream.passes
        self.resumed = True

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
    def receive(self, frame: bytes | str | P.ClientMessage) -> Received:
        """A client frame (or a dialect's typed client message) -> work for the engine. Raises
        ProtocolError (bad audio, a bad or rate-limited control message, the audio limit, a
        message out of order)."""
        if isinstance(frame, (bytes, bytearray, memoryview)):
            return Received(self._marked(self._receive_audio(bytes(frame))))
        if isinstance(frame, P.Audio):
            return Received(self._marked(self._receive_audio(frame.data)))
        if not self.bucket.take():
            raise P.ProtocolError(P.ErrorCode.RATE_LIMITED, f"more than {self.limits.control_rate:g} "
                                  "control messages per second")
        message = self.session.check(P.decode_text(frame) if isinstance(frame, str) else frame)
        if isinstance(message, P.Retune):
            return Received(self._retune(message))
        if isinstance(message, P.Finalize):
            return Received(self._marked((*self._events(self.path.flush()), FinalizeNow())))
        if isinstance(message, P.Configure):
            return Received((Reconfigure(message.keywords),))
        return Received(close=isinstance(message, P.Close))

    def _retune(self, message: P.Retune) -> tuple[Work, ...]:
        """New language and VAD settings before the first audio: a new audio path now, a new
        engine stream when the work runs."""
        if self.session.audio_seconds > 0 or self.resumed:
            raise P.ProtocolError(P.ErrorCode.BAD_MESSAGE, "the language and turn detection are set before "
                                  "the first audio; this session has audio already")
        try:
            language = model_language(message.language, self.engine.dims.languages)
        except ValueError as e:
            raise P.ProtocolError(P.ErrorCode.BAD_MESSAGE, str(e)) from None
        self.config = dataclasses.replace(self.config, language=language, vad=message.vad)
        self.limits = dataclasses.replace(self.limits, end_of_speech_ms=message.end_of_speech_ms,
                                          vad_aggressiveness=message.vad_aggressiveness)
        self.path = self._new_path()
        return (Reopen(message.language, tuple(self.session.keywords)),)

    def end(self, reason: str) -> tuple[Work, ...]:
        """The session ends (the client closed, a limit, a timeout, shutdown): the work that
        commits what is left and answers `final`. A shutdown of a session that can resume commits
        nothing more: its `final` carries the token of the session as it stands, and the session
        that resumes commits the pending words (forced at a cut mid-utterance, they would be the
        reading of half a sentence)."""
        self.session.closing()
        if reason == "shutdown" and self.resume_secret is not None:
            return (FinishNow(reason, suspend=True), Mark(self.path.state()))
        return self._marked((*self._events(self.path.flush(last=True)), FinishNow(reason)))

    def _marked(self, work: tuple[Work, ...]) -> tuple[Work, ...]:
        return (*work, Mark(self.path.state())) if work and self.resume_secret is not None else work

    def _receive_audio(self, data: bytes) -> tuple[Work, ...]:
        samples = P.decode_audio(data, self.config.encoding)
        before = self.session.audio_seconds
        self.session.check(P.Audio(data))
        seconds = self.session.audio_seconds
        if before < self._replay_until:
            self.observer.replayed(min(seconds, self._replay_until) - before)
        self.observer.audio(len(samples) / self.config.sample_rate)
        now = self.clock()
        with self._arrivals_lock:
            self._arrivals.append((seconds, now))
        if self._pace is None and before >= self._replay_until:
            self._pace = (before, now)   # live audio starts here (after any replay)
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
        """Run work items through the engine, in order; consecutive feeds become one engine call,
        across the resume marks between them (a backlog is caught up at once: one pass per step,
        or fewer when the session has fallen behind, see `_behind`). Engine errors propagate,
        and mark the core failed: a transport then ends the session with `internal`."""
        out: list[P.ServerMessage] = []
        pending: list[Chunk] = []
        sealed = 0   # out[:sealed] carry their tokens
        try:
            for i, item in enumerate(work):
                if isinstance(item, Feed):
                    pending.extend(item.chunks)
                    continue
                if isinstance(item, Mark) and pending and i + 1 < len(work) and isinstance(work[i + 1], Feed):
                    continue   # more audio follows: one feed for all of it, sealed at a later mark
                ends = (isinstance(item, (SpeechEnded, FinalizeNow))
                        or isinstance(item, FinishNow) and not item.suspend)
                if pending and ends:
                    out += self._feed(pending, then=item)   # the utterance's last audio and its end: one engine call
                    pending = []
                    continue
                if pending:
                    out += self._feed(pending)
                    pending = []
                if isinstance(item, Mark):
                    out[sealed:] = self._seal(out[sealed:], item.path)
                    sealed = len(out)
                    continue
                out += self._run(item)
            if pending:
                out += self._feed(pending)
        except Exception:
            self.failed = True
            raise
        return out

    def _seal(self, messages: list[P.ServerMessage], path: dict) -> list[P.ServerMessage]:
        """Attach the resume token of the session as it stands now to its committed and final."""
        if not any(isinstance(m, (P.Committed, P.Final)) for m in messages):
            return messages
        token, replay_from = self.token(path)
        if token is None or replay_from is None:
            return messages
        return [dataclasses.replace(m, resume=token, replay_from=round(replay_from, 6))
                if isinstance(m, (P.Committed, P.Final)) else m for m in messages]

    def _run(self, item: Work, audio: np.ndarray | None = None) -> list[P.ServerMessage]:
        """One work item that is not a feed; `audio`: the speech fed just before an utterance's
        end (SpeechEnded, FinalizeNow, FinishNow), handed to the engine's finalize with it."""
        if isinstance(item, SpeechEnded):
            if not self._utterance_fed:
                return []
            self._utterance_fed = False
            return self._publish(self._live.finalize(audio, keep_context=True), end_of_speech=True)
        if isinstance(item, FinalizeNow):
            return self._publish(self._live.finalize(audio), final="finalize")
        if isinstance(item, Reconfigure):
            try:
                self._live.configure(keywords=list(item.keywords))
            except ValueError as e:   # the engine refused a keyword: the old ones stay
                return [P.Error(P.ErrorCode.BAD_MESSAGE, str(e)[:300])]
            return []
        if isinstance(item, Reopen):
            self.stream = self._open_stream(item.language, item.keywords)
            self._passes_seen = self.stream.passes
            return []
        if isinstance(item, FinishNow):
            if item.suspend:
                return self.session.final(None, item.reason)
            return self._publish(self._live.finish(audio), final=item.reason)
        raise TypeError(f"not a work item: {item!r}")

    def _feed(self, chunks: list[Chunk], then: Work | None = None) -> list[P.ServerMessage]:
        """Speech chunks to the engine; `then`: the utterance's end that follows them (its
        finalize takes the audio, `StreamSession.finalize(audio)`)."""
        refill = [c for c in chunks if c.refill]
        if refill:
            self._refill(refill)
            chunks = [c for c in chunks if not c.refill]
            if not chunks:
                return self._run(then) if then is not None else []
        if not self._utterance_fed and self.config.vad:
            # §8: the engine's gate judges an utterance's first audio; later chunks of an
            # utterance that has begun always reach the engine (a quiet word inside a sentence).
            first = next((i for i, c in enumerate(chunks) if self.engine.is_speech(c.audio)), None)
            if first is None:
                return self._run(then) if then is not None else []
            chunks = chunks[first:]
            if self._said_until is not None and chunks[0].start - self._said_until > CONTEXT_PAUSE_S:
                # The engine does not hear the VAD's silences: a pause this long ends the sentence
                # before it for the reader too (the stream keeps no context past it).
                self._live.finalize()
        for c in chunks:
            self.time_map.add(c)
        self._utterance_fed = True
        self._said_until = chunks[-1].start + len(chunks[-1].audio) / self.rate
        audio = chunks[0].audio if len(chunks) == 1 else np.concatenate([c.audio for c in chunks])
        if then is not None:
            return self._run(then, audio)
        behind = self._behind(chunks)
        if behind:
            self.observer.caught_up()
        return self._publish(self._live.feed(audio, catch_up=behind))

    def _behind(self, chunks: list[Chunk]) -> bool:
        """A live session that has fallen behind: its audio arrives no faster than real time and
        the first of these chunks was whole more than CATCH_UP_LAG_S ago. Its stream then skips
        the passes a later pass reads again (`StreamSession.feed(catch_up=)`: one at each
        utterance end and at the newest step), so a busy machine gives each session fewer passes
        rather than a growing backlog. A client sending faster than real time (a file) is not
        behind: its passes stay one per step."""
        if len(chunks) < 2 or self._pace is None:
            return False
        seconds, since = self._pace
        now = self.clock()
        if self.session.audio_seconds - seconds > now - since + LIVE_SLACK_S:
            return False
        whole = self._arrived(chunks[0].start + len(chunks[0].audio) / self.rate)
        return whole is not None and now - whole > CATCH_UP_LAG_S

    def _refill(self, chunks: list[Chunk]) -> None:
        """Replayed audio the resumed engine stream held: back into its buffer (no pass runs)."""
        self._live.feed(np.concatenate([c.audio for c in chunks]))

    def _publish(self, update: StreamUpdate, *, end_of_speech: bool = False,
                 final: str | None = None) -> list[P.ServerMessage]:
        passes = self._live.passes - self._passes_seen
        self._passes_seen = self._live.passes
        if passes:
            self.observer.passes(passes, update.pass_ms / 1000 / passes)
        update = dataclasses.replace(update, words=tuple(
            dataclasses.replace(w, start=self.time_map(w.start), end=self.time_map(w.end)) for w in update.words))
        now = self.clock()
        for w in update.words:
            arrived = self._arrived(w.end)
            if arrived is not None:
                self.observer.commit_latency(max(0.0, now - arrived))
        if final is None:
            return self.session.results(update, end_of_speech=end_of_speech, passes=passes)
        return self.session.final(update, final, passes=passes)

    @property
    def _live(self) -> EngineStream:
        """The engine stream: every engine call comes after `open` made it."""
        assert self.stream is not None, "the session's engine stream is not open"
        return self.stream

    def _arrived(self, t: float) -> float | None:
        """Clock time at which session second `t` had been received (None: not known)."""
        with self._arrivals_lock:
            while len(self._arrivals) > 1 and self._arrivals[1][0] < t - 5.0:
                self._arrivals.popleft()   # keep a few seconds before the oldest word still to commit
            for seconds, at in self._arrivals:
                if seconds >= t:
                    return at
            return self._arrivals[-1][1] if self._arrivals else None
