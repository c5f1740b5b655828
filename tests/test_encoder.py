"""Stem (guide §3) and encoder (§6): NumPy twins, shapes, and parity with the quantised reference."""

from types import SimpleNamespace

import numpy as np
import pytest

from whistle_stream import encoder as E
from whistle_stream.kernels import encoder as EK
from whistle_stream.kernels import integer as KI

RNG = np.random.default_rng(0)


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


class FakeCact:
    """Just enough of a CactFile for the stem: dims and named float32 arrays."""

    def __init__(self, arrays, **dims):
        self.arrays, self.dims = arrays, SimpleNamespace(**dims)

    def array(self, name):
        return self.arrays[name]

    def packed_cq(self, name):  # as CactFile says of a record that is not CQ (dense Linear then)
        raise TypeError(f"record {name!r} is fp32, not CQ")


def twin_stem(feats, w, dws, pws, out):
    """§3 written out: zero-padded 3x3 stride-2 windows, row 3 * time + mel of each (9, C) kernel."""
    def down(x, k):  # x (T, M, C), k (9, C): depthwise (C = 1 broadcasts to the first conv)
        t, m = (x.shape[0] + 1) // 2, (x.shape[1] + 1) // 2
        xp = np.pad(x, ((1, 2), (1, 2), (0, 0)))
        return sum(xp[i:i + 2 * t:2, j:j + 2 * m:2] * k[3 * i + j] for i in range(3) for j in range(3))

    silu = lambda v: v / (1 + np.exp(-v))
    x = down(feats.astype(np.float64)[:, :, None], w)
    for dw, pw in zip(dws, pws):
        x = down(silu(x), dw) @ pw.T
    x = silu(x)
    flat = x.transpose(0, 2, 1).reshape(x.shape[0], -1)  # channel-major: index mels * c + f
    amax = np.abs(flat).max(1, keepdims=True)
    scale = np.where(amax > 0, amax / 127, 1)
    return (np.clip(np.round(flat / scale), -128, 127) * scale) @ out.T


