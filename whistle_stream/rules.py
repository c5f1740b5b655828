"""Rules several stages share, each defined once: the 30 s window, sentence ends, the word-start
marker, and the loudness rules (docs/engine.md §8, docs/streaming.md, docs/word-times.md).

Loudness is judged against a clip's *speech level*, the 90th percentile of its frames' RMS, and
a frame is *quiet* when it is at least some dB under that level. Each rule's dB figure is in
`LOUDNESS`, the one table of thresholds:

| rule                           | dB under the speech level | used by                         |
|--------------------------------|---------------------------|---------------------------------|
| `pause_db`: a pause, silence   | 40                        | streaming (utterance ends)      |
| `clean_db`: no noise floor     | 50                        | streaming (`sound_span`)        |
| `sounding_db`: a frame sounds  | 35                        | word times (`sounding_frames`)  |
| `gap_db`: a gap between words  | 20                        | pauses closed (`close_pauses`)  |
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WINDOW_S = 30.0             # §8: up to 30 s of audio is one pass; longer audio runs in such windows
SENTENCE_END = (".", "!", "?", "\u2026")
_CLOSERS = "\"'\u201d\u2019)]}\u00bb"   # a sentence can end inside a quote or bracket: `said."`
WORD_START = "\u2581"       # "▁": sentencepiece's visible space, which opens a word's first piece
SPEECH_PERCENTILE = 90.0    # the frame RMS percentile that stands for a clip's speech level
PAUSE_FRAME = 320           # samples at 16 kHz: the 20 ms frames pauses are measured in
BEAMS = 5                   # the guide's beam width (§6): every search that does not say otherwise
MAX_BEAMS = 16              # the widest search any caller may ask for
PAUSE_S = 0.45              # quiet frames (`LOUDNESS.pause_db`) this long make a pause between utterances
# A pause inside a sentence ends an utterance, not the sentence: the passes after it still read the
# words before it (their audio stays in the stream's buffer), back to the sentence's start, when
# that lies at most CONTEXT_S before the pause and the pause lasts at most CONTEXT_PAUSE_S.
CONTEXT_S = 10.0
CONTEXT_PAUSE_S = 1.5
# A pause inside the audio a pass reads is shortened to this much: a model trained on fluent speech
# reads "set a timer for ... twelve minutes" as one sentence once the pause is closed, and as two
# (or a guess at one) with it.
PAUSE_KEEP_S = 0.1
# How `transcribe` reads a clip, the first the default everywhere (Python API, CLI, server):
# "utterances" reads up to 30 s in one pass and longer audio cut at its pauses, in passes of whole
# utterances; "windows" runs the guide's 30 s windows (§8) exactly.
READ_BY = ("utterances", "windows")


def pause_frame(rate: int) -> int:
    """Samples in one 20 ms frame at `rate`."""
    return PAUSE_FRAME * rate // 16000


@dataclass(frozen=True)
class Loudness:
    pause_db: float = 40.0
    clean_db: float = 50.0
    sounding_db: float = 35.0
    gap_db: float = 20.0


LOUDNESS = Loudness()


def ends_sentence(word: str) -> bool:
    """Whether a word's text ends a sentence (. ! ? …, possibly before closing quotes/brackets)."""
    return word.rstrip().rstrip(_CLOSERS).endswith(SENTENCE_END)


def speech_level(rms: np.ndarray) -> float:
    """A clip's speech level from its frames' RMS (0.0 for no frames)."""
    return float(np.percentile(rms, SPEECH_PERCENTILE)) if len(rms) else 0.0


def quiet_under(level: float, db: float) -> float:
    """The RMS at or under which a frame is `db` under `level`."""
    return level * 10.0 ** (-db / 20.0)


def quiet(rms: np.ndarray, level: float, db: float) -> np.ndarray:
    """(frames,) bool: the frames at least `db` under `level`."""
    return np.asarray(rms) <= quiet_under(level, db)


LEVEL_BLOCK_FRAMES = 1500  # 30 s of 20 ms frames (`frame_levels` works through a clip this much at a time)


def frame_levels(audio: np.ndarray, rate: int = 16000) -> np.ndarray:
    """RMS of each 20 ms frame of `audio`, frames aligned to its end (a partial frame at the start
    is left out); empty when the audio is shorter than a frame."""
    frame = pause_frame(rate)
    n = len(audio) // frame
    frames = np.asarray(audio[len(audio) - n * frame:], np.float32).reshape(n, frame)
    out = np.empty(n, np.float64)
    # a block of frames at a time: the squares in float64 of a whole hour would be 460 MB
    for a in range(0, n, LEVEL_BLOCK_FRAMES):
        b = min(n, a + LEVEL_BLOCK_FRAMES)
        out[a:b] = np.sqrt(np.mean(np.square(frames[a:b], dtype=np.float64), axis=1))
    return out


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) runs of True in a boolean mask, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, bool).astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


@dataclass(frozen=True)
class QuietRuns:
    """A clip measured by the pause rule: its 20 ms frames (aligned to the clip's end) and the runs
    of them `drop_db` under its speech level. Digital silence has no speech level: every frame is
    quiet, and the whole clip is one run. A pause is such a run at least PAUSE_S long."""

    rate: int                      # samples per second
    head: int                      # samples before the first whole frame
    frame: int                     # samples per frame
    frames: int                    # whole frames
    runs: list[tuple[int, int]]    # [start, end) quiet frame runs, in order
    silent: bool                   # digital silence (no speech level)

    def frames_in(self, seconds: float) -> int:
        """Frames in `seconds`, rounded (the length a run needs to be a pause)."""
        return int(round(seconds * self.rate / self.frame))

    def sample(self, frame: int) -> int:
        """The clip sample where frame index `frame` starts."""
        return self.head + frame * self.frame


def quiet_runs(audio: np.ndarray, rate: int, drop_db: float = LOUDNESS.pause_db) -> QuietRuns:
    """`audio` measured by the pause rule (`QuietRuns`): the one definition of what is quiet that
    the stream's utterance ends (`spans.last_pause`) and a file's utterances
    (`longform.utterance_spans`) are both cut by."""
    frame = pause_frame(rate)
    rms = frame_levels(audio, rate)
    level = speech_level(rms)
    still = quiet(rms, level, drop_db) if level > 0.0 else np.ones(len(rms), bool)
    return QuietRuns(rate=rate, head=len(audio) - len(rms) * frame, frame=frame, frames=len(rms), runs=runs(still),
                     silent=level <= 0.0)
