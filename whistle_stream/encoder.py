"""Stem and encoder stack: log-mel features -> (frames, width) float32, one row per 80 ms.

Guide §3 (stem), §6 (encoder block) and needle `whistle.Stem` / `EncoderBlock` / `LaneStack`.
Only valid frames are computed: the reference's padded frames are masked out of every path
that reaches a valid frame (stem masks, attention key mask, the conv module's `valid`), so
running exactly the valid frames with zero padding gives the same numbers.
"""

from __future__ import annotations

import numpy as np

from . import blocks as B
from . import frontend
from . import kernels as K
from .kernels.encoder import _conv_time, _stem_conv_in, _stem_depthwise



STEM_BLOCK_FRAMES = 64  # encoder frames (80 ms each) the stem makes at a time (bounds its activations)


def halve(n: int) -> int:
    """A stride-2 stage with padding 1 and kernel 3: n -> ceil(n / 2)."""
    return (n + 1) // 2


# ---------------------------------------------------------------- stem


class Stem:
    """§3 stem: conv 3x3/2 + SiLU, then (depthwise 3x3/2, pointwise, SiLU) per later stage,
    channel-major flatten, int8 fake-quant, projection to the width. No biases."""

    def __init__(self, cact):
        d = cact.dims
        self.stages = d.stem_stages
        self.w = np.ascontiguousarray(cact.array("stem.w"), np.float32)  # (9, C)
        self.dw = [np.ascontiguousarray(cact.array(f"stem.dw_{i}"), np.float32) for i in range(1, self.stages)]
        self.pw = [B.CQLinear.from_cact(cact, f"stem.pw_{i}") for i in range(1, self.stages)]
        self.out = B.CQLinear.from_cact(cact, "stem.out", integer=True)
        self.channels = self.w.shape[1]

    def __call__(self, feats: np.ndarray) -> np.ndarray:
        """feats (T, mels) float32 -> (frames, width) with frames = T halved `stages` times.

        Every stage is row-local in time (a stride-2 conv reads three input rows per output row;
        the pointwise maps, SiLU and the int8 fake-quant are per row), so the output is made
        STEM_BLOCK_FRAMES frames at a time from the feature rows they read: the first stage's
        activation of 30 s (T/2 x mels/2 x channels) is never held whole, and the blocks of a
        long clip run on the worker threads at once.
        """
        feats = np.ascontiguousarray(feats, np.float32)
        sizes = [feats.shape[0]]
        for _ in range(self.stages):
            sizes.append(halve(sizes[-1]))
        out = np.empty((sizes[-1], self.out.shape[0]), np.float32)
        starts = range(0, sizes[-1], STEM_BLOCK_FRAMES)

        def blocks(i: int, j: int) -> None:
            for a in starts[i:j]:
                b = min(sizes[-1], a + STEM_BLOCK_FRAMES)
                out[a:b] = self._block(feats, sizes, a, b)

        B.run_split(blocks, len(starts))  # the blocks are independent: over the worker threads
        return out

    def _block(self, feats: np.ndarray, sizes: list[int], a: int, b: int) -> np.ndarray:
        """Output frames [a, b). Stage k's rows [lo, hi) read stage k-1's rows [2lo-1, 2hi-1],
        zero outside; a slice from row 2lo-2 (even) gives outputs lo-1 .. hi-1 with the slice's
        own zero above its first row, so output lo-1 (wrong unless lo is 0) is dropped."""
        need = [(a, b)]
        for k in range(self.stages, 0, -1):
            lo, hi = need[0]
            need.insert(0, (max(0, 2 * lo - 2), min(sizes[k - 1], 2 * hi)))
        c = self.channels
        lo, hi = need[0]
        x = feats[lo:hi]
        for k in range(1, self.stages + 1):
            first = lo // 2                        # the global row of this slice's first output
            y = np.empty((halve(x.shape[0]), halve(x.shape[1]), c), np.float32)
            if k == 1:
                _stem_conv_in(x, self.w, y)
                B.silu_inplace(y)
            else:
                _stem_depthwise(x, self.dw[k - 2], y)
                rows = y.shape[0] * y.shape[1]
                y = self.pw[k - 2](y.reshape(rows, c))
                B.silu_inplace(y)
                y = y.reshape(-1, halve(x.shape[1]), c)
            lo, hi = need[k]
            x = y[lo - first:hi - first]
        frames = x.shape[0]
        flat = np.ascontiguousarray(x.transpose(0, 2, 1)).reshape(frames, -1)  # channel-major: index c * mel_bands + f
        return self.out.quantised(flat)


# ---------------------------------------------------------------- encoder block


