"""Numba kernels only the decoder uses: causal taps over a history, attention over the per-beam
KV pool and over the clip's memory, and the engram table gather (guide §6).

Like `kernels.py`: private, `out=` arrays, shapes trusted (decoder.py checks them at its boundary),
all kernels release the GIL. Sums follow the reference's order where it is cheap to (taps j = 0
first, softmax as exp(x - max) / sum), so the only differences left are float summation order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import GEMM_FASTMATH


def _jit(fastmath=False):
    return njit(cache=True, nogil=True, fastmath=fastmath)


@_jit()
def _causal_taps(new, hist, taps, dilation, start, out):
    """Depthwise causal convolution over time, continuing a history.

    new (B, S, D): raw rows at positions start .. start+S-1 of each beam row b;
    hist (B, H, D): the same beam's raw rows at positions start-H .. start-1 (oldest first);
    taps (J, D). out[b, i] = sum_j taps[j] * z(p - j * dilation), p = start + i, with z(q) = 0
    for q < 0 (the reference's shift-right plus position mask). Needs H >= (J - 1) * dilation.
    """
    n_rows, n_new, width = new.shape
    depth = hist.shape[1]
    for b in range(n_rows):
        for i in range(n_new):
            p = start + i
            o = out[b, i]
            for d in range(width):
                o[d] = 0.0
            for j in range(taps.shape[0]):
                q = p - j * dilation
                if q < 0:
                    break
                if q >= start:
                    src = new[b, q - start]
                else:
                    src = hist[b, depth - (start - q)]
                for d in range(width):
                    o[d] += taps[j, d] * src[d]


@_jit(GEMM_FASTMATH)
def _attend_pool(q, k_pool, v_pool, anc, start, q_scale, logit_scale, scores, out):
    """Causal self-attention of new positions over each beam's cached keys and values.

    q (B, S, H, dq): int8-fake-quantised queries at positions start .. start+S-1;
    k_pool (T, R, KH, dq), v_pool (T, R, KH, dv): position s of pool row r;
    anc (B_cap, T) int32: pool row holding position s of beam b (the block table);
    scores (T,) float32 scratch; out (B, S, H, dv).
    Query head h reads kv head h // (H // KH) (grouped heads, as jax's dot_product_attention).
    Logits are ((q * q_scale) . k) * logit_scale, the reference's flash path.
    """
    n_rows, n_new, heads, dq = q.shape
    kv_heads = k_pool.shape[2]
    dv = v_pool.shape[3]
    group = heads // kv_heads
    qs = np.empty(dq, np.float32)
    for b in range(n_rows):
        for i in range(n_new):
            p = start + i
            for h in range(heads):
                g = h // group
                for d in range(dq):
                    qs[d] = q[b, i, h, d] * q_scale
                top = np.float32(-np.inf)
                for s in range(p + 1):
                    kr = k_pool[s, anc[b, s], g]
                    acc = np.float32(0.0)
                    for d in range(dq):
                        acc += qs[d] * kr[d]
                    acc *= logit_scale
                    scores[s] = acc
                    if acc > top:
                        top = acc
                total = np.float32(0.0)
                for s in range(p + 1):
                    e = np.exp(scores[s] - top)
                    scores[s] = e
                    total += e
                o = out[b, i, h]
                for d in range(dv):
                    o[d] = 0.0
                for s in range(p + 1):
                    w = scores[s] / total
                    vr = v_pool[s, anc[b, s], g]
                    for d in range(dv):
                        o[d] += w * vr[d]


@_jit(GEMM_FASTMATH)
def _attend_memory(q, k_mem, v_mem, q_scale, logit_scale, weights, out):
    """Cross-attention of rows over the clip's memory, every head its own K and V.

    q (R, H, dq) fake-quantised; k_mem (H, F, dq); v_mem (H, F, dv);
    weights (R, H, F) receives the softmax weights (word timestamps read them); out (R, H, dv).
    """
    n_rows, heads, dq = q.shape
    frames = k_mem.shape[1]
    dv = v_mem.shape[2]
    qs = np.empty(dq, np.float32)
    for r in range(n_rows):
        for h in range(heads):
            for d in range(dq):
                qs[d] = q[r, h, d] * q_scale
            w = weights[r, h]
            top = np.float32(-np.inf)
            for f in range(frames):
                kf = k_mem[h, f]
                acc = np.float32(0.0)
                for d in range(dq):
                    acc += qs[d] * kf[d]
                acc *= logit_scale
                w[f] = acc
                if acc > top:
                    top = acc
            total = np.float32(0.0)
            for f in range(frames):
                e = np.exp(w[f] - top)
                w[f] = e
                total += e
            o = out[r, h]
            for d in range(dv):
                o[d] = 0.0
            for f in range(frames):
                wf = w[f] / total
                w[f] = wf
                vf = v_mem[h, f]
                for d in range(dv):
                    o[d] += wf * vf[d]


@_jit()
def _gather_levels(codes, norms, codebook, rows, group, out):
    """Rotated-domain rows of a CQ matrix: out[m, k] = codebook[codes[rows[m], k]] * norm.

    codes (N, K_pad) uint8; norms (N, K_pad // group) float32; rows (M,) int64; out (M, K_pad).
    A normalised FWHT of each group of `out` gives the dequantised weights.
    """
    for m in range(rows.shape[0]):
        row = rows[m]
        for k in range(codes.shape[1]):
            out[m, k] = codebook[codes[row, k]] * norms[row, k // group]


@_jit(GEMM_FASTMATH)
def _levels_rows(xr, levels, gscale, group, out):
    """A few rows times int16 level codes in the rotated domain (decoder beams).

    out[r, n] = sum_g gscale[n, g] * (levels[n, g] . xr[r, g]); xr (R, K_pad) rotated activations,
    levels (N, K_pad) int16, gscale (N, K_pad // group) float32. Each code group is widened to
    float32 once and reused by every row.
    """
    rows, k_pad = xr.shape
    groups = k_pad // group
    buf = np.empty(group, np.float32)
    for n in range(levels.shape[0]):
        ln = levels[n]
        for r in range(rows):
            out[r, n] = 0.0
        for g in range(groups):
            base = g * group
            for k in range(group):
                buf[k] = ln[base + k]
            s = gscale[n, g]
            for r in range(rows):
                xg = xr[r]
                acc = np.float32(0.0)
                for k in range(group):
                    acc += buf[k] * xg[base + k]
                out[r, n] += acc * s
