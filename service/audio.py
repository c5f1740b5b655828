"""One session's audio path before the engine: resample to the model's rate (16 kHz for Whistle),
gate speech, cut engine steps.

`AudioPath.push(float32 at the client's rate)` returns events: `Chunk`s of model-rate audio for the
engine (whole steps while speech goes on, the remainder when it ends) and `EndOfSpeech` after
`end_of_speech_ms` of non-speech following speech. With VAD off, every sample goes to the engine in
whole steps and no `EndOfSpeech` is produced. No passes run on silence: audio between utterances
never reaches the engine. `TimeMap` turns engine seconds (which skip the dropped silence) back into
session seconds for word times.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np
import soxr
import webrtcvad

from whistle_stream.frontend import MODEL_RATE

from .config import DEFAULTS

VAD_FRAME_MS = 30      # one of webrtcvad's three frame lengths
PREROLL_FRAMES = 10    # 300 ms kept before a speech onset so the first word's attack is not cut
ONSET_FRAMES = 3       # speech frames among the last ONSET_WINDOW that start an utterance (90 ms)
ONSET_WINDOW = 10      # ... so a single click is not speech
PRIME_FRAMES = 100     # a resumed path runs the VAD over this much replayed audio (3 s) before its
                       # position: webrtcvad adapts to the signal, and a fresh one decides differently


@dataclass
class Chunk:
    audio: np.ndarray  # float32 at the model's rate
    start: float       # session seconds of audio[0]
    first: bool        # first chunk of an utterance (or of the stream with VAD off)
    refill: bool = False  # replayed audio an earlier session's engine stream held (resume)


@dataclass
class EndOfSpeech:
    at: float          # session seconds where the speech ended


class AudioPath:
    """A client's audio at `sample_rate` -> the model's `rate`, gated by the VAD, in steps."""

    def __init__(self, sample_rate: int, *, rate: int = MODEL_RATE, step_s: float = DEFAULTS.step_s,
                 vad: bool = True, aggressiveness: int = DEFAULTS.vad_aggressiveness,
                 end_of_speech_ms: int = DEFAULTS.end_of_speech_ms):
        self.sample_rate, self.rate = sample_rate, rate
        self.step = int(round(step_s * rate))
        self.frame = VAD_FRAME_MS * rate // 1000          # webrtcvad takes 8, 16, 32 or 48 kHz
        self.vad = webrtcvad.Vad(aggressiveness) if vad else None
        self.hangover = max(1, end_of_speech_ms // VAD_FRAME_MS)   # VAD frames of non-speech
        self._resampler = (None if sample_rate == rate else
                           soxr.ResampleStream(sample_rate, rate, 1, dtype="float32", quality="HQ"))
        self._frame_tail = np.zeros(0, np.float32)  # model-rate samples not yet a whole VAD frame
        self._position = 0                          # model-rate samples seen (session time)
        self._buffer: list[np.ndarray] = []         # audio for the engine, not yet a whole step
        self._buffered = 0
        self._buffer_start = 0                      # session sample of the buffer's first sample
        self._first = True
        self._preroll: deque[np.ndarray] = deque(maxlen=PREROLL_FRAMES)
        self._recent: deque[bool] = deque(maxlen=ONSET_WINDOW)
        self.in_speech = self.vad is None
        self._silent_frames = 0
        self._replay: _Replay | None = None   # after `restore`: where replayed samples go
        self._preroll_part = np.zeros(0, np.float32)
        self._prime_part = np.zeros(0, np.float32)

    def _prime(self, piece: np.ndarray) -> None:
        """Replayed audio before the restored position: through the VAD, its answers unused."""
        frames, self._prime_part = _whole_frames(self._prime_part, piece, self.frame)
        assert self.vad is not None   # a state with VAD off holds no priming audio
        for frame in frames:
            self.vad.is_speech(_pcm16(frame), self.rate)

    def _preroll_bytes(self, piece: np.ndarray) -> None:
        """Replayed preroll samples back into whole VAD frames."""
        frames, self._preroll_part = _whole_frames(self._preroll_part, piece, self.frame)
        self._preroll.extend(frames)

    def _resample(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        if self._resampler is None:
            return samples
        return np.asarray(self._resampler.resample_chunk(samples, last=last), dtype=np.float32)

    def _append(self, audio: np.ndarray, start: int, out: list) -> None:
        if not len(audio):
            return
        if not self._buffered:
            self._buffer_start = start
        self._buffer.append(audio)
        self._buffered += len(audio)
        while self._buffered >= self.step:
            joined = np.concatenate(self._buffer)
            out.append(Chunk(joined[:self.step], self._buffer_start / self.rate, self._first))
            self._first = False
            rest = joined[self.step:]
            self._buffer_start += self.step
            self._buffer, self._buffered = ([rest], len(rest)) if len(rest) else ([], 0)

    def _drain(self, out: list) -> None:
        if self._buffered:
            out.append(Chunk(np.concatenate(self._buffer), self._buffer_start / self.rate, self._first))
            self._first = False
            self._buffer, self._buffered = [], 0

    def _frame(self, frame: np.ndarray, out: list) -> None:
        start = self._position
        self._position += len(frame)
        assert self.vad is not None   # frames are cut only with VAD on
        speech = self.vad.is_speech(_pcm16(frame), self.rate)
        self._recent.append(speech)
        if not self.in_speech:
            self._preroll.append(frame)
            if speech and sum(self._recent) >= ONSET_FRAMES:
                self.in_speech, self._silent_frames, self._first = True, 0, True
                frames = list(self._preroll)
                self._preroll.clear()
                self._append(np.concatenate(frames), self._position - sum(map(len, frames)), out)
            return
        self._append(frame, start, out)
        self._silent_frames = 0 if speech else self._silent_frames + 1
        if self._silent_frames >= self.hangover:
            self._drain(out)
            self.in_speech = False
            self._recent.clear()
            out.append(EndOfSpeech(self._position / self.rate))

    def push(self, samples: np.ndarray, last: bool = False) -> list:
        """Float32 audio at the session's rate -> [Chunk | EndOfSpeech]. `last`: flush the resampler."""
        audio = self._resample(np.asarray(samples, np.float32), last=last)
        out: list = []
        if self._replay is not None:
            audio = self._replay.take(audio, self, out)
        if self.vad is None:
            self._append(audio, self._position, out)
            self._position += len(audio)
            return out
        if len(self._frame_tail):
            audio = np.concatenate([self._frame_tail, audio])
        whole = len(audio) - len(audio) % self.frame
        for i in range(0, whole, self.frame):
            self._frame(audio[i:i + self.frame], out)
        self._frame_tail = audio[whole:]
        return out

    def flush(self, last: bool = False) -> list:
        """Everything buffered for the engine now (finalize; `last`: the stream ends)."""
        out = self.push(np.zeros(0, np.float32), last=True) if last else []
        if last and len(self._frame_tail) and self.in_speech:
            self._append(self._frame_tail, self._position, out)
            self._position += len(self._frame_tail)
            self._frame_tail = np.zeros(0, np.float32)
        if self.in_speech or self.vad is None:
            self._drain(out)
        return out

    # -- resume ------------------------------------------------------------------------------
    def state(self) -> dict:
        """Where the path stands (JSON-able, no audio): what it has framed, what it holds back."""
        return {"vad": self.vad is not None, "position": self._position, "tail": len(self._frame_tail),
                "in_speech": self.in_speech,
                "silent": self._silent_frames, "recent": [bool(r) for r in self._recent], "first": self._first,
                "preroll": sum(len(f) for f in self._preroll), "buffer_start": self._buffer_start,
                "buffered": self._buffered}

    @staticmethod
    def _held(state: dict, frame: int) -> list[tuple[int, int, str]]:
        """The session sample ranges [a, b) a path restored from `state` takes back from the
        replay, and what each is: preroll frames, a step in the making, the frame tail, and the
        audio that primes a fresh VAD."""
        position = int(state["position"])
        held = []
        if state["preroll"]:
            held.append((position - int(state["preroll"]), position, "preroll"))
        if state["buffered"]:
            held.append((int(state["buffer_start"]), int(state["buffer_start"]) + int(state["buffered"]), "buffer"))
        if state["tail"]:
            held.append((position, position + int(state["tail"]), "tail"))
        if state["vad"]:
            held.append((max(0, position - PRIME_FRAMES * frame), position, "prime"))
        return held

    @staticmethod
    def replay_start(state: dict, rate: int = MODEL_RATE) -> int:
        """The first session sample (at the model's `rate`) a path restored from `state` needs again."""
        frame = VAD_FRAME_MS * rate // 1000
        return min([int(state["position"])] + [a for a, _, _ in AudioPath._held(state, frame)])

    def restore(self, state: dict, start: int, refill: list[tuple[int, int]]) -> None:
        """Continue `state()`: replayed audio begins at session sample `start`; the samples in
        `refill` ([a, b) session ranges) go out as Chunk(refill=True) for the engine stream, the
        rest re-fills what the path held (preroll, a step in the making, the frame tail); from
        the state's end on, the path runs as before."""
        self._position = int(state["position"])
        self.in_speech = bool(state["in_speech"])
        self._silent_frames = int(state["silent"])
        self._recent = deque((bool(r) for r in state["recent"]), maxlen=ONSET_WINDOW)
        self._first = bool(state["first"])
        self._buffer, self._buffered, self._buffer_start = [], 0, int(state["buffer_start"])
        end = self._position + int(state["tail"])
        held = [(a, b, "refill") for a, b in refill] + self._held(state, self.frame)
        self._replay = _Replay(int(start), end, sorted(held))


