"""The shared kernels and blocks against slow NumPy twins written from the reference's math."""

from pathlib import Path

import numpy as np
import pytest

from whistle_stream import blocks as B
from whistle_stream import kernels as K
from whistle_stream.container import walsh_hadamard

RNG = np.random.default_rng(0)


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------- twins


def twin_fake_quant(x):
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return (np.clip(np.round(x / scale), -128, 127) * scale).astype(np.float32)


def twin_int8_codes(x):
    """The fake-quant's int8 codes (int64) and scales (float32) of each row."""
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return np.clip(np.round(x / scale), -128, 127).astype(np.int64), scale[..., 0]


def twin_quant_rotate(x, group, k_pad):
    """Each row's int8 codes, zero padded to k_pad, times the +-1 Sylvester matrix per group."""
    q, scale = twin_int8_codes(x)
    q = np.pad(q, ((0, 0), (0, k_pad - x.shape[1])))
    signs = np.rint(walsh_hadamard(group) * np.sqrt(group)).astype(np.int64)
    return (q.reshape(len(q), -1, group) @ signs).reshape(len(q), k_pad), scale


def twin_integer_gemm(a, levels, span):
    """Integer products summed per span of inputs in int64, then the spans in order in float32, as
    `_integer_gemm` adds them with every norm and scale 1: a (R, K_pad), levels (N, K_pad)."""
    rows, k_pad = a.shape
    sums = np.einsum("rgk,ngk->rng", a.reshape(rows, -1, span).astype(np.int64),
                     levels.reshape(len(levels), -1, span).astype(np.int64))
    out = np.zeros(sums.shape[:2], np.float32)
    for g in range(sums.shape[2]):
        out = out + sums[:, :, g].astype(np.float32)
    return out, sums


def twin_zc_rmsnorm(x, scale, eps=1e-6):
    rms = np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
    return ((1 + scale) * x / rms).astype(np.float32)


def twin_sinkhorn(logits, iters=20):
    k = logits.astype(np.float64)
    for _ in range(iters):
        k = k - np.log(np.exp(k).sum(-1, keepdims=True))
        k = k - np.log(np.exp(k).sum(-2, keepdims=True))
    return np.exp(k)


def twin_hadamard_mlp(x, p, p1, p2, width):
    n = p["d1"].shape[0]
    ba, bb = p["w1a"].shape[0], p["w1b"].shape[0]

    def kron(z, a, b):
        return np.einsum("rij,ik,jl->rkl", z.reshape(-1, ba, bb), a, b).reshape(-1, n)

    logits = x @ p["cond_v"]
    e = np.exp(logits - logits.max(-1, keepdims=True))
    cond = 1 + (e / e.sum(-1, keepdims=True)) @ p["cond_u"]
    z = np.pad(x, ((0, 0), (0, n - width)))
    z = kron(p["d1"] * z, p["w1a"], p["w1b"])[:, p1]
    h = p["d2"] * cond * z + p["b2"]
    z = kron(h / (1 + np.exp(-h)), p["w2a"], p["w2b"])[:, p2]
    return (p["d4"] * kron(p["d3"] * z, p["w3a"], p["w3b"]))[:, :width]


# ---------------------------------------------------------------- tests


def test_fake_quant_matches_reference_rule_including_ties_and_zero_rows():
    x = rand(7, 96)
    x[2] = 0.0                                       # all-zero row: scale 1, stays zero
    x[3, :4] = [127.0, 0.5, 1.5, -2.5]               # exact .5 ties on the int8 grid: half to even
    got = B.fake_quant_int8(x)
    np.testing.assert_array_equal(got, twin_fake_quant(x))
    assert np.all(got[2] == 0)
    assert got[3, 1] == 0.0 and got[3, 2] == 2.0 and got[3, 3] == -2.0


def test_fake_quant_works_over_the_last_axis_of_any_rank():
    x = rand(3, 4, 48)
    np.testing.assert_array_equal(B.fake_quant_int8(x), twin_fake_quant(x))


def test_zc_rmsnorm_and_rms_unit_match_twins():
    x, s = rand(5, 64, scale=3.0), rand(64, scale=0.3)
    np.testing.assert_allclose(B.zc_rmsnorm(x, s), twin_zc_rmsnorm(x, s), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(B.rms_unit(x), twin_zc_rmsnorm(x, np.zeros(64, np.float32)), rtol=1e-6, atol=1e-6)


def test_softmax_silu_sigmoid_match_numpy():
    x = rand(4, 33, scale=5.0)
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(B.softmax(x), e / e.sum(-1, keepdims=True), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(B.sigmoid(x), 1 / (1 + np.exp(-x)), rtol=1e-6)
    np.testing.assert_allclose(B.silu(x), x / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6)


def test_rope_is_rotate_half_with_theta_frequencies():
    d, theta = 48, 100000.0
    x = rand(6, 3, d)
    pos = np.arange(6) + 10
    cos, sin = B.rope_tables(d, pos, theta)
    freqs = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * freqs
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    np.testing.assert_allclose(B.apply_rope(x, cos, sin), want, rtol=1e-4, atol=1e-5)


def test_sinkhorn_matches_log_domain_twin_and_is_doubly_stochastic():
    logits = rand(5, 4, 4, scale=3.0)
    got = np.empty_like(logits)
    K._sinkhorn_rows(logits, 20, got)
    np.testing.assert_allclose(got, twin_sinkhorn(logits), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-5)


def test_sinkhorn_with_an_underflowing_column_takes_the_log_domain_path():
    # Column 3 is ~e^-200 below every row's max: exp-domain normalisation would divide by zero.
    logits = rand(3, 4, 4, scale=1.0)
    logits[:, :, 3] -= 200.0
    got = np.empty_like(logits)
    K._sinkhorn_rows(logits, 20, got)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, twin_sinkhorn(logits), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40])
