"""The JAX reference every parity test of the engine is pinned against.

`build_model(shape, seed)` makes a random but *perturbed* Whistle of a named shape (every
parameter moved off its initial value, so zero-initialised gates, norms and biases cannot hide a
path), quantises it exactly as guide §1 does, and packs it into a .cact at the shipped widths
(guide §2). `ref_embed`, `ref_logits`, `ref_greedy` and `ref_beam` run the quantised reference
(CQ weights, int8 activations and KV) the way the engine is specified to run it.

Built models are cached under tests/.cache/models/ (params as a flat .npz, the .cact and the
tokenizer), keyed by shape, seed and `VERSION`; bump `VERSION` whenever anything that changes a
built model changes.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

import jax
import jax.numpy as jnp
import sentencepiece as spm
from needle.model import export as _export
from needle.model.architecture import ladder_config, ladder_slice
from needle.model.quantize import (
    _cq_codebook_np, _cq_hadamard_np, _is_quant_leaf, _reduces_second_last, configure_deploy, cq_quantize,
    leaf_name,
)
from needle.model.whistle import LANGUAGES, Whistle, WhistleConfig

from .corpus import CORPUS

VERSION = "h4"
CACHE = Path(__file__).resolve().parent.parent / ".cache"
SAMPLE_RATE = 16000

# Guide §6 search constants.
BEAMS = 5
PROPOSALS = 6        # each live beam proposes its 6 best text tokens
LOOP_UNIT = 8        # a loop is a unit of 1..8 tokens ...
LOOP_REPEATS = 4     # ... repeated 4 times at the end

# ---------------------------------------------------------------------------------------------
# Shapes

TOKENIZER_PIECES = 512  # text vocabulary of the test tokenizer: 4 specials + 256 bytes + 252 learned

SHAPES: dict[str, dict] = {
    # Fast: every path present, smallest sizes.
    "tiny": dict(dim=128, v_dim=64, qk_dim=32, kv_heads=1, enc_layers=2, dec_layers=2, sites=(1,),
                 orders=(2, 3), slots=512, stem=32, conv_kernel=9, languages=("en", "de")),
    # Odd counts everywhere a constant could hide: 3 encoder / 4 decoder layers, two engram sites,
    # 3 encoder lanes and 2 decoder lanes, 2 QKV taps, a 7-wide encoder conv, a 128-position cap.
    "odd": dict(dim=256, v_dim=64, qk_dim=48, kv_heads=2, enc_layers=3, dec_layers=4, sites=(1, 3),
                orders=(2, 3), slots=1024, stem=64, conv_kernel=7, lanes=2, enc_lanes=3, taps=2,
                max_tokens=128, languages=LANGUAGES),
    # The shipped architecture (WhistleConfig defaults) with the small test vocabulary.
    "full": dict(languages=LANGUAGES),
}


def shape_config(shape: str) -> WhistleConfig:
    """The float32 WhistleConfig of a named shape, text vocabulary = the test tokenizer's."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known shapes: {sorted(SHAPES)}")
    return WhistleConfig(**{**SHAPES[shape], "text": TOKENIZER_PIECES, "dtype": "float32"})


# ---------------------------------------------------------------------------------------------
# Cache plumbing


@contextlib.contextmanager
def _locked(name: str):
    """An exclusive inter-process lock, so concurrent test sessions build each entry once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _atomic_write(path: Path, write) -> None:
    """Call write(tmp_path) then rename into place, so readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _flatten(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if hasattr(value, "items"):
            out.update(_flatten(value, name))
        else:
            out[name] = np.asarray(value)
    return out


def _unflatten(flat):
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, last = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _corpus_lines():
    return [line for text in CORPUS.values() for line in text.splitlines() if line.strip()]


def tokenizer_path() -> Path:
    """Train (once, cached) the test sentencepiece BPE and return its .model path.

    pad 0, eos 1, bos 2, unk 3 as the shipped tokenizer has them; byte fallback on, full character
    coverage, so every string encodes without <unk>.
    """
    digest = hashlib.sha1("\n".join(_corpus_lines()).encode()).hexdigest()[:10]
    path = CACHE / f"tokenizer-{TOKENIZER_PIECES}-{digest}.model"
    if path.exists():
        return path
    with _locked("tokenizer"):
        if path.exists():
            return path
        import io
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(_corpus_lines()), model_writer=model, model_type="bpe",
            vocab_size=TOKENIZER_PIECES, byte_fallback=True, character_coverage=1.0,
            pad_id=0, eos_id=1, bos_id=2, unk_id=3, num_threads=1, minloglevel=2,
            hard_vocab_limit=True)
        _atomic_write(path, lambda tmp: Path(tmp).write_bytes(model.getvalue()))
    return path


def tokenizer_blob(model_path: Path | str, languages) -> bytes:
    """The RAW tokenizer record the .cact carries: our BPE plus one <|xx|> piece per language."""
    from sentencepiece import sentencepiece_model_pb2
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_path).read_bytes())
    return _export.whistle_tokenizer_blob(proto, tuple(languages))


