"""The reference harness itself: built files, perturbation, numerics and the decode oracles."""
import struct

import numpy as np
import pytest

from harness import audio


# ------------------------------------------------------------------------------------------------
# Expected .cact layout, derived here from the config and guide §5 (not from export.py)

def _expected_records(cfg):
    decoder_layer = 24 + (3 if cfg.taps else 0)      # 12 tensors + 13 Hadamard (+ q/k/v taps)
    return (1 + cfg.dec_layers * decoder_layer + 9 + 2 + 4 * len(cfg.sites) + 1   # text decoder
            + 1 + 10 * cfg.dec_layers + 1                                          # manifest, cross, pe_gate
            + 43 * cfg.enc_layers + 10                                             # encoder blocks, mHC, norm
            + 2 * cfg.stem_stages + 1 + 1)                                         # stem, mel, tokenizer


def _cq4_positions(cfg):
    decoder_layer = 24 + (3 if cfg.taps else 0)
    phi = 1 + cfg.dec_layers * decoder_layer + 6                # after the six mhc_a/b records
    encoder_end = _expected_records(cfg) - (2 * cfg.stem_stages + 1 + 1) - 1   # encoder.final_norm
    return {0, phi, phi + 1, phi + 2, encoder_end - 3, encoder_end - 2, encoder_end - 1}


def _directory(path):
    from needle.model import export
    raw = path.read_bytes()
    header = struct.unpack_from(export._HDR_FMT, raw, 0)
    offset = struct.calcsize(export._HDR_FMT) + 4 * header[2]
    records = []
    for _ in range(header[1]):
        rec = struct.unpack_from(export._REC_FMT, raw, offset)
        offset += export.REC_SIZE
        records.append({"dtype": rec[0], "shape": tuple(rec[3:3 + rec[1]]), "bits": rec[10]})
    return records


SHAPES = ["tiny", "odd", pytest.param("full", marks=pytest.mark.slow)]


@pytest.fixture(params=SHAPES)
def model(request, reference):
    return reference.build_model(request.param)


def test_full_shape_is_the_shipped_architecture(reference):
    from needle.model.whistle import WhistleConfig
    cfg, shipped = reference.shape_config("full"), WhistleConfig()
    for name in ("dim", "kv_heads", "qk_dim", "v_dim", "enc_layers", "dec_layers", "lanes", "enc_lanes", "taps",
                 "sites", "orders", "slots", "rope", "max_tokens", "stem", "conv_kernel", "languages"):
        assert getattr(cfg, name) == getattr(shipped, name), name
    assert cfg.heads == 8 and cfg.dtype == "float32"


def test_cact_reads_back_with_the_record_count_of_its_config(model):
    from needle.model.export import read_export
    info, tensors = read_export(str(model.path))
    assert info["num_tensors"] == len(tensors) == _expected_records(model.cfg)
    assert info["vocab_size"] == model.cfg.vocab == model.sp.get_piece_size() + len(model.cfg.languages)
    if model.shape == "full":
        assert info["num_tensors"] == 681


def test_matrices_are_cq2_except_embedding_and_lane_maps_at_cq4(model):
    records = _directory(model.path)
    cq = {i: r for i, r in enumerate(records) if r["dtype"] == 3}
    cq4 = {i for i, r in cq.items() if r["bits"] == 4}
    assert cq4 == _cq4_positions(model.cfg)
    assert all(r["bits"] == 2 for i, r in cq.items() if i not in cq4)
    assert records[0]["shape"] == (model.cfg.vocab, model.cfg.dim)
    lanes = {records[i]["shape"] for i in cq4 - {0}}
    assert lanes <= {(model.cfg.dec_layers * model.cfg.lanes, model.cfg.lanes * model.cfg.dim),
                     (model.cfg.dec_layers * model.cfg.lanes ** 2, model.cfg.lanes * model.cfg.dim),
                     (model.cfg.enc_layers * model.cfg.enc_lanes, model.cfg.enc_lanes * model.cfg.dim),
                     (model.cfg.enc_layers * model.cfg.enc_lanes ** 2, model.cfg.enc_lanes * model.cfg.dim)}


