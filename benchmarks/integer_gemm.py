"""Integer products on AVX-512 VNNI: a probe of what an integer path for the encoder could gain.

    python benchmarks/integer_gemm.py          # a CPU with avx512vnni

The encoder's products take int8 activations (the reference's rule) and 2- or 4-bit weight codes
whose groups are Hadamard-rotated. Rotating an int8 row's 128-groups without the 1/sqrt(128)
gives exact integers within +-16384 (int16), and the codebook's levels as integers up to 1023
keep each int32 lane (128 products of one group and one output column) inside 2**31. So
vpdpwssd (int16 pairs into int32 lanes, 32 multiply-adds per instruction, twice the float32 FMA
rate) computes the products exactly, a group at a time, with the group's norms applied in
float32 after each group. This probe times a register-blocked microkernel (4 rows x 3 x 16
columns, written in LLVM IR) against numpy's float32 BLAS on the encoder's shapes, one thread,
in the same run, and checks it against an int64 NumPy twin. It is not wired into the engine.
"""

import sys
import time

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
LANES = 16
GROUP_PAIRS = 64   # a group of 128 inputs as pairs

def _decl(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)

@intrinsic(prefer_literal=True)
def _tile_i16(typingctx, a, b, norms, rscale, m0, j0, mr, nr, out):
    """out[m0:m0+mr, 16*j0 : 16*(j0+nr)] = rscale[m] * sum_g norms[j, g, :] * (int32 sum over the group)"""
    if not (isinstance(mr, types.IntegerLiteral) and isinstance(nr, types.IntegerLiteral)):
        return None
    MR, NR = mr.literal_value, nr.literal_value
    sig = types.none(a, b, norms, rscale, m0, j0, mr, nr, out)
    def codegen(context, builder, signature, args):
        a_v, b_v, n_v, s_v, m0_v, j0_v, _, _, o_v = args
        A = context.make_array(signature.args[0])(context, builder, a_v)
        Bm = context.make_array(signature.args[1])(context, builder, b_v)
        N = context.make_array(signature.args[2])(context, builder, n_v)
        S = context.make_array(signature.args[3])(context, builder, s_v)
        O = context.make_array(signature.args[8])(context, builder, o_v)
        vi = ir.VectorType(_I32, LANES); vf = ir.VectorType(_F32, LANES)
        dp = _decl(builder, "llvm.x86.avx512.vpdpwssd.512", vi, [vi, vi, vi])
        fma = _decl(builder, "llvm.fma.v16f32", vf, [vf, vf, vf])
        m0_i = context.cast(builder, m0_v, signature.args[4], types.intp)
        j0_i = context.cast(builder, j0_v, signature.args[5], types.intp)
        kp = cgutils.unpack_tuple(builder, A.shape, 2)[1]
        a_row = builder.sdiv(cgutils.unpack_tuple(builder, A.strides, 2)[0], ir.Constant(_I64, 4))  # in i32 pairs
        pairs = builder.sdiv(kp, ir.Constant(_I64, 2))
        groups = builder.sdiv(pairs, ir.Constant(_I64, GROUP_PAIRS))
        a32 = builder.bitcast(A.data, ir.PointerType(_I32))
        bvec = builder.bitcast(Bm.data, ir.PointerType(vi))
        nvec = builder.bitcast(N.data, ir.PointerType(vf))
        rows = [builder.gep(a32, [builder.mul(builder.add(m0_i, ir.Constant(_I64, i)), a_row)]) for i in range(MR)]
        bases = [builder.gep(bvec, [builder.mul(builder.add(j0_i, ir.Constant(_I64, j)), pairs)]) for j in range(NR)]
        nbases = [builder.gep(nvec, [builder.mul(builder.add(j0_i, ir.Constant(_I64, j)), groups)]) for j in range(NR)]
        zi = ir.Constant(vi, [0] * LANES); zf = ir.Constant(vf, [0.0] * LANES)
        accf = [[cgutils.alloca_once_value(builder, zf) for _ in range(NR)] for _ in range(MR)]
        acci = [[cgutils.alloca_once_value(builder, zi) for _ in range(NR)] for _ in range(MR)]
        undef = ir.Constant(vi, ir.Undefined); zero_mask = ir.Constant(vi, [0] * LANES)
        with cgutils.for_range(builder, groups) as gl:
            g = gl.index
            for i in range(MR):
                for j in range(NR):
                    builder.store(zi, acci[i][j])
            first = builder.mul(g, ir.Constant(_I64, GROUP_PAIRS))
            with cgutils.for_range(builder, ir.Constant(_I64, GROUP_PAIRS)) as pl:
                p = builder.add(first, pl.index)
                bs = [builder.load(builder.gep(bases[j], [p]), align=4) for j in range(NR)]
                for i in range(MR):
                    pair = builder.load(builder.gep(rows[i], [p]), align=4)
                    av = builder.shuffle_vector(builder.insert_element(undef, pair, ir.Constant(_I32, 0)), undef, zero_mask)
                    for j in range(NR):
                        builder.store(builder.call(dp, [builder.load(acci[i][j]), av, bs[j]]), acci[i][j])
            ns = [builder.load(builder.gep(nbases[j], [g]), align=4) for j in range(NR)]
            for i in range(MR):
                for j in range(NR):
                    builder.store(builder.call(fma, [builder.sitofp(builder.load(acci[i][j]), vf), ns[j], builder.load(accf[i][j])]), accf[i][j])
        o_row = builder.sdiv(cgutils.unpack_tuple(builder, O.strides, 2)[0], ir.Constant(_I64, 4))
        for i in range(MR):
            m = builder.add(m0_i, ir.Constant(_I64, i))
            sc = builder.load(builder.gep(S.data, [m]))
            scv = builder.shuffle_vector(builder.insert_element(ir.Constant(vf, ir.Undefined), sc, ir.Constant(_I32, 0)), ir.Constant(vf, ir.Undefined), zero_mask)
            for j in range(NR):
                col = builder.mul(builder.add(j0_i, ir.Constant(_I64, j)), ir.Constant(_I64, LANES))
                dst = builder.gep(O.data, [builder.add(builder.mul(m, o_row), col)])
                builder.store(builder.fmul(builder.load(accf[i][j]), scv), builder.bitcast(dst, ir.PointerType(vf)), align=4)
        return context.get_dummy_value()
    return sig, codegen