# ---------------------------------------------------------------------------------------------
# Parameters: init, perturbation, quantisation (guide §1)


def _init_params(cfg: WhistleConfig, seed: int) -> dict:
    wav = jnp.zeros((1, SAMPLE_RATE), jnp.float32)
    lengths = jnp.array([SAMPLE_RATE], jnp.int32)
    tokens = jnp.array([[cfg.bos, cfg.text, 5, 6]], jnp.int32)
    variables = jax.jit(Whistle(cfg).init)(jax.random.PRNGKey(seed), wav, lengths, tokens)
    return _flatten(variables["params"])


# Per-leaf perturbation. Each rule moves a parameter well away from its initialiser (zeros,
# ones, identity, constants) while keeping every activation O(1): the goal is that any path the
# engine drops or gets wrong changes the outputs visibly.
_GATES = ("attn_gate", "cross_gate", "pe_gate")
_HADAMARD_FACTORS = ("w1a", "w1b", "w2a", "w2b", "w3a", "w3b")
# Random-initialised matrices whose default scale leaves their path too faint to test, as
# multipliers on the initial values.
_GAIN = {
    "embedding/embedding": 8.0,     # std 0.16: decoder input O(1) against the normalised blocks
}
# Stem kernels rescaled to (this gain) / sqrt(fan-in), so the encoder's input is O(1) and varies
# with the audio. At their 0.02 init the stem output has an RMS of ~0.01 and the encoder output
# is dominated by a clip-independent vector (frame-to-frame cosine 0.96).
_STEM_GAIN = {"w": 2.0, "dw": 2.0, "pw": 1.7, "out": 0.5}


# Mean offsets on some norm scales: sharper (more frame- and audio-dependent) attention and a
# cross-attention term that outweighs the token embedding, so transcripts depend on the clip.
_NORM_OFFSET = {
    "stack/layers/block/cross_attn/q_norm/scale": 1.5,
    "stack/layers/block/cross_attn/k_norm/scale": 1.5,
    "stack/layers/block/post_cross_norm/scale": 2.0,
    "stack/layers/block/self_attn/q_norm/scale": 1.0,
    "stack/layers/block/self_attn/k_norm/scale": 1.0,
    "encoder/layers/block/self_attn/q_norm/scale": 0.5,
    "encoder/layers/block/self_attn/k_norm/scale": 0.5,
}


def _stem_gain(name: str, value: np.ndarray) -> float:
    if not name.startswith("stem/"):
        return 1.0
    kind = name.split("/")[1].split("_")[0]
    fan_in = 9 if kind in ("w", "dw") else value.shape[0]      # 3x3 taps, or Dense (in, out)
    return _STEM_GAIN[kind] / math.sqrt(fan_in) / float(value.std())


def _perturb(flat: dict, seed: int) -> dict:
    out = {}
    for name in sorted(flat):
        value = np.asarray(flat[name], np.float32)
        # One stream per leaf, from the seed and the leaf name: adding a leaf moves no other.
        rng = np.random.default_rng([seed, int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "little")])
        noise = rng.standard_normal(value.shape).astype(np.float32)
        key = name.rsplit("/", 1)[-1]
        if key in _GATES:
            sign = np.where(rng.random(value.shape) < 0.5, -1.0, 1.0)
            if key == "cross_gate":                       # open: the transcript must follow the audio
                sign = np.ones(value.shape)
            value = (sign * rng.uniform(0.5, 2.0, value.shape)).astype(np.float32)
        elif name == "stack/final_norm/scale":
            # A zero-centred random gain (1 + scale ~ N(0, 3 sqrt(128 / dim))) on the decoder's last
            # norm. With the tied head, a positive gain makes every token predict itself (greedy
            # repeats one id forever); a random-signed one gives audio-dependent transcripts, with
            # logits std ~6 at every width (saturated softmaxes at 3 / sqrt(dim / 128) fixed).
            value = -1.0 + 3.0 * math.sqrt(128 / value.shape[-1]) * noise
        elif key == "scale" and name in _NORM_OFFSET:     # sharper attention, stronger cross path
            value = value + _NORM_OFFSET[name] + 0.25 * noise
        elif key == "scale":                              # ZCRMSNorm: (1 + scale)
            value = value + 0.25 * noise
        elif key.startswith("mhc_a_"):                    # init 0.01: make the lane maps matter
            value = rng.uniform(0.2, 0.8, value.shape).astype(np.float32)
        elif key.startswith("mhc_b_"):                    # zeros / 4*identity
            value = value + 0.5 * noise
        elif key in ("q_taps", "k_taps", "v_taps", "taps"):   # identity taps [1, 0, ...]
            value = value + 0.25 * noise
        elif key in ("d1", "d2", "d3", "b2"):             # ones / zeros
            value = value + 0.25 * noise
        elif key == "d4":                                 # 0.02: the MLP's output scale
            value = value + 0.1 * noise
        elif key in _HADAMARD_FACTORS:                    # Walsh blocks, entries 1/sqrt(size)
            value = value + 0.3 / math.sqrt(value.shape[-1]) * noise
        elif key == "cond_v":
            value = value + 0.05 * noise
        elif key == "cond_u":                             # zeros
            value = value + 0.3 * noise
        elif name.startswith("engrams_") and key == "embedding":
            value = value * 10.0 * (1 + 0.2 * noise)      # engram path O(1) rather than O(1e-3)
        elif name.startswith("engrams_") and name.endswith("value_proj/kernel"):
            value = value * 5.0 * (1 + 0.2 * noise)
        else:                                             # random matrices, stem kernels, embedding
            value = value * _GAIN.get(name, 1.0) * _stem_gain(name, value) * (1 + 0.2 * noise)
        out[name] = value.astype(np.float32)
    return out