def test_file_weights_equal_the_quantised_reference_weights(tiny_model):
    from needle.model.export import read_export
    _, tensors = read_export(str(tiny_model.path))
    q = tiny_model.qparams
    embedding = q["embedding"]["embedding"]
    np.testing.assert_allclose(tensors[0], embedding, rtol=0, atol=1e-6 * np.abs(embedding).max())
    q_proj = q["stack"]["layers"]["block"]["self_attn"]["q_proj"]["kernel"][0].T   # [out, in]
    np.testing.assert_allclose(tensors[2], q_proj, rtol=0, atol=1e-6 * np.abs(q_proj).max())


def test_tokenizer_blob_matches_the_sentencepiece_model(tiny_model):
    from needle.model.export import RefTokenizer, read_export
    _, tensors = read_export(str(tiny_model.path))
    tok = RefTokenizer.from_cact(str(tiny_model.path))
    assert isinstance(tensors[-1], bytes)
    assert tok.pieces[-len(tiny_model.cfg.languages):] == [f"<|{c}|>" for c in tiny_model.cfg.languages]
    for text in ("Żółw szedł przez łąkę.", "Übermorgen in München", "the lazy dog 42 ☃"):
        assert tok.encode(text) == tiny_model.sp.encode(text)
        assert tok.decode(tok.encode(text)) == text
    sp = tiny_model.sp
    assert (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()) == (0, 1, 2, 3)
    assert sp.unk_id() not in sp.encode("☃ 漢字")          # byte fallback, never <unk>


def test_perturbed_params_have_no_zero_gates_or_identity_defaults(tiny_model):
    flat = _flat(tiny_model.params)
    gates = {k: v for k, v in flat.items() if k.rsplit("/", 1)[-1] in ("attn_gate", "cross_gate", "pe_gate")}
    assert len(gates) == 4      # encoder attn, decoder attn, decoder cross, pe
    assert all(np.abs(v).min() >= 0.5 for v in gates.values())
    for key, value in flat.items():
        leaf = key.rsplit("/", 1)[-1]
        if leaf in ("scale", "b2", "cond_u", "mhc_b_pre", "mhc_b_post"):
            assert np.abs(value).min() > 0 and value.std() > 0.05, key     # initialised to zeros
        if leaf in ("d1", "d2", "d3"):
            assert np.abs(value - 1).std() > 0.05, key                      # ones
        if leaf.startswith("mhc_a_"):
            assert np.all(np.abs(value - 0.01) > 0.1), key                  # constant 0.01
        if leaf in ("q_taps", "k_taps", "v_taps", "taps"):
            assert np.abs(value[1:]).max() > 0.1, key                       # identity [1, 0, ...]


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        name = f"{prefix}/{k}" if prefix else k
        out.update(_flat(v, name) if isinstance(v, dict) else {name: np.asarray(v)})
    return out


# ------------------------------------------------------------------------------------------------
# Numerics of the quantised reference

def _speech():
    return audio.speech("The quick brown fox jumps over the lazy dog.")


