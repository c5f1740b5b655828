"""The /v1/listen wire protocol, Sans-I/O: bytes and JSON in, typed messages out, and back.

Nothing here touches a socket, a thread or an event loop. The session runner (`service.runner`)
moves frames; this module decides what they mean. The full protocol is in docs/protocol.md.

Client -> server: binary frames are audio (`Audio`); text frames are JSON control messages
(`Finalize`, `Close`, `KeepAlive`, `Configure`). Server -> client: JSON text frames (`Ready`,
`Partial`, `Committed`, `Final`, `Error`). `Session` turns the engine's stream updates
(`whistle_stream.results.StreamUpdate`) into those messages and enforces their ordering rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Iterable, Mapping, Sequence, Union
from urllib.parse import parse_qsl

import numpy as np

from whistle_stream.results import StreamUpdate

from .params import group, model_language, parse_bool

PROTOCOL_VERSION = 2   # 2: resume tokens (`resume`, `replay_from`, `ready.resumed`)

DEFAULT_SAMPLE_RATE = 16000        # the query's default: Whistle's own rate, so nothing is resampled
MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000
ENCODINGS = {"pcm_s16le": 2, "pcm_f32le": 4}  # encoding -> bytes per sample
MAX_KEYWORDS = 64
MAX_KEYWORD_CHARS = 100
MAX_TEXT_FRAME_CHARS = 16384  # control messages are tiny; anything bigger is a mistake or abuse


class ErrorCode(str, Enum):
    """Every `error` message carries one of these codes (docs/protocol.md, "Errors")."""

    BAD_REQUEST = "bad_request"                  # a query parameter is missing, unknown or out of range
    UNSUPPORTED_ENCODING = "unsupported_encoding"
    BAD_AUDIO = "bad_audio"                      # byte count not a whole number of samples, NaN/inf
    EXPECTED_BINARY = "expected_binary"          # a text frame that is not JSON: audio goes in binary frames
    MALFORMED_JSON = "malformed_json"
    BAD_MESSAGE = "bad_message"                  # JSON, but not a valid control message
    UNKNOWN_TYPE = "unknown_type"
    NOT_READY = "not_ready"                      # a message before `ready` (Session state machine)
    SESSION_CLOSED = "session_closed"            # a message after `close`
    TOO_LARGE = "too_large"                      # a text frame over MAX_TEXT_FRAME_CHARS
    RATE_LIMITED = "rate_limited"                # too many control messages
    UNAUTHORIZED = "unauthorized"
    SERVER_FULL = "server_full"
    SESSION_LIMIT = "session_limit"              # max audio seconds per session reached
    IDLE_TIMEOUT = "idle_timeout"
    SLOW_CLIENT = "slow_client"                  # the client does not read what the server sends
    SHUTTING_DOWN = "shutting_down"
    BAD_RESUME = "bad_resume"                    # a resume token tampered with, expired, malformed or mismatched
    INTERNAL = "internal"


class CloseCode:
    """WebSocket close codes the server uses (RFC 6455 section 7.4 plus one private code)."""

    NORMAL = 1000        # answer to the client's `close`
    GOING_AWAY = 1001    # server shutdown (SIGTERM drain)
    POLICY = 1008        # bad parameters, rate limit, session limit, idle timeout, slow client
    TOO_BIG = 1009       # a binary frame over the server's max frame size (sent by websockets itself)
    INTERNAL = 1011      # the engine failed
    TRY_AGAIN = 1013     # server full
    BAD_RESUME = 4400    # a resume token the server cannot take
    UNAUTHORIZED = 4401  # missing or wrong token


# Which errors end the session, and with which close code. Errors not listed drop the offending
# frame and the session carries on.
FATAL_ERRORS = {
    ErrorCode.BAD_REQUEST: CloseCode.POLICY,
    ErrorCode.UNSUPPORTED_ENCODING: CloseCode.POLICY,
    ErrorCode.RATE_LIMITED: CloseCode.POLICY,
    ErrorCode.UNAUTHORIZED: CloseCode.UNAUTHORIZED,
    ErrorCode.SERVER_FULL: CloseCode.TRY_AGAIN,
    ErrorCode.SESSION_LIMIT: CloseCode.POLICY,
    ErrorCode.IDLE_TIMEOUT: CloseCode.POLICY,
    ErrorCode.SLOW_CLIENT: CloseCode.POLICY,
    ErrorCode.SHUTTING_DOWN: CloseCode.GOING_AWAY,
    ErrorCode.INTERNAL: CloseCode.INTERNAL,
    ErrorCode.BAD_RESUME: CloseCode.BAD_RESUME,
}


class ProtocolError(Exception):
    """A client broke the protocol. `code` is an ErrorCode; `message` is safe to send back."""

    def __init__(self, code: ErrorCode, message: str, *, fatal: bool | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code = ErrorCode(code)
        self.message = message
        # None: as FATAL_ERRORS says; False: the frame is refused and the session goes on (a
        # dialect's settings message that asks for an encoding mid-session, say)
        self._fatal = fatal

    @property
    def fatal(self) -> bool:
        return self.code in FATAL_ERRORS if self._fatal is None else self._fatal

    @property
    def close_code(self) -> int | None:
        return FATAL_ERRORS.get(self.code, CloseCode.POLICY) if self.fatal else None


# ---------------------------------------------------------------------------------------------
# Client messages

@dataclass(frozen=True)
class Audio:
    """A binary frame: PCM in the session's encoding and sample rate, any length."""
    data: bytes


