"""Train the bundled demo Whistle from scratch on synthetic speech and pack it as a .cact.

    python tools/train_demo_model.py --seed 0 --out whistle_stream/models/demo.cact

regenerates the data (tools/demo_data.py) under --data, trains a sentencepiece BPE tokenizer on the
training transcripts, trains a small `needle.model.whistle.Whistle` with quantisation-aware training
at the exported widths (guide §1/§2: CQ4 for `embedding` and the `mhc_phi*` lane maps, CQ2 for every
other matrix, int8 activations and KV cache), writes the .cact atomically every --export-every steps,
and finally scores greedy decoding on the quantised weights on the held-out test split (WER, whisper
English normalisation). Uses the JAX reference; never imported by the runtime package.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import demo_data  # noqa: E402
from whistle_stream.models import CARD_SENTENCES_PER_PASS  # noqa: E402

LANGUAGE = "en"
# Each batch is padded to the smallest of these lengths (seconds) that holds its longest clip, with that
# length's batch size (about the same audio per step), and its token rows to one width per length:
# each distinct shape costs an XLA compile of ~1-5 min on a shared 2-vCPU machine.
BUCKETS = ((3.0, 16), (4.5, 16), (6.5, 16), (10.0, 10), (15.0, 6), (30.0, 3))
TOKEN_ROUND = 8
DECODE_TOKENS = 64  # greedy decoding stops here; the longest transcript is under 40 tokens


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


# ---------------------------------------------------------------------------------------------
# Data and tokenizer

def load_split(manifest: str) -> list[dict]:
    rows = [json.loads(line) for line in open(manifest)]
    for row in rows:
        row["pcm"] = (demo_data.read_wav16k(row["audio"]) * 32768).astype(np.int16)
    return rows


def train_tokenizer(texts: list[str], vocab: int, seed: int):
    """A sentencepiece BPE model proto trained on texts (ids: pad 0, eos 1, bos 2, unk 3)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sorted(set(texts))), model_writer=model, model_type="bpe",
        vocab_size=vocab, byte_fallback=True, character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2,
        unk_id=3, normalization_rule_name="identity", num_threads=1,
        shuffle_input_sentence=False, minloglevel=2)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    return proto