def test_linear_matches_matmul_on_both_row_paths(rows):
    w, x = rand(70, 96), rand(rows, 96)
    np.testing.assert_allclose(B.Linear(w)(x), x.astype(np.float64) @ w.T.astype(np.float64),
                               rtol=1e-5, atol=1e-4)


def test_gemm_rows_gives_a_row_the_same_bits_whatever_rows_come_with_it():
    """A one-token decoder step and teacher forcing run the mHC maps' product on 1 and on S rows:
    equal bits keep them equal (an int8 fake-quant downstream would flip a code on a last-bit
    difference)."""
    w, x = rand(24, 1024), rand(21, 1024)
    together = np.empty((21, 24), np.float32)
    K._gemm_rows(x, w, together)
    for r in range(21):
        alone = np.empty((1, 24), np.float32)
        K._gemm_rows(x[r:r + 1], w, alone)
        np.testing.assert_array_equal(alone[0], together[r])


@pytest.mark.parametrize("rows, k", [(10, 64), (10, 60), (7, 64), (3, 64)])  # K of lanes: simd._dot5 and _dot1
def test_gemm_rows_matches_matmul_on_its_five_row_and_plain_paths(rows, k):
    w, x = rand(9, k), rand(rows, 2 * k)[:, ::2]  # x: every other column, not contiguous
    out = np.empty((rows, 9), np.float32)
    K._gemm_rows(x, w, out)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    K._gemm_rows(np.ascontiguousarray(x), w, out)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_fwht_rows_is_the_normalised_walsh_hadamard_per_group_with_zero_padding():
    x = rand(3, 200)
    got = np.empty((3, 256), np.float32)
    K._fwht_rows(x, 128, got)
    padded = np.pad(x, ((0, 0), (0, 56))).reshape(3, 2, 128)
    np.testing.assert_allclose(got.reshape(3, 2, 128), padded @ walsh_hadamard(128), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [2, 4, 8, 16, 64])
def test_fwht_rows_small_groups_take_the_same_transform(group):
    """Groups of 8 and more run their first three stages as one unrolled 8-point transform."""
    x = rand(4, 3 * group - 1)
    got = np.empty((4, 3 * group), np.float32)
    K._fwht_rows(x, group, got)
    padded = np.pad(x, ((0, 0), (0, 1))).reshape(4, 3, group)
    np.testing.assert_allclose(got.reshape(4, 3, group), padded @ walsh_hadamard(group), rtol=1e-5, atol=1e-5)


def test_fake_quant_in_place_equals_out_of_place():
    """The kernel runs in place (x is out) in most callers; the result must not depend on it."""
    x = rand(5, 2048) * 3
    x[1] = 0.0  # all-zero row: scale 1
    x[2, :4] = [0.5, -0.5, 1.5, -2.5]
    want = np.empty_like(x)
    K._fake_quant_rows(x, want)
    inplace = x.copy()
    K._fake_quant_rows(inplace, inplace)
    np.testing.assert_array_equal(inplace, want)
    np.testing.assert_array_equal(want, twin_fake_quant(x))


class _Packed:
    """Just enough of container.PackedCQ for blocks.CQLinear: level indices, fp16 norms, codebook."""

    def __init__(self, codes, norms, codebook, bits, group, shape):
        self._codes, self.norms, self.codebook = codes, norms, codebook
        self.bits, self.group, self.shape, self.in_pad = bits, group, shape, codes.shape[1]

    def codes(self):
        return self._codes