@dataclass(frozen=True)
class Finalize:
    """Commit everything received so far; the stream stays open."""


@dataclass(frozen=True)
class Close:
    """Commit everything, answer with `final`, then the server closes with 1000."""


@dataclass(frozen=True)
class KeepAlive:
    """Resets the idle timer; no answer."""


@dataclass(frozen=True)
class Configure:
    """New keyword phrases for the passes that follow (§7)."""
    keywords: tuple[str, ...]


@dataclass(frozen=True)
class Retune:
    """Settings a dialect changes after the session opened and before its first audio (OpenAI
    Realtime's `session.update`): the language, the VAD on or off, its end of speech and
    aggressiveness. Not a message of this wire protocol: dialects hand it to the session core."""
    language: str | None
    vad: bool
    end_of_speech_ms: int
    vad_aggressiveness: int


ClientMessage = Union[Audio, Finalize, Close, KeepAlive, Configure, Retune]


@dataclass(frozen=True)
class DialectInput:
    """What a dialect makes of one client frame: messages for the session core, in order (audio
    bytes, a control frame of this protocol, or a typed client message), and replies the dialect
    sends back at once (an acknowledgement that is not the session's)."""
    messages: tuple = ()
    replies: tuple = ()


# ---------------------------------------------------------------------------------------------
# Server messages. Field order here is the key order on the wire (`encode`).

@dataclass(frozen=True)
class Word:
    word: str
    start: float  # seconds from the start of the session's audio
    end: float
    probability: float


@dataclass(frozen=True)
class Ready:
    session_id: str
    model: str
    languages: tuple[str, ...]
    language: str | None
    sample_rate: int
    encoding: str
    vad: bool
    keywords: tuple[str, ...] = ()
    protocol: int = PROTOCOL_VERSION
    resumed: bool = False         # this session continues an earlier one (`?resume=`)
    seq: int = 0                  # the last `committed.seq` already delivered
    replay_from: float = 0.0      # send the session's audio from here (seconds) on
    model_note: str | None = None  # what a person should know about the model (the demo model's limits)
    type: str = field(default="ready", init=False)


@dataclass(frozen=True)
class Partial:
    pending: str
    language: str
    revision: int
    type: str = field(default="partial", init=False)


