"""Building blocks the encoder and the decoder share (guide §6, needle `architecture.py`).

Weights come from a `CactFile` and are kept as read-only float32 arrays; every call takes its
activations as float32 (rows, features) arrays and returns new arrays (or writes `out=`).
Where the reference fake-quantises activations to int8 (`_aq`) the callers here do the same,
at the same points, with `fake_quant_int8`.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from . import kernels as K
from .results import KernelPath
from .kernels import _target, simd
from .kernels import integer as KI
from .kernels.decoder import HadamardMlp, _hadamard_residual, _packed_rows
from .kernels.simd import PACKED_BITS, interleave

NORM_EPS = 1e-6  # ZCRMSNorm and _rms_unit epsilon in the reference
SINKHORN_ITERS = 20  # needle `_sinkhorn` default


def _f32_rows(x: np.ndarray) -> np.ndarray:
    """x as a C-contiguous float32 2-D view (rows, features), copying only when needed."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x


# ---------------------------------------------------------------- elementwise and row maps


def split_rows(fn: Callable[[int, int], object], rows: int, size: int) -> None:
    """fn(a, b) over all rows: split over kernels.GEMM_THREADS threads when the map touches at least
    kernels.SPLIT_ELEMENTS elements (a hand-off to the pool costs ~50-100 us here)."""
    if K.GEMM_THREADS > 1 and rows >= 2 and size >= K.SPLIT_ELEMENTS:
        run_split(fn, rows)
    else:
        fn(0, rows)


def fake_quant_int8(x: np.ndarray) -> np.ndarray:
    """Symmetric int8 fake-quant over the last axis (quantize.fake_quant, group = last dim, 8 bits).

    Per row: scale = absmax / 127 (1 for an all-zero row), round half to even, clip to
    [-128, 127], multiply back. Returns a new float32 array of x's shape.
    """
    x2 = _f32_rows(x)
    out = np.empty_like(x2)
    split_rows(lambda a, b: K._fake_quant_rows(x2[a:b], out[a:b]), x2.shape[0], x2.size)
    return out.reshape(np.shape(x))


def zc_rmsnorm(x: np.ndarray, scale: np.ndarray, eps: float = NORM_EPS) -> np.ndarray:
    """Zero-centred RMSNorm over the last axis: (1 + scale) * x / sqrt(mean(x^2) + eps)."""
    x2 = _f32_rows(x)
    out = np.empty_like(x2)
    scale = np.asarray(scale, np.float32)
    split_rows(lambda a, b: K._zc_rmsnorm_rows(x2[a:b], scale, eps, out[a:b]), x2.shape[0], x2.size)
    return out.reshape(np.shape(x))


def rms_unit(x: np.ndarray, eps: float = NORM_EPS) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis (needle `_rms_unit`)."""
    x2 = _f32_rows(x)
    out = np.empty_like(x2)
    split_rows(lambda a, b: K._rms_unit_rows(x2[a:b], eps, out[a:b]), x2.shape[0], x2.size)
    return out.reshape(np.shape(x))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, max-subtracted, float32."""
    x2 = _f32_rows(x)
    out = np.empty_like(x2)
    split_rows(lambda a, b: K._softmax_rows(x2[a:b], out[a:b]), x2.shape[0], x2.size)
    return out.reshape(np.shape(x))


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) as a new float32 array."""
    out = np.array(x, dtype=np.float32, order="C", copy=True)
    silu_inplace(out)
    return out


def silu_inplace(x: np.ndarray) -> None:
    """x <- x * sigmoid(x) for a float32 array (vectorised exp when C-contiguous)."""
    if x.flags.c_contiguous:
        flat = x.reshape(-1)
        split_rows(lambda a, b: K._logistic_flat(flat[a * 512:b * 512], True), -(-flat.size // 512), flat.size)
    else:
        K._logistic_rows(x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1), True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) as a new float32 array."""
    out = np.array(x, dtype=np.float32, order="C", copy=True)
    sigmoid_inplace(out)
    return out


