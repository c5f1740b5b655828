"""The Numba kernel of word alignment (guide §8): DTW over a token-by-frame cost with the pause
rule (docs/word-times.md). Private, `out=` arrays, shapes trusted; `alignment.dtw_path` wraps it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import JIT_OPTIONS
from ._cache import link_on_demand

# DTW steps: which neighbour a cell was reached from (a trace code is step * 3 + the neighbour's state)
_DIAG, _TOKEN, _FRAME = 0, 1, 2


@njit(**JIT_OPTIONS)
def _better(v, c, best_v, best_c):  # pragma: no cover - compiled
    """Whether (violations v, cost c) beats (best_v, best_c): fewer violations first, then cost."""
    return c < np.inf and (best_c == np.inf or v < best_v or (v == best_v and c < best_c))


@njit(**JIT_OPTIONS)
def _take_frame(s, snd, pause, word):  # pragma: no cover - compiled
    """(state, violations) after a unit in state s takes a frame: 0 no sound yet, 1 sound and no
    long pause since, 2 sound and then a long pause. A word that sounds again after a long pause
    straddles it, and the silence around the words (a unit that is not a word) takes sound: one
    violation each."""
    if snd:
        return 1, 1 if (s == 2 if word else s == 0) else 0
    if pause and s >= 1:
        return 2, 0
    return s, 0


@njit(**JIT_OPTIONS)
def _dtw(cost, unit_start, needs_sound, sounding, pause, acc_v, acc_c, trace, path_tok, path_frm):  # pragma: no cover
    """Fill acc_v, acc_c, trace (N+1, M+1, 3) for cost (N, M); write the path backwards into
    path_tok/path_frm (N+M,) from their start; return its length.

    Steps: diagonal (next row, next frame), token (next row, same frame), frame (same row, next
    frame). Rows are grouped into units (words, and the non-word rows around them): unit_start (N,)
    marks a row that opens one, needs_sound (N,) a row whose unit is a word. A path is scored by
    its violations first, then its cost. A violation is a unit boundary inside sound (the frames
    on both sides of it sounding, or both units sharing a sounding frame), a word unit left with
    no sounding frame, a word that sounds again after a long pause (`pause` (M,): the frames of
    silent runs long enough to part words), or a unit that is not a word with sound in it. State s
    (last axis) is _take_frame's. Ties prefer diagonal, then token, then frame, and lower states.
    With no unit starts, no word rows and no sounding frame this is the plain DTW recurrence."""
    n, m = cost.shape
    acc_v[:, :, :] = 0
    acc_c[:, :, :] = np.inf
    acc_c[0, 0, 0] = 0.0
    for i in range(1, n + 1):
        opens = unit_start[i - 1] and i > 1
        left_word = i > 1 and needs_sound[i - 2]
        word = needs_sound[i - 1]
        for j in range(1, m + 1):
            snd = sounding[j - 1]
            for s in range(3):
                best_v, best_c, code = 0, np.inf, 0
                for step in range(3):
                    pi = i if step == 2 else i - 1
                    pj = j if step == 1 else j - 1
                    for s0 in range(3):
                        c = acc_c[pi, pj, s0]
                        if c == np.inf:
                            continue
                        v = acc_v[pi, pj, s0]
                        if step < 2 and opens:
                            ns, dv = _take_frame(0, snd, pause[j - 1], word)
                            if snd and (step == 1 or (j >= 2 and sounding[j - 2])):
                                v += 1  # the boundary lies inside sound
                            if left_word and s0 == 0:
                                v += 1  # the word just left had no sound
                        else:
                            ns, dv = _take_frame(s0, snd, pause[j - 1], word)
                        v += dv
                        if ns == s and _better(v, c, best_v, best_c):
                            best_v, best_c, code = v, c, step * 3 + s0
                if best_c < np.inf:
                    acc_v[i, j, s] = best_v
                    acc_c[i, j, s] = cost[i - 1, j - 1] + best_c
                    trace[i, j, s] = code
    s, best_v, best_c = 0, 0, np.inf
    for end in range(3):
        v = acc_v[n, m, end] + (1 if (end == 0 and needs_sound[n - 1]) else 0)  # the last word without sound
        if _better(v, acc_c[n, m, end], best_v, best_c):
            s, best_v, best_c = end, v, acc_c[n, m, end]
    i, j, k = n, m, 0
    while i > 0 and j > 0:
        path_tok[k] = i - 1
        path_frm[k] = j - 1
        k += 1
        code = trace[i, j, s]
        step, s = code // 3, code % 3
        if step == _DIAG:
            i -= 1
            j -= 1
        elif step == _TOKEN:
            i -= 1
        else:
            j -= 1
    return k


link_on_demand(globals())   # last: every kernel of this module is defined
