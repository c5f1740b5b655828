"""Reader for Whistle `.cact` files (guide §2, §4, §5; the byte layout of needle's export.py).

Layout, all little-endian: a header of 49 four-byte fields (rope_theta a float32, the rest u32),
the shared codebooks cb2|cb3|cb4 as float32, a nameless directory of 44-byte records, then 64-byte
aligned blobs. The directory is positional: `expected_layout` lists what each index must hold for a
speech model, and the reader refuses anything else, naming the record, the tensor it expected and
what it found.

The file is memory-mapped; FP32 records come back as read-only views, the rest are decoded on
demand, so the reader itself never holds a second copy of the weights.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .dims import ENGRAM_CONV_TAPS, HADAMARD_COND_RANK, Dims, hadamard_blocks
from .errors import ModelFormatError

TAG = 0x05E12A84
ALIGN = 64
HEADER = struct.Struct("<48If")
RECORD = struct.Struct("<BBHIIIIQQII")
FP16, FP32, CQ, RAW = 1, 2, 3, 4
DTYPE_NAMES = {FP16: "FP16", FP32: "FP32", CQ: "CQ", RAW: "RAW"}
TERNARY_RECORD_BITS = 5
CQ_BITS = (1, 2, 3, 4, TERNARY_RECORD_BITS)
CODEBOOK_BITS = (2, 3, 4)  # the shared codebooks in the header, in this order
AUDIO_MANIFEST_MAGIC = 3246.0
AUDIO_MANIFEST_LEN = 13
TERNARY_LEVEL = 1.2240064  # 3-level Lloyd-Max centroid of a unit Gaussian (export.py docstring)
HADAMARD_MLP_TENSORS = ("d1", "d2", "b2", "d3", "d4", "w1a", "w1b", "w2a", "w2b", "w3a", "w3b",
                        "cond_v", "cond_u")
_PROJ = ("q_proj", "k_proj", "v_proj", "gate_proj", "out_proj")
_HEADER_FIELDS = (
    "tag", "num_tensors", "codebook_len", "kv_window", "kv_bits", "vocab", "out_vocab", "d_model",
    "num_heads", "num_kv_heads", "num_layers", "qk_head_dim", "v_head_dim", "max_seq_len", "hada_n",
    "mhc_lanes", "sliding_window", "global_mask_lo", "global_mask_hi", "qkv_conv_taps",
    "engram_slots", "engram_sub_dim", "num_engram_tables", "engram_conv_taps",
    "engram_conv_dilation", "engram_seed_heads", "num_engram_orders",
)


@dataclass(frozen=True)
class Record:
    index: int
    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    group: int
    bits: int

    @property
    def kind(self) -> str:
        """FP16, FP32, RAW, or CQ<bits> (CQ1.58 for the ternary record)."""
        if self.dtype == CQ:
            return "CQ1.58" if self.bits == TERNARY_RECORD_BITS else f"CQ{self.bits}"
        return DTYPE_NAMES.get(self.dtype, f"dtype{self.dtype}")


@dataclass(frozen=True)
class CQMatrix:
    """A CQ record left packed: level indices, per-group fp16 norms and the unit codebook."""

    codes: np.ndarray  # (out, in_pad) uint8 level index per weight
    norms: np.ndarray  # (out, in_pad // group) float16, a view of the file
    codebook: np.ndarray  # (levels,) float32, already divided by sqrt(group)
    bits: int
    group: int
    shape: tuple[int, int]  # logical (out, in)

    def dequantize(self) -> np.ndarray:
        """(out, in) float32: per group (codebook[idx] * norm) @ H, H the normalised Walsh-Hadamard."""
        return dequantize_rows(self.codes, self.norms, self.codebook, self.group, self.shape[1])


def dequantize_rows(codes: np.ndarray, norms: np.ndarray, codebook: np.ndarray, group: int,
                    in_dim: int) -> np.ndarray:
    """Rows of a CQ matrix as float32 (len(codes), in_dim) from their level indices (rows, in_pad)
    and fp16 norms (rows, in_pad // group): per group (codebook[idx] * norm) @ H."""
    rows = codes.shape[0]
    groups = codes.shape[1] // group
    rot = codebook[codes].reshape(rows, groups, group)
    rot *= norms.astype(np.float32)[:, :, None]
    return from_rotated(rot.reshape(rows, groups * group), group, in_dim)


def from_rotated(rot: np.ndarray, group: int, in_dim: int) -> np.ndarray:
    """Rows in the rotated domain (rows, in_pad) float32, codebook[idx] * norm, as weights
    (rows, in_dim): each group times H."""
    rows = rot.shape[0]
    # A stack of (groups, group) products, as export._cq_unpack computes it, so the float32 sums
    # run in the same order and the result is bit-identical (a row alike whichever rows come with it).
    w = rot.reshape(rows, -1, group) @ walsh_hadamard(group)
    return np.ascontiguousarray(w.reshape(rows, -1)[:, :in_dim])


@dataclass(frozen=True)
class PackedCQ:
    """A CQ record whose level indices stay packed in the file: rows are unpacked when asked for
    (a table read a few rows at a time, such as the engram tables, never holds a byte per weight)."""

    packed: np.ndarray  # (out, row bytes) uint8, a view of the file
    norms: np.ndarray  # (out, in_pad // group) float16, a view of the file
    codebook: np.ndarray  # (levels,) float32, already divided by sqrt(group)
    bits: int  # the record's bits field (TERNARY_RECORD_BITS for the ternary crumbs)
    group: int
    shape: tuple[int, int]  # logical (out, in)

    @property
    def in_pad(self) -> int:
        return -(-self.shape[1] // self.group) * self.group

    @property
    def field_bits(self) -> int:
        """Bits per packed field: the record's, 2 for the ternary record's crumbs."""
        return 2 if self.bits == TERNARY_RECORD_BITS else self.bits

    def field_codes(self) -> np.ndarray:
        """The level index (uint8) of each packed field value: the value itself; for the ternary
        crumbs 3 -> 0, 0 -> 1, 1 -> 2 (2 is no level: the file is refused when read)."""
        values = np.arange(1 << self.field_bits)
        if self.bits == TERNARY_RECORD_BITS:
            values = np.where(values == 3, 0, np.minimum(values + 1, 2))
        return values.astype(np.uint8)

    def codes(self, rows=None) -> np.ndarray:
        """(len(rows), in_pad) uint8 level indices of the given rows (all rows by default)."""
        packed = self.packed if rows is None else self.packed[rows]
        fields = unpack_lsb(packed, self.field_bits, self.in_pad)
        return self.field_codes()[fields] if self.bits == TERNARY_RECORD_BITS else fields

    def rows(self, rows) -> np.ndarray:
        """The given rows dequantised, float32 (len(rows), in): exactly those of the whole matrix."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        return dequantize_rows(self.codes(rows), self.norms[rows], self.codebook, self.group, self.shape[1])


@functools.lru_cache(maxsize=None)
def walsh_hadamard(n: int) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix divided by sqrt(n), float32 (n a power of two); one
    read-only array per n (a decoder step dequantises its input rows with it)."""
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    h = (h / np.sqrt(n)).astype(np.float32)
    h.setflags(write=False)
    return h


def analytic_codebook(bits: int, group: int) -> np.ndarray:
    """The codebooks not stored in the header: binary and ternary (export.py docstring)."""
    if bits == 1:
        levels = np.array([-np.sqrt(2.0 / np.pi), np.sqrt(2.0 / np.pi)])
    elif bits == TERNARY_RECORD_BITS:
        levels = np.array([-TERNARY_LEVEL, 0.0, TERNARY_LEVEL])
    else:
        raise ValueError(bits)
    return (levels / np.sqrt(group)).astype(np.float32)


def _packed_row_bytes(in_pad: int, bits: int) -> int:
    return in_pad * (2 if bits == TERNARY_RECORD_BITS else bits) // 8


def unpack_lsb(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """(rows, bytes) uint8 LSB-first bitstreams -> (rows, count) uint8 fields of `bits` bits."""
    if 8 % bits == 0:   # whole fields per byte: field j of a byte is (byte >> j * bits) & mask
        per, mask = 8 // bits, (1 << bits) - 1
        out = np.empty((packed.shape[0], packed.shape[1], per), np.uint8)
        for j in range(per):
            np.bitwise_and(packed >> np.uint8(j * bits), np.uint8(mask), out=out[:, :, j])
        return np.ascontiguousarray(out.reshape(packed.shape[0], -1)[:, :count])
    stream = np.unpackbits(packed, axis=1, bitorder="little")[:, : count * bits]
    fields = stream.reshape(packed.shape[0], count, bits)
    weights = (1 << np.arange(bits, dtype=np.uint16)).astype(np.uint8)
    return (fields * weights).sum(axis=2, dtype=np.uint16).astype(np.uint8)


def hadamard_mlp_shapes(width: int, hada_n: int) -> dict[str, tuple[int, ...]]:
    ba, bb = hadamard_blocks(hada_n)
    shapes = {k: (hada_n,) for k in ("d1", "d2", "b2", "d3", "d4")}
    for s in (1, 2, 3):
        shapes[f"w{s}a"], shapes[f"w{s}b"] = (ba, ba), (bb, bb)
    shapes["cond_v"] = (width, HADAMARD_COND_RANK)
    shapes["cond_u"] = (HADAMARD_COND_RANK, hada_n)
    return shapes


def decoder_layout(h: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, kind, shape) of records 0 .. final_norm, from the header alone (guide §5)."""
    W, L, n = h["d_model"], h["num_layers"], h["mhc_lanes"]
    heads, kv, qk, v = h["num_heads"], h["num_kv_heads"], h["qk_head_dim"], h["v_head_dim"]
    taps = h["qkv_conv_taps"]
    hada = hadamard_mlp_shapes(W, h["hada_n"])
    out = [("embedding", "cq", (h["vocab"], W))]
    for i in range(L):
        p = f"layer{i:02d}."
        out += [(p + "norm_in", "fp16", (W,)), (p + "q_proj", "cq", (heads * qk, W)),
                (p + "k_proj", "cq", (kv * qk, W)), (p + "v_proj", "cq", (kv * v, W))]
        if taps:
            out += [(p + "q_taps", "fp16", (taps, heads * qk)), (p + "k_taps", "fp16", (taps, kv * qk)),
                    (p + "v_taps", "fp16", (taps, kv * v))]
        out += [(p + "q_norm", "fp16", (qk,)), (p + "k_norm", "fp16", (qk,)),
                (p + "gate_proj", "cq", (heads * v, W)), (p + "out_proj", "cq", (W, heads * v)),
                (p + "post_norm", "fp16", (W,)), (p + "attn_gate", "fp16", (1,)),
                (p + "pre_hada", "fp16", (W,))]
        out += [(p + k, "fp16", hada[k]) for k in HADAMARD_MLP_TENSORS]
    out += _mhc_layout("", L, n, W)
    out += [("hada_p1", "fp32", (h["hada_n"],)), ("hada_p2", "fp32", (h["hada_n"],))]
    tables, sub = h["num_engram_tables"], h["engram_sub_dim"]
    for s in range(h["num_engram_sites"]):
        out += [(f"engram{s}.tables", "cq", (tables * h["engram_slots"], sub)),
                (f"engram{s}.key_proj", "cq", (W, tables * sub)),
                (f"engram{s}.value_proj", "cq", (W, tables * sub)),
                (f"engram{s}.taps", "fp16", (h["engram_conv_taps"], W))]
    out.append(("final_norm", "fp16", (W,)))
    return out


def _mhc_layout(prefix: str, L: int, n: int, W: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(f"{prefix}mhc_a_pre", "fp16", (L,)), (f"{prefix}mhc_a_post", "fp16", (L,)),
            (f"{prefix}mhc_a_res", "fp16", (L,)), (f"{prefix}mhc_b_pre", "fp16", (L, n)),
            (f"{prefix}mhc_b_post", "fp16", (L, n)), (f"{prefix}mhc_b_res", "fp16", (L, n, n)),
            (f"{prefix}mhc_phi_pre", "cq", (L * n, n * W)), (f"{prefix}mhc_phi_post", "cq", (L * n, n * W)),
            (f"{prefix}mhc_phi_res", "cq", (L * n * n, n * W))]


def speech_layout(h: dict, m: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, kind, shape) of the records after final_norm: manifest .. tokenizer (guide §5)."""
    W, L = h["d_model"], h["num_layers"]
    heads, kv, qk, v = h["num_heads"], h["num_kv_heads"], h["qk_head_dim"], h["v_head_dim"]
    hada = hadamard_mlp_shapes(W, h["hada_n"])
    out = [("audio.manifest", "fp32", (AUDIO_MANIFEST_LEN,))]
    for i in range(L):
        p = f"layer{i:02d}."
        # Cross-attention: 8 heads for Q, K and V alike, no grouping (guide §4).
        out += [(p + "cross_norm", "fp16", (W,)), (p + "cross.q_proj", "cq", (heads * qk, W)),
                (p + "cross.k_proj", "cq", (heads * qk, W)), (p + "cross.v_proj", "cq", (heads * v, W)),
                (p + "cross.gate_proj", "cq", (heads * v, W)), (p + "cross.out_proj", "cq", (W, heads * v)),
                (p + "cross_q_norm", "fp16", (qk,)), (p + "cross_k_norm", "fp16", (qk,)),
                (p + "post_cross_norm", "fp16", (W,)), (p + "cross_gate", "fp16", (1,))]
    out.append(("pe_gate", "fp16", (1,)))
    E, n = m["enc_layers"], m["enc_lanes"]
    for i in range(E):
        p = f"encoder{i:02d}."
        out += [(p + k, "fp16", (W,)) for k in ("pre_hada_norm_0", "ZCRMSNorm_0", "post_attn_norm",
                                                 "conv_norm", "conv_out_norm", "pre_hada_norm")]
        out += [(p + "q_proj", "cq", (heads * qk, W)), (p + "k_proj", "cq", (kv * qk, W)),
                (p + "v_proj", "cq", (kv * v, W)), (p + "gate_proj", "cq", (heads * v, W)),
                (p + "out_proj", "cq", (W, heads * v)), (p + "q_norm", "fp16", (qk,)),
                (p + "k_norm", "fp16", (qk,)), (p + "attn_gate", "fp16", (1,)),
                (p + "pw1", "cq", (2 * W, W)), (p + "pw2", "cq", (W, W)),
                (p + "dw", "fp16", (m["conv_kernel"], W))]
        for mlp in ("hadamard_mlp_0", "hadamard_mlp"):
            out += [(f"{p}{mlp}.{k}", "fp16", hada[k]) for k in HADAMARD_MLP_TENSORS]
    out += _mhc_layout("encoder.", E, n, W)
    out.append(("encoder.final_norm", "fp16", (W,)))
    stem = m["stem"]
    out.append(("stem.w", "fp16", (9, stem)))
    for i in range(1, m["stem_stages"]):
        out += [(f"stem.dw_{i}", "fp16", (9, stem)), (f"stem.pw_{i}", "cq", (stem, stem))]
    mels = m["mels"]
    for _ in range(m["stem_stages"]):
        mels = (mels + 1) // 2
    out.append(("stem.out", "cq", (W, stem * mels)))
    out.append(("mel", "fp32", (m["fft"] // 2 + 1, m["mels"])))
    out.append(("tokenizer", "raw", ()))
    return out


_KIND_DTYPE = {"fp16": FP16, "fp32": FP32, "cq": CQ, "raw": RAW}
_MANIFEST_FIELDS = ("magic", "version", "text", "enc_layers", "enc_lanes", "conv_kernel", "stem",
                    "stem_stages", "mels", "rate", "fft", "win", "hop")


class CactFile:
    """A memory-mapped, validated Whistle .cact file.

    Raises ModelFormatError for anything that is not a speech-model .cact in the positional order
    of guide §5, naming what was wrong.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < HEADER.size:
                    raise ModelFormatError(
                        f"{self.path}: {size} bytes is too short for a .cact header ({HEADER.size} bytes)")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFormatError(f"{self.path}: cannot read model file ({e.strerror or e})") from e
        self.size = size
        self._buf = memoryview(self._mm)
        self._parse()

    # ---- parsing -------------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        raise ModelFormatError(f"{self.path}: {message}")

    def _parse(self) -> None:
        values = HEADER.unpack_from(self._buf, 0)
        if values[0] != TAG:
            self._fail(f"not a .cact model (tag 0x{values[0]:08X}, expected 0x{TAG:08X})")
        h = dict(zip(_HEADER_FIELDS, values[:27]))
        h["engram_orders"] = tuple(values[27:31][: values[26]])
        h["num_engram_sites"] = values[31]
        h["engram_sites"] = tuple(values[32:48][: values[31]])
        h["rope_theta"] = float(values[48])
        self.header = h
        self._check_header(h, values)

        cb_len = h["codebook_len"]
        if cb_len != sum(1 << b for b in CODEBOOK_BITS):
            self._fail(f"codebook length {cb_len}, expected {sum(1 << b for b in CODEBOOK_BITS)} (cb2|cb3|cb4)")
        dir_start = HEADER.size + 4 * cb_len
        n = h["num_tensors"]
        if dir_start + n * RECORD.size > self.size:
            self._fail(f"truncated: the directory of {n} records needs {dir_start + n * RECORD.size} bytes, "
                       f"the file has {self.size}")
        cb = np.frombuffer(self._buf, np.float32, cb_len, HEADER.size)
        self._codebooks = {}
        start = 0
        for bits in CODEBOOK_BITS:
            part = cb[start:start + (1 << bits)]
            start += 1 << bits
            if not np.all(np.isfinite(part)) or np.any(np.diff(part) <= 0):
                self._fail(f"the {bits}-bit codebook is not finite and strictly increasing")
            self._codebooks[bits] = part

        raw = [RECORD.unpack_from(self._buf, dir_start + i * RECORD.size) for i in range(n)]
        layout = decoder_layout(h)
        mi = len(layout)
        if n <= mi:
            self._fail(f"{n} records cannot hold a speech model: the decoder alone takes {mi} and the audio "
                       f"manifest should be record {mi}")
        manifest_rec = self._record(mi, "audio.manifest", raw[mi])
        if manifest_rec.dtype != FP32 or manifest_rec.shape != (AUDIO_MANIFEST_LEN,):
            self._fail(f"record {mi}: expected audio.manifest (FP32, 13 values), found "
                       f"{manifest_rec.kind} {manifest_rec.shape}; this is not a speech (Whistle) model")
        self._check_extent(manifest_rec)
        mvals = np.frombuffer(self._buf, np.float32, AUDIO_MANIFEST_LEN, manifest_rec.offset)
        if mvals[0] != AUDIO_MANIFEST_MAGIC:
            self._fail(f"record {mi}: audio manifest magic {mvals[0]!r}, expected {AUDIO_MANIFEST_MAGIC:g}")
        if not np.all(np.isfinite(mvals)) or np.any(mvals != np.round(mvals)) or np.any(mvals < 0):
            self._fail(f"record {mi}: audio manifest values must be non-negative integers, found {mvals.tolist()}")
        m = dict(zip(_MANIFEST_FIELDS, (int(x) for x in mvals)))
        self.manifest = m
        self._check_manifest(m)
        layout = layout + speech_layout(h, m)
        if n != len(layout):
            self._fail(f"{n} records, expected {len(layout)} for this header and audio manifest "
                       f"({h['num_layers']} decoder / {m['enc_layers']} encoder layers, "
                       f"{h['num_engram_sites']} engram sites)")
        self.records = [self._checked(i, spec, raw[i]) for i, spec in enumerate(layout)]
        groups = {r.group for r in self.records if r.dtype == CQ}
        if len(groups) > 1:
            self._fail(f"CQ records use group sizes {sorted(groups)}; the shared codebooks fit one group size")
        self.names = tuple(r.name for r in self.records)
        self._by_name = {r.name: r for r in self.records}
        self.tokenizer_blob = bytes(self._bytes(self._by_name["tokenizer"]))
        self.dims = self._dims(h, m)

    def _check_header(self, h: dict, values: tuple) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                self._fail(f"bad header: {what}")

        need(values[26] <= 4, f"{values[26]} engram orders (at most 4)")
        need(values[31] <= 16, f"{values[31]} engram sites (at most 16)")
        need(np.isfinite(h["rope_theta"]) and h["rope_theta"] > 0, f"rope_theta {h['rope_theta']}")
        for key in ("vocab", "d_model", "num_heads", "num_kv_heads", "num_layers", "qk_head_dim",
                    "v_head_dim", "max_seq_len", "hada_n", "mhc_lanes"):
            need(0 < h[key] <= 1 << 20, f"{key} = {h[key]}")
        need(h["d_model"] % h["v_head_dim"] == 0, f"d_model {h['d_model']} is not a multiple of v_head_dim "
             f"{h['v_head_dim']}")
        # Guide §4: heads are width / v_dim, never width / qk_dim.
        need(h["num_heads"] == h["d_model"] // h["v_head_dim"],
             f"num_heads {h['num_heads']} != d_model / v_head_dim = {h['d_model'] // h['v_head_dim']}")
        need(h["num_heads"] % h["num_kv_heads"] == 0,
             f"num_heads {h['num_heads']} is not a multiple of num_kv_heads {h['num_kv_heads']}")
        need(h["qk_head_dim"] % 2 == 0, f"qk_head_dim {h['qk_head_dim']} must be even for RoPE")
        need(h["hada_n"] == 1 << (h["d_model"] - 1).bit_length(),
             f"hada_n {h['hada_n']} is not the power of two above d_model {h['d_model']}")
        need(h["qkv_conv_taps"] <= 16, f"qkv_conv_taps {h['qkv_conv_taps']}")
        need(h["sliding_window"] == 0, f"sliding_window {h['sliding_window']}: Whistle's decoder attends over "
             "the whole transcript (guide §4)")
        need(h["engram_conv_taps"] == ENGRAM_CONV_TAPS, f"engram_conv_taps {h['engram_conv_taps']}, expected "
             f"{ENGRAM_CONV_TAPS}")
        need(all(0 < o <= 8 for o in h["engram_orders"]), f"engram orders {h['engram_orders']}")
        need(all(s < h["num_layers"] for s in h["engram_sites"]), f"engram sites {h['engram_sites']} beyond "
             f"{h['num_layers']} layers")
        need(list(h["engram_sites"]) == sorted(set(h["engram_sites"])), f"engram sites {h['engram_sites']} "
             "not strictly increasing")
        if h["num_engram_sites"]:
            need(len(h["engram_orders"]) > 0 and h["num_engram_tables"] % len(h["engram_orders"]) == 0,
                 f"{h['num_engram_tables']} engram tables for {len(h['engram_orders'])} orders")
            need(0 < h["engram_slots"] <= 1 << 24 and 0 < h["engram_sub_dim"] <= 1 << 16,
                 f"engram slots {h['engram_slots']}, sub_dim {h['engram_sub_dim']}")
            need(h["engram_conv_dilation"] == max(h["engram_orders"]),
                 f"engram_conv_dilation {h['engram_conv_dilation']} != max order {max(h['engram_orders'])}")
        need(h["kv_bits"] in (2, 3, 4, 8), f"kv_bits {h['kv_bits']}")
        need(h["num_tensors"] <= 100_000, f"{h['num_tensors']} records")

    def _check_manifest(self, m: dict) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                self._fail(f"bad audio manifest: {what}")

        need(0 < m["enc_layers"] <= 256, f"enc_layers {m['enc_layers']}")
        need(0 < m["enc_lanes"] <= 64, f"enc_lanes {m['enc_lanes']}")
        need(m["conv_kernel"] % 2 == 1, f"conv_kernel {m['conv_kernel']} must be odd")
        need(0 < m["stem"] <= 4096 and 0 < m["stem_stages"] <= 8, f"stem {m['stem']} x {m['stem_stages']}")
        need(0 < m["mels"] <= 1024, f"mels {m['mels']}")
        need(m["fft"] >= m["win"] > 0 and m["fft"] & (m["fft"] - 1) == 0, f"fft {m['fft']}, win {m['win']}")
        need(0 < m["hop"] and 0 < m["rate"] <= 192000, f"rate {m['rate']}, hop {m['hop']}")
        need(0 < m["text"] <= self.header["vocab"], f"text vocabulary {m['text']} vs vocab {self.header['vocab']}")

    def _record(self, index: int, name: str, rec: tuple) -> Record:
        dtype, ndim, _pad, s0, s1, s2, s3, offset, nbytes, group, bits = rec
        if ndim > 4:
            self._fail(f"record {index} ({name}): ndim {ndim} > 4")
        return Record(index, name, dtype, (s0, s1, s2, s3)[:ndim], offset, nbytes, group, bits)

    def _check_extent(self, r: Record) -> None:
        if r.offset % ALIGN:
            self._fail(f"record {r.index} ({r.name}): offset {r.offset} is not {ALIGN}-byte aligned")
        if r.offset + r.nbytes > self.size:
            self._fail(f"record {r.index} ({r.name}): bytes {r.offset}..{r.offset + r.nbytes} lie outside "
                       f"the file of {self.size} bytes")

    def _checked(self, index: int, spec: tuple, rec: tuple) -> Record:
        name, kind, shape = spec
        r = self._record(index, name, rec)
        want = _KIND_DTYPE[kind]
        if r.dtype != want or (kind != "raw" and r.shape != shape):
            found = f"{r.kind} {r.shape}" if r.dtype in DTYPE_NAMES else f"dtype code {r.dtype}"
            self._fail(f"record {index}: expected {name} ({kind.upper()} {shape}), found {found}")
        self._check_extent(r)
        count = int(np.prod(shape)) if shape else 0
        if kind == "fp16" and r.nbytes != 2 * count or kind == "fp32" and r.nbytes != 4 * count:
            self._fail(f"record {index} ({name}): {r.nbytes} bytes for {kind.upper()} {shape}")
        if kind == "cq":
            if r.bits not in CQ_BITS:
                self._fail(f"record {index} ({name}): CQ width {r.bits}, accepted {CQ_BITS}")
            if r.group < 8 or r.group & (r.group - 1) or r.group > 1 << 16:
                self._fail(f"record {index} ({name}): CQ group {r.group} is not a power of two >= 8")
            out, in_dim = shape
            in_pad = -(-in_dim // r.group) * r.group
            expect = out * _packed_row_bytes(in_pad, r.bits) + out * (in_pad // r.group) * 2
            if r.nbytes != expect:
                self._fail(f"record {index} ({name}): {r.nbytes} bytes, a CQ{r.bits} {shape} matrix in groups "
                           f"of {r.group} takes {expect}")
        return r

    def _dims(self, h: dict, m: dict) -> Dims:
        from .tokenizer import Tokenizer

        tok = Tokenizer.from_blob(self.tokenizer_blob)
        self.tokenizer = tok  # parsed once here; the engine reuses it
        languages = tuple(tok.languages)
        if tok.vocab_size != h["vocab"]:
            self._fail(f"tokenizer has {tok.vocab_size} pieces, the header's vocabulary is {h['vocab']}")
        if not languages:
            self._fail("tokenizer has no trailing <|xx|> language pieces")
        text = h["vocab"] - len(languages)
        if m["text"] != text:
            self._fail(f"audio manifest says {m['text']} text pieces, the tokenizer has {text} before "
                       f"{len(languages)} language tags")
        for special in (tok.bos, tok.eos):
            if not 0 <= special < text:
                self._fail(f"special id {special} outside the text vocabulary of {text}")
        return Dims(
            vocab=h["vocab"], text_vocab=text, width=h["d_model"], heads=h["d_model"] // h["v_head_dim"],
            kv_heads=h["num_kv_heads"], qk_dim=h["qk_head_dim"], v_dim=h["v_head_dim"],
            dec_layers=h["num_layers"], rope_theta=h["rope_theta"], max_tokens=h["max_seq_len"],
            hada_n=h["hada_n"], lanes=h["mhc_lanes"], taps=h["qkv_conv_taps"], kv_bits=h["kv_bits"],
            kv_window=h["kv_window"], engram_slots=h["engram_slots"], engram_sub_dim=h["engram_sub_dim"],
            engram_tables=h["num_engram_tables"], engram_conv_taps=h["engram_conv_taps"],
            engram_dilation=h["engram_conv_dilation"], engram_seed_heads=h["engram_seed_heads"],
            engram_orders=h["engram_orders"], engram_sites=h["engram_sites"],
            enc_layers=m["enc_layers"], enc_lanes=m["enc_lanes"], conv_kernel=m["conv_kernel"],
            stem=m["stem"], stem_stages=m["stem_stages"], mels=m["mels"], rate=m["rate"], fft=m["fft"],
            win=m["win"], hop=m["hop"], languages=languages, bos=tok.bos, eos=tok.eos, pad=tok.pad,
            unk=tok.unk,
        )

    # ---- access --------------------------------------------------------------------------
    def record(self, name: str) -> Record:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no record named {name!r} in {self.path}") from None

    def _bytes(self, r: Record) -> memoryview:
        return self._buf[r.offset:r.offset + r.nbytes]

    def array(self, name: str) -> np.ndarray:
        """The record as float32: FP32 a read-only view of the file, FP16 and CQ decoded copies."""
        r = self.record(name)
        if r.dtype == FP32:
            return np.frombuffer(self._buf, np.float32, int(np.prod(r.shape)), r.offset).reshape(r.shape)
        if r.dtype == FP16:
            return np.frombuffer(self._buf, np.float16, int(np.prod(r.shape)), r.offset).reshape(
                r.shape).astype(np.float32)
        if r.dtype == CQ:
            return self.cq(name).dequantize()
        raise TypeError(f"record {name!r} is {r.kind}, not a numeric tensor")

    def cq(self, name: str) -> CQMatrix:
        """A CQ record with its level indices unpacked and its norms left in the file."""
        p = self.packed_cq(name)
        return CQMatrix(p.codes(), p.norms, p.codebook, p.bits, p.group, p.shape)

    def packed_cq(self, name: str) -> PackedCQ:
        """A CQ record left packed: its rows unpacked on demand, norms left in the file."""
        r = self.record(name)
        if r.dtype != CQ:
            raise TypeError(f"record {name!r} is {r.kind}, not CQ")
        out, in_dim = r.shape
        in_pad = -(-in_dim // r.group) * r.group
        row = _packed_row_bytes(in_pad, r.bits)
        packed = np.frombuffer(self._buf, np.uint8, out * row, r.offset).reshape(out, row)
        norms = np.frombuffer(self._buf, np.float16, out * (in_pad // r.group), r.offset + out * row)
        if r.bits == TERNARY_RECORD_BITS:
            # every crumb of the record, checked in the packed bytes (rows unpacked later must be levels)
            if any(np.any((packed >> shift) & 3 == 2) for shift in (0, 2, 4, 6)):
                self._fail(f"record {r.index} ({name}): ternary crumb code 2 is not a level (codes are 3, 0, 1)")
            codebook = analytic_codebook(r.bits, r.group)
        else:
            codebook = (analytic_codebook(1, r.group) if r.bits == 1 else self._codebook(r.bits, r.group))
        return PackedCQ(packed, norms.reshape(out, in_pad // r.group), codebook, r.bits, r.group, (out, in_dim))

    def _codebook(self, bits: int, group: int) -> np.ndarray:
        # The header stores each codebook already divided by sqrt(group) of the export's group size;
        # every record of a file shares that group, so the stored values are used as they are.
        return np.array(self._codebooks[bits], np.float32)

    def raw(self, name: str) -> bytes:
        r = self.record(name)
        if r.dtype != RAW:
            raise TypeError(f"record {name!r} is {r.kind}, not RAW")
        return bytes(self._bytes(r))

    @property
    def mel(self) -> np.ndarray:
        """The mel filterbank, (fft // 2 + 1, mels) float32 (guide §3 step 6)."""
        return self.array("mel")

    def bytes_by_kind(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for r in self.records:
            sizes[r.kind] = sizes.get(r.kind, 0) + r.nbytes
        return sizes

    def close(self) -> None:
        """Unmap the file once no array still views it (views keep the mapping alive otherwise)."""
        try:
            self._buf.release()
            self._mm.close()
        except BufferError:
            pass

    def __enter__(self) -> "CactFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CactFile({str(self.path)!r}, {len(self.records)} records)"
