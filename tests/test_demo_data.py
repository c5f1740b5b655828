"""The demo model's synthetic data: grammar size, determinism, held-out splits, augmentation."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import demo_data  # noqa: E402  (module access only: its test_* helpers are not tests)

needs_tts = pytest.mark.skipif(not (shutil.which("espeak-ng") and shutil.which("flite")),
                               reason="espeak-ng and flite are needed to synthesise clips")


def test_grammar_vocabulary_has_at_least_400_words():
    assert len(demo_data.grammar_vocabulary()) >= 400


@pytest.mark.parametrize("n, words", [(0, "zero"), (13, "thirteen"), (42, "forty-two"), (90, "ninety"),
                                      (305, "three hundred and five"), (1000, "one thousand")])
def test_numbers_are_spelled_as_words(n, words):
    assert demo_data.number_words(n) == words


@pytest.mark.parametrize("n, words", [(1, "first"), (12, "twelfth"), (23, "twenty-third"), (40, "fortieth"),
                                      (100, "one hundredth")])
def test_ordinals_are_spelled_as_words(n, words):
    assert demo_data.ordinal_words(n) == words


@pytest.mark.parametrize("n", [-1, 1001])
def test_numbers_outside_the_grammar_are_rejected(n):
    with pytest.raises(ValueError, match="0..1000"):
        demo_data.number_words(n)


def test_clip_specs_are_a_function_of_the_seed():
    assert demo_data.train_items(200, seed=3) == demo_data.train_items(200, seed=3)
    assert demo_data.test_items(50, seed=3) == demo_data.test_items(50, seed=3)
    assert demo_data.train_items(200, seed=3) != demo_data.train_items(200, seed=4)


def test_sentences_have_normal_casing_and_end_punctuation():
    for text in demo_data.train_sentences(300, seed=0):
        assert text[0].isupper() and text[-1] in ".?", text


def test_held_out_sentences_never_appear_in_training():
    held_out = {it["text"] for it in demo_data.test_items(300, seed=0)}
    held_out |= {it["text"] for it in demo_data.validation_items(seed=0)}
    assert len(held_out) == 400
    assert held_out.isdisjoint(demo_data.train_sentences(6000, seed=0))


def test_every_word_of_a_held_out_sentence_is_heard_in_training():
    # Held-out sentences are new combinations of known words: a word that only the test pool says
    # is one no model trained on this data can write (runs up to 19 held out "Pause the music.",
    # a sentence the grammar stated once, and "pause" with it).
    held_out = [it["text"] for it in demo_data.test_items(300, seed=0) + demo_data.validation_items(seed=0)]
    heard = {w for text in demo_data.train_sentences(6000, seed=0) for w in demo_data._words(text)}
    assert {w for text in held_out for w in demo_data._words(text)} <= heard


def test_everyday_sentences_fill_their_slots_from_the_listed_options():
    rng = np.random.default_rng(0)
    said = {demo_data.everyday(rng) for _ in range(3000)}
    every = demo_data.everyday_sentences()
    assert said == every  # 3000 draws reach all 241 sentences
    assert "Where are my keys?" in demo_data.EVERYDAY and "Where are my gloves?" in every
    assert "Turn left at the next corner." in demo_data.EVERYDAY and "Turn right at the next junction." in every
    assert all(form.count("{}") == len(slots) >= 1 for form, *slots in demo_data._EVERYDAY_FORMS)


@pytest.mark.parametrize("text, lowered", [("The door is open", "the door is open"),
                                           ("I am on my way home", "I am on my way home"),
                                           ("Anna is late", "Anna is late"), ("Dinner", "dinner")])
def test_a_message_lowers_the_first_word_unless_it_is_a_name(text, lowered):
    assert demo_data._lower_first(text) == lowered


def test_held_out_voices_never_appear_in_training():
    assert set(demo_data.TEST_VOICES).isdisjoint(demo_data.TRAIN_VOICES)
    assert {it["voice"] for it in demo_data.train_items(2000, seed=0)} <= set(demo_data.TRAIN_VOICES)
    tested = {it["voice"] for it in demo_data.test_items(300, seed=0)}
    assert tested <= set(demo_data.TEST_VOICES)
    assert any(v.startswith("flite/") for v in tested) and any(v.startswith("espeak-ng/") for v in tested)


@pytest.mark.parametrize("mix", ["core", "wide", "core-flite"])
def test_every_voice_mix_keeps_the_held_out_voices_out(mix):
    voices = [it["voice"] for it in demo_data.train_items(2000, seed=0, voices=mix)]
    voices += [it["voice"] for it in demo_data.mixed_items(300, seed=0, voices=mix)]
    voices += [it["voice"] for it in demo_data.spliced_items(300, seed=0, voices=mix)]
    voices += [it["voice"] for it in demo_data.scrambled_items(300, seed=0, voices=mix)]
    assert set(voices) <= set(demo_data.voice_mix(mix).voices) <= set(demo_data.TRAIN_VOICES)
    assert set(voices).isdisjoint(demo_data.TEST_VOICES)
    assert not any(f"+{v}" in voice for voice in voices for v in demo_data.HELD_OUT_VARIANTS)


def test_core_mix_draws_every_voice_equally_and_wide_gives_flite_a_fifth():
    def flite_share(mix):
        items = demo_data.train_items(4000, seed=1, voices=mix)
        return sum(it["voice"].startswith("flite/") for it in items) / len(items)

    core = demo_data.voice_mix("core")
    assert flite_share("core") == pytest.approx(len(core.flite) / len(core.voices), abs=0.015)
    assert flite_share("wide") == pytest.approx(0.2, abs=0.02)
    assert flite_share("core-flite") == pytest.approx(0.2, abs=0.02)
    named = {it["voice"].partition("+")[2] for it in demo_data.train_items(4000, seed=1, voices="wide")}
    assert len(named & set(demo_data.NAMED_VARIANTS)) > 50  # the wide mix really hears the named variants


def test_unknown_voice_mixes_and_shares_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"unknown voice mix 'loud'.*'core'.*'core-flite'.*'wide'"):
        demo_data.train_items(10, voices="loud")
    with pytest.raises(ValueError, match="flite_share is a share from 0 to 1"):
        demo_data.VoiceMix(demo_data.CORE_VOICES, flite_share=1.5)
    with pytest.raises(ValueError, match="at least one voice"):
        demo_data.VoiceMix(())
    with pytest.raises(ValueError, match="needs flite and espeak-ng voices both"):
        demo_data.VoiceMix(("espeak-ng/en+m1",), flite_share=0.2)


@needs_tts
def test_every_named_espeak_variant_speaks():
    rng = np.random.default_rng(0)
    for variant in demo_data.NAMED_VARIANTS:
        audio = demo_data.synthesize("Call mom.", f"espeak-ng/en-us+{variant}", rng)
        assert audio.dtype == np.float32 and 0.3 * demo_data.RATE < len(audio) < 3 * demo_data.RATE, variant
        assert np.abs(audio).max() > 0.05, variant


def test_test_split_holds_at_least_200_clips():
    assert len(demo_data.test_items(200, seed=0)) == 200
    with pytest.raises(ValueError, match="test_items takes"):
        demo_data.test_items(demo_data.TEST_POOL, seed=0)


def _speechlike(seconds=2.0):
    t = np.arange(int(seconds * demo_data.RATE)) / demo_data.RATE
    audio = 0.3 * np.sin(2 * np.pi * 220 * t) * (np.sin(2 * np.pi * 3 * t) > 0)
    return np.concatenate([np.zeros(4000), audio, np.zeros(4000)]).astype(np.float32)


@pytest.mark.parametrize("snr_db", [5.0, 12.5, 30.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_added_noise_has_the_requested_snr(snr_db, seed):
    audio = _speechlike()
    noisy = demo_data.add_noise(audio, snr_db, np.random.default_rng(seed))
    speech = audio[np.abs(audio) > 1e-4].astype(np.float64)
    noise = noisy.astype(np.float64) - audio
    measured = 10 * np.log10(np.mean(speech ** 2) / np.mean(noise ** 2))
    assert abs(measured - snr_db) < 0.05


def test_augmentation_draws_silence_snr_and_gain_within_range():
    audio = _speechlike()
    snrs = []
    for seed in range(40):
        record = {}
        out = demo_data.augment(audio, np.random.default_rng(seed), record)
        assert 0.1 <= record["lead"] <= 0.8 and 0.1 <= record["trail"] <= 0.8
        assert len(out) == len(audio) + int(record["lead"] * demo_data.RATE) + int(record["trail"] * demo_data.RATE)
        assert not np.any(out[:int(record["lead"] * demo_data.RATE)]) or record["snr_db"] is not None
        assert -18.0 <= record["gain_db"] <= 6.0
        assert out.dtype == np.float32 and np.max(np.abs(out)) <= 1.0
        if record["snr_db"] is not None:
            snrs.append(record["snr_db"])
    assert snrs and all(5.0 <= s <= 30.0 for s in snrs)


@needs_tts
def test_a_clip_is_a_function_of_text_voice_and_seed():
    a = demo_data.make_clip("Set a timer for ten minutes.", "espeak-ng/en-us+f2", seed=7)
    b = demo_data.make_clip("Set a timer for ten minutes.", "espeak-ng/en-us+f2", seed=7)
    c = demo_data.make_clip("Set a timer for ten minutes.", "espeak-ng/en-us+f2", seed=8)
    assert a.dtype == np.float32 and a.ndim == 1 and len(a) > demo_data.RATE
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[:min(len(a), len(c))], c[:min(len(a), len(c))])


@needs_tts
def test_held_out_clips_regenerate_as_audio_and_text():
    clips = demo_data.test_clips(3, seed=0)
    items = demo_data.test_items(3, seed=0)
    assert [text for _, text in clips] == [it["text"] for it in items]
    for audio, _ in clips:
        assert audio.dtype == np.float32 and 0.5 * demo_data.RATE < len(audio) < 10 * demo_data.RATE


def test_unknown_voice_is_rejected():
    with pytest.raises(ValueError, match="unknown voice 'piper/amy'"):
        demo_data.make_clip("Call mom.", "piper/amy", seed=0)
    with pytest.raises(ValueError, match="unknown voice 'festival/kal': festival's voices here are"):
        demo_data.make_clip("Call mom.", "festival/kal", seed=0)


# ---------------------------------------------------------------- mixed clips (second training stage)


def test_mixed_specs_are_seeded_prefix_stable_and_held_out():
    items = demo_data.mixed_items(300, seed=0)
    assert items == demo_data.mixed_items(300, seed=0)
    assert items[:100] == demo_data.mixed_items(100, seed=0)  # cached clips stay valid as --mix grows
    kinds = {it["kind"] for it in items}
    assert kinds == {"prefix", "multi", "long"}
    reserved = set(demo_data.test_sentences(demo_data.TEST_POOL, 0))
    for it in items:
        assert it["voice"] in demo_data.TRAIN_VOICES
        texts = [it["source"]] if it["kind"] == "prefix" else it["parts"]
        assert not reserved & set(texts)
        if it["kind"] == "prefix":
            assert it["voice"].startswith("espeak-ng/") and 1 <= it["keep"] < len(it["source"].split())
        elif it["kind"] == "multi":
            assert 2 <= len(it["parts"]) <= 4


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_prefix_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match="from 0 to 1"):
        demo_data.mixed_items(10, prefix=share)


@needs_tts
def test_espeak_word_starts_are_ordered_and_repeatable():
    text = "Set a timer for twenty-five minutes, then turn on the kitchen lights."
    audio, rate, starts = demo_data.espeak_words(text, "en-us+f2", 175, 40)
    assert rate == 22050 and len(starts) == len(text.split())
    known = [s for s in starts if s >= 0]  # espeak runs some short words into their neighbour
    assert starts[0] == 0 and len(known) >= len(starts) - 2
    assert all(a < b for a, b in zip(known, known[1:])) and known[-1] < len(audio)
    again = demo_data.espeak_words(text, "en-us+f2", 175, 40)
    np.testing.assert_array_equal(again[0], audio)
    assert again[2] == starts


@needs_tts
def test_a_prefix_clip_holds_the_words_before_its_cut():
    item = {"kind": "prefix", "source": "Turn on the lights in the kitchen, please.", "keep": 7,
            "voice": "espeak-ng/en-us+m3", "seed": 11}
    audio, text = demo_data.make_mixed_clip(item)
    assert text == "Turn on the lights in the kitchen"  # the cut word's comma dropped
    full = demo_data.make_clip(item["source"], item["voice"], item["seed"])
    assert 0.3 * len(full) < len(audio) < len(full)
    again, _ = demo_data.make_mixed_clip(item)
    np.testing.assert_array_equal(audio, again)


@needs_tts
def test_a_multi_sentence_clip_joins_its_parts_and_fits_one_window():
    parts = ["Call mom.", "What time is it?", "Set a timer for ten minutes."]
    item = {"kind": "multi", "parts": parts, "voice": "flite/slt", "seed": 5}
    audio, text = demo_data.make_mixed_clip(item)
    assert text == " ".join(parts)
    long = {"kind": "long", "parts": parts * 12, "voice": "espeak-ng/en+m1", "seed": 5}
    audio, text = demo_data.make_mixed_clip(long)
    assert len(audio) <= demo_data.MAX_SECONDS * demo_data.RATE
    assert text.startswith(" ".join(parts)) and len(text) < len(" ".join(long["parts"]))


def test_window_specs_are_seeded_prefix_stable_and_held_out():
    items = demo_data.window_items(200, seed=0, voices="broad")
    assert items == demo_data.window_items(200, seed=0, voices="broad")
    assert items[:50] == demo_data.window_items(50, seed=0, voices="broad")  # cached clips stay valid as N grows
    reserved = set(demo_data.test_sentences(demo_data.TEST_POOL, 0))
    assert 0.35 < np.mean([it["head"] for it in items]) < 0.65 and 0.45 < np.mean([it["tail"] for it in items]) < 0.75
    for it in items:
        assert it["kind"] == "window" and it["voice"] in demo_data.TRAIN_VOICES and not reserved & set(it["parts"])
        assert 20.0 <= sum(0.36 * len(p.split()) + 0.8 for p in it["parts"]) < 29.0 + 0.36 * 20 + 0.8


@needs_tts
@pytest.mark.parametrize("head, tail", [(True, True), (False, False), (True, False)])
def test_a_window_clip_starts_and_ends_where_its_spec_cuts_it(head, tail):
    parts = ["Turn on the lights in the kitchen, please.", "What time is it?", "Set a timer for ten minutes.",
             "Call mom on her mobile phone."] * 4
    item = {"kind": "window", "parts": parts, "voice": "espeak-ng/en-us+m3", "head": head, "tail": tail, "seed": 3}
    audio, text = demo_data.make_mixed_clip(item)
    assert len(audio) <= demo_data.MAX_SECONDS * demo_data.RATE
    whole = " ".join(parts)
    words = text.split()
    # a head cut drops the first sentence's first words; a tail cut keeps a prefix of a sentence
    assert (whole.startswith(text.rstrip(",;:")) if not head else
            whole.find(" ".join(words[:6])) > 0 and len(words[0]) and not text.startswith("Turn on"))
    assert text.endswith((".", "?")) != tail or len(text.split()) < len(whole.split())
    again = demo_data.make_mixed_clip(item)
    np.testing.assert_array_equal(audio, again[0])
    assert again[1] == text


def test_augmenting_a_clip_cut_at_both_ends_adds_no_silence_at_either():
    speech = np.random.default_rng(0).standard_normal(8000).astype(np.float32) * 0.1
    drawn: dict = {}
    out = demo_data.augment(speech, np.random.default_rng(1), record=drawn, leading=False, trailing=False)
    assert len(out) == len(speech) and drawn["lead"] == drawn["trail"] == 0.0
    padded = demo_data.augment(speech, np.random.default_rng(1))
    assert len(padded) > len(speech) + 0.2 * demo_data.RATE  # 0.1-0.8 s at each end otherwise


def _batches(perturb):
    from tools import train_demo_model as tdm

    rng = np.random.default_rng(0)
    lengths = [16000, 30000, 47000, 47900, 20000, 64000]
    rows = [{"pcm": (rng.standard_normal(n) * 3000).astype(np.int16)} for n in lengths]
    ids = [[2, 512, 5, 6, 1]] * len(rows)
    return tdm, tdm.Batches(rows, ids, np.random.default_rng(1), perturb=perturb), rows


def test_speed_perturbation_changes_each_clip_and_never_overflows_its_batch():
    tdm, batches, rows = _batches(0.1)
    samples = tdm.bucket(48000)
    out = batches.perturbed([1, 2, 3], samples)
    for before, after in zip([rows[i] for i in (1, 2, 3)], out):
        speed = len(before["pcm"]) / len(after["pcm"])
        assert 0.9 - 1e-3 <= speed <= 1.1 + 1e-3 and len(after["pcm"]) <= samples
        assert after["pcm"].dtype == np.int16
    assert len(out[2]["pcm"]) <= samples  # 47900 samples in a 48000 bucket: barely slowed, if at all


def test_no_perturbation_returns_the_clips_untouched_and_draws_nothing():
    _, batches, rows = _batches(0.0)
    state = batches.rng.bit_generator.state
    assert [r["pcm"] is rows[i]["pcm"] for i, r in zip((0, 4), batches.perturbed([0, 4], 48000))] == [True, True]
    assert batches.rng.bit_generator.state == state


def test_spliced_specs_are_seeded_prefix_stable_and_held_out():
    items = demo_data.spliced_items(200, seed=0)
    assert items == demo_data.spliced_items(200, seed=0) and items[:50] == demo_data.spliced_items(50, seed=0)
    reserved = set(demo_data.test_sentences(demo_data.TEST_POOL, 0))
    assert all(it["kind"] == "spliced" and it["voice"] in demo_data.TRAIN_VOICES for it in items)
    assert not reserved & {it["source"] for it in items}


def test_speech_span_trims_the_silence_around_a_sound():
    audio = np.zeros(16000, np.float32)
    audio[4800:9600] = np.sin(np.arange(4800) * 0.3)
    assert demo_data.speech_span(audio) == (4800, 9600)
    assert demo_data.speech_span(np.zeros(1000, np.float32)) == (0, 0)


@needs_tts
def test_a_spliced_clip_says_its_sentence_one_word_at_a_time():
    item = next(it for it in demo_data.spliced_items(50, seed=0) if it["voice"].startswith("espeak-ng/"))
    audio, text = demo_data.make_mixed_clip(item)
    assert text == item["source"]
    again, _ = demo_data.make_mixed_clip(item)
    np.testing.assert_array_equal(audio, again)
    # the words' own spans (same voice, speed and pitch for each) plus 0.05-0.7 s between them and
    # 0.1-0.8 s of lead and trail: the clip is exactly that long range
    voice_seed = int(np.random.default_rng(item["seed"]).integers(2 ** 31))
    words = item["source"].split()
    spans = [demo_data.speech_span(demo_data.synthesize(w, item["voice"], np.random.default_rng(voice_seed)))
             for w in words]
    speech = sum(e - s for s, e in spans) / demo_data.RATE
    assert all(e > s for s, e in spans)
    seconds = len(audio) / demo_data.RATE
    assert speech + 0.05 * (len(words) - 1) + 0.2 - 0.01 <= seconds <= speech + 0.7 * (len(words) - 1) + 1.6 + 0.01
    # where each word sits in the clip: its own length, 0.05-0.7 s after the previous one, after
    # 0.1-0.8 s of lead, and the same clip as without asking
    placed: list = []
    with_spans, _ = demo_data.make_mixed_clip(item, placed)
    np.testing.assert_array_equal(with_spans, audio)
    assert [b - a for a, b in placed] == [e - s for s, e in spans]
    assert 0.1 * demo_data.RATE - 1 <= placed[0][0] <= 0.8 * demo_data.RATE
    gaps = [(c - b) / demo_data.RATE for (_, b), (c, _) in zip(placed, placed[1:])]
    assert all(0.05 - 1e-3 <= g <= 0.7 for g in gaps), gaps
    assert placed[-1][1] + 0.1 * demo_data.RATE - 1 <= len(audio)


@needs_tts
def test_a_word_by_word_clip_puts_silence_after_the_share_of_words_asked():
    sentence = "set a timer for ten minutes"
    pcm, truth = demo_data.word_by_word_clip(sentence, "espeak-ng/en-us", 0, np.random.default_rng(0))
    assert [w for w, _, _ in truth] == sentence.split()
    assert truth[0][1] == pytest.approx(0.5)
    gaps = [b[1] - a[2] for a, b in zip(truth, truth[1:])]
    assert all(0.3 - 1e-3 <= g <= 0.6 for g in gaps), gaps
    for (_, start, end) in truth:  # each span is the word's sound: digital silence just outside it
        a, b = round(start * demo_data.RATE), round(end * demo_data.RATE)
        assert np.abs(pcm[a:b]).max() > 0.01 and pcm[a - 1] == 0.0 and pcm[b] == 0.0
    _, joined = demo_data.word_by_word_clip(sentence, "espeak-ng/en-us", 0, np.random.default_rng(0), pause_share=0.0)
    assert all(b[1] == pytest.approx(a[2]) for a, b in zip(joined, joined[1:]))  # one word straight into the next
    _, some = demo_data.word_by_word_clip(sentence, "espeak-ng/en-us", 0, np.random.default_rng(1), pause_share=0.5)
    assert 0 < sum(b[1] - a[2] > 0.2 for a, b in zip(some, some[1:])) < 5
    with pytest.raises(ValueError, match="pause_share"):
        demo_data.word_by_word_clip(sentence, "espeak-ng/en-us", 0, np.random.default_rng(0), pause_share=1.5)


@needs_tts
def test_a_spliced_clips_manifest_row_holds_its_word_spans(tmp_path):
    """write_split keeps each spliced clip's word spans next to it (and makes them for a clip
    synthesised before spans were kept), so training can read where the words are."""
    items = demo_data.spliced_items(3, seed=0)
    rows = [json.loads(line) for line in open(demo_data.write_split(items, str(tmp_path), "spliced", workers=1))]
    for item, row in zip(items, rows):
        placed: list = []
        audio, _ = demo_data.make_mixed_clip(item, placed)
        assert row["words"] == [list(p) for p in placed] and len(placed) == len(row["text"].split())
    (tmp_path / "spliced" / "000000.words.json").unlink()
    again = [json.loads(line) for line in open(demo_data.write_split(items, str(tmp_path), "spliced", workers=1))]
    assert again == rows


def test_scrambled_specs_are_seeded_prefix_stable_and_held_out():
    items = demo_data.scrambled_items(300, seed=0)
    assert items == demo_data.scrambled_items(300, seed=0) and items[:50] == demo_data.scrambled_items(50, seed=0)
    assert items != demo_data.scrambled_items(300, seed=1)
    reserved = set(demo_data.test_sentences(demo_data.TEST_POOL, 0))
    assert not reserved & {it["text"] for it in items}
    assert all(it["voice"] in demo_data.CORE_VOICES for it in items)
    flite = demo_data.scrambled_items(500, seed=0, voices="core-flite")
    assert sum(it["voice"].startswith("flite/") for it in flite) / len(flite) == pytest.approx(0.2, abs=0.04)


def test_scrambled_sentences_use_every_grammar_word_in_its_grammar_spelling():
    vocabulary = demo_data.grammar_vocabulary()
    items = demo_data.scrambled_items(3000, seed=0)
    words = [w for it in items for w in it["text"][:-1].split()]
    assert all(it["text"][0].isupper() and it["text"].endswith(".") for it in items)
    assert {3, 8} <= {len(it["text"].split()) for it in items} <= set(range(3, 9))
    assert {w.lower() for w in words} == vocabulary  # 3000 clips x 5.5 words reach all 525 words
    inner = {w for it in items for w in it["text"][:-1].split()[1:]}
    assert {"Madrid", "Monday", "Diana", "I"} <= inner  # names, days and "I" keep their capital
    assert {"lovely", "kettle", "seven"} <= inner and not {"Lovely", "Kettle", "Seven"} & inner


@needs_tts
def test_a_scrambled_clip_is_an_ordinary_clip_of_its_text():
    item = demo_data.scrambled_items(1, seed=0)[0]
    audio = demo_data.make_clip(item["text"], item["voice"], item["seed"])
    np.testing.assert_array_equal(audio, demo_data.make_clip(item["text"], item["voice"], item["seed"]))
    assert 0.5 < len(audio) / demo_data.RATE < 10


def test_ctc_fits_says_which_rows_have_a_ctc_path_as_optax_scores_them():
    """The training script leaves CTC out for clips too short for their transcripts: optax scores
    those ~1e5 (one such row swamped a whole batch's loss), the others stay small."""
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp
    from tools import train_demo_model as tdm

    text = np.array([[5, 6, 7, 0, 0], [5, 5, 5, 0, 0], [5, 6, 7, 8, 9], [5, 5, 0, 0, 0]], np.int32)
    frames = np.array([3, 4, 5, 2], np.int32)  # needs 3, 5 (two blanks), 5 and 3 (one blank)
    fits = np.asarray(tdm.ctc_fits(jnp.asarray(text), jnp.asarray(frames), 0))
    assert fits.tolist() == [True, False, True, False]
    logits = jnp.zeros((4, 6, 10))
    loss = np.asarray(optax.ctc_loss(logits, (jnp.arange(6) >= frames[:, None]).astype(jnp.float32),
                                     jnp.asarray(text), jnp.asarray(text == 0, jnp.float32), blank_id=0))
    assert (loss[fits] < 50).all() and (loss[~fits] > 1e3).all()


def test_the_broad_mix_is_the_wide_one_with_a_channel_on_most_clips_and_no_festival_voice():
    wide, broad = demo_data.train_items(2000, seed=0, voices="wide"), demo_data.train_items(2000, seed=0, voices="broad")
    assert [{k: v for k, v in it.items() if k != "channel"} for it in broad] == wide   # the same voices and seeds
    assert sum(it.get("channel", False) for it in broad) / len(broad) == pytest.approx(0.7, abs=0.03)
    for make in (demo_data.mixed_items, demo_data.spliced_items, demo_data.scrambled_items):
        items = make(400, seed=0, voices="broad")
        assert 0.6 < sum(it.get("channel", False) for it in items) / len(items) < 0.8
        assert not any(it["voice"].startswith("festival/") for it in items)
    assert not any("channel" in it for it in demo_data.test_items(300))              # the test split is unchanged
    with pytest.raises(ValueError, match="channel is a share from 0 to 1"):
        demo_data.VoiceMix(demo_data.CORE_VOICES, channel=2.0)


def test_a_family_holds_every_voice_of_one_synthesiser_and_the_families_are_disjoint():
    families = demo_data.FAMILIES
    assert all(v.startswith(name + "/") for name, voices in families.items() for v in voices)
    assert set(demo_data.TRAIN_VOICES) | set(demo_data.TEST_VOICES) >= set(families["flite"])
    items = demo_data.family_items("festival", 9)
    assert [it["text"] for it in items] == [it["text"] for it in demo_data.test_items(9)]
    assert [it["voice"] for it in items] == list(families["festival"]) * 3
    with pytest.raises(ValueError, match="unknown synthesiser family 'piper'"):
        demo_data.family_items("piper", 3)


def test_the_channel_keeps_the_length_and_is_a_function_of_its_draws():
    speech = (0.3 * np.sin(np.arange(16000) * 0.07)).astype(np.float32)
    seen = {}
    for seed in range(12):
        drawn: dict = {}
        out = demo_data.channel(speech, np.random.default_rng(seed), drawn)
        again = demo_data.channel(speech, np.random.default_rng(seed))
        assert out.dtype == np.float32 and out.shape == speech.shape and np.abs(out).max() <= 0.99
        np.testing.assert_array_equal(out, again)
        for key in drawn:
            seen[key] = seen.get(key, 0) + 1
    assert {"rt60", "telephone", "eq_hz"} <= set(seen)          # each stage is drawn on some clips
    assert 0.1 <= drawn.get("rt60", 0.5) <= 0.9


def test_a_telephone_channel_removes_what_a_telephone_line_does_not_carry():
    rng = np.random.default_rng(3)
    noise = rng.standard_normal(32000).astype(np.float32) * 0.1
    for seed in range(40):
        drawn: dict = {}
        out = demo_data.channel(noise, np.random.default_rng(seed), drawn)
        if drawn.get("telephone") and "rt60" not in drawn:
            spectrum = np.abs(np.fft.rfft(out)) ** 2
            freqs = np.fft.rfftfreq(len(out), 1 / demo_data.RATE)
            assert spectrum[freqs > 4500].sum() < 0.01 * spectrum[(freqs > 500) & (freqs < 3000)].sum()
            return
    pytest.fail("no telephone channel without reverberation in 40 draws")


@pytest.mark.skipif(not shutil.which("text2wave"), reason="festival is needed (.ci/run installs it)")
def test_every_festival_voice_speaks():
    for voice in demo_data.FAMILIES["festival"]:
        audio = demo_data.make_clip("Call mom on her mobile phone.", voice, seed=1)
        assert audio.dtype == np.float32 and np.abs(audio).max() > 0.05, voice


def test_paused_items_put_pauses_inside_sentences_and_keep_fragments_as_their_own_clips():
    items = demo_data.paused_items(400, seed=0, voices="broad")
    assert items == demo_data.paused_items(400, seed=0, voices="broad")          # a pure function of the seed
    reserved = demo_data._reserved(0)
    kinds = [it["kind"] for it in items]
    assert 0.5 < kinds.count("paused") / len(items) < 0.7
    for it in items:
        words = it["source"].split()
        assert it["source"] not in reserved and not it["voice"].startswith("festival/")
        if it["kind"] == "paused":
            assert 1 <= len(it["cuts"]) <= 2 and all(0 < c < len(words) for c in it["cuts"])
        else:
            assert 1 <= it["keep"] < len(words)
    assert any(it["kind"] == "fragment" and it["keep"] == 1 for it in items)


@pytest.mark.slow
def test_a_paused_clip_is_its_sentence_with_silence_inside():
    item = next(it for it in demo_data.paused_items(20, seed=0) if it["kind"] == "paused")
    audio, text = demo_data.make_mixed_clip(item)
    assert text == item["source"]
    fluent = demo_data.make_clip(text, item["voice"], item["seed"])
    assert len(audio) > len(fluent)                          # at least PAUSE_RANGE[0] s more