def _cq_matrix(rng, bits, out_dim, in_dim, group=128):
    """A random CQ matrix: its _Packed record and its dequantised float64 weights (per group
    (codebook[idx] * norm) @ H, the packer's definition)."""
    in_pad = -(-in_dim // group) * group
    # one codebook per width, as a .cact holds them
    codebook = np.sort(np.random.default_rng(bits).standard_normal(1 << bits)).astype(np.float32) / np.sqrt(group)
    codes = rng.integers(0, 1 << bits, (out_dim, in_pad)).astype(np.uint8)
    norms = rng.uniform(0.5, 2.0, (out_dim, in_pad // group)).astype(np.float16)
    rot = codebook[codes].reshape(out_dim, -1, group).astype(np.float64) * norms.astype(np.float64)[:, :, None]
    dense = (rot @ walsh_hadamard(group).astype(np.float64)).reshape(out_dim, in_pad)[:, :in_dim]
    return _Packed(codes, norms, codebook, bits, group, (out_dim, in_dim)), dense


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("rows", [1, 13, 200])  # the row kernel, BLAS, BLAS split over threads
def test_cq_linear_matches_the_dequantised_matrices_stacked(bits, rows, monkeypatch):
    """The encoder's products: stacked CQ matrices kept packed, dequantised per call without their
    rotation (the activation is rotated instead), equal the dense product to float32 rounding."""
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    rng = np.random.default_rng([bits, rows])
    parts = [_cq_matrix(rng, bits, n, 200) for n in (40, 8, 24)]
    layer = B.CQLinear([p for p, _ in parts])
    assert layer.shape == (72, 200) and layer.packed[0].nbytes == 72 * 256 * bits // 8
    x = rng.standard_normal((rows, 200)).astype(np.float32)
    want = x.astype(np.float64) @ np.concatenate([d for _, d in parts]).T
    got = layer(x)
    assert got.dtype == np.float32 and got.shape == (rows, 72)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    with pytest.raises(ValueError, match="input has 100 features, the matrix takes 200"):
        layer(x[:, :100])


# ---------------------------------------------------------------- integer products (kernels/integer.py)

import llvmlite.binding as llvm_binding  # noqa: E402

from whistle_stream.kernels import integer as KI  # noqa: E402

needs_integer = pytest.mark.skipif(not KI.AVAILABLE, reason="this CPU has no integer products (AVX2 or AVX-512 VNNI): the float path only")


@pytest.mark.parametrize("group", [128, 64, 16])
def test_quant_rotate_rows_are_the_fake_quants_codes_rotated_exactly(group):
    x = rand(9, 200, scale=3.0)
    x[2] = 0.0                                   # an all-zero row: scale 1, codes 0
    x[3, :4] = [127.0, 0.5, 1.5, -2.5]           # ties on the int8 grid: half to even
    k_pad = -(-200 // group) * group
    out, scales = np.full((9, k_pad), 7, np.int16), np.empty(9, np.float32)
    K._quant_rotate_rows(x, group, out, scales)
    want, want_scales = twin_quant_rotate(x, group, k_pad)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(scales, want_scales)
    rotated = np.empty((9, k_pad), np.float32)   # the float path's rotation of the fake-quantised rows
    K._fwht_rows(B.fake_quant_int8(x), group, rotated)
    np.testing.assert_allclose(out * (scales[:, None] / np.sqrt(group)), rotated, rtol=1e-6, atol=1e-5)


def test_vnni_codes_put_each_pair_of_inputs_of_sixteen_columns_in_one_vector():
    for bits in (2, 4):
        codes = np.random.default_rng(bits).integers(0, 1 << bits, (32, 256)).astype(np.uint8)
        packed = KI.vnni_codes(codes, bits)
        words = 2 * bits
        assert packed.shape == (2, 128, words) and packed.dtype == np.uint16
        for b, p, lane in [(0, 0, 0), (0, 0, 31), (1, 77, 5), (1, 127, 30), (0, 3, 17)]:
            column, which = lane // 2, lane % 2
            got = (int(packed[b, p, lane % words]) >> (bits * (lane // words))) & ((1 << bits) - 1)
            assert got == codes[16 * b + column, 2 * p + which]


def _integer_case(rng, bits, rows, columns, k_pad, group=128, span=128):
    codes = rng.integers(0, 1 << bits, (columns, k_pad)).astype(np.uint8)
    codes[0] = rng.integers(0, 2, k_pad)     # column 0: the extreme levels only
    limit = KI.level_limit(span)
    ints = rng.integers(-limit, limit + 1, 1 << bits).astype(np.int16)
    ints[:2] = limit, -limit
    table = np.zeros(KI.PAIR_LANES, np.int16)
    table[:ints.size] = ints
    ones = KI.block_norms(np.ones((columns, k_pad // group), np.float32))
    w = KI.IntegerMatrix(KI.vnni_codes(codes, bits), table, ones, bits, group, span)
    return w, ints[codes]


@needs_integer
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("rows, columns", [(1, 16), (4, 64), (7, 32), (10, 48), (13, 48), (8, 80), (5, 112)])
def test_integer_products_equal_their_int64_twin_exactly(bits, rows, columns):
    """Both paths (up to FEW_ROWS rows the codes expanded in registers per tile, more through the
    scratch), their row and block tails: every group's sum is exact in int32, so with norms and
    scales 1 the output is the twin's
    float32 sum of the int64 group sums, bit for bit: activations anywhere in int16's rotated
    range, levels up to level_limit(span), and rows whose rotation lines up with a column's levels
    (sums near the int32 bound)."""
    for span in (128, 16):   # a whole group's grid, and the finest (levels up to 32767)
        rng = np.random.default_rng([bits, rows, columns, span])
        k_pad = 384
        w, levels = _integer_case(rng, bits, rows, columns, k_pad, span=span)
        q = rng.integers(-127, 128, (rows, k_pad))
        q[0] = 0
        signs = np.rint(walsh_hadamard(128) * np.sqrt(128)).astype(np.int64)
        for g in range(k_pad // 128):   # row 0: codes whose rotation is column 0's levels, scaled to 127
            aligned = np.zeros(128)
            aligned[:span] = levels[0, 128 * g:128 * g + span]   # on the group's first span only
            aligned = aligned @ signs
            q[0, 128 * g:128 * (g + 1)] = np.rint(127 * aligned / np.abs(aligned).max())
        a = (q.reshape(rows, -1, 128) @ signs).reshape(rows, k_pad).astype(np.int16)
        out = np.full((rows, columns), np.nan, np.float32)
        K._integer_gemm(a, np.ones(rows, np.float32), w, 0, columns // 16, out)
        want, sums = twin_integer_gemm(a, levels, span)
        assert np.abs(sums).max() < 2**31 and np.abs(sums[0, 0]).max() > 2**28  # near the bound, inside it
        np.testing.assert_array_equal(out, want)


@needs_integer
@pytest.mark.parametrize("rows, keys, d", [(1, 16, 2), (6, 48, 48), (13, 80, 48), (130, 400, 64)])
def test_integer_scores_equal_their_int64_twin_exactly(rows, keys, d):
    """Attention's scores from int8 codes (`_integer_scores` over `integer.key_levels`): with
    scales and norms 1 each is the int64 dot product of the codes as float32, bit for bit, row
    and block tails included, and -128 x -128 everywhere (the largest sum) too."""
    rng = np.random.default_rng([rows, keys, d])
    a = rng.integers(-128, 128, (rows, d)).astype(np.int16)
    kc = rng.integers(-128, 128, (keys, d)).astype(np.int16)
    a[0], kc[0] = -128, -128
    out = np.full((rows, keys), np.nan, np.float32)
    K._integer_scores(a, np.ones(rows, np.float32), KI.key_levels(kc), np.ones((keys // 16, 1, 16), np.float32), out)
    want = (a.astype(np.int64) @ kc.astype(np.int64).T).astype(np.float32)
    assert want[0, 0] == d * 128 * 128
    np.testing.assert_array_equal(out, want)


def test_int8_rows_are_the_fake_quant_s_codes_and_scales():
    x = (RNG.standard_normal((9, 13)) * 3).astype(np.float32)
    x[3] = 0.0
    codes, scales = np.full((9, 14), 99, np.int16), np.empty(9, np.float32)
    K._int8_rows(x, codes, scales)
    want, scale = twin_int8_codes(x)
    np.testing.assert_array_equal(codes[:, :13], want)
    assert (codes[:, 13] == 0).all()
    np.testing.assert_array_equal(scales, np.asarray(scale, np.float32).reshape(-1))
    np.testing.assert_array_equal(codes[:, :13] * scales[:, None], B.fake_quant_int8(x))


@needs_integer
@pytest.mark.parametrize("tq, d", [(150, 48), (9, 7)])
def test_attend_int8_is_attend_of_the_fake_quantised_queries_and_keys(tq, d, monkeypatch):
    """The encoder's attention on the integer scores against `attend` of fake_quant_int8's floats
    (the float path): the same to float rounding (scores up to ~30 here, each a few ulps apart: the
    integer sums are exact, the float ones are not); two threads give one thread's numbers."""
    rng = np.random.default_rng([tq, d])
    q = (rng.standard_normal((tq, 8, d)) * 2).astype(np.float32)
    k = (rng.standard_normal((tq, 2, d)) * 2).astype(np.float32)
    v = B.fake_quant_int8(rng.standard_normal((tq, 2, 16)).astype(np.float32))
    got = B.attend_int8(q, k, v)
    want = B.attend(B.fake_quant_int8(q), B.fake_quant_int8(k), v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
    monkeypatch.setattr(K, "INTEGER_PRODUCTS", False)
    assert np.array_equal(B.attend_int8(q, k, v), want)
    monkeypatch.setattr(K, "INTEGER_PRODUCTS", True)
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    monkeypatch.setattr(K, "GEMM_SPLIT_ROWS", 8)
    assert np.array_equal(B.attend_int8(q, k, v), got)


@needs_integer
def test_integer_products_of_some_column_blocks_write_only_those():
    rng = np.random.default_rng(5)
    w, levels = _integer_case(rng, 2, 6, 80, 256)
    a, _ = twin_quant_rotate(rng.standard_normal((6, 256)).astype(np.float32), 128, 256)
    a = a.astype(np.int16)
    out = np.full((6, 80), np.nan, np.float32)
    K._integer_gemm(a, np.ones(6, np.float32), w, 1, 4, out)
    want, _ = twin_integer_gemm(a, levels, w.span)
    np.testing.assert_array_equal(out[:, 16:64], want[:, 16:64])
    assert np.isnan(out[:, :16]).all() and np.isnan(out[:, 64:]).all()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("rows", [1, 13, 60])
def test_cq_linear_quantised_is_the_product_of_the_fake_quantised_rows(bits, rows, monkeypatch):
    """`quantised` on both paths: the integer products where the CPU has them (the codebook's
    integer levels round it by a few 1e-5 of the largest output at most), and with them off the
    float path's fake-quant and product, bit for bit; a split over two threads changes no bit."""
    monkeypatch.setattr(K, "INTEGER_PRODUCTS", KI.AVAILABLE)
    rng = np.random.default_rng(bits)
    parts = [_cq_matrix(rng, bits, n, 200) for n in (48, 16, 37)]   # 101 outputs: padded to 7 blocks
    layer = B.CQLinear([p for p, _ in parts], integer=True)
    if KI.AVAILABLE:   # a random codebook is off the grid: its integer products taken by hand
        layer.integer = B.integer_matrix([p for p, _ in parts], tolerance=1.0)
    x = rng.standard_normal((rows, 200)).astype(np.float32)
    want = twin_fake_quant(x).astype(np.float64) @ np.concatenate([d for _, d in parts]).T
    got = layer.quantised(x)
    assert got.dtype == np.float32 and got.shape == (rows, 101) and got.flags.c_contiguous
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    monkeypatch.setattr(K, "GEMM_SPLIT_ROWS", 8)
    np.testing.assert_array_equal(layer.quantised(x), got)
    monkeypatch.setattr(K, "INTEGER_PRODUCTS", False)
    np.testing.assert_array_equal(layer.quantised(x), layer(B.fake_quant_int8(x)))
    with pytest.raises(ValueError, match="input has 100 features, the matrix takes 200"):
        layer.quantised(x[:, :100])


def test_cq_linear_quantised_takes_the_float_path_where_the_integer_one_does_not_fit(monkeypatch):
    """Groups over integer.MAX_GROUP inputs (whose sums the integer levels cannot keep exact): the
    float path, its packed form built at once (with the integer products it is built only when
    the float path is first called)."""
    monkeypatch.setattr(K, "INTEGER_PRODUCTS", KI.AVAILABLE)
    rng = np.random.default_rng(11)
    wide = B.CQLinear([_cq_matrix(rng, 2, 40, 256, group=256)[0]], integer=True)
    assert wide.integer is None and wide._packed is not None
    x = rng.standard_normal((60, 256)).astype(np.float32)
    np.testing.assert_array_equal(wide.quantised(x), wide(B.fake_quant_int8(x)))
    x = x[:, :128]
    if KI.AVAILABLE:
        part = _cq_matrix(rng, 2, 32, 128)[0]
        layer = B.CQLinear([part], integer=True)
        layer.integer = B.integer_matrix([part], tolerance=1.0)
        assert layer._packed is None
        layer.quantised(x)
        assert layer._packed is None
        monkeypatch.setattr(K, "INTEGER_PRODUCTS", False)
        np.testing.assert_array_equal(layer.quantised(x), layer(B.fake_quant_int8(x)))
        assert layer._packed is not None


def test_the_integer_products_run_where_they_can_unless_turned_off(monkeypatch):
    """On wherever the host has the instructions; WHISTLE_INTEGER=0 turns them off; a value other
    than 0 or 1 is reported. The VNNI path where the host has AVX-512 VNNI and the kernels compile
    for it; the AVX2 path for an AVX2 host without them, a forced AVX2 simd path and the x86-64-v3
    and -v4 tiers' caches (whose code may not hold VNNI); none for the generic simd path, the
    baseline tier or another cross-compiled CPU."""
    from numba import config

    from whistle_stream.kernels import simd

    monkeypatch.delenv(KI.ENV, raising=False)
    assert KI._enabled() is KI.AVAILABLE
    monkeypatch.setenv(KI.ENV, "0")
    assert KI._enabled() is False
    monkeypatch.setenv(KI.ENV, "yes")
    with pytest.warns(RuntimeWarning, match="WHISTLE_INTEGER must be 0 or 1, got 'yes'"):
        assert KI._enabled() is KI.AVAILABLE
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    for tier, path in [("x86-64-v4", "avx2"), ("x86-64-v3", "avx2"), ("x86-64", None), ("znver4", None)]:
        monkeypatch.setattr(config, "CPU_NAME", tier)
        monkeypatch.setattr(simd, "PATH", simd._choose_path())
        assert KI._path() == path, tier
    monkeypatch.setattr(config, "CPU_NAME", None)
    for simd_path, features, path in [
            ("avx512", {"avx512f": True, "avx512bw": True, "avx512vnni": True, "avx2": True}, "vnni"),
            ("avx512", {"avx512f": True, "avx512bw": True, "avx2": True}, "avx2"),   # AVX-512 without VNNI
            ("avx2", {"avx512f": True, "avx512bw": True, "avx512vnni": True, "avx2": True}, "avx2"),
            ("avx2", {"avx2": True}, "avx2"),
            ("generic", {"avx2": True}, None)]:
        monkeypatch.setattr(simd, "PATH", simd_path)
        monkeypatch.setattr(llvm_binding, "get_host_cpu_features", lambda f=features: f)
        assert KI._path() == path, (simd_path, features)


def test_only_a_codebook_on_the_integer_grid_takes_the_integer_products():
    """needle's 2-bit codebook fits a whole group's integer grid within LEVEL_TOLERANCE; its 4-bit
    one fits none (the encoder's float products keep it exact), but the decoder's float products
    take it on the finest grid already, whose 16-input spans then hold it exactly; outputs are
    padded to whole column blocks."""
    rng = np.random.default_rng(3)
    needle_2bit = np.array([-0.13317214, -0.03990209, 0.04003528, 0.13346045], np.float32)
    needle_4bit = np.array([-0.23953155, -0.18070605, -0.14095794, -0.10901255, -0.08151297, -0.05652765,
                            -0.03293915, -0.01011611, 0.0127108, 0.03570792, 0.05945826, 0.08497702,
                            0.11274162, 0.14469692, 0.184239, 0.2422737], np.float32)

    def cq(codebook, rows=32):
        bits = int(np.log2(codebook.size))
        codes = rng.integers(0, codebook.size, (rows, 128)).astype(np.uint8)
        return _Packed(codes, np.ones((rows, 1), np.float16), codebook, bits, 128, (rows, 128))

    assert B.integer_matrix([cq(needle_2bit)]).span == 128
    assert B.integer_matrix([cq(needle_2bit)], levels=B.decoder_levels(needle_2bit, 2)).span == 128
    assert B.integer_matrix([cq(needle_4bit)]) is None
    assert B.integer_matrix([cq(needle_4bit)], tolerance=1e-5).span == 16     # 9.2e-6 off
    assert B.integer_matrix([cq(needle_4bit)], tolerance=1.0).span == 128
    decoder_4bit = B.integer_matrix([cq(needle_4bit)], levels=B.decoder_levels(needle_4bit, 4))
    ints, unit = B.integer_levels(needle_4bit)
    assert decoder_4bit.span == 16 and np.array_equal(decoder_4bit.table[:16], ints)
    assert B.integer_matrix([cq(needle_2bit, rows=40)]).codes.shape[0] == 3   # padded to whole 16-column blocks


def test_cq_linear_of_a_width_it_cannot_keep_packed_is_a_dense_linear(tmp_path):
    """Records that are not CQ of one packed width come back as the dense Linear of their weights."""

    class Records:
        def __init__(self):
            rng = np.random.default_rng(9)
            self.cq = {"a": _cq_matrix(rng, 2, 8, 128), "b": _cq_matrix(rng, 4, 8, 128),
                       "c": _cq_matrix(rng, 2, 8, 128)}
            self.cq["t"] = _cq_matrix(rng, 3, 8, 128)

        def packed_cq(self, name):
            return self.cq[name][0]

        def array(self, name):
            return self.cq[name][1].astype(np.float32)

    cact = Records()
    assert isinstance(B.CQLinear.from_cact(cact, "a", "c"), B.CQLinear)
    cact.cq["d"] = (_Packed(*(getattr(cact.cq["c"][0], f) for f in ("_codes", "norms")),
                            cact.cq["c"][0].codebook * 2, 2, 128, (8, 128)), cact.cq["c"][1] * 2)
    for names in (("a", "b"), ("t",), ("a", "d")):  # mixed widths; a width with no packed product; two codebooks
        layer = B.CQLinear.from_cact(cact, *names)
        assert isinstance(layer, B.Linear)
        np.testing.assert_array_equal(layer.weight, np.concatenate([cact.array(n) for n in names]))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("rows", [1, 5, 30])
def test_rotated_linear_matches_the_dequantised_matrix(bits, rows):
    rng = np.random.default_rng([bits, rows])
    out_dim, in_dim, group = 48, 200, 128
    in_pad = 256
    levels = 1 << bits
    codebook = np.sort(rng.standard_normal(levels)).astype(np.float32) / np.sqrt(group)
    codes = rng.integers(0, levels, (out_dim, in_pad)).astype(np.uint8)
    norms = rng.uniform(0.5, 2.0, (out_dim, in_pad // group)).astype(np.float16)
    rot = codebook[codes].reshape(out_dim, 2, group) * norms.astype(np.float32)[:, :, None]
    dense = (rot @ walsh_hadamard(group)).reshape(out_dim, in_pad)[:, :in_dim]
    x = rng.standard_normal((rows, in_dim)).astype(np.float32)
    want = x.astype(np.float64) @ dense.T.astype(np.float64)
    got = B.RotatedLinear(codes, norms, codebook, group, (out_dim, in_dim))(x)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()


def test_attend_groups_query_heads_onto_kv_heads_and_masks_keys():
    tq, heads, kv, d, dv = 5, 4, 2, 8, 6
    q, k, v = rand(tq, heads, d), rand(7, kv, d), rand(7, kv, dv)
    valid = np.array([1, 1, 1, 1, 1, 0, 0], bool)
    got = B.attend(q, k, v, valid).reshape(tq, heads, dv)
    for h in range(heads):
        s = q[:, h] @ k[:valid.sum(), h // 2].T / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(got[:, h], p @ v[:valid.sum(), h // 2], rtol=1e-5, atol=1e-6)


def test_attend_causal_sees_only_earlier_positions():
    q, k, v = rand(6, 2, 8), rand(6, 1, 8), rand(6, 1, 4)
    got = B.attend(q, k, v, causal=True).reshape(6, 2, 4)
    np.testing.assert_allclose(got[0, :], np.broadcast_to(v[0, 0], (2, 4)), rtol=1e-6)


@pytest.mark.parametrize("width,n", [(128, 128), (96, 128)])
def test_hadamard_mlp_matches_einsum_twin(width, n, monkeypatch):
    """`HadamardMLP.residual` (the fused kernel) against x + scale * twin(zc_rmsnorm(x, pre)); the
    rows split over two threads give one thread's numbers."""
    ba = 1 << ((n - 1).bit_length() // 2)
    bb = n // ba
    p = {k: rand(n, scale=0.5) + 1 for k in ("d1", "d2", "d3")}
    p.update(b2=rand(n, scale=0.3), d4=rand(n, scale=0.1), cond_v=rand(width, 8, scale=0.1),
             cond_u=rand(8, n, scale=0.3))
    for s in (1, 2, 3):
        p[f"w{s}a"], p[f"w{s}b"] = rand(ba, ba, scale=0.25), rand(bb, bb, scale=0.2)
    p1, p2 = RNG.permutation(n), RNG.permutation(n)
    mlp = B.HadamardMLP(p, p1.astype(np.float32), p2.astype(np.float32), width)
    pre = rand(width, scale=0.3)
    for rows in (1, 3, 20):
        x = rand(rows, width)
        got = B.HadamardMLP.residual(x, mlp.record(pre, 0.5))
        want = x + 0.5 * twin_hadamard_mlp(twin_zc_rmsnorm(x, pre), p, p1, p2, width)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    monkeypatch.setattr(K, "GEMM_SPLIT_ROWS", 8)
    np.testing.assert_array_equal(B.HadamardMLP.residual(x, mlp.record(pre, 0.5)), got)


class _Arrays:
    def __init__(self, arrays):
        self.arrays = arrays

    def array(self, name):
        return self.arrays[name]


def twin_lane_step(x, layer, hc, block):
    """needle `_LaneBody` for one layer, written with einsum, phi as (nC, n) / (nC, n*n)."""
    rows, n, c = x.shape
    lane = np.eye(n, dtype=np.float32)[layer % n]
    nx = twin_fake_quant(twin_zc_rmsnorm(x.reshape(rows, n * c), np.zeros(n * c, np.float32)))
    sig = lambda v: 1 / (1 + np.exp(-v))
    hpre = sig(hc["a_pre"][layer] * (nx @ hc["phi_pre"][layer]) + hc["b_pre"][layer] + 8 * lane - 4)
    u = np.einsum("rn,rnc->rc", hpre, x)
    y = block(u) - u
    hpost = 2 * sig(hc["a_post"][layer] * (nx @ hc["phi_post"][layer]) + hc["b_post"][layer] - 4 * (1 - lane))
    hres = twin_sinkhorn(hc["a_res"][layer] * (nx @ hc["phi_res"][layer]).reshape(rows, n, n) + hc["b_res"][layer])
    return np.einsum("rij,rjc->ric", hres, x) + hpost[..., None] * y[:, None, :]


@pytest.mark.parametrize("lanes,layer", [(4, 0), (4, 2), (3, 4)])
def test_lane_mixer_step_matches_the_reference_lane_body(lanes, layer):
    n, c, layers, rows = lanes, 16, 5, 6
    hc = {"phi_pre": rand(layers, n * c, n, scale=0.1), "phi_post": rand(layers, n * c, n, scale=0.1),
          "phi_res": rand(layers, n * c, n * n, scale=0.1), "a_pre": rand(layers), "a_post": rand(layers),
          "a_res": rand(layers), "b_pre": rand(layers, n), "b_post": rand(layers, n),
          "b_res": rand(layers, n, n) + 4 * np.eye(n, dtype=np.float32)}
    arrays = {f"encoder.mhc_{k}": v for k, v in hc.items() if not k.startswith("phi")}
    for k in ("phi_pre", "phi_post", "phi_res"):  # stored (L * lanes, lanes * width): row l*lanes + j = phi[l][:, j]
        arrays[f"encoder.mhc_{k}"] = hc[k].transpose(0, 2, 1).reshape(-1, n * c)
    arrays["encoder.final_norm"] = rand(c, scale=0.2)
    mixer = B.LaneMixer(_Arrays(arrays), "encoder.", layers, n, c)
    x = rand(rows, n, c)
    block = lambda u: np.tanh(u) * 1.5 + u
    np.testing.assert_allclose(mixer.step(layer, x, block), twin_lane_step(x, layer, hc, block), rtol=1e-4, atol=1e-4)
    start = mixer.expand(x[:, 0])
    assert start.shape == (rows, n, c) and np.all(start == x[:, :1])
    np.testing.assert_allclose(mixer.collapse(x), twin_zc_rmsnorm(x.mean(1), arrays["encoder.final_norm"]),
                               rtol=1e-5, atol=1e-5)


def test_sinkhorn_wrapper_matches_twin_for_many_rows():
    logits = rand(400, 3, 3, scale=3.0)
    np.testing.assert_allclose(B.sinkhorn(logits), twin_sinkhorn(logits), rtol=1e-5, atol=1e-6)


def test_silu_and_sigmoid_chunks_cover_arrays_of_any_size_and_extremes():
    for n in (10, 5000, K.EXP_CHUNK + 3, 3 * K.EXP_CHUNK):
        x = rand(n, scale=4.0)
        x[:4] = [-100.0, -89.0, 89.0, 100.0]  # past the exp clamps: 0 and inf inside
        x64 = x.astype(np.float64)
        np.testing.assert_allclose(B.silu(x), x64 / (1 + np.exp(-x64)), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(B.sigmoid(x), 1 / (1 + np.exp(-x64)), rtol=1e-6, atol=1e-7)
        strided = np.asfortranarray(rand(7, n // 7 + 1, scale=4.0))  # the strided fallback
        want = strided.astype(np.float64) / (1 + np.exp(-strided.astype(np.float64)))
        B.silu_inplace(strided)
        np.testing.assert_allclose(strided, want, rtol=1e-6, atol=1e-7)


def test_linear_row_split_over_threads_gives_the_same_product(monkeypatch):
    w, x = rand(64, 96), rand(301, 96)
    single = B.Linear(w)(x)
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    # the same product up to float32 summation order: BLAS may block 150 rows otherwise than 301
    # (seen on an AVX2-only machine: 6.7e-6 on entries up to ~15, a few float32 ulps of 96-term sums)
    np.testing.assert_allclose(B.Linear(w)(x), single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attend_split_over_threads_gives_the_same_result(monkeypatch, causal):
    tq = 301
    q, k, v = rand(tq, 4, 8), rand(tq, 2, 8), rand(tq, 2, 6)
    valid = np.ones(tq, bool)
    valid[-20:] = False
    single = B.attend(q, k, v, valid, causal=causal)
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    np.testing.assert_allclose(B.attend(q, k, v, valid, causal=causal), single, rtol=1e-5, atol=1e-6)


def test_set_threads_validates_and_sets_the_split(monkeypatch):
    monkeypatch.setattr(K, "GEMM_THREADS", 1)
    K.set_threads(2)
    assert K.GEMM_THREADS == 2
    for bad in (0, 65, 1.5, "2", True):
        with pytest.raises(ValueError, match="threads must be an integer from 1 to 64"):
            K.set_threads(bad)
    assert K.GEMM_THREADS == 2


def test_whistle_threads_environment_variable(monkeypatch):
    monkeypatch.setattr(K, "GEMM_THREADS", 1)
    monkeypatch.setenv("WHISTLE_THREADS", "2")
    K._threads_from_env()
    assert K.GEMM_THREADS == 2
    monkeypatch.setenv("WHISTLE_THREADS", "many")
    with pytest.warns(RuntimeWarning, match="WHISTLE_THREADS must be an integer from 1 to 64, got 'many'"):
        K._threads_from_env()
    assert K.GEMM_THREADS == 2  # unchanged


def test_row_maps_split_over_threads_give_identical_rows(monkeypatch):
    x = rand(301, 96, scale=3.0)
    s = rand(96, scale=0.3)
    want = [B.fake_quant_int8(x), B.zc_rmsnorm(x, s), B.rms_unit(x), B.softmax(x), B.silu(x), B.sigmoid(x)]
    gate = rand(301, 192)
    gate2 = gate.copy()
    B.sigmoid_inplace(gate[:, 96:])  # the strided path
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    monkeypatch.setattr(K, "SPLIT_ELEMENTS", 1)
    got = [B.fake_quant_int8(x), B.zc_rmsnorm(x, s), B.rms_unit(x), B.softmax(x), B.silu(x), B.sigmoid(x)]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    B.sigmoid_inplace(gate2[:, 96:])
    np.testing.assert_array_equal(gate, gate2)


def test_a_split_inside_a_split_runs_inline(monkeypatch):
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    seen = []

    def outer(a, b):
        B.run_split(lambda c, d: seen.append((a, b, c, d)), b - a)

    B.run_split(outer, 10)
    assert sorted(seen) == [(0, 5, 0, 5), (5, 10, 0, 5)]


def test_the_kernel_cache_is_dropped_when_any_kernel_source_changes(tmp_path, monkeypatch):
    from whistle_stream.kernels import _cache

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    pkg = tmp_path / "kernels"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "b.py").write_text("y = 2\n")

    def cached(*names):
        for name in names:
            (pkg / "__pycache__" / name).write_bytes(b"machine code")

    cached("a.f-1.py311.nbi", "a.f-1.py311.1.nbc", "a.cpython-311.pyc")
    assert _cache.drop_stale(pkg) == 2                      # no stamp yet: the cache is not trusted
    assert sorted(p.name for p in (pkg / "__pycache__").iterdir()) == ["a.cpython-311.pyc", _cache.STAMP]
    cached("a.f-1.py311.nbi")
    assert _cache.drop_stale(pkg) == 0                      # sources unchanged: kept
    (pkg / "b.py").write_text("y = 3\n")                    # a sibling a kernel may inline changed
    assert _cache.drop_stale(pkg) == 1
    assert _cache.drop_stale(pkg) == 0


def test_the_kernel_cache_under_numba_cache_dir_is_guarded_too(tmp_path, monkeypatch):
    from whistle_stream.kernels import _cache

    pkg = tmp_path / "src" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    (mirror,) = [d for d in _cache.cache_dirs(pkg) if str(d).startswith(str(tmp_path / "cache"))]
    mirror.mkdir(parents=True)
    (mirror / "a.f-1.py311.nbi").write_bytes(b"x")
    assert _cache.drop_stale(pkg) == 1 and (mirror / _cache.STAMP).exists()


def test_a_cache_folder_numba_has_not_made_yet_is_stamped_so_the_first_processs_cache_is_kept(tmp_path, monkeypatch):
    from whistle_stream.kernels import _cache

    pkg = tmp_path / "src" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))   # empty: a fresh image build
    assert _cache.drop_stale(pkg) == 0                      # the first process: nothing cached yet
    (mirror,) = [d for d in _cache.cache_dirs(pkg) if str(d).startswith(str(tmp_path / "cache"))]
    (mirror / "a.f-1.py311.nbi").write_bytes(b"x")          # what that process's Numba then writes
    assert _cache.drop_stale(pkg) == 0                      # the next process keeps it
    assert (mirror / "a.f-1.py311.nbi").exists()


_LOAD_THEN_LINK = r"""
import json
import numpy as np
from numba import njit
from whistle_stream import kernels as K
from whistle_stream.kernels import decoder as KD

x = np.linspace(-3, 3, 4 * 64, dtype=np.float32).reshape(4, 64)
direct = np.empty_like(x)
K._fake_quant_rows(x, direct)
library = next(iter(K._fake_quant_rows.overloads.values())).library
parked = library._shared_module is None


@njit
def linked(x, out):   # compiled now: links the loaded kernel's IR into its own
    K._fake_quant_rows(x, out)


through = np.empty_like(x)
linked(x, through)
print(json.dumps({"hits": sum(K._fake_quant_rows.stats.cache_hits.values()), "parked": parked,
                  "same": bool(np.array_equal(direct, through)),
                  "kinds": sorted({type(k._cache).__name__ for k in (K._fake_quant_rows, KD._block_step)})}))
"""


def test_a_kernel_loaded_from_the_cache_parks_its_linking_ir_and_still_links_into_a_new_kernel():
    """The IR a loaded kernel would lend to a later compile is kept as bitcode (30 MB less of an
    engine process); a kernel compiled afterwards still links it and computes the same."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    runs = [json.loads(subprocess.run([sys.executable, "-c", _LOAD_THEN_LINK], cwd=root, check=True,
                                      capture_output=True, text=True).stdout) for _ in range(2)]
    loaded = runs[1]                        # the first run compiled the kernel if it was not cached
    assert loaded["hits"] == 1 and loaded["parked"]
    assert loaded["same"] and runs[0]["same"]
    assert loaded["kinds"] == ["_LinkOnDemandCache"]


def test_the_guarded_cache_folder_is_the_one_numba_writes(tmp_path, monkeypatch):
    from numba.core.caching import _CacheLocator

    from whistle_stream import kernels
    from whistle_stream.kernels import _cache

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    pkg = Path(kernels.__file__).parent
    numba_dir = tmp_path / _CacheLocator.get_suitable_cache_subpath(str(pkg / "decoder.py"))
    assert numba_dir in _cache.cache_dirs(pkg)