@dataclass(frozen=True)
class Committed:
    seq: int
    text: str
    words: tuple[Word, ...]
    end_of_speech: bool = False
    resume: str | None = None         # the token to resume the session after this message
    replay_from: float | None = None  # audio before this (seconds) is settled
    type: str = field(default="committed", init=False)


@dataclass(frozen=True)
class Final:
    seq: int                  # seq of the last `committed` sent before it (0: none yet)
    text: str                 # the whole transcript committed so far
    language: str
    audio_seconds: float      # audio received in this session, seconds
    passes: int
    mean_pass_ms: float
    reason: str               # "finalize" | "close" | "shutdown" | "session_limit" | "idle_timeout" | ...
    resume: str | None = None
    replay_from: float | None = None
    type: str = field(default="final", init=False)


@dataclass(frozen=True)
class Error:
    code: ErrorCode
    message: str
    type: str = field(default="error", init=False)


ServerMessage = Union[Ready, Partial, Committed, Final, Error]

_SERVER_TYPES = {"ready": Ready, "partial": Partial, "committed": Committed, "final": Final,
                 "error": Error}
def _wire_value(value):
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Word):
        return {"word": value.word, "start": round(value.start, 3), "end": round(value.end, 3),
                "probability": round(value.probability, 4)}
    if isinstance(value, tuple):
        return [_wire_value(v) for v in value]
    if isinstance(value, float):
        return round(value, 3)
    return value


def encode(message: ServerMessage) -> str:
    """A server message -> its JSON text frame (compact, `type` first, fixed key order)."""
    out = {"type": message.type}
    for f in fields(message):   # the dataclass's field order is the wire's
        if f.name != "type":
            out[f.name] = _wire_value(getattr(message, f.name))
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def decode_server(text: str | bytes) -> ServerMessage:
    """A server JSON text frame -> its typed message (used by clients). Raises ValueError."""
    try:
        obj = json.loads(text)
        kind = _SERVER_TYPES[obj.pop("type")]
        if kind is Error:
            return Error(code=ErrorCode(obj["code"]), message=obj["message"])
        if kind is Committed:
            words = tuple(Word(**w) for w in obj.pop("words"))
            return Committed(words=words, **obj)
        if kind is Ready:
            obj["languages"] = tuple(obj["languages"])
            obj["keywords"] = tuple(obj.get("keywords", ()))
        return kind(**obj)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a server message: {str(text)[:200]!r}") from e


# ---------------------------------------------------------------------------------------------
# Decoding what clients send

@dataclass(frozen=True)
class SessionConfig:
    """What the client asked for in the /v1/listen query string."""
    sample_rate: int = DEFAULT_SAMPLE_RATE
    encoding: str = "pcm_s16le"
    language: str | None = None      # None: detected by the engine
    keywords: tuple[str, ...] = ()
    token: str | None = None
    vad: bool = True
    resume: str | None = None         # a resume token: the session it names continues
    given: frozenset = field(default=frozenset(), compare=False)   # parameters the query named (a resume checks them)


MAX_RESUME_CHARS = 4096
_QUERY_PARAMETERS = ("sample_rate", "encoding", "language", "keyword", "token", "vad", "resume")


def _pairs(params) -> list[tuple[str, str]]:
    if isinstance(params, (str, bytes)):
        text = params.decode("utf-8", "replace") if isinstance(params, bytes) else params
        return parse_qsl(text.lstrip("?"), keep_blank_values=True)
    if isinstance(params, Mapping):
        pairs: list[tuple[str, str]] = []
        for key, value in params.items():
            values = value if isinstance(value, (list, tuple)) else [value]
            pairs.extend((str(key), str(v)) for v in values)
        return pairs
    return [(str(k), str(v)) for k, v in params]


