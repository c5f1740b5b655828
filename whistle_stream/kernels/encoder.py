"""Numba kernels only the encoder uses: the stem's strided and depthwise convolutions and the
conv module's depthwise convolution over time (guide §3, §6). Private, `out=` arrays, shapes trusted.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import GEMM_FASTMATH, JIT_OPTIONS
from ._cache import link_on_demand


@njit(fastmath=GEMM_FASTMATH, **JIT_OPTIONS)
def _stem_conv_in(x, w, out):
    """3x3 stride-2 conv, zero padding 1, one input channel -> C.

    x (T, M) features; w (9, C) with row 3 * time + mel; out (ceil(T/2), ceil(M/2), C).
    Cross-correlation as lax.conv_general_dilated computes it (the kernel is not flipped).
    """
    t_in, m_in = x.shape
    t_out, m_out, c_dim = out.shape
    xp = np.zeros((2 * t_out + 2, 2 * m_out + 2), np.float32)  # one zero of padding each side
    xp[1:t_in + 1, 1:m_in + 1] = x
    taps = np.empty(9, np.float32)
    for t in range(t_out):
        for f in range(m_out):
            for i in range(3):
                for j in range(3):
                    taps[3 * i + j] = xp[2 * t + i, 2 * f + j]
            o = out[t, f]
            for c in range(c_dim):
                acc = np.float32(0.0)
                for k in range(9):
                    acc += taps[k] * w[k, c]
                o[c] = acc


@njit(fastmath=GEMM_FASTMATH, **JIT_OPTIONS)
def _stem_depthwise(x, w, out):
    """Depthwise 3x3 stride-2 conv, zero padding 1: x (T, M, C), w (9, C), out (ceil(T/2), ceil(M/2), C).

    Interior outputs take the nine taps unrolled (vectorised over channels); the border ones,
    whose taps reach into the padding, go through the bounds-checked loop.
    """
    t_in, m_in, c_dim = x.shape
    t_out, m_out, _ = out.shape
    for t in range(t_out):
        for f in range(m_out):
            o = out[t, f]
            if 2 * t - 1 >= 0 and 2 * t + 1 < t_in and 2 * f - 1 >= 0 and 2 * f + 1 < m_in:
                a0, a1, a2 = x[2 * t - 1, 2 * f - 1], x[2 * t - 1, 2 * f], x[2 * t - 1, 2 * f + 1]
                b0, b1, b2 = x[2 * t, 2 * f - 1], x[2 * t, 2 * f], x[2 * t, 2 * f + 1]
                c0, c1, c2 = x[2 * t + 1, 2 * f - 1], x[2 * t + 1, 2 * f], x[2 * t + 1, 2 * f + 1]
                for c in range(c_dim):
                    o[c] = (a0[c] * w[0, c] + a1[c] * w[1, c] + a2[c] * w[2, c]
                            + b0[c] * w[3, c] + b1[c] * w[4, c] + b2[c] * w[5, c]
                            + c0[c] * w[6, c] + c1[c] * w[7, c] + c2[c] * w[8, c])
                continue
            for c in range(c_dim):
                o[c] = 0.0
            for i in range(3):
                ti = 2 * t + i - 1
                if ti < 0 or ti >= t_in:
                    continue
                for j in range(3):
                    fj = 2 * f + j - 1
                    if fj < 0 or fj >= m_in:
                        continue
                    xv = x[ti, fj]
                    wk = w[3 * i + j]
                    for c in range(c_dim):
                        o[c] += xv[c] * wk[c]


@njit(fastmath=GEMM_FASTMATH, **JIT_OPTIONS)
def _conv_time(g, w, first, last, out):
    """Depthwise conv over time, "SAME" zero padding, the kernel applied unflipped
    (lax.conv_general_dilated is a cross-correlation): out[t, c] = sum_k g[t + k - (K-1)//2, c] * w[k, c]
    for the rows t in [first, last). g (T, C), w (K, C), out (T, C)."""
    t_dim = g.shape[0]
    taps, c_dim = w.shape
    left = (taps - 1) // 2
    for t in range(first, last):
        o = out[t]
        for c in range(c_dim):
            o[c] = 0.0
        for k in range(taps):
            s = t + k - left
            if s < 0 or s >= t_dim:
                continue
            gs = g[s]
            wk = w[k]
            for c in range(c_dim):
                o[c] += gs[c] * wk[c]


link_on_demand(globals())   # last: every kernel of this module is defined
