"""Word timestamps from cross-attention by dynamic time warping (guide §8, "Word times").

The model runs a second, teacher-forced pass over the chosen transcript and collects the
cross-attention weights of the active decoder layers in the upper half of the stack. Here those
weights become word times: standardise each head's weights per frame across the tokens, sum the
heads, find a monotonic token-to-frame path through the negative by DTW, and group tokens into words
at pieces that begin with a space.

Two steps beyond §8 use the audio itself, where it has pauses (frames at least 35 dB under the
speech level): the path ends and begins words in the pauses, gives every word sound and no word a
pause of MIN_PAUSE_FRAMES or more inside it (`dtw_path`), and each word's edges are then trimmed
to its sounding frames (`trim_to_sound`). A small model's cross-attention often does not follow
the words (the demo model's does not), and a pause is where one word ends and the next begins far
more often than inside a word. Audio with no pause (noise above that floor, continuous speech)
leaves the path as §8 gives it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from .kernels.alignment import _dtw
from .rules import LOUDNESS, WORD_START, quiet, runs, speech_level

_STD_FLOOR = 1e-6  # a frame every token attends to equally carries no timing information
MIN_PAUSE_FRAMES = 2  # a pause that parts words: 160 ms; a stop consonant's closure ("pi-ck") can leave one
                      # silent 80 ms frame inside a word, and joined words one between them


class Detokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def long_pauses(sounding: np.ndarray, min_frames: int = MIN_PAUSE_FRAMES) -> np.ndarray:
    """(frames,) bool: the frames of every silent run of at least min_frames frames in `sounding`."""
    silent = ~np.asarray(sounding, dtype=bool)
    out = np.zeros(len(silent), dtype=bool)
    for a, b in runs(silent):
        if b - a >= min_frames:
            out[a:b] = True
    return out


def dtw_path(cost: np.ndarray, unit_start=None, needs_sound=None, sounding=None) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost monotonic path through a (rows, frames) cost matrix, from (0, 0) to
    (rows-1, frames-1) with steps (1, 1), (1, 0), (0, 1). Returns (row_idx, frame_idx), int64
    arrays of the same length, in path order.

    With no other argument this is §8's DTW. Given unit_start (rows,) bool (a row that opens a
    unit: a word, or the rows around the words), needs_sound (rows,) bool (the row's unit is a
    word) and sounding (frames,) bool (the frame holds sound), the path is the cheapest among
    those with the fewest violations, a violation being a unit boundary inside sound, a word with
    no sounding frame, a word that sounds on both sides of a pause of MIN_PAUSE_FRAMES or more, or
    a unit that is not a word (the rows around the words) with sound: where the audio pauses,
    words end and begin in the pauses."""
    c = np.asarray(cost)
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"cost must be a non-empty 2-D (tokens, frames) array, got shape {c.shape}")
    if not np.all(np.isfinite(c)):
        raise ValueError("cost must be finite (no NaN or infinity)")
    c = np.ascontiguousarray(c, dtype=np.float64)
    n, m = c.shape
    given = [a is not None for a in (unit_start, needs_sound, sounding)]
    if any(given) and not all(given):
        raise ValueError("unit_start, needs_sound and sounding go together: give all three or none")
    if all(given):
        unit_start, needs_sound, sounding = (np.asarray(a, dtype=np.bool_) for a in (unit_start, needs_sound, sounding))
        if unit_start.shape != (n,) or needs_sound.shape != (n,) or sounding.shape != (m,):
            raise ValueError(f"unit_start and needs_sound must be ({n},) and sounding ({m},) for a {c.shape} cost, got "
                             f"{unit_start.shape}, {needs_sound.shape} and {sounding.shape}")
        if np.any((needs_sound[1:] != needs_sound[:-1]) & ~unit_start[1:]):
            raise ValueError("needs_sound must be the same for every row of a unit (it changes only where unit_start is set)")
    else:
        unit_start, needs_sound, sounding = np.zeros(n, np.bool_), np.zeros(n, np.bool_), np.zeros(m, np.bool_)
    acc_v = np.empty((n + 1, m + 1, 3), dtype=np.int64)
    acc_c = np.empty((n + 1, m + 1, 3), dtype=np.float64)
    trace = np.zeros((n + 1, m + 1, 3), dtype=np.int8)
    path_tok = np.empty(n + m, dtype=np.int64)
    path_frm = np.empty(n + m, dtype=np.int64)
    k = _dtw(c, unit_start, needs_sound, sounding, long_pauses(sounding), acc_v, acc_c, trace, path_tok, path_frm)
    return path_tok[:k][::-1].copy(), path_frm[:k][::-1].copy()