class Batches:
    """Length-bucketed batches: each padded to the smallest of BUCKETS that holds its longest clip.

    Every epoch shuffles the clips within each bucket, cuts them into that bucket's batch size (a
    short remainder waits for the next epoch: one shape per bucket) and shuffles the batches.
    With fixed_width (the first stage, single sentences only): the clips sorted
    by length in fixed groups of 16, each epoch the groups shuffled, every token row fixed_width wide.
    """

    def __init__(self, rows, ids, rng, fixed_width: int | None = None, perturb: float = 0.0,
                 with_spans: bool = False):
        self.rows, self.ids, self.rng, self.fixed_width, self.perturb = rows, ids, rng, fixed_width, perturb
        self.with_spans = with_spans  # also yield alignment_spans (train with --align)
        order = np.argsort([len(r["pcm"]) for r in rows], kind="stable")
        self.fixed = [order[i:i + 16] for i in range(0, len(order), 16)]
        self.members: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            self.members.setdefault(bucket(len(row["pcm"])), []).append(i)
        self.widths = {b: token_width([ids[i] for i in m]) for b, m in self.members.items()}
        self.sizes = {int(sec * demo_data.RATE): size for sec, size in BUCKETS}

    def count(self) -> int:
        if self.fixed_width:
            return len(self.fixed)
        return sum(len(m) // self.sizes.get(b, 1) for b, m in self.members.items())

    def epoch(self):
        if self.fixed_width:
            for g in self.rng.permutation(len(self.fixed)):
                idx = self.fixed[g]
                yield self._batch(self.perturbed(idx), idx, None, self.fixed_width)
            return
        groups = []
        for b, members in sorted(self.members.items()):
            size = self.sizes.get(b, 1)
            order = self.rng.permutation(members)
            groups += [(b, order[i:i + size]) for i in range(0, len(order) - size + 1, size)]
        for g in self.rng.permutation(len(groups)):
            b, idx = groups[g]
            yield self._batch(self.perturbed(idx, b), idx, b, self.widths[b])

    def _batch(self, rows, idx, samples, width):
        ids = [self.ids[i] for i in idx]
        wav, lengths, tokens = arrays(rows, ids, samples, width)
        if not self.with_spans:
            return wav, lengths, tokens
        return wav, lengths, tokens, alignment_spans(rows, tokens.shape[1], wav.shape[1])

    def perturbed(self, idx, samples: int | None = None) -> list[dict]:
        """The rows idx, each (with --perturb P) played at a random speed in [1 - P, 1 + P]: tempo,
        pitch and formants move together, as if another speaker said it (Ko et al. 2015, "Audio
        augmentation for speech recognition"). A clip is never slowed past `samples` (its batch's
        padded length), so nothing is cut off."""
        rows = [self.rows[i] for i in idx]
        if not self.perturb:
            return rows
        import soxr

        out = []
        for row in rows:
            speed = self.rng.uniform(1.0 - self.perturb, 1.0 + self.perturb)
            if samples:
                speed = max(speed, len(row["pcm"]) / samples)
            pcm = soxr.resample(row["pcm"].astype(np.float32), demo_data.RATE * speed, demo_data.RATE)
            if samples:
                pcm = pcm[:samples]
            moved = {"pcm": np.clip(np.round(pcm), -32768, 32767).astype(np.int16)}
            if "words" in row:  # a sample at t is now at t / speed
                moved["words"] = [[int(round(a / speed)), int(round(b / speed))] for a, b in row["words"]]
            out.append({**row, **moved})
        return out


def bucket(samples: int) -> int:
    """The padded length (samples) for a batch whose longest clip has `samples` samples."""
    for seconds, _ in BUCKETS:
        if samples <= seconds * demo_data.RATE:
            return int(seconds * demo_data.RATE)
    return -(-samples // demo_data.RATE) * demo_data.RATE


def token_width(ids) -> int:
    """The token row width for these decoder sequences: the longest, rounded up to TOKEN_ROUND."""
    return -(-max(len(t) for t in ids) // TOKEN_ROUND) * TOKEN_ROUND


def masked_cross_entropy(logits, tokens, pad: int, smoothing: float = 0.0):
    """The decoder's cross entropy on tokens[:, 1:] from logits of tokens[:, :-1], pad rows left out;
    with smoothing > 0, against targets with that share of their mass spread evenly over the vocabulary
    (label smoothing)."""
    import jax
    import jax.numpy as jnp
    import optax

    targets = tokens[:, 1:]
    mask = targets != pad
    if smoothing:
        labels = optax.smooth_labels(jax.nn.one_hot(targets, logits.shape[-1]), smoothing)
        ce = optax.softmax_cross_entropy(logits, labels)
    else:
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def spec_keep(f0, fw, t0, tw, frames: int, mels: int):
    """(B, frames, mels) float32 SpecAugment keep mask (Park et al. 2019, without time warping): 0 on
    mel channels [f0, f0 + fw) and frames [t0, t0 + tw) of each clip, 1 elsewhere. f0, fw: (B, F)
    int; t0, tw: (B, T) int. A masked cell of the normalised log-mel features reads as 0, the clip's
    mean."""
    import jax.numpy as jnp

    m, n = jnp.arange(mels), jnp.arange(frames)
    band = ((m >= f0[..., None]) & (m < (f0 + fw)[..., None])).any(axis=1)  # (B, mels)
    span = ((n >= t0[..., None]) & (n < (t0 + tw)[..., None])).any(axis=1)  # (B, frames)
    return 1.0 - (band[:, None, :] | span[:, :, None]).astype(jnp.float32)


def spec_draws(key, frames, batch: int, mels: int, spec: tuple[int, int, int, int]):
    """(f0, fw, t0, tw) for spec_keep: per clip, spec = (F, W, T, S): F bands of 0..W mel channels
    anywhere in `mels`, T spans of 0..S frames inside the clip's own `frames` (B,) feature frames."""
    import jax
    import jax.numpy as jnp

    n_bands, width, n_spans, span = spec
    k = jax.random.split(key, 4)
    fw = jax.random.randint(k[0], (batch, n_bands), 0, width + 1)
    f0 = (jax.random.uniform(k[1], (batch, n_bands)) * (mels - fw + 1)).astype(jnp.int32)
    tw = jnp.minimum(jax.random.randint(k[2], (batch, n_spans), 0, span + 1), frames[:, None])
    t0 = (jax.random.uniform(k[3], (batch, n_spans)) * (frames[:, None] - tw + 1)).astype(jnp.int32)
    return f0, fw, t0, tw


WARP_KNEE = 0.8  # mel_warp: the share of the mel axis scaled by alpha; the rest bends to keep the top


def mel_sources(alpha, mels: int):
    """(B, mels) float32 source positions of a vocal-tract-length warp on the mel axis (after VTLP,
    Jaitly & Hinton 2013, on mel channels instead of linear frequency): channel m reads channel
    m * alpha below the knee, then a straight line to the top channel, which stays in place. alpha
    (B,): above 1 a channel reads a higher one, so formants move down as a longer vocal tract's
    would; below 1 they move up; 1 leaves the features alone."""
    import jax.numpy as jnp

    top = float(mels - 1)
    m = jnp.arange(mels, dtype=jnp.float32)[None, :]
    a = alpha[:, None].astype(jnp.float32)
    knee = WARP_KNEE * top * jnp.minimum(1.0, 1.0 / a)  # below it m * alpha stays inside the axis
    above = knee * a + (m - knee) * (top - knee * a) / (top - knee)
    return jnp.where(m <= knee, m * a, above)


def mel_warp(x, alpha):
    """x (B, frames, mels) features read at `mel_sources` by linear interpolation between channels."""
    import jax.numpy as jnp

    mels = x.shape[2]
    src = jnp.clip(mel_sources(alpha, mels), 0.0, mels - 1.0)
    lo = jnp.floor(src).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, mels - 1)
    frac = (src - lo)[:, None, :]
    take = lambda idx: jnp.take_along_axis(x, jnp.broadcast_to(idx[:, None, :], x.shape), axis=2)
    return take(lo) * (1.0 - frac) + take(hi) * frac


def augmented_encode(model, params, wav, lengths, key, spec, warp: float = 0.0):
    """model.apply(..., method=Whistle.encode) on quantised params with SpecAugment (spec_draws'
    `spec`, None: off) and a mel warp (`mel_warp`, alpha uniform in [1 - warp, 1 + warp] per clip;
    0: off) on the log-mel features. Whistle.encode reads the reference module's `features` when it
    is traced, so the augmented features stand in for that trace only; validation and scoring trace
    the plain one."""
    import jax

    from needle.model import whistle as reference

    if spec is None and not warp:
        return model.apply({"params": params}, wav, lengths, True, method=reference.Whistle.encode)
    plain = reference.features
    spec_key, warp_key = jax.random.split(key)

    def masked(c, w, n):
        x, frames = plain(c, w, n)  # (B, frames, mels)
        if warp:
            x = mel_warp(x, jax.random.uniform(warp_key, (x.shape[0],), minval=1.0 - warp, maxval=1.0 + warp))
        if spec is None:
            return x, frames
        draws = spec_draws(spec_key, frames, x.shape[0], x.shape[2], spec)
        return x * spec_keep(*draws, x.shape[1], x.shape[2]), frames

    reference.features = masked
    try:
        return model.apply({"params": params}, wav, lengths, True, method=reference.Whistle.encode)
    finally:
        reference.features = plain


def parse_spec_augment(text: str) -> tuple[int, int, int, int] | None:
    """'F,W,T,S' -> (F, W, T, S) non-negative ints ('' or '0,0,0,0': None, off)."""
    if not text:
        return None
    try:
        spec = tuple(int(v) for v in text.split(","))
    except ValueError:
        spec = ()
    if len(spec) != 4 or min(spec) < 0:
        raise ValueError(f"--spec-augment takes four non-negative integers F,W,T,S (F bands of up to W mel "
                         f"channels, T spans of up to S frames), got {text!r}")
    bands, spans = spec[0] > 0 and spec[1] > 0, spec[2] > 0 and spec[3] > 0
    return spec if bands or spans else None


def arrays(rows, ids, samples=None, width=None):
    """(wav float32 (B, S), lengths int32 (B,), tokens int32 (B, T)) padded with zeros / pad id."""
    samples = samples or bucket(max(len(r["pcm"]) for r in rows))
    width = width or token_width(ids)
    wav = np.zeros((len(rows), samples), np.float32)
    lengths = np.zeros(len(rows), np.int32)
    tokens = np.zeros((len(rows), width), np.int32)
    for k, (row, t) in enumerate(zip(rows, ids)):
        pcm = row["pcm"][:samples].astype(np.float32) / 32768
        wav[k, :len(pcm)], lengths[k], tokens[k, :len(t)] = pcm, len(pcm), t
    return wav, lengths, tokens


FRAME_SAMPLES = 1280  # one encoder frame: 80 ms at 16 kHz


def token_words(sp, text: str) -> list[int] | None:
    """The whitespace word of `text` that each of its pieces belongs to (a piece that begins with
    sentencepiece's space marker starts the next word), or None where that does not give one piece
    run per word."""
    owner, word = [], -1
    for i in sp.encode(text):
        if word < 0 or sp.id_to_piece(i).startswith("\u2581"):
            word += 1
        owner.append(word)
    return owner if word + 1 == len(text.split()) else None


def alignment_spans(rows, width: int, samples: int) -> np.ndarray:
    """(B, width - 1, 2) int32: for decoder row p (the query that predicts token p + 1 of
    [<s>, tag, text..., </s>]), the encoder frames [first, last + 1) of the word that token p + 1
    belongs to, from the row's "words" (sample spans) and "token_words"; (0, 0) where unknown. Rows
    without word spans (everything but spliced clips) get none."""
    out = np.zeros((len(rows), width - 1, 2), np.int32)
    frames = -(-samples // FRAME_SAMPLES)
    for k, row in enumerate(rows):
        words, owner = row.get("words"), row.get("token_words")
        if not words or owner is None or len(owner) + 2 > width:
            continue
        for j, w in enumerate(owner):  # token 2 + j, predicted by row 1 + j
            a, b = words[w]
            first, end = min(a // FRAME_SAMPLES, frames), min(-(-b // FRAME_SAMPLES), frames)
            if end > first:
                out[k, 1 + j] = first, end
    return out


def alignment_loss(weights, spans, lengths):
    """Mean over the rows with a span, the upper half of the decoder's layers and every head of
    -log(the attention mass on the span's frames): what teaches cross-attention to follow the words,
    as §8's word times read it.

    weights: (layers, B, heads, rows, frames) cross-attention probabilities; spans: (B, rows, 2)
    frame ranges from alignment_spans; lengths: (B,) encoder frames (a span is clipped to them)."""
    import jax.numpy as jnp

    upper = weights[weights.shape[0] // 2:]
    t = jnp.arange(weights.shape[-1])
    end = jnp.minimum(spans[..., 1], lengths[:, None])
    inside = (t >= spans[..., :1]) & (t < end[..., None])  # (B, rows, frames)
    valid = (end > spans[..., 0]).astype(jnp.float32)  # (B, rows)
    mass = (upper * inside[None, :, None].astype(upper.dtype)).sum(-1)  # (L', B, H, rows)
    nll = -jnp.log(mass + 1e-6) * valid[None, :, None]
    return nll.sum() / jnp.maximum(valid.sum() * upper.shape[0] * upper.shape[2], 1.0)


def sow_cross_attention() -> None:
    """Make the reference's cross-attention record its probabilities in the "intermediates"
    collection ((layers, B, heads, rows, frames), stacked by the decoder's layer scan), for
    --align. Needs the config's flash=False, whose path computes the probabilities."""
    import math

    import flax.linen as linen
    import jax
    import jax.numpy as jnp
    from flax.linen import module as flax_module
    import needle.model.whistle as whistle

    if getattr(whistle, "_demo_sown", False):
        return

    def cross_attend(q, k, v, mem_mask):  # the reference's non-flash cross-attention, recorded
        s = jnp.einsum("bshd,bthd->bhst", q.astype(jnp.float32), k.astype(jnp.float32)) / math.sqrt(q.shape[-1])
        s = jnp.where(mem_mask[:, None, None, :], s, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, -1)
        flax_module._context.module_stack[-1].sow("intermediates", "cross_weights", p)
        return jnp.einsum("bhst,bthd->bshd", p, v.astype(jnp.float32)).astype(v.dtype)

    class Linen:  # flax.linen, with the layer scans also stacking "intermediates"
        def __getattr__(self, name):
            return getattr(linen, name)

        @staticmethod
        def scan(target, variable_axes, **options):
            return linen.scan(target, variable_axes={**variable_axes, "intermediates": 0}, **options)

    whistle._cross_attend, whistle.nn, whistle._demo_sown = cross_attend, Linen(), True


def cross_weights(state):
    """The decoder's recorded cross-attention probabilities from apply(..., mutable=["intermediates"])."""
    return state["intermediates"]["stack"]["layers"]["block"]["cross_attn"]["cross_weights"][0]


def whistle_config(text: int, dim: int = 128, enc_layers: int = 3, dec_layers: int = 2, flash: bool = True):
    """The demo Whistle's WhistleConfig: `text` tokenizer pieces, the given width and depths, the
    rest fixed (one KV head, 4 lanes, an engram site on the last decoder layer, 2048 slots)."""
    from needle.model.whistle import WhistleConfig

    return WhistleConfig(text=text, languages=(LANGUAGE,), dim=dim, kv_heads=1, qk_dim=32, v_dim=64,
                         enc_layers=enc_layers, dec_layers=dec_layers, lanes=4, enc_lanes=4,
                         sites=(dec_layers - 1,), orders=(2, 3), slots=2048, stem=64, remat=False, flash=flash)


def transcript_ids(cfg, sp, rows) -> list[list[int]]:
    """Each row's decoder sequence: <s>, the language tag, its text's pieces, </s>."""
    return [[cfg.bos, cfg.tag(LANGUAGE), *sp.encode(r["text"]), cfg.eos] for r in rows]


def ctc_fits(text, frames, pad: int):
    """(B,) bool: whether each row's labels (text, pad-filled) have a CTC path through its `frames`
    encoder frames: one frame per label and a blank between two equal labels. A clip too short for
    its transcript (a fast 8-word scrambled clip played 1.2x faster) has none; optax scores it about
    1e5, and that one clip swamps its batch's loss."""
    import jax.numpy as jnp

    labels = text != pad
    need = labels.sum(1) + (labels[:, 1:] & (text[:, 1:] == text[:, :-1])).sum(1)
    return jnp.asarray(frames) >= need


def audible_stem(params, seed: int):
    """params with the stem's kernels redrawn at a variance-preserving scale (He: std sqrt(2 / fan_in)).

    The reference initialises every kernel at std 0.02. Through the stem's three conv stages that
    shrinks the log-mel input ~1e6-fold, below the encoder's RMS-norm epsilon (1e-6), so a model
    trained from scratch never hears the audio and learns only the grammar (measured: equal loss
    with the clips shuffled across the batch after 600 steps). A pretrained checkpoint never meets this.
    """
    rng = np.random.default_rng(seed)
    stem = dict(params["stem"])
    for name, leaf in stem.items():
        if isinstance(leaf, dict):  # Dense: {"kernel": (in, out)}
            shape = leaf["kernel"].shape
            stem[name] = {"kernel": rng.normal(0.0, np.sqrt(2.0 / shape[0]), shape).astype(np.float32)}
        else:  # depthwise conv (3, 3, 1, channels): fan-in 9
            stem[name] = rng.normal(0.0, np.sqrt(2.0 / 9.0), leaf.shape).astype(np.float32)
    return {**params, "stem": stem}


# ---------------------------------------------------------------------------------------------
# Quantisation at the exported widths (guide §1, §2)

def export_bits(name: str, cq2: bool) -> int:
    """Bits a matrix is stored at: CQ4 for the embedding and mhc_phi lane maps, CQ2 (or 4) otherwise."""
    if name in ("embedding", "embedding/embedding") or "mhc_phi" in name:
        return 4
    return 2 if cq2 else 4


def quantise(params, cq2: bool, straight_through: bool):
    """Every quantised leaf replaced by its CQ reconstruction (with an STE gradient if asked)."""
    import jax
    import jax.numpy as jnp
    from needle.model.quantize import (CQ_GROUP_SIZE, _is_quant_leaf, _reduces_second_last, cq_quantize,
                                       cq_ste, leaf_name)

    def one(path, leaf):
        if not _is_quant_leaf(path, leaf):
            return leaf
        bits = export_bits(leaf_name(path), cq2)
        fn = (lambda w: cq_ste(w, bits, CQ_GROUP_SIZE)) if straight_through else (lambda w: cq_quantize(w, bits))
        if _reduces_second_last(path):
            return jnp.swapaxes(fn(jnp.swapaxes(leaf, -1, -2)), -1, -2)
        return fn(leaf)

    return jax.tree_util.tree_map_with_path(one, params)


def average_params(trees, weights=None):
    """The weighted mean (equal weights by default) of same-shaped param trees: checkpoint averaging.

    Averaging the weights of nearby points of one run (or of a run and its fine-tuned second stage)
    lands nearer the middle of a flat minimum than any one of them, and often decodes better.
    """
    import jax

    weights = np.full(len(trees), 1.0 / len(trees)) if weights is None else np.asarray(weights, np.float64)
    if len(weights) != len(trees) or abs(weights.sum() - 1.0) > 1e-6:
        raise ValueError(f"need one weight per tree, summing to 1; got {list(weights)} for {len(trees)} trees")
    shapes = [jax.tree.map(np.shape, t) for t in trees]
    for i, other in enumerate(shapes[1:], 1):
        if other != shapes[0]:
            raise ValueError(f"param tree {i + 1} is not shaped like the first (another model shape or "
                             "architecture): only checkpoints of one run's shape can be averaged")
    return jax.tree.map(lambda *leaves: sum(w * np.asarray(a, np.float64) for w, a in zip(weights, leaves))
                        .astype(np.asarray(leaves[0]).dtype), *trees)


def load_start(template, paths: list[str]):
    """(params, CTC head or None, step) a run starts from: one checkpoint's, or the equal-weight
    mean of several checkpoints' params and heads (a weight soup; the step is the last one's).
    template: a params tree of the run's shape, which the saved bytes are read into."""
    from flax import serialization

    trees, heads, step = [], [], 0
    for path in paths:
        with np.load(path, allow_pickle=False) as saved:
            trees.append(serialization.from_bytes(template, saved["params"].tobytes()))
            if "head" in saved:
                heads.append(np.asarray(saved["head"]))
            step = int(saved["step"]) if "step" in saved else 0
    params = average_params(trees) if len(trees) > 1 else trees[0]
    return params, (np.mean(heads, axis=0) if heads else None), step


def params_array(params) -> np.ndarray:
    """A params tree as the uint8 array a checkpoint .npz stores under 'params' (flax msgpack)."""
    from flax import serialization

    return np.frombuffer(serialization.to_bytes(params), np.uint8)


def write_cact(params, cfg, path: str, blob: bytes, cq2: bool) -> dict:
    """Pack params at the shipped widths, atomically (temp file, then os.replace).

    export.py's packer refuses bits other than 4; like guide §2 we swap in a packer without that
    guard and a `_q` that picks the width by record name, then restore both.
    """
    from needle.model import export
    from needle.model.quantize import _cq_codebook_np, _cq_hadamard_np

    def pack(w, bits, group):
        rows, cols = w.shape
        g = np.pad(w, ((0, 0), (0, -cols % group))).reshape(rows, -1, group) @ _cq_hadamard_np(group)
        norm = np.sqrt((g ** 2).sum(-1, keepdims=True))
        idx = export._nearest_idx(g / np.maximum(norm, 1e-12), _cq_codebook_np(bits, group))
        return export._pack_lsb(idx.reshape(rows, -1), bits), norm[..., 0].astype(np.float16)

    original_pack, original_q = export._cq_pack, export._q
    export._cq_pack = pack
    export._q = lambda name, mat, bits, group: original_q(name, mat, export_bits(name, cq2), group)
    try:
        tmp = path + ".tmp"
        info = export.write_export(params, cfg.needle(), tmp, tokenizer=blob, audio=cfg)
        os.replace(tmp, path)
    finally:
        export._cq_pack, export._q = original_pack, original_q
    return {**info, "path": path}


def params_from_cact(template, cfg, path: str):
    """The params a .cact was packed from, as far as it holds them (CQ matrices dequantised, fp16
    vectors widened): a second stage can start from a shipped model whose checkpoint is gone.

    The packer only rearranges each leaf (transposes and reshapes) before quantising it, so the
    rearrangement is read off by packing `template` with every element replaced by its own index;
    the records of `path`, in the file's order, are then scattered back to those indices. A leaf
    the file does not hold keeps `template`'s values; the record count and every shape must match.
    """
    import jax
    from needle.model import export

    leaves, treedef = jax.tree_util.tree_flatten(jax.device_get(template))
    sizes = [int(np.prod(np.shape(a))) for a in leaves]
    starts = np.cumsum([0] + sizes)
    tagged = jax.tree_util.tree_unflatten(
        treedef, [np.arange(a, a + n, dtype=np.float64).reshape(np.shape(leaf))
                  for a, n, leaf in zip(starts, sizes, leaves)])
    marks = []  # per record in file order: the element indices it holds, or None (not a param)

    def mark(name, arr, *_):
        marks.append(np.asarray(arr, np.float64))
        return name

    original_q, original_fp16, original_tensor = export._q, export._fp16, export._Tensor
    export._q = export._fp16 = mark
    export._Tensor = lambda *a, **k: marks.append(None)
    try:
        export._tensors(tagged, cfg.needle(), 4, 128, audio=cfg)
    finally:
        export._q, export._fp16, export._Tensor = original_q, original_fp16, original_tensor
    from needle.model.quantize import _cq_codebook_np, _cq_hadamard_np

    def unpack(packed, norms, out, in_dim, bits, group):
        """A CQ record as the weights that pack back to it: CQ stores each group's norm and the
        nearest codebook level of each coordinate of its unit vector; a group of levels is not a
        unit vector, so the group is that direction at the stored norm (export's unpack, scaled)."""
        in_pad = -(-in_dim // group) * group
        unit = _cq_codebook_np(bits, group)[export._unpack_lsb(packed, bits, in_pad)].reshape(out, -1, group)
        unit = unit / np.maximum(np.sqrt((unit ** 2).sum(-1, keepdims=True)), 1e-12)
        w = (unit * norms.reshape(out, -1, 1).astype(np.float32)) @ _cq_hadamard_np(group)
        return w.reshape(out, in_pad)[:, :in_dim]

    original_unpack, export._cq_unpack = export._cq_unpack, unpack
    try:
        _, records = export.read_export(path)
    finally:
        export._cq_unpack = original_unpack
    records = [r for r in records if not isinstance(r, (bytes, bytearray))]  # the tokenizer blob
    if len(records) != len(marks):
        raise ValueError(f"{path} holds {len(records)} tensors where a model of this shape has {len(marks)}: "
                         "the .cact was packed for another shape")
    flat = np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in leaves])
    seen = np.zeros(len(flat), bool)
    for i, (ids, values) in enumerate(zip(marks, records)):
        if ids is None:
            continue
        if ids.shape != np.shape(values):
            raise ValueError(f"{path}: tensor {i} is shaped {np.shape(values)} where this model's is {ids.shape}")
        index = ids.astype(np.int64).ravel()
        flat[index] = np.ravel(values)
        seen[index] = True
    out = [flat[a:a + n].reshape(np.shape(leaf)).astype(np.asarray(leaf).dtype)
           for a, n, leaf in zip(starts, sizes, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out), int((~seen).sum())


def write_card(cact: str, vocabulary: list[str], cfg, note: str) -> None:
    digest = hashlib.sha256(open(cact, "rb").read()).hexdigest()
    card = {
        "name": "whistle-stream demo model",
        "description": ("A tiny Whistle trained from scratch on synthetic English speech (espeak-ng and "
                        "flite voices): voice commands, numbers, times, dates, short everyday sentences. "
                        "For tests and demos, not for real transcription. " + note),
        "vocabulary": vocabulary,
        "languages": list(cfg.languages),
        # trained on clips of one sentence (and a few 2-4 sentence ones): it reads one a pass best
        CARD_SENTENCES_PER_PASS: 1,
        "shape": {"dim": cfg.dim, "enc_layers": cfg.enc_layers, "dec_layers": cfg.dec_layers,
                  "text_vocab": cfg.text, "v_dim": cfg.v_dim, "qk_dim": cfg.qk_dim, "kv_heads": cfg.kv_heads},
        "sha256": digest,
    }
    path = os.path.splitext(cact)[0] + ".json"
    with open(path + ".tmp", "w") as f:
        json.dump(card, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def keep_export(cact: str, step: int, vocabulary: list[str], cfg, note: str) -> str:
    """A copy of the export `cact` as CACT-stepS.cact with its own card (`--keep-exports`): the
    export itself is overwritten by the next one. Returns the copy's path."""
    kept = f"{os.path.splitext(cact)[0]}-step{step}.cact"
    shutil.copyfile(cact, kept)
    write_card(kept, vocabulary, cfg, note)
    return kept


# ---------------------------------------------------------------------------------------------
# Greedy decoding on the quantised weights (like whistle_finetune._score_quantised)

def greedy_wer(model, qparams, cfg, sp, rows, batch=16):
    """(edits, reference words, hypotheses) of greedy decoding; whisper English normalisation."""
    import jax
    from needle.model.whistle import Whistle
    from needle.model.whistle_finetune import errors

    encode = jax.jit(lambda p, w, n: model.apply({"params": p}, w, n, True, method=Whistle.encode))
    step = jax.jit(lambda p, t, e, f: model.apply({"params": p}, t, e, f, True, method=Whistle.logits))
    tags = np.arange(cfg.vocab) >= cfg.text
    samples = bucket(max(len(r["pcm"]) for r in rows))
    edits = words = 0
    hyps = []
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        wav, lengths, _ = arrays(part, [[0]] * len(part), samples)
        enc, frames = encode(qparams, wav, lengths)
        tokens = np.full((len(part), DECODE_TOKENS), cfg.pad, np.int32)  # one width: one compile
        tokens[:, 0], tokens[:, 1] = cfg.bos, cfg.tag(LANGUAGE)
        done = np.zeros(len(part), bool)
        for pos in range(1, DECODE_TOKENS - 1):
            logits = np.array(step(qparams, tokens, enc, frames)[:, pos])
            logits[:, tags] = -np.inf
            pick = logits.argmax(-1)
            tokens[:, pos + 1] = np.where(done, cfg.pad, pick)
            done |= pick == cfg.eos
            if done.all():
                break
        for row, ids in zip(part, tokens.tolist()):
            ids = ids[2:]
            ids = ids[:ids.index(cfg.eos)] if cfg.eos in ids else ids
            text = sp.decode([i for i in ids if i != cfg.pad])
            e, n = errors(row["text"], text, LANGUAGE)
            edits, words = edits + e, words + n
            hyps.append(text)
    return edits, words, hyps


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="whistle_stream/models/demo.cact")
    ap.add_argument("--data", default="work-data/demo", help="generated audio and manifests (not committed)")
    ap.add_argument("--clips", type=int, default=6000, help="training clips to synthesise")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--vocab", type=int, default=512, help="sentencepiece pieces (incl. 256 byte pieces)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--enc-layers", type=int, default=3)
    ap.add_argument("--dec-layers", type=int, default=2)
    ap.add_argument("--bits", type=int, choices=(2, 4), default=2, help="width of the non-embedding matrices")
    ap.add_argument("--export-every", type=int, default=150)
    ap.add_argument("--keep-exports", action="store_true",
                    help="keep each export as OUT-stepS.cact with its card (OUT itself is overwritten by the next)")
    ap.add_argument("--test-clips", type=int, default=300)
    ap.add_argument("--score", type=int, default=0, help="score only the first N test clips (0: all)")
    ap.add_argument("--ctc", type=float, default=0.3,
                    help="weight of an auxiliary CTC loss on the encoder output (training only; 0: off)")
    ap.add_argument("--align", type=float, default=0.0,
                    help="weight of an alignment term: on clips whose word spans are known (--spliced), the "
                         "upper decoder layers' cross-attention for each token is asked to lie on its word's "
                         "frames, so that word times (guide §8) follow the words (training only; 0: off)")
    ap.add_argument("--mix", type=int, default=0,
                    help="extra training clips from demo_data.mixed_items: sentence prefixes, 2-4 sentences, 14-27 s")
    ap.add_argument("--prefix-share", type=float, default=0.30,
                    help="share of --mix clips that are sentence prefixes (0 leaves them out)")
    ap.add_argument("--spliced", type=int, default=0,
                    help="extra training clips from demo_data.spliced_items: sentences spoken one word at a time")
    ap.add_argument("--scrambled", type=int, default=0,
                    help="extra training clips from demo_data.scrambled_items: 3-8 vocabulary words in no "
                         "grammatical order, so the model listens to words rather than recalling sentences")
    ap.add_argument("--order-seed", type=int,
                    help="seed of the batch order, speed perturbation and SpecAugment masks (default: --seed, "
                         "which also draws the clips and the tokenizer): two fine-tunes of one start on one data")
    ap.add_argument("--paused", type=int, default=0,
                    help="extra training clips from demo_data.paused_items: sentences with 0.2-1.5 s pauses "
                         "inside, and sentence fragments and single words as their own clips")
    ap.add_argument("--window", type=int, default=0,
                    help="extra training clips from demo_data.window_items: 20-29 s of sentences shaped like a "
                         "long-audio window, half starting and 60 %% ending at a cut inside a sentence")
    ap.add_argument("--voices", choices=sorted(demo_data.VOICE_MIXES), default="core",
                    help="training voice mix (tools/demo_data.py VOICE_MIXES): core (runs up to 13), wide "
                         "(espeak-ng's named variants too, flite on a fifth of the clips) or core-flite (core "
                         "voices, flite on a fifth of the clips)")
    ap.add_argument("--perturb", type=float, default=0.0,
                    help="speed perturbation: each training clip, each epoch, at a speed in [1-P, 1+P] (0: off)")
    ap.add_argument("--tokenizer-clips", type=int, default=6000,
                    help="train the tokenizer on the first N training transcripts (a second stage with more "
                         "--clips keeps its first stage's tokenizer)")
    ap.add_argument("--init", nargs="+", metavar="CHECKPOINT",
                    help="checkpoint .npz whose params and CTC head start the run (fresh optimiser and schedule: a "
                         "second stage); several: their equal-weight mean starts it (a weight soup)")
    ap.add_argument("--init-cact", help="a packed .cact (e.g. the shipped model) whose weights, dequantised, start "
                                        "the run: a second stage when its checkpoint is gone (fresh CTC head, "
                                        "optimiser and schedule)")
    ap.add_argument("--resume", help="checkpoint .npz to continue from (same shape); with --steps equal to "
                                     "its step, only scores it")
    ap.add_argument("--label-smoothing", type=float, default=0.0,
                    help="label smoothing of the training cross entropy (validation reports it unsmoothed; 0: off)")
    ap.add_argument("--warp", type=float, default=0.0,
                    help="vocal-tract-length warp of the training clips' log-mel features: each clip, each "
                         "step, its mel axis scaled by alpha uniform in [1-W, 1+W] (mel_warp; validation and "
                         "scoring unwarped; 0: off)")
    ap.add_argument("--spec-augment", default="",
                    help="SpecAugment on the training clips' log-mel features, F,W,T,S: F bands of up to W mel "
                         "channels and T spans of up to S 10 ms frames set to the clip mean (e.g. 2,12,2,20; "
                         "validation and scoring unmasked; default: off)")
    ap.add_argument("--average", type=int, default=1,
                    help="the exported model is the mean of the params at the last N exports (checkpoint "
                         "averaging; each export's params are also kept as DATA/params-stepS.npz for "
                         "tools/average_checkpoints.py; 1: the last params alone)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.label_smoothing < 1.0:
        ap.error(f"--label-smoothing is a share from 0 to 1 (exclusive), got {args.label_smoothing}")
    packed_blob = None  # --init-cact's tokenizer, read before any clip is synthesised
    if args.init_cact:
        if args.init or args.resume:
            ap.error("--init-cact starts a run from a packed model; --init and --resume start it from a "
                     "checkpoint: give one of them")
        from needle.model.export import read_tokenizer_blob
        try:
            packed_blob = read_tokenizer_blob(args.init_cact)
        except (OSError, ValueError, struct.error) as e:
            ap.error(f"--init-cact {args.init_cact}: not a readable .cact with a tokenizer ({e})")
    if args.average < 1:
        ap.error(f"--average is a number of exports, at least 1, got {args.average}")
    if not 0.0 <= args.warp < 0.5:
        ap.error(f"--warp is a range from 0 to 0.5 (exclusive), got {args.warp}")
    if not 0.0 <= args.perturb < 0.5:
        ap.error(f"--perturb is a speed range from 0 to 0.5 (exclusive), got {args.perturb}")
    if args.align < 0:
        ap.error(f"--align is a non-negative weight, got {args.align}")
    try:
        spec = parse_spec_augment(args.spec_augment)
    except ValueError as e:
        ap.error(str(e))
    if not 0.0 <= args.prefix_share <= 1.0:
        ap.error(f"--prefix-share is a share from 0 to 1, got {args.prefix_share}")
    # the first export comes after --export-every steps: a missing folder must not fail it there
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.time()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import serialization
    from needle.model.export import whistle_tokenizer_blob
    from needle.model.quantize import configure_deploy
    from needle.model.whistle import Whistle
    import sentencepiece as spm

    jax.config.update("jax_compilation_cache_dir", os.path.join(args.data, "jax-cache"))
    cq2 = args.bits == 2

    log("data", args.data, "voices", args.voices)
    suffix = "" if args.voices == "core" else "-" + args.voices  # audio is cached by index: one folder per mix
    manifests = {
        "test": demo_data.write_split(demo_data.test_items(args.test_clips, args.seed), args.data, "test"),
        "validation": demo_data.write_split(demo_data.validation_items(seed=args.seed), args.data, "validation"),
        "train": demo_data.write_split(demo_data.train_items(args.clips, args.seed, args.voices), args.data,
                                       "train" + suffix),
    }
    if args.mix:
        name = "mixed" if args.prefix_share == 0.30 else f"mixed-prefix{args.prefix_share:g}"
        manifests["mixed"] = demo_data.write_split(
            demo_data.mixed_items(args.mix, args.seed, args.prefix_share, args.voices), args.data, name + suffix)
    if args.spliced:
        manifests["spliced"] = demo_data.write_split(demo_data.spliced_items(args.spliced, args.seed, args.voices),
                                                     args.data, "spliced" + suffix)
    if args.scrambled:
        manifests["scrambled"] = demo_data.write_split(
            demo_data.scrambled_items(args.scrambled, args.seed, args.voices), args.data, "scrambled" + suffix)
    if args.paused:
        manifests["paused"] = demo_data.write_split(demo_data.paused_items(args.paused, args.seed, args.voices),
                                                    args.data, "paused" + suffix)
    if args.window:
        manifests["window"] = demo_data.write_split(demo_data.window_items(args.window, args.seed, args.voices),
                                                    args.data, "window" + suffix)
    splits = {k: load_split(v) for k, v in manifests.items()}
    mixed = (splits.pop("mixed", []) + splits.pop("spliced", []) + splits.pop("scrambled", [])
             + splits.pop("window", []) + splits.pop("paused", []))
    minutes = sum(len(r["pcm"]) for r in splits["train"]) / demo_data.RATE / 60
    mixed_minutes = sum(len(r["pcm"]) for r in mixed) / demo_data.RATE / 60
    log(f"clips train {len(splits['train'])} ({minutes:.1f} min) + mixed {len(mixed)} ({mixed_minutes:.1f} min)  validation {len(splits['validation'])}"
        f"  test {len(splits['test'])}  ({time.time() - t0:.0f} s)")

    proto = train_tokenizer([r["text"] for r in splits["train"][:args.tokenizer_clips]], args.vocab, args.seed)
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    blob = whistle_tokenizer_blob(proto, (LANGUAGE,))
    cfg = whistle_config(len(proto.pieces), args.dim, args.enc_layers, args.dec_layers, flash=not args.align)
    if args.align:
        sow_cross_attention()
        for row in mixed:
            if "words" in row:
                row["token_words"] = token_words(sp, row["text"])
        timed = sum(row.get("token_words") is not None for row in mixed)
        log(f"alignment term {args.align} on {timed} clips with word spans")
        if not timed:
            raise SystemExit("--align needs clips with word spans: add --spliced N")
    ids = {k: transcript_ids(cfg, sp, rows) for k, rows in splits.items()}
    log(f"tokenizer {cfg.text} pieces + <|{LANGUAGE}|>; longest transcript {max(map(len, ids['train']))} tokens")

    configure_deploy(act_bits=8, kv_bits=8)
    model = Whistle(cfg)
    wav0, len0, tok0 = arrays(splits["train"][:2], ids["train"][:2])
    params = model.init(jax.random.PRNGKey(args.seed), wav0, len0, tok0[:, :-1])["params"]
    params = jax.tree.map(jnp.asarray, audible_stem(jax.device_get(params), args.seed))
    start_step, head = 0, None
    if args.resume or args.init:
        params, head, start_step = load_start(params, [args.resume] if args.resume else args.init)
        params, head = jax.tree.map(jnp.asarray, params), None if head is None else jnp.asarray(head)
        start_step = start_step if args.resume else 0
        if not args.resume and len(args.init) > 1:
            log(f"params: the mean of {', '.join(args.init)}")
    elif args.init_cact:
        if packed_blob != blob:
            raise SystemExit(f"{args.init_cact}: its tokenizer is not the one this run trains (another --seed, "
                             "--vocab, --tokenizer-clips or grammar): a second stage keeps its first stage's tokenizer")
        try:
            params, missing = params_from_cact(params, cfg, args.init_cact)
        except ValueError as e:
            raise SystemExit(str(e))
        params = jax.tree.map(jnp.asarray, params)
        log(f"params from {args.init_cact} ({missing} elements it does not hold keep their initial values); "
            "CTC head fresh")
    count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    log(f"model dim {cfg.dim} heads {cfg.heads} enc {cfg.enc_layers} dec {cfg.dec_layers} "
        f"sites {cfg.sites} slots {cfg.slots} stem {cfg.stem}: {count / 1e6:.2f} M params; "
        f"QAT CQ{args.bits} (CQ4 embedding, mhc_phi) + A8 + KV8; CTC weight {args.ctc}; "
        f"SpecAugment {'off' if spec is None else 'bands {} x <={}, spans {} x <={} frames'.format(*spec)}; "
        f"mel warp {f'alpha 1 +- {args.warp}' if args.warp else 'off'}")

    def attention_loss(p, enc, frames, tokens, spans=None, smoothing=0.0):
        """(the decoder's masked cross entropy, with spans plus args.align x the alignment term;
        the alignment term, 0 without spans)."""
        if spans is None:
            logits = model.apply({"params": p}, tokens[:, :-1], enc, frames, True, method=Whistle.logits)
        else:
            logits, state = model.apply({"params": p}, tokens[:, :-1], enc, frames, True,
                                        method=Whistle.logits, mutable=["intermediates"])
        loss = masked_cross_entropy(logits, tokens, cfg.pad, smoothing)
        if spans is None:
            return loss, jnp.float32(0.0)
        align = alignment_loss(cross_weights(state), spans, frames)
        return loss + args.align * align, align

    def encode(p, wav, lengths):
        return model.apply({"params": p}, wav, lengths, True, method=Whistle.encode)

    def ce_loss(p, wav, lengths, tokens):
        """The decoder's cross entropy (what validation reports): p are the model's params alone."""
        q = quantise(p, cq2, True)
        enc, frames = encode(q, wav, lengths)
        return attention_loss(q, enc, frames, tokens)[0]

    def loss_fn(pair, key, wav, lengths, tokens, spans=None):
        """Cross entropy + args.ctc x CTC of a linear head on the encoder output over the text pieces.

        The CTC head (blank = the pad id 0, never a target) is a training aid only, as in joint
        CTC-attention ASR: it makes the encoder align with the transcript from the first steps
        instead of waiting for cross-attention to find the audio. It is not exported.
        """
        p, head = pair
        q = quantise(p, cq2, True)
        enc, frames = augmented_encode(model, q, wav, lengths, key, spec, args.warp)
        loss, align = attention_loss(q, enc, frames, tokens, spans, args.label_smoothing)
        if args.ctc > 0:
            text = tokens[:, 2:]  # after <s> and the language tag; </s> and pad dropped below
            text = jnp.where(text == cfg.eos, cfg.pad, text)
            ctc = optax.ctc_loss(enc.astype(jnp.float32) @ head,
                                 (jnp.arange(enc.shape[1]) >= frames[:, None]).astype(jnp.float32),
                                 text, (text == cfg.pad).astype(jnp.float32), blank_id=cfg.pad)
            fits = ctc_fits(text, frames, cfg.pad)  # the others keep their cross entropy only
            n = jnp.maximum(((text != cfg.pad) * fits[:, None]).sum(), 1.0)
            loss = loss + args.ctc * jnp.where(fits, ctc, 0.0).sum() / n
        return loss, align

    warmup = max(1, args.steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, end_value=args.lr * 0.02)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    if head is None:  # the CTC head's (dim, text pieces) matrix
        head = jnp.asarray(np.random.default_rng(args.seed + 1).normal(
            0.0, cfg.dim ** -0.5, (cfg.dim, cfg.text)).astype(np.float32))
    params = (params, head)
    opt_state = optimizer.init(params)
    if args.resume:
        opt_state = serialization.from_bytes(opt_state, saved["opt"].tobytes())

    @jax.jit
    def train_step(p, state, key, wav, lengths, tokens, spans=None):
        (loss, align), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, key, wav, lengths, tokens, spans)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss, align

    eval_loss = jax.jit(ce_loss)

    width = token_width(ids["validation"])
    val_samples = bucket(max(len(r["pcm"]) for r in splits["validation"]))

    def validate(p, shuffle=False):  # the model's params; one shape for every batch: one compile
        rows, t = splits["validation"], ids["validation"]
        losses = []
        for i in range(0, len(rows), 20):
            wav, lengths, tokens = arrays(rows[i:i + 20], t[i:i + 20], val_samples, width)
            if shuffle:  # each transcript paired with another clip's audio: what the model gets from sound
                wav, lengths = np.roll(wav, 1, 0), np.roll(lengths, 1, 0)
            losses.append(float(eval_loss(p, wav, lengths, tokens)))
        return float(np.mean(losses))

    vocabulary = sorted(demo_data.grammar_vocabulary())
    ckpt = os.path.join(args.data, "checkpoint.npz")

    def checkpoint(p, state, step, note):
        np.savez(ckpt + ".tmp.npz", params=params_array(p[0]),
                 head=np.asarray(p[1]), opt=np.frombuffer(serialization.to_bytes(state), np.uint8), step=step)
        os.replace(ckpt + ".tmp.npz", ckpt)
        info = write_cact(jax.device_get(p[0]), cfg, args.out, blob, cq2)
        write_card(args.out, vocabulary, cfg, note)
        if args.keep_exports:
            keep_export(args.out, step, vocabulary, cfg, note)
        return info

    train_ids = ids["train"] + transcript_ids(cfg, sp, mixed)
    if max(map(len, train_ids)) > cfg.max_tokens:
        raise SystemExit(f"a training transcript has {max(map(len, train_ids))} tokens, over {cfg.max_tokens}")
    first_stage = token_width([t for k in ids for t in ids[k]])
    order = args.seed if args.order_seed is None else args.order_seed
    batches = Batches(splits["train"] + mixed, train_ids, np.random.default_rng(order),
                      fixed_width=None if mixed else first_stage, perturb=args.perturb,
                      with_spans=bool(args.align))
    step, recent, aligned, tick, snapshots = start_step, [], [], time.time(), []
    spec_key = jax.random.PRNGKey(order + 2)
    log(f"training {args.steps} steps, {batches.count()} batches/epoch (compiling...)")
    while step < args.steps:
        for batch in batches.epoch():
            key = jax.random.fold_in(spec_key, step)  # the SpecAugment masks of this step
            params, opt_state, loss, align = train_step(params, opt_state, key, *batch)
            step += 1
            recent.append(float(loss))
            if len(batch) > 3 and batch[3][..., 1].any():  # the alignment term of batches with spans
                aligned.append(float(align))
            if step % 25 == 0:
                extra = f" align {np.mean(aligned):.3f} ({len(aligned)} batches)" if aligned else ""
                log(f"step {step}/{args.steps} loss {np.mean(recent):.4f}{extra} lr {float(schedule(step)):.2e} "
                    f"{(time.time() - tick) / len(recent):.2f} s/step")
                recent, aligned, tick = [], [], time.time()
            if step % args.export_every == 0 or step == args.steps:
                val, deaf = validate(params[0]), validate(params[0], shuffle=True)
                note = f"Step {step}, validation loss {val:.3f}."
                info = checkpoint(params, opt_state, step, note)
                if args.average > 1:
                    snapshots.append((step, jax.device_get(params[0])))
                    del snapshots[:-args.average]
                    np.savez(os.path.join(args.data, f"params-step{step}.npz"), step=step, params=params_array(params[0]))
                log(f"step {step} val {val:.4f} (audio shuffled {deaf:.4f})  wrote {info['path']} "
                    f"({info['bytes'] / 1e6:.2f} MB)")
            if step >= args.steps:
                break

    params = params[0]
    if len(snapshots) > 1:
        params = average_params([tree for _, tree in snapshots])
        log(f"averaged the params of the last {len(snapshots)} exports (steps {', '.join(str(s) for s, _ in snapshots)})")
    qparams = quantise(params, cq2, False)
    scored = splits["test"][:args.score or None]
    edits, words, hyps = greedy_wer(model, qparams, cfg, sp, scored)
    wer = edits / max(words, 1)
    log(f"test WER {wer:.2%} ({edits}/{words} words, {len(hyps)} clips, greedy, CQ{args.bits} weights)")
    with open(os.path.join(args.data, "test_hypotheses.jsonl"), "w") as f:
        for row, hyp in zip(scored, hyps):
            f.write(json.dumps({"voice": row["voice"], "text": row["text"], "hyp": hyp}) + "\n")
    val = validate(params)
    write_cact(jax.device_get(params), cfg, args.out, blob, cq2)
    write_card(args.out, vocabulary, cfg, f"Step {step}, validation loss {val:.3f}, test WER {wer:.1%} "
                                          f"(greedy, quantised, {len(hyps)} held-out clips and voices).")
    log(f"validation loss {val:.4f}; wrote {args.out} and its card")
    log(f"done in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
