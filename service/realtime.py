"""OpenAI Realtime transcription (`/v1/realtime?intent=transcription`), Sans-I/O: Realtime's
client events in, our session's typed messages translated to Realtime's server events out.

The official `openai` SDK reaches it with `base_url="http://HOST:PORT/v1"` and
`client.realtime.connect(model=..., extra_query={"intent": "transcription"})`. Both API versions
are spoken: the GA form (`session.update` with `audio.input...`) and the beta form
(`transcription_session.update` with `input_audio_format`), the latter answered in its own event
names when the client says `OpenAI-Beta: realtime=v1`. What is and is not supported, field by
field, is in docs/compatibility.md.

One conversation item is one utterance: the VAD's end of speech (`server_vad`), or the client's
`input_audio_buffer.commit` (turn detection `null`), completes it. Unlike OpenAI's own servers,
which transcribe an item only once it is committed, each piece of text is sent as a `delta` as
soon as two passes agree on it, while the person is still talking; `completed` then carries the
item's whole transcript, the deltas joined.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import parse_qsl

from . import protocol as P
from .audio import PREROLL_FRAMES, VAD_FRAME_MS
from .config import DEFAULTS
from .params import group, model_language

PATH = "/v1/realtime"
RATE = 24000                       # audio/pcm and pcm16: 16-bit little-endian mono at 24 kHz
FORMAT = {"type": "audio/pcm", "rate": RATE}
DEFAULT_SILENCE_MS = DEFAULTS.end_of_speech_ms   # the service's end of speech (OpenAI's server_vad: 500 ms)
DEFAULT_THRESHOLD = 0.5
DEFAULT_PREFIX_MS = PREROLL_FRAMES * VAD_FRAME_MS  # the audio path's pre-roll
# semantic_vad's eagerness as a silence length (OpenAI: low waits longest, high answers soonest)
EAGERNESS_MS = {"low": 1200, "medium": 600, "auto": 600, "high": 300}
MIN_SILENCE_MS, MAX_SILENCE_MS = 90, 10_000   # three VAD frames; ten seconds


@dataclass(frozen=True)
class TurnDetection:
    """server_vad (or semantic_vad, mapped to a silence length), or None: the client commits."""
    kind: str = "server_vad"
    silence_duration_ms: int = DEFAULT_SILENCE_MS
    threshold: float = DEFAULT_THRESHOLD
    prefix_padding_ms: int = DEFAULT_PREFIX_MS
    eagerness: str | None = None

    def wire(self) -> dict:
        if self.kind == "semantic_vad":
            return {"type": "semantic_vad", "eagerness": self.eagerness or "auto"}
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms}

    @property
    def aggressiveness(self) -> int:
        """threshold 0..1 as webrtcvad's aggressiveness 0..3 (0.5, OpenAI's default, is our 2)."""
        return min(3, int(self.threshold * 4))


@dataclass(frozen=True)
class Settings:
    language: str | None = None
    prompt: str = ""
    turn: TurnDetection | None = TurnDetection()
    model: str = "whistle"


def _error(message: str, code: P.ErrorCode = P.ErrorCode.BAD_MESSAGE) -> P.ProtocolError:
    """A client event refused: an `error` event, and the session goes on (as OpenAI's does)."""
    return P.ProtocolError(code, message, fatal=False)


def _object(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _error(f"{where} must be an object, got {type(value).__name__}")
    return value


def _turn(raw: Any, current: TurnDetection | None) -> TurnDetection | None:
    if raw is None:
        return None
    raw = _object(raw, "turn_detection")
    kind = raw.get("type", "server_vad")
    if kind == "semantic_vad":
        eagerness = raw.get("eagerness", "auto")
        if eagerness not in EAGERNESS_MS:
            raise _error(f"turn_detection.eagerness must be one of {', '.join(EAGERNESS_MS)}, got {eagerness!r}")
        return TurnDetection("semantic_vad", EAGERNESS_MS[eagerness], eagerness=eagerness)
    if kind != "server_vad":
        raise _error(f"turn_detection.type must be server_vad, semantic_vad or null, got {str(kind)[:30]!r}")
    base = current if current is not None and current.kind == "server_vad" else TurnDetection()
    silence = raw.get("silence_duration_ms", base.silence_duration_ms)
    threshold = raw.get("threshold", base.threshold)
    prefix = raw.get("prefix_padding_ms", base.prefix_padding_ms)
    if isinstance(silence, bool) or not isinstance(silence, int) or not MIN_SILENCE_MS <= silence <= MAX_SILENCE_MS:
        raise _error(f"turn_detection.silence_duration_ms must be an integer from {MIN_SILENCE_MS} to "
                     f"{MAX_SILENCE_MS}, got {silence!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise _error(f"turn_detection.threshold must be a number from 0 to 1, got {threshold!r}")
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise _error(f"turn_detection.prefix_padding_ms must be a non-negative integer, got {prefix!r}")
    return TurnDetection("server_vad", silence, float(threshold), prefix)


def _format(raw: Any) -> None:
    """The input format: audio/pcm at 24 kHz (GA) or "pcm16" (beta); anything else is refused."""
    if raw is None or raw == "pcm16":
        return
    if isinstance(raw, dict) and raw.get("type", "audio/pcm") == "audio/pcm" and raw.get("rate", RATE) == RATE:
        return
    raise _error(f"audio format {json.dumps(raw)[:60]} is not supported; send audio/pcm at 24000 Hz "
                 "(beta: pcm16)", P.ErrorCode.UNSUPPORTED_ENCODING)


def parse_session(event: dict, current: Settings, languages: Sequence[str]) -> Settings:
    """A `session.update` (GA) or `transcription_session.update` (beta) -> the new settings.
    Raises ProtocolError naming the field and what is accepted."""
    session = _object(event.get("session"), "session")
    if "audio" in session or session.get("type") is not None:   # the GA shape
        kind = session.get("type", "transcription")
        if kind != "transcription":
            raise _error(f"session.type must be transcription on this server (speech to text only), got "
                         f"{str(kind)[:30]!r}")
        audio_in = _object(_object(session.get("audio"), "session.audio").get("input"), "session.audio.input")
        _format(audio_in.get("format"))
        transcription = _object(audio_in.get("transcription"), "audio.input.transcription")
        turn_given, turn_raw = "turn_detection" in audio_in, audio_in.get("turn_detection")
    else:                                                        # the beta shape
        _format(session.get("input_audio_format"))
        transcription = _object(session.get("input_audio_transcription"), "input_audio_transcription")
        turn_given, turn_raw = "turn_detection" in session, session.get("turn_detection")
    language = transcription.get("language", current.language)
    if language is not None:
        if not isinstance(language, str):
            raise _error(f"transcription.language must be a string, got {type(language).__name__}")
        try:
            language = model_language(language, languages)
        except ValueError as e:
            raise _error(str(e)) from None
    prompt = transcription.get("prompt", current.prompt)
    if not isinstance(prompt, str):
        raise _error(f"transcription.prompt must be a string, got {type(prompt).__name__}")
    model = transcription.get("model", current.model)
    turn = _turn(turn_raw, current.turn) if turn_given else current.turn
    return Settings(language=language, prompt=prompt, turn=turn, model=str(model)[:60])


class Dialect:
    """One Realtime session's translation. `beta`: answer in the beta event names."""

    name = "realtime"
    turn_over = False

    def __init__(self, model: str, languages: Sequence[str], audio_seconds: Callable[[], float],
                 beta: bool = False):
        self.model, self.languages, self.beta = model, tuple(languages), beta
        self.audio_seconds = audio_seconds
        self.settings = Settings(model=model)
        self.session_id = "sess_" + uuid.uuid4().hex[:20]
        self.item: str | None = None          # the item (utterance) being transcribed
        self.previous: str | None = None      # the item before it
        self.pieces: list[str] = []           # the item's deltas so far
        self.item_start = 0.0                 # session seconds where its speech began
        self.item_end = 0.0                   # ... and its last committed word ended
        self.client_event: str | None = None  # the event_id of the client event being handled

    # -- client -> server --------------------------------------------------------------------
    def incoming(self, frame) -> P.DialectInput:
        if isinstance(frame, (bytes, bytearray, memoryview)):
            raise _error("the Realtime API takes JSON text frames; send audio in input_audio_buffer.append "
                         "as base64")
        if len(frame) > 4 * P.MAX_TEXT_FRAME_CHARS * 64:
            raise _error(f"an event of {len(frame)} characters; at most {4 * P.MAX_TEXT_FRAME_CHARS * 64}",
                         P.ErrorCode.TOO_LARGE)
        try:
            event = json.loads(frame)
        except (ValueError, RecursionError) as e:
            raise _error(f"an event that is not valid JSON: {str(e)[:80]}", P.ErrorCode.MALFORMED_JSON) from e
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise _error('a client event is a JSON object with a string "type"')
        self.client_event = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        kind = event["type"]
        if kind == "input_audio_buffer.append":
            audio = event.get("audio")
            if not isinstance(audio, str):
                raise _error('input_audio_buffer.append needs "audio": base64 of 16-bit PCM at 24 kHz')
            try:
                data = base64.b64decode(audio, validate=True)
            except (binascii.Error, ValueError) as e:
                raise _error(f"input_audio_buffer.append: audio is not base64 ({str(e)[:60]})",
                             P.ErrorCode.BAD_AUDIO) from e
            return P.DialectInput(messages=(P.Audio(data),))
        if kind == "input_audio_buffer.commit":
            return P.DialectInput(messages=(P.Finalize(),))
        if kind == "input_audio_buffer.clear":
            # What was heard cannot be unsaid (its deltas went out): the item so far is completed,
            # and the buffer starts empty.
            return P.DialectInput(messages=(P.Finalize(),),
                                  replies=(self._event("input_audio_buffer.cleared"),))
        if kind in ("session.update", "transcription_session.update"):
            self.settings = parse_session(event, self.settings, self.languages)
            s, turn = self.settings, self.settings.turn
            retune = P.Retune(language=s.language, vad=turn is not None,
                              end_of_speech_ms=turn.silence_duration_ms if turn else DEFAULT_SILENCE_MS,
                              vad_aggressiveness=turn.aggressiveness if turn else 2)
            keywords = P.Configure(keywords=P.check_keywords(P.prompt_phrases(s.prompt), "prompt"))
            return P.DialectInput(messages=(keywords, retune), replies=(self._session_event("updated"),))
        raise _error(f"unknown or unsupported event type {kind[:60]!r}; accepted: session.update, "
                     "transcription_session.update, input_audio_buffer.append, input_audio_buffer.commit, "
                     "input_audio_buffer.clear", P.ErrorCode.UNKNOWN_TYPE)

    def speech_started(self, at: float) -> list[str]:
        if self.settings.turn is None:
            return []
        self._open(at)
        return [self._event("input_audio_buffer.speech_started", audio_start_ms=int(at * 1000), item_id=self.item)]

    # -- server -> client --------------------------------------------------------------------
    def outgoing(self, message: P.ServerMessage) -> list[str]:
        if isinstance(message, P.Ready):
            return [self._session_event("created")]
        if isinstance(message, P.Committed):
            out = []
            if message.text.strip():
                self._open(message.words[0].start if message.words else self.audio_seconds())
                delta = message.text.lstrip() if not self.pieces else message.text
                self.pieces.append(delta)
                if message.words:
                    self.item_end = max(self.item_end, message.words[-1].end)
                out.append(self._event("conversation.item.input_audio_transcription.delta", item_id=self.item,
                                       content_index=0, delta=delta))
            if message.end_of_speech and self.item is not None:
                out += self._complete(stopped=True)
            return out
        if isinstance(message, P.Final):
            if message.reason == "finalize" and self.item is None:
                self._open(self.audio_seconds())   # a commit answers with an item, empty or not
            return self._complete(stopped=False) if self.item is not None else []
        if isinstance(message, P.Error):
            kind = "server_error" if message.code is P.ErrorCode.INTERNAL else "invalid_request_error"
            return [self._event("error", error={"type": kind, "code": message.code.value, "message": message.message,
                                                "param": None, "event_id": self.client_event})]
        return []   # Partial: Realtime has no unstable text

    def _open(self, at: float) -> None:
        if self.item is None:
            self.item = "item_" + uuid.uuid4().hex[:20]
            self.pieces, self.item_start, self.item_end = [], at, at

    def _complete(self, stopped: bool) -> list[str]:
        item, previous = self.item, self.previous
        end = max(self.item_end, self.item_start)
        out = []
        if stopped and self.settings.turn is not None:
            out.append(self._event("input_audio_buffer.speech_stopped", audio_end_ms=int(end * 1000), item_id=item))
        transcript = "".join(self.pieces)
        out += [
            self._event("input_audio_buffer.committed", item_id=item, previous_item_id=previous),
            self._event("conversation.item.created" if self.beta else "conversation.item.added",
                        previous_item_id=previous,
                        item={"id": item, "object": "realtime.item", "type": "message", "status": "completed",
                              "role": "user", "content": [{"type": "input_audio", "transcript": None}]}),
            self._event("conversation.item.input_audio_transcription.completed", item_id=item, content_index=0,
                        transcript=transcript,
                        usage={"type": "duration", "seconds": round(max(0.0, end - self.item_start), 3)}),
        ]
        self.previous, self.item, self.pieces = item, None, []
        return out

    def _session_event(self, what: str) -> str:
        s = self.settings
        transcription = {"model": s.model, "language": s.language, "prompt": s.prompt}
        turn = None if s.turn is None else s.turn.wire()
        session: dict[str, Any]
        if self.beta:
            session = {"id": self.session_id, "object": "realtime.transcription_session",
                       "input_audio_format": "pcm16", "input_audio_transcription": transcription,
                       "turn_detection": turn, "input_audio_noise_reduction": None, "include": []}
            return self._event("transcription_session." + what, session=session)
        session = {"type": "transcription", "id": self.session_id, "object": "realtime.transcription_session",
                   "expires_at": 0, "include": [],
                   "audio": {"input": {"format": FORMAT, "transcription": transcription, "turn_detection": turn,
                                       "noise_reduction": None}}}
        return self._event("session." + what, session=session)

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return json.dumps({"type": kind, "event_id": "event_" + uuid.uuid4().hex[:20], **fields},
                          ensure_ascii=False)


def check_query(query: str) -> None:
    """The connection's query: `intent=transcription` (this server only transcribes), and
    optionally `model` (any name: the server's model answers) and `token`. Raises ProtocolError."""
    pairs = parse_qsl(query, keep_blank_values=True)
    unknown = sorted({k for k, _ in pairs} - {"intent", "model", "token", "call_id"})
    if unknown:
        raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, f"unknown query parameter {unknown[0][:40]!r}; accepted: "
                              "intent, model, token")
    try:
        one, _ = group(pairs)
    except ValueError as e:
        raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, f"query {e}") from e
    if one.get("intent") != "transcription":
        raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, "this server transcribes only: connect with "
                              "?intent=transcription")
    if "call_id" in one:
        raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, "call_id (joining a SIP or WebRTC call) is not supported")


def session_config() -> P.SessionConfig:
    """The session a Realtime connection opens with, before any `session.update`: 24 kHz 16-bit
    PCM, the language detected, server VAD."""
    return P.SessionConfig(sample_rate=RATE, encoding="pcm_s16le", language=None, vad=True)
