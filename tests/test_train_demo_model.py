"""The demo model's training script: the alignment term that teaches cross-attention to follow
the words (tools/train_demo_model.py --align), on hand-built inputs and a tiny reference model."""

import hashlib
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import train_demo_model as tdm  # noqa: E402

FRAME = tdm.FRAME_SAMPLES


class Pieces:
    """A stand-in sentencepiece processor over fixed pieces."""

    def __init__(self, pieces):
        self.pieces = pieces

    def encode(self, text):
        return list(range(len(self.pieces)))

    def id_to_piece(self, i):
        return self.pieces[i]


def test_token_words_groups_pieces_at_the_space_marker():
    sp = Pieces(["\u2581Set", "\u2581a", "\u2581tim", "er", "\u2581for", "\u2581ten", "."])
    assert tdm.token_words(sp, "Set a timer for ten.") == [0, 1, 2, 2, 3, 4, 4]
    # no marker on the first piece (no dummy prefix): it still starts word 0
    assert tdm.token_words(Pieces(["Set", "\u2581a"]), "Set a") == [0, 1]
    # pieces that do not split as the whitespace words do give no mapping
    assert tdm.token_words(Pieces(["\u2581Seta"]), "Set a") is None


def test_token_words_with_a_trained_tokenizer():
    spm = pytest.importorskip("sentencepiece")
    texts = ["Set a timer for ten minutes.", "Turn on the lights in the kitchen.", "Call my mother tomorrow."] * 20
    sp = spm.SentencePieceProcessor(model_proto=tdm.train_tokenizer(texts, 300, 0).SerializeToString())
    for text in texts[:3]:
        owner = tdm.token_words(sp, text)
        assert owner is not None and owner[0] == 0 and owner[-1] == len(text.split()) - 1
        assert all(b - a in (0, 1) for a, b in zip(owner, owner[1:]))
        pieces = [sp.id_to_piece(i) for i in sp.encode(text)]
        for w, word in enumerate(text.split()):  # each word's pieces spell it
            assert "".join(p for p, o in zip(pieces, owner) if o == w).lstrip("\u2581") == word