# the stem makes E.STEM_BLOCK_FRAMES output frames (8 feature rows each) at a time: the last three
# cross block edges (two blocks exactly, one row over, three blocks and a part)
@pytest.mark.parametrize("frames,mels", [(37, 80), (8, 80), (1, 80), (12, 7), (1024, 12), (1025, 12), (1557, 20)])
def test_stem_matches_section3_twin(frames, mels):
    c, width, stages = 6, 10, 3
    m_out = mels
    for _ in range(stages):
        m_out = (m_out + 1) // 2
    arrays = {"stem.w": rand(9, c), "stem.out": rand(width, c * m_out, scale=0.3)}
    for i in (1, 2):
        arrays[f"stem.dw_{i}"], arrays[f"stem.pw_{i}"] = rand(9, c, scale=0.5), rand(c, c, scale=0.5)
    stem = E.Stem(FakeCact(arrays, stem_stages=stages))
    feats = rand(frames, mels)
    got = stem(feats)
    want = twin_stem(feats, arrays["stem.w"], [arrays["stem.dw_1"], arrays["stem.dw_2"]],
                     [arrays["stem.pw_1"], arrays["stem.pw_2"]], arrays["stem.out"])
    assert got.shape == (-(-frames // 8), width)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_stem_kernel_rows_are_time_major_and_not_flipped():
    arrays = {"stem.w": np.zeros((9, 1), np.float32), "stem.out": np.ones((1, 1), np.float32)}
    arrays["stem.w"][3 * 2 + 0, 0] = 1.0  # time offset +1, mel offset -1
    stem = E.Stem(FakeCact(arrays, stem_stages=1))
    feats = np.zeros((4, 1), np.float32)
    feats[1, 0] = 0.5
    # Output frame 0 reads input time 2*0 + 2 - 1 = 1, mel 2*0 + 0 - 1 = -1 (padding): zero.
    # A mel-only tap (row 3 * 1 + 1 = 4, centre) at time +1 would have read it.
    assert np.all(stem(feats) == 0)
    arrays["stem.w"][:] = 0
    arrays["stem.w"][3 * 2 + 1, 0] = 1.0  # time +1, mel 0
    got = stem(feats)
    assert got[0, 0] > 0 and got[1, 0] == 0


def test_depthwise_time_conv_is_same_padded_and_unflipped():
    g, w = rand(11, 5), rand(9, 5)
    out = np.empty_like(g)
    EK._conv_time(g, w, 0, 11, out)
    gp = np.pad(g, ((4, 4), (0, 0)))
    want = sum(gp[k:k + 11] * w[k] for k in range(9))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    flipped = sum(gp[k:k + 11] * w[8 - k] for k in range(9))
    assert np.abs(out - flipped).max() > 1e-2
    parts = np.full_like(g, np.nan)  # rows in ranges (the worker threads' split): the same numbers
    for a, b in ((0, 3), (3, 4), (4, 11)):
        EK._conv_time(g, w, a, b, parts)
    assert np.array_equal(parts, out)


def test_odd_kernel_width_pads_evenly():
    g, w = rand(6, 3), rand(7, 3)
    out = np.empty_like(g)
    EK._conv_time(g, w, 0, 6, out)
    gp = np.pad(g, ((3, 3), (0, 0)))
    np.testing.assert_allclose(out, sum(gp[k:k + 6] * w[k] for k in range(7)), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- against the reference

reference = pytest.importorskip("tests.harness.reference", reason="needs the cactus-needle JAX reference")

# The encoder's parity line: clip cosine >= 0.9999, every frame but the last two >= 0.999. Measured on
# the full shape against the file-weight reference: >= 0.999998 on every clip (0.99999 against the
# harness's float32-master reference); a 1e-7 relative change of the features moves the engine's
# own output by ~1e-6, so the margin is not luck of int8 rounding.
CLIP_COSINE = 0.9999
FRAME_COSINE = 0.999

PARITY_CLIPS = ["espeak_1s", "espeak_5s", "espeak_12s", "espeak_30s", "flite_1s", "flite_5s", "flite_12s",
                "flite_30s", "quiet", "noise", "bad_samples"]


def file_weight_reference(model):
    """The quantised reference (guide §1, Whistle.encode with quant=True) run on the weights as
    the .cact stores them, at the clip's own length.

    The harness's qparams keep norms, gates, Hadamard factors and stem kernels in float32; the
    file (and so every engine) has them in fp16. That rounding is a difference of the model, not
    of the port (on a more sensitive earlier build of the test model it alone moved the
    reference's output by a clip cosine of 1e-4), so the oracle rounds those leaves to fp16 the
    way the file does. CQ leaves are already the file's values.
    """
    import jax
    import jax.numpy as jnp
    from needle.model.quantize import _is_quant_leaf, configure_deploy
    from needle.model.whistle import Whistle

    params = jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf if _is_quant_leaf(path, leaf) else np.asarray(leaf, np.float16).astype(np.float32),
        model.qparams)
    module = Whistle(model.cfg)
    encode = jax.jit(lambda p, wav, lengths: module.apply({"params": p}, wav, lengths, True, method=Whistle.encode))

    def run(pcm):
        configure_deploy(act_bits=8, kv_bits=8)  # guide §1: int8 activations and KV
        pcm = reference.reference_level(reference.reference_sanitize(pcm))
        enc, frames = encode(params, jnp.asarray(pcm)[None], jnp.array([len(pcm)], jnp.int32))
        return np.asarray(enc[0, :int(frames[0])], np.float32)

    return run


@pytest.fixture(scope="module")
def clips():
    from tests.harness.audio import clip_set

    return clip_set()


@pytest.fixture(scope="module", params=["tiny", "odd", "demo", pytest.param("full", marks=pytest.mark.slow)])
def shaped(request):
    """A random model of a harness shape, or the bundled demo model (trained: its activations are
    the ones real speech gives), with our encoder and the reference on its weights."""
    from whistle_stream.container import CactFile
    from whistle_stream.models import resolve_model

    if request.param == "demo":
        model = reference.from_cact(resolve_model(None).path)
    else:
        model = reference.build_model(request.param)
    return model, E.Encoder(CactFile(model.path)), file_weight_reference(model)


def cosine(a, b):
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.reference
@pytest.mark.parametrize("clip", PARITY_CLIPS)
def test_embed_matches_the_quantised_reference(shaped, clips, clip):
    model, engine, run_reference = shaped
    want = run_reference(clips[clip])
    got = engine.embed(clips[clip])
    assert got.dtype == np.float32
    assert got.shape == want.shape == (reference.encoder_frames(len(clips[clip]), model.cfg), model.cfg.dim)
    assert cosine(got.ravel(), want.ravel()) >= CLIP_COSINE
    assert cosine(got[:-2], want[:-2]).min() >= FRAME_COSINE


@pytest.mark.reference
def test_embed_of_empty_and_sub_frame_audio_is_empty(shaped):
    model, engine, _ = shaped
    for samples in (0, 1, 159):
        out = engine.embed(np.zeros(samples, np.float32))
        assert out.shape == (0, model.cfg.dim) and out.dtype == np.float32


@pytest.mark.reference
def test_embed_accepts_int16_and_other_rates(shaped, clips):
    model, engine, _ = shaped
    pcm = clips["espeak_1s"]
    as_int16 = np.round(pcm * 32767).astype(np.int16)
    a, b = engine.embed(as_int16), engine.embed(as_int16.astype(np.float32) / 32768)
    np.testing.assert_array_equal(a, b)
    assert engine.embed(pcm[::2].copy(), rate=8000).shape[0] == engine.frames_for(len(pcm[::2]) * 2)


def test_the_stem_s_blocks_on_two_threads_are_one_thread_s_numbers(shaped, clips, monkeypatch):
    """A long clip's stem blocks (STEM_BLOCK_FRAMES frames each) run on the worker threads at
    once; each block's products run whole inside its thread, so the numbers are one thread's."""
    from whistle_stream import encoder as E
    from whistle_stream import kernels as K

    model, engine, _ = shaped
    feats = engine.features(clips["flite_12s"])
    one = engine.stem(feats)
    assert len(one) > 2 * E.STEM_BLOCK_FRAMES
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    assert np.array_equal(engine.stem(feats), one)


@pytest.mark.reference
def test_embed_split_over_two_threads_matches_the_reference_too(shaped, clips, monkeypatch):
    """kernels.GEMM_THREADS = 2 splits products, attention and the row maps by rows; BLAS may
    round a split product differently, so the check is the parity criterion, not equality."""
    from whistle_stream import kernels as K

    model, engine, run_reference = shaped
    pcm = clips["espeak_5s"]
    want = run_reference(pcm)
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    monkeypatch.setattr(K, "GEMM_SPLIT_ROWS", 8)
    monkeypatch.setattr(K, "SPLIT_ELEMENTS", 1)
    got = engine.embed(pcm)
    assert got.shape == want.shape
    assert cosine(got.ravel(), want.ravel()) >= CLIP_COSINE
    assert cosine(got[:-2], want[:-2]).min() >= FRAME_COSINE


@pytest.mark.reference
@pytest.mark.skipif(not KI.AVAILABLE, reason="no integer products on this CPU: the float path is the one tested above")
@pytest.mark.parametrize("clip", ["espeak_5s", "flite_12s", "noise"])
def test_embed_with_the_float_products_matches_the_reference_too(shaped, clips, clip, monkeypatch):
    """On a CPU with the integer products (kernels/integer.py) the tests above run them where the
    codebook fits their grid (the harness models' 2-bit one; the demo model's 4-bit one does not);
    the float path, which every other CPU runs, holds the same line here."""
    from whistle_stream import kernels as K

    model, engine, run_reference = shaped
    assert (engine.blocks[0].pw1.integer is not None) == (engine.blocks[0].pw1.bits == 2)
    monkeypatch.setattr(K, "INTEGER_PRODUCTS", False)
    want = run_reference(clips[clip])
    got = engine.embed(clips[clip])
    assert cosine(got.ravel(), want.ravel()) >= CLIP_COSINE
    assert cosine(got[:-2], want[:-2]).min() >= FRAME_COSINE
