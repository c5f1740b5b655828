"""The engine's Numba kernels: this module holds the ones the encoder and decoder share;
`decoder`, `encoder`, `alignment` and `simd` hold the rest. Keeping every kernel in this package
lets one cache stamp (`_cache`) invalidate them together.

Every kernel is private, takes its output array as `out=` and trusts its caller on dtype and
shape; `blocks.py` holds the public wrappers that check them once. Weights are read-only arrays
shared by every thread, so all kernels release the GIL.

Tunables live here and nowhere else.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import _target
from ._cache import drop_stale, link_on_demand

_target.configure()                 # the CPU the kernels compile for: before any compiles or loads
drop_stale(Path(__file__).parent)   # before any kernel of the package loads from the cache

from .simd import LANES, _dot1, _dot5, _fwht_groups, _levels_row  # noqa: E402
from . import integer as _integer  # noqa: E402
from .integer import _expand, _tile, _tile_codes  # noqa: E402

# Reassociation lets LLVM vectorise the dot-product reductions (AVX2, 8 lanes); it changes
# only the order of a float sum. Kernels that must round exactly like the reference
# (fake-quant, norms) are compiled without it.
GEMM_FASTMATH = {"reassoc", "contract", "nsz"}
# The exp's polynomial and the maps around it fused into multiply-adds: every sum keeps its order,
# and each step rounds once instead of twice, which is faster and no less exact.
EXP_FASTMATH = {"contract"}
# Up to this many rows the hand-written row kernel beats numpy's BLAS on one thread; past it BLAS's
# blocking wins (benchmarks/few_rows.py measures the crossing).
SMALL_ROWS = 12
# Up to this many rows a packed CQ matrix's product reads its codes in registers (the decoder's
# `_packed_rows`) instead of dequantising the matrix for BLAS (`blocks.CQLinear`): an encoder pass
# over 1-3 s of speech is 12-40 rows, where reading the codes costs less than dequantising them;
# a longer pass amortises the dequantised matrix (benchmarks/encoder.py).
PACKED_ROWS = 40
# The int8 activation/KV fake-quant of the reference (quantize.ACT_BITS = KV_BITS = 8).
INT8_MAX = 127
# One BLAS thread: serving threads already run kernels side by side without the GIL, and a second
# BLAS thread on a small machine competes with them for the same cores.
BLAS_THREADS = 1


# Threads one pass splits its large products and attention over (numpy releases the GIL inside
# BLAS, the kernels release it too). 1 by default: a server runs many sessions' passes side by
# side already, and on a shared 2-vCPU host the second core is usually another session's. Set
# with set_threads() or the WHISTLE_THREADS environment variable for single-stream latency.
GEMM_THREADS = 1
GEMM_SPLIT_ROWS = 128  # below this many rows a product is not worth splitting
# A hand-off to the worker pool costs tens of microseconds, as much as a decoder step's small
# products take, so only the largest (the 8199-row head) is split; row maps are split from
# SPLIT_ELEMENTS elements (the stem's SiLU, the lane mixes).
SPLIT_WEIGHTS = 1 << 22
SPLIT_ELEMENTS = 1 << 18


def set_threads(threads: int) -> None:
    """Threads each encoder / decoder pass splits its large products over (see GEMM_THREADS)."""
    global GEMM_THREADS
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
        raise ValueError(f"threads must be an integer from 1 to 64, got {threads!r}")
    GEMM_THREADS = threads


def _threads_from_env() -> None:
    """WHISTLE_THREADS, if set; a bad value is reported and ignored (one thread), not raised at import."""
    import os
    import warnings

    raw = os.environ.get("WHISTLE_THREADS", "").strip()
    if raw:
        try:
            set_threads(int(raw))
        except ValueError:
            warnings.warn(f"WHISTLE_THREADS must be an integer from 1 to 64, got {raw!r}; using "
                          f"{GEMM_THREADS} thread(s)", RuntimeWarning, stacklevel=2)


_threads_from_env()


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


# Numba's default ("python") error model checks every float division for zero to raise
# ZeroDivisionError, which keeps LLVM from vectorising any loop with a division (a SiLU over the
# stem's 7.7M activations: 10.6 vs 4.7 ms). The numpy model gives inf/nan like the reference.
JIT_OPTIONS = {"cache": True, "nogil": True, "error_model": "numpy"}


def _jit(fastmath=False):
    return njit(fastmath=fastmath, **JIT_OPTIONS)


# ---------------------------------------------------------------- exp


# Cephes expf: exp(x) = 2^n * exp(r), r = x - n ln2 in [-ln2/2, ln2/2], a degree-6 polynomial
# for exp(r); ~1 ulp, and branch-free so LLVM vectorises it (libm's expf is a call per element,
# and the softmax over 375 memory frames is most of a step's exps).
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LO = np.float32(-87.3)  # below this exp underflows float32's normal range: returns 0
_EXP_HI = np.float32(88.7)  # above this it overflows: returns inf
_EXP_POLY = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
             np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))


_INF_BITS = np.int32(0x7F800000)


@njit(inline="always", **JIT_OPTIONS)
def _exp_neg(x, out, bits, n):
    """out[:n] = exp(x[:n]) (vectorised; out may be x itself); bits: int32 scratch (n,).

    Below _EXP_LO the result is 0 and above _EXP_HI inf: the scale 2^k is built as 0 or inf there,
    so no branch reads x after out has been written.
    """
    c0, c1, c2, c3, c4, c5 = _EXP_POLY
    for i in range(n):
        xi = x[i]
        v = xi if xi > _EXP_LO else _EXP_LO  # selects, not min/max: these vectorise
        v = v if v < _EXP_HI else _EXP_HI
        k = np.floor(v * _LOG2E + np.float32(0.5))
        r = v - k * _LN2_HI - k * _LN2_LO
        z = r * r
        y = (((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5) * z + r + np.float32(1.0)
        e = (np.int32(k) + np.int32(127)) << np.int32(23)
        e = np.int32(0) if xi < _EXP_LO else e
        e = _INF_BITS if xi > _EXP_HI else e
        bits[i] = e
        out[i] = y
    scale = bits[:n].view(np.float32)
    for i in range(n):
        out[i] = out[i] * scale[i]


# ---------------------------------------------------------------- products


@_jit(GEMM_FASTMATH)
def _dot5_rows(x, codes, norms, levels, group, out):
    """out[r, n] = `simd._dot5`(codes[n], x, r, norms[n], levels, group, 0) for every five rows r of
    x and every row n of codes (N, K), one code per weight; norms (N, K // group). Past a multiple
    of five the last five rows are read again (the same sums); under five rows go one at a time
    (`simd._dot1`: the same sums too)."""
    rows = x.shape[0]
    if rows < 5:
        for r in range(rows):
            for n in range(codes.shape[0]):
                out[r, n] = _dot1(codes[n], x, r, norms[n], levels, group, 0)[0]
        return
    for step in range(0, rows, 5):
        r = min(step, rows - 5)
        for n in range(codes.shape[0]):
            out[r, n], out[r + 1, n], out[r + 2, n], out[r + 3, n], out[r + 4, n] = _dot5(
                codes[n], x, r, norms[n], levels, group, 0)


@_jit(GEMM_FASTMATH)
def _packed5_rows(x, packed, norms, levels, bits, group, out):
    """`_dot5_rows` for level indices of `bits` bits (2 or 4) in `simd.interleave`'s layout: packed
    (N, >= K * bits / 8) uint8, levels (2**bits,) float32, group a multiple of LANES * 8 // bits."""
    rows = x.shape[0]
    if rows < 5:
        for r in range(rows):
            for n in range(packed.shape[0]):
                if bits == 2:
                    out[r, n] = _dot1(packed[n], x, r, norms[n], levels, group, 2)[0]
                else:
                    out[r, n] = _dot1(packed[n], x, r, norms[n], levels, group, 4)[0]
        return
    for step in range(0, rows, 5):
        r = min(step, rows - 5)  # past a multiple of five the last five again: the same sums
        for n in range(packed.shape[0]):
            if bits == 2:
                s = _dot5(packed[n], x, r, norms[n], levels, group, 2)
            else:
                s = _dot5(packed[n], x, r, norms[n], levels, group, 4)
            out[r, n], out[r + 1, n], out[r + 2, n], out[r + 3, n], out[r + 4, n] = s


@_jit()
def _packed_levels(packed, norms, levels, bits, group, out):
    """out[n, k] = levels[index (n, k)] * norms[n, k // group]: a CQ matrix dequantised in the rotated
    domain (its Hadamard rotation is left to the activation, `_fwht_rows`) from level indices of
    `bits` bits (2 or 4) in `simd.interleave`'s layout; packed (N, >= K_pad * bits / 8) uint8, norms
    (N, K_pad // group) and levels (2**bits,) float32, out (N, K_pad) float32. `simd._levels_row`
    when group is a multiple of its blocks, else a plain loop (the same products)."""
    per = 8 // bits
    block = LANES * per
    if group % block == 0:
        for n in range(packed.shape[0]):
            if bits == 2:
                _levels_row(packed[n], norms[n], levels, group, 2, out[n])
            else:
                _levels_row(packed[n], norms[n], levels, group, 4, out[n])
        return
    mask = (1 << bits) - 1
    for n in range(packed.shape[0]):
        pn = packed[n]
        for k in range(out.shape[1]):
            within = k % block
            out[n, k] = levels[(pn[k // block * LANES + within % LANES] >> (within // LANES * bits)) & mask] \
                * norms[n, k // group]


@_jit(GEMM_FASTMATH)
def _gemm_rows(x, w, out):
    """out[r, n] = x[r] . w[n] for x (R, K), w (N, K) [out, in]: five rows at a time through
    `simd._dot5` when K is a multiple of its lanes (the rows past a multiple of five one at a time),
    else one accumulator per row. Through `_dot5` a row's sums run in the same order whatever rows
    come with it: compiled into a caller, the plain loop's reductions were vectorised differently
    for the rows of an unrolled body and those of its remainder (the mHC maps of a one-token step
    differed from teacher forcing's by ~1e-7)."""
    rows, k_dim = x.shape
    if k_dim % LANES == 0 and k_dim > 0 and w.strides[1] == 4:
        ones = np.ones((w.shape[0], 1), np.float32)  # one group of K per row, norm 1
        _dot5_rows(np.ascontiguousarray(x), w, ones, ones[0], k_dim, out)
        return
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
    vector = group in (16, 32, 64, 128) and group % LANES == 0  # simd._fwht_groups' sizes
    for r in range(rows):
        o = out[r]
        for k in range(k_dim):
            o[k] = x[r, k]
        for k in range(k_dim, k_pad):
            o[k] = 0.0
        if vector:  # the same butterflies in registers (a literal size per call site)
            if group == 128:
                _fwht_groups(o, 128)
            elif group == 64:
                _fwht_groups(o, 64)
            elif group == 32:
                _fwht_groups(o, 32)
            else:
                _fwht_groups(o, 16)
            continue
        h = 1
        if group >= 8:  # stages h = 1, 2, 4 as one unrolled 8-point transform: their inner loops
            h = 8       # are too short to vectorise (same sums in the same order: bit-identical)
            for i in range(0, k_pad, 8):
                a0, a1, a2, a3 = o[i], o[i + 1], o[i + 2], o[i + 3]
                a4, a5, a6, a7 = o[i + 4], o[i + 5], o[i + 6], o[i + 7]
                b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
                b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
                c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
                c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
                o[i], o[i + 1], o[i + 2], o[i + 3] = c0 + c4, c1 + c5, c2 + c6, c3 + c7
                o[i + 4], o[i + 5], o[i + 6], o[i + 7] = c0 - c4, c1 - c5, c2 - c6, c3 - c7
        while h < group:
            for g0 in range(0, k_pad, group):
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


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE bit pattern is the int32 `bits` (a register bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(inline="always", **JIT_OPTIONS)
def _int8_scale(xr):
    """The symmetric int8 scale of a contiguous float32 vector: absmax / 127, or 1 when it is all
    zero (inputs are finite: the boundaries check).

    The absolute maximum is taken over the bit patterns with the sign bit cleared, as int32: for
    finite floats their order is the floats' order, and an integer max reduction vectorises where
    the float compare-and-select did not (5 rows x 2048: 0.9 us instead of 5.7)."""
    bits = xr.view(np.int32)
    top = np.int32(0)
    for k in range(bits.shape[0]):
        b = bits[k] & np.int32(0x7FFFFFFF)
        top = b if b > top else top
    amax = _float32_from_bits(top)
    return amax / np.float32(INT8_MAX) if amax > 0 else np.float32(1.0)


@njit(inline="always", **JIT_OPTIONS)
def _int8_code(v, scale):
    """v's int8 code on the grid of `scale`, as a float32: clip(rint(v / scale), -128, 127), rint
    rounding half to even like jnp.round."""
    c = np.rint(v / scale)
    c = np.float32(INT8_MAX) if c > INT8_MAX else c
    return np.float32(-INT8_MAX - 1) if c < -INT8_MAX - 1 else c


@_jit()
def _fake_quant_rows(x, out):
    """Symmetric int8 fake-quant of each row (quantize.fake_quant with group = row length).

    scale = absmax / 127 (1 when the row is all zero); q = clip(rint(x / scale), -128, 127) * scale;
    rint rounds half to even like jnp.round.
    """
    rows, d = x.shape
    q = np.empty(d, np.float32)  # x may be out: a loop reading one and writing the other in place
    for r in range(rows):         # fails LLVM's overlap check and runs scalar (10 us, not 1)
        xr = x[r]
        o = out[r]
        scale = _int8_scale(xr)
        for k in range(d):
            q[k] = _int8_code(xr[k], scale)
        for k in range(d):
            o[k] = q[k] * scale


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


@njit(inline="always", **JIT_OPTIONS)
def _max_flat(x):
    """The largest of a contiguous float32 vector without NaN, through int32 keys of its bit
    patterns that order as the floats do (negative floats' magnitude bits flipped): an integer
    max reduction vectorises where the float compare-and-select did not (384 x 1024: 0.07 ms, not 0.41)."""
    bits = x.view(np.int32)
    top = np.int32(-2147483648)
    for k in range(bits.shape[0]):
        b = bits[k]
        key = b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))
        top = key if key > top else top
    return _float32_from_bits(top ^ ((top >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@_jit(GEMM_FASTMATH)
def _sum_flat(x, n):
    """x[:n] summed with reassociation (vector partial sums: 0.03 ms for 384 x 1024, not 0.22)."""
    s = np.float32(0.0)
    for k in range(n):
        s += x[k]
    return s


@_jit(EXP_FASTMATH)
def _softmax_rows(x, out):
    """out[r] = exp(x[r] - max) / sum over each row (x may be out); the vectorised exp, max and sum."""
    rows, d = x.shape
    shifted = np.empty(d, np.float32)
    bits = np.empty(d, np.int32)
    for r in range(rows):
        xr = x[r]
        for k in range(d):
            shifted[k] = xr[k]
        m = _max_flat(shifted)
        for k in range(d):
            shifted[k] -= m
        o = out[r]
        _exp_neg(shifted, o, bits, d)
        inv = np.float32(1.0) / _sum_flat(o, d)
        for k in range(d):
            o[k] *= inv


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


# Below this a column of exp(logits - row max) is treated as empty and the matrix goes through
# the log-domain loop instead (whose normalisation never divides by an underflowed sum).
_SINKHORN_TINY = np.float32(1e-30)


@_jit()
def _sinkhorn_log(work, iters):
    """`iters` rounds of log-domain row then column normalisation of work (n, n), in place."""
    n = work.shape[0]
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


@njit(inline="always", **JIT_OPTIONS)
def _normalise_lines(work, total, by_rows):
    """Each row (by_rows) or column of every matrix in work (n, n, matrices) divided by its sum,
    the matrices side by side in the innermost loops; total: (matrices,) scratch."""
    n = work.shape[0]
    one = np.float32(1.0)
    for a in range(n):
        total[:] = 0.0
        for b in range(n):
            line = work[a, b] if by_rows else work[b, a]
            for r in range(line.shape[0]):
                total[r] += line[r]
        for r in range(total.shape[0]):
            total[r] = one / total[r]
        for b in range(n):
            line = work[a, b] if by_rows else work[b, a]
            for r in range(line.shape[0]):
                line[r] *= total[r]


@_jit()
def _sinkhorn_rows(logits, iters, out):
    """exp of `iters` rounds of log-domain row then column normalisation, per (n, n) matrix.

    needle `_sinkhorn` subtracts logsumexp over rows then columns; subtracting a log-sum in the
    log domain is dividing by the sum after exp, so the same rounds run on exp(logits - row max)
    with n^2 exps per matrix instead of 2 n^2 per round (the same numbers to float rounding).
    The rounds run on every matrix at once, entry (i, j) of each side by side (work (n, n, rows)),
    so they vectorise across the matrices; each matrix's sums keep their order. A matrix whose
    exps underflow a whole column takes the log-domain loop.
    """
    rows, n, _ = logits.shape
    work = np.empty((n, n, rows), np.float32)
    ok = np.empty(rows, np.bool_)
    for r in range(rows):
        for i in range(n):
            m = logits[r, i, 0]
            for j in range(1, n):
                m = max(m, logits[r, i, j])
            for j in range(n):
                work[i, j, r] = np.exp(logits[r, i, j] - m)
        ok[r] = True
        for j in range(n):
            s = np.float32(0.0)
            for i in range(n):
                s += work[i, j, r]
            if not s > _SINKHORN_TINY:
                ok[r] = False
    total = np.empty(rows, np.float32)
    for _ in range(iters):   # every matrix, the log-domain ones' entries overwritten below
        _normalise_lines(work, total, True)
        _normalise_lines(work, total, False)
    single = np.empty((n, n), np.float32)
    for r in range(rows):
        o = out[r]
        if ok[r]:
            for i in range(n):
                for j in range(n):
                    o[i, j] = work[i, j, r]
            continue
        for i in range(n):
            for j in range(n):
                single[i, j] = logits[r, i, j]
        _sinkhorn_log(single, iters)
        for i in range(n):
            for j in range(n):
                o[i, j] = np.exp(single[i, j])


EXP_CHUNK = 2048  # elements per pass of the vectorised exp (scratch stays in L1)


@_jit(EXP_FASTMATH)
def _logistic_flat(x, times_x):
    """x <- (x if times_x else 1) / (1 + exp(-x)) over a flat float32 array: SiLU or sigmoid,
    with the vectorised `_exp_neg` a chunk at a time."""
    n = x.shape[0]
    e = np.empty(EXP_CHUNK, np.float32)
    bits = np.empty(EXP_CHUNK, np.int32)
    one = np.float32(1.0)
    for a in range(0, n, EXP_CHUNK):
        m = min(EXP_CHUNK, n - a)
        xs = x[a:a + m]
        for i in range(m):
            e[i] = -xs[i]
        _exp_neg(e, e, bits, m)
        if times_x:
            for i in range(m):
                xs[i] = xs[i] / (one + e[i])
        else:
            for i in range(m):
                xs[i] = one / (one + e[i])


@_jit(EXP_FASTMATH)
def _logistic_rows(x, times_x):
    """`_logistic_flat` for a 2-D array of any strides, a row at a time through scratch."""
    for r in range(x.shape[0]):
        row = np.ascontiguousarray(x[r])
        _logistic_flat(row, times_x)
        x[r] = row


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


# ---------------------------------------------------------------- integer products (integer.py)


_MR, _NR = _integer.MR, _integer.NR  # the tile's rows and column blocks (literals in the calls below)
# Up to this many rows `_integer_gemm` expands the codes in registers per tile (`integer._tile_codes`)
# instead of once per NR blocks into a scratch every row reads (`_expand`, `_tile`); on the VNNI
# path only (a constant when the kernels compile: the AVX2 path's code never holds vpermw).
FEW_ROWS = 10
_VNNI = _integer.VNNI


# Whether `blocks.CQLinear` builds and `quantised` takes the integer products (on a CPU that has
# them unless WHISTLE_INTEGER=0, integer.ENABLED); read when a matrix is built and at each call.
INTEGER_PRODUCTS = _integer.ENABLED


@_jit()
def _quant_rotate_rows(x, group, out, scales):
    """Each row's int8 codes (`_int8_code` on its `_int8_scale`, the fake-quant's) rotated per
    `group` block by the Walsh-Hadamard matrix without its 1/sqrt(group): exact integers within
    +-128 * group. x (R, K) float32; out (R, K_pad) int16, zero padded past K; scales (R,) float32
    the rows' int8 scales. fake_quant_int8(x) rotated by `_fwht_rows` is out * scales / sqrt(group).

    The codes go through `_fwht_rows`' float transform (its vector butterflies where the group
    allows them): its sums of integers are exact, its 1/sqrt(group) is undone by rounding to the
    nearest integer (float32's error on values within 16384 is far below 1/2)."""
    rows, d = x.shape
    k_pad = out.shape[1]
    codes = np.empty((1, d), np.float32)
    rotated = np.empty((1, k_pad), np.float32)
    root = np.float32(math.sqrt(group))
    for r in range(rows):
        xr = x[r]
        scale = _int8_scale(xr)
        scales[r] = scale
        for k in range(d):
            codes[0, k] = _int8_code(xr[k], scale)
        _fwht_rows(codes, group, rotated)
        o = out[r]
        for k in range(k_pad):
            o[k] = np.int16(np.rint(rotated[0, k] * root))


@njit(inline="always", **JIT_OPTIONS)
def _row_tiles(a, scales, levels, norms, span, nr, out):
    """Every row of a (`_MR` at a time) by `integer._tile` against nr column blocks (`_NR` or 1)
    of levels in `_expand`'s layout with their norms, into out's first 16 nr columns."""
    for m in range(0, a.shape[0], _MR):
        if nr == _NR:
            _tile(a, levels, norms, scales, m, span, _MR, _NR, out)
        else:
            _tile(a, levels, norms, scales, m, span, _MR, 1, out)


@_jit()
def _int8_rows(x, codes, scales):
    """Each row's int8 codes as int16 (`_int8_code` on its `_int8_scale`: fake_quant_int8(x) is
    codes * scales), zero past x's columns: x (R, K) float32, codes (R, >= K) int16, scales (R,)."""
    rows, d = x.shape
    for r in range(rows):
        xr = x[r]
        scale = _int8_scale(xr)
        scales[r] = scale
        c = codes[r]
        for k in range(d):
            c[k] = np.int16(_int8_code(xr[k], scale))
        for k in range(d, codes.shape[1]):
            c[k] = 0


@_jit()
def _integer_scores(a, scales, levels, norms, out):
    """out[m, 16 j + c] = scales[m] * norms[j, 0, c] * (a[m] . the codes of column 16 j + c), the
    dot product of int8 codes exact in int32 (`integer._tile`, one span of the whole row): a (R, K)
    int16 codes with their scales (R,), levels (B, K / 2, 32) int16 in `integer.key_levels`'
    layout, norms (B, 1, 16) float32, out (R, >= 16 B) float32 (any row stride)."""
    blocks = levels.shape[0]
    b = 0
    while b < blocks:
        nr = _NR if blocks - b >= _NR else 1
        _row_tiles(a, scales, levels[b:b + nr], norms[b:b + nr], 2 * levels.shape[1], nr,
                   out[:, _integer.COLUMNS * b:])
        b += nr


@_jit()
def _integer_gemm(a, scales, w, first, last, out):
    """out[:, 16 first : 16 last] = the integer product (integer.py) of a `integer.IntegerMatrix`'s
    column blocks [first, last): a (R, K_pad) int16 from `_quant_rotate_rows` with its scales (R,);
    out (R, N) float32. Up to FEW_ROWS rows (a decoder step) each tile expands the codes in
    registers (`_few_rows`); more rows share each run of NR blocks expanded once (`_expand`) by
    every row's tile (`_tile`). Either way a row's sums are the same. Few tile shapes, each a
    tail's too (a tile's rows past the last are the last again): every shape is machine code in
    each kernel that calls this one."""
    rows = a.shape[0]
    if _VNNI:
        if rows <= FEW_ROWS:
            for m in range(0, rows, _integer.FEW_MR):
                _few_rows(a, scales, w, first, last, m, out)
            return
    buf = np.empty((_NR, w.codes.shape[1], _integer.PAIR_LANES), np.int16)
    b = first
    while b < last:
        nr = _NR if last - b >= _NR else 1
        for s in range(nr):
            if w.bits == 2:
                _expand(w.codes, w.table, b + s, s, 2, buf)
            else:
                _expand(w.codes, w.table, b + s, s, 4, buf)
        _row_tiles(a, scales, buf, w.norms[b:b + nr], w.span, nr, out[:, _integer.COLUMNS * b:])
        b += nr


@_jit()
def _few_rows(a, scales, w, first, last, m, out):
    """Rows m .. m + 4 (those that exist) of `_integer_gemm`'s product over column blocks [first,
    last), by `_tile_codes`: five rows by three blocks a tile (one row alone where one is left),
    one block at a time at the end."""
    one = a.shape[0] - m == 1
    b = first
    while b < last:
        nr = _NR if last - b >= _NR else 1
        if w.bits == 2:
            _few_tile(a, scales, w, b, m, one, nr, 2, out)
        else:
            _few_tile(a, scales, w, b, m, one, nr, 4, out)
        b += nr


@njit(inline="always", **JIT_OPTIONS)
def _few_tile(a, scales, w, b, m, one, nr, bits, out):
    """`_few_rows`' tile at block b: 1 row or 5, nr blocks (3 or 1), codes of `bits` (a literal)."""
    codes, nrm, o = w.codes[b:], w.norms[b:], out[:, _integer.COLUMNS * b:]
    if one:
        if nr == _NR:
            _tile_codes(a, codes, w.table, nrm, scales, m, w.span, 1, 3, bits, o)
        else:
            _tile_codes(a, codes, w.table, nrm, scales, m, w.span, 1, 1, bits, o)
    elif nr == _NR:
        _tile_codes(a, codes, w.table, nrm, scales, m, w.span, 5, 3, bits, o)
    else:
        _tile_codes(a, codes, w.table, nrm, scales, m, w.span, 5, 1, bits, o)


link_on_demand(globals())   # last: every kernel of this module is defined