def check_keywords(keywords: Iterable, where: str) -> tuple[str, ...]:
    """Validate keyword phrases (§7: one phrase per line, so no newlines inside one)."""
    code = ErrorCode.BAD_MESSAGE if where == "configure" else ErrorCode.BAD_REQUEST
    out = []
    for phrase in keywords:
        if not isinstance(phrase, str):
            raise ProtocolError(code, f"{where}: keywords must be strings, got {type(phrase).__name__}")
        phrase = phrase.strip()
        if not phrase or len(phrase) > MAX_KEYWORD_CHARS or any(c in phrase for c in "\r\n\x00"):
            raise ProtocolError(code, f"{where}: a keyword must be 1 to {MAX_KEYWORD_CHARS} "
                                      f"characters on one line, got {phrase[:40]!r}")
        out.append(phrase)
    if len(out) > MAX_KEYWORDS:
        raise ProtocolError(code, f"{where}: at most {MAX_KEYWORDS} keywords, got {len(out)}")
    return tuple(out)


def prompt_phrases(prompt: str) -> list[str]:
    """An OpenAI `prompt` read as keyword phrases (§7), by the REST endpoint and the Realtime
    dialect alike: one phrase per line; a one-line prompt with commas is a comma-separated list
    ("Kaliko, Irolg")."""
    lines = [line for line in prompt.splitlines() if line.strip()]
    if len(lines) == 1 and "," in lines[0]:
        lines = [p for p in lines[0].split(",") if p.strip()]
    return lines


def parse_query(params, languages: Sequence[str] = ()) -> SessionConfig:
    """The /v1/listen query (a raw query string, a mapping or (key, value) pairs) -> SessionConfig.

    `languages` are the model's codes; an empty sequence accepts any `language`. Raises
    ProtocolError(bad_request | unsupported_encoding) naming the parameter and what is accepted.
    """
    pairs = _pairs(params)
    for key, _ in pairs:
        if key not in _QUERY_PARAMETERS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown query parameter {key[:40]!r}; "
                                f"accepted: {', '.join(_QUERY_PARAMETERS)}")
    try:
        one, seen = group(pairs, repeatable=("keyword",))
    except ValueError as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"query {e}") from e

    sample_rate = DEFAULT_SAMPLE_RATE
    if "sample_rate" in one:
        raw = one["sample_rate"]
        if not raw.isdecimal() or not MIN_SAMPLE_RATE <= int(raw) <= MAX_SAMPLE_RATE:  # isdigit() passes "²"
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"sample_rate must be an integer from "
                                f"{MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz, got {raw[:20]!r}")
        sample_rate = int(raw)

    encoding = one.get("encoding", "pcm_s16le")
    if encoding not in ENCODINGS:
        raise ProtocolError(ErrorCode.UNSUPPORTED_ENCODING, f"encoding {encoding[:40]!r} is not "
                            f"supported; accepted: {', '.join(ENCODINGS)}")

    try:
        language = model_language(one.get("language"), languages)
    except ValueError as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{e} (or omit it to detect)") from None

    try:
        vad = parse_bool("vad", one.get("vad", "true"))
    except ValueError as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from e

    keywords = check_keywords(seen.get("keyword", []), "keyword")
    resume = one.get("resume") or None
    if resume is not None and len(resume) > MAX_RESUME_CHARS:
        raise ProtocolError(ErrorCode.BAD_RESUME, f"resume token of {len(resume)} characters; tokens are "
                            f"at most {MAX_RESUME_CHARS}")
    return SessionConfig(sample_rate=sample_rate, encoding=encoding, language=language,
                         keywords=keywords, token=one.get("token") or None, vad=vad, resume=resume,
                         given=(frozenset(one) | frozenset(seen)) - {"token", "resume"})


