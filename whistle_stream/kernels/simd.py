"""The inner loops of the decoder's 5-row kernels, written in LLVM vector IR (Numba intrinsics).

The decoder's 5-row products (beams) are most of a decoding step. Written as Numba loops, LLVM
vectorises each 128-weight group into its own reduction: a 2-bit code becomes its level through a
3-compare select chain (6 vector ops per 16 weights beside 5 multiply-adds), and every group ends
in 5 horizontal sums (a third of the kernel). `_dot5` keeps five vector accumulators across the
whole row instead (each group's partial sums are scaled by the group's norm with one vector
multiply-add, one horizontal sum per output at the end), and turns a code into its level with one
in-register table lookup (vpermps). The codes stay packed, 2 or 4 bits each (a quarter of the
bytes a byte per code took), in `interleave`'s layout: one load of LANES bytes, widened once, holds
8 / bits vectors of consecutive codes, each a shift and a mask away. `_tile5` is the same idea for
five rows of coefficients times a tile of columns (cross-attention scores, the Hadamard MLP's
Kronecker factors).

Lane width and table lookup follow the CPU Numba compiles for: 16 lanes + AVX-512 vpermps,
8 lanes + AVX2 vpermps, or 8 lanes and a portable select chain. WHISTLE_SIMD=avx512|avx2|generic
overrides the choice (tests run each path; a path the CPU lacks cannot run; compiled kernels are
cached per CPU, so set NUMBA_CACHE_DIR apart when forcing a path). An unknown value is reported
and ignored. Compiling for a fixed tier (`_target`, WHISTLE_JIT_TARGET) takes that tier's path.
"""

from __future__ import annotations

import os
import warnings

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _target

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
PATHS = ("avx512", "avx2", "generic")


def _choose_path() -> str:
    forced = os.environ.get("WHISTLE_SIMD", "").strip().lower()
    if forced in PATHS:
        return forced
    if forced:
        warnings.warn(f"WHISTLE_SIMD must be one of {', '.join(PATHS)}, got {forced!r}; choosing from the CPU",
                      RuntimeWarning, stacklevel=2)
    tier_path = _target.simd_path()
    if tier_path is not None:  # compiling for a fixed tier (`_target`): that tier's instructions
        return tier_path
    if config.CPU_NAME or config.CPU_FEATURES:  # some other cross-compiled target: no x86 intrinsics
        return "generic"
    features = llvm_binding.get_host_cpu_features()
    if features.get("avx512f"):
        return "avx512"
    return "avx2" if features.get("avx2") else "generic"


PATH = _choose_path()
LANES = 16 if PATH == "avx512" else 8  # a CQ group must be a multiple of this (128 is)
PACKED_BITS = (2, 4)  # widths of CQ level indices `_dot5` reads packed (`interleave`)


def _vec(elem, lanes: int = LANES) -> ir.VectorType:
    return ir.VectorType(elem, lanes)


def _splat(builder, scalar, elem, lanes: int = LANES):
    """scalar in every lane of a <lanes x elem> vector."""
    vec = _vec(elem, lanes)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), ir.Constant(_vec(_I32, lanes), [0] * lanes))


