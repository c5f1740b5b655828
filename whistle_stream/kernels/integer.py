"""Integer products on AVX-512 VNNI: int8 activations times CQ level codes, exact in int32 lanes.

A product the reference computes as fake_quant_int8(x) @ W.T, with W's 128-groups
(levels[idx] * norm) @ H (H the normalised Walsh-Hadamard matrix), is here, per row and group,

    scale_r / sqrt(group) * sum_g norm[n, g] * unit * (q_r,g @ H') . L[idx[n, g]]

with q the row's int8 codes (scale = absmax / 127, the reference's rule), H' the Hadamard matrix
without its 1/sqrt(group) (so q @ H' are integers within +-128 * group: int16), and L the
codebook as integers of magnitude <= level_limit(span) with their unit (codebook ~= L * unit).
A sum of `span` of a group's products is then an integer inside int32 (`level_limit`'s bound),
so vpdpwssd (int16 pairs into int32 lanes, 32 multiply-adds per instruction, twice the float32
FMA's rate) computes it exactly: its adds wrap, and a sum inside int32 comes out right whatever
its partial sums did. Each span's int32 sums are scaled by their group's norms in float32. The
span is the longest of SPANS whose grid holds the float products' levels within LEVEL_TOLERANCE:
a whole group for needle's 2-bit codebook, 16 inputs for the decoder's 4-bit levels.

The weights stay packed (2 or 4 bits a code) in `vnni_codes`' layout: for a block of 16 output
columns and a pair of inputs, the 32 codes one vpdpwssd multiplies, in 2 * bits 16-bit words.
`_expand` turns a column block's codes into int16 levels for the whole input (a shift, a mask and
one vpermw table lookup per 32 weights) into a scratch that stays in the L1 cache while every
row's tile (`_tile`: MR rows x NR column blocks in registers) reads it; for a few rows (a decoder
step) `_tile_codes` expands them in registers as it goes.

Two paths (`PATH`), chosen when the kernels compile:
- "vnni": CPUs with avx512vnni (and avx512bw's vpermw), the kernels compiled for the host or the
  x86-64-v4-vnni tier (`_target`). Every product, the decoder's few rows included (`_tile_codes`).
- "avx2": CPUs with AVX2 but not those, and the x86-64-v3 and -v4 tiers' caches (`_target`).
  vpmaddwd (int16 pairs into int32 lanes, 16 multiply-adds per instruction) and vpaddd take
  vpdpwssd's place, a column block as two 8-lane halves; `_expand` looks the levels up with a
  compare-and-select per level (AVX2 has no vpermw) into the scratch every row reads. Only the
  many-row products take it (`_integer_gemm`, the encoder's): the decoder keeps its float
  products there.
Only for codebooks whose levels fit an integer grid within LEVEL_TOLERANCE, and not with
WHISTLE_INTEGER=0: the float products serve every other case.
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _target, simd
from .simd import _declare, _splat

_F32, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(16), ir.IntType(32), ir.IntType(64)
COLUMNS = 16      # output columns of a block: one int32 lane each in a 512-bit register
PAIR_LANES = 32   # int16 lanes: the block's 16 columns x a pair of inputs
MAX_GROUP = 128     # the largest group whose sums `level_limit` keeps exact
# Inputs per exact int32 sum, longest first. A sum over `span` inputs of a group is at most
# ||q H'|| ||L_span|| <= sqrt(G) ||q|| sqrt(span) Lmax <= 128 G sqrt(span) Lmax (Cauchy-Schwarz;
# H' / sqrt(G) is orthogonal): a shorter span admits larger integer levels, so a finer grid
# (`level_limit`: 11585 for a whole group of 128, 32767 for 16), for one more float multiply-add
# per span and column.
SPANS = (128, 64, 32, 16)


def level_limit(span: int) -> int:
    """The largest integer level whose sums over `span` inputs stay inside int32 (any int8 codes)."""
    return min(int((2**31 - 1) // (128 * MAX_GROUP * span ** 0.5)), 32767)



# The largest error, relative to the largest level, of a codebook's levels on an integer grid
# against the levels the float products multiply by, that keeps parity: needle's 2-bit codebook
# is within 4.7e-6 on a whole group's grid (the full architecture's encoder holds a clip cosine of
# 0.999992 against the reference, the float path 0.999993); its 4-bit one is 9.2e-6 away on the
# finest grid (2.6e-5 on a whole group's), which took the 4-bit demo model's encoder below the
# 0.9999 line on a noise clip: the encoder keeps the float products there. The decoder's float
# products already take 4-bit levels on that finest grid (`blocks.packed_levels`), so its 4-bit
# matrices (the head) take the integer products with the same levels.
LEVEL_TOLERANCE = 5e-6
ENV = "WHISTLE_INTEGER"  # "0": the float products everywhere


PATHS = ("vnni", "avx2")


def _path() -> str | None:
    """The integer products' path: "vnni" where the host (or the tier compiled for) has AVX-512 VNNI
    and the simd path is AVX-512's; "avx2" where the simd path has AVX2's instructions (the host's,
    or a tier's: x86-64-v3, -v4) but not those; else None (the float products, and every ARM tier).
    WHISTLE_SIMD=avx2 takes the AVX2 path on any host that has it, =generic neither."""
    if simd.PATH not in ("avx512", "avx2"):
        return None
    if config.CPU_NAME or config.CPU_FEATURES:   # a tier's cache: its own instructions only
        tier = _target.compiled_tier()
        if tier is None or tier.integer is None:
            return None
        return tier.integer if simd.PATH == "avx512" else "avx2"
    have = llvm_binding.get_host_cpu_features()
    if simd.PATH == "avx512" and all(have.get(f) for f in ("avx512f", "avx512bw", "avx512vnni")):
        return "vnni"
    return "avx2" if have.get("avx2") else None


PATH = _path()
AVAILABLE = PATH is not None   # the encoder's (many-row) integer products
VNNI = PATH == "vnni"          # and the decoder's: `_tile_codes`, vpermw, vpdpwssd
# The register tile, rows x column blocks: 12 int32 + 12 float32 accumulators of 16 lanes on
# AVX-512's 32 registers; on AVX2's 16, 4 x 1 block (two 8-lane halves: 8 + 8, the float ones
# touched once a span).
MR, NR = (4, 3) if PATH != "avx2" else (4, 1)
FEW_MR = 5          # `_tile_codes`' rows: a 5-beam step's


def _enabled() -> bool:
    """Possible here and not turned off (WHISTLE_INTEGER=0); another value is reported."""
    asked = os.environ.get(ENV, "").strip()
    if asked not in ("", "0", "1"):
        warnings.warn(f"{ENV} must be 0 or 1, got {asked!r}; the integer products where they run",
                      RuntimeWarning, stacklevel=2)
    return AVAILABLE and asked != "0"


ENABLED = _enabled()


class IntegerMatrix(NamedTuple):
    """A CQ matrix (or several stacked along their outputs) for `_integer_gemm`."""
    codes: np.ndarray   # level indices in `vnni_codes`' layout (N / 16, K_pad / 2, 2 * bits) uint16
    table: np.ndarray   # (32,) int16: the integer levels (|level| <= level_limit(span)), zero padded
    norms: np.ndarray   # (N / 16, G, 16) float32 (`block_norms`): norm x level unit / sqrt(group)
    bits: int           # 2 or 4
    group: int          # inputs per norm and Hadamard block, a power of two <= MAX_GROUP
    span: int           # inputs per exact int32 sum (one of SPANS, dividing group)


def absent() -> IntegerMatrix:
    """An IntegerMatrix of no column blocks: in a typed record, "this matrix takes the float path"."""
    return IntegerMatrix(np.zeros((0, 0, 4), np.uint16), np.zeros(PAIR_LANES, np.int16),
                         np.zeros((0, 0, COLUMNS), np.float32), 2, MAX_GROUP, MAX_GROUP)


def vnni_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Level indices (N, K_pad) uint8, N a multiple of COLUMNS, as (N / 16, K_pad / 2, 2 * bits)
    uint16: vector (b, p) holds the 32 indices of columns 16b..16b+15 at inputs 2p, 2p+1 (lane
    i = 2 * column + input), lane i in word i % (2 * bits) at bit bits * (i // (2 * bits))."""
    n, k_pad = codes.shape
    words = 2 * bits
    lanes = (np.asarray(codes, np.uint16).reshape(n // COLUMNS, COLUMNS, k_pad // 2, 2)
             .transpose(0, 2, 1, 3).reshape(n // COLUMNS, k_pad // 2, PAIR_LANES // words, words))
    shifts = (bits * np.arange(PAIR_LANES // words, dtype=np.uint16))[:, None]
    return np.ascontiguousarray(np.bitwise_or.reduce(lanes << shifts, axis=2), dtype=np.uint16)


def key_levels(codes: np.ndarray) -> np.ndarray:
    """int8 codes (N, K) as int16, N a multiple of COLUMNS and K even, in `_tile`'s levels layout
    (N / 16, K / 2, 32): vector (b, p) lane 2 c + i holds row 16 b + c's code at input 2 p + i
    (attention's keys, each a column of the scores)."""
    n, k = codes.shape
    return np.ascontiguousarray(np.asarray(codes, np.int16).reshape(n // COLUMNS, COLUMNS, k // 2, 2)
                                .transpose(0, 2, 1, 3).reshape(n // COLUMNS, k // 2, PAIR_LANES))


def block_norms(norms: np.ndarray) -> np.ndarray:
    """Per-group scales (N, G) float32 as (N / 16, G, 16): a column block's 16 scales of a group
    in one vector."""
    n, g = norms.shape
    return np.ascontiguousarray(np.asarray(norms, np.float32).reshape(n // COLUMNS, COLUMNS, g).transpose(0, 2, 1))


class _Expansion(NamedTuple):
    """What turns a column block's packed codes at one input pair into its 32 int16 levels: the
    words' spread over the lanes, each lane's shift, the mask, the table, and vpermw (None on the
    AVX2 path: a select per level instead)."""
    spread: ir.Constant
    shifts: ir.Constant
    mask: ir.Constant
    table: ir.Value
    perm: ir.Function | None
    count: int


def _expansion(builder, table_ptr, bits: int) -> _Expansion:
    words = 2 * bits
    v32 = ir.VectorType(_I16, PAIR_LANES)
    return _Expansion(
        spread=ir.Constant(ir.VectorType(_I32, PAIR_LANES), [i % words for i in range(PAIR_LANES)]),
        shifts=ir.Constant(v32, [bits * (i // words) for i in range(PAIR_LANES)]),
        mask=ir.Constant(v32, [(1 << bits) - 1] * PAIR_LANES),
        table=builder.load(builder.bitcast(table_ptr, ir.PointerType(v32)), align=2),
        perm=_declare(builder, "llvm.x86.avx512.permvar.hi.512", v32, [v32, v32]) if VNNI else None,
        count=1 << bits)


def _expand_pair(builder, ex: _Expansion, words_ptr):
    """The 32 int16 levels of the codes at words_ptr (<2 * bits x i16>*): a shift, a mask, and
    vpermw, or on the AVX2 path a compare and select per level."""
    w = builder.load(words_ptr, align=2)
    idx = builder.and_(builder.lshr(builder.shuffle_vector(w, w, ex.spread), ex.shifts), ex.mask)
    if ex.perm is not None:
        return builder.call(ex.perm, [ex.table, idx])
    out = _splat(builder, builder.extract_element(ex.table, ir.Constant(_I32, 0)), _I16, PAIR_LANES)
    for j in range(1, ex.count):
        hit = builder.icmp_unsigned("==", idx, ir.Constant(idx.type, [j] * PAIR_LANES))
        out = builder.select(hit, _splat(builder, builder.extract_element(ex.table, ir.Constant(_I32, j)),
                                         _I16, PAIR_LANES), out)
    return out


def _words_type(bits: int):
    return ir.PointerType(ir.VectorType(_I16, 2 * bits))


@intrinsic(prefer_literal=True)
def _expand(typingctx, codes, table, block, slot, bits, out):
    """out[slot] = table[indices of column block `block`], int16 (K_pad / 2, 32): codes in
    `vnni_codes`' layout (B, K_pad / 2, 2 * bits) uint16, table (32,) int16 (the integer levels,
    padded), out (NR, K_pad / 2, 32) int16. bits: a literal 2 or 4."""
    if not isinstance(bits, types.IntegerLiteral):
        return None
    b = bits.literal_value
    sig = types.none(codes, table, block, slot, bits, out)

    def codegen(context, builder, signature, args):
        c_v, t_v, blk_v, slot_v, _, o_v = args
        C = context.make_array(signature.args[0])(context, builder, c_v)
        T = context.make_array(signature.args[1])(context, builder, t_v)
        O = context.make_array(signature.args[5])(context, builder, o_v)
        v32 = ir.VectorType(_I16, PAIR_LANES)
        pairs = cgutils.unpack_tuple(builder, C.shape, 3)[1]
        blk = context.cast(builder, blk_v, signature.args[2], types.intp)
        slot = context.cast(builder, slot_v, signature.args[3], types.intp)
        src = builder.gep(builder.bitcast(C.data, _words_type(b)), [builder.mul(blk, pairs)])
        dst = builder.gep(builder.bitcast(O.data, ir.PointerType(v32)), [builder.mul(slot, pairs)])
        ex = _expansion(builder, T.data, b)
        with cgutils.for_range(builder, pairs) as loop:
            builder.store(_expand_pair(builder, ex, builder.gep(src, [loop.index])),
                          builder.gep(dst, [loop.index]), align=2)
        return context.get_dummy_value()

    return sig, codegen


def _tile_body(context, builder, A, N, S, O, m0, pairs, span_pairs, rows_n: int, blocks_n: int, level_at):
    """The tile both `_tile` and `_tile_codes` emit: out rows m0 .. m0 + rows_n - 1, columns of
    blocks_n blocks, an exact int32 sum per span_pairs input pairs; level_at(j, p) gives block j's
    32 int16 levels at input pair p. Rows past a's last are its last again (the same sums written
    to the same place), so one tile of rows_n serves a tail of fewer rows. A block is one vector
    of 16 int32 lanes on the VNNI path (vpdpwssd), two of 8 on the AVX2 path (vpmaddwd, vpaddd):
    the same sums either way."""
    lanes = COLUMNS if VNNI else COLUMNS // 2
    halves = COLUMNS // lanes
    vi, vf, v16 = ir.VectorType(_I32, lanes), ir.VectorType(_F32, lanes), ir.VectorType(_I16, 2 * lanes)
    fma = _declare(builder, f"llvm.fma.v{lanes}f32", vf, [vf, vf, vf])
    if VNNI:
        dot = _declare(builder, "llvm.x86.avx512.vpdpwssd.512", vi, [vi, vi, vi])

        def mac(acc, pair, lev):
            return builder.call(dot, [acc, pair, builder.bitcast(lev, vi)])
    else:
        madd = _declare(builder, "llvm.x86.avx2.pmadd.wd", vi, [v16, v16])

        def mac(acc, pair, lev):
            return builder.add(acc, builder.call(madd, [builder.bitcast(pair, v16), lev]))

    def half(lev, h):
        if halves == 1:
            return lev
        return builder.shuffle_vector(lev, lev, ir.Constant(ir.VectorType(_I32, 2 * lanes),
                                                            list(range(2 * lanes * h, 2 * lanes * (h + 1)))))

    groups = cgutils.unpack_tuple(builder, N.shape, 3)[1]
    group_pairs = builder.sdiv(pairs, groups)
    a_stride = builder.sdiv(cgutils.unpack_tuple(builder, A.strides, 2)[0], ir.Constant(_I64, 4))  # int16 pairs
    s_stride = builder.sdiv(cgutils.unpack_tuple(builder, S.strides, 1)[0], ir.Constant(_I64, 4))
    o_stride = builder.sdiv(cgutils.unpack_tuple(builder, O.strides, 2)[0], ir.Constant(_I64, 4))
    a32 = builder.bitcast(A.data, ir.PointerType(_I32))
    last = builder.sub(cgutils.unpack_tuple(builder, A.shape, 2)[0], ir.Constant(_I64, 1))
    row_at = []
    for i in range(rows_n):
        m = builder.add(m0, ir.Constant(_I64, i))
        row_at.append(builder.select(builder.icmp_signed(">", m, last), last, m))
    row_ptr = [builder.gep(a32, [builder.mul(m, a_stride)]) for m in row_at]
    parts = [(j, h) for j in range(blocks_n) for h in range(halves)]

    def norms_at(j, h, g):   # block j's half h of group g's 16 norms (N: (B, G, 16) float32)
        at = builder.add(builder.mul(builder.add(builder.mul(ir.Constant(_I64, j), groups), g),
                                     ir.Constant(_I64, COLUMNS)), ir.Constant(_I64, lanes * h))
        return builder.load(builder.bitcast(builder.gep(N.data, [at]), ir.PointerType(vf)), align=4)

    zero_i, zero_f = ir.Constant(vi, [0] * lanes), ir.Constant(vf, [0.0] * lanes)
    acc_f = [[cgutils.alloca_once_value(builder, zero_f) for _ in parts] for _ in range(rows_n)]
    acc_i = [[cgutils.alloca_once_value(builder, zero_i) for _ in parts] for _ in range(rows_n)]
    with cgutils.for_range(builder, groups) as group_loop:
        g = group_loop.index
        with cgutils.for_range(builder, builder.sdiv(group_pairs, span_pairs)) as span_loop:
            for i in range(rows_n):
                for k in range(len(parts)):
                    builder.store(zero_i, acc_i[i][k])
            first = builder.add(builder.mul(g, group_pairs), builder.mul(span_loop.index, span_pairs))
            with cgutils.for_range(builder, span_pairs) as pair_loop:
                p = builder.add(first, pair_loop.index)
                blocks = [level_at(j, p) for j in range(blocks_n)]
                lev = [half(blocks[j], h) for j, h in parts]
                for i in range(rows_n):
                    pair = _splat(builder, builder.load(builder.gep(row_ptr[i], [p]), align=4), _I32, lanes)
                    for k in range(len(parts)):
                        builder.store(mac(builder.load(acc_i[i][k]), pair, lev[k]), acc_i[i][k])
            nrm = [norms_at(j, h, g) for j, h in parts]
            for i in range(rows_n):
                for k in range(len(parts)):
                    total = builder.sitofp(builder.load(acc_i[i][k]), vf)
                    builder.store(builder.call(fma, [total, nrm[k], builder.load(acc_f[i][k])]), acc_f[i][k])
    for i in range(rows_n):
        m = row_at[i]
        scale = _splat(builder, builder.load(builder.gep(S.data, [builder.mul(m, s_stride)])), _F32, lanes)
        for k, (j, h) in enumerate(parts):
            dst = builder.gep(O.data, [builder.add(builder.mul(m, o_stride), ir.Constant(_I64, COLUMNS * j + lanes * h))])
            builder.store(builder.fmul(builder.load(acc_f[i][k]), scale),
                          builder.bitcast(dst, ir.PointerType(vf)), align=4)


@intrinsic(prefer_literal=True)
def _tile(typingctx, a, levels, norms, scales, m0, span, mr, nr, out):
    """out[m0 + i, 16 j + c] = scales[m0 + i] * sum_g sum_s norms[j, g, c] * (int32 sum of span s
    of group g of a[m0 + i] times column c of block j), for i < mr, j < nr (literals), spans of
    `span` inputs: a (R, K_pad) int16 rotated activations, levels (>= nr, K_pad / 2, 32) int16
    from `_expand`, norms (>= nr, G, 16) float32, scales (R,) float32, out (R, >= 16 nr) float32
    (any row stride)."""
    if not (isinstance(mr, types.IntegerLiteral) and isinstance(nr, types.IntegerLiteral)):
        return None
    sig = types.none(a, levels, norms, scales, m0, span, mr, nr, out)

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 8)]
        A, L, N, S, O = arrays
        m0 = context.cast(builder, args[4], signature.args[4], types.intp)
        span_pairs = builder.sdiv(context.cast(builder, args[5], signature.args[5], types.intp), ir.Constant(_I64, 2))
        pairs = cgutils.unpack_tuple(builder, L.shape, 3)[1]
        lvec = builder.bitcast(L.data, ir.PointerType(ir.VectorType(_I16, PAIR_LANES)))

        def level_at(j, p):
            return builder.load(builder.gep(lvec, [builder.add(builder.mul(ir.Constant(_I64, j), pairs), p)]), align=4)

        _tile_body(context, builder, A, N, S, O, m0, pairs, span_pairs, mr.literal_value, nr.literal_value, level_at)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic(prefer_literal=True)
def _tile_codes(typingctx, a, codes, table, norms, scales, m0, span, mr, nr, bits, out):
    """`_tile` reading the packed codes (`vnni_codes`' layout, sliced to the tile's first block)
    and expanding each block's levels in registers as it goes (`_expand`'s arithmetic, no
    scratch): for a few rows (a decoder step's beams), where a scratch written once is read by too
    few rows to pay for its stores. table (32,) int16; bits: a literal 2 or 4."""
    if not all(isinstance(v, types.IntegerLiteral) for v in (mr, nr, bits)):
        return None
    b = bits.literal_value
    sig = types.none(a, codes, table, norms, scales, m0, span, mr, nr, bits, out)

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 4, 10)]
        A, C, T, N, S, O = arrays
        m0 = context.cast(builder, args[5], signature.args[5], types.intp)
        span_pairs = builder.sdiv(context.cast(builder, args[6], signature.args[6], types.intp), ir.Constant(_I64, 2))
        pairs = cgutils.unpack_tuple(builder, C.shape, 3)[1]
        src = builder.bitcast(C.data, _words_type(b))
        ex = _expansion(builder, T.data, b)

        def level_at(j, p):
            return _expand_pair(builder, ex, builder.gep(src, [builder.add(builder.mul(ir.Constant(_I64, j), pairs), p)]))

        _tile_body(context, builder, A, N, S, O, m0, pairs, span_pairs, mr.literal_value, nr.literal_value, level_at)
        return context.get_dummy_value()

    return sig, codegen