def _word_starts(token_ids: Sequence[int], tokenizer: Detokenizer) -> list[bool]:
    """Whether each token begins a word: the first token, and every piece that begins with a space
    (from `id_to_piece` when the tokenizer has it, else from the growth of incremental decodes)."""
    to_piece = getattr(tokenizer, "id_to_piece", None)
    if callable(to_piece):
        return [i == 0 or str(to_piece(int(t))).startswith(WORD_START) for i, t in enumerate(token_ids)]
    starts, prev = [], ""
    for i in range(len(token_ids)):
        text = tokenizer.decode([int(t) for t in token_ids[: i + 1]])
        added = text[len(prev):] if text.startswith(prev) else text
        starts.append(i == 0 or added[:1].isspace())
        prev = text
    return starts


def token_frames(weights: np.ndarray, lead: int = 0, trail: int = 0, word_start=None,
                 sounding=None) -> tuple[np.ndarray, np.ndarray]:
    """Each token's first frame and last frame + 1, (tokens,) int64 each, from cross-attention
    weights (layers*heads, rows, frames): per-head z-score over the rows, heads summed, DTW. The
    first `lead` and last `trail` rows take part in the path but are not tokens: they are where
    the audio before the first word and after the last one goes (see `word_times`).

    Given word_start (tokens,) bool (the token opens a word) and sounding (frames,) bool (the
    frame holds sound), the path puts word boundaries in pauses where the audio has them and gives
    every word a sounding frame (dtw_path); the attention decides the rest."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 3 or 0 in w.shape:
        raise ValueError(f"weights must be a non-empty (layers*heads, tokens, frames) array, got shape {w.shape}")
    rows = w.shape[1]
    if lead < 0 or trail < 0 or lead + trail >= rows:
        raise ValueError(f"lead ({lead}) and trail ({trail}) rows must leave at least one of {rows} rows")
    if (word_start is None) != (sounding is None):
        raise ValueError("word_start and sounding go together: give both or neither")
    mean = w.mean(axis=1, keepdims=True)  # (LH, 1, frames)
    std = w.std(axis=1, keepdims=True)  # (LH, 1, frames)
    z = (w - mean) / np.maximum(std, _STD_FLOOR)  # (LH, tokens, frames)
    units = {}
    if word_start is not None:
        word_start = np.asarray(word_start, dtype=np.bool_)
        if word_start.shape != (rows - lead - trail,):
            raise ValueError(f"word_start must have one entry per token ({rows - lead - trail}), got {word_start.shape}")
        unit_start = np.zeros(rows, np.bool_)
        needs_sound = np.zeros(rows, np.bool_)
        unit_start[0] = True  # the lead rows are one unit, as are the trail rows
        unit_start[lead:rows - trail] = word_start
        unit_start[lead] = True
        if trail:
            unit_start[rows - trail] = True
        needs_sound[lead:rows - trail] = True
        units = {"unit_start": unit_start, "needs_sound": needs_sound, "sounding": sounding}
    tok, frm = dtw_path(-z.sum(axis=0), **units)  # (rows, frames) cost
    first = np.full(rows, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(rows, -1, dtype=np.int64)
    np.minimum.at(first, tok, frm)
    np.maximum.at(last, tok, frm)
    keep = slice(lead, rows - trail)
    return first[keep], last[keep] + 1


def word_times(weights: np.ndarray, token_ids: Sequence[int], token_probs: Sequence[float],
               tokenizer: Detokenizer, frame_seconds: float, offset_s: float = 0.0,
               lead: int = 0, trail: int = 0, sounding=None) -> list[dict]:
    """Words with times from a teacher-forced pass (§8).

    weights: (layers*heads, lead + tokens + trail, frames) cross-attention weights over the clip's
        encoder frames: the rows that predict the transcript's text tokens, after `lead` rows and
        before `trail` rows that join the path without being words. The model passes one of each,
        the rows that predict the language tag and </s>: they take the silence before the first
        word and after the last (whisper's timing keeps its start and end rows in the path for the
        same reason). Without them the path must start the first word at frame 0: on held-out
        espeak-ng sentences after 0.2-0.8 s of silence (demo model, 131 words), word starts within
        160 ms of the synthesiser's word events 50 % -> 71 %, median error 0.16 -> 0.08 s
        (benchmarks/word_times.py).
    token_ids, token_probs: the text tokens and each one's probability (0..1).
    tokenizer: has `decode(ids) -> str`, and preferably `id_to_piece(id) -> str`.
    frame_seconds: seconds per encoder frame (0.08); offset_s: time of frame 0 in seconds.
    sounding: optional (frames,) bool, which frames hold sound (`sounding_frames`): word boundaries
        then fall in the audio's pauses where it has them, and every word gets sound (token_frames).
    Returns [{"word", "start", "end", "probability"}], times in seconds, rounded to ms,
    non-decreasing and non-overlapping within [offset_s, offset_s + frames * frame_seconds].
    """
    w = np.asarray(weights)
    n = len(token_ids)
    if w.ndim != 3 or w.shape[1] != n + lead + trail or len(token_probs) != n:
        raise ValueError(f"weights must be (layers*heads, rows, frames) with rows = lead + len(token_ids) + trail = "
                         f"{lead} + {n} + {trail} and len(token_probs) = {n}, got weights {w.shape} and "
                         f"{len(token_probs)} probabilities")
    if frame_seconds <= 0:
        raise ValueError(f"frame_seconds must be positive, got {frame_seconds}")
    if n == 0:
        return []
    starts = _word_starts(token_ids, tokenizer)
    first, end = token_frames(w, lead, trail, None if sounding is None else starts, sounding)
    probs = np.asarray(token_probs, dtype=np.float64)
    bounds = [i for i, s in enumerate(starts) if s] + [n]
    lo, hi = offset_s, offset_s + w.shape[2] * frame_seconds
    words: list[dict] = []
    prev_end = lo
    for a, b in zip(bounds[:-1], bounds[1:]):
        text = tokenizer.decode([int(t) for t in token_ids[a:b]]).strip()
        if not text:
            continue
        start = min(max(round(offset_s + first[a] * frame_seconds, 3), prev_end), hi)
        stop = min(max(round(offset_s + end[b - 1] * frame_seconds, 3), start), hi)
        words.append({"word": text, "start": start, "end": stop, "probability": float(probs[a:b].mean())})
        prev_end = stop
    return words


def sounding_frames(pcm: np.ndarray, frame_samples: int, frames: int,
                    floor_db: float = LOUDNESS.sounding_db) -> np.ndarray:
    """(frames,) bool: whether each encoder frame of pcm (frame k = samples [k, k + 1) x
    frame_samples, zero past the end) holds sound, i.e. its RMS is within floor_db of the clip's
    speech level (the 90th percentile frame). All True when nothing stands out (noise as loud as
    the speech, or silence), so that word times are then left as the path gave them."""
    if frame_samples <= 0 or frames < 0:
        raise ValueError(f"frame_samples must be positive and frames non-negative, got {frame_samples}, {frames}")
    x = np.zeros(frames * frame_samples, np.float64)
    n = min(len(pcm), len(x))
    x[:n] = np.asarray(pcm[:n], np.float64)
    rms = np.sqrt(np.mean(x.reshape(frames, frame_samples) ** 2, axis=1)) if frames else np.zeros(0)
    level = speech_level(rms)
    if level <= 0.0:
        return np.ones(frames, bool)
    return ~quiet(rms, level, floor_db)


def trim_to_sound(words: list[dict], sounding: np.ndarray, frame_seconds: float, offset_s: float = 0.0) -> list[dict]:
    """Each word's span shrunk to its first and last sounding encoder frame (80 ms resolution).

    The DTW path gives every frame to some token, so the silence between two words belongs to one
    of them: a word said before a pause would end at the next word's start. Dropping the silent
    frames at a word's edges puts its start and end where its sound is. A word with no sounding
    frame in its span keeps the span the path gave it."""
    out = []
    for w in words:
        a = int(round((w["start"] - offset_s) / frame_seconds))
        b = int(round((w["end"] - offset_s) / frame_seconds))
        on = np.flatnonzero(sounding[max(a, 0):max(b, 0)])
        if len(on):
            start = round(offset_s + (a + on[0]) * frame_seconds, 3)
            end = round(offset_s + (a + on[-1] + 1) * frame_seconds, 3)
            w = {**w, "start": max(w["start"], start), "end": min(w["end"], end)}
        out.append(w)
    return out
