"""The .cact reader: dims, positional order, CQ decoding, and refusal of bad files (guide §2, §4, §5)."""

from __future__ import annotations

import os
import struct
import tracemalloc

import numpy as np
import pytest

from whistle_stream.container import ALIGN, HEADER, RECORD, CactFile, unpack_lsb, walsh_hadamard
from whistle_stream.errors import ModelFormatError

export = pytest.importorskip("needle.model.export", reason="needs the cactus-needle reference")


def _dir_start(blob: bytes) -> int:
    return HEADER.size + 4 * struct.unpack_from("<I", blob, 8)[0]


def _rewrite_record(blob: bytes, index: int, **changes) -> bytes:
    names = ("dtype", "ndim", "pad", "s0", "s1", "s2", "s3", "offset", "nbytes", "group", "bits")
    pos = _dir_start(blob) + index * RECORD.size
    rec = dict(zip(names, RECORD.unpack_from(blob, pos)))
    rec.update(changes)
    out = bytearray(blob)
    RECORD.pack_into(out, pos, *(rec[n] for n in names))
    return bytes(out)


def _load(tmp_path, blob: bytes, name="m.cact") -> CactFile:
    path = tmp_path / name
    path.write_bytes(blob)
    return CactFile(path)


# ---- acceptance: the full shipped shape -------------------------------------------------------

@pytest.mark.slow
@pytest.mark.reference
def test_full_shape_reads_681_records_with_the_dims_of_section_4(full_model):
    f = CactFile(full_model.path)
    d = f.dims
    assert len(f.records) == 681
    assert f.names[237] == "audio.manifest" and f.names[679] == "mel" and f.names[680] == "tokenizer"
    assert d.vocab == d.text_vocab + len(d.languages) and d.languages == ("en", "de", "fr", "es", "it", "nl", "pl")
    assert (d.width, d.heads, d.qk_dim, d.kv_heads, d.v_dim) == (512, 8, 48, 2, 64)
    assert (d.dec_layers, d.enc_layers, d.rope_theta, d.max_tokens, d.lanes, d.taps) == (8, 8, 100000.0, 320, 4, 3)
    assert (d.engram_sites, d.engram_orders, d.engram_slots) == ((3, 7), (2, 3), 18432)
    assert (d.bos, d.eos) == (2, 1)
    assert d.frame_seconds == pytest.approx(0.08)


@pytest.mark.reference
@pytest.mark.parametrize("shape", ["tiny", "odd", pytest.param("full", marks=pytest.mark.slow)])
def test_every_record_equals_the_reference_reader(shape, request):
    model = request.getfixturevalue(f"{shape}_model")
    f = CactFile(model.path)
    _, tensors = export.read_export(str(model.path))
    assert len(tensors) == len(f.records)
    for record, want in zip(f.records, tensors):
        if record.kind == "RAW":
            assert f.raw(record.name) == want
            continue
        got = f.array(record.name)
        assert got.shape == want.shape, record.name
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=record.name)


@pytest.mark.reference
def test_matrices_are_stored_at_the_shipped_widths(tiny_model):
    f = CactFile(tiny_model.path)
    for r in f.records:
        if r.dtype == 3:
            want = 4 if r.name == "embedding" or "mhc_phi" in r.name else 2
            assert r.bits == want, r.name


# ---- the traps of section 4 -------------------------------------------------------------------

@pytest.mark.reference
def test_heads_come_from_width_over_v_dim_not_qk_dim(odd_model):
    d = CactFile(odd_model.path).dims
    assert d.heads == d.width // d.v_dim
    assert d.width // d.qk_dim != d.heads  # the odd shape makes the wrong rule visible


@pytest.mark.reference
def test_cross_attention_keys_use_all_heads_without_grouping(odd_model):
    f = CactFile(odd_model.path)
    d = f.dims
    assert f.record("layer00.cross.k_proj").shape == (d.heads * d.qk_dim, d.width)
    assert f.record("layer00.k_proj").shape == (d.kv_heads * d.qk_dim, d.width)


@pytest.mark.reference
def test_encoder_has_no_conv_taps_but_the_decoder_does(tiny_model):
    f = CactFile(tiny_model.path)
    assert f.dims.taps == 3
    assert "layer00.q_taps" in f.names
    assert not any(n.startswith("encoder") and "taps" in n for n in f.names)


@pytest.mark.reference
def test_languages_are_the_trailing_tag_pieces_and_vocab_counts_them(tiny_model):
    f = CactFile(tiny_model.path)
    d = f.dims
    assert d.languages == tuple(tiny_model.cfg.languages)
    assert d.text_vocab == tiny_model.cfg.text and d.vocab == tiny_model.cfg.vocab
    assert d.language_id(d.languages[-1]) == d.vocab - 1
    with pytest.raises(ValueError, match="knows"):
        d.language_id("xx")