def quantise_params(params: dict) -> dict:
    """Guide §1: CQ4 for embedding/embedding and mhc_phi*, CQ2 for every other quant leaf, with the
    reduction axis moved last for kernels and lane maps. Float32 in, float32 (dequantised) out."""
    def quantise(path, leaf):
        if not _is_quant_leaf(path, leaf):
            return leaf
        name = leaf_name(path)
        bits = 4 if name == "embedding/embedding" or "mhc_phi" in name else 2
        if _reduces_second_last(path):
            return jnp.swapaxes(cq_quantize(jnp.swapaxes(leaf, -1, -2), bits), -1, -2)
        return cq_quantize(leaf, bits)

    tree = jax.tree_util.tree_map_with_path(quantise, jax.tree.map(jnp.asarray, params))
    return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)


# ---------------------------------------------------------------------------------------------
# Export at the shipped widths (guide §2)


def shipped_bits(name: str) -> int:
    """The CQ width whistle.cact stores a matrix record at: 4 for the embedding and the six
    mhc_phi lane maps, 2 for every other matrix (guide §2)."""
    return 4 if name == "embedding" or "mhc_phi" in name else 2


def _cq_pack_any_width(w: np.ndarray, bits: int, group: int):
    """export._cq_pack without its 4-bit-only guard: rotate each group of `group` inputs by the
    normalised Walsh-Hadamard matrix, split it into an L2 norm (stored FP16) and a unit vector,
    and store the nearest codebook level of each unit coordinate, LSB-first packed."""
    rows, cols = w.shape
    padded = np.pad(w, ((0, 0), (0, -cols % group)))
    rotated = padded.reshape(rows, -1, group) @ _cq_hadamard_np(group)         # (rows, groups, group)
    norm = np.sqrt((rotated ** 2).sum(-1, keepdims=True))
    levels = _export._nearest_idx(rotated / np.maximum(norm, 1e-12), _cq_codebook_np(bits, group))
    return _export._pack_lsb(levels.reshape(rows, -1), bits), norm[..., 0].astype(np.float16)


@contextlib.contextmanager
def _shipped_widths():
    original_pack, original_q = _export._cq_pack, _export._q

    def q(name, mat, bits, group):
        return original_q(name, mat, shipped_bits(name), group)

    _export._cq_pack, _export._q = _cq_pack_any_width, q
    try:
        yield
    finally:
        _export._cq_pack, _export._q = original_pack, original_q


def write_cact(params: dict, cfg: WhistleConfig, path: Path, tokenizer: bytes) -> dict:
    """Pack float32 master params into a .cact at the shipped widths; returns write_export's info."""
    with _shipped_widths():
        return _export.write_export(_unflatten(params), cfg.needle(), str(path), tokenizer=tokenizer, audio=cfg)


# ---------------------------------------------------------------------------------------------
# Models


@dataclass(eq=False)
class RefModel:
    """A built reference model. `params`/`qparams` are nested dicts of float32 numpy arrays."""
    shape: str
    seed: int
    cfg: WhistleConfig
    params: dict
    qparams: dict
    path: Path
    tokenizer_model: Path
    sp: spm.SentencePieceProcessor = field(repr=False)
    depth: int | None = None          # decoder ladder depth, None for the full stack

    @property
    def key(self) -> str:
        return _model_key(self.shape, self.seed, self.depth)

    @property
    def first_tag(self) -> int:
        return self.cfg.text

    def language_id(self, code: str) -> int:
        if code not in self.cfg.languages:
            raise ValueError(f"language {code!r} is not one of this model's {self.cfg.languages}")
        return self.cfg.tag(code)


def _model_key(shape, seed, depth=None):
    return f"{shape}-s{seed}" + (f"-d{depth}" if depth else "") + f"-{VERSION}"