def decode_audio(data: bytes, encoding: str) -> np.ndarray:
    """A binary frame -> float32 samples in [-1, 1] (pcm_s16le) or as sent (pcm_f32le).

    Raises ProtocolError(bad_audio) when the byte count is not a whole number of samples or a
    float sample is NaN or infinite, and ProtocolError(unsupported_encoding) for other encodings.
    """
    width = ENCODINGS.get(encoding)
    if width is None:
        raise ProtocolError(ErrorCode.UNSUPPORTED_ENCODING, f"encoding {encoding!r} is not supported; "
                            f"accepted: {', '.join(ENCODINGS)}")
    if len(data) % width:
        raise ProtocolError(ErrorCode.BAD_AUDIO, f"{len(data)} bytes is not a whole number of "
                            f"{encoding} samples ({width} bytes each)")
    if encoding == "pcm_s16le":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) * np.float32(1 / 32768)
    samples = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.isfinite(samples).all():
        raise ProtocolError(ErrorCode.BAD_AUDIO, "pcm_f32le audio contains NaN or infinite samples")
    return samples


def decode_text(text: str) -> ClientMessage:
    """A text frame -> Finalize | Close | KeepAlive | Configure. Raises ProtocolError."""
    if len(text) > MAX_TEXT_FRAME_CHARS:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"text frame of {len(text)} characters; control "
                            f"messages are at most {MAX_TEXT_FRAME_CHARS}")
    try:
        obj = json.loads(text)
    except ValueError as e:
        if text.lstrip()[:1] in ("{", "["):
            raise ProtocolError(ErrorCode.MALFORMED_JSON, f"text frame is not valid JSON: "
                                f"{str(e)[:80]}") from e
        raise ProtocolError(ErrorCode.EXPECTED_BINARY, "text frames carry JSON control messages; "
                            "send audio as binary frames") from e
    except RecursionError as e:
        raise ProtocolError(ErrorCode.MALFORMED_JSON, "text frame nests too deeply") from e
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a control message is a JSON object, got "
                            f"{type(obj).__name__}")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, 'a control message needs a string "type"')
    if kind == "finalize":
        return Finalize()
    if kind == "close":
        return Close()
    if kind == "keepalive":
        return KeepAlive()
    if kind == "configure":
        keywords = obj.get("keywords")
        if not isinstance(keywords, list):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, 'configure needs "keywords": a list of strings')
        return Configure(keywords=check_keywords(keywords, "configure"))
    raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind[:40]!r}; accepted: "
                        "finalize, close, keepalive, configure")


# ---------------------------------------------------------------------------------------------
# The session state machine

class SessionState(Enum):
    NEW = "new"            # connected, `ready` not sent yet
    OPEN = "open"          # streaming
    CLOSING = "closing"    # `close` received or the server is ending the session
    CLOSED = "closed"


