"""Small Numba kernels shared by the encoder and the decoder.

Every kernel is private, takes its output array as `out=` and trusts its caller on dtype and
shape; `blocks.py` holds the public wrappers that check them once. Weights are read-only arrays
shared by every thread, so all kernels release the GIL.

Tunables live here and nowhere else.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# Reassociation lets LLVM vectorise the dot-product reductions (AVX2, 8 lanes); it changes
# only the order of a float sum. Kernels that must round exactly like the reference
# (fake-quant, norms) are compiled without it.
GEMM_FASTMATH = {"reassoc", "contract", "nsz"}
# Up to this many rows the hand-written row kernel beats numpy's BLAS (one BLAS thread,
# [1024,512]: 5 rows 129 vs 328 us, 12 rows 315 vs 371 us; at 375 rows BLAS wins ~66 GFLOP/s).
SMALL_ROWS = 12
# Above this many elements numpy's SIMD exp beats Numba's scalar libm exp (no SVML here):
# softmax over (3000, 375) 1.5 ms vs 13.6 ms; below it numpy's per-call overhead dominates.
SMALL_ELEMENTS = 4096
# The int8 activation/KV fake-quant of the reference (quantize.ACT_BITS = KV_BITS = 8).
INT8_MAX = 127
# One BLAS thread: on this 2-vCPU class of machine two made an encoder layer slower (MEASURED:
# 59.7 vs 34.5 ms), and serving threads already run kernels side by side without the GIL.
BLAS_THREADS = 1


# Python threads a large product is split over by rows (numpy releases the GIL inside BLAS).
# 1 by default: on a shared 2-vCPU host the second core is usually another session's.
GEMM_THREADS = 1
GEMM_SPLIT_ROWS = 128  # below this many rows a product is not worth splitting


def set_blas_threads(threads: int = BLAS_THREADS) -> bool:
    """Set numpy's bundled OpenBLAS thread count for the whole process; False if not found."""
    import ctypes
    import glob
    import os

    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in glob.glob(os.path.join(libs, "*openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                       "openblas_set_num_threads"):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn(ctypes.c_int(threads))
                return True
    return False


def _jit(fastmath=False):
    return njit(cache=True, nogil=True, fastmath=fastmath)


# ---------------------------------------------------------------- products


@_jit(GEMM_FASTMATH)
def _gemm_rows(x, w, out):
    """out[r, n] = x[r] . w[n] for x (R, K), w (N, K) [out, in]; one accumulator per row."""
    rows, k_dim = x.shape
    for n in range(w.shape[0]):
        wn = w[n]
        for r in range(rows):
            xr = x[r]
            acc = np.float32(0.0)
            for k in range(k_dim):
                acc += xr[k] * wn[k]
            out[r, n] = acc


@_jit(GEMM_FASTMATH)
def _fwht_rows(x, group, out):
    """Normalised fast Walsh-Hadamard transform of each `group` block of each row.

    x (R, K); out (R, K_pad) with K_pad a multiple of group, zero padded past K. Computes
    x_g @ H with H = Sylvester Hadamard / sqrt(group), the matrix the CQ packer rotates by.
    """
    rows, k_dim = x.shape
    k_pad = out.shape[1]
    norm = np.float32(1.0 / math.sqrt(group))
    for r in range(rows):
        o = out[r]
        for k in range(k_dim):
            o[k] = x[r, k]
        for k in range(k_dim, k_pad):
            o[k] = 0.0
        for g0 in range(0, k_pad, group):
            h = 1
            while h < group:
                for i in range(g0, g0 + group, 2 * h):
                    for j in range(i, i + h):
                        a = o[j]
                        b = o[j + h]
                        o[j] = a + b
                        o[j + h] = a - b
                h *= 2
        for k in range(k_pad):
            o[k] *= norm


@_jit(GEMM_FASTMATH)
def _levels_gemm(xr, codes, gscale, group, out):
    """Product in the rotated domain: out[r, n] = sum_g gscale[n, g] * (codes[n, g] . xr[r, g]).

    xr (R, K_pad) is the activation after `_fwht_rows`; codes (N, K_pad) int16 level codes;
    gscale (N, K_pad // group) float32 = per-group norm x level unit.
    """
    rows = xr.shape[0]
    n_groups = gscale.shape[1]
    for n in range(codes.shape[0]):
        cn = codes[n]
        for r in range(rows):
            x = xr[r]
            total = np.float32(0.0)
            for g in range(n_groups):
                acc = np.float32(0.0)
                base = g * group
                for k in range(group):
                    acc += np.float32(cn[base + k]) * x[base + k]
                total += acc * gscale[n, g]
            out[r, n] = total


# ---------------------------------------------------------------- row-wise maps


@_jit()
def _fake_quant_rows(x, out):
    """Symmetric int8 fake-quant of each row (quantize.fake_quant with group = row length).

    scale = absmax / 127 (1 when the row is all zero); q = clip(rint(x / scale), -128, 127) * scale;
    rint rounds half to even like jnp.round.
    """
    rows, d = x.shape
    for r in range(rows):
        amax = np.float32(0.0)
        for k in range(d):
            a = abs(x[r, k])
            if a > amax:
                amax = a
        scale = amax / np.float32(INT8_MAX) if amax > 0 else np.float32(1.0)
        for k in range(d):
            q = np.rint(x[r, k] / scale)
            if q > INT8_MAX:
                q = INT8_MAX
            elif q < -INT8_MAX - 1:
                q = -INT8_MAX - 1
            out[r, k] = q * scale


@_jit(GEMM_FASTMATH)
def _zc_rmsnorm_rows(x, scale, eps, out):
    """Zero-centred RMSNorm of each row: (1 + scale) * x / sqrt(mean(x^2) + eps)."""
    rows, d = x.shape
    for r in range(rows):
        ss = 0.0
        for k in range(d):
            v = np.float64(x[r, k])
            ss += v * v
        rms = np.float32(math.sqrt(ss / d + eps))
        for k in range(d):
            out[r, k] = ((np.float32(1.0) + scale[k]) * x[r, k]) / rms


@_jit(GEMM_FASTMATH)
def _rms_unit_rows(x, eps, out):
    """Each row times 1 / sqrt(mean(x^2) + eps) (needle `_rms_unit`)."""
    rows, d = x.shape
    for r in range(rows):
        ss = 0.0
        for k in range(d):
            v = np.float64(x[r, k])
            ss += v * v
        inv = np.float32(1.0 / math.sqrt(ss / d + eps))
        for k in range(d):
            out[r, k] = x[r, k] * inv


@_jit()
def _softmax_rows(x, out):
    rows, d = x.shape
    for r in range(rows):
        m = x[r, 0]
        for k in range(1, d):
            if x[r, k] > m:
                m = x[r, k]
        s = np.float32(0.0)
        for k in range(d):
            e = np.exp(x[r, k] - m)
            out[r, k] = e
            s += e
        inv = np.float32(1.0) / s
        for k in range(d):
            out[r, k] *= inv


@_jit()
def _rope_rows(x, cos, sin, out):
    """Rotate-half RoPE: x (R, H, d), cos/sin (R, d/2) for each row's position.

    [x1 * cos - x2 * sin, x2 * cos + x1 * sin] with x1 = x[..., :d/2], x2 = x[..., d/2:].
    """
    rows, heads, d = x.shape
    half = d // 2
    for r in range(rows):
        for h in range(heads):
            for i in range(half):
                a = x[r, h, i]
                b = x[r, h, half + i]
                c = cos[r, i]
                s = sin[r, i]
                out[r, h, i] = a * c - b * s
                out[r, h, half + i] = b * c + a * s


@_jit()
def _sinkhorn_rows(logits, iters, out):
    """exp of `iters` rounds of log-domain row then column normalisation, per (n, n) matrix."""
    rows, n, _ = logits.shape
    work = np.empty((n, n), np.float32)
    for r in range(rows):
        for i in range(n):
            for j in range(n):
                work[i, j] = logits[r, i, j]
        for _ in range(iters):
            for i in range(n):
                m = work[i, 0]
                for j in range(1, n):
                    m = max(m, work[i, j])
                s = np.float32(0.0)
                for j in range(n):
                    s += np.exp(work[i, j] - m)
                lse = m + np.log(s)
                for j in range(n):
                    work[i, j] -= lse
            for j in range(n):
                m = work[0, j]
                for i in range(1, n):
                    m = max(m, work[i, j])
                s = np.float32(0.0)
                for i in range(n):
                    s += np.exp(work[i, j] - m)
                lse = m + np.log(s)
                for i in range(n):
                    work[i, j] -= lse
        for i in range(n):
            for j in range(n):
                out[r, i, j] = np.exp(work[i, j])


@_jit()
def _silu_inplace(x):
    """x <- x * sigmoid(x) for a 2-D array of any strides."""
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            v = x[r, c]
            x[r, c] = v / (np.float32(1.0) + np.exp(-v))


@_jit()
def _sigmoid_inplace(x):
    """x <- 1 / (1 + exp(-x)) for a 2-D array of any strides."""
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            x[r, c] = np.float32(1.0) / (np.float32(1.0) + np.exp(-x[r, c]))


# ---------------------------------------------------------------- mHC lanes


@_jit(GEMM_FASTMATH)
def _lane_combine(h, x, out):
    """out[r] = sum_j h[r, j] * x[r, j]: the weighted sum of lanes, x (R, n, C), h (R, n)."""
    rows, n, c_dim = x.shape
    for r in range(rows):
        o = out[r]
        for c in range(c_dim):
            o[c] = 0.0
        for j in range(n):
            hj = h[r, j]
            xj = x[r, j]
            for c in range(c_dim):
                o[c] += hj * xj[c]


@_jit(GEMM_FASTMATH)
def _lane_mix(hres, x, hpost, y, out):
    """out[r, i] = sum_j hres[r, i, j] * x[r, j] + hpost[r, i] * y[r]  (mHC residual update)."""
    rows, n, c_dim = x.shape
    for r in range(rows):
        yr = y[r]
        for i in range(n):
            o = out[r, i]
            hp = hpost[r, i]
            for c in range(c_dim):
                o[c] = hp * yr[c]
            for j in range(n):
                hij = hres[r, i, j]
                xj = x[r, j]
                for c in range(c_dim):
                    o[c] += hij * xj[c]