def _load_entry(folder: Path, shape, seed, cfg, depth, tok) -> RefModel:
    def load(name):
        with np.load(folder / name) as data:
            return _unflatten({k: data[k] for k in data.files})

    params = load("params.npz")
    if not (folder / "qparams.npz").exists():          # an entry from before qparams were cached
        _save_npz(folder / "qparams.npz", _flatten(quantise_params(params)))
    return RefModel(shape=shape, seed=seed, cfg=cfg, params=params, qparams=load("qparams.npz"),
                    path=folder / "model.cact", tokenizer_model=tok,
                    sp=spm.SentencePieceProcessor(model_file=str(tok)), depth=depth)


def _save_npz(path: Path, flat: dict) -> None:
    def write(tmp):
        with open(tmp, "wb") as handle:
            np.savez(handle, **flat)
    _atomic_write(path, write)


def _store_entry(folder: Path, flat: dict, cfg: WhistleConfig, tok: Path) -> None:
    """Write a cache entry; params.npz goes last and marks the entry complete."""
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / "model.cact",
                  lambda tmp: write_cact(flat, cfg, Path(tmp), tokenizer_blob(tok, cfg.languages)))
    _atomic_write(folder / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(
        {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, indent=1)))
    _save_npz(folder / "qparams.npz", _flatten(quantise_params(_unflatten(flat))))
    _save_npz(folder / "params.npz", flat)


_MODELS: dict[str, RefModel] = {}


def build_model(shape: str, seed: int = 0) -> RefModel:
    """The perturbed reference model of a named shape (see SHAPES), built once and cached on disk.

    First build of "full" takes about a minute and a half (JAX init compile + CQ packing)."""
    cfg = shape_config(shape)
    key = _model_key(shape, seed)
    if key in _MODELS:
        return _MODELS[key]
    tok = tokenizer_path()
    folder = CACHE / "models" / key
    with _locked(key):
        if not (folder / "params.npz").exists():
            _store_entry(folder, _perturb(_init_params(cfg, seed), seed), cfg, tok)
        model = _load_entry(folder, shape, seed, cfg, None, tok)
    _MODELS[key] = model
    return model


def ladder(model: RefModel, depth: int) -> RefModel:
    """The model with its decoder cut to the ladder rung of `depth` layers (guide §6: the
    endpoint-preserving bisection order, engram sites kept only where their layer survives), its
    own quantised params and .cact. The encoder is untouched."""
    if model.depth is not None:
        raise ValueError("ladder() takes a full-depth model")
    if not 2 <= depth < model.cfg.dec_layers:
        raise ValueError(f"depth must be in [2, {model.cfg.dec_layers - 1}], got {depth}")
    key = _model_key(model.shape, model.seed, depth)
    if key in _MODELS:
        return _MODELS[key]
    needle_cfg = model.cfg.needle()
    cfg = replace(model.cfg, dec_layers=depth, sites=tuple(ladder_config(needle_cfg, depth).engram_layers))
    folder = CACHE / "models" / key
    with _locked(key):
        if not (folder / "params.npz").exists():
            sliced = ladder_slice(jax.tree.map(jnp.asarray, model.params), needle_cfg, depth)
            _store_entry(folder, _flatten(sliced), cfg, model.tokenizer_model)
        rung = _load_entry(folder, model.shape, model.seed, cfg, depth, model.tokenizer_model)
    _MODELS[key] = rung
    return rung


def config_of_cact(path) -> WhistleConfig:
    """The float32 WhistleConfig a .cact was exported from, read from its header (our Dims)."""
    from whistle_stream.container import CactFile

    d = CactFile(path).dims
    return WhistleConfig(
        text=d.text_vocab, languages=tuple(d.languages), dim=d.width, kv_heads=d.kv_heads, qk_dim=d.qk_dim,
        v_dim=d.v_dim, enc_layers=d.enc_layers, dec_layers=d.dec_layers, conv_kernel=d.conv_kernel,
        taps=d.taps, lanes=d.lanes, enc_lanes=d.enc_lanes, sites=tuple(d.engram_sites),
        orders=tuple(d.engram_orders), slots=d.engram_slots, hashes=d.engram_hashes, stem=d.stem,
        stem_stages=d.stem_stages, rope=d.rope_theta, mels=d.mels, rate=d.rate, fft=d.fft, win=d.win,
        hop=d.hop, max_tokens=d.max_tokens, pad=d.pad, eos=d.eos, bos=d.bos, dtype="float32", remat=False)