def _pcm16(frame: np.ndarray) -> bytes:
    """A VAD frame as webrtcvad takes it: 16-bit PCM."""
    return (np.clip(frame, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def _whole_frames(part: np.ndarray, piece: np.ndarray, frame: int) -> tuple[list[np.ndarray], np.ndarray]:
    """`part` (less than a VAD frame) followed by `piece`, as whole VAD frames and what is left."""
    pending = np.concatenate([part, piece]) if len(part) else piece
    whole = len(pending) - len(pending) % frame
    return [pending[i:i + frame] for i in range(0, whole, frame)], pending[whole:]


class _Replay:
    """Routes replayed samples [start, end) to where the earlier session had them."""

    def __init__(self, start: int, end: int, held: list[tuple[int, int, str]]):
        self.at, self.end, self.held = start, end, held

    def take(self, audio: np.ndarray, path: AudioPath, out: list) -> np.ndarray:
        """Consume the replayed part of `audio`; returns what comes after the replay."""
        n = min(len(audio), self.end - self.at)
        lo, hi = self.at, self.at + n
        for a, b, kind in self.held:
            a2, b2 = max(a, lo), min(b, hi)
            if a2 >= b2:
                continue
            piece = audio[a2 - lo:b2 - lo]
            if kind == "refill":
                out.append(Chunk(piece, a2 / path.rate, False, refill=True))
            elif kind == "preroll":
                path._preroll_bytes(piece)
            elif kind == "buffer":
                path._buffer.append(piece)
                path._buffered += len(piece)
            elif kind == "prime":
                path._prime(piece)
            else:
                path._frame_tail = np.concatenate([path._frame_tail, piece])
        self.at = hi
        if self.at >= self.end:
            path._replay = None
        return audio[n:]


class TimeMap:
    """Engine seconds -> session seconds, for an engine that only saw the speech chunks. Segments
    that end more than KEEP_S before the engine's newest audio are forgotten: an engine stream's
    buffer never holds more than 30 s, so no word time or resume reaches back further."""

    KEEP_S = 90.0

    def __init__(self, rate: int = MODEL_RATE):
        self.rate = rate
        self._engine: list[float] = []   # engine seconds where each contiguous segment starts
        self._session: list[float] = []  # ... and the session seconds it corresponds to
        self._engine_end = 0.0
        self._session_end: float | None = None

    def add(self, chunk: Chunk) -> None:
        seconds = len(chunk.audio) / self.rate
        if self._session_end is None or abs(chunk.start - self._session_end) > 1e-6:
            self._engine.append(self._engine_end)
            self._session.append(chunk.start)
        self._engine_end += seconds
        self._session_end = chunk.start + seconds
        if len(self._engine) > 64 and self._engine[32] < self._engine_end - self.KEEP_S:
            stale = bisect.bisect_right(self._engine, self._engine_end - self.KEEP_S) - 1
            del self._engine[:stale], self._session[:stale]

    def state(self, since: float = 0.0) -> dict:
        """The segments that map engine seconds from `since` on (JSON-able)."""
        i = max(0, bisect.bisect_right(self._engine, since) - 1)
        return {"engine": self._engine[i:], "session": self._session[i:], "engine_end": self._engine_end,
                "session_end": self._session_end}

    def restore(self, state: dict) -> None:
        self._engine = [float(x) for x in state["engine"]]
        self._session = [float(x) for x in state["session"]]
        self._engine_end = float(state["engine_end"])
        self._session_end = None if state["session_end"] is None else float(state["session_end"])

    def session_ranges(self, start: float, end: float) -> list[tuple[int, int]]:
        """The session sample ranges [a, b) (at the model's rate) holding engine seconds [start, end)."""
        out = []
        bounds = self._engine + [self._engine_end]
        for i, e0 in enumerate(self._engine):
            a, b = max(e0, start), min(bounds[i + 1], end)
            if a < b:
                s0 = int(round((self._session[i] + (a - e0)) * self.rate))
                out.append((s0, s0 + int(round((b - a) * self.rate))))
        return out

    def __call__(self, t: float) -> float:
        i = bisect.bisect_right(self._engine, t) - 1
        if i < 0:
            return t
        return self._session[i] + (t - self._engine[i])
