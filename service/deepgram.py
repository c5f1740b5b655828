"""A Deepgram-compatible live stream (`/deepgram/v1/listen`), Sans-I/O: Deepgram's query and
control messages in, our session's typed messages translated to Deepgram's `Results`,
`Metadata`, `UtteranceEnd` and `SpeechStarted` out. The official `deepgram-sdk` reaches it with its
WebSocket base URL set to `ws://HOST:PORT/deepgram`. What is and is not supported, parameter by
parameter, is in docs/compatibility.md.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence
from urllib.parse import parse_qsl

from . import protocol as P
from .params import FALSE, group, model_language, parse_bool

PREFIX = "/deepgram"
LISTEN_PATH = PREFIX + "/v1/listen"

# Accepted and honoured
_HONOURED = ("encoding", "sample_rate", "channels", "language", "interim_results", "keyterm", "keywords",
             "endpointing", "utterance_end_ms", "vad_events", "token")
# Accepted with no effect: our output is always punctuated and formatted the model's way
_IGNORED = ("model", "punctuate", "smart_format", "numerals", "tag", "mip_opt_out", "version", "filler_words",
            "profanity_filter", "dictation", "extra")
# May be given more than once (each adds one); any other key given twice is refused
_REPEATABLE = ("keyterm", "keywords", "tag", "extra")
# Refused with an error: features this server does not have
_UNSUPPORTED = ("diarize", "diarize_model", "multichannel", "redact", "replace", "search", "callback",
                "callback_method", "detect_entities", "language_hint", "alternatives", "detect_language")
MIN_ENDPOINTING_MS = 90
NO_ENDPOINTING_MS = 10_000_000   # endpointing=false: utterances end only at Finalize or the stream's end


class DeepgramError(Exception):
    """A request refused at the handshake: HTTP status and Deepgram's error body."""

    def __init__(self, status: int, message: str, code: str = "Bad Request"):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def body(self, request_id: str = "") -> bytes:
        return json.dumps({"err_code": self.code, "err_msg": self.message, "request_id": request_id}).encode()


@dataclass(frozen=True)
class Options:
    interim_results: bool = False
    utterance_end_ms: int | None = None
    vad_events: bool = False
    # endpointing: None leaves the server's --end-of-speech-ms (Deepgram's 10 ms default is too
    # short for a VAD to be sure speech has ended)
    end_of_speech_ms: int | None = None
    model: str = "whistle"
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))


def _flag(name: str, raw: str) -> bool:
    try:
        return parse_bool(name, raw)
    except ValueError as e:
        raise DeepgramError(400, str(e)) from e


def parse_query(query: str, languages: Sequence[str] = ()) -> tuple[P.SessionConfig, Options]:
    """Deepgram's /v1/listen query -> our SessionConfig and the dialect's Options. Raises
    DeepgramError (400) naming the parameter and what is accepted."""
    pairs = parse_qsl(query, keep_blank_values=True)
    for key, _ in pairs:
        if key in _UNSUPPORTED:
            raise DeepgramError(400, f"{key} is not supported by this server (whistle-stream); see its "
                                "docs/compatibility.md")
        if key not in _HONOURED + _IGNORED:
            raise DeepgramError(400, f"unknown query parameter {key[:40]!r}; accepted: "
                                f"{', '.join(_HONOURED + _IGNORED)}")
    try:
        one, seen = group(pairs, repeatable=_REPEATABLE)
    except ValueError as e:
        raise DeepgramError(400, str(e)) from e
    encoding = one.get("encoding", "linear16")
    if encoding != "linear16":
        raise DeepgramError(400, f"encoding {encoding[:30]!r} is not supported; send raw PCM with "
                            "encoding=linear16 and sample_rate")
    raw_rate = one.get("sample_rate", str(P.DEFAULT_SAMPLE_RATE))
    if not raw_rate.isdecimal() or not P.MIN_SAMPLE_RATE <= int(raw_rate) <= P.MAX_SAMPLE_RATE:
        raise DeepgramError(400, f"sample_rate must be {P.MIN_SAMPLE_RATE} to {P.MAX_SAMPLE_RATE}, got {raw_rate[:20]!r}")
    if one.get("channels", "1") != "1":
        raise DeepgramError(400, f"channels must be 1 (mono), got {one['channels'][:10]!r}")
    try:
        language = model_language(one.get("language"), languages)
    except ValueError as e:
        raise DeepgramError(400, str(e)) from None
    # keyterm=phrase (Nova-3) and keywords=word:boost (older models) both become keyword phrases
    phrases = seen.get("keyterm", []) + [k.rpartition(":")[0] if ":" in k else k for k in seen.get("keywords", [])]
    try:
        keywords = P.check_keywords(phrases, "keyword")
    except P.ProtocolError as e:
        raise DeepgramError(400, e.message) from e
    end_of_speech_ms = None
    if "endpointing" in one:
        raw = one["endpointing"].lower()
        if raw in FALSE and not raw.isdecimal():   # endpointing=0 is a time
            end_of_speech_ms = NO_ENDPOINTING_MS
        elif raw.isdecimal():
            end_of_speech_ms = max(MIN_ENDPOINTING_MS, int(raw))
        else:
            raise DeepgramError(400, f"endpointing must be milliseconds or false, got {raw[:20]!r}")
    utterance_end_ms = None
    if "utterance_end_ms" in one:
        raw = one["utterance_end_ms"]
        if not raw.isdecimal() or not 1000 <= int(raw) <= 5000:
            raise DeepgramError(400, f"utterance_end_ms must be 1000 to 5000, got {raw[:20]!r}")
        utterance_end_ms = int(raw)
    options = Options(interim_results=_flag("interim_results", one.get("interim_results", "false")),
                      utterance_end_ms=utterance_end_ms,
                      vad_events=_flag("vad_events", one.get("vad_events", "false")),
                      end_of_speech_ms=end_of_speech_ms, model=one.get("model", "whistle"))
    config = P.SessionConfig(sample_rate=int(raw_rate), encoding="pcm_s16le", language=language,
                             keywords=keywords, token=one.get("token") or None, vad=True)
    return config, options


