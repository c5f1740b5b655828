"""tools/eval_demo_model.py: its per-group breakdown and its clip cache."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import demo_data, eval_demo_model  # noqa: E402


def test_voice_groups_name_the_held_out_variant():
    assert eval_demo_model.voice_group("espeak-ng/en-gb-scotland+f4") == "+f4"
    assert eval_demo_model.voice_group("espeak-ng/en-us+m6") == "+m6"
    assert eval_demo_model.voice_group("flite/rms") == "rms"


def test_breakdown_counts_errors_per_voice_and_everyday_group():
    items = [{"voice": "flite/rms"}, {"voice": "espeak-ng/en+f4"}]
    refs = ["Where are my keys?", "Set a timer for ten minutes."]
    hyps = ["Where are my shoes?", "Set a timer for ten minutes."]
    got = eval_demo_model.breakdown(items, refs, hyps)
    assert got["all"] == (1, 10) and got["rms"] == (1, 4) and got["+f4"] == (0, 6)
    assert got["everyday"] == (1, 4) and got["other"] == (0, 6)


def test_the_clip_cache_is_redrawn_when_the_test_split_draws_other_clips(tmp_path, monkeypatch):
    made = []

    def fake_clip(text, voice, seed):
        made.append(text)
        return np.full(10 + len(made), len(made), np.float32)

    monkeypatch.setattr(demo_data, "make_clip", fake_clip)
    first = eval_demo_model.cached_clips(3, 0, str(tmp_path))
    again = eval_demo_model.cached_clips(2, 0, str(tmp_path))
    assert len(made) == 3 and [t for _, t in again] == [t for _, t in first[:2]]
    np.testing.assert_array_equal(again[1][0], first[1][0])
    real = demo_data.test_items

    def other_grammar(n, seed=0):
        return [dict(it, text="Other " + it["text"]) for it in real(n, seed)]

    monkeypatch.setattr(demo_data, "test_items", other_grammar)
    redrawn = eval_demo_model.cached_clips(2, 0, str(tmp_path))
    assert len(made) == 5 and redrawn[0][1].startswith("Other ")

    def other_voices(n, seed=0):
        return [dict(it, voice="flite/awb") for it in other_grammar(n, seed)]

    monkeypatch.setattr(demo_data, "test_items", other_voices)
    eval_demo_model.cached_clips(2, 0, str(tmp_path))
    assert len(made) == 7  # same sentences, other voices: redrawn too


def test_validation_clips_are_cached_apart_from_the_test_clips(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_data, "make_clip", lambda text, voice, seed: np.zeros(5, np.float32))
    test = eval_demo_model.cached_clips(2, 0, str(tmp_path), "test")
    validation = eval_demo_model.cached_clips(2, 0, str(tmp_path), "validation")
    assert [t for _, t in test] == [it["text"] for it in demo_data.test_items(2)]
    assert [t for _, t in validation] == [it["text"] for it in demo_data.validation_items(2)]
    assert not set(t for _, t in validation) & {it["text"] for it in demo_data.test_items(300)}
    assert sorted(os.listdir(tmp_path)) == ["test-clips-seed0.npz", "validation-clips-seed0.npz"]


def test_a_family_split_is_the_test_sentences_spoken_by_every_voice_of_the_family(tmp_path, monkeypatch):
    spoken = []
    monkeypatch.setattr(demo_data, "make_clip", lambda text, voice, seed: spoken.append(voice) or np.zeros(5, np.float32))
    clips = eval_demo_model.cached_clips(6, 0, str(tmp_path), "festival")
    assert [t for _, t in clips] == [it["text"] for it in demo_data.test_items(6)]
    assert spoken == list(demo_data.FAMILIES["festival"]) * 2      # each voice in turn
    assert eval_demo_model.voice_group("festival/ked_diphone") == "ked_diphone"
    assert "festival-clips-seed0.npz" in os.listdir(tmp_path)


def test_a_negative_long_count_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        eval_demo_model.main(["model.cact", "--long", "-1"])
    assert "--long is a number of 95 s streams, 0 or more; got -1" in capsys.readouterr().err
