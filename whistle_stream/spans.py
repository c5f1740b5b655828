"""Where the sound is in a pass's audio: pauses, the span a pass reads, how many words fit.

Signal rules the stream and the file reader share (guide §8): `last_pause` finds where an
utterance ends, `sound_span` frames what a pass transcribes, `close_pauses` shortens the pauses
inside it, `sayable` bounds the words a stretch of audio can hold. Plain NumPy on samples;
nothing here knows a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rules import LOUDNESS, PAUSE_KEEP_S, PAUSE_S, frame_levels, quiet_runs, quiet_under, speech_level

EDGE_ZEROS_S = 0.02  # digital silence a pass keeps after noisy speech (see sound_span)
CLEAN_MARGIN_S = 0.3  # ... and on each side of clean speech (no noise floor)
# Digital silence: samples under one step of 16-bit PCM (any 16-bit sample that is not zero is
# sound). A resampler's ringing and float round-off leave exact zeros a few 1e-6 off zero (a 48 kHz
# microphone resampled to 16 kHz), which is no sound.
DIGITAL_SILENCE = 1.0 / 32768.0
MAX_WORDS_PER_S = 6.0  # a pass reading more words than this a second of its audio heard none (see sayable)


def last_pause(audio: np.ndarray, rate: int, since: int = 0, pause_s: float = PAUSE_S,
               drop_db: float = LOUDNESS.pause_db, leading: bool = True) -> int | None:
    """The sample at the middle of the last pause of `audio` that ends after sample `since`, or None.

    A pause is a run of at least `pause_s` seconds of 20 ms frames all `drop_db` below the clip's
    speech level (the 90th percentile of its frame RMS); in digital silence the whole clip is one.
    A run still open at the clip's end counts from its start to the end. leading=False skips a run
    that starts the clip (quiet before anything was said ends no utterance)."""
    q = quiet_runs(audio, rate, drop_db)
    need = q.frames_in(pause_s)
    if q.frames < need or need < 1:
        return None
    for start, end in reversed(q.runs):  # newest first
        if q.sample(end) <= since:
            return None
        if end - start >= need and (leading or start > 0):
            return q.head + (start + end) * q.frame // 2
    return None


def sound_span(audio: np.ndarray, rate: int = 16000, keep_s: float = EDGE_ZEROS_S,
               margin_s: float = CLEAN_MARGIN_S, floor_db: float = LOUDNESS.clean_db) -> tuple[int, int]:
    """The span a pass transcribes: the non-zero audio, with digital silence kept around it only
    where the recording has no noise floor.

    Digital silence (a muted or gated input, the gaps of a spliced recording) carries no sound, and
    the front end standardises the features over the whole clip (§3), so a run of exact zeros next
    to noisy speech shifts every frame's features (a sentence read correctly alone is misread
    between runs of zeros). Noisy audio (its quietest 20 ms frame within `floor_db` of the speech level) is
    therefore cut to its non-zero samples plus `keep_s` after them, so that a word followed by
    silence still reads as ended. Clean audio (a quietest frame further down: speech recorded or
    synthesised without a noise floor) gets `margin_s` of its zeros on each side instead: models are
    trained on clips with silence around the speech, and cut tight a model doubles sentences
    (docs/streaming.md, "Silence inside the buffer").
    """
    bounds = _sound_bounds(audio)
    if bounds is None:
        return 0, 0
    first, last = bounds
    rms = frame_levels(audio[first:last], rate)
    if len(rms) >= 3:
        level = speech_level(rms)
        if level > 0.0 and float(rms.min()) < quiet_under(level, floor_db):
            margin = int(margin_s * rate)
            return max(0, first - margin), min(len(audio), last + margin)
    return first, min(len(audio), last + int(keep_s * rate))


def _sound_bounds(audio: np.ndarray, block: int = 16000) -> tuple[int, int] | None:
    """[first, last) of the samples that are not digital silence, or None: found a block at a time
    from each end (an hour's mask of every sample's index would be 460 MB)."""
    first = None
    for a in range(0, len(audio), block):
        hit = np.flatnonzero(np.abs(audio[a:a + block]) >= DIGITAL_SILENCE)
        if len(hit):
            first = a + int(hit[0])
            break
    if first is None:
        return None
    b = len(audio)
    while True:   # ends at the latest in the block holding `first`, which is sound
        a = max(first, b - block)
        hit = np.flatnonzero(np.abs(audio[a:b]) >= DIGITAL_SILENCE)
        if len(hit):
            return first, a + int(hit[-1]) + 1
        b = a


def sayable(words: int, seconds: float) -> bool:
    """Whether `words` words fit in `seconds` of audio: at most MAX_WORDS_PER_S a second, plus one
    (fast read English runs 4-5 words a second; a word cut at a pass's edge counts whole)."""
    return words <= MAX_WORDS_PER_S * seconds + 1


@dataclass(frozen=True)
class Closed:
    """Audio with its inner pauses shortened (`close_pauses`), and where: `cuts` holds, for each
    pause, the second in the closed audio where samples were taken out and how many seconds."""

    audio: np.ndarray
    cuts: tuple[tuple[float, float], ...] = ()

    def original(self, t: float) -> float:
        """A time in the closed audio (seconds) as a time in the audio it was made from."""
        return t + sum(removed for at, removed in self.cuts if t > at + 1e-9)


def close_pauses(audio: np.ndarray, rate: int = 16000, keep_s: float = PAUSE_KEEP_S, min_s: float = PAUSE_S) -> Closed:
    """`audio` with every pause inside it shortened to `keep_s`, half of it kept on each side. A
    pause here is a run of at least `min_s` of 20 ms frames `LOUDNESS.gap_db` under the speech
    level, not at either end: the room between words over a microphone's hiss, which the
    utterance rule's `pause_db` does not hear. A sentence said with a pause in it then reaches the
    model as the sentence: models are trained on fluent clips, and read a pause inside one as a
    sentence's end."""
    q = quiet_runs(audio, rate, LOUDNESS.gap_db)
    if q.silent:
        return Closed(audio)
    need, half = max(1, q.frames_in(min_s)), int(keep_s * rate / 2)
    pieces, cuts, at, length = [], [], 0, 0
    for start, end in q.runs:
        if start == 0 or end == q.frames or end - start < need:
            continue
        a, b = q.sample(start) + half, q.sample(end) - half
        if b <= a:
            continue
        pieces.append(audio[at:a])
        length += a - at
        cuts.append((length / rate, (b - a) / rate))
        at = b
    if not cuts:
        return Closed(audio)
    pieces.append(audio[at:])
    return Closed(np.concatenate(pieces), tuple(cuts))