def test_encoder_output_has_one_frame_per_80_ms_and_is_sane(tiny_model, reference):
    pcm = _speech()
    enc = reference.ref_embed(tiny_model, pcm)
    assert enc.shape == (reference.encoder_frames(len(pcm), tiny_model.cfg), tiny_model.cfg.dim)
    assert enc.shape[0] == -(-(len(pcm) // 160) // 8)
    assert np.isfinite(enc).all()
    assert 0.1 < np.sqrt((enc ** 2).mean()) < 10


def test_padding_the_clip_moves_the_quantised_encoder_only_by_int8_rounding(tiny_model, reference):
    # Why the harness runs the encoder unpadded: lengths mask the padding, yet int8 roundings
    # flip. The change must stay far below the guide's 0.999 acceptance cosine.
    pcm = _speech()[:30_001]
    exact = reference.ref_embed(tiny_model, pcm)
    padded = reference.ref_embed(tiny_model, pcm, pad_to=32_000)
    assert padded.shape == exact.shape
    cosine = (exact * padded).sum(-1) / np.linalg.norm(exact, axis=-1) / np.linalg.norm(padded, axis=-1)
    assert cosine.min() > 0.9999


def test_padding_the_decoder_memory_does_not_change_the_logits(tiny_model, reference):
    import jax.numpy as jnp
    pcm, cfg = _speech()[:30_001], tiny_model.cfg
    enc, frames = reference._encode_padded(tiny_model, pcm)
    tokens = [[cfg.bos, cfg.text, 40, 41, 42]]
    bucketed = reference._run_logits(tiny_model, enc, frames, tokens)[:, :5]
    exact = reference._run_logits(tiny_model, jnp.asarray(enc[:, :frames]), frames, tokens)[:, :5]
    np.testing.assert_allclose(bucketed, exact, rtol=0, atol=1e-4)


def test_level_gain_selects_the_99th_percentile_block(reference):
    pcm = np.zeros(320 * 200, np.float32)
    for k in range(200):
        pcm[320 * k:320 * (k + 1)] = 0.001 * (k + 1)      # block k has RMS 0.001 (k + 1)
    out = reference.reference_level(pcm)
    loud = 0.001 * (int(0.99 * 199) + 1)
    np.testing.assert_allclose(out, pcm * (0.1 / loud), rtol=1e-6)
    silent = np.full(1000, 1e-7, np.float32)
    assert np.array_equal(reference.reference_level(silent), silent)


def test_bad_samples_read_as_zero(reference):
    pcm = np.array([0.5, np.nan, np.inf, -np.inf, 65536.0, -65536.0, 65535.0, -0.25], np.float32)
    out = reference.reference_sanitize(pcm)
    assert out.tolist() == [0.5, 0, 0, 0, 0, 0, 65535.0, -0.25]


def test_logits_are_finite_and_not_saturated(tiny_model, reference):
    stats = reference.activation_stats(tiny_model, _speech())
    assert stats["enc_finite"] and stats["logits_finite"]
    assert 1.0 < stats["logits_std"] < 20.0
    assert stats["entropy_max"] > 0.5                                 # not all one-hot
    assert stats["entropy_max"] < stats["entropy_uniform"] - 1.0      # never flat


def test_encoder_output_varies_from_frame_to_frame(tiny_model, reference):
    enc = reference.ref_embed(tiny_model, _speech())
    unit = enc / np.linalg.norm(enc, axis=-1, keepdims=True)
    cosine = unit @ unit.T
    assert cosine[np.triu_indices(len(enc), 1)].mean() < 0.8     # not one clip-independent vector


def test_transcript_depends_on_the_audio(tiny_model, reference):
    german = audio.speech("Der schnelle braune Fuchs springt über den faulen Hund.", voice="de")
    assert reference.ref_greedy(tiny_model, _speech(), max_new=8) != reference.ref_greedy(tiny_model, german, max_new=8)


def test_margins_are_the_top_two_gap_of_the_choices(tiny_model, reference):
    cfg, pcm = tiny_model.cfg, _speech()
    language, ids = reference.ref_greedy(tiny_model, pcm, max_new=6)
    tokens = [cfg.bos, tiny_model.language_id(language), *ids]
    margins = reference.ref_margins(tiny_model, pcm, tokens)
    logits = reference.ref_logits(tiny_model, pcm, tokens)
    assert margins.shape == (len(tokens),) and (margins >= 0).all()
    text = np.sort(logits[1, :cfg.text])
    assert margins[1] == pytest.approx(text[-1] - text[-2])


# ------------------------------------------------------------------------------------------------
# Decode oracles

def test_greedy_choices_are_the_argmax_of_teacher_forced_logits(tiny_model, reference):
    cfg, pcm = tiny_model.cfg, _speech()
    language, ids = reference.ref_greedy(tiny_model, pcm)          # to </s> or the cap
    tokens = [cfg.bos, tiny_model.language_id(language), *ids]
    assert len(tokens) <= cfg.max_tokens - 1
    logits = reference.ref_logits(tiny_model, pcm, tokens)
    assert cfg.languages[int(np.argmax(logits[0, cfg.text:]))] == language
    choices = np.argmax(logits[1:, :cfg.text], -1)
    assert choices[:-1].tolist() == ids
    if len(tokens) < cfg.max_tokens - 1:
        assert choices[-1] == cfg.eos                       # stopped by </s>, not the cap
    assert all(0 <= t < cfg.text and t != cfg.eos for t in ids)


def test_greedy_max_new_is_a_prefix_of_the_full_transcript(tiny_model, reference):
    pcm = _speech()
    full = reference.ref_greedy(tiny_model, pcm)
    short = reference.ref_greedy(tiny_model, pcm, max_new=7)
    assert short[0] == full[0] and short[1] == full[1][:7]


def test_greedy_honours_a_forced_language(tiny_model, reference):
    forced = tiny_model.cfg.languages[-1]
    language, ids = reference.ref_greedy(tiny_model, _speech(), language=forced, max_new=4)
    assert language == forced and len(ids) <= 4
    with pytest.raises(ValueError, match="language"):
        reference.ref_greedy(tiny_model, _speech(), language="xx")


def test_beam_returns_the_best_finished_transcript(tiny_model, reference):
    cfg, trace = tiny_model.cfg, []
    language, ids = reference.ref_beam(tiny_model, _speech(), trace=trace)
    assert language in cfg.languages
    assert all(0 <= t < cfg.text and t != cfg.eos for t in ids)
    assert all(len(step["live"]) <= reference.BEAMS for step in trace)
    finished = trace[-1]["finished"]
    assert len(finished) >= reference.BEAMS or not trace[-1]["live"]
    assert ids == max(finished, key=lambda f: f[0])[1]
    assert reference.find_loop(ids) == 0


def test_find_loop_takes_the_shortest_unit_repeated_four_times(reference):
    assert reference.find_loop([5, 7, 7, 7, 7]) == 1
    assert reference.find_loop([7, 7, 7]) == 0
    assert reference.find_loop([1, 2, 1, 2, 1, 2, 1, 2]) == 2
    assert reference.find_loop([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]) == 3
    unit = list(range(10, 18))
    assert reference.find_loop(unit * 4) == 8
    assert reference.find_loop(list(range(9)) * 4) == 0        # a 9-token unit is not a loop


def _table_scorer(table, vocab):
    """next_logits for a toy model whose log-probs depend only on the last token."""
    def next_logits(prefixes):
        rows = []
        for ids in prefixes:
            rows.append(table.get(ids[-1] if ids else None, np.zeros(vocab)))
        return np.log(np.maximum(np.asarray(rows, np.float64), 1e-30))
    return next_logits


def test_beam_search_normalises_finished_scores_by_token_count_including_eos(reference):
    vocab, eos = 8, 1
    # After the start: token 4 (p .5) or 5 (p .4) or </s> (p .1). 4 always ends (p 1);
    # 5 continues to 6 with p .99, which ends with p .99.
    probs = {None: {4: 0.5, 5: 0.4, eos: 0.1}, 4: {eos: 1.0}, 5: {6: 0.99, eos: 0.01}, 6: {eos: 0.99, 7: 0.01},
             7: {eos: 1.0}}
    table = {k: np.array([v.get(i, 0.0) for i in range(vocab)]) for k, v in probs.items()}
    ids, score = reference.beam_search(_table_scorer(table, vocab), vocab, eos, max_generated=20)
    # [4, </s>]: log .5 / 2 = -0.347; [5, 6, </s>]: log(.4 * .99 * .99) / 3 = -0.312.
    assert ids == [5, 6]
    assert score == pytest.approx(np.log(0.4 * 0.99 * 0.99) / 3)


def _chain(vocab, eos, successor, p=0.99):
    """Toy table: after token t comes successor[t] with probability p, else </s>."""
    table = {}
    for t, nxt in successor.items():
        row = np.full(vocab, 0.0)
        row[nxt], row[eos] = p, 1 - p
        table[t] = row
    return table


def test_beam_search_cuts_a_loop_to_one_copy(reference):
    # 3, 7, 7, 7, 7: the unit [7] repeats 4 times at step 5, before five </s> endings finish.
    vocab, eos = 10, 1
    ids, score = reference.beam_search(_table_scorer(_chain(vocab, eos, {None: 3, 3: 7, 7: 7}), vocab), vocab, eos,
                                       max_generated=50)
    assert ids == [3, 7]
    assert score == pytest.approx(np.log(0.99))     # 5 tokens summed, divided by 5 (before the cut)


def test_beam_search_stops_once_five_have_finished(reference):
    # A 2-token loop needs 8 steps; the </s> endings of steps 1-5 stop the search first.
    vocab, eos = 10, 1
    ids, _ = reference.beam_search(_table_scorer(_chain(vocab, eos, {None: 3, 3: 4, 4: 3}), vocab), vocab, eos,
                                   max_generated=50)
    assert ids == [3, 4, 3, 4]                      # (4 log .99 + log .01) / 5 beats the shorter endings


def test_beam_search_finishes_at_the_cap(reference):
    vocab, eos = 40, 1
    chain = _chain(vocab, eos, {None: 10, **{t: t + 1 for t in range(10, vocab - 1)}})
    ids, score = reference.beam_search(_table_scorer(chain, vocab), vocab, eos, max_generated=3)
    assert ids == [10, 11, 12]
    assert score == pytest.approx(np.log(0.99))


# ------------------------------------------------------------------------------------------------
# Ladder

def test_ladder_keeps_the_bisection_layers_and_their_engram_sites(odd_model, reference):
    from needle.model.export import read_export
    rung = reference.ladder(odd_model, 3)          # 4 layers: order 0, 3, 1, 2 -> keeps 0, 1, 3
    assert rung.cfg.dec_layers == 3 and rung.cfg.sites == (1, 2)
    parent = odd_model.params["stack"]["layers"]["block"]["attn_gate"]
    np.testing.assert_array_equal(rung.params["stack"]["layers"]["block"]["attn_gate"], parent[[0, 1, 3]])
    info, tensors = read_export(str(rung.path))
    assert info["num_tensors"] == _expected_records(rung.cfg)
    assert info["engram_layers"] == (1, 2)
    with pytest.raises(ValueError, match="depth"):
        reference.ladder(odd_model, 4)


# ------------------------------------------------------------------------------------------------
# Test audio

def test_clip_set_has_the_acceptance_clips(clips):
    for engine in ("espeak", "flite"):
        for seconds, samples in audio.CLIP_SAMPLES.items():
            pcm = clips[f"{engine}_{seconds}s"]
            assert pcm.dtype == np.float32 and len(pcm) == samples
            assert 0.02 < np.sqrt((pcm ** 2).mean()) < 0.5
    assert np.abs(clips["quiet"]).max() < 2e-3
    assert np.sqrt((clips["noise"].astype(np.float64) ** 2).mean()) == pytest.approx(10 ** (-30 / 20), rel=1e-3)
    bad = clips["bad_samples"]
    assert np.isnan(bad).any() and np.isinf(bad).any() and (np.abs(bad[np.isfinite(bad)]) >= 65536).any()


def test_speech_is_deterministic(clips):
    again = audio.speech_of_length(audio.CLIP_SAMPLES[5], "espeak")
    np.testing.assert_array_equal(again, clips["espeak_5s"])


def test_speech_rejects_an_unknown_engine():
    with pytest.raises(ValueError, match="engine"):
        audio.speech("hello", engine="festival")


def test_the_load_benchmarks_script_reads_as_words_of_the_models_own_pieces():
    """benchmarks/spoken_tokens.py --scripted: a fixed sequence of word-start pieces, some followed
    by a continuation piece, so passes that read it agree word by word."""
    import sys
    from pathlib import Path

    from whistle_stream.container import CactFile
    from whistle_stream.models import demo_model_path
    from whistle_stream.rules import WORD_START

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from spoken_tokens import script_for

    cact = CactFile(demo_model_path())
    tok = cact.tokenizer
    script = script_for(tok, cact.dims.vocab, length=2000)
    assert np.array_equal(script, script_for(tok, cact.dims.vocab, length=2000))  # the same for every pass
    pieces = [tok.piece(int(i)) for i in script]
    assert pieces[0].startswith(WORD_START) and not any(tok.is_special(int(i)) for i in script)
    words = sum(p.startswith(WORD_START) for p in pieces)
    assert 1.2 < len(pieces) / words < 1.4
    # at most one continuation piece after a word's start
    assert not any(not a.startswith(WORD_START) and not b.startswith(WORD_START) for a, b in zip(pieces, pieces[1:]))


def test_the_load_benchmarks_scripted_passes_start_together_without_error(tmp_path):
    """benchmarks/spoken_tokens.py --scripted: a server's engine threads start their first passes
    together; each must find the model's two scripts set (one of them was set before the other, and
    a thread in between read a missing attribute: the load runs' `internal` errors)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    child = r"""
import sys, threading, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import spoken_tokens
spoken_tokens.install(4.0, scripted=True)
from whistle_stream.whistle import Whistle
audio = np.load(sys.argv[2])
failures = []
for _ in range(5):
    model = Whistle()
    gate = threading.Barrier(8)
    def one(k):
        gate.wait()
        time.sleep(0.01 * k)   # passes that start one after another, while the first sets the scripts
        try:
            model.transcribe(audio, language="en")
        except Exception as e:
            failures.append(repr(e))
    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
print(failures)
sys.exit(1 if failures else 0)
"""
    clip = tmp_path / "clip.npy"
    np.save(clip, audio.speech("Set a timer for ten minutes."))
    run = subprocess.run([sys.executable, "-c", child, str(root / "benchmarks"), str(clip)], capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]


def test_a_benchmark_server_of_another_checkout_imports_that_checkouts_service(tmp_path):
    """load.py --engine: the other checkout's server runs its own service, not the installed one
    (the editable install maps whistle_stream.service to the installed checkout's folder whatever
    sys.path says, so both servers ran one service)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "whistle_stream").symlink_to(root / "whistle_stream")
    for package in ("service", "clients"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    child = ("import sys; sys.path.insert(0, sys.argv[1]); from harness_model import import_checkout; "
             "import_checkout(__import__('pathlib').Path(sys.argv[2])); "
             "import whistle_stream.service, whistle_stream.clients, whistle_stream.whistle; "
             "print(whistle_stream.service.__file__, whistle_stream.clients.__file__, whistle_stream.whistle.__file__)")
    run = subprocess.run([sys.executable, "-c", child, str(root / "benchmarks"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    service, clients, engine = run.stdout.split()
    assert service == str(tmp_path / "service" / "__init__.py")
    assert clients == str(tmp_path / "clients" / "__init__.py")
    assert engine == str(tmp_path / "whistle_stream" / "whistle.py")


def test_the_decoder_benchmarks_numpy_twin_runs_on_the_engines_weights_and_agrees():
    """benchmarks/decoder.py reads the engine's weights into its NumPy baseline: a renamed or removed
    attribute breaks it, and nothing else runs it (here on the tiny shape, a few steps)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "decoder.py"), "--shape", "tiny", "--vocab", "0",
                          "--frames", "20", "--context", "6", "--steps", "10", "--tokens", "4", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    # The baseline rounds at the same int8 points in float32 on its own path, so with random
    # weights a row near a rounding boundary lands on the other level; most steps pick the same token.
    agree = re.search(r"engine vs numpy logits: max \|delta\| (\S+), top-1 identical on (\d+)/(\d+) steps", run.stdout)
    assert agree, run.stdout[-2000:]
    assert np.isfinite(float(agree.group(1))) and 2 * int(agree.group(2)) > int(agree.group(3)), agree.group(0)


def test_the_decoder_benchmark_times_another_checkouts_step_beside_this_ones():
    """benchmarks/decoder.py --engine: both checkouts' children step the same beams and report their
    times (here this checkout against itself, on the tiny shape)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "decoder.py"), "--shape", "tiny", "--vocab", "0",
                          "--frames", "20", "--context", "6", "--steps", "10", "--engine", str(root)],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    for label in ("in turn", "back to back"):
        line = re.search(rf"{label}: this best (\S+) ms, median \S+ ms; other best (\S+) ms, .*this / other (\S+)x "
                         rf"\(medians\).* over (\d+) steps", run.stdout)
        assert line, run.stdout[-2000:]
        assert float(line.group(1)) > 0 and float(line.group(2)) > 0 and float(line.group(3)) > 0
        assert int(line.group(4)) == 10


def test_the_gate_benchmark_finds_every_stopped_clip_empty():
    """benchmarks/gate.py's own check of the gated clips' results (a result type that changed, say
    words from a list to a tuple, read as NOT EMPTY there while the gate worked)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "gate.py"), "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    lines = [line for line in run.stdout.splitlines() if " ms, " in line and "faster than the peer" in line]
    assert len(lines) == 3, run.stdout[-2000:] + run.stderr[-2000:]
    assert all("faster than the peer, empty;" in line for line in lines), "\n".join(lines)