def from_cact(path, shape: str = "file") -> RefModel:
    """A reference model whose parameters are exactly what a .cact stores: every CQ record
    dequantised by needle's own `read_export`, every FP16 record as its float16 values.

    export's `_tensors` lays every parameter leaf out into records by reshapes, transposes and
    stacking only; running it over leaves filled with their own element indices (with `_q` and
    `_fp16` swapped for pass-throughs) gives, per record, which leaf element each value came
    from, and so the inverse. `params` and `qparams` are the same tree (already quantised)."""
    cfg = config_of_cact(path)
    template = _init_params(cfg, 0)
    names = sorted(template)
    sizes = [template[n].size for n in names]
    starts = np.cumsum([0, *sizes])
    indexed = _unflatten({n: np.arange(starts[i], starts[i + 1], dtype=np.float64).reshape(template[n].shape)
                          for i, n in enumerate(names)})
    saved = _export._q, _export._fp16
    _export._q = lambda name, mat, bits, group: (name, np.asarray(mat))
    _export._fp16 = lambda name, arr: (name, np.asarray(arr))
    try:
        layout = [t for t in _export._tensors(indexed, cfg.needle(), 2, 128, audio=cfg) if isinstance(t, tuple)]
    finally:
        _export._q, _export._fp16 = saved
    from whistle_stream.container import CactFile

    _, values = _export.read_export(str(path))  # positional, in record order
    tensors = dict(zip((r.name for r in CactFile(path).records), values))
    flat = np.full(int(starts[-1]), np.nan, np.float32)
    for name, where in layout:
        value = np.asarray(tensors[name], np.float32).reshape(-1)
        index = np.asarray(where).reshape(-1)
        if value.size < index.size:
            raise ValueError(f"record {name} holds {value.size} values, the layout wants {index.size}")
        flat[index.astype(np.int64)] = value[:index.size]
    missing = [n for i, n in enumerate(names) if np.isnan(flat[starts[i]:starts[i + 1]]).any()]
    if missing:
        raise ValueError(f"{path}: no record holds {missing}")
    params = _unflatten({n: flat[starts[i]:starts[i + 1]].reshape(template[n].shape) for i, n in enumerate(names)})
    return RefModel(shape=shape, seed=0, cfg=cfg, params=params, qparams=params, path=Path(path),
                    tokenizer_model=Path(path), sp=None)


# ---------------------------------------------------------------------------------------------
# Audio front of the reference


def reference_sanitize(pcm) -> np.ndarray:
    """Guide §3 step 1: NaN, infinite and |x| >= 65536 samples read as zero. float32 out."""
    pcm = np.asarray(pcm, np.float32)
    if pcm.ndim != 1:
        raise ValueError(f"pcm must be a 1-D array of samples at 16 kHz, got shape {pcm.shape}")
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(pcm) | (np.abs(pcm) >= 65536.0)
    return np.where(bad, np.float32(0.0), pcm)


def reference_level(pcm) -> np.ndarray:
    """Guide §1/§3 step 2, the level gain the reference leaves out: the RMS of 320-sample blocks,
    sorted, the one at floor(0.99 * (blocks - 1)); above 1e-6 the clip is scaled by 0.1 / it.
    The gain and product are computed in float64 and rounded to float32 once. A clip shorter than
    one block (no RMS to select) is left as it is."""
    pcm = np.asarray(pcm, np.float32)
    blocks = len(pcm) // 320
    if blocks == 0:
        return pcm.copy()
    rms = np.sqrt((pcm[:blocks * 320].reshape(blocks, 320).astype(np.float64) ** 2).mean(1))
    loud = np.sort(rms)[int(0.99 * (blocks - 1))]
    return (pcm * (0.1 / loud)).astype(np.float32) if loud > 1e-6 else pcm.copy()


def encoder_frames(samples: int, cfg: WhistleConfig | None = None) -> int:
    """Encoder frames for a clip of `samples` samples: samples // hop feature frames, halved
    (rounding up) once per stem stage."""
    cfg = cfg or WhistleConfig()
    frames = samples // cfg.hop
    for _ in range(cfg.stem_stages):
        frames = (frames + 1) // 2
    return frames


# The decoder's memory is zero-padded to a multiple of this many frames (masked by the frame
# count; changes logits by ~1e-6), so one compile serves every clip length in a bucket.
MEMORY_BUCKET = 64


# ---------------------------------------------------------------------------------------------
# Quantised reference runs


def _deploy():
    # Guide §1: int8 activations and int8 KV. A no-op after the first call.
    configure_deploy(act_bits=8, kv_bits=8)


_ENCODE: dict = {}
_LOGITS: dict = {}
_ENCODED: OrderedDict = OrderedDict()


def _encode_fn(cfg):
    if cfg not in _ENCODE:
        module = Whistle(cfg)
        _ENCODE[cfg] = jax.jit(lambda p, wav, lengths: module.apply(
            {"params": p}, wav, lengths, True, method=Whistle.encode))
    return _ENCODE[cfg]


def _logits_fn(cfg):
    if cfg not in _LOGITS:
        module = Whistle(cfg)
        _LOGITS[cfg] = jax.jit(lambda p, tokens, enc, frames: module.apply(
            {"params": p}, tokens, enc, frames, True, method=Whistle.logits))
    return _LOGITS[cfg]