def _horizontal_sum(builder, v):
    """Pairwise halves: lanes (0..n/2) + (n/2..n), until one is left."""
    n = LANES
    while n > 1:
        half = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, half), list(range(half, n))))
        v, n = builder.fadd(lo, hi), half
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _declare(builder, name: str, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _level_lookup(builder, tables, idx, count: int):
    """levels[idx] for codes idx (<LANES x i32>, each < count: 4 or 16) from the level tables
    (`_level_tables`: 16 levels take two on the 8-lane paths, the second holding levels 8..15)."""
    vf = _vec(_F32)
    if PATH == "generic":
        out = _splat(builder, builder.extract_element(tables[0], ir.Constant(_I32, 0)), _F32)
        for j in range(1, count):
            level = builder.extract_element(tables[j // LANES], ir.Constant(_I32, j % LANES))
            hit = builder.icmp_unsigned("==", idx, _splat(builder, ir.Constant(_I32, j), _I32))
            out = builder.select(hit, _splat(builder, level, _F32), out)
        return out
    name = "llvm.x86.avx512.permvar.sf.512" if PATH == "avx512" else "llvm.x86.avx2.permps"
    permute = _declare(builder, name, vf, [vf, _vec(_I32)])
    out = builder.call(permute, [tables[0], idx])  # vpermps reads the index's low log2(LANES) bits
    if len(tables) > 1:
        high = builder.icmp_unsigned(">=", idx, _splat(builder, ir.Constant(_I32, LANES), _I32))
        out = builder.select(high, builder.call(permute, [tables[1], idx]), out)
    return out


def _level_tables(builder, level_arr, count: int):
    """The first `count` levels (4 or 16) loaded into vectors of LANES lanes for `_level_lookup`."""
    tables = []
    for first in range(0, count, LANES):
        table = ir.Constant(_vec(_F32), ir.Undefined)
        for j in range(first, min(count, first + LANES)):
            level = builder.load(builder.gep(level_arr.data, [ir.Constant(_I64, j)]))
            table = builder.insert_element(table, level, ir.Constant(_I32, j - first))
        tables.append(table)
    return tables


def interleave(codes, bits: int):
    """Level indices (rows, K) of `bits` bits (2 or 4) in the layout `_dot5` reads, (rows, K' * bits / 8)
    uint8, K' = K rounded up to a block of LANES * 8 // bits codes (zero codes past K): block b's
    byte i holds codes b * block + i + j * LANES, j < 8 // bits, at bit j * bits. One LANES-byte load
    widened to LANES lanes then gives 8 // bits vectors of consecutive codes by shift and mask."""
    per = 8 // bits
    block = LANES * per
    rows, k = codes.shape
    padded = np.zeros((rows, -(-k // block) * block), np.uint8)
    padded[:, :k] = codes
    fields = padded.reshape(rows, -1, per, LANES)
    out = np.zeros((rows, fields.shape[1], LANES), np.uint8)
    for j in range(per):
        out |= fields[:, :, j, :] << np.uint8(j * bits)
    return out.reshape(rows, -1)


def _block_codes(builder, code_arr, tables, first, width: int):
    """The 8 // width vectors of levels of one block of `interleave`'s layout whose first code is
    `first`: one LANES-byte load widened once, then per vector a shift, a mask and `_level_lookup`."""
    per = 8 // width
    mask = _splat(builder, ir.Constant(_I32, (1 << width) - 1), _I32)
    at = builder.gep(code_arr.data, [builder.sdiv(first, ir.Constant(_I64, per))])
    raw = builder.load(builder.bitcast(at, ir.PointerType(_vec(ir.IntType(8)))), align=1)
    wide = builder.zext(raw, _vec(_I32))
    out = []
    for j in range(per):
        shifted = builder.lshr(wide, _splat(builder, ir.Constant(_I32, j * width), _I32)) if j else wide
        out.append(_level_lookup(builder, tables, builder.and_(shifted, mask), 1 << width))
    return out


def _dot_rows(count: int):
    """The typer of `_dot5` (count 5) and `_dot1` (count 1): the same arithmetic per row, so a
    row's sums do not depend on how many rows one call reads."""

    def typer(typingctx, codes, x, r0, norms, levels, group, bits):
        if not isinstance(bits, types.IntegerLiteral):
            return None
        width = bits.literal_value
        packed = codes.dtype == types.uint8
        dense = codes.dtype == types.float32
        if not (width in PACKED_BITS if packed else width == 0 and (dense or codes.dtype == types.int16)):
            return None
        sig = types.UniTuple(types.float32, count)(codes, x, r0, norms, levels, group, bits)

        def codegen(context, builder, signature, args):
            codes_v, x_v, r0_v, norms_v, levels_v, group_v, _ = args
            code_arr = context.make_array(signature.args[0])(context, builder, codes_v)
            x_arr = context.make_array(signature.args[1])(context, builder, x_v)
            norm_arr = context.make_array(signature.args[3])(context, builder, norms_v)
            level_arr = context.make_array(signature.args[4])(context, builder, levels_v)
            k_pad = cgutils.unpack_tuple(builder, x_arr.shape, 2)[1]
            x_row = builder.sdiv(cgutils.unpack_tuple(builder, x_arr.strides, 2)[0], ir.Constant(_I64, 4))
            r0_i = context.cast(builder, r0_v, signature.args[2], types.intp)
            group_i = context.cast(builder, group_v, signature.args[5], types.intp)
            vf = _vec(_F32)
            code_ptr_t = ir.PointerType(_vec(_F32 if dense else ir.IntType(16)))
            vec_ptr_t = ir.PointerType(vf)
            tables = _level_tables(builder, level_arr, 1 << width) if packed else []
            fma = _declare(builder, f"llvm.fmuladd.v{LANES}f32", vf, [vf, vf, vf])
            rows = [builder.gep(x_arr.data, [builder.mul(builder.add(r0_i, ir.Constant(_I64, i)), x_row)])
                    for i in range(count)]
            zero = ir.Constant(vf, [0.0] * LANES)
            total = [cgutils.alloca_once_value(builder, zero) for _ in range(count)]  # promoted to registers
            part = [cgutils.alloca_once_value(builder, zero) for _ in range(count)]

            def accumulate(k, w):  # each row's partial sums += w * x[row, k:k + LANES]
                for i in range(count):
                    xv = builder.load(builder.bitcast(builder.gep(rows[i], [k]), vec_ptr_t), align=4)
                    builder.store(builder.call(fma, [w, xv, builder.load(part[i])]), part[i])

            with cgutils.for_range(builder, builder.sdiv(k_pad, group_i)) as group_loop:
                g = group_loop.index
                for p in part:
                    builder.store(zero, p)
                base = builder.mul(g, group_i)
                if packed:   # a LANES-byte load per block, widened once, then 8 // width vectors of codes
                    per = 8 // width
                    with cgutils.for_range(builder, builder.sdiv(group_i, ir.Constant(_I64, LANES * per))) as block_loop:
                        first = builder.add(base, builder.mul(block_loop.index, ir.Constant(_I64, LANES * per)))
                        for j, w in enumerate(_block_codes(builder, code_arr, tables, first, width)):
                            accumulate(builder.add(first, ir.Constant(_I64, j * LANES)), w)
                else:
                    with cgutils.for_range(builder, builder.sdiv(group_i, ir.Constant(_I64, LANES))) as lane_loop:
                        k = builder.add(base, builder.mul(lane_loop.index, ir.Constant(_I64, LANES)))
                        raw = builder.load(builder.bitcast(builder.gep(code_arr.data, [k]), code_ptr_t),
                                           align=4 if dense else 1)
                        accumulate(k, raw if dense else builder.sitofp(builder.sext(raw, _vec(_I32)), vf))
                norm = _splat(builder, builder.load(builder.gep(norm_arr.data, [g])), _F32)
                for i in range(count):
                    builder.store(builder.call(fma, [builder.load(part[i]), norm, builder.load(total[i])]), total[i])
            sums = [_horizontal_sum(builder, builder.load(t)) for t in total]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    typer.__name__ = typer.__qualname__ = f"_dot{count}"
    return typer


_dot5 = intrinsic(prefer_literal=True)(_dot_rows(5))
_dot5.__doc__ = """(5 float32) out[i] = sum_g norms[g] * (w_g . x[r0 + i, g]) for one matrix row.

    codes the row's codes, by the literal `bits`: 2 or 4, uint8 level indices in `interleave`'s
    layout (w = levels[index], levels holding 2**bits float32; group a multiple of LANES * 8 // bits);
    0, one code per weight: int16 level codes (w = code, the unit folded into norms; levels
    unused) or float32 weights (w = code). x (R, K_pad) float32 rotated activations, rows r0 .. r0 + 4
    read; codes and each row of x contiguous (the callers check); norms (K_pad // group,) float32;
    group a multiple of LANES dividing K_pad. Sums run in LANES-wide partials (a different order
    from a plain loop)."""
# `_dot5` for the one row r0 (a 1-tuple): a greedy step's row, or the rows past a multiple of five.
_dot1 = intrinsic(prefer_literal=True)(_dot_rows(1))


@intrinsic
def _tile5(typingctx, m, c0, coef, out):
    """out[i, c0:c0 + LANES] = sum_d coef[i, d] * m[d, c0:c0 + LANES] for i < 5: five rows of
    coefficients times one LANES-column tile of a matrix m (D, C), int8 (widened in registers) or
    float32, columns c0 .. c0 + LANES - 1 inside it; coef (5, >= D) and out (5, C) float32; every
    row contiguous (row strides may be anything: slices of larger arrays are fine). The tile's five
    accumulators stay in registers over d: no horizontal sums (cross-attention scores with frames
    as columns, the Hadamard MLP's Kronecker factors)."""
    if m.dtype not in (types.int8, types.float32):
        return None
    widen = m.dtype == types.int8
    sig = types.none(m, c0, coef, out)

    def codegen(context, builder, signature, args):
        m_v, c0_v, coef_v, out_v = args
        m_arr = context.make_array(signature.args[0])(context, builder, m_v)
        coef_arr = context.make_array(signature.args[2])(context, builder, coef_v)
        out_arr = context.make_array(signature.args[3])(context, builder, out_v)
        depth = cgutils.unpack_tuple(builder, m_arr.shape, 2)[0]
        # Row strides in elements (rows may be slices of a larger array; each row is contiguous).
        cols = builder.sdiv(cgutils.unpack_tuple(builder, m_arr.strides, 2)[0], ir.Constant(_I64, 1 if widen else 4))
        coef_cols = builder.sdiv(cgutils.unpack_tuple(builder, coef_arr.strides, 2)[0], ir.Constant(_I64, 4))
        out_cols = builder.sdiv(cgutils.unpack_tuple(builder, out_arr.strides, 2)[0], ir.Constant(_I64, 4))
        c0_i = context.cast(builder, c0_v, signature.args[1], types.intp)
        vf = _vec(_F32)
        fma = _declare(builder, f"llvm.fmuladd.v{LANES}f32", vf, [vf, vf, vf])
        zero = ir.Constant(vf, [0.0] * LANES)
        acc = [cgutils.alloca_once_value(builder, zero) for _ in range(5)]  # promoted to registers
        with cgutils.for_range(builder, depth) as loop:
            d = loop.index
            at = builder.gep(m_arr.data, [builder.add(builder.mul(d, cols), c0_i)])
            if widen:
                raw = builder.load(builder.bitcast(at, ir.PointerType(_vec(ir.IntType(8)))), align=1)
                w = builder.sitofp(builder.sext(raw, _vec(_I32)), vf)
            else:
                w = builder.load(builder.bitcast(at, ir.PointerType(vf)), align=4)
            for i in range(5):
                a = builder.load(builder.gep(coef_arr.data, [builder.add(builder.mul(ir.Constant(_I64, i), coef_cols), d)]))
                builder.store(builder.call(fma, [_splat(builder, a, _F32), w, builder.load(acc[i])]), acc[i])
        for i in range(5):
            at = builder.gep(out_arr.data, [builder.add(builder.mul(ir.Constant(_I64, i), out_cols), c0_i)])
            builder.store(builder.load(acc[i]), builder.bitcast(at, ir.PointerType(vf)), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic(prefer_literal=True)
def _levels_row(typingctx, codes, norms, levels, group, bits, out):
    """out[k] = levels[index k] * norms[k // group] for one matrix row: its level indices of the
    literal `bits` bits (2 or 4) in `interleave`'s layout, dequantised in the rotated domain (the
    Hadamard rotation is left to the activation). norms (K_pad // group,) and levels (2**bits,)
    float32; out (K_pad,) float32 contiguous; group a multiple of LANES * 8 // bits dividing K_pad.
    One LANES-byte load per block, widened once; each vector a shift, a mask, the table lookup and
    a multiply by the group's norm."""
    if not isinstance(bits, types.IntegerLiteral) or bits.literal_value not in PACKED_BITS:
        return None
    if codes.dtype != types.uint8:
        return None
    width = bits.literal_value
    sig = types.none(codes, norms, levels, group, bits, out)

    def codegen(context, builder, signature, args):
        codes_v, norms_v, levels_v, group_v, _, out_v = args
        code_arr = context.make_array(signature.args[0])(context, builder, codes_v)
        norm_arr = context.make_array(signature.args[1])(context, builder, norms_v)
        level_arr = context.make_array(signature.args[2])(context, builder, levels_v)
        out_arr = context.make_array(signature.args[5])(context, builder, out_v)
        k_pad = cgutils.unpack_tuple(builder, out_arr.shape, 1)[0]
        group_i = context.cast(builder, group_v, signature.args[3], types.intp)
        vec_ptr_t = ir.PointerType(_vec(_F32))
        tables = _level_tables(builder, level_arr, 1 << width)
        per = 8 // width
        with cgutils.for_range(builder, builder.sdiv(k_pad, group_i)) as group_loop:
            g = group_loop.index
            norm = _splat(builder, builder.load(builder.gep(norm_arr.data, [g])), _F32)
            base = builder.mul(g, group_i)
            with cgutils.for_range(builder, builder.sdiv(group_i, ir.Constant(_I64, LANES * per))) as block_loop:
                first = builder.add(base, builder.mul(block_loop.index, ir.Constant(_I64, LANES * per)))
                for j, w in enumerate(_block_codes(builder, code_arr, tables, first, width)):
                    dest = builder.gep(out_arr.data, [builder.add(first, ir.Constant(_I64, j * LANES))])
                    builder.store(builder.fmul(w, norm), builder.bitcast(dest, vec_ptr_t), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic(prefer_literal=True)
def _fwht_groups(typingctx, row, group):
    """The normalised Walsh-Hadamard transform of each `group` block of a contiguous float32 row,
    in place (x_g @ H, H the Sylvester matrix over sqrt(group)). group: a literal power of two,
    a multiple of LANES and at most 16 * LANES, dividing the row's length.

    A block is held in group / LANES vectors: the butterflies of stride h < LANES pair lanes
    of one vector (a shuffle to the partner lane, then the sum or the difference per lane), those
    of stride h >= LANES pair whole vectors. Each output is the same sum or difference of the same
    operands, stage by stage, as the plain loop's (`kernels._fwht_rows`): bit-identical."""
    if not isinstance(group, types.IntegerLiteral):
        return None
    size = group.literal_value
    if size < LANES or size % LANES or size & (size - 1) or size > 16 * LANES or row.dtype != types.float32:
        return None
    sig = types.none(row, group)

    def codegen(context, builder, signature, args):
        row_arr = context.make_array(signature.args[0])(context, builder, args[0])
        length = cgutils.unpack_tuple(builder, row_arr.shape, 1)[0]
        vf = _vec(_F32)
        vec_ptr_t = ir.PointerType(vf)
        count = size // LANES
        scale = ir.Constant(vf, [1.0 / float(np.sqrt(size))] * LANES)
        with cgutils.for_range(builder, builder.sdiv(length, ir.Constant(_I64, size))) as loop:
            base = builder.mul(loop.index, ir.Constant(_I64, size))
            ptrs = [builder.bitcast(builder.gep(row_arr.data, [builder.add(base, ir.Constant(_I64, i * LANES))]),
                                    vec_ptr_t) for i in range(count)]
            v = [builder.load(p, align=4) for p in ptrs]
            h = 1
            while h < LANES:
                partner = ir.Constant(_vec(_I32), [lane ^ h for lane in range(LANES)])
                upper = ir.Constant(ir.VectorType(ir.IntType(1), LANES), [bool(lane & h) for lane in range(LANES)])
                for i in range(count):
                    p = builder.shuffle_vector(v[i], v[i], partner)
                    v[i] = builder.select(upper, builder.fsub(p, v[i]), builder.fadd(v[i], p))
                h *= 2
            while h < size:
                step = h // LANES
                for i in range(count):
                    if (i // step) % 2 == 0:
                        a, b = v[i], v[i + step]
                        v[i], v[i + step] = builder.fadd(a, b), builder.fsub(a, b)
                h *= 2
            for p, x in zip(ptrs, v):
                builder.store(builder.fmul(x, scale), p, align=4)
        return context.get_dummy_value()

    return sig, codegen
