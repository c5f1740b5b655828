"""The Whistle text decoder: incremental, batched over beams (guide §6).

One decoder step takes the live beams together as rows: embedding x sqrt(width); engram at its
sites; per kept layer, inside the mHC lanes, causal self-attention (3 conv taps on Q, K and V,
per-head Q/K norms, RoPE, int8 Q and KV, grouped KV heads, gate), cross-attention over the clip's
memory (8 heads for Q, K and V alike, no RoPE, int8 Q/K/V, gate), Hadamard MLP; mean over lanes,
final norm, int8, and the tied embedding as the output head over every vocabulary id.

State, kept apart from the weights (`DecoderState`, one per clip):
- cross-attention K/V, projected and quantised once per clip per layer;
- a KV pool per layer indexed by (position, pool row), int8 codes with a scale per head vector
  (the reference's int8 KV, a quarter of float32's bytes), and a block table `anc` (beam, position)
  -> pool row. A new position of beam b is written to pool row b; reordering beams by `parents`
  copies only their rows of the small int32 table, never the cache itself;
- short histories per beam (the last taps-1 projected Q/K/V rows per layer, the engram's last
  taps x dilation value rows and its last order-1 tokens), gathered by `parents` on reorder.

Numerics follow the quantised reference (needle `Whistle.logits` with quant=True): activations
int8 where `_aq` is applied, int8 Q and KV per head, the flash attention path's scaling.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import blocks as B
from . import kernels as K
from .blocks import NORM_EPS, SINKHORN_ITERS
from .container import from_rotated
from .rules import BEAMS
from .kernels.simd import PACKED_BITS
from .kernels.decoder import (
    CrossAttention, LaneMaps, LayerStep, Memory, Rotated, SelfAttention, SelfCache, Shape,
    _block_step, _packed_rows, compiled_for, _engram_hash, _engram_site, _gather_packed, _lanes_final, _lanes_from,
    _levels_rows, _quant_codes, _quant_rotate, _reorder_rows,
)
from .kernels import integer as KI

ENGRAM_SEED = 0x9E3779B9  # needle `engram_indices`: per-table seeds seed * (table + 1)
ENGRAM_PRIME = 0x01000193  # FNV prime of the n-gram hash
ENGRAM_SHIFT = 15  # final xor-shift of the hash
# The memory's frames are padded to a multiple of this: the keys go in tiles of simd.LANES frames
# (16 or 8), which divide it.
MEMORY_FRAME_BLOCK = 16


def ladder_order(layers: int) -> tuple[int, ...]:
    """Endpoint-preserving bisection order of a decoder stack (guide §6).

    Both ends first, then repeatedly the midpoint (rounded down) of the widest gap between chosen
    layers, the leftmost gap on ties: 8 layers give 0, 7, 3, 5, 1, 2, 4, 6.
    """
    if layers < 1:
        raise ValueError(f"a decoder needs at least one layer, got {layers}")
    if layers == 1:
        return (0,)
    chosen = [0, layers - 1]
    order = list(chosen)
    while len(order) < layers:
        chosen.sort()
        gaps = [(right - left, left, right) for left, right in zip(chosen, chosen[1:]) if right - left > 1]
        width = max(g[0] for g in gaps)
        _, left, right = next(g for g in gaps if g[0] == width)
        mid = (left + right) // 2
        chosen.append(mid)
        order.append(mid)
    return tuple(order)


def ladder_layers(layers: int, depth: int | None) -> tuple[int, ...]:
    """The decoder layers a ladder depth keeps, in stack order (None: all of them)."""
    if depth is None:
        return tuple(range(layers))
    lowest = min(2, layers)
    if not isinstance(depth, (int, np.integer)) or not lowest <= depth <= layers:
        raise ValueError(f"decoder depth must be an integer in [{lowest}, {layers}], got {depth!r}")
    return tuple(sorted(ladder_order(layers)[: int(depth)]))


def sinusoids(frames: int, width: int) -> np.ndarray:
    """(frames, width) float32: [sin(t w), cos(t w)], w_i = exp(-i ln 10000 / (width/2 - 1)) (§6)."""
    half = width // 2
    step = np.float32(-math.log(10000.0) / (half - 1))
    omega = np.exp(step * np.arange(half, dtype=np.float32))
    angle = np.arange(frames, dtype=np.float32)[:, None] * omega[None, :]
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=1).astype(np.float32)


def _sigmoid_scalar(x: np.ndarray) -> np.float32:
    v = np.float32(np.asarray(x, np.float32).reshape(-1)[0])
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-v))


def _memory_codes(x: np.ndarray, frames_first: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Cross-attention K or V (frames, heads, d), int8-quantised per head vector like
    quantize.maybe_quant_kv, as codes (heads, d, padded) int8, frames last (K: `_attend_memory`
    takes tiles of frames), or with `frames_first` (heads, padded, d) (V: it takes tiles of the
    vector), and scales (heads, padded) float32; zero past `frames`: padded is the next multiple
    of MEMORY_FRAME_BLOCK."""
    frames, heads, dim = x.shape
    codes = np.empty((frames * heads, dim), np.int8)
    scales = np.empty(frames * heads, np.float32)
    _quant_codes(np.ascontiguousarray(x, np.float32).reshape(-1, dim), codes, scales)
    padded = frames + (-frames) % MEMORY_FRAME_BLOCK
    out_scales = np.zeros((heads, padded), np.float32)
    out_scales[:, :frames] = scales.reshape(frames, heads).T
    by_head = codes.reshape(frames, heads, dim).transpose(1, 0, 2)
    if frames_first:
        out_codes = np.zeros((heads, padded, dim), np.int8)
        out_codes[:, :frames] = by_head
    else:
        out_codes = np.zeros((heads, dim, padded), np.int8)
        out_codes[:, :, :frames] = by_head.transpose(0, 2, 1)
    return out_codes, out_scales


