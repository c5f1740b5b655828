"""Numba kernels only the decoder uses: causal taps over a history, attention over the per-beam
KV pool and over the clip's memory, and the engram table gather (guide §6).

Like `kernels.py`: private, `out=` arrays, shapes trusted (decoder.py checks them at its boundary),
all kernels release the GIL. Sums follow the reference's order where it is cheap to (taps j = 0
first, softmax as exp(x - max) / sum), so the only differences left are float summation order.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, typeof, types
from numba.extending import overload

from . import (
    GEMM_FASTMATH, JIT_OPTIONS, _dot5_rows, _exp_neg, _packed5_rows, _fake_quant_rows, _fwht_rows, _gemm_rows, _int8_scale,
    _integer_gemm, _lane_combine, _lane_mix, _quant_rotate_rows, _rms_unit_rows, _rope_rows, _sinkhorn_rows,
    _zc_rmsnorm_rows,
)
from ._cache import link_on_demand
from .integer import VNNI as INTEGER_KERNELS, COLUMNS as BLOCK_COLUMNS, IntegerMatrix
from .simd import LANES, _tile5


def _jit(fastmath=False):
    return njit(fastmath=fastmath, **JIT_OPTIONS)


@_jit()
def _exp_rows(x, out):
    """exp of a (rows, n) array with `_exp_neg` (test hook)."""
    bits = np.empty(x.shape[1], np.int32)
    for r in range(x.shape[0]):
        _exp_neg(x[r], out[r], bits, x.shape[1])


@_jit()
def _causal_taps(new, ring, anc, taps, dilation, start, out):
    """Depthwise causal convolution over time, continuing each beam's history.

    new (B, S, D): raw rows at positions start .. start+S-1 of each beam row b;
    ring (R, cap, D): the raw row of position q fed to pool row r is ring[q % R, r], and beam b's
    position q < start was fed to pool row anc[b, q] (the block table the KV pool uses), so a beam
    reorder moves nothing here; taps (J, D). out[b, i] = sum_j taps[j] * z(p - j * dilation),
    p = start + i, with z(q) = 0 for q < 0 (the reference's shift-right plus position mask).
    Needs R > (J - 1) * dilation: a slot is rewritten (by `_push_ring`, position q + R) only after
    every position that reads q has been fed.
    """
    n_rows, n_new, width = new.shape
    slots = ring.shape[0]
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
                    src = ring[q % slots, anc[b, q]]
                for d in range(width):
                    o[d] += taps[j, d] * src[d]


@_jit()
def _push_ring(ring, new, start):
    """Keep the raw rows new (B, S, D) of positions start .. start+S-1, fed to pool rows 0 .. B-1,
    in the ring (R, cap, D) that `_causal_taps` reads."""
    slots = ring.shape[0]
    for b in range(new.shape[0]):
        for i in range(new.shape[1]):
            ring[(start + i) % slots, b] = new[b, i]


@_jit()
def _reorder_rows(anc, hist, parents, positions):
    """A beam reorder: row b of the block table anc (cap, T)'s first `positions` entries and of the
    token history hist (cap, H) becomes old row parents[b] (rows gathered before any is written)."""
    rows = parents.shape[0]
    kept_anc = np.empty((rows, positions), anc.dtype)
    kept_hist = np.empty((rows, hist.shape[1]), hist.dtype)
    for b in range(rows):
        kept_anc[b] = anc[parents[b], :positions]
        kept_hist[b] = hist[parents[b]]
    anc[:rows, :positions] = kept_anc
    hist[:rows] = kept_hist


@_jit()
def _lanes_from(x, scale, out):
    """The lane stream's start: out (R, lanes, C) holds x (R, C) * scale in every lane."""
    for r in range(x.shape[0]):
        for lane in range(out.shape[1]):
            for c in range(x.shape[1]):
                out[r, lane, c] = x[r, c] * scale


@_jit()
def _lanes_final(stream, scale, eps, out):
    """out (R, C) = zc_rmsnorm(the lanes' mean) of stream (R, lanes, C): the lanes added in turn,
    then divided by their count (NumPy's float32 mean over that axis, to the bit)."""
    n, lanes, width = stream.shape
    mean = np.empty((n, width), np.float32)
    count = np.float32(lanes)
    for r in range(n):
        for c in range(width):
            mean[r, c] = stream[r, 0, c]
        for lane in range(1, lanes):
            for c in range(width):
                mean[r, c] += stream[r, lane, c]
        for c in range(width):
            mean[r, c] /= count
    _zc_rmsnorm_rows(mean, scale, eps, out)


@_jit(GEMM_FASTMATH)
def _attend_pool(q, k_pool, k_scale, v_pool, v_scale, anc, start, q_scale, logit_scale, scores, out):
    """Causal self-attention of new positions over each beam's cached keys and values.

    q (B, S, H, dq): int8-fake-quantised queries at positions start .. start+S-1;
    k_pool (T, R, KH, dq), v_pool (T, R, KH, dv): int8 codes of position s of pool row r, with
    their scales k_scale, v_scale (T, R, KH) (the reference's int8 KV: key = codes * scale);
    anc (B_cap, T) int32: pool row holding position s of beam b (the block table);
    scores (H // KH, T) float32 scratch; out (B, S, H, dv).
    Query head h reads kv head h // (H // KH) (grouped heads, as jax's dot_product_attention): the
    heads of a group are done together, so each key and value row, read in place through the
    block table, serves all of them (faster than gathering the rows first: benchmarks/decoder.py).
    Logits are ((q * q_scale) . k) * logit_scale, the reference's flash path, with each key's
    scale applied to its dot product with the codes (and each value's to its weight): a step
    reads a quarter of the bytes float32 keys and values would take.
    """
    n_rows, n_new, heads, dq = q.shape
    kv_heads = k_pool.shape[2]
    dv = v_pool.shape[3]
    group = heads // kv_heads
    positions = start + n_new
    qs = np.empty((group, dq), np.float32)
    shifted = np.empty(positions, np.float32)
    bits = np.empty(positions, np.int32)
    acc = np.empty((group, dv), np.float32)
    for b in range(n_rows):
        for g in range(kv_heads):
            for i in range(n_new):
                p = start + i
                for j in range(group):
                    for d in range(dq):
                        qs[j, d] = q[b, i, g * group + j, d] * q_scale
                for s in range(p + 1):
                    r = anc[b, s]
                    kr = k_pool[s, r, g]
                    ks = k_scale[s, r, g] * logit_scale
                    for j in range(group):
                        qj = qs[j]
                        a = np.float32(0.0)
                        for d in range(dq):
                            a += qj[d] * np.float32(kr[d])
                        scores[j, s] = a * ks
                for j in range(group):  # softmax as exp(x - max) / sum (kernels._softmax_rows's
                    # arithmetic, inline: a call on these slices costs more than the softmax)
                    row = scores[j]
                    top = np.float32(-np.inf)
                    for s in range(p + 1):
                        top = max(top, row[s])
                    for s in range(p + 1):
                        shifted[s] = row[s] - top
                    _exp_neg(shifted, row, bits, p + 1)
                    total = np.float32(0.0)
                    for s in range(p + 1):
                        total += row[s]
                    inv = np.float32(1.0) / total
                    for s in range(p + 1):
                        row[s] *= inv
                acc[:] = 0.0
                for s in range(p + 1):
                    r = anc[b, s]
                    vr = v_pool[s, r, g]
                    vs = v_scale[s, r, g]
                    for j in range(group):
                        w = scores[j, s] * vs
                        aj = acc[j]
                        for d in range(dv):
                            aj[d] += w * np.float32(vr[d])
                for j in range(group):
                    o = out[b, i, g * group + j]
                    for d in range(dv):
                        o[d] = acc[j, d]


@_jit()
def _quant_codes(x, codes, scales):
    """int8 codes and scales of each row's fake-quant (the same rule as kernels._fake_quant_rows:
    scale = absmax / 127, 1 for an all-zero row; code = clip(rint(x / scale), -128, 127)), so
    that codes * scale is exactly the fake-quantised row. x (R, d) -> codes (R, d) int8, scales (R,)."""
    rows, d = x.shape
    hi = np.float32(127.0)
    lo = np.float32(-128.0)
    for r in range(rows):
        xr = x[r]
        scale = _int8_scale(xr)
        scales[r] = scale
        for k in range(d):
            c = np.rint(xr[k] / scale)
            c = hi if c > hi else c
            c = lo if c < lo else c
            codes[r, k] = np.int8(c)


@_jit(GEMM_FASTMATH)
def _attend_memory(q, k_codes, k_scale, v_codes, v_scale, q_scale, logit_scale, weights, out):
    """Cross-attention of rows over the clip's memory, every head its own K and V.

    The memory is int8 as the reference fake-quantises it (per head and frame): K = k_codes *
    k_scale, V = v_codes * v_scale, a quarter of the bytes of float32 (the step reads all of it).
    q (R, H, dq) fake-quantised; k_codes (H, dq, Fp) int8, frames last, v_codes (H, Fp, dv) int8,
    frames first; k_scale, v_scale (H, Fp); Fp >= F is a multiple of simd.LANES and frames past F
    are zero (`decoder._memory_codes`); weights (R, H, F) receives the softmax weights (word
    timestamps read them); out (R, H, dv). Rows go five at a time, both products as
    `simd._tile5`'s register tiles (no horizontal sums): the scores of a tile of frames for five
    rows, summed over dq; then a tile of value columns for five rows, summed over the frames
    (a plain loop when dv is not a multiple of its lanes).
    """
    n_rows, heads, dq = q.shape
    frames = weights.shape[2]
    padded = v_codes.shape[1]
    dv = v_codes.shape[2]
    shifted = np.empty(frames, np.float32)
    bits = np.empty(frames, np.int32)
    scaled = np.zeros((5, padded), np.float32)  # frames past F score 0 (zero codes) and weigh 0
    coef = np.empty((5, dq), np.float32)
    tile = np.empty((5, dv), np.float32)
    for h in range(heads):
        ks = k_scale[h]
        for r0 in range(0, n_rows, 5):
            block = min(5, n_rows - r0)
            for i in range(5):  # rows past the block end read as zeros
                for d in range(dq):
                    coef[i, d] = q[r0 + i, h, d] * q_scale if i < block else np.float32(0.0)
            for c0 in range(0, padded, LANES):
                _tile5(k_codes[h], c0, coef, scaled)
            for i in range(block):
                w = weights[r0 + i, h]
                for f in range(frames):
                    w[f] = scaled[i, f] * (ks[f] * logit_scale)
    for r in range(n_rows):
        for h in range(heads):
            w = weights[r, h]
            top = np.float32(-np.inf)
            for f in range(frames):
                top = max(top, w[f])
            for f in range(frames):
                shifted[f] = w[f] - top
            _exp_neg(shifted, w, bits, frames)
            total = np.float32(0.0)
            for f in range(frames):
                total += w[f]
            inv = np.float32(1.0) / total
            for f in range(frames):
                w[f] = w[f] * inv
    for h in range(heads):
        vs = v_scale[h]
        vh = v_codes[h]
        for r0 in range(0, n_rows, 5):
            block = min(5, n_rows - r0)
            for i in range(5):  # rows past the block end weigh nothing; so do frames past F
                si = scaled[i]
                if i < block:
                    wi = weights[r0 + i, h]
                    for f in range(frames):
                        si[f] = wi[f] * vs[f]
                    for f in range(frames, padded):
                        si[f] = 0.0
                else:
                    for f in range(padded):
                        si[f] = 0.0
            if dv % LANES == 0:
                for c0 in range(0, dv, LANES):
                    _tile5(vh, c0, scaled, tile)
            else:
                tile[:] = 0.0
                for f in range(frames):
                    vf = vh[f]
                    for i in range(block):
                        c = scaled[i, f]
                        for d in range(dv):
                            tile[i, d] += c * np.float32(vf[d])
            for i in range(block):
                for d in range(dv):
                    out[r0 + i, h, d] = tile[i, d]


@_jit()
def _gather_packed(packed, bits, levels, norms, rows, group, out):
    """Rotated-domain rows of a CQ matrix read from its packed fields: out[m, k] = levels[field k
    of row rows[m]] * norms[rows[m], k // group].

    packed (N, row bytes) uint8, each row an LSB-first stream of `bits`-bit fields
    (`container.unpack_lsb`'s layout); levels (2**bits,) float32, the codebook level of each field
    value (`PackedCQ.field_codes`); norms (N, K_pad // group) float32; rows (M,) int64; out
    (M, K_pad). A normalised FWHT of each group of `out` gives the dequantised weights.
    """
    mask = (1 << bits) - 1
    for m in range(rows.shape[0]):
        pr = packed[rows[m]]
        nr = norms[rows[m]]
        for k in range(out.shape[1]):
            at = k * bits
            byte, shift = at >> 3, at & 7
            v = np.int64(pr[byte]) >> shift
            if shift + bits > 8:   # the field runs on into the next byte
                v |= np.int64(pr[byte + 1]) << (8 - shift)
            out[m, k] = levels[v & mask] * nr[k // group]


@_jit(GEMM_FASTMATH)
def _levels_rows(xr, levels, gscale, group, out):
    """A few rows times int16 level codes in the rotated domain (decoder beams, the CQ4 head).

    out[r, n] = sum_g gscale[n, g] * (levels[n, g] . xr[r, g]); xr (R, K_pad) rotated activations,
    levels (N, K_pad) int16, gscale (N, K_pad // group) float32. Rows go five at a time (under
    five one at a time, past a multiple of five the last five again: the same sums): each level is
    widened to float32 in a register and used for five multiply-adds (`simd._dot5`; a plain loop when group is not a
    multiple of its lanes, which reads a last row again to fill its five).
    """
    rows, k_pad = xr.shape
    groups = k_pad // group
    if group % LANES == 0:
        _dot5_rows(xr, levels, gscale, gscale[0], group, out)  # (the levels argument is unused for int16)
        return
    for r in range(0, rows, 5):
        for n in range(levels.shape[0]):
            ln = levels[n]
            s0 = s1 = s2 = s3 = s4 = np.float32(0.0)
            for g in range(groups):
                base = g * group
                c = ln[base:base + group]
                x0, x1 = xr[r, base:base + group], xr[min(r + 1, rows - 1), base:base + group]
                x2, x3 = xr[min(r + 2, rows - 1), base:base + group], xr[min(r + 3, rows - 1), base:base + group]
                x4 = xr[min(r + 4, rows - 1), base:base + group]
                a0 = a1 = a2 = a3 = a4 = np.float32(0.0)
                for k in range(group):
                    v = np.float32(c[k])
                    a0 += v * x0[k]
                    a1 += v * x1[k]
                    a2 += v * x2[k]
                    a3 += v * x3[k]
                    a4 += v * x4[k]
                m = gscale[n, g]
                s0 += a0 * m
                s1 += a1 * m
                s2 += a2 * m
                s3 += a3 * m
                s4 += a4 * m
            _store5(out, r, n, s0, s1, s2, s3, s4)


@_jit()
def _store5(out, r, n, s0, s1, s2, s3, s4):
    """out[r .. r + 4, n] = s0 .. s4, the rows that exist (the plain loops' last five may overhang)."""
    rows = out.shape[0]
    out[r, n] = s0
    if r + 1 < rows:
        out[r + 1, n] = s1
    if r + 2 < rows:
        out[r + 2, n] = s2
    if r + 3 < rows:
        out[r + 3, n] = s3
    if r + 4 < rows:
        out[r + 4, n] = s4


@_jit(GEMM_FASTMATH)
def _packed_rows(xr, packed, norms, levels, bits, group, out):
    """A few rows times a CQ matrix in the rotated domain, from its packed level indices.

    out[r, n] = sum_g norms[n, g] * (levels[code(n, k)] . xr[r, g]); xr (R, K_pad) rotated
    activations; packed (N, >= K_pad * bits / 8) uint8, indices of `bits` bits (2 or 4) in
    `simd.interleave`'s layout; norms (N, K_pad // group) float32; levels (2**bits,) float32. Rows
    go five at a time: each code
    becomes its float32 level in a register (a quarter or half byte read per weight) used for five
    multiply-adds: `simd._dot5`'s shift, mask and table lookup when group is a multiple of its
    blocks (under five rows one at a time, past a multiple of five the last five again: the
    same sums), else a plain loop.
    """
    rows, k_pad = xr.shape
    groups = k_pad // group
    per = 8 // bits
    block = LANES * per
    if group % block == 0:
        _packed5_rows(xr, packed, norms, levels, bits, group, out)
        return
    mask = (1 << bits) - 1
    for r in range(0, rows, 5):
        for n in range(packed.shape[0]):
            pn = packed[n]
            s0 = s1 = s2 = s3 = s4 = np.float32(0.0)
            for g in range(groups):
                base = g * group
                a0 = a1 = a2 = a3 = a4 = np.float32(0.0)
                for k in range(base, base + group):
                    within = k % block
                    v = levels[(pn[k // block * LANES + within % LANES] >> (within // LANES * bits)) & mask]
                    a0 += v * xr[r, k]
                    a1 += v * xr[min(r + 1, rows - 1), k]
                    a2 += v * xr[min(r + 2, rows - 1), k]
                    a3 += v * xr[min(r + 3, rows - 1), k]
                    a4 += v * xr[min(r + 4, rows - 1), k]
                m = norms[n, g]
                s0 += a0 * m
                s1 += a1 * m
                s2 += a2 * m
                s3 += a3 * m
                s4 += a4 * m
            _store5(out, r, n, s0, s1, s2, s3, s4)


# ---------------------------------------------------------------- fused stages of a decoder step
# One batched step runs a few dozen of these per layer; fusing the small row maps (norms, int8,
# sigmoid gates, the rotation) keeps Python dispatch out of a step that must take milliseconds.


@_jit()
def _sigmoid(v):
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-v))


@_jit(GEMM_FASTMATH)
def _lanes_in(x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, lane, eps, iters, u, hpost, hres):
    """The mHC maps of one layer (needle `_LaneBody`, guide §6) for the stream x (R, n, C).

    nx = int8(rms_unit(x.reshape(R, n*C))); z = nx @ phi.T with phi (2n + n^2, n*C) the stacked
    pre/post/res maps; u (R, C) = sum_j sigmoid(a_pre z_pre + b_pre + 8 lane - 4)_j x_j;
    hpost (R, n) = 2 sigmoid(a_post z_post + b_post - 4 (1 - lane));
    hres (R, n, n) = sinkhorn(a_res z_res + b_res). lane (n,) is the one-hot lane of the layer.
    """
    rows, n, width = x.shape
    nx = np.empty((rows, n * width), np.float32)
    _rms_unit_rows(x.reshape((rows, n * width)), eps, nx)
    _fake_quant_rows(nx, nx)
    z = np.empty((rows, phi.shape[0]), np.float32)
    _gemm_rows(nx, phi, z)
    hpre = np.empty((rows, n), np.float32)
    logits = np.empty((rows, n, n), np.float32)
    for r in range(rows):
        for j in range(n):
            on = lane[j]
            hpre[r, j] = _sigmoid(a_pre * z[r, j] + b_pre[j] + (np.float32(8.0) * on - np.float32(4.0)))
            hpost[r, j] = np.float32(2.0) * _sigmoid(
                a_post * z[r, n + j] + b_post[j] + np.float32(-4.0) * (np.float32(1.0) - on))
            for i in range(n):
                logits[r, j, i] = a_res * z[r, 2 * n + j * n + i] + b_res[j, i]
    _sinkhorn_rows(logits, iters, hres)
    _lane_combine(hpre, x, u)


@_jit(GEMM_FASTMATH)
def _lanes_out(x, hres, hpost, block_out, u, out):
    """x (R, n, C) -> out: hres @ x + hpost * (block(u) - u) (block_out is overwritten)."""
    for r in range(block_out.shape[0]):
        for c in range(block_out.shape[1]):
            block_out[r, c] -= u[r, c]
    _lane_mix(hres, x, hpost, block_out, out)


@_jit(GEMM_FASTMATH)
def _quant_rotate(h, group, hr):
    """hr = FWHT(int8(h)) per group (h overwritten by its fake-quant): rows into the rotated domain
    of the float products (`_product`)."""
    _fake_quant_rows(h, h)
    _fwht_rows(h, group, hr)


@_jit(GEMM_FASTMATH)
def _quant_product(h, w, out):
    """out = int8(h) @ W.T for a `Rotated` matrix W; h (R, K) float32, overwritten. The integer
    products (`kernels._integer_gemm` of `_quant_rotate_rows`' codes) where W holds them, else the
    fake-quantised rows rotated (`_quant_rotate`) through the float `_product`. The integer branch
    is compiled only where its instructions exist (`integer.VNNI`, a constant when this
    compiles: a tier's or another CPU's code never holds them)."""
    rows = h.shape[0]
    if INTEGER_KERNELS:
        iw = w.integer
        blocks = iw.codes.shape[0]
        if blocks:
            q = np.empty((rows, 2 * iw.codes.shape[1]), np.int16)
            scales = np.empty(rows, np.float32)
            _quant_rotate_rows(h, w.group, q, scales)
            if BLOCK_COLUMNS * blocks == out.shape[1]:
                _integer_gemm(q, scales, iw, 0, blocks, out)
            else:   # the matrix padded to whole 16-column blocks
                full = np.empty((rows, BLOCK_COLUMNS * blocks), np.float32)
                _integer_gemm(q, scales, iw, 0, blocks, full)
                out[:] = full[:, :out.shape[1]]
            return
    hr = np.zeros((rows, w.norms.shape[1] * w.group), np.float32)
    _quant_rotate(h, w.group, hr)
    _product(hr, w.codes, w.norms, w.levels, w.bits, w.group, out)


@_jit(GEMM_FASTMATH)
def _norm_product(x, scale, eps, w, out):
    """out = int8(zc_rmsnorm(x)) @ W.T: a block's input through its first products."""
    h = np.empty(x.shape, np.float32)
    _zc_rmsnorm_rows(x, scale, eps, h)
    _quant_product(h, w, out)


@njit(inline="always", **JIT_OPTIONS)
def _sigmoid_vec(x, out, bits):
    """out = 1 / (1 + exp(-x)) over a 1-D array, with the vectorised exp (out may alias x)."""
    n = x.shape[0]
    for i in range(n):
        out[i] = -x[i]
    _exp_neg(out, out, bits, n)
    for i in range(n):
        out[i] = np.float32(1.0) / (np.float32(1.0) + out[i])


@_jit(GEMM_FASTMATH)
def _gate_product(att, gate, w, out):
    """out = int8(att * sigmoid(gate)) @ W.T: the attention output through out_proj."""
    rows, width = att.shape
    h = np.empty((rows, width), np.float32)
    sig = np.empty(width, np.float32)
    bits = np.empty(width, np.int32)
    for r in range(rows):
        _sigmoid_vec(gate[r], sig, bits)
        for c in range(width):
            h[r, c] = att[r, c] * sig[c]
    _quant_product(h, w, out)


@_jit(GEMM_FASTMATH)
def _gated_residual(x, y, scale, eps, gate):
    """x += gate * zc_rmsnorm(y), in place (post-attention norm and sigmoid(attn_gate) residual)."""
    h = np.empty(y.shape, np.float32)
    _zc_rmsnorm_rows(y, scale, eps, h)
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            x[r, c] = x[r, c] + gate * h[r, c]


@_jit(GEMM_FASTMATH)
def _head_norm_quant(x, heads, scale, eps, out):
    """out (R, H, d) = int8(zc_rmsnorm(x per head)) for x (R, H*d): cross-attention queries."""
    rows = x.shape[0]
    d = out.shape[2]
    flat = np.ascontiguousarray(x).reshape((rows * heads, d))
    o = out.reshape((rows * heads, d))
    _zc_rmsnorm_rows(flat, scale, eps, o)
    _fake_quant_rows(o, o)


@_jit(GEMM_FASTMATH)
def _self_qkv(y, n_rows, start, q_taps, k_taps, v_taps, hq, hk, hv, anc, q_norm, k_norm, cos_tab, sin_tab, eps,
              heads, kv_heads, k_pool, k_scale, v_pool, v_scale, q_out):
    """From the stacked projections y (B*S, q | k | v | gate) of the new positions to quantised
    queries q_out (B, S, H, dq), with this position's keys and values written to the pool as int8
    codes and scales (`_quant_codes`: codes * scale is their fake-quant).

    Per stream: causal taps over the raw rows kept in the rings hq/hk/hv (read through the block
    table anc, then this step's rows added), per-head ZCRMSNorm (q, k),
    RoPE at each row's absolute position (q, k), int8 per head (q, k, v) (guide §6).
    k_pool (T, cap, KH, dq), v_pool (T, cap, KH, dv) int8 with k_scale, v_scale (T, cap, KH):
    position start+i of beam b goes to row b.
    """
    n = y.shape[0]
    n_new = n // n_rows
    dq = q_out.shape[3]
    dv = v_pool.shape[3]
    q_w, k_w, v_w = heads * dq, kv_heads * dq, kv_heads * dv
    half = dq // 2
    cos = np.empty((n, half), np.float32)
    sin = np.empty((n, half), np.float32)
    for r in range(n):
        p = start + r % n_new
        cos[r] = cos_tab[p]
        sin[r] = sin_tab[p]
    q = np.ascontiguousarray(y[:, :q_w]).reshape((n_rows, n_new, q_w))
    k = np.ascontiguousarray(y[:, q_w:q_w + k_w]).reshape((n_rows, n_new, k_w))
    v = np.ascontiguousarray(y[:, q_w + k_w:q_w + k_w + v_w]).reshape((n_rows, n_new, v_w))
    if q_taps.shape[0] > 0:
        qt, kt, vt = np.empty_like(q), np.empty_like(k), np.empty_like(v)
        _causal_taps(q, hq, anc, q_taps, 1, start, qt)
        _causal_taps(k, hk, anc, k_taps, 1, start, kt)
        _causal_taps(v, hv, anc, v_taps, 1, start, vt)
        _push_ring(hq, q, start)
        _push_ring(hk, k, start)
        _push_ring(hv, v, start)
        q, k, v = qt, kt, vt
    qn = np.empty((n, heads, dq), np.float32)
    kn = np.empty((n, kv_heads, dq), np.float32)
    _zc_rmsnorm_rows(q.reshape((n * heads, dq)), q_norm, eps, qn.reshape((n * heads, dq)))
    _zc_rmsnorm_rows(k.reshape((n * kv_heads, dq)), k_norm, eps, kn.reshape((n * kv_heads, dq)))
    qr = np.empty_like(qn)
    kr = np.empty_like(kn)
    _rope_rows(qn, cos, sin, qr)
    _rope_rows(kn, cos, sin, kr)
    _fake_quant_rows(qr.reshape((n * heads, dq)), q_out.reshape((n * heads, dq)))
    kc = np.empty((n * kv_heads, dq), np.int8)
    vc = np.empty((n * kv_heads, dv), np.int8)
    ksc = np.empty(n * kv_heads, np.float32)
    vsc = np.empty(n * kv_heads, np.float32)
    _quant_codes(kr.reshape((n * kv_heads, dq)), kc, ksc)
    _quant_codes(v.reshape((n * kv_heads, dv)), vc, vsc)
    for b in range(n_rows):
        for i in range(n_new):
            r = (b * n_new + i) * kv_heads
            for g in range(kv_heads):
                k_pool[start + i, b, g] = kc[r + g]
                v_pool[start + i, b, g] = vc[r + g]
                k_scale[start + i, b, g] = ksc[r + g]
                v_scale[start + i, b, g] = vsc[r + g]


@_jit(GEMM_FASTMATH)
def _kron_rows(z, a, b, perm, out):
    """out[r, m] = Z'[perm[m]] with Z' = A^T Z B, Z = z[r].reshape(ba, bb): one Kronecker factor
    pair of the Hadamard MLP for every row. Both products go five matrix rows at a time through
    `simd._tile5` (Z B with the rows of every Z stacked, then A^T times each row's Z B) when bb
    is a multiple of its lanes; plain loops otherwise."""
    rows = z.shape[0]
    ba, bb = a.shape[0], b.shape[0]
    if bb % LANES:
        _kron_rows_loop(z, a, b, perm, out)
        return
    stacked = rows * ba
    zs = z.reshape((stacked, bb))  # every row's Z, stacked
    t = np.empty((stacked + (-stacked) % 5, bb), np.float32)
    whole = stacked - stacked % 5
    for i in range(0, whole, 5):
        for c0 in range(0, bb, LANES):
            _tile5(b, c0, zs[i:i + 5], t[i:i + 5])
    if whole < stacked:  # the last rows, padded with zero rows to five
        tail = np.zeros((5, bb), np.float32)
        tail[:stacked - whole] = zs[whole:]
        for c0 in range(0, bb, LANES):
            _tile5(b, c0, tail, t[whole:whole + 5])
    ka = ba + (-ba) % 5
    at = np.zeros((ka, ba), np.float32)  # A^T, zero rows up to a multiple of five
    for i in range(ba):
        for k in range(ba):
            at[k, i] = a[i, k]
    full = np.empty((ka, bb), np.float32)
    flat = full.reshape(ka * bb)  # rows k < ba: the (ba, bb) result, row-major
    for r in range(rows):
        tr = t[r * ba:(r + 1) * ba]
        for k in range(0, ka, 5):
            for c0 in range(0, bb, LANES):
                _tile5(tr, c0, at[k:k + 5], full[k:k + 5])
        for m in range(ba * bb):
            out[r, m] = flat[perm[m]]


@_jit(GEMM_FASTMATH)
def _kron_rows_loop(z, a, b, perm, out):
    """`_kron_rows` as plain loops (any factor sizes)."""
    rows = z.shape[0]
    ba, bb = a.shape[0], b.shape[0]
    t = np.empty((ba, bb), np.float32)
    full = np.empty(ba * bb, np.float32)
    for r in range(rows):
        zr = z[r]
        for i in range(ba):
            for l in range(bb):
                t[i, l] = 0.0
            for j in range(bb):
                zij = zr[i * bb + j]
                for l in range(bb):
                    t[i, l] += zij * b[j, l]
        for k in range(ba):
            for l in range(bb):
                full[k * bb + l] = 0.0
        for i in range(ba):
            for k in range(ba):
                aik = a[i, k]
                for l in range(bb):
                    full[k * bb + l] += aik * t[i, l]
        for m in range(ba * bb):
            out[r, m] = full[perm[m]]


@_jit(GEMM_FASTMATH)
def _hadamard_residual(x, mlp, eps):
    """x += hadamard_mlp(zc_rmsnorm(x, mlp.pre)), in place, for a `HadamardMlp` record (needle
    `HadamardMLP`, guide §6).

    cond = 1 + softmax(h @ cond_v) @ cond_u (cond_vt = cond_v.T, contiguous); z = kron1(d1 * pad(h))[p1];
    z = kron2(silu(d2 * cond * z + b2))[p2]; out = (d4 * kron3(d3 * z))[:C]. ident = arange(n).
    """
    pre, d1, d2, b2, d3, d4 = mlp.pre, mlp.d1, mlp.d2, mlp.b2, mlp.d3, mlp.d4
    w1a, w1b, w2a, w2b, w3a, w3b = mlp.w1a, mlp.w1b, mlp.w2a, mlp.w2b, mlp.w3a, mlp.w3b
    cond_vt, cond_u, p1, p2, ident = mlp.cond_vt, mlp.cond_u, mlp.p1, mlp.p2, mlp.ident
    rows, width = x.shape
    n = d1.shape[0]
    rank = cond_vt.shape[0]
    h = np.empty((rows, width), np.float32)
    _zc_rmsnorm_rows(x, pre, eps, h)
    z = np.zeros((rows, n), np.float32)
    cond = np.empty((rows, n), np.float32)
    e = np.empty(rank, np.float32)
    for r in range(rows):
        top = np.float32(-np.inf)
        for m in range(rank):
            acc = np.float32(0.0)
            for c in range(width):
                acc += h[r, c] * cond_vt[m, c]
            e[m] = acc
            top = max(top, acc)
        total = np.float32(0.0)
        for m in range(rank):
            e[m] = np.exp(e[m] - top)
            total += e[m]
        for m in range(rank):
            e[m] = e[m] / total
        c_r = cond[r]
        for k in range(n):
            c_r[k] = np.float32(0.0)
        for m in range(rank):  # by rows of cond_u: vectors along k, no reduction per k
            em = e[m]
            for k in range(n):
                c_r[k] += em * cond_u[m, k]
        for k in range(n):
            c_r[k] += np.float32(1.0)
        for c in range(width):
            z[r, c] = d1[c] * h[r, c]
    y = np.empty((rows, n), np.float32)
    _kron_rows(z, w1a, w1b, p1, y)
    arg = np.empty(n, np.float32)
    sig = np.empty(n, np.float32)
    bits = np.empty(n, np.int32)
    for r in range(rows):
        for k in range(n):
            arg[k] = d2[k] * cond[r, k] * y[r, k] + b2[k]
        _sigmoid_vec(arg, sig, bits)
        for k in range(n):
            y[r, k] = arg[k] * sig[k]
    _kron_rows(y, w2a, w2b, p2, z)
    for r in range(rows):
        for k in range(n):
            z[r, k] *= d3[k]
    _kron_rows(z, w3a, w3b, ident, y)
    for r in range(rows):
        for c in range(width):
            x[r, c] = x[r, c] + d4[c] * y[r, c]


# ---------------------------------------------------------------- engram sites (guide §6)


@_jit()
def _engram_hash(seq, depth, start, orders, hashes, stride, seed, prime, shift, slots, idx, ok):
    """Hashed n-gram table indices of the new positions (needle `engram_indices`, uint32 arithmetic).

    seq (B, depth + S) int64: each row's last `depth` tokens (0 before the start) then its S new
    tokens; orders (O,) int64. For order o (index oi) and hash head h, table t = oi * hashes + h:
    acc = seed * (oi * stride + h + 1); acc = (acc ^ token) * prime over the o newest tokens, newest
    first; idx[b, i, t] = (acc ^ (acc >> shift)) % slots, ok[b, i, t] = position >= o - 1.
    """
    mask = np.int64(0xFFFFFFFF)
    n_rows = seq.shape[0]
    n_new = seq.shape[1] - depth
    for b in range(n_rows):
        for i in range(n_new):
            for oi in range(orders.shape[0]):
                order = orders[oi]
                for h in range(hashes):
                    acc = (seed * (oi * stride + h + 1)) & mask
                    for j in range(order):
                        acc = ((acc ^ (seq[b, depth + i - j] & mask)) * prime) & mask
                    acc = acc ^ (acc >> shift)
                    t = oi * hashes + h
                    idx[b, i, t] = acc % slots
                    ok[b, i, t] = np.float32(1.0) if start + i >= order - 1 else np.float32(0.0)


@_jit(GEMM_FASTMATH)
def _engram_site(idx, ok, t_packed, t_bits, t_levels, t_norms, t_group, slots, sub, kv, taps, dilation, ring, anc,
                 n_rows, start, key, value):
    """One engram site's key and value rows for the new positions (needle `Engram`, guide §6).

    idx, ok (B*S, tables): table indices and validity; the tables, stacked (tables * slots rows),
    stay packed (t_packed, t_bits, t_levels, t_norms as `_gather_packed` reads them); the gathered
    rows (dequantised CQ rows of each table, cut to `sub` = sub_dim, zeroed where not ok) are int8-quantised
    together and projected by the stacked [key | value] matrix kv (a `Rotated`); the value rows then pass the
    dilated causal taps over `hist` (capacity, H, width), which receives the raw value rows.
    key, value (B*S, width).
    """
    n, tables = idx.shape
    width = key.shape[1]
    rows_sel = np.empty(n * tables, np.int64)
    for m in range(n):
        for t in range(tables):
            rows_sel[m * tables + t] = t * slots + idx[m, t]
    rot = np.empty((n * tables, t_norms.shape[1] * t_group), np.float32)
    _gather_packed(t_packed, t_bits, t_levels, t_norms, rows_sel, t_group, rot)
    deq = np.empty_like(rot)
    _fwht_rows(rot, t_group, deq)
    fetched = np.empty((n, tables * sub), np.float32)
    for m in range(n):
        for t in range(tables):
            w = ok[m, t]
            src = deq[m * tables + t]
            for c in range(sub):
                fetched[m, t * sub + c] = src[c] * w
    y = np.empty((n, kv.outputs), np.float32)
    _quant_product(fetched, kv, y)
    n_new = n // n_rows
    raw = np.empty((n_rows, n_new, width), np.float32)
    for m in range(n):
        for c in range(width):
            key[m, c] = y[m, c]
            raw[m // n_new, m % n_new, c] = y[m, width + c]
    _causal_taps(raw, ring, anc, taps, dilation, start, value.reshape((n_rows, n_new, width)))
    _push_ring(ring, raw, start)


# ---------------------------------------------------------------- one whole decoder block per call


def _product(xr, codes, norms, levels, bits, group, out):
    """xr (R, K_pad) rotated rows times a CQ matrix: `_packed_rows` for packed level indices (uint8,
    `bits` wide), `_levels_rows` for int16 level codes (levels and bits unused). Chosen when a
    kernel is compiled."""
    if codes.dtype == np.uint8:
        _packed_rows(xr, codes, norms, levels, bits, group, out)
    else:
        _levels_rows(xr, codes, norms, group, out)


@overload(_product, jit_options=JIT_OPTIONS)
def _product_typed(xr, codes, norms, levels, bits, group, out):
    if codes.dtype == types.uint8:
        return lambda xr, codes, norms, levels, bits, group, out: _packed_rows(xr, codes, norms, levels, bits, group,
                                                                               out)
    return lambda xr, codes, norms, levels, bits, group, out: _levels_rows(xr, codes, norms, group, out)


@_jit(GEMM_FASTMATH)
def _engram_mix(x, key, value, eps, embed_scale):
    """x += sigmoid(rms_unit(x) . rms_unit(key) / embed_scale) * value, per row, in place."""
    rows, width = x.shape
    nx = np.empty((rows, width), np.float32)
    nk = np.empty((rows, width), np.float32)
    _rms_unit_rows(x, eps, nx)
    _rms_unit_rows(key, eps, nk)
    for r in range(rows):
        acc = np.float32(0.0)
        for c in range(width):
            acc += nx[r, c] * nk[r, c]
        g = _sigmoid(acc / embed_scale)
        for c in range(width):
            x[r, c] = x[r, c] + g * value[r, c]



def compiled_for(dispatcher, *args):
    """The compiled entry point of a kernel for these arguments' types. Calls through it skip
    Numba's per-call type resolution, which for a `LayerStep` record (~60 arrays in named tuples)
    costs more than the call itself; a decoder step calls `_block_step` once a layer."""
    return dispatcher.compile(tuple(typeof(a) for a in args))


# ---------------------------------------------------------------- one decoder layer's arguments
# Typed records (Numba reads named tuples field by field): `_block_step` takes one `LayerStep`,
# built once per clip by decoder.py, instead of ~80 positional arrays whose order two places had
# to agree on.


class Rotated(NamedTuple):
    """A CQ matrix kept in the rotated domain (§5) for `_quant_product`: its integer form where it
    has one (an `integer.IntegerMatrix`; else one of no blocks), else the float products' codes
    (packed level indices of `bits` bits, or int16 level codes with bits 0), per-group norms (out,
    K_pad // group) and levels (those three empty where the integer form serves)."""
    codes: np.ndarray
    norms: np.ndarray
    levels: np.ndarray
    bits: int
    group: int
    outputs: int
    integer: IntegerMatrix


class LaneMaps(NamedTuple):
    """The mHC maps of one layer's place in the stack (§6)."""
    phi: np.ndarray
    a_pre: np.ndarray
    a_post: np.ndarray
    a_res: np.ndarray
    b_pre: np.ndarray
    b_post: np.ndarray
    b_res: np.ndarray
    lane: np.ndarray       # one-hot lane of this place
    iters: int             # Sinkhorn iterations


class SelfCache(NamedTuple):
    """One layer's per-clip self-attention state: tap rings, KV pool (int8 codes and scales),
    block table, scratch."""
    hq: np.ndarray
    hk: np.ndarray
    hv: np.ndarray
    k_pool: np.ndarray
    k_scale: np.ndarray
    v_pool: np.ndarray
    v_scale: np.ndarray
    anc: np.ndarray
    scores: np.ndarray


class Memory(NamedTuple):
    """One layer's cross-attention keys and values over the clip, int8 codes and scales."""
    k_codes: np.ndarray
    k_scale: np.ndarray
    v_codes: np.ndarray
    v_scale: np.ndarray


class SelfAttention(NamedTuple):
    norm_in: np.ndarray
    qkvg: Rotated          # q | k | v | gate, one stacked product
    gate_at: int           # first gate column of qkvg
    q_taps: np.ndarray
    k_taps: np.ndarray
    v_taps: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    out: Rotated
    post_norm: np.ndarray
    gate: np.float32       # sigmoid(attn_gate)


class CrossAttention(NamedTuple):
    norm: np.ndarray
    qg: Rotated            # q | gate
    q_norm: np.ndarray
    out: Rotated
    post_norm: np.ndarray
    gate: np.float32       # sigmoid(cross_gate)


class HadamardMlp(NamedTuple):
    """`blocks.HadamardMLP`'s arrays for `_hadamard_residual` (`HadamardMLP.record`), the
    Kronecker factors as (a, b) pairs; d4 carries the residual's scale."""
    pre: np.ndarray
    d1: np.ndarray
    d2: np.ndarray
    b2: np.ndarray
    d3: np.ndarray
    d4: np.ndarray
    w1a: np.ndarray
    w1b: np.ndarray
    w2a: np.ndarray
    w2b: np.ndarray
    w3a: np.ndarray
    w3b: np.ndarray
    cond_vt: np.ndarray
    cond_u: np.ndarray
    p1: np.ndarray
    p2: np.ndarray
    ident: np.ndarray


class Shape(NamedTuple):
    """What every layer shares: RoPE tables, norm epsilon, heads, attention scales."""
    cos_tab: np.ndarray
    sin_tab: np.ndarray
    eps: float
    heads: int
    kv_heads: int
    q_scale: np.float32
    logit_scale: np.float32
    embed_scale: np.float32


class LayerStep(NamedTuple):
    """Everything `_block_step` reads of one kept layer, built once per clip."""
    lanes: LaneMaps
    cache: SelfCache
    memory: Memory
    attn: SelfAttention
    cross: CrossAttention
    mlp: HadamardMlp
    shape: Shape


@_jit(GEMM_FASTMATH)
def _block_step(stream, out, weights, eng_key, eng_value, n_rows, start, layer):
    """One decoder layer (a `LayerStep`) on the lane stream (B*S, lanes, width) into `out` (guide
    §6; the stages as decoder.py documents them): the mHC maps give the block input u
    (`_lanes_in`); an engram site adds sigmoid(rms_unit(u) . rms_unit(key) / embed_scale) * value
    (eng_key and eng_value (B*S, width), or zero rows where the layer has none); then the block,
    and the lane update out = hres @ stream + hpost * (block(x) - u). One call per layer instead
    of a dozen: a 5-beam step is milliseconds, and each kernel call from Python costs
    microseconds of dispatch. weights (B*S, H, F) receives the cross-attention weights (word
    timestamps read them)."""
    lm, cache, mem, sa, ca, mlp, sh = layer
    eps, heads, kv_heads = sh.eps, sh.heads, sh.kv_heads
    n, lanes, width = stream.shape
    u = np.empty((n, width), np.float32)
    hpost = np.empty((n, lanes), np.float32)
    hres = np.empty((n, lanes, lanes), np.float32)
    _lanes_in(stream, lm.phi, lm.a_pre, lm.a_post, lm.a_res, lm.b_pre, lm.b_post, lm.b_res, lm.lane, eps,
              lm.iters, u, hpost, hres)
    x = u.copy()
    if eng_key.shape[0]:
        _engram_mix(x, eng_key, eng_value, eps, sh.embed_scale)
    n_new = n // n_rows
    dq = cache.k_pool.shape[3]
    dv = cache.v_pool.shape[3]

    # causal self-attention: int8(norm_in(x)) -> [q | k | v | gate] in one rotated product
    y = np.empty((n, sa.qkvg.outputs), np.float32)
    _norm_product(x, sa.norm_in, eps, sa.qkvg, y)
    q = np.empty((n_rows, n_new, heads, dq), np.float32)
    _self_qkv(y, n_rows, start, sa.q_taps, sa.k_taps, sa.v_taps, cache.hq, cache.hk, cache.hv, cache.anc,
              sa.q_norm, sa.k_norm, sh.cos_tab, sh.sin_tab, eps, heads, kv_heads, cache.k_pool, cache.k_scale,
              cache.v_pool, cache.v_scale, q)
    att = np.empty((n_rows, n_new, heads, dv), np.float32)
    _attend_pool(q, cache.k_pool, cache.k_scale, cache.v_pool, cache.v_scale, cache.anc, start, sh.q_scale,
                 sh.logit_scale, cache.scores, att)
    o = np.empty((n, sa.out.outputs), np.float32)
    _gate_product(att.reshape((n, heads * dv)), y[:, sa.gate_at:], sa.out, o)
    _gated_residual(x, o, sa.post_norm, eps, sa.gate)

    # cross-attention over the clip's memory: int8(cross_norm(x)) -> [q | gate]
    y = np.empty((n, ca.qg.outputs), np.float32)
    _norm_product(x, ca.norm, eps, ca.qg, y)
    qc = np.empty((n, heads, dq), np.float32)
    _head_norm_quant(y[:, :heads * dq], heads, ca.q_norm, eps, qc)
    att = np.empty((n, heads, dv), np.float32)
    _attend_memory(qc, mem.k_codes, mem.k_scale, mem.v_codes, mem.v_scale, sh.q_scale, sh.logit_scale, weights,
                   att)
    o = np.empty((n, ca.out.outputs), np.float32)
    _gate_product(att.reshape((n, heads * dv)), y[:, heads * dq:], ca.out, o)
    _gated_residual(x, o, ca.post_norm, eps, ca.gate)

    _hadamard_residual(x, mlp, eps)
    _lanes_out(stream, hres, hpost, x, u, out)


link_on_demand(globals())   # last: every kernel of this module is defined
