"""The Wyoming protocol (Home Assistant's speech-to-text), Sans-I/O: Wyoming's events in, our
session's typed messages translated to Wyoming's events out. Events and their fields come from
the `wyoming` package, the protocol's reference implementation; `wyoming_server` moves them.

A transcription is `transcribe` (optional: a language), `audio-start`, `audio-chunk`...,
`audio-stop`. The answer streams: `transcript-start` when the session opens, a `transcript-chunk`
for each piece of text as soon as two passes agree on it (the chunks concatenate to the
transcript), then `transcript` with the whole text and `transcript-stop`. Audio of any rate from
4 to 192 kHz, 8-, 16-, 24- or 32-bit, any channel count, is converted to mono float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from wyoming.asr import Transcript, TranscriptChunk, TranscriptStart, TranscriptStop
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import AsrModel, AsrProgram, Attribution, Info

from whistle_stream.rules import ends_sentence

from . import protocol as P

DEFAULT_PORT = 10300         # the port Wyoming servers use by convention
MIN_RATE, MAX_RATE = 4000, 192000
WIDTHS = (1, 2, 3, 4)        # bytes per sample: unsigned 8-bit, signed 16-, 24- and 32-bit
MAX_CHANNELS = 8
ATTRIBUTION = Attribution(name="Cactus Compute", url="https://huggingface.co/Cactus-Compute")


# Home Assistant's end-of-speech sensitivities (`vad_sensitivity`) as the silence that ends an
# utterance: its own lengths (assist_pipeline's VadSensitivity), in milliseconds.
SENSITIVITY_MS = {"aggressive": 250, "default": 700, "relaxed": 1250}
# The server ends a transcription's turn itself (`requires_external_vad: false`), smarter than a
# timer because it knows what was said: an utterance whose text ends a sentence ends the turn at
# the turn's silence (the sensitivity's); one that stops mid-sentence ("set a timer for...") waits
# MID_SENTENCE_WAIT_S more, in case the rest follows. A sentence's end gets no shorter silence: a
# reading cut at a pause inside a command often closes itself with a full stop of its own
# (benchmarks/turns.py measures commands with such a pause).
MID_SENTENCE_WAIT_S = 1.0


def check_sensitivity(value) -> int | None:
    """A `transcribe`'s vad_sensitivity as milliseconds of silence (None: not given). Raises
    ProtocolError naming the accepted values."""
    if value is None:
        return None
    if value not in SENSITIVITY_MS:
        raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, f"vad_sensitivity {str(value)[:20]!r} is not accepted; "
                              f"{', '.join(SENSITIVITY_MS)}")
    return SENSITIVITY_MS[value]


def info_event(model: str, languages: Sequence[str], version: str, description: str, end_of_turn: bool) -> Event:
    """The `info` that answers `describe`: one ASR program with the model, streaming text;
    end_of_turn: the server ends a transcription itself (no VAD needed on the client)."""
    asr_model = AsrModel(name=model, attribution=ATTRIBUTION, installed=True, description=description,
                         version=version, languages=list(languages))
    program = AsrProgram(name="whistle-stream", attribution=ATTRIBUTION, installed=True,
                         description=f"Live speech-to-text: {description}", version=version,
                         models=[asr_model], supports_transcript_streaming=True,
                         requires_external_vad=not end_of_turn)
    return Info(asr=[program]).event()


def error_event(code: P.ErrorCode, message: str) -> Event:
    return Error(text=message, code=code.value).event()


@dataclass(frozen=True)
class Format:
    rate: int
    width: int
    channels: int

    @classmethod
    def of(cls, event: Event) -> "Format":
        """An audio-start's or audio-chunk's format, checked. Raises ProtocolError naming what is
        accepted."""
        data = event.data or {}
        try:
            rate, width, channels = (data[k] for k in ("rate", "width", "channels"))
        except KeyError as e:
            raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, f"{event.type} needs rate, width and channels; "
                                  f"{e.args[0]} is missing") from e
        for name, value in (("rate", rate), ("width", width), ("channels", channels)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, f"{event.type}: {name} must be an integer, "
                                      f"got {value!r}"[:200])
        if not MIN_RATE <= rate <= MAX_RATE:
            raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, f"{event.type}: rate {rate} Hz is not accepted; "
                                  f"{MIN_RATE} to {MAX_RATE} Hz")
        if width not in WIDTHS:
            raise P.ProtocolError(P.ErrorCode.UNSUPPORTED_ENCODING, f"{event.type}: width {width} is not "
                                  "accepted; 1, 2, 3 or 4 bytes a sample")
        if not 1 <= channels <= MAX_CHANNELS:
            raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, f"{event.type}: channels {channels} is not "
                                  f"accepted; 1 to {MAX_CHANNELS}")
        return cls(rate, width, channels)

    def decode(self, audio: bytes) -> np.ndarray:
        """PCM in this format -> mono float32 in [-1, 1]. Raises ProtocolError(bad_audio)."""
        frame = self.width * self.channels
        if len(audio) % frame:
            raise P.ProtocolError(P.ErrorCode.BAD_AUDIO, f"audio-chunk of {len(audio)} bytes is not a whole "
                                  f"number of {self.width}-byte samples in {self.channels} channel(s)")
        raw = np.frombuffer(audio, np.uint8)
        if self.width == 1:
            samples = (raw.astype(np.float32) - 128.0) / 128.0
        elif self.width == 3:   # little-endian 24-bit: the top byte carries the sign
            b = raw.reshape(-1, 3).astype(np.int32)
            value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
            samples = (np.where(value >= 1 << 23, value - (1 << 24), value) / float(1 << 23)).astype(np.float32)
        else:
            kind = "<i2" if self.width == 2 else "<i4"
            samples = (np.frombuffer(audio, kind).astype(np.float32) / float(1 << (8 * self.width - 1)))
        if self.channels > 1:
            samples = samples.reshape(-1, self.channels).mean(axis=1, dtype=np.float32)
        return np.ascontiguousarray(samples, np.float32)


class Dialect:
    """One transcription's translation, from its `audio-start` to its `audio-stop`, or to the end
    of its turn: the utterance our VAD ended, when its text ends a sentence, or MID_SENTENCE_WAIT_S
    of further silence after one that does not (`turn_over`; the transcript then goes out while the
    client still sends audio)."""

    name = "wyoming"

    def __init__(self, audio: Format, language: str | None, end_of_turn: bool = True):
        self.format, self.language, self.end_of_turn = audio, language, end_of_turn
        self.turn_over = False
        self._last = ""                    # the last text committed ("": none yet)
        self._waited: int | None = None    # samples since an utterance ended mid-sentence (None: none)

    # -- client -> server --------------------------------------------------------------------
    def incoming(self, event: Event):
        if AudioChunk.is_type(event.type):
            if Format.of(event) != self.format:
                raise P.ProtocolError(P.ErrorCode.BAD_AUDIO, "audio-chunk's rate, width and channels differ from "
                                      "its audio-start's; one transcription has one format")
            samples = self.format.decode(event.payload or b"")
            if self._waited is not None:
                self._waited += len(samples)
                self.turn_over = self._waited >= MID_SENTENCE_WAIT_S * self.format.rate
            return samples.tobytes()   # pcm_f32le at the session's rate
        if AudioStop.is_type(event.type):
            return P.Close()
        if AudioStart.is_type(event.type):
            raise P.ProtocolError(P.ErrorCode.BAD_MESSAGE, "audio-start during a transcription; send audio-stop "
                                  "first")
        raise P.ProtocolError(P.ErrorCode.UNKNOWN_TYPE, f"{event.type[:40]!r} during a transcription; accepted: "
                              "audio-chunk, audio-stop")

    def speech_started(self, at: float) -> list:
        self._waited = None    # the utterance goes on after its pause
        return []

    # -- server -> client --------------------------------------------------------------------
    def outgoing(self, message: P.ServerMessage) -> list[Event]:
        if isinstance(message, P.Ready):
            return [TranscriptStart(language=self.language).event()]
        if isinstance(message, P.Committed):
            self._last = message.text or self._last
            if message.end_of_speech and self._last and self.end_of_turn:
                if ends_sentence(self._last):
                    self.turn_over = True
                else:
                    self._waited = 0
            return [TranscriptChunk(text=message.text).event()] if message.text else []
        if isinstance(message, P.Final):
            language = message.language or self.language
            return [Transcript(text=message.text.strip(), language=language).event(), TranscriptStop().event()]
        if isinstance(message, P.Error):
            return [error_event(message.code, message.message)]
        return []   # Partial: Wyoming has no unstable text


def session_config(audio: Format, language: str | None) -> P.SessionConfig:
    """A transcription's session: mono float32 at the client's rate, VAD on (a long dictation
    commits at each pause), the language given or detected."""
    return P.SessionConfig(sample_rate=audio.rate, encoding="pcm_f32le", language=language, vad=True)