# ---------------------------------------------------------------- weights


class _LevelsLinear:
    """y = int8(x) @ W.T in the CQ rotated domain, never dequantising W, for one matrix or several
    stacked along their outputs (q, k, v and the gate read the same activation: one call).

    A CQ row group is w_g = (cb[idx] * norm) @ H, H the symmetric normalised Walsh-Hadamard
    matrix, so x_g . w_g = (x_g @ H) . (cb[idx] * norm): the activation is rotated once per group,
    then dotted with the levels. Where the integer products run and the matrix fits them
    (`blocks.integer_form` near `blocks.decoder_levels`: needle's 2-bit and 4-bit matrices) the
    int8 codes rotated exactly times the integer levels (`kernels.integer`; 5 rows of 1120 x 512
    in 13 against 38 us, of the 8199-row head in 121 against 462 us); else the float
    products: 2- and 4-bit matrices (`PACKED_BITS`) keep their level indices packed, 2 or 4 bits
    each in `simd.interleave`'s layout: 2-bit ones read the exact levels, 4-bit ones
    blocks.RotatedLinear's integer levels times norm * unit (~1e-5), as other widths do through
    its int16 level codes. Only one of the two forms is held.
    """

    def __init__(self, cact, *names: str):
        cqs = [cact.packed_cq(name) for name in names]
        first = cqs[0]
        if any(c.group != first.group or c.bits != first.bits or c.in_pad != first.in_pad for c in cqs):
            raise ValueError(f"cannot stack {names}: different CQ widths, groups or input sizes")
        self.group = first.group
        self.sizes = [c.shape[0] for c in cqs]
        self.offsets = [0, *np.cumsum(self.sizes)[:-1].tolist()]  # first output column of each
        self.shape = (sum(self.sizes), first.shape[1])
        self.k_pad = first.in_pad
        self.bits = first.bits if first.bits in PACKED_BITS else 0
        self.integer = B.integer_form(cqs, decoder=True)
        if self.integer is not None:   # the float form's fields, empty (`Rotated`)
            self.codes, self.norms = np.zeros((0, 0), np.uint8), np.zeros((0, self.k_pad // self.group), np.float32)
            self.levels = np.zeros(4, np.float32)
        elif self.bits:
            self.codes, self.norms, self.levels = B.packed_levels(cqs, integer=True)
        else:
            wide = [B.RotatedLinear(c.codes(), c.norms, c.codebook, c.group, c.shape) for c in cqs]
            codes, norms = [w.levels for w in wide], [w.gscale for w in wide]
            self.levels = np.zeros(4, np.float32)  # unused by the int16 level-code product
            self.codes = np.ascontiguousarray(codes[0] if len(codes) == 1 else np.concatenate(codes))
            self.norms = np.ascontiguousarray(norms[0] if len(norms) == 1 else np.concatenate(norms))

    def record(self) -> Rotated:
        """The matrix as the fused kernels read it (`kernels.decoder._quant_product`)."""
        return Rotated(codes=self.codes, norms=self.norms, levels=self.levels, bits=self.bits, group=self.group,
                       outputs=self.shape[0], integer=KI.absent() if self.integer is None else self.integer)

    def quantised(self, h: np.ndarray) -> np.ndarray:
        """int8(h) @ W.T: h (rows, in) float32, overwritten by its fake-quant -> (rows, out). With
        kernels.GEMM_THREADS > 1 a large matrix is split by output columns over the shared pool
        (the kernels release the GIL).

        Either form gives every row the same arithmetic whatever the batch (a row's logits are
        bit-identical decoded alone, in a beam batch or teacher-forced): the float kernels take rows
        five at a time (fewer one at a time) with the same sums per row, the integer ones sum each
        group exactly."""
        rows = h.shape[0]
        split = K.GEMM_THREADS > 1 and self.shape[0] * self.k_pad >= K.SPLIT_WEIGHTS
        if self.integer is not None:
            return B.integer_product(h, self.group, self.k_pad, self.integer, self.shape[0], split)
        xr = np.zeros((rows, self.k_pad), np.float32)
        _quant_rotate(h, self.group, xr)
        out = np.empty((rows, self.shape[0]), np.float32)
        if split:
            B.run_split(lambda a, b: self._part(xr, a, b, out), self.shape[0])
        else:
            self._part(xr, 0, self.shape[0], out)
        return out

    def _part(self, xr: np.ndarray, a: int, b: int, out: np.ndarray) -> None:
        if self.bits:
            _packed_rows(xr, self.codes[a:b], self.norms[a:b], self.levels, self.bits, self.group, out[:, a:b])
        else:
            _levels_rows(xr, self.codes[a:b], self.norms[a:b], self.group, out[:, a:b])


class _Layer:
    """One kept decoder layer's weights. `index` is its place in the file, `position` its place
    among the kept layers (which picks its mHC lane offsets)."""

    def __init__(self, cact, index: int, position: int, site: int | None):
        d = cact.dims
        p = f"layer{index:02d}."
        a = cact.array
        self.index, self.position, self.site = index, position, site
        self.norm_in = a(p + "norm_in")
        # q, k, v and the gate all read int8(norm_in(x)): one stacked product.
        self.qkvg = _LevelsLinear(cact, p + "q_proj", p + "k_proj", p + "v_proj", p + "gate_proj")
        self.lane = np.zeros(d.lanes, np.float32)  # one-hot mHC lane of this place in the kept stack
        self.lane[position % d.lanes] = 1.0
        if d.taps:
            self.q_taps, self.k_taps, self.v_taps = a(p + "q_taps"), a(p + "k_taps"), a(p + "v_taps")
        else:
            self.q_taps = self.k_taps = self.v_taps = np.zeros((0, 1), np.float32)
        self.q_norm, self.k_norm = a(p + "q_norm"), a(p + "k_norm")
        self.out = _LevelsLinear(cact, p + "out_proj")
        self.post_norm = a(p + "post_norm")
        self.attn_gate = _sigmoid_scalar(a(p + "attn_gate"))
        self.cross_norm = a(p + "cross_norm")
        self.cqg = _LevelsLinear(cact, p + "cross.q_proj", p + "cross.gate_proj")
        self.cout = _LevelsLinear(cact, p + "cross.out_proj")
        # Memory-side projections see (frames, width) once per clip, K and V in one product (the
        # integer products where they fit, else BLAS on one matrix dequantised at a time)
        self.ckv = B.CQLinear.from_cact(cact, p + "cross.k_proj", p + "cross.v_proj", few_rows=False, integer=True)
        self.cq_norm, self.ck_norm = a(p + "cross_q_norm"), a(p + "cross_k_norm")
        self.post_cross_norm = a(p + "post_cross_norm")
        self.cross_gate = _sigmoid_scalar(a(p + "cross_gate"))
        self.pre_hada = a(p + "pre_hada")
        self.mlp = B.HadamardMLP.from_cact(cact, p[:-1], d.width)
        # The weights `_block_step` reads, as its records (the per-clip ones come from `Decoder.start`).
        self.attn = SelfAttention(
            norm_in=self.norm_in, qkvg=self.qkvg.record(), gate_at=self.qkvg.offsets[3], q_taps=self.q_taps,
            k_taps=self.k_taps, v_taps=self.v_taps, q_norm=self.q_norm, k_norm=self.k_norm,
            out=self.out.record(), post_norm=self.post_norm, gate=self.attn_gate)
        self.cross = CrossAttention(
            norm=self.cross_norm, qg=self.cqg.record(), q_norm=self.cq_norm, out=self.cout.record(),
            post_norm=self.post_cross_norm, gate=self.cross_gate)
        self.mlp_record = self.mlp.record(self.pre_hada)


# The largest embedding kept dense (float32) rather than packed with rows dequantised per step.
DENSE_EMBEDDING_BYTES = 1 << 20


class _DenseRows:
    """An embedding table kept dequantised: rows(tokens) as PackedCQ.rows gives them."""

    def __init__(self, table: np.ndarray):
        self.table = np.ascontiguousarray(table, np.float32)
        self.table.setflags(write=False)
        self.shape = self.table.shape

    def rows(self, rows) -> np.ndarray:
        return self.table[np.asarray(rows, np.int64).reshape(-1)]


class _PackedRows:
    """A CQ table left packed in the file, read a few rows at a time (`_gather_packed`: each field's
    level times its group's norm): rows(ids) as PackedCQ.rows gives them, to the bit."""

    def __init__(self, cq):
        self.cq, self.shape, self.group = cq, cq.shape, cq.group
        self.levels = np.ascontiguousarray(cq.codebook[cq.field_codes()], np.float32)
        self.norms = np.ascontiguousarray(cq.norms, np.float32)

    def rows(self, rows) -> np.ndarray:
        rows = np.asarray(rows, np.int64).reshape(-1)
        rot = np.empty((rows.shape[0], self.cq.in_pad), np.float32)
        _gather_packed(self.cq.packed, self.cq.field_bits, self.levels, self.norms, rows, self.group, rot)
        return from_rotated(rot, self.group, self.shape[1])


class _Engram:
    """One engram site: hashed n-gram tables (left packed, gathered per token), key/value maps."""

    def __init__(self, cact, site: int):
        d = cact.dims
        self.tables = _PackedRows(cact.packed_cq(f"engram{site}.tables"))  # a step reads a few rows
        self.kv = _LevelsLinear(cact, f"engram{site}.key_proj", f"engram{site}.value_proj")
        self.kv_record = self.kv.record()
        self.taps = cact.array(f"engram{site}.taps")  # (4, width)
        self.sub_dim = d.engram_sub_dim


# ---------------------------------------------------------------- per-clip state


def untouched_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An array of zeros in pages of its own, which hold memory only once written.

    The KV pools have room for max_tokens positions (320) and a pass writes the few dozen it
    decodes; np.zeros takes them from the heap once freed arrays have raised malloc's mmap
    threshold, and calloc then writes every page.
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    pages = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return np.frombuffer(pages, dtype, count=count).reshape(shape)


@dataclass(eq=False)
class DecoderState:
    """Everything one clip's decode carries between steps; made by `Decoder.start`.

    rows: live beam rows; position: the next position to feed (tokens fed so far).
    """

    frames: int
    capacity: int  # most beam rows
    rows: int
    position: int
    cross_k: list  # per kept layer (int8 codes (heads, qk_dim, padded frames), scales (heads, padded frames))
    cross_v: list  # per kept layer (int8 codes (heads, padded frames, v_dim), scales (heads, padded frames))
    k_pool: list  # per kept layer (max_tokens, capacity, kv_heads, qk_dim) int8 codes
    k_scale: list  # per kept layer (max_tokens, capacity, kv_heads) float32: key = codes * scale
    v_pool: list  # per kept layer (max_tokens, capacity, kv_heads, v_dim) int8 codes
    v_scale: list  # per kept layer (max_tokens, capacity, kv_heads) float32
    anc: np.ndarray  # (capacity, max_tokens) int32: pool row of each beam's position
    tap_hist: list  # per kept layer [q, k, v] raw-row rings, each (taps, capacity, features)
    engram_hist: dict  # site -> ((conv taps - 1) * dilation + 1, capacity, width) raw value-row ring
    token_hist: np.ndarray  # (capacity, max order - 1) int64, the last tokens (0 before the start)
    scores: np.ndarray  # (heads per kv head, max_tokens) float32 attention scratch
    layer_args: list  # per kept layer: the `LayerStep` record `_block_step` reads
    # alignment layer -> (max_tokens, heads, frames) cross-attention weights of each position fed
    # while one row is live (`Decoder.record`), or None: a greedy decode's word-time weights
    recorded: dict | None = None


@dataclass(frozen=True, eq=False)
class DecoderMark:
    """Where a one-row decode stood (`Decoder.mark`), for `Decoder.rewind` to go on from there
    after a search has fed more: the position, and row 0 of every ring (the causal taps', the
    engram sites') and of the token history, which later positions overwrite."""

    position: int
    rings: tuple
    tokens: np.ndarray


def _rings(state: DecoderState) -> list:
    """Every ring of `state` that a position writes in its pool row's slot: the taps', the engram sites'."""
    return [ring for layer in state.tap_hist for ring in layer] + list(state.engram_hist.values())


class Decoder:
    """The decoder of a Whistle .cact.

    Decoder(cact, depth=None): depth keeps that many layers by the ladder order (guide §6).
    The CQ matrices stay in the rotated domain (`_LevelsLinear`); only the embedding is also
    dequantised, for the input rows.
    """

    def __init__(self, cact, depth: int | None = None):
        K.set_blas_threads()  # the per-clip memory projections go through BLAS (kernels.BLAS_THREADS)
        d = cact.dims
        self.dims = d
        self.kept = ladder_layers(d.dec_layers, depth)
        sites = {layer: s for s, layer in enumerate(d.engram_sites)}
        self.layers = [_Layer(cact, index, pos, sites.get(index)) for pos, index in enumerate(self.kept)]
        self.engrams = {s: _Engram(cact, s) for s, layer in enumerate(d.engram_sites) if layer in self.kept}
        self.lanes = B.LaneMixer(cact, "", d.dec_layers, d.lanes, d.width)
        # Input rows. A large table stays packed in the file and its rows are dequantised as
        # tokens are fed (a dense copy is 16.8 MB with the shipped 8199 rows); a small one is kept
        # dense, where a step's row gather costs nothing (the demo model's: 263 KB).
        packed = cact.packed_cq("embedding")
        if packed.shape[0] * packed.shape[1] * 4 <= DENSE_EMBEDDING_BYTES:
            self.embedding = _DenseRows(cact.array("embedding"))
        else:
            self.embedding = _PackedRows(packed)
        self.head = _LevelsLinear(cact, "embedding")  # output head: the same matrix, over every id
        self.pe_gate = _sigmoid_scalar(cact.array("pe_gate"))
        self.embed_scale = np.float32(math.sqrt(d.width))
        self.rope_cos, self.rope_sin = B.rope_tables(d.qk_dim, np.arange(d.max_tokens), d.rope_theta)
        # The reference's flash path: q * sqrt(fused / qk), then logits / sqrt(fused), fused =
        # max(qk, v): mathematically q.k / sqrt(qk).
        fused = max(d.qk_dim, d.v_dim)
        self.q_scale = np.float32(math.sqrt(fused / d.qk_dim))
        self.logit_scale = np.float32(1.0 / math.sqrt(fused))
        self.orders = tuple(d.engram_orders)
        self.order_array = np.array(self.orders, np.int64)
        self.hashes = d.engram_hashes
        self.hash_stride = d.engram_seed_heads or d.engram_hashes
        self.engram_depth = (d.engram_conv_taps - 1) * d.engram_dilation
        self.shape = Shape(cos_tab=self.rope_cos, sin_tab=self.rope_sin, eps=NORM_EPS, heads=d.heads,
                           kv_heads=d.kv_heads, q_scale=self.q_scale, logit_scale=self.logit_scale,
                           embed_scale=self.embed_scale)
        lanes = self.lanes
        self.lane_maps = [LaneMaps(phi=lanes.phi[i].weight, a_pre=lanes.a_pre[i], a_post=lanes.a_post[i],
                                   a_res=lanes.a_res[i], b_pre=lanes.b_pre[i], b_post=lanes.b_post[i],
                                   b_res=lanes.b_res[i], lane=layer.lane, iters=SINKHORN_ITERS)
                          for layer in self.layers for i in (layer.index,)]
        self._no_engram = np.zeros((0, d.width), np.float32)  # a layer without an engram site
        self._steps: dict = {}  # kept layer -> `_block_step` compiled for its record's types

    # ---------------------------------------------------------------- public API

    @property
    def alignment_layers(self) -> tuple[int, ...]:
        """The kept layers in the upper half of the full stack (guide §8 word timestamps)."""
        return tuple(i for i in self.kept if i >= self.dims.dec_layers // 2)

    def memory(self, enc: np.ndarray) -> np.ndarray:
        """Encoder output (frames, width) -> cross-attention memory: int8(enc + sigmoid(pe_gate) x
        sinusoids) (guide §6)."""
        enc = self._check_memory(enc)
        return B.fake_quant_int8(enc + self.pe_gate * sinusoids(enc.shape[0], self.dims.width))

    def start(self, enc: np.ndarray, beams: int = BEAMS) -> DecoderState:
        """A fresh decode over the encoder output `enc` (frames, width) float32, room for `beams`
        rows. Projects each kept layer's cross-attention K/V once."""
        cap = _beam_rows(beams)
        d = self.dims
        mem = self.memory(enc)
        frames = mem.shape[0]
        cross_k, cross_v = [], []
        for layer in self.layers:
            k, v = np.split(layer.ckv.quantised(mem), [d.heads * d.qk_dim], axis=1)   # mem is int8 already
            k = B.zc_rmsnorm(np.ascontiguousarray(k).reshape(frames, d.heads, d.qk_dim), layer.ck_norm)
            v = np.ascontiguousarray(v).reshape(frames, d.heads, d.v_dim)
            cross_k.append(_memory_codes(k))
            cross_v.append(_memory_codes(v, frames_first=True))
        return self._fresh(frames, cross_k, cross_v, cap)

    def restart(self, state: DecoderState, beams: int = 1, *, record: bool | None = None) -> DecoderState:
        """A fresh decode over the same encoder output as `state` (a `start` of it): the
        cross-attention K/V are shared (read-only), not projected again; nothing is fed yet.
        It records (`record`) as `state` does, or as `record` says."""
        fresh = self._fresh(state.frames, state.cross_k, state.cross_v, _beam_rows(beams))
        if (state.recorded is not None) if record is None else record:
            self.record(fresh)
        return fresh

    def record(self, state: DecoderState) -> None:
        """From now on `state` keeps the alignment layers' cross-attention weights of every position
        it feeds while one row is live (a prompt, a greedy decode, a search's text fed again after
        `rewind`), so that `recorded_weights` gives the teacher-forced pass's weights of what it
        read without running that pass (a row's weights are the same whichever way it was fed).
        Pages are touched only for the positions fed."""
        d = self.dims
        state.recorded = {i: np.empty((d.max_tokens, d.heads, state.frames), np.float32)
                          for i in self.alignment_layers}

    def mark(self, state: DecoderState) -> DecoderMark:
        """Where `state`, one row live, stands now (the end of a prompt), for `rewind`."""
        if state.rows != 1:
            raise ValueError(f"a mark is taken with one row live, not {state.rows}")
        return DecoderMark(state.position, tuple(ring[:, 0].copy() for ring in _rings(state)),
                           state.token_hist[0].copy())

    def rewind(self, state: DecoderState, mark: DecoderMark) -> None:
        """Back to `mark` (taken on this state) with one row live: what is fed next follows what
        was fed before the mark, as if nothing came between (a beam search's steps). The KV pool
        needs nothing: the positions before the mark were fed with one row, so every row reads
        them from pool row 0 (`_reorder` copies block table rows, and row 0's entries there are
        0), and a search writes only later positions; the rings' row 0 slots, which later
        positions overwrite, and the token history come back from the mark."""
        for ring, kept in zip(_rings(state), mark.rings):
            ring[:, 0] = kept
        state.token_hist[0] = mark.tokens
        state.rows = 1
        state.position = mark.position

    def recorded_weights(self, state: DecoderState, positions: int) -> np.ndarray | None:
        """`cross_attention_weights` of the first `positions` tokens `state` fed, from its record
        (`record`), or None where it holds fewer (a transcript cut at the length cap ends
        without its last token fed)."""
        if state.recorded is None or state.position < positions or state.rows != 1:
            return None
        out = [state.recorded[i][:positions].transpose(1, 0, 2) for i in self.alignment_layers]
        return np.concatenate(out, axis=0) if out else np.zeros((0, positions, state.frames), np.float32)

    def _fresh(self, frames: int, cross_k: list, cross_v: list, cap: int) -> DecoderState:
        """A state with room for `cap` rows over projected cross-attention K/V, nothing fed."""
        d = self.dims
        T = d.max_tokens
        # Raw rows the causal taps read back, in rings one slot longer than the taps reach: slot
        # position % R of pool row r, read through the block table like the KV pool (a reorder
        # moves nothing).
        ring = max(d.taps - 1, 0) + 1
        tap_hist = [[np.zeros((ring, cap, n), np.float32)
                     for n in (d.heads * d.qk_dim, d.kv_heads * d.qk_dim, d.kv_heads * d.v_dim)]
                    for _ in self.layers]
        engram_hist = {s: np.zeros((self.engram_depth + 1, cap, d.width), np.float32) for s in self.engrams}
        state = DecoderState(
            frames=frames, capacity=cap, rows=1, position=0, cross_k=cross_k, cross_v=cross_v,
            k_pool=[untouched_zeros((T, cap, d.kv_heads, d.qk_dim), np.int8) for _ in self.layers],
            k_scale=[untouched_zeros((T, cap, d.kv_heads)) for _ in self.layers],
            v_pool=[untouched_zeros((T, cap, d.kv_heads, d.v_dim), np.int8) for _ in self.layers],
            v_scale=[untouched_zeros((T, cap, d.kv_heads)) for _ in self.layers],
            anc=np.zeros((cap, T), np.int32), tap_hist=tap_hist, engram_hist=engram_hist,
            token_hist=np.zeros((cap, max(max(self.orders, default=1) - 1, 0)), np.int64),
            scores=np.empty((d.heads // d.kv_heads, T), np.float32), layer_args=[])
        # Each layer's `LayerStep`, built once per clip (packing it per step was a tenth of a
        # millisecond of a 5-beam step).
        for li, layer in enumerate(self.layers):
            cache = SelfCache(*tap_hist[li], k_pool=state.k_pool[li], k_scale=state.k_scale[li],
                              v_pool=state.v_pool[li], v_scale=state.v_scale[li], anc=state.anc, scores=state.scores)
            memory = Memory(*cross_k[li], *cross_v[li])
            state.layer_args.append(LayerStep(
                lanes=self.lane_maps[li], cache=cache, memory=memory, attn=layer.attn, cross=layer.cross,
                mlp=layer.mlp_record, shape=self.shape))
        return state

    def feed(self, state: DecoderState, tokens) -> np.ndarray:
        """Feed a run of tokens (S,) to every live row (the prompt); returns (rows, S, vocab)."""
        tokens = np.asarray(tokens).reshape(-1)
        tokens = self._check_tokens(tokens, state, tokens.shape[0])
        return self._forward(state, np.broadcast_to(tokens[None, :], (state.rows, tokens.shape[0])))

    def step(self, state: DecoderState, parents, tokens) -> np.ndarray:
        """Reorder the beams to `parents` (row indices into the current rows), then feed one token per
        row. Returns (rows, vocab) float32 next-token logits over every vocabulary id."""
        parents = np.asarray(parents)
        if parents.ndim != 1 or not np.issubdtype(parents.dtype, np.integer) or parents.shape[0] == 0:
            raise ValueError(f"parents must be a non-empty 1-D integer array, got {parents!r}")
        if parents.shape[0] > state.capacity:
            raise ValueError(f"{parents.shape[0]} rows exceed the state's {state.capacity} beams")
        if parents.min() < 0 or parents.max() >= state.rows:
            raise ValueError(f"parents must index the {state.rows} current rows, got {parents.tolist()}")
        tokens = self._check_tokens(np.asarray(tokens).reshape(-1), state, 1)
        if tokens.shape[0] != parents.shape[0]:
            raise ValueError(f"{tokens.shape[0]} tokens for {parents.shape[0]} parents; one token per row")
        self._reorder(state, parents.astype(np.int64))
        return self._forward(state, tokens[:, None])[:, 0]

    def advance_fn(self, state: DecoderState) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        """The search callback: advance(parents, tokens) -> (rows, vocab) logits (search.py)."""
        return lambda parents, tokens: self.step(state, parents, tokens)

    def logits(self, enc: np.ndarray, tokens) -> np.ndarray:
        """Teacher-forced logits (len(tokens), vocab) float32: row i is the next-token distribution
        after tokens[:i + 1]; tokens is the whole decoder input, <s> first."""
        state = self.start(enc, beams=1)
        return self.feed(state, tokens)[0]

    def cross_attention_weights(self, enc: np.ndarray, tokens, layers=None, *,
                                same_as: DecoderState | None = None) -> np.ndarray:
        """Teacher-forced cross-attention weights (len(layers) * heads, len(tokens), frames) of the
        given kept layers (file indices; default `alignment_layers`), layer-major then head.
        same_as: a state started on this `enc` (the search's): its cross K/V are reused."""
        return self.logits_and_weights(enc, tokens, layers, same_as=same_as)[1]

    def logits_and_weights(self, enc: np.ndarray, tokens, layers=None, *,
                           same_as: DecoderState | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`logits` and `cross_attention_weights` of the same teacher-forced pass, run once."""
        layers = self.alignment_layers if layers is None else tuple(int(i) for i in layers)
        missing = [i for i in layers if i not in self.kept]
        if missing:
            raise ValueError(f"layers {missing} are not among the kept decoder layers {self.kept}")
        if same_as is None:
            state = self.start(enc, beams=1)
        elif same_as.frames != np.shape(enc)[0]:
            raise ValueError(f"same_as holds a decode over {same_as.frames} encoder frames; enc has "
                             f"{np.shape(enc)[0]}")
        else:
            state = self.restart(same_as, beams=1)
        tokens = np.asarray(tokens).reshape(-1)
        tokens = self._check_tokens(tokens, state, tokens.shape[0])
        collected: dict[int, np.ndarray] = {}
        logits = self._forward(state, tokens[None, :], collect=(set(layers), collected))[0]
        d = self.dims
        out = [collected[i].reshape(len(tokens), d.heads, state.frames).transpose(1, 0, 2) for i in layers]
        weights = np.concatenate(out, axis=0) if out else np.zeros((0, len(tokens), state.frames), np.float32)
        return logits, weights

    # ---------------------------------------------------------------- checks

    def _check_memory(self, enc) -> np.ndarray:
        enc = np.asarray(enc)
        w = self.dims.width
        if enc.ndim != 2 or enc.shape[1] != w or enc.shape[0] == 0:
            raise ValueError(f"encoder output must be a (frames, {w}) array with frames >= 1, got {enc.shape}")
        enc = np.ascontiguousarray(enc, np.float32)
        if not np.isfinite(enc).all():
            raise ValueError("encoder output contains NaN or infinite values")
        return enc

    def _check_tokens(self, tokens: np.ndarray, state: DecoderState, positions: int) -> np.ndarray:
        """tokens: ids to feed, `positions` new positions per row."""
        d = self.dims
        if tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a non-empty integer array, got {tokens!r}")
        if tokens.min() < 0 or tokens.max() >= d.vocab:
            raise ValueError(f"token ids must be in [0, {d.vocab}), got {tokens.min()}..{tokens.max()}")
        needed = state.position + positions
        if needed > d.max_tokens:
            raise ValueError(f"the decoder holds at most {d.max_tokens} positions; {needed} requested")
        return tokens.astype(np.int64)

    # ---------------------------------------------------------------- internals

    def _reorder(self, state: DecoderState, parents: np.ndarray) -> None:
        """Make row b the continuation of old row parents[b]: the block table rows and the last
        tokens are gathered; the KV pool and the tap rings (read through the table) are untouched."""
        rows = parents.shape[0]
        if rows == state.rows and np.array_equal(parents, np.arange(rows)):
            return
        _reorder_rows(state.anc, state.token_hist, parents, state.position)
        state.rows = rows

    def _engram_rows(self, state: DecoderState, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hashed n-gram table indices (B*S, tables) int64 and their validity (B*S, tables) float32
        for the new positions (needle `engram_indices`: uint32 arithmetic, tokens before the start
        read as 0)."""
        rows, n_new = tokens.shape
        seq = np.concatenate([state.token_hist[:rows], tokens], axis=1)  # (B, H + S)
        tables = len(self.orders) * self.hashes
        idx = np.empty((rows, n_new, tables), np.int64)
        ok = np.empty((rows, n_new, tables), np.float32)
        _engram_hash(seq, state.token_hist.shape[1], state.position, self.order_array, self.hashes,
                     self.hash_stride, ENGRAM_SEED, ENGRAM_PRIME, ENGRAM_SHIFT, self.dims.engram_slots, idx, ok)
        return idx.reshape(rows * n_new, tables), ok.reshape(rows * n_new, tables)

    def _engram(self, state, site: int, idx: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(key, value) rows (B*S, width) of one engram site for the new positions."""
        e = self.engrams[site]
        d = self.dims
        key = np.empty((idx.shape[0], d.width), np.float32)
        value = np.empty_like(key)
        t = e.tables
        _engram_site(idx, ok, t.cq.packed, t.cq.field_bits, t.levels, t.norms, t.group, d.engram_slots, e.sub_dim,
                     e.kv_record, e.taps, d.engram_dilation, state.engram_hist[site], state.anc, state.rows,
                     state.position, key, value)
        return key, value

    def _forward(self, state: DecoderState, tokens: np.ndarray, collect=None) -> np.ndarray:
        """Feed tokens (B, S) at positions position .. position+S-1 of the B live rows; returns the
        logits (B, S, vocab)."""
        d = self.dims
        rows, n_new = tokens.shape
        start = state.position
        state.anc[:rows, start:start + n_new] = np.arange(rows, dtype=np.int32)[:, None]
        n = rows * n_new
        stream = np.empty((n, d.lanes, d.width), np.float32)  # every lane starts as embedding x sqrt(width)
        _lanes_from(self.embedding.rows(tokens), self.embed_scale, stream)
        engram = {}
        if self.engrams:
            idx, ok = self._engram_rows(state, tokens)
            for site in self.engrams:
                engram[site] = self._engram(state, site, idx, ok)
        if state.token_hist.shape[1]:
            _push_history(state.token_hist, rows, tokens)

        spare = np.empty_like(stream)
        scratch = np.empty((n, d.heads, state.frames), np.float32)
        recorded = state.recorded if rows == 1 else None
        for li, layer in enumerate(self.layers):
            key, value = engram.get(layer.site, (self._no_engram, self._no_engram))
            weights = scratch  # a layer whose weights nobody keeps writes them here
            if collect is not None and layer.index in collect[0]:
                weights = collect[1][layer.index] = np.empty((n, d.heads, state.frames), np.float32)
            elif recorded is not None and layer.index in recorded:
                weights = recorded[layer.index][start:start + n_new]
            args = (stream, spare, weights, key, value, rows, start, state.layer_args[li])
            step = self._steps.get(li)
            if step is None:   # the record's types are fixed per decoder: resolve them once
                step = self._steps[li] = compiled_for(_block_step, *args)
            step(*args)
            stream, spare = spare, stream
        h = np.empty((n, d.width), np.float32)
        _lanes_final(stream, self.lanes.final_norm, NORM_EPS, h)
        logits = self.head.quantised(h)
        state.position = start + n_new
        return logits.reshape(rows, n_new, d.vocab)


def _beam_rows(beams) -> int:
    """The row capacity a decode of `beams` beams needs; refuses anything but a positive integer."""
    if not isinstance(beams, (int, np.integer)) or beams < 1:
        raise ValueError(f"beams must be a positive integer, got {beams!r}")
    return int(beams)


def _push_history(hist: np.ndarray, rows: int, new: np.ndarray) -> None:
    """hist (capacity, H, ...) keeps the last H entries of each row: append new (rows, S, ...)."""
    depth = hist.shape[1]
    if depth == 0:
        return
    n_new = new.shape[1]
    if n_new >= depth:
        hist[:rows] = new[:, n_new - depth:]
    else:
        hist[:rows, : depth - n_new] = hist[:rows, n_new:].copy()
        hist[:rows, depth - n_new:] = new