class Session:
    """One stream's message logic, without I/O.

    The session core calls `ready()` once, `check(msg)` for every client message, `results(u)` for
    every engine `StreamUpdate` from `feed`/`finalize`, and `final(u, reason)` for the update from
    `finalize`/`finish` that answers a client's `finalize`/`close`. Word times in `u` must already be
    in session seconds. Guarantees: `ready` first; `committed.seq` counts 1, 2, 3 ... with no gaps; committed
    text is never revised; `final` follows the `committed` it sums up; nothing after `close`.
    """

    def __init__(self, session_id: str, config: SessionConfig, model: str, languages: Sequence[str],
                 model_note: str | None = None):
        self.session_id = session_id
        self.model_note = model_note
        self.config = config
        self.model = model
        self.languages = tuple(languages)
        self.state = SessionState.NEW
        self.seq = 0
        self.transcript: list[str] = []
        self.language = ""
        self.pending = ""
        self.revision = 0
        self.audio_seconds = 0.0
        self.passes = 0
        self.pass_ms = 0.0
        self.keywords = config.keywords

    def ready(self, resumed: bool = False, replay_from: float = 0.0) -> Ready:
        """The first message. A resumed session (`resume`: its seq and counted audio restored
        first) says so, with the last seq delivered and where the client's replay starts."""
        if self.state is not SessionState.NEW:
            raise RuntimeError("ready() twice")
        self.state = SessionState.OPEN
        c = self.config
        return Ready(session_id=self.session_id, model=self.model, languages=self.languages,
                     language=c.language, sample_rate=c.sample_rate, encoding=c.encoding, vad=c.vad,
                     keywords=self.keywords, resumed=resumed, seq=self.seq, replay_from=replay_from,
                     model_note=self.model_note)

    def resume(self, seq: int, audio_seconds: float, language: str, keywords: tuple[str, ...]) -> None:
        """Continue an earlier session before `ready`: its last seq, the audio it counted up to the
        replay point (replayed audio counts again, so the audio limit holds), its language and
        keywords."""
        if self.state is not SessionState.NEW:
            raise RuntimeError("resume() after ready()")
        self.seq, self.audio_seconds, self.language, self.keywords = seq, audio_seconds, language, keywords

    def check(self, message: ClientMessage) -> ClientMessage:
        """Apply the ordering rules to a client message; returns it, or raises ProtocolError."""
        if self.state is SessionState.NEW:
            raise ProtocolError(ErrorCode.NOT_READY, f"{type(message).__name__.lower()} before ready")
        if self.state is not SessionState.OPEN:
            raise ProtocolError(ErrorCode.SESSION_CLOSED,
                                f"{type(message).__name__.lower()} after the session was closed")
        if isinstance(message, Audio):
            self.audio_seconds += len(message.data) / ENCODINGS[self.config.encoding] / self.config.sample_rate
        elif isinstance(message, Configure):
            self.keywords = message.keywords
        elif isinstance(message, Close):
            self.state = SessionState.CLOSING
        return message

    def closing(self) -> None:
        """The server ends the session (limit, timeout, shutdown): no more client messages."""
        if self.state in (SessionState.NEW, SessionState.OPEN):
            self.state = SessionState.CLOSING

    def _spaced(self, text: str) -> str:
        """`text` with a leading space when it would otherwise run into the transcript so far, so
        that committed texts (and the pending tail after them) concatenate to readable text
        whether the engine puts spaces before its words or joins them with spaces."""
        before = next((piece for piece in reversed(self.transcript) if piece), "")
        if text and before and not text[0].isspace() and not before[-1].isspace():
            return " " + text
        return text

    def results(self, d: StreamUpdate, *, end_of_speech: bool = False,
                passes: int | None = None) -> list[ServerMessage]:
        """An engine update -> [Committed] (new text, or end_of_speech) then [Partial] (tail changed).

        `passes`: how many passes the engine call ran (None: one if it spent time in passes).
        """
        if self.state is SessionState.CLOSED:
            raise RuntimeError("results() after the session closed")
        out: list[ServerMessage] = []
        revision = int(d.revision)
        pass_ms = float(d.pass_ms)
        self.passes += passes if passes is not None else int(pass_ms > 0)
        self.pass_ms += pass_ms
        text = self._spaced(d.text or "")
        words = tuple(Word(str(w.word), float(w.start), float(w.end), float(w.probability)) for w in d.words)
        if text or words or end_of_speech:
            self.seq += 1
            self.transcript.append(text)
            out.append(Committed(seq=self.seq, text=text, words=words, end_of_speech=end_of_speech))
        language = d.language or self.language
        pending = self._spaced(d.pending or "")
        if pending != self.pending or language != self.language:
            out.append(Partial(pending=pending, language=language, revision=revision))
        self.pending, self.language, self.revision = pending, language, max(revision, self.revision)
        return out

    def final(self, d: StreamUpdate | None, reason: str, passes: int | None = None) -> list[ServerMessage]:
        """The update that answers finalize/close (or None if the engine had nothing) -> [...] + Final."""
        out = self.results(d, passes=passes) if d is not None else []
        out.append(Final(seq=self.seq, text="".join(self.transcript), language=self.language,
                         audio_seconds=self.audio_seconds, passes=self.passes,
                         mean_pass_ms=self.pass_ms / self.passes if self.passes else 0.0,
                         reason=reason))
        if reason != "finalize":
            self.state = SessionState.CLOSED
        return out