def test_alignment_spans_put_each_tokens_word_on_the_row_that_predicts_it():
    rows = [{"words": [[1000, 5000], [9000, 12800]], "token_words": [0, 1, 1]},  # 3 text tokens
            {"pcm": None},  # no spans: unsupervised
            {"words": [[0, 64000]], "token_words": [0]}]  # runs past the padded length: clipped
    spans = tdm.alignment_spans(rows, width=8, samples=48000)
    assert spans.shape == (3, 7, 2) and spans.dtype == np.int32
    # [<s>, tag, t0, t1, t2, </s>]: row 1 predicts t0, rows 2 and 3 predict t1 and t2
    assert spans[0].tolist() == [[0, 0], [0, 4], [7, 10], [7, 10], [0, 0], [0, 0], [0, 0]]
    assert not spans[1].any()
    assert spans[2, 1].tolist() == [0, -(-48000 // FRAME)] and not spans[2, 2:].any()


def _loss_twin(weights, spans, lengths):
    """alignment_loss, one row at a time."""
    layers, batch, heads, rows, _ = weights.shape
    total, count = 0.0, 0
    for b in range(batch):
        for r in range(rows):
            first, end = spans[b, r, 0], min(spans[b, r, 1], lengths[b])
            if end <= first:
                continue
            for layer in range(layers // 2, layers):
                for h in range(heads):
                    total += -np.log(weights[layer, b, h, r, first:end].sum() + 1e-6)
                    count += 1
    return total / max(count, 1)


def test_alignment_loss_matches_its_numpy_twin():
    pytest.importorskip("jax")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 2, 3, 6, 10))
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    spans = np.array([[[0, 0], [1, 4], [3, 6], [0, 0], [8, 12], [2, 3]],
                      [[0, 2], [0, 0], [5, 9], [9, 10], [0, 0], [0, 0]]], np.int32)
    lengths = np.array([10, 9], np.int32)  # row 1's [9, 10) falls past its frames: left out
    got = float(tdm.alignment_loss(weights.astype(np.float32), spans, lengths))
    assert got == pytest.approx(_loss_twin(weights, spans, lengths), rel=1e-5)
    # all the mass on the spans: zero; none of it: large
    on = np.zeros_like(weights, dtype=np.float32)
    on[..., 0] = 1.0
    assert float(tdm.alignment_loss(on, np.array([[[0, 1]] * 6] * 2, np.int32), lengths)) == pytest.approx(0, abs=1e-5)
    assert float(tdm.alignment_loss(on, np.array([[[1, 3]] * 6] * 2, np.int32), lengths)) > 13


def test_speed_perturbation_moves_the_word_spans_with_the_audio():
    rng = np.random.default_rng(0)
    rows = [{"pcm": (rng.standard_normal(32000) * 3000).astype(np.int16), "words": [[8000, 16000], [20000, 30000]]}]
    batches = tdm.Batches(rows, [[2, 512, 5, 6, 1]], np.random.default_rng(1), perturb=0.2)
    out = batches.perturbed([0], 48000)[0]
    speed = len(rows[0]["pcm"]) / len(out["pcm"])
    for (a, b), (c, d) in zip(rows[0]["words"], out["words"]):
        assert abs(c - a / speed) <= 2 and abs(d - b / speed) <= 2


def test_sown_cross_attention_leaves_the_model_as_it_was_and_records_its_weights(monkeypatch):
    jax = pytest.importorskip("jax")
    whistle = pytest.importorskip("needle.model.whistle")
    from needle.model.whistle import Whistle

    for name in ("_cross_attend", "nn", "_demo_sown"):  # undone after the test
        monkeypatch.setattr(whistle, name, getattr(whistle, name, False), raising=False)

    cfg = tdm.whistle_config(64, dim=64, enc_layers=2, dec_layers=2, flash=False)
    model = Whistle(cfg)
    rng = np.random.default_rng(0)
    wav = (rng.standard_normal((2, 16000)) * 0.1).astype(np.float32)
    lengths = np.array([16000, 12000], np.int32)
    tokens = np.array([[2, 64, 5, 6, 7, 1], [2, 64, 8, 9, 1, 0]], np.int32)
    params = model.init(jax.random.PRNGKey(0), wav, lengths, tokens)["params"]
    before = np.asarray(model.apply({"params": params}, wav, lengths, tokens))
    tdm.sow_cross_attention()
    tdm.sow_cross_attention()  # installing twice is harmless
    after, state = model.apply({"params": params}, wav, lengths, tokens, mutable=["intermediates"])
    np.testing.assert_array_equal(np.asarray(after), before)
    w = np.asarray(tdm.cross_weights(state))
    frames = 14  # 1 s -> 12.5 frames, padded to an even count
    assert w.shape == (cfg.dec_layers, 2, cfg.heads, tokens.shape[1], frames)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    assert np.all(w[:, 1, :, :, -(-12000 // FRAME):] < 1e-6)  # nothing on clip 2's padding
    # and without asking for the collection nothing changes either
    np.testing.assert_array_equal(np.asarray(model.apply({"params": params}, wav, lengths, tokens)), before)


def test_token_width_rounds_the_longest_sequence_up():
    assert tdm.token_width([[1] * 3, [1] * 9]) == 16
    assert tdm.token_width([[1] * 8]) == 8


def test_masked_cross_entropy_matches_its_numpy_twin():
    pytest.importorskip("optax")
    rng = np.random.default_rng(0)
    tokens = np.array([[2, 9, 5, 6, 1, 0], [2, 9, 7, 1, 0, 0]], np.int32)
    logits = rng.standard_normal((2, 5, 12)).astype(np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = [-logp[b, t, tokens[b, t + 1]] for b in range(2) for t in range(5) if tokens[b, t + 1] != 0]
    assert float(tdm.masked_cross_entropy(logits, tokens, 0)) == pytest.approx(np.mean(picked), rel=1e-5)
    spread = [-logp[b, t].mean() for b in range(2) for t in range(5) if tokens[b, t + 1] != 0]
    smoothed = 0.9 * np.mean(picked) + 0.1 * np.mean(spread)
    assert float(tdm.masked_cross_entropy(logits, tokens, 0, 0.1)) == pytest.approx(smoothed, rel=1e-5)


def test_average_params_is_the_weighted_mean_of_each_leaf_in_its_own_dtype():
    a = {"enc": {"w": np.array([[1.0, 2.0]], np.float32)}, "b": np.array([4.0], np.float32)}
    b = {"enc": {"w": np.array([[3.0, 6.0]], np.float32)}, "b": np.array([0.0], np.float32)}
    mean = tdm.average_params([a, b])
    np.testing.assert_allclose(mean["enc"]["w"], [[2.0, 4.0]])
    np.testing.assert_allclose(mean["b"], [2.0])
    assert mean["enc"]["w"].dtype == np.float32
    weighted = tdm.average_params([a, b], [0.75, 0.25])
    np.testing.assert_allclose(weighted["enc"]["w"], [[1.5, 3.0]])
    np.testing.assert_allclose(weighted["b"], [3.0])


def test_average_params_refuses_trees_of_other_shapes():
    with pytest.raises(ValueError, match="not shaped like the first"):
        tdm.average_params([{"w": np.ones(2, np.float32)}, {"w": np.ones(3, np.float32)}])
    with pytest.raises(ValueError, match="not shaped like the first"):
        tdm.average_params([{"w": np.ones(2, np.float32)}, {"v": np.ones(2, np.float32)}])


@pytest.mark.parametrize("weights", [[0.5], [0.7, 0.7]])
def test_average_params_refuses_weights_that_do_not_fit(weights):
    tree = {"w": np.ones(2, np.float32)}
    with pytest.raises(ValueError, match="one weight per tree, summing to 1"):
        tdm.average_params([tree, tree], weights)


def test_a_run_starts_from_one_checkpoint_or_the_mean_of_several(tmp_path):
    pytest.importorskip("flax")
    template = {"enc": {"w": np.zeros((1, 2), np.float32)}, "b": np.zeros(1, np.float32)}
    a = {"enc": {"w": np.array([[1.0, 2.0]], np.float32)}, "b": np.array([4.0], np.float32)}
    b = {"enc": {"w": np.array([[3.0, 6.0]], np.float32)}, "b": np.array([0.0], np.float32)}
    np.savez(tmp_path / "a.npz", params=tdm.params_array(a), head=np.ones((2, 3), np.float32), step=1500)
    np.savez(tmp_path / "b.npz", params=tdm.params_array(b), head=np.full((2, 3), 3.0, np.float32), step=1000)
    one, head, step = tdm.load_start(template, [str(tmp_path / "a.npz")])
    np.testing.assert_array_equal(one["enc"]["w"], a["enc"]["w"])
    assert step == 1500 and head.shape == (2, 3)
    mean, head, _ = tdm.load_start(template, [str(tmp_path / "a.npz"), str(tmp_path / "b.npz")])
    np.testing.assert_allclose(mean["enc"]["w"], [[2.0, 4.0]])
    np.testing.assert_allclose(mean["b"], [2.0])
    np.testing.assert_allclose(head, np.full((2, 3), 2.0))


def test_average_checkpoints_packs_the_mean_of_its_checkpoints(tmp_path):
    """The tool reads two checkpoints, averages them and packs the mean exactly as the training script
    packs a params tree: the mean of A and 3A is 2A, and CQ packing of 2A is A's codes with doubled
    norms, which fp16 holds exactly."""
    pytest.importorskip("needle")
    import json

    import jax
    from needle.model.export import whistle_tokenizer_blob
    from needle.model.whistle import Whistle

    from tools import average_checkpoints, demo_data

    texts = [item["text"] for item in demo_data.train_items(400, 0)]
    with open(tmp_path / "train-broad.jsonl", "w") as f:   # a --voices broad run's manifest
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    proto = tdm.train_tokenizer(texts, 512, 0)
    cfg = tdm.whistle_config(len(proto.pieces))
    wav, lengths, tokens = np.zeros((1, 16000), np.float32), np.array([16000], np.int32), np.ones((1, 4), np.int32)
    params = jax.device_get(Whistle(cfg).init(jax.random.PRNGKey(0), wav, lengths, tokens)["params"])
    for name, scale in (("a", 1.0), ("b", 3.0)):
        scaled = jax.tree.map(lambda x: np.asarray(x) * np.float32(scale), params)
        np.savez(tmp_path / f"{name}.npz", params=tdm.params_array(scaled), step=1)
    out = tmp_path / "mean.cact"
    average_checkpoints.main([str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--data", str(tmp_path),
                              "--manifest", "train-broad.jsonl", "--out", str(out)])
    expected = tmp_path / "expected.cact"
    tdm.write_cact(jax.tree.map(lambda x: np.asarray(x) * np.float32(2.0), params), cfg, str(expected),
                   whistle_tokenizer_blob(proto, (tdm.LANGUAGE,)), False)
    assert out.read_bytes() == expected.read_bytes()
    assert json.loads((tmp_path / "mean.json").read_text())["sha256"]


def test_average_checkpoints_names_a_file_that_is_not_a_checkpoint(tmp_path):
    from tools import average_checkpoints

    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(SystemExit, match="not a train_demo_model checkpoint"):
        average_checkpoints.load_params(str(tmp_path / "other.npz"))


def test_average_checkpoints_refuses_weights_that_do_not_fit(tmp_path, capsys):
    pytest.importorskip("flax")
    from tools import average_checkpoints

    (tmp_path / "train.jsonl").write_text('{"text": "Call mom."}\n')
    tree = {"w": np.ones(2, np.float32)}
    np.savez(tmp_path / "a.npz", params=tdm.params_array(tree), step=1)
    with pytest.raises(SystemExit):
        average_checkpoints.main([str(tmp_path / "a.npz"), str(tmp_path / "a.npz"), "--weights", "0.7,0.7",
                                  "--data", str(tmp_path), "--out", str(tmp_path / "x.cact")])
    assert "one weight per tree, summing to 1" in capsys.readouterr().err
    assert not (tmp_path / "x.cact").exists()


def test_params_from_cact_read_the_shipped_model_back_into_params_that_pack_to_it(tmp_path):
    """--init-cact: the shipped .cact read back into a params tree (every element of it held by the
    file), packed again, gives the same file but for the engram tables, whose 32-wide rows fill a
    128-wide CQ group with zeros that the dequantised rows cannot keep (under 1 % of its values;
    none differ in the model shipped since 2026-12-03)."""
    pytest.importorskip("needle")
    import jax
    from needle.model import export
    from needle.model.whistle import Whistle

    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "whistle_stream", "models", "demo.cact")
    cfg = tdm.whistle_config(512)
    wav, lengths, tokens = np.zeros((1, 16000), np.float32), np.array([16000], np.int32), np.ones((1, 4), np.int32)
    template = jax.device_get(Whistle(cfg).init(jax.random.PRNGKey(0), wav, lengths, tokens)["params"])
    params, missing = tdm.params_from_cact(template, cfg, shipped)
    assert missing == 0
    again = tmp_path / "again.cact"
    tdm.write_cact(params, cfg, str(again), export.read_tokenizer_blob(shipped), False)
    _, before = export.read_export(shipped)
    _, after = export.read_export(str(again))
    assert len(before) == len(after)
    differing = []
    for i, (a, b) in enumerate(zip(before, after)):
        if isinstance(a, (bytes, bytearray)):
            assert a == b
        elif not np.array_equal(a, b):
            differing.append((i, np.shape(a), float(np.mean(a != b))))
    # only the engram tables may differ, by under 1 % of their values
    assert all(shape == (cfg.slots * 4, 32) and share < 0.01 for _, shape, share in differing), differing
    assert len(differing) <= 1
    # a model of another shape is refused by name
    small = tdm.whistle_config(512, dim=64)
    other = jax.device_get(Whistle(small).init(jax.random.PRNGKey(0), wav, lengths, tokens)["params"])
    with pytest.raises(ValueError, match="packed for another shape|shaped"):
        tdm.params_from_cact(other, small, shipped)


def test_init_cact_names_a_file_that_is_not_a_cact_and_refuses_a_second_start(tmp_path, capsys):
    pytest.importorskip("needle")
    bad = tmp_path / "notes.cact"
    bad.write_bytes(b"RIFF" + bytes(400))
    for argv, said in (([ "--init-cact", str(bad)], "not a readable .cact with a tokenizer"),
                       (["--init-cact", str(bad), "--init", "x.npz"], "give one of them")):
        with pytest.raises(SystemExit):
            tdm.main(argv + ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "m.cact")])
        assert said in capsys.readouterr().err
    assert not (tmp_path / "data").exists()          # refused before any clip is made


# ---------------------------------------------------------------- SpecAugment (--spec-augment)

def naive_spec_keep(f0, fw, t0, tw, frames, mels):
    """The slow twin of tdm.spec_keep: cell by cell."""
    keep = np.ones((len(f0), frames, mels), np.float32)
    for b in range(len(f0)):
        for a, w in zip(f0[b], fw[b]):
            keep[b, :, a:a + w] = 0.0
        for a, w in zip(t0[b], tw[b]):
            keep[b, a:a + w, :] = 0.0
    return keep


def test_spec_keep_matches_its_numpy_twin():
    rng = np.random.default_rng(0)
    f0, fw = rng.integers(0, 70, (3, 2)), rng.integers(0, 11, (3, 2))
    t0, tw = rng.integers(0, 90, (3, 2)), rng.integers(0, 21, (3, 2))
    got = np.asarray(tdm.spec_keep(f0, fw, t0, tw, 100, 80))
    np.testing.assert_array_equal(got, naive_spec_keep(f0, fw, t0, tw, 100, 80))


def test_spec_draws_stay_inside_each_clip_and_their_limits():
    jax = pytest.importorskip("jax")
    frames = np.array([300, 40, 5], np.int32)
    seen = set()
    for k in range(20):
        f0, fw, t0, tw = (np.asarray(a) for a in tdm.spec_draws(jax.random.PRNGKey(k), frames, 3, 80, (2, 12, 2, 20)))
        assert f0.shape == fw.shape == t0.shape == tw.shape == (3, 2)
        assert (fw >= 0).all() and (fw <= 12).all() and (f0 >= 0).all() and (f0 + fw <= 80).all()
        assert (tw >= 0).all() and (tw <= np.minimum(20, frames[:, None])).all()
        assert (t0 >= 0).all() and (t0 + tw <= frames[:, None]).all()
        seen.add((tuple(f0.ravel()), tuple(t0.ravel())))
    assert len(seen) == 20  # each key draws its own masks
    again = tdm.spec_draws(jax.random.PRNGKey(3), frames, 3, 80, (2, 12, 2, 20))
    first = tdm.spec_draws(jax.random.PRNGKey(3), frames, 3, 80, (2, 12, 2, 20))
    assert all(np.array_equal(a, b) for a, b in zip(again, first))


def test_mel_warp_scales_the_low_channels_and_keeps_both_ends():
    import jax

    alpha = np.array([0.9, 1.0, 1.1], np.float32)
    src = np.asarray(tdm.mel_sources(jax.numpy.asarray(alpha), 80))
    np.testing.assert_allclose(src[:, 0], 0.0)
    np.testing.assert_allclose(src[:, -1], 79.0, rtol=1e-6)
    np.testing.assert_allclose(src[1], np.arange(80), rtol=1e-6)  # alpha 1: the identity
    for row, a in zip(src, alpha):
        assert np.all(np.diff(row) > 0) and row.min() >= 0 and row.max() <= 79 + 1e-4
        low = np.arange(80) <= tdm.WARP_KNEE * 79 * min(1.0, 1.0 / a)
        np.testing.assert_allclose(row[low], np.arange(80)[low] * a, rtol=1e-5)


def test_mel_warp_interpolates_each_clip_between_channels_as_numpy_does():
    import jax

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, 80)).astype(np.float32)
    alpha = np.array([0.92, 1.0, 1.08], np.float32)
    got = np.asarray(tdm.mel_warp(jax.numpy.asarray(x), jax.numpy.asarray(alpha)))
    src = np.asarray(tdm.mel_sources(jax.numpy.asarray(alpha), 80))
    for b in range(3):
        for t in range(7):
            np.testing.assert_allclose(got[b, t], np.interp(src[b], np.arange(80), x[b, t]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], x[1])