@pytest.mark.reference
def test_bos_and_eos_come_from_the_tokenizer_header(tiny_model):
    d = CactFile(tiny_model.path).dims
    assert (d.bos, d.eos, d.pad, d.unk) == (2, 1, 0, 3)


# ---- memory -----------------------------------------------------------------------------------

@pytest.mark.reference
def test_fp32_records_are_read_only_views_of_the_mapping(tiny_model):
    f = CactFile(tiny_model.path)
    mel = f.mel
    assert not mel.flags.writeable and not mel.flags.owndata
    assert mel.shape == (f.dims.fft // 2 + 1, f.dims.mels)


@pytest.mark.reference
def test_opening_a_model_does_not_copy_its_weights(odd_model):
    size = os.path.getsize(odd_model.path)
    tracemalloc.start()
    CactFile(odd_model.path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < size / 4, (peak, size)


@pytest.mark.parametrize("shape", ["tiny", "odd"])
def test_packed_cq_rows_are_the_unpacked_records_rows(shape, request):
    """An engram table stays packed (PackedCQ): any rows it unpacks equal those rows of the whole
    record unpacked, and the packed bytes are a view of the file, not a copy."""
    f = CactFile(request.getfixturevalue(f"{shape}_model").path)
    for name in [r.name for r in f.records if r.kind.startswith("CQ")][:6] + ["engram0.tables"]:
        packed, whole = f.packed_cq(name), f.cq(name)
        rows = np.random.default_rng(0).integers(0, whole.shape[0], 9)
        assert np.array_equal(packed.codes(rows), whole.codes[rows])
        assert np.array_equal(packed.codes(), whole.codes)
        assert not packed.packed.flags.owndata and packed.norms.shape == whole.norms.shape


@pytest.mark.parametrize("shape", ["tiny", "odd", "full"])
def test_packed_rows_dequantise_to_exactly_the_whole_matrixs_rows(shape, request):
    """The decoder's input rows are dequantised as tokens are fed (PackedCQ.rows): each equals,
    bit for bit, that row of the whole record dequantised (the table the decoder held before)."""
    f = CactFile(request.getfixturevalue(f"{shape}_model").path)
    for name in ("embedding", "layer00.q_proj", "engram0.tables"):
        packed, whole = f.packed_cq(name), f.array(name)
        for rows in (np.arange(whole.shape[0]), np.array([3]), np.random.default_rng(1).integers(0, whole.shape[0], (5, 1))):
            got = packed.rows(rows)
            assert got.dtype == np.float32 and np.array_equal(got, whole[rows.reshape(-1)]), (name, rows.shape)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_unpacking_reads_each_field_lsb_first(bits):
    """unpack_lsb (a shift and mask per field where fields fill whole bytes) against reading the
    bitstream one bit at a time, with and without a partial last byte."""
    packed = np.random.default_rng(bits).integers(0, 256, (6, 24), dtype=np.uint8)
    for count in (24 * 8 // bits, 24 * 8 // bits - 3):
        want = np.zeros((6, count), np.uint8)
        for r in range(6):
            for i in range(count):
                for b in range(bits):
                    k = i * bits + b
                    want[r, i] |= ((int(packed[r, k // 8]) >> (k % 8)) & 1) << b
        got = unpack_lsb(packed, bits, count)
        assert got.flags.c_contiguous and np.array_equal(got, want)


def test_walsh_hadamard_is_orthonormal_and_symmetric():
    h = walsh_hadamard(128)
    np.testing.assert_allclose(h @ h, np.eye(128), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)


# ---- bad files --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_blob(tiny_model) -> bytes:
    return tiny_model.path.read_bytes()


def test_a_file_that_is_not_a_cact_is_refused(tmp_path):
    with pytest.raises(ModelFormatError, match="not a .cact"):
        _load(tmp_path, b"RIFF" + bytes(400))
    with pytest.raises(ModelFormatError, match="too short"):
        _load(tmp_path, b"\x84\x2a\xe1\x05")
    with pytest.raises(ModelFormatError, match="cannot read"):
        CactFile(tmp_path / "missing.cact")


@pytest.mark.reference
@pytest.mark.parametrize("keep", [0.02, 0.3, 0.6, 0.999])
def test_truncated_files_are_refused(tmp_path, good_blob, keep):
    with pytest.raises(ModelFormatError, match="truncated|outside the file|too short"):
        _load(tmp_path, good_blob[: int(len(good_blob) * keep)])


@pytest.mark.reference
def test_a_wrong_record_count_is_refused(tmp_path, good_blob):
    blob = bytearray(good_blob)
    n = struct.unpack_from("<I", blob, 4)[0]
    struct.pack_into("<I", blob, 4, n - 1)
    with pytest.raises(ModelFormatError, match=f"{n - 1} records, expected {n}"):
        _load(tmp_path, bytes(blob))


@pytest.mark.reference
def test_records_out_of_order_are_refused_naming_index_expected_and_found(tmp_path, good_blob):
    pos = _dir_start(good_blob)
    a, b = 1, 2  # layer00.norm_in (FP16) and layer00.q_proj (CQ)
    blob = bytearray(good_blob)
    rec_a = bytes(blob[pos + a * RECORD.size: pos + (a + 1) * RECORD.size])
    blob[pos + a * RECORD.size: pos + (a + 1) * RECORD.size] = blob[pos + b * RECORD.size: pos + (b + 1) * RECORD.size]
    blob[pos + b * RECORD.size: pos + (b + 1) * RECORD.size] = rec_a
    with pytest.raises(ModelFormatError, match=r"record 1: expected layer00\.norm_in \(FP16 .*\), found CQ2"):
        _load(tmp_path, bytes(blob))


@pytest.mark.reference
def test_an_offset_outside_the_file_is_refused(tmp_path, good_blob):
    with pytest.raises(ModelFormatError, match="outside the file"):
        _load(tmp_path, _rewrite_record(good_blob, 3, offset=len(good_blob) // ALIGN * ALIGN + ALIGN))


@pytest.mark.reference
def test_a_misaligned_blob_is_refused(tmp_path, good_blob):
    off = RECORD.unpack_from(good_blob, _dir_start(good_blob) + 3 * RECORD.size)[7]
    with pytest.raises(ModelFormatError, match="not 64-byte aligned"):
        _load(tmp_path, _rewrite_record(good_blob, 3, offset=off + 2))


@pytest.mark.reference
def test_a_cq_record_whose_size_disagrees_with_its_shape_is_refused(tmp_path, good_blob):
    nbytes = RECORD.unpack_from(good_blob, _dir_start(good_blob) + 2 * RECORD.size)[8]
    with pytest.raises(ModelFormatError, match="CQ2 .* takes"):
        _load(tmp_path, _rewrite_record(good_blob, 2, nbytes=nbytes - 8))


@pytest.mark.reference
def test_an_unknown_cq_width_is_refused(tmp_path, good_blob):
    with pytest.raises(ModelFormatError, match="CQ width 7"):
        _load(tmp_path, _rewrite_record(good_blob, 2, bits=7))


@pytest.mark.reference
def test_a_ternary_crumb_that_is_not_a_level_is_refused_packed_or_unpacked(tmp_path, good_blob):
    """A CQ2 record relabelled ternary (the same 2-bit crumbs, as many bytes) holds crumb code 2,
    which no ternary level has: refused when the record is read, whether it stays packed (the
    engram tables) or is unpacked."""
    f = CactFile(_write(tmp_path, _rewrite_record(good_blob, 2, bits=5)))
    name = f.records[2].name
    for read in (f.packed_cq, f.cq):
        with pytest.raises(ModelFormatError, match=f"record 2 \\({name}\\): ternary crumb code 2 is not a level"):
            read(name)


@pytest.mark.reference
def test_a_wrong_tag_is_refused(tmp_path, good_blob):
    with pytest.raises(ModelFormatError, match="tag 0x"):
        _load(tmp_path, b"\x00\x00\x00\x00" + good_blob[4:])


@pytest.mark.reference
def test_a_bad_audio_manifest_is_refused(tmp_path, good_blob):
    f = CactFile(_write(tmp_path, good_blob))
    r = f.record("audio.manifest")
    blob = bytearray(good_blob)
    struct.pack_into("<f", blob, r.offset, 1234.0)
    with pytest.raises(ModelFormatError, match="manifest magic"):
        _load(tmp_path, bytes(blob), "b.cact")


@pytest.mark.reference
def test_a_tokenizer_blob_with_bad_lengths_is_refused(tmp_path, good_blob):
    f = CactFile(_write(tmp_path, good_blob))
    r = f.record("tokenizer")
    blob = bytearray(good_blob)
    struct.pack_into("<I", blob, r.offset, 10**6)  # more pieces than the blob holds
    with pytest.raises(ModelFormatError):
        _load(tmp_path, bytes(blob), "b.cact")


def _write(tmp_path, blob: bytes):
    path = tmp_path / "good.cact"
    path.write_bytes(blob)
    return path


@pytest.mark.reference
def test_fuzzed_headers_and_directories_load_or_raise_model_format_error(tmp_path, good_blob):
    rng = np.random.default_rng(1234)
    end = _dir_start(good_blob) + 200 * RECORD.size
    path = tmp_path / "fuzz.cact"
    size = len(good_blob)
    for trial in range(300):
        blob = bytearray(good_blob if trial % 10 else good_blob[: rng.integers(1, size)])
        for _ in range(rng.integers(1, 6)):
            pos = int(rng.integers(0, min(end, len(blob))))
            blob[pos] = int(rng.integers(0, 256))
        path.write_bytes(bytes(blob))
        tracemalloc.start()
        try:
            f = CactFile(path)
            for name in f.names[:12]:
                if f.record(name).kind != "RAW":
                    f.array(name)
        except ModelFormatError:
            pass
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert peak < 4 * size, f"trial {trial}: peak {peak} bytes"