class EncoderBlock:
    """One macaron block (§6):
    x = x + 0.5 * mlp0(pre_hada_norm_0(x))
    x = x + sigmoid(attn_gate) * post_attn_norm(attention(ZCRMSNorm_0(x)))
    x = x + pw2(int8(silu(conv_out_norm(depthwise(glu(pw1(int8(conv_norm(x)))))))))
    x = x + 0.5 * mlp(pre_hada_norm(x))
    """

    def __init__(self, cact, layer: int):
        d = cact.dims
        p = f"encoder{layer:02d}."
        self.width, self.heads, self.kv_heads = d.width, d.heads, d.kv_heads
        self.qk_dim, self.v_dim = d.qk_dim, d.v_dim
        norm = {k: cact.array(p + k) for k in ("pre_hada_norm_0", "ZCRMSNorm_0", "post_attn_norm",
                                               "conv_norm", "conv_out_norm", "pre_hada_norm")}
        self.norm = norm
        self.q_norm, self.k_norm = cact.array(p + "q_norm"), cact.array(p + "k_norm")
        self.attn_gate = np.float32(1.0 / (1.0 + np.exp(-np.float64(cact.array(p + "attn_gate")[0]))))
        # Q, K, V and the attention gate all read the same int8 input: one product.
        proj = [p + n for n in ("q_proj", "k_proj", "v_proj", "gate_proj")]
        self.splits = np.cumsum([cact.record(n).shape[0] for n in proj])[:-1]
        self.qkvg = B.CQLinear.from_cact(cact, *proj, integer=True)
        self.out_proj = B.CQLinear.from_cact(cact, p + "out_proj", integer=True)
        self.pw1 = B.CQLinear.from_cact(cact, p + "pw1", integer=True)
        self.pw2 = B.CQLinear.from_cact(cact, p + "pw2", integer=True)
        self.dw = np.ascontiguousarray(cact.array(p + "dw"), np.float32)  # (conv_kernel, width)
        self.mlp0 = B.HadamardMLP.from_cact(cact, p + "hadamard_mlp_0", d.width)
        self.mlp = B.HadamardMLP.from_cact(cact, p + "hadamard_mlp", d.width)
        # x + 0.5 * mlp(norm(x)), each as one fused kernel
        self.half_mlp0 = self.mlp0.record(norm["pre_hada_norm_0"], 0.5)
        self.half_mlp = self.mlp.record(norm["pre_hada_norm"], 0.5)

    def attention(self, h: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        t = h.shape[0]
        q, k, v, g = np.split(self.qkvg.quantised(h), self.splits, axis=1)
        q = B.zc_rmsnorm(q.reshape(t, self.heads, self.qk_dim), self.q_norm)
        k = B.zc_rmsnorm(k.reshape(t, self.kv_heads, self.qk_dim), self.k_norm)
        v = B.fake_quant_int8(v.reshape(t, self.kv_heads, self.v_dim))
        # per-head int8 queries (maybe_quant_query) and keys (the int8 KV), bidirectional over the clip
        o = B.attend_int8(B.apply_rope(q, cos, sin), B.apply_rope(k, cos, sin), v)  # (T, heads * v_dim)
        B.sigmoid_inplace(g)
        o *= g
        return self.out_proj.quantised(o)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        n = self.norm
        x = B.HadamardMLP.residual(x, self.half_mlp0)
        h = self.attention(B.zc_rmsnorm(x, n["ZCRMSNorm_0"]), cos, sin)
        x = x + self.attn_gate * B.zc_rmsnorm(h, n["post_attn_norm"])
        h = self.pw1.quantised(B.zc_rmsnorm(x, n["conv_norm"]))  # (T, 2 * width)
        g = h[:, self.width:]
        B.sigmoid_inplace(g)
        g *= h[:, :self.width]  # GLU: first half times sigmoid of the second
        c = np.empty((x.shape[0], self.width), np.float32)
        g = np.ascontiguousarray(g)
        B.split_rows(lambda a, b: _conv_time(g, self.dw, a, b, c), len(c), g.size * len(self.dw))
        c = B.zc_rmsnorm(c, n["conv_out_norm"])
        B.silu_inplace(c)
        x = x + self.pw2.quantised(c)
        return B.HadamardMLP.residual(x, self.half_mlp)


# ---------------------------------------------------------------- encoder


class Encoder:
    """Stem + encoder stack of a .cact model. Weights are read once and shared read-only."""

    def __init__(self, cact):
        d = cact.dims
        K.set_blas_threads()
        self.dims = d
        self.mel = np.ascontiguousarray(cact.mel, np.float32)
        self.stem = Stem(cact)
        self.blocks = [EncoderBlock(cact, i) for i in range(d.enc_layers)]
        self.lanes = B.LaneMixer(cact, "encoder.", d.enc_layers, d.enc_lanes, d.width)

    def frames_for(self, samples: int) -> int:
        """Encoder frames for a clip of `samples` samples at 16 kHz."""
        n = samples // self.dims.hop
        for _ in range(self.dims.stem_stages):
            n = halve(n)
        return n

    def features(self, pcm: np.ndarray) -> np.ndarray:
        """§3 front end of float32 16 kHz samples: (samples // hop, mels), by frames over the
        worker threads for a long clip."""
        d = self.dims
        size = len(pcm) // d.hop * d.win  # the windowed samples the FFTs read
        return frontend.features(pcm, self.mel, d.hop, d.win, lambda fn, n: B.split_rows(fn, n, size))

    def encode(self, feats: np.ndarray) -> np.ndarray:
        """Normalised log-mel features (T, mels) -> encoder output (frames, width) float32."""
        d = self.dims
        feats = np.asarray(feats, np.float32)
        if feats.ndim != 2 or feats.shape[1] != d.mels:
            raise ValueError(f"features must be (frames, {d.mels}) float32, got shape {feats.shape}")
        if feats.shape[0] == 0:
            return np.zeros((0, d.width), np.float32)
        x = self.stem(feats)
        cos, sin = B.rope_tables(d.qk_dim, np.arange(x.shape[0]), d.rope_theta)
        stream = self.lanes.expand(x)
        for i, block in enumerate(self.blocks):
            stream = self.lanes.step(i, stream, lambda u, b=block: b(u, cos, sin))
        return self.lanes.collapse(stream)

    def embed(self, audio, rate: int | None = None) -> np.ndarray:
        """Audio (see frontend.load_audio) -> (frames, width) float32, one row per 80 ms.
        An empty or sub-frame clip gives a (0, width) array."""
        pcm = frontend.load_audio(audio, rate)
        return self.encode(self.features(pcm))


def embed(cact, audio, rate: int | None = None) -> np.ndarray:
    """One-shot helper: build the encoder of `cact` and embed `audio` (see Encoder.embed)."""
    return Encoder(cact).embed(audio, rate)
