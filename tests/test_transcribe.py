"""Whistle.transcribe against the quantised reference: prompt, language, greedy and 5-beam ids
(guide §1, §6), keywords (§7), word times (§8), long audio and the silence gate (§8)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from whistle_stream import Whistle
from whistle_stream.search import find_loop, cut_loop

RATE = 16000


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return Whistle(tiny_model.path)


@pytest.fixture(scope="module")
def odd(odd_model):
    return Whistle(odd_model.path)


def _greedy_with_stop_rules(ids: list[int]) -> list[int]:
    """The reference's greedy ids under the engine's stop rules: a loop ends the transcript (§6)."""
    for n in range(1, len(ids) + 1):
        if find_loop(ids[:n]):
            return cut_loop(ids[:n])
    return ids


SPEECH = ["espeak_1s", "espeak_5s", "flite_5s", "flite_12s", "quiet", "bad_samples"]


@pytest.mark.parametrize("clip", SPEECH)
def test_greedy_ids_equal_the_reference_greedy_loop_tiny(tiny, tiny_model, reference, clips, clip):
    language, ids = reference.ref_greedy(tiny_model, clips[clip])
    got = tiny.decode(clips[clip], beams=1)
    assert got["language"] == language
    assert got["tokens"] == _greedy_with_stop_rules(ids)


@pytest.mark.parametrize("clip", ["espeak_1s", "flite_5s", "bad_samples"])
def test_greedy_ids_equal_the_reference_greedy_loop_odd(odd, odd_model, reference, clips, clip):
    language, ids = reference.ref_greedy(odd_model, clips[clip])
    got = odd.decode(clips[clip], beams=1)
    assert got["language"] == language
    assert got["tokens"] == _greedy_with_stop_rules(ids)


@pytest.mark.parametrize("clip", SPEECH)
def test_beam_ids_equal_the_reference_beam_search_tiny(tiny, tiny_model, reference, clips, clip):
    language, ids = reference.ref_beam(tiny_model, clips[clip])
    got = tiny.decode(clips[clip], beams=5)
    assert (got["language"], got["tokens"]) == (language, ids)


@pytest.mark.parametrize("clip", ["espeak_5s", "flite_1s"])
def test_beam_ids_equal_the_reference_beam_search_odd(odd, odd_model, reference, clips, clip):
    language, ids = reference.ref_beam(odd_model, clips[clip])
    got = odd.decode(clips[clip], beams=5)
    assert (got["language"], got["tokens"]) == (language, ids)


@pytest.mark.parametrize("language", ["en", "de"])
def test_a_forced_language_is_fed_as_the_tag(tiny, tiny_model, reference, clips, language):
    ref_language, ids = reference.ref_beam(tiny_model, clips["espeak_5s"], language=language)
    got = tiny.decode(clips["espeak_5s"], language=language)
    assert got["language"] == ref_language == language
    assert got["tokens"] == ids


def test_full_architecture_greedy_and_beam_match_the_reference(full_model, reference, clips):
    model = Whistle(full_model.path)
    clip = clips["espeak_1s"]
    language, ids = reference.ref_greedy(full_model, clip)
    got = model.decode(clip, beams=1)
    assert (got["language"], got["tokens"]) == (language, _greedy_with_stop_rules(ids))
    language, ids = reference.ref_beam(full_model, clip)
    got = model.decode(clip, beams=5)
    assert (got["language"], got["tokens"]) == (language, ids)


def test_an_unknown_language_names_the_models_languages(tiny, clips):
    with pytest.raises(ValueError, match="en, de"):
        tiny.transcribe(clips["espeak_1s"], language="xx")


def test_transcribe_returns_the_needle_result_shape(tiny, clips):
    out = tiny.transcribe(clips["espeak_5s"])
    assert set(out) == {"text", "language", "ttft_ms", "decode_tps"}
    assert out["language"] in tiny.dims.languages and out["ttft_ms"] > 0
    words = tiny.transcribe(clips["espeak_5s"], word_timestamps=True)["words"]
    assert isinstance(words, list)


def test_word_times_are_ordered_and_within_the_clip(tiny, clips):
    for name in ("espeak_5s", "flite_12s"):
        pcm = clips[name]
        out = tiny.transcribe(pcm, word_timestamps=True)
        words = out["words"]
        assert " ".join(w["word"] for w in words).split() == out["text"].split()
        last = 0.0
        for w in words:
            assert last - 1e-9 <= w["start"] <= w["end"] <= len(pcm) / RATE + 1e-9
            assert 0.0 <= w["probability"] <= 1.0
            last = w["end"]


def test_a_keyword_pulls_its_tokens_into_the_transcript(tiny, clips):
    pcm = clips["espeak_5s"]
    keyword = "timer"
    ids = tiny.tokenizer.encode(keyword)
    plain = tiny.decode(pcm)["tokens"]
    biased = tiny.decode(pcm, keywords=keyword)["tokens"]
    contains = lambda seq: any(seq[i:i + len(ids)] == ids for i in range(len(seq)))
    assert not contains(plain)
    assert contains(biased)


def test_greedy_without_keywords_is_plain_argmax(tiny, clips):
    pcm = clips["espeak_5s"]
    assert tiny.decode(pcm, beams=1) == tiny.decode(pcm, beams=1, keywords="")


@pytest.mark.parametrize("kind", ["digital_silence", "minus_90_dbfs_noise", "steady_noise"])
def test_gated_audio_returns_empty_results_quickly(tiny, kind):
    rng = np.random.default_rng(0)
    n = 30 * RATE
    pcm = {"digital_silence": np.zeros(n, np.float32),
           "minus_90_dbfs_noise": (10 ** (-90 / 20) * rng.standard_normal(n)).astype(np.float32),
           "steady_noise": (0.05 * rng.standard_normal(n)).astype(np.float32)}[kind]
    tiny.transcribe(pcm[:RATE])  # warm
    best = min(_timed(lambda: tiny.transcribe(pcm, word_timestamps=True)) for _ in range(3))
    out = tiny.transcribe(pcm, word_timestamps=True)
    assert out["text"] == "" and out["language"] == "" and out["words"] == []
    assert best < 0.05, f"the gate took {best * 1000:.1f} ms for 30 s"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_empty_and_sub_frame_audio_embed_to_empty_arrays(tiny):
    assert tiny.embed(np.zeros(0, np.float32)).shape == (0, tiny.dims.width)
    assert tiny.embed(np.zeros(100, np.float32)).shape == (0, tiny.dims.width)
