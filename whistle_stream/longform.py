"""Long audio: 30-second windows cut at sentence or word ends (guide §8, "Long audio"), or
utterances cut at the audio's pauses (`utterance_spans`, the stream's pause rule).

Up to `window_s` seconds is one pass. Longer audio runs window by window: each window is cut at its
last sentence end that falls at least 40% of the way in and half a second before its end, or failing
that at the last word ending a second before its end, or else at its end; the words before the cut
are kept and the next window starts at the cut. Word times count from the start of the clip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .rules import LOUDNESS, PAUSE_S, WINDOW_S, ends_sentence, quiet_runs

_EPS = 1e-9


def cut_point(words: Sequence[dict], window_s: float, min_frac: float = 0.4,
              sentence_margin_s: float = 0.5, word_margin_s: float = 1.0) -> float:
    """Seconds into a window of `window_s` seconds at which to cut it (§8).

    words: [{"word", "start", "end", ...}] with times in seconds from the window start, in order.
    Returns the end of the last sentence-ending word that ends at least `min_frac` of the way in and
    `sentence_margin_s` before the window end; else the end of the last word ending at least
    `word_margin_s` before the end (and after 0); else `window_s`.
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be positive seconds, got {window_s}")
    sentence_cut = word_cut = None
    for w in words:
        end = float(w["end"])
        if ends_sentence(w["word"]) and min_frac * window_s - _EPS <= end <= window_s - sentence_margin_s + _EPS:
            sentence_cut = end
        if _EPS < end <= window_s - word_margin_s + _EPS:
            word_cut = end
    if sentence_cut is not None:
        return sentence_cut
    if word_cut is not None:
        return word_cut
    return float(window_s)


@dataclass
class WindowCut:
    """One window of a long clip: where it started, how long it was, where it was cut (seconds
    into the window), and the words kept (end at or before the cut; times from the clip start)."""

    start_s: float
    length_s: float
    cut_s: float
    words: list[dict] = field(default_factory=list)
    last: bool = False


def iter_windows(total_s: float, transcribe_window: Callable[[float, float], list[dict]],
                 window_s: float = WINDOW_S, **cut_options) -> Iterator[WindowCut]:
    """Run `transcribe_window(start_s, length_s)` over a `total_s`-second clip, window by window.

    transcribe_window returns the words of audio [start_s, start_s + length_s) with times in seconds
    from start_s. Each yielded WindowCut keeps the words ending at or before the cut, shifted to clip
    time; the next window starts at the cut. The last window (the one reaching the clip end) keeps
    every word. cut_options go to `cut_point`.
    """
    if not total_s >= 0:
        raise ValueError(f"total_s must be non-negative seconds, got {total_s}")
    if not window_s > 0:
        raise ValueError(f"window_s must be positive seconds, got {window_s}")
    start = 0.0
    while True:
        length = min(window_s, total_s - start)
        last = start + window_s >= total_s - _EPS
        words = transcribe_window(start, length)
        cut = length if last else cut_point(words, length, **cut_options)
        kept = [{**w, "start": w["start"] + start, "end": w["end"] + start}
                for w in words if w["end"] <= cut + _EPS]
        yield WindowCut(start_s=start, length_s=length, cut_s=cut, words=kept, last=last)
        if last:
            return
        start += cut


def transcribe_long(total_s: float, transcribe_window: Callable[[float, float], list[dict]],
                    window_s: float = WINDOW_S, **cut_options) -> list[dict]:
    """All the kept words of `iter_windows`, in clip time."""
    return [w for window in iter_windows(total_s, transcribe_window, window_s, **cut_options)
            for w in window.words]


SPLIT_OVER_S = 6.0      # an utterance longer than this is split again at its longest shorter pause ...
SPLIT_PAUSE_S = 0.15    # ... of at least this many seconds, ...
MIN_PART_S = 1.0        # ... when both parts keep at least this much audio


def utterance_spans(pcm: np.ndarray, rate: int = 16000, pause_s: float = PAUSE_S,
                    drop_db: float = LOUDNESS.pause_db) -> list[tuple[int, int]]:
    """[(start, end)) sample spans of the utterances of a clip. It is cut in the middle of every
    pause (`pause_s` of 20 ms frames `drop_db` under the clip's speech level, the stream's rule),
    so each utterance keeps half of the pause on either side as lead-in and tail; an utterance
    longer than SPLIT_OVER_S is then split at its longest quiet run of SPLIT_PAUSE_S or more
    (sentences said with short breaths between them), again and again. Spans cover the clip
    without gaps; a clip without pauses is one span; digital silence is no span at all."""
    q = quiet_runs(pcm, rate, drop_db)
    if len(pcm) == 0 or q.silent:
        return []
    inner = [(a, b) for a, b in q.runs if a > 0 and b < q.frames]
    need = max(1, q.frames_in(pause_s))
    cuts = [(a + b) // 2 for a, b in inner if b - a >= need]          # in frames
    bounds = [0, *cuts, q.frames]
    spans = []
    for a, b in zip(bounds, bounds[1:]):
        spans += _split_long(a, b, inner, rate / q.frame)
    out = [(q.sample(a) if a else 0, q.sample(b) if b < q.frames else len(pcm)) for a, b in spans]
    return [(a, b) for a, b in out if b > a]


def _split_long(a: int, b: int, runs: list[tuple[int, int]], frames_per_s: float) -> list[tuple[int, int]]:
    """Frames [a, b) as one span, or split at the middle of its longest inside quiet run."""
    shortest = SPLIT_PAUSE_S * frames_per_s
    part = MIN_PART_S * frames_per_s
    if b - a <= SPLIT_OVER_S * frames_per_s:
        return [(a, b)]
    inside = [(r0, r1) for r0, r1 in runs if r1 - r0 >= shortest and (r0 + r1) // 2 - a >= part
              and b - (r0 + r1) // 2 >= part]
    if not inside:
        return [(a, b)]
    r0, r1 = max(inside, key=lambda r: (r[1] - r[0], -r[0]))
    cut = (r0 + r1) // 2
    return _split_long(a, cut, runs, frames_per_s) + _split_long(cut, b, runs, frames_per_s)