def test_parse_spec_augment_reads_four_counts_and_names_a_bad_value():
    assert tdm.parse_spec_augment("") is None
    assert tdm.parse_spec_augment("0,0,0,0") is None
    assert tdm.parse_spec_augment("2,12,2,20") == (2, 12, 2, 20)
    assert tdm.parse_spec_augment("2,12,0,0") == (2, 12, 0, 0)
    for bad in ("2,12,2", "a,b,c,d", "2,-1,2,20"):
        with pytest.raises(ValueError, match="four non-negative integers"):
            tdm.parse_spec_augment(bad)


def test_augmented_encode_masks_the_features_of_that_call_only():
    jax = pytest.importorskip("jax")
    whistle = pytest.importorskip("needle.model.whistle")
    from needle.model.whistle import Whistle

    cfg = tdm.whistle_config(64, dim=64, enc_layers=2, dec_layers=2)
    model = Whistle(cfg)
    rng = np.random.default_rng(1)
    wav = (rng.standard_normal((2, 16000)) * 0.1).astype(np.float32)
    lengths = np.array([16000, 12000], np.int32)
    tokens = np.array([[2, 64, 5, 6, 1], [2, 64, 8, 1, 0]], np.int32)
    params = model.init(jax.random.PRNGKey(0), wav, lengths, tokens)["params"]
    plain_features = whistle.features
    key = jax.random.PRNGKey(7)
    plain, frames = tdm.augmented_encode(model, params, wav, lengths, key, None)
    masked, masked_frames = tdm.augmented_encode(model, params, wav, lengths, key, (2, 20, 2, 30))
    assert whistle.features is plain_features  # restored
    np.testing.assert_array_equal(np.asarray(frames), np.asarray(masked_frames))
    assert np.abs(np.asarray(masked) - np.asarray(plain)).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(tdm.augmented_encode(model, params, wav, lengths, key, None)[0]),
                                  np.asarray(plain))
    # the masks this key draws cover part of the features: neither none nor all of them
    x, n = plain_features(cfg, wav, lengths)
    keep = tdm.spec_keep(*tdm.spec_draws(key, n, 2, x.shape[2], (2, 20, 2, 30)), x.shape[1], x.shape[2])
    assert 0.0 < float(np.asarray(keep).mean()) < 1.0


def test_keep_export_copies_the_export_with_a_card_of_its_own(tmp_path):
    from types import SimpleNamespace

    out = tmp_path / "demo.cact"
    out.write_bytes(b"an export")
    cfg = SimpleNamespace(languages=("en",), dim=8, enc_layers=1, dec_layers=1, text=4, v_dim=4, qk_dim=4, kv_heads=1)
    kept = tdm.keep_export(str(out), 1750, ["one", "two"], cfg, "Step 1750.")
    assert kept == str(tmp_path / "demo-step1750.cact")
    assert (tmp_path / "demo-step1750.cact").read_bytes() == b"an export"
    card = json.loads((tmp_path / "demo-step1750.json").read_text())
    assert card["sha256"] == hashlib.sha256(b"an export").hexdigest()
    assert card["description"].endswith("Step 1750.") and card["vocabulary"] == ["one", "two"]
    out.write_bytes(b"the next export")   # the next export leaves the copy as it was
    assert (tmp_path / "demo-step1750.cact").read_bytes() == b"an export"