def _encode_padded(model: RefModel, pcm, pad_to: int | None = None):
    """(enc (1, F_bucket, dim) jax array zero-padded to MEMORY_BUCKET frames, frames int) of the
    sanitised, levelled clip; cached for the last 16 clips.

    The encoder runs on the clip at its own length unless pad_to (samples) is given. It is not
    bucketed: with int8 activations a padded run is not bit-identical (lengths mask the padding,
    but ulp-level changes in reductions flip int8 roundings: up to ~2e-2 absolute, per-frame
    cosine >= 0.99998 on tiny), and the oracle should be exactly Whistle.encode on the clip."""
    pcm = reference_level(reference_sanitize(pcm))
    if len(pcm) == 0:
        raise ValueError("pcm is empty; the encoder needs at least one sample")
    size = pad_to or len(pcm)
    if size < len(pcm):
        raise ValueError(f"pad_to={size} is shorter than the clip ({len(pcm)} samples)")
    key = (model.key, size, hashlib.sha1(pcm.tobytes()).hexdigest())
    if key in _ENCODED:
        _ENCODED.move_to_end(key)
        return _ENCODED[key]
    _deploy()
    wav = np.zeros((1, size), np.float32)
    wav[0, :len(pcm)] = pcm
    enc, frames = _encode_fn(model.cfg)(model.qparams, jnp.asarray(wav), jnp.array([len(pcm)], jnp.int32))
    frames = int(frames[0])
    memory = np.zeros((1, -(-max(frames, 1) // MEMORY_BUCKET) * MEMORY_BUCKET, model.cfg.dim), np.float32)
    memory[0, :frames] = np.asarray(enc[0, :frames])
    result = (jnp.asarray(memory), frames)
    _ENCODED[key] = result
    while len(_ENCODED) > 16:
        _ENCODED.popitem(last=False)
    return result


def ref_embed(model: RefModel, pcm, pad_to: int | None = None) -> np.ndarray:
    """Quantised reference encoder output, (frames, dim) float32, for pcm at 16 kHz in [-1, 1].

    Applies guide §3 step 1 (bad samples -> 0) and the level gain, then Whistle.encode with
    quant=True (guide §1) on the clip at its own length (or zero-padded to pad_to samples)."""
    enc, frames = _encode_padded(model, pcm, pad_to)
    return np.array(enc[0, :frames], np.float32)


def _check_tokens(model: RefModel, tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or len(tokens) == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty 1-D integer sequence, got {tokens!r}")
    if tokens.min() < 0 or tokens.max() >= model.cfg.vocab:
        raise ValueError(f"token ids must be in [0, {model.cfg.vocab}), got {tokens.min()}..{tokens.max()}")
    if len(tokens) > model.cfg.max_tokens:
        raise ValueError(f"at most max_tokens={model.cfg.max_tokens} tokens, got {len(tokens)}")
    return tokens.astype(np.int32)


def _run_logits(model: RefModel, enc, frames: int, rows: list[list[int]]) -> np.ndarray:
    """Logits (len(rows), max_tokens, vocab) of the quantised decoder over each row.

    Every call runs the same shape: rows padded with pad ids to max_tokens positions, the batch to
    5 rows. The decoder is causal and each row's positions are computed independently, so a
    position's logits are bit-identical whatever follows it or shares its batch; one fixed shape
    keeps ref_logits, ref_greedy and ref_beam exactly consistent (changing the width moves
    logits by int8 rounding flips) and costs one compile per clip-length bucket."""
    _deploy()
    width = model.cfg.max_tokens
    if max(len(r) for r in rows) > width:
        raise ValueError(f"a decoder row holds at most max_tokens={width} tokens")
    batch = max(len(rows), BEAMS)
    tokens = np.full((batch, width), model.cfg.pad, np.int32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    logits = _logits_fn(model.cfg)(model.qparams, jnp.asarray(tokens),
                                   jnp.broadcast_to(enc, (batch, *enc.shape[1:])),
                                   jnp.full((batch,), frames, jnp.int32))
    return np.asarray(logits[:len(rows)], np.float32)


def _batch_logits(model: RefModel, enc, frames: int, rows: list[list[int]], positions: list[int]) -> np.ndarray:
    """Logits (len(rows), vocab) at positions[i] of rows[i]."""
    logits = _run_logits(model, enc, frames, rows)
    return np.stack([logits[i, p] for i, p in enumerate(positions)])


def ref_logits(model: RefModel, pcm, tokens) -> np.ndarray:
    """Teacher-forced logits (len(tokens), vocab) float32 of the quantised reference: row i is the
    next-token distribution after tokens[:i+1]. tokens is the full decoder input, <s> first."""
    tokens = _check_tokens(model, tokens)
    enc, frames = _encode_padded(model, pcm)
    return _run_logits(model, enc, frames, [tokens.tolist()])[0, :len(tokens)]


def ref_margins(model: RefModel, pcm, tokens) -> np.ndarray:
    """Top-1 minus top-2 logit of the quantised reference at each position of tokens, over the
    ids that position chooses from (tags at position 0, text ids after), float32 (len(tokens),).

    A parity test of transcripts can use it to excuse a disagreement at a near tie: the engine
    and the reference differ by int8 rounding flips, so a margin of the order of the measured
    engine-vs-reference logit error can go either way."""
    logits = ref_logits(model, pcm, tokens)
    cfg = model.cfg
    out = np.empty(len(logits), np.float32)
    for i, row in enumerate(logits):
        pool = row[cfg.text:cfg.vocab] if i == 0 else row[:cfg.text]
        top = np.sort(pool)[-2:] if len(pool) > 1 else np.array([-np.inf, pool[0]])
        out[i] = top[1] - top[0]
    return out


def _prompt(model: RefModel, enc, frames: int, language: str | None) -> tuple[str, list[int]]:
    """Guide §6 prompt: feed <s>; the language is forced or the argmax over the tag ids."""
    cfg = model.cfg
    if language is not None:
        return language, [cfg.bos, model.language_id(language)]
    first = _batch_logits(model, enc, frames, [[cfg.bos]], [0])[0]
    tag = int(np.argmax(first[cfg.text:cfg.vocab]))
    return cfg.languages[tag], [cfg.bos, cfg.text + tag]


def _draft(generated: list[int], previous: list[int], size: int) -> list[int]:
    """A guess at the next `size` ids: the tail's period (1..8) continued when the ids end in two
    copies of it (random test models loop a lot), else the previous pass's predictions, padded
    with the last id."""
    for unit in range(1, LOOP_UNIT + 1):
        if len(generated) >= 2 * unit and generated[-unit:] == generated[-2 * unit:-unit]:
            return (generated[-unit:] * (size // unit + 1))[:size]
    filler = generated[-1] if generated else 0
    return (previous + [filler] * size)[:size]


def ref_greedy(model: RefModel, pcm, language: str | None = None, max_new: int | None = None):
    """Greedy decode of the quantised reference (guide §6 prompt, then argmax over text ids).

    Returns (language code, generated text ids without the final </s>). Stops at </s>, when the
    sequence (prompt included) reaches max_tokens - 1 tokens (the cap `ref_beam` uses), or after
    `max_new` generated tokens when given.

    Exact greedy, computed speculatively: each pass feeds the accepted ids plus a draft of the
    rest (`_draft`) and accepts predictions while the draft agrees, so a looping transcript takes
    a few passes instead of one per token. Causality makes every accepted id the argmax given
    exactly the ids before it."""
    cfg = model.cfg
    if language is not None:
        model.language_id(language)
    enc, frames = _encode_padded(model, pcm)
    language, seq = _prompt(model, enc, frames, language)
    limit = cfg.max_tokens - 1 - len(seq)
    if max_new is not None:
        limit = min(limit, max_new)
    generated: list[int] = []
    draft: list[int] = []
    while len(generated) < limit:
        room = limit - len(generated)
        draft = _draft(generated, draft, room - 1)        # the last prediction needs no draft
        logits = _run_logits(model, enc, frames, [seq + generated + draft])[0]
        start = len(seq) + len(generated) - 1
        predictions = np.argmax(logits[start:start + len(draft) + 1, :cfg.text], -1).tolist()
        for j, token in enumerate(predictions):
            if token == cfg.eos:
                return language, generated
            generated.append(token)
            if j >= len(draft) or draft[j] != token:
                break
        draft = predictions[j + 1:]
    return language, generated


# ---------------------------------------------------------------------------------------------
# Beam search oracle (guide §6)



def find_loop(ids: list[int]) -> int:
    """Length of the shortest unit (1..8 tokens) that ids end with 4 copies of, or 0."""
    for unit in range(1, LOOP_UNIT + 1):
        span = unit * LOOP_REPEATS
        if len(ids) >= span and all(ids[-span + k] == ids[-unit + k % unit] for k in range(span)):
            return unit
    return 0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def beam_search(next_logits, text_vocab: int, eos: int, max_generated: int, beams: int = BEAMS,
                trace: list | None = None) -> tuple[list[int], float]:
    """Guide §6's beam search, independent of any model: returns (winning ids, winning score).

    next_logits(prefixes) takes a list of generated-id lists (one per live beam, the prompt left
    out) and returns their next-token logits, (len(prefixes), >= text_vocab) floats; only the first
    text_vocab columns (ids below the first language tag) are used.

    Exact rules (the engine's search.py must match these):
    * Start: one live beam, no ids, log-prob 0.
    * Each step, every live beam proposes its 6 best text ids (</s> among them) by log-prob under
      log_softmax over the text ids only (float64); a proposal scores running log-prob + token
      log-prob. Ties within a beam: lower id first.
    * All proposals are sorted by score, descending (stable: on equal scores the earlier live beam,
      then the better-ranked token first), and walked in order until `beams` beams are live. A
      proposal finishes instead of taking a beam if, checked in this order:
        1. the token is </s>;
        2. the ids, token included, end in a loop (find_loop: the shortest unit of 1..8 tokens
           repeated 4 times); the transcript is cut back to one copy of the unit;
        3. it holds max_generated ids (the cap; see ref_beam for how it follows from max_tokens).
      A finished proposal scores (its log-prob) / (its token count), where the log-prob is the sum
      over every generated token and the count is the number of generated text tokens INCLUDING
      the finishing </s> (for a loop: counted before the cut, i.e. every token whose log-prob is in
      the sum). Every finishing proposal met during the walk is kept, even past the 5th.
    * After the walk, stop if at least `beams` transcripts have finished or no beam is live.
    * The winner is the best finished score; ties go to the one that finished first.
    The returned ids exclude </s>. `trace`, when a list, receives one dict per step: the live
    beams after it, every transcript finished so far, the sorted proposals as (score, generated
    ids with the proposed token) and how many of them the walk took (`walked`).
    """
    if not 1 <= beams <= 16:
        raise ValueError(f"beams must be in [1, 16], got {beams}")
    if max_generated < 1:
        raise ValueError(f"max_generated must be at least 1, got {max_generated}")
    live: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[float, list[int]]] = []
    while live and len(finished) < beams:
        logits = np.asarray(next_logits([ids for ids, _ in live]))
        logp = _log_softmax(logits[:, :text_vocab])
        proposals = []
        for b, (_, score) in enumerate(live):
            best = np.argsort(-logp[b], kind="stable")[:PROPOSALS]
            proposals += [(score + float(logp[b, t]), b, int(t)) for t in best]
        proposals.sort(key=lambda p: -p[0])            # stable: beam order, then rank, on ties
        survivors: list[tuple[list[int], float]] = []
        walked = 0
        for score, b, token in proposals:
            if len(survivors) == beams:
                break
            walked += 1
            ids = live[b][0] + [token]
            if token == eos:
                finished.append((score / len(ids), ids[:-1]))
            elif unit := find_loop(ids):
                finished.append((score / len(ids), ids[:len(ids) - (LOOP_REPEATS - 1) * unit]))
            elif len(ids) >= max_generated:
                finished.append((score / len(ids), ids))
            else:
                survivors.append((ids, score))
        prev, live = live, survivors
        if trace is not None:
            trace.append({"live": [(list(i), s) for i, s in live], "finished": list(finished),
                          "proposals": [(s, tuple(prev[b][0]) + (t,)) for s, b, t in proposals],
                          "walked": walked})
    best = max(range(len(finished)), key=lambda i: (finished[i][0], -i))
    return finished[best][1], finished[best][0]


def ref_beam(model: RefModel, pcm, language: str | None = None, beams: int = BEAMS, trace: list | None = None,
             pad_to: int | None = None):
    """Guide §6's beam search over the quantised reference (rules: `beam_search`).

    Returns (language code, ids of the winning transcript without </s>, a loop cut to one copy).
    The prompt is [<s>, tag] (tag forced or detected as in ref_greedy). The cap: a transcript
    finishes when the sequence, prompt included, reaches max_tokens - 1 tokens (319 for the
    shipped 320), i.e. after max_tokens - 3 generated ids. Each step recomputes every live
    beam's full prefix (slow, obviously correct). pad_to: see ref_embed (one encoder compile per
    padded length instead of one per clip length)."""
    cfg = model.cfg
    if language is not None:
        model.language_id(language)
    enc, frames = _encode_padded(model, pcm, pad_to)
    language, prompt = _prompt(model, enc, frames, language)

    def next_logits(prefixes):
        return _batch_logits(model, enc, frames, [prompt + ids for ids in prefixes],
                             [len(prompt) + len(ids) - 1 for ids in prefixes])

    ids, _ = beam_search(next_logits, cfg.text, cfg.eos, cfg.max_tokens - 1 - len(prompt), beams, trace)
    return language, ids


# ---------------------------------------------------------------------------------------------
# Sanity of a built model


def activation_stats(model: RefModel, pcm) -> dict:
    """Numbers that say whether the perturbed network is numerically sane on a clip: the encoder
    output's RMS and finiteness, and the teacher-forced logits' spread and softmax entropy over a
    short greedy prefix."""
    enc = ref_embed(model, pcm)
    language, ids = ref_greedy(model, pcm, max_new=16)
    tokens = [model.cfg.bos, model.language_id(language), *ids]
    logits = ref_logits(model, pcm, tokens)
    text = _log_softmax(logits[:, :model.cfg.text])
    entropy = -(np.exp(text) * text).sum(-1)
    return {
        "enc_finite": bool(np.isfinite(enc).all()),
        "enc_rms": float(np.sqrt((enc.astype(np.float64) ** 2).mean())),
        "logits_finite": bool(np.isfinite(logits).all()),
        "logits_std": float(logits[:, :model.cfg.text].std(-1).mean()),
        "entropy_min": float(entropy.min()),
        "entropy_max": float(entropy.max()),
        "entropy_uniform": float(np.log(model.cfg.text)),
        "tokens": tokens,
    }