def make_gemm(MR, NR):
    @njit(cache=False, nogil=True)
    def gemm(a, b, norms, rscale, out):
        mp = a.shape[0]; nb = b.shape[0]
        j = 0
        while j + NR <= nb:
            for m in range(0, mp, MR):
                _tile_i16(a, b, norms, rscale, m, j, MR, NR, out)
            j += NR
        while j < nb:
            for m in range(0, mp, MR):
                _tile_i16(a, b, norms, rscale, m, j, MR, 1, out)
            j += 1
    return gemm

def pack_b(w):  # w (N, Kp) int16 -> (N/16, Kp/2, 32)
    n, kp = w.shape
    return np.ascontiguousarray(w.reshape(n // 16, 16, kp // 2, 2).transpose(0, 2, 1, 3).reshape(n // 16, kp // 2, 32))

def pack_norms(nr):  # (N, G) -> (N/16, G, 16)
    n, g = nr.shape
    return np.ascontiguousarray(nr.reshape(n // 16, 16, g).transpose(0, 2, 1))


def main() -> int:
    if not llvm_binding.get_host_cpu_features().get("avx512vnni"):
        print("this CPU has no AVX-512 VNNI (avx512vnni): nothing to measure")
        return 0
    from whistle_stream import kernels
    kernels.set_blas_threads(1)   # one thread on each side
    gemm_i16 = make_gemm(4, 3)
    rng = np.random.default_rng(0)
    for (M, K, N) in [(376, 512, 512), (376, 512, 1120), (376, 512, 1024), (376, 1280, 512)]:
        a = rng.integers(-16384, 16385, (M, K)).astype(np.int16)
        w = rng.integers(-1023, 1024, (N, K)).astype(np.int16)
        G = K // 128
        nr = rng.random((N, G)).astype(np.float32)
        rs = rng.random(M).astype(np.float32)
        B, NRM = pack_b(w), pack_norms(nr)
        out = np.empty((M, N), np.float32)
        gemm_i16(a, B, NRM, rs, out)
        # twin
        prod = np.einsum("mgk,ngk->mng", a.reshape(M, G, 128).astype(np.int64), w.reshape(N, G, 128).astype(np.int64))
        assert np.abs(prod).max() < 2**31
        ref = (prod.astype(np.float64) * nr[None]).sum(-1) * rs[:, None]
        err = np.abs(out - ref).max() / np.abs(ref).max()
        af = a.astype(np.float32); wf = w.astype(np.float32); of = np.empty((M, N), np.float32)
        def best(f, n=20):
            t = []
            for _ in range(n):
                s = time.perf_counter(); f(); t.append(time.perf_counter() - s)
            return min(t)
        ti = best(lambda: gemm_i16(a, B, NRM, rs, out))
        tf = best(lambda: np.matmul(af, wf.T, out=of))
        print(f"{M}x{K}x{N}: int16 {ti*1e3:.3f} ms ({2*M*K*N/ti/1e9:.0f} GOPS)  BLAS f32 {tf*1e3:.3f} ms ({2*M*K*N/tf/1e9:.0f} GFLOPS)  ratio {ti/tf:.2f}  relerr {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