def sigmoid_inplace(x: np.ndarray) -> None:
    """x <- 1 / (1 + exp(-x)) for a float32 array of any strides (vectorised exp when C-contiguous)."""
    if x.flags.c_contiguous:
        flat = x.reshape(-1)
        split_rows(lambda a, b: K._logistic_flat(flat[a * 512:b * 512], False), -(-flat.size // 512), flat.size)
    elif x.ndim == 2:
        split_rows(lambda a, b: K._logistic_rows(x[a:b], False), x.shape[0], x.size)
    else:
        K._logistic_rows(x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1), False)


def sinkhorn(logits: np.ndarray, iters: int = SINKHORN_ITERS) -> np.ndarray:
    """exp of `iters` rounds of log-domain row then column normalisation of each (n, n) matrix
    (needle `_sinkhorn`); logits (rows, n, n) -> (rows, n, n) float32."""
    logits = np.ascontiguousarray(logits, np.float32)
    out = np.empty_like(logits)
    split_rows(lambda a, b: K._sinkhorn_rows(logits[a:b], iters, out[a:b]), logits.shape[0],
                logits.size * iters)  # an entry's round: a vector lane's add and multiply
    return out


# ---------------------------------------------------------------- RoPE


def rope_tables(head_dim: int, positions: np.ndarray, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables (len(positions), head_dim // 2) for rotate-half RoPE.

    Frequencies 1 / theta^(arange(0, d, 2) / d), computed in float32 like
    needle `precompute_rope_freqs`.
    """
    freqs = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                          / np.float32(head_dim)))).astype(np.float32)
    angles = np.outer(np.asarray(positions, np.float32), freqs).astype(np.float32)
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE on x (rows, heads, d) with per-row tables cos/sin (rows, d // 2); half-split layout."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    K._rope_rows(x, np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32), out)
    return out


# ---------------------------------------------------------------- matrices


_POOL = None


def thread_pool():
    """The shared worker pool for split products (kernels.GEMM_THREADS workers)."""
    global _POOL
    if _POOL is None or _POOL._max_workers != K.GEMM_THREADS:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(K.GEMM_THREADS, thread_name_prefix="whistle-gemm")
    return _POOL


_SPLIT = threading.local()  # .active: this thread is running one part of a split


def run_split(fn: Callable[[int, int], object], total: int) -> None:
    """fn(a, b) over kernels.GEMM_THREADS contiguous ranges of range(total): the first on this
    thread, the others on the shared pool (fn must release the GIL to gain anything). A split
    inside a part runs inline, so a pool worker never waits on the pool."""
    if getattr(_SPLIT, "active", False) or total < 2:
        fn(0, total)
        return
    parts = K.GEMM_THREADS
    bounds = [total * i // parts for i in range(parts + 1)]

    def part(a: int, b: int) -> None:
        _SPLIT.active = True
        try:
            fn(a, b)
        finally:
            _SPLIT.active = False

    jobs = [thread_pool().submit(part, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
    try:
        part(bounds[0], bounds[1])
    finally:
        for job in jobs:
            job.result()


class Linear:
    """y = x @ W.T for a stored [out, in] matrix, dequantised once to float32.

    Many rows go to numpy's BLAS, a handful (decoder beams) to a hand-written row kernel that
    beats BLAS call overhead there (kernels.SMALL_ROWS).
    """

    def __init__(self, weight: np.ndarray):
        w = np.ascontiguousarray(weight, dtype=np.float32)
        if w.ndim != 2:
            raise ValueError(f"a Linear weight is a 2-D [out, in] matrix, got shape {w.shape}")
        w.setflags(write=False)
        self.weight = w

    @classmethod
    def from_cact(cls, cact, name: str) -> "Linear":
        return cls(cact.array(name))

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in)."""
        return self.weight.shape

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x (rows, in) float32 -> (rows, out) float32."""
        return _product(_f32_rows(x), self.weight, out)

    def quantised(self, x: np.ndarray) -> np.ndarray:
        """The product of fake_quant_int8(x)."""
        return self(fake_quant_int8(x))


def _product(x: np.ndarray, weight: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """x (rows, K) @ weight (N, K).T into out (rows, N): the row kernel for a few rows, else BLAS
    (split by rows over the pool from GEMM_SPLIT_ROWS rows when GEMM_THREADS > 1)."""
    if out is None:
        out = np.empty((x.shape[0], weight.shape[0]), np.float32)
    rows = x.shape[0]
    if rows <= K.SMALL_ROWS:
        K._gemm_rows(x, weight, out)
    elif K.GEMM_THREADS > 1 and rows >= K.GEMM_SPLIT_ROWS:
        run_split(lambda a, b: np.matmul(x[a:b], weight.T, out=out[a:b]), rows)
    else:
        np.matmul(x, weight.T, out=out)
    return out


def packed_levels(cqs, integer: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CQ matrices of one width in `PACKED_BITS` (so one codebook), one group and one input size, stacked along their
    outputs as (codes, norms, levels): level indices in `simd.interleave`'s layout (N, K_pad * bits / 8)
    uint8, norms (N, K_pad // group) float32, levels (2**bits,) float32, so that row n's group g is
    levels[codes] * norms[n, g] before its Hadamard rotation. integer: 4-bit levels as
    `integer_levels` (the unit folded into the norms), the decoder's int16 level codes' arithmetic.
    One matrix's indices are unpacked at a time: the byte-per-weight form is never whole."""
    first = cqs[0]
    if first.bits not in PACKED_BITS or any(
            c.bits != first.bits or c.group != first.group or c.in_pad != first.in_pad
            or not np.array_equal(c.codebook, first.codebook) for c in cqs):
        raise ValueError(f"packed CQ matrices share one width in {PACKED_BITS}, one codebook, one group "
                         "and one input size")
    codes = [interleave(c.codes(), first.bits) for c in cqs]
    if integer and first.bits == 4:
        ints, unit = integer_levels(first.codebook)   # the grid `decoder_levels` describes
        levels, scale = ints.astype(np.float32), np.float32(unit)
    else:
        levels, scale = np.ascontiguousarray(first.codebook, np.float32), np.float32(1.0)
    norms = [np.asarray(c.norms, np.float32) * scale for c in cqs]
    stack = (lambda parts: np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts)))
    return stack(codes), stack(norms), levels


_scratch = threading.local()


def _weight_scratch(rows: int, cols: int) -> np.ndarray:
    """A (rows, cols) float32 buffer of this thread's, grown to the largest asked for and reused:
    `CQLinear` dequantises one matrix at a time into it."""
    size = rows * cols
    buf = getattr(_scratch, "weights", None)
    if buf is None or buf.size < size:
        buf = _scratch.weights = np.empty(size, np.float32)
    return buf[:size].reshape(rows, cols)


class CQLinear:
    """y = x @ W.T for a CQ matrix (or several stacked along their outputs) whose level indices
    stay packed (2 or 4 bits each): the many-row products (the stem, the encoder, the decoder's
    cross-attention K and V over the memory).

    A CQ row group is w_g = (levels[idx] * norm) @ H with H the symmetric normalised Walsh-Hadamard
    matrix, so x_g . w_g = (x_g @ H) . (levels[idx] * norm). Each call rotates the activation
    (`_fwht_rows`), dequantises the matrix without its rotation into this thread's scratch
    (`_packed_levels`) and hands the product to BLAS: the model holds a sixteenth of the bytes of
    float32 weights (2-bit), plus one matrix's float32 per thread. Up to `kernels.PACKED_ROWS`
    rows (a short clip) the decoder's `_packed_rows` reads the codes instead, without the copy
    (the encoder's matrices; `few_rows=False` keeps BLAS). Agrees with `Linear` on the
    dequantised matrix to float32 rounding (the sums run in another order).
    """

    def __init__(self, cqs, few_rows: bool = True, integer: bool = False):
        first = cqs[0]
        # False: BLAS at any row count (the decoder's cross-attention K and V, whose int8 codes
        # follow the products' rounding: the parity tests against the reference hold them there)
        self.few_rows = few_rows
        self.bits, self.group, self.k_pad = first.bits, first.group, first.in_pad
        self.sizes = [c.shape[0] for c in cqs]
        self.shape = (sum(self.sizes), first.shape[1])
        # integer: `quantised` is called (the encoder's products of int8 activations)
        self.integer = integer_form(cqs) if integer else None
        # the float path's packed form; with the integer products it is built only if the float
        # path is called (the integer products switched off), not held twice
        self._cqs = cqs
        self._packed = None if self.integer is not None else self._pack()

    def _pack(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        form = packed_levels(self._cqs)
        for a in form:
            a.setflags(write=False)
        return form

    @property
    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, norms, levels) of `packed_levels`: the float path's form of the matrix."""
        if self._packed is None:
            self._packed = self._pack()
        return self._packed

    @classmethod
    def from_cact(cls, cact, *names: str, few_rows: bool = True, integer: bool = False) -> "CQLinear | Linear":
        """The records stacked along their outputs; a dense `Linear` of them when they are not
        all CQ of one packed width (`PACKED_BITS`), codebook, group and input size."""
        try:
            cqs = [cact.packed_cq(name) for name in names]
            return cls(cqs, few_rows, integer)
        except (TypeError, ValueError):
            weights = [cact.array(name) for name in names]
            return Linear(weights[0] if len(weights) == 1 else np.concatenate(weights))

    def _input(self, x: np.ndarray) -> np.ndarray:
        """x as float32 rows of the matrix's input size, or a ValueError naming both sizes."""
        x = _f32_rows(x)
        if x.shape[1] != self.shape[1]:
            raise ValueError(f"input has {x.shape[1]} features, the matrix takes {self.shape[1]}")
        return x

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x (rows, in) float32 -> (rows, out) float32."""
        x = self._input(x)
        xr = np.empty((x.shape[0], self.k_pad), np.float32)
        K._fwht_rows(x, self.group, xr)
        codes, norms, levels = self.packed
        if self.few_rows and x.shape[0] <= K.PACKED_ROWS:  # the codes in registers, no dequantised copy
            if out is None:
                out = np.empty((x.shape[0], self.shape[0]), np.float32)
            _packed_rows(xr, codes, norms, levels, self.bits, self.group, out)
            return out
        w = _weight_scratch(self.shape[0], self.k_pad)
        K._packed_levels(codes, norms, levels, self.bits, self.group, w)
        return _product(xr, w, out)

    def quantised(self, x: np.ndarray) -> np.ndarray:
        """The product of fake_quant_int8(x): x (rows, in) float32 -> (rows, out) float32. With the
        integer products on (`kernels.INTEGER_PRODUCTS`, the matrix built with them:
        `integer_matrix`) the int8 codes times the integer levels, exact in int32
        (`kernels.integer`; at 13 rows 2.4x faster than the float path, at 375 1.6x); else the
        fake-quantised float rows through `__call__`."""
        x = self._input(x)
        if self.integer is None or not K.INTEGER_PRODUCTS:
            return self(fake_quant_int8(x))
        return integer_product(x, self.group, self.k_pad, self.integer, self.shape[0], False)


def integer_product(x: np.ndarray, group: int, k_pad: int, w: "KI.IntegerMatrix", columns: int,
                    split: bool) -> np.ndarray:
    """(rows, columns) float32: `kernels._integer_gemm` of x's rotated int8 codes (rows, K_pad)
    int16 (`kernels._quant_rotate_rows`) with their scales. Many rows (GEMM_SPLIT_ROWS, with
    GEMM_THREADS > 1) are split by rows over the shared pool, each part quantising its own rows and
    taking every column (no quantisation before the hand-off); fewer by column blocks where `split`.
    A row's sums are the same either way. The columns the matrix was padded with to whole
    16-column blocks dropped (contiguous)."""
    rows = x.shape[0]
    blocks = w.codes.shape[0]
    q = np.empty((rows, k_pad), np.int16)
    scales = np.empty(rows, np.float32)
    out = np.empty((rows, KI.COLUMNS * blocks), np.float32)

    def by_rows(a: int, b: int) -> None:
        K._quant_rotate_rows(x[a:b], group, q[a:b], scales[a:b])
        K._integer_gemm(q[a:b], scales[a:b], w, 0, blocks, out[a:b])

    if K.GEMM_THREADS > 1 and rows >= K.GEMM_SPLIT_ROWS:
        run_split(by_rows, rows)
    elif split:
        K._quant_rotate_rows(x, group, q, scales)
        run_split(lambda a, b: K._integer_gemm(q, scales, w, a, b, out), blocks)
    else:
        by_rows(0, rows)
    return out if out.shape[1] == columns else np.ascontiguousarray(out[:, :columns])


def integer_products_run(decoder: bool = False) -> bool:
    """Whether the encoder's (many-row) products, or with `decoder` the decoder's (few-row) ones,
    take the integer products here: on (`kernels.INTEGER_PRODUCTS`), and the decoder's on the VNNI
    path only (`integer.VNNI`; the AVX2 path has no in-register code expansion)."""
    return bool(K.INTEGER_PRODUCTS and (KI.VNNI if decoder else KI.AVAILABLE))


def kernel_path() -> KernelPath:
    """The path the kernels take here (for the logs, `warm`, and the tests that depend on it)."""
    tier = _target.compiled_tier()
    return KernelPath(_target.machine(), tier and tier.name, simd.PATH,
                      integer_products_run(False), integer_products_run(True))


def integer_form(cqs, decoder: bool = False) -> "KI.IntegerMatrix | None":
    """Stacked CQ matrices' integer form where the integer products run here
    (`kernels.INTEGER_PRODUCTS`) and the matrices fit them (`integer_matrix`: near the codebook,
    or with `decoder` near `decoder_levels`, the levels the decoder's float products take), else
    None. The decoder's (few rows, `decoder`) on the VNNI path only (`integer.VNNI`)."""
    if not integer_products_run(decoder):
        return None
    first = cqs[0]
    return integer_matrix(cqs, levels=decoder_levels(first.codebook, first.bits) if decoder else None)


def integer_matrix(cqs, tolerance: float = KI.LEVEL_TOLERANCE,
                   levels: np.ndarray | None = None) -> "KI.IntegerMatrix | None":
    """Stacked CQ matrices (as `packed_levels` takes them) for the integer products, or None when
    they do not fit them (a power-of-two group up to `integer.MAX_GROUP`, an integer grid within
    `tolerance` of the largest level of `levels`, the levels the float products multiply by: the
    codebook's own unless given): their level indices in
    `integer.vnni_codes`' layout, padded with zero columns to whole 16-column blocks (their outputs
    are 0: `integer_product` drops them), the codebook as integers up to
    `integer.level_limit(span)` for the longest span of `integer.SPANS` (at most the group) whose
    grid holds it, and the norms times its unit over sqrt(group)."""
    first = cqs[0]
    group = first.group
    if group > KI.MAX_GROUP or group < 2 or group & (group - 1):
        return None
    codebook = np.asarray(first.codebook if levels is None else levels, np.float64)
    for span in sorted({min(span, group) for span in KI.SPANS}, reverse=True):
        ints, unit = integer_levels(first.codebook, KI.level_limit(span))
        if np.abs(ints * unit - codebook).max() <= tolerance * np.abs(codebook).max():
            break
    else:
        return None
    table = np.zeros(KI.PAIR_LANES, np.int16)
    table[:ints.size] = ints
    pad = (-sum(c.shape[0] for c in cqs)) % KI.COLUMNS
    codes = np.concatenate([c.codes() for c in cqs] + [np.zeros((pad, first.in_pad), np.uint8)])
    codes = KI.vnni_codes(codes, first.bits)
    scale = np.float32(unit / np.sqrt(group))
    norms = np.concatenate([np.asarray(c.norms, np.float32) for c in cqs] + [np.zeros((pad, first.in_pad // group),
                                                                                       np.float32)])
    norms = KI.block_norms(norms * scale)
    for a in (codes, table, norms):
        a.setflags(write=False)
    return KI.IntegerMatrix(codes, table, norms, first.bits, group, span)


def decoder_levels(codebook: np.ndarray, bits: int) -> np.ndarray:
    """The levels the decoder's float products multiply a codebook's indices by: 4-bit ones and
    those kept as int16 level codes (`RotatedLinear`) on the int16 grid (`integer_levels`), 2-bit
    ones exact (`packed_levels` with integer=True)."""
    if bits == 2:
        return np.asarray(codebook, np.float64)
    ints, unit = integer_levels(codebook)
    return ints * unit


def _level_unit(codebook: np.ndarray, limit: int = 32767) -> float:
    """The unit u that makes codebook / u closest to integers of magnitude <= limit.

    A CQ codebook is a handful of Lloyd-Max levels; scanning the top half of the int16 range
    for the common unit with the smallest worst-case rounding error keeps every level within
    ~1e-6 (2 bits) to ~1e-5 (4 bits) of the largest, instead of the 1.5e-5 of a plain absmax
    scale.
    """
    cb = np.abs(np.asarray(codebook, np.float64))
    top = cb.max()
    units = top / np.arange(limit // 2, limit + 1, dtype=np.float64)
    scaled = cb[None, :] / units[:, None]
    err = (np.abs(scaled - np.rint(scaled)) * units[:, None]).max(axis=1)
    return float(units[np.argmin(err)])


def integer_levels(codebook: np.ndarray, limit: int = 32767) -> tuple[np.ndarray, float]:
    """A CQ codebook as int16 level codes of magnitude <= limit and their unit (codebook ~= codes *
    unit, `_level_unit`)."""
    unit = _level_unit(codebook, limit)
    return np.rint(np.asarray(codebook, np.float64) / unit).astype(np.int16), unit


class RotatedLinear:
    """y = x @ W.T computed in the CQ rotated domain, without dequantising W.

    A CQ row group is w_g = (cb[idx] * norm) @ H with H the normalised Walsh-Hadamard matrix,
    which is symmetric, so x_g . w_g = (x_g @ H) . (cb[idx] * norm). The activation is rotated
    once per call (fast Walsh-Hadamard, per 128-group) and dotted with int16 level codes
    (cb[idx] / unit) times a per-group float32 scale (norm * unit). Half the bytes of a float32
    matrix; agrees with `Linear` on the dequantised matrix to ~1e-5 relative.
    """

    def __init__(self, codes: np.ndarray, norms: np.ndarray, codebook: np.ndarray, group: int,
                 shape: tuple[int, int]):
        levels, unit = integer_levels(codebook)
        self.levels = np.ascontiguousarray(levels[np.asarray(codes)])  # (out, in_pad) int16
        self.gscale = (np.asarray(norms, np.float32) * np.float32(unit)).astype(np.float32)
        self.group = int(group)
        self.shape = (int(shape[0]), int(shape[1]))
        self.levels.setflags(write=False)
        self.gscale.setflags(write=False)

    @classmethod
    def from_cact(cls, cact, name: str) -> "RotatedLinear":
        cq = cact.cq(name)
        return cls(cq.codes, cq.norms, cq.codebook, cq.group, cq.shape)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x (rows, in) float32 -> (rows, out) float32."""
        x = _f32_rows(x)
        rotated = np.empty((x.shape[0], self.levels.shape[1]), np.float32)
        K._fwht_rows(x, self.group, rotated)
        if out is None:
            out = np.empty((x.shape[0], self.shape[0]), np.float32)
        K._levels_gemm(rotated, self.levels, self.gscale, self.group, out)
        return out


# ---------------------------------------------------------------- attention


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, key_valid: np.ndarray | None = None,
           causal: bool = False) -> np.ndarray:
    """Softmax attention with grouped K/V heads, scale 1 / sqrt(d_qk).

    q (Tq, H, d), k (Tk, KV, d), v (Tk, KV, dv); query head h reads K/V head h // (H // KV).
    key_valid (Tk,) bool masks keys out; causal masks key j > query i (same positions).
    Returns (Tq, H * dv) float32. With kernels.GEMM_THREADS > 1 and enough queries, blocks of
    query rows run on the shared pool (each row's softmax is independent of the others).
    """
    tq, heads, d = q.shape
    tk, kv_heads, dv = v.shape
    kh = np.ascontiguousarray(k.transpose(1, 2, 0))  # (KV, d, Tk)
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))  # (KV, Tk, dv)
    masked = None if key_valid is None else ~np.asarray(key_valid, bool)
    out = np.empty((tq, heads * dv), np.float32)
    if K.GEMM_THREADS > 1 and tq >= K.GEMM_SPLIT_ROWS:
        run_split(lambda a, b: _attend_rows(q, kh, vh, masked, causal, a, b, out), tq)
    else:
        _attend_rows(q, kh, vh, masked, causal, 0, tq, out)
    return out


def attend_int8(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """`attend` of fake_quant_int8(q) and fake_quant_int8(k) (per row and head: the encoder's int8
    queries and keys), unmasked: q (Tq, H, d), k (Tk, KV, d), v (Tk, KV, dv) -> (Tq, H * dv).

    With the integer products on (`kernels.INTEGER_PRODUCTS`) a score is the int8 codes' dot
    product, exact in int32 (`kernels._integer_scores`), times the query's scale and the key's
    scale over sqrt(d); else `attend` of the fake-quantised floats. Blocks of ATTEND_BLOCK_ROWS
    query rows of a KV head run on the shared pool."""
    if not K.INTEGER_PRODUCTS:
        return attend(fake_quant_int8(q), fake_quant_int8(k), v)
    tq, heads, d = q.shape
    tk, kv_heads, dv = v.shape
    group = heads // kv_heads
    d_pad = d + d % 2           # whole int16 pairs
    keys = -(-tk // KI.COLUMNS) * KI.COLUMNS
    kc = np.zeros((kv_heads, keys, d_pad), np.int16)   # keys past tk: zero codes, scale 1
    ks = np.ones((kv_heads, keys), np.float32)
    kt = np.ascontiguousarray(k.transpose(1, 0, 2), np.float32)
    rows = group * tq            # a KV head's query rows: (head in group, query)
    qt = np.ascontiguousarray(q.transpose(1, 0, 2), np.float32).reshape(kv_heads, rows, d)
    qc = np.empty((kv_heads, rows, d_pad), np.int16)
    qs = np.empty((kv_heads, rows), np.float32)
    for g in range(kv_heads):
        K._int8_rows(kt[g], kc[g, :tk], ks[g, :tk])
        K._int8_rows(qt[g], qc[g], qs[g])
    levels = [KI.key_levels(kc[g]) for g in range(kv_heads)]
    norms = [(ks[g] * np.float32(1.0 / np.sqrt(d))).reshape(-1, 1, KI.COLUMNS) for g in range(kv_heads)]
    vh = np.zeros((kv_heads, keys, dv), np.float32)  # the padded keys' values zero
    vh[:, :tk] = v.transpose(1, 0, 2)
    o = np.empty((kv_heads, rows, dv), np.float32)

    def blocks(i: int, j: int) -> None:  # blocks i..j-1 of ATTEND_BLOCK_ROWS rows of every KV head
        s = np.empty((ATTEND_BLOCK_ROWS, keys), np.float32)
        for g in range(kv_heads):
            for r0 in range(i * ATTEND_BLOCK_ROWS, min(j * ATTEND_BLOCK_ROWS, rows), ATTEND_BLOCK_ROWS):
                r1 = min(rows, r0 + ATTEND_BLOCK_ROWS)
                n = r1 - r0
                K._integer_scores(qc[g, r0:r1], qs[g, r0:r1], levels[g], norms[g], s[:n])
                s[:n, tk:] = -np.inf   # the padded keys: exp 0, whole rows for the softmax
                K._softmax_rows(s[:n], s[:n])
                np.matmul(s[:n], vh[g], out=o[g, r0:r1])

    count = -(-rows // ATTEND_BLOCK_ROWS)
    if K.GEMM_THREADS > 1 and tq >= K.GEMM_SPLIT_ROWS:
        run_split(blocks, count)
    else:
        blocks(0, count)
    return np.ascontiguousarray(o.reshape(heads, tq, dv).transpose(1, 0, 2)).reshape(tq, heads * dv)


# Queries per score block: the scores of a block are (heads, rows, Tk) float32, so a 30 s clip's
# (375 keys) take 1.5 MB a block instead of 4.5 MB for all its queries at once.
ATTEND_BLOCK_ROWS = 128


def _attend_rows(q, kh, vh, masked, causal: bool, a: int, b: int, out: np.ndarray) -> None:
    """Queries a..b-1 of `attend` into out[a:b], ATTEND_BLOCK_ROWS at a time."""
    for lo in range(a, b, ATTEND_BLOCK_ROWS):
        _attend_block(q, kh, vh, masked, causal, lo, min(b, lo + ATTEND_BLOCK_ROWS), out)


def _attend_block(q, kh, vh, masked, causal: bool, a: int, b: int, out: np.ndarray) -> None:
    """Queries a..b-1 of `attend` into out[a:b]; kh (KV, d, Tk), vh (KV, Tk, dv)."""
    _, heads, d = q.shape
    kv_heads, tk, dv = vh.shape
    group = heads // kv_heads
    rows = b - a
    qh = np.ascontiguousarray(q[a:b].transpose(1, 0, 2)).reshape(kv_heads, group * rows, d)
    s = np.matmul(qh, kh)  # (KV, group * rows, Tk)
    s *= np.float32(1.0 / np.sqrt(d))
    if masked is not None:
        s[:, :, masked] = np.finfo(np.float32).min
    if causal:
        blocked = np.arange(tk)[None, :] > np.arange(a, b)[:, None]
        s.reshape(kv_heads, group, rows, tk)[:, :, blocked] = np.finfo(np.float32).min
    s2 = s.reshape(-1, tk)
    K._softmax_rows(s2, s2)
    o = np.matmul(s, vh)  # (KV, group * rows, dv)
    out[a:b] = o.reshape(heads, rows, dv).transpose(1, 0, 2).reshape(rows, heads * dv)


# ---------------------------------------------------------------- Hadamard MLP

HADAMARD_KEYS = ("d1", "d2", "b2", "d3", "d4", "w1a", "w1b", "w2a", "w2b", "w3a", "w3b",
                 "cond_v", "cond_u")


class HadamardMLP:
    """needle `HadamardMLP`: three Kronecker-factored (ba x ba) (x) (bb x bb) mixes.

    cond = 1 + softmax(x @ cond_v) @ cond_u
    z = kron1(d1 * pad(x))[p1];  z = kron2(silu(d2 * cond * z + b2))[p2];  out = d4 * kron3(d3 * z)
    kron(z) reshapes z to (ba, bb) and returns A^T Z B. x (rows, width) -> (rows, width). It runs
    as one fused kernel with its norm and residual (`kernels.decoder._hadamard_residual`) over the
    arrays of a `record`: `residual` here, the decoder's layer step there.
    """

    def __init__(self, params: dict[str, np.ndarray], p1: np.ndarray, p2: np.ndarray, width: int):
        f = {key: np.ascontiguousarray(params[key], np.float32) for key in HADAMARD_KEYS}
        self.n = f["d1"].shape[0]
        self.ba, self.bb = f["w1a"].shape[0], f["w1b"].shape[0]
        if self.ba * self.bb != self.n:
            raise ValueError(f"Hadamard factors {self.ba}x{self.bb} do not make {self.n}")
        self.width = width
        self.d1, self.d2, self.b2, self.d3, self.d4 = (f[k] for k in ("d1", "d2", "b2", "d3", "d4"))
        self.cond_u = f["cond_u"]  # (8, n)
        self.cond_vt = np.ascontiguousarray(f["cond_v"].T)  # (8, width): the kernel's layout of cond_v
        self.factors = [(f[f"w{s}a"], f[f"w{s}b"]) for s in (1, 2, 3)]
        self.p1 = np.asarray(p1).astype(np.int64)
        self.p2 = np.asarray(p2).astype(np.int64)

    @classmethod
    def from_cact(cls, cact, prefix: str, width: int) -> "HadamardMLP":
        """prefix: "encoder03.hadamard_mlp_0" (encoder) or "layer03" (decoder)."""
        params = {key: cact.array(f"{prefix}.{key}") for key in HADAMARD_KEYS}
        return cls(params, cact.array("hada_p1"), cact.array("hada_p2"), width)

    def record(self, pre: np.ndarray, scale: float = 1.0) -> HadamardMlp:
        """The arrays `residual` (and the decoder's layer step) read: x + scale * mlp(zc_rmsnorm(x, pre)),
        the scale folded into d4 (exact for the blocks' 1 and 0.5)."""
        (w1a, w1b), (w2a, w2b), (w3a, w3b) = self.factors
        return HadamardMlp(
            pre=np.ascontiguousarray(pre, np.float32), d1=self.d1, d2=self.d2, b2=self.b2, d3=self.d3,
            d4=(np.float32(scale) * self.d4).astype(np.float32), w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, w3a=w3a,
            w3b=w3b, cond_vt=self.cond_vt, cond_u=self.cond_u, p1=self.p1, p2=self.p2,
            ident=np.arange(self.n, dtype=np.int64))

    @staticmethod
    def residual(x: np.ndarray, record: HadamardMlp) -> np.ndarray:
        """x + scale * mlp(zc_rmsnorm(x, pre)) for a `record` of this MLP, as a new (rows, width) array:
        one fused kernel per block of rows, the rows split over the worker threads."""
        out = np.array(x, dtype=np.float32, order="C", copy=True)
        if K.GEMM_THREADS > 1 and out.shape[0] >= K.GEMM_SPLIT_ROWS:
            run_split(lambda a, b: _hadamard_residual(out[a:b], record, NORM_EPS), out.shape[0])
        else:
            _hadamard_residual(out, record, NORM_EPS)
        return out


# ---------------------------------------------------------------- mHC lanes


class LaneMixer:
    """The mHC lane stream around every block (needle `_LaneBody` / `_ScanBody`, guide §6).

    The residual stream is (rows, lanes, width); rows are encoder frames or decoder beams.
    Per layer l (with lane = eye(n)[position % n]):
      nx    = int8(rms_unit(x.reshape(rows, n * C)))
      hpre  = sigmoid(a_pre * (nx @ phi_pre) + b_pre + 8 * lane - 4)
      u     = sum_j hpre_j * x_j;  y = block(u) - u
      hpost = 2 * sigmoid(a_post * (nx @ phi_post) + b_post - 4 * (1 - lane))
      hres  = sinkhorn(a_res * (nx @ phi_res).reshape(n, n) + b_res)
      x     = hres @ x + hpost * y
    The stack ends with the mean over lanes and the final ZCRMSNorm (`collapse`).
    """

    def __init__(self, cact, prefix: str, layers: int, lanes: int, width: int):
        """prefix "encoder." for the encoder stack, "" for the decoder stack."""
        n = lanes
        self.layers, self.lanes, self.width = layers, lanes, width
        phi_pre = cact.array(f"{prefix}mhc_phi_pre")  # (L * n, n * C), row l*n + j = phi[l][:, j]
        phi_post = cact.array(f"{prefix}mhc_phi_post")
        phi_res = cact.array(f"{prefix}mhc_phi_res")  # (L * n * n, n * C)
        # One [2n + n^2, n*C] matrix per layer so the three lane maps are a single product.
        self.phi = [Linear(np.concatenate([phi_pre[l * n:(l + 1) * n], phi_post[l * n:(l + 1) * n],
                                           phi_res[l * n * n:(l + 1) * n * n]]))
                    for l in range(layers)]
        self.a_pre = cact.array(f"{prefix}mhc_a_pre").reshape(layers).astype(np.float32)
        self.a_post = cact.array(f"{prefix}mhc_a_post").reshape(layers).astype(np.float32)
        self.a_res = cact.array(f"{prefix}mhc_a_res").reshape(layers).astype(np.float32)
        self.b_pre = cact.array(f"{prefix}mhc_b_pre").reshape(layers, n).astype(np.float32)
        self.b_post = cact.array(f"{prefix}mhc_b_post").reshape(layers, n).astype(np.float32)
        self.b_res = cact.array(f"{prefix}mhc_b_res").reshape(layers, n, n).astype(np.float32)
        self.final_norm = cact.array(f"{prefix}final_norm").astype(np.float32)

    def expand(self, x: np.ndarray) -> np.ndarray:
        """(rows, C) -> (rows, lanes, C): every lane starts as the input."""
        x = _f32_rows(x)
        return np.ascontiguousarray(np.broadcast_to(x[:, None, :], (x.shape[0], self.lanes, x.shape[1])))

    def step(self, layer: int, x: np.ndarray, block: Callable[[np.ndarray], np.ndarray],
             position: int | None = None) -> np.ndarray:
        """One layer: x (rows, lanes, C) -> new (rows, lanes, C).

        block(u) takes (rows, C) float32 and returns the block's output (rows, C), residual
        included, exactly like the reference block. `position` (default: layer) picks the lane
        offsets; a depth-sliced decoder passes its index among the active layers.
        """
        n = self.lanes
        rows = x.shape[0]
        pos = layer if position is None else position
        lane = np.zeros(n, np.float32)
        lane[pos % n] = 1.0
        z = self.phi[layer](fake_quant_int8(rms_unit(x.reshape(rows, n * self.width))))  # (rows, 2n + n^2)
        hpre = sigmoid(self.a_pre[layer] * z[:, :n] + self.b_pre[layer] + (8 * lane - 4))
        u = np.empty((rows, self.width), np.float32)
        split_rows(lambda a, b: K._lane_combine(hpre[a:b], x[a:b], u[a:b]), rows, x.size)
        y = np.ascontiguousarray(block(u), dtype=np.float32) - u
        hpost = 2 * sigmoid(self.a_post[layer] * z[:, n:2 * n] + self.b_post[layer] - 4 * (1 - lane))
        logits = (self.a_res[layer] * z[:, 2 * n:]).reshape(rows, n, n) + self.b_res[layer]
        hres = sinkhorn(logits)
        out = np.empty_like(x)
        hpost = np.ascontiguousarray(hpost, np.float32)
        split_rows(lambda a, b: K._lane_mix(hres[a:b], x[a:b], hpost[a:b], y[a:b], out[a:b]), rows, x.size)
        return out

    def collapse(self, x: np.ndarray) -> np.ndarray:
        """(rows, lanes, C) -> (rows, C): mean over lanes, then the stack's final norm."""
        return zc_rmsnorm(x.mean(axis=1, dtype=np.float32), self.final_norm)