class Dialect:
    """One session's translation between Deepgram's messages and ours."""

    name = "deepgram"
    turn_over = False

    def __init__(self, options: Options, model: str, audio_seconds: Callable[[], float]):
        self.options, self.model = options, model
        self.audio_seconds = audio_seconds   # the session's audio so far, seconds (its own count)
        self.cursor = 0.0            # end of the audio the last final result covered
        self.finalizing = False      # a Finalize is being answered
        self.answered = False        # ... and a Results with from_finalize went out

    # -- client -> server --------------------------------------------------------------------
    def incoming(self, frame):
        """A client frame -> the frame our session core takes (audio passes through)."""
        if isinstance(frame, (bytes, bytearray, memoryview)):
            return frame
        try:
            kind = json.loads(frame).get("type")
        except (ValueError, AttributeError, RecursionError):
            kind = None
        if not isinstance(kind, str):
            kind = None
        mapping = {"KeepAlive": "keepalive", "Finalize": "finalize", "CloseStream": "close"}
        if kind in mapping:
            if kind == "Finalize":
                self.finalizing, self.answered = True, False
            return json.dumps({"type": mapping[kind]})
        if kind == "Configure":
            raise P.ProtocolError(P.ErrorCode.UNKNOWN_TYPE, "Configure is not supported by this server; "
                                  "set keyterm when connecting")
        raise P.ProtocolError(P.ErrorCode.BAD_MESSAGE, "expected KeepAlive, Finalize or CloseStream, got "
                              f"{str(frame)[:80]!r}")

    def speech_started(self, at: float) -> list[str]:
        """The VAD heard an utterance begin at session second `at`."""
        if not self.options.vad_events:
            return []
        return [json.dumps({"type": "SpeechStarted", "channel": [0], "timestamp": round(at, 3)})]

    # -- server -> client --------------------------------------------------------------------
    def _results(self, transcript: str, words: Sequence[P.Word], *, final: bool, speech_final: bool,
                 start: float, end: float) -> str:
        confidence = (sum(w.probability for w in words) / len(words)) if words else (1.0 if not transcript else 0.0)
        return json.dumps({
            "type": "Results", "channel_index": [0, 1], "duration": round(max(0.0, end - start), 3),
            "start": round(start, 3), "is_final": final, "speech_final": speech_final,
            "from_finalize": bool(final and self.finalizing),
            "channel": {"alternatives": [{
                "transcript": transcript, "confidence": round(confidence, 4),
                "words": [{"word": _plain(w.word), "start": round(w.start, 3), "end": round(w.end, 3),
                           "confidence": round(w.probability, 4), "punctuated_word": w.word} for w in words]}]},
            "metadata": {"request_id": self.options.request_id, "model_uuid": self.options.request_id,
                         "model_info": self._model_info()},
        }, ensure_ascii=False)

    def _model_info(self) -> dict:
        return {"name": self.model, "version": "whistle-stream", "arch": "whistle"}

    def outgoing(self, message: P.ServerMessage) -> list[str]:
        """One of our server messages -> the Deepgram messages it becomes (maybe none)."""
        if isinstance(message, P.Partial):
            if not (self.options.interim_results and message.pending.strip()):
                return []
            return [self._results(message.pending.strip(), (), final=False, speech_final=False,
                                  start=self.cursor, end=max(self.cursor, self.audio_seconds()))]
        if isinstance(message, P.Committed):
            words = message.words
            start = words[0].start if words else self.cursor
            end = words[-1].end if words else self.cursor
            out = [self._results(message.text.strip(), words, final=True, speech_final=message.end_of_speech,
                                 start=start, end=end)]
            self.answered = self.answered or self.finalizing
            self.cursor = max(self.cursor, end)
            if message.end_of_speech and self.options.utterance_end_ms is not None:
                out.append(json.dumps({"type": "UtteranceEnd", "channel": [0, 1],
                                       "last_word_end": round(self.cursor, 3)}))
            return out
        if isinstance(message, P.Final):
            out = []
            if self.finalizing and not self.answered:   # Deepgram answers every Finalize with a result
                out.append(self._results("", (), final=True, speech_final=False, start=self.cursor, end=self.cursor))
            self.finalizing = False
            if message.reason != "finalize":
                out.append(json.dumps({
                    "type": "Metadata", "transaction_key": "deprecated", "request_id": self.options.request_id,
                    "sha256": "", "created": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
                    "duration": round(message.audio_seconds, 3), "channels": 1,
                    "models": [self.options.request_id],
                    "model_info": {self.options.request_id: self._model_info()}}))
            return out
        if isinstance(message, P.Error):
            return [json.dumps({"type": "Error", "variant": message.code.value, "description": message.message,
                                "message": message.message})]
        return []   # Ready: Deepgram sends nothing when a stream opens


def _plain(word: str) -> str:
    """Deepgram's `word`: lower case without surrounding punctuation (`punctuated_word` keeps it)."""
    return word.strip().strip(".,!?;:\"'()[]{}\u2026").lower()
