"""StreamSession: pass schedule, commits, bounded buffer — driven by a scripted fake model.

The fake "hears" audio built from constant-amplitude segments: segment k (amplitude 0.001·(k+1))
is the word "w{k}". A word cut off by the end of the buffer is misheard unless most of it is there,
which is what makes two-pass agreement necessary.
"""

from __future__ import annotations

import numpy as np
import pytest

from whistle_stream import streaming
from whistle_stream.streaming import MAX_BUFFER_S, StreamSession

RATE = 16000
UNIT = 0.001


class FakeModel:
    def __init__(self, languages=("en", "de")):
        self.dims = type("D", (), {"rate": RATE, "languages": languages})()
        self.passes: list[float] = []  # seconds of audio each pass saw
        self.prefixes: list[str] = []  # the committed words each pass was given to read first

    def load_audio(self, audio):
        return np.asarray(audio, np.float32)

    def is_speech(self, pcm):
        return bool(np.any(pcm))

    def check_language(self, language):
        if language not in self.dims.languages:
            raise ValueError(f"unknown language {language!r}")
        return language

    def parse_keywords(self, keywords):
        return [] if not keywords else list(keywords)

    def transcribe_words(self, audio, language=None, keywords=None, beams=None, open_end=False, prefix="",
                         draft=(), memo=None):
        self.passes.append(len(audio) / RATE)
        self.prefixes.append(prefix)
        if not np.any(audio):
            return {"speech": False, "language": language or "", "text": "", "words": []}
        words = []
        nz = np.flatnonzero(audio)
        edges = np.flatnonzero(np.diff(nz) > 1)
        starts = np.r_[nz[0], nz[edges + 1]]
        ends = np.r_[nz[edges], nz[-1]] + 1
        for s, e in zip(starts, ends):
            k = int(round(float(audio[s]) / UNIT)) - 1
            whole = e < len(audio) or (e - s) / RATE >= 0.3
            text = f"w{k}" + ("." if k % 5 == 4 else "") if whole else "uh"
            words.append({"word": text, "start": s / RATE, "end": e / RATE, "probability": 0.9})
        return {"speech": True, "language": language or "de", "text": " ".join(w["word"] for w in words),
                "words": words}


def scripted_audio(n_words: int, seed: int = 0, pause=(0.15, 0.5), length=(0.25, 0.6), lead=0.3) -> tuple[np.ndarray, list]:
    rng = np.random.default_rng(seed)
    parts, truth, t = [np.zeros(int(lead * RATE), np.float32)], [], int(lead * RATE)
    for k in range(n_words):
        dur = int(rng.uniform(*length) * RATE)
        parts.append(np.full(dur, UNIT * (k + 1), np.float32))
        truth.append((f"w{k}", t / RATE, (t + dur) / RATE))
        t += dur
        gap = int((rng.uniform(*pause) if k % 7 != 6 else 1.5) * RATE)  # now and then a long pause
        parts.append(np.zeros(gap, np.float32))
        t += gap
    return np.concatenate(parts), truth


def run(audio: np.ndarray, chunk_ms: float, passes: list | None = None, **kw) -> tuple[list[dict], StreamSession]:
    session = StreamSession(FakeModel(), on_pass=None if passes is None else passes.append, **kw)
    step = max(1, int(chunk_ms * RATE / 1000))
    out = [session.feed(audio[i:i + step]) for i in range(0, len(audio), step)]
    out.append(session.finish())
    return out, session


def states(dicts: list[dict]) -> list[tuple]:
    """The sequence of (revision, committed so far, pending) the dicts describe, timing removed."""
    seen, committed = [(0, (), "", "")], []  # the state before the first pass
    for d in dicts:
        committed += [(w["word"], w["start"], w["end"]) for w in d["words"]]
        state = (d["revision"], tuple(committed), d["pending"], d["language"])
        if not seen or seen[-1] != state:
            seen.append(state)
    return seen


def _timeless(passes: list[dict]) -> list[dict]:
    return [{k: v for k, v in p.items() if k != "pass_ms"} for p in passes]


def test_output_is_identical_for_any_chunking():
    audio, _ = scripted_audio(30, seed=1)
    ref_passes: list[dict] = []
    reference, _ = run(audio, 1000, ref_passes)
    assert len(ref_passes) > 10
    for chunk_ms in (10, 20, 100, 250, 3000):
        passes: list[dict] = []
        got, _ = run(audio, chunk_ms, passes)
        # Pass by pass the output is the same; calls that span several passes merge them.
        assert _timeless(passes) == _timeless(ref_passes), chunk_ms
        assert [w for d in got for w in d["words"]] == [w for d in reference for w in d["words"]]
        assert got[-1]["revision"] == reference[-1]["revision"]
        if chunk_ms <= 1000:
            assert states(got) == states(reference), chunk_ms


def test_every_word_is_committed_once_in_order_with_its_times():
    audio, truth = scripted_audio(40, seed=2)
    dicts, _ = run(audio, 250)
    words = [w for d in dicts for w in d["words"]]
    assert [w["word"].rstrip(".") for w in words] == [t[0] for t in truth]
    for w, (_, start, end) in zip(words, truth):
        assert abs(w["start"] - start) < 1e-3 and abs(w["end"] - end) < 1e-3


def test_invariants_hold_on_every_call():
    audio, _ = scripted_audio(25, seed=3)
    dicts, _ = run(audio, 333)
    revision, committed, last_end = -1, "", 0.0
    for d in dicts:
        assert d["revision"] >= revision
        revision = d["revision"]
        committed += d["text"]   # the pieces concatenate to the transcript as they are
        if committed and d["pending"]:
            assert d["pending"].startswith(" ")
        for w in d["words"]:
            assert w["start"] >= last_end - 1e-9 and w["end"] >= w["start"]
            assert w["end"] <= d["received"] + 1e-9
            last_end = w["end"]
    assert dicts[-1]["pending"] == ""
    assert committed == " ".join(w["word"] for d in dicts for w in d["words"])


def test_committed_text_never_changes_and_pending_is_the_unconfirmed_tail():
    audio, _ = scripted_audio(12, seed=4)
    session = StreamSession(FakeModel())
    committed: list[str] = []
    step = RATE // 4
    for i in range(0, len(audio), step):
        d = session.feed(audio[i:i + step])
        committed += [w["word"] for w in d["words"]]
        if d["pass_ms"] > 0 and session.model.passes:
            last = session.model.transcribe_words(session._buffer[: session._last_pass_end() - session._buffer_start])
            hyp = [w["word"] for w in last["words"]]
            assert hyp[len(hyp) - len(d["pending"].split()) if d["pending"] else len(hyp):] == (
                d["pending"].split() if d["pending"] else [])
    final = session.finish()
    assert final["pending"] == ""


def test_a_pass_runs_once_per_step_of_received_audio():
    audio, _ = scripted_audio(6, seed=5)
    _, session = run(audio, 70)
    n_steps = len(audio) // RATE
    assert session.passes >= n_steps  # plus the final partial pass of finish()
    assert session.passes <= n_steps + 1


def test_the_buffer_stays_bounded_on_a_long_stream():
    audio, truth = scripted_audio(600, seed=6, pause=(0.1, 0.3))
    assert len(audio) / RATE > 300
    session = StreamSession(FakeModel())
    longest, words = 0.0, []
    for i in range(0, len(audio), RATE):
        d = session.feed(audio[i:i + RATE])
        words += d["words"]
        longest = max(longest, session.buffer_s)
    words += session.finish()["words"]
    assert longest <= MAX_BUFFER_S
    assert max(session.model.passes) <= MAX_BUFFER_S
    assert [w["word"].rstrip(".") for w in words] == [t[0] for t in truth]


def test_speech_without_pauses_is_force_committed_before_the_buffer_fills():
    # One 40-second stretch of words with tiny gaps: the 30 s cap must commit through a boundary.
    audio, truth = scripted_audio(120, seed=7, pause=(0.02, 0.04), length=(0.25, 0.35))
    dicts, session = run(audio, 1000)
    words = [w["word"].rstrip(".") for d in dicts for w in d["words"]]
    assert words == [t[0] for t in truth]
    assert max(session.model.passes) <= MAX_BUFFER_S


def test_the_language_is_detected_once_and_then_held():
    audio, _ = scripted_audio(10, seed=8)
    dicts, session = run(audio, 500)
    langs = {d["language"] for d in dicts if d["language"]}
    assert langs == {"de"}


def test_a_forced_language_is_used_from_the_start():
    audio, _ = scripted_audio(4, seed=9)
    dicts, _ = run(audio, 500, language="en")
    assert all(d["language"] == "en" for d in dicts)


def test_silence_after_speech_finalizes_the_pending_tail():
    audio, truth = scripted_audio(3, seed=10)
    audio = np.concatenate([audio, np.zeros(4 * RATE, np.float32)])
    session = StreamSession(FakeModel())
    words = []
    for i in range(0, len(audio), RATE // 2):
        words += session.feed(audio[i:i + RATE // 2])["words"]
    assert [w["word"].rstrip(".") for w in words] == [t[0] for t in truth]
    assert session.pending_text == ""


def test_finalize_commits_now_and_streaming_continues():
    audio, truth = scripted_audio(8, seed=11)
    half = len(audio) // 2
    session = StreamSession(FakeModel())
    first = session.feed(audio[:half])
    fin = session.finalize()
    assert fin["pending"] == ""
    rest = session.feed(audio[half:])
    last = session.finish()
    words = [w["word"].rstrip(".") for d in (first, fin, rest, last) for w in d["words"]]
    # A word cut in two by finalize() may come out as a misheard fragment, never doubled.
    assert len(words) == len(set(words))


def test_feeding_a_finished_stream_is_refused():
    session = StreamSession(FakeModel())
    session.finish()
    with pytest.raises(RuntimeError, match="finished"):
        session.feed(np.zeros(10, np.float32))


def test_bad_step_is_refused():
    with pytest.raises(ValueError, match="step_s"):
        StreamSession(FakeModel(), step_s=0)


def _speechlike(seconds: float, rng) -> np.ndarray:
    return (0.1 * rng.standard_normal(int(seconds * RATE))).astype(np.float32)


def test_last_pause_finds_the_newest_long_quiet_run():
    from whistle_stream.spans import last_pause

    rng = np.random.default_rng(0)
    gap = np.zeros(int(0.6 * RATE), np.float32)
    audio = np.concatenate([_speechlike(2.0, rng), gap, _speechlike(0.5, rng)])
    mid = last_pause(audio, RATE)
    assert mid is not None and abs(mid - int(2.3 * RATE)) <= 320  # the middle of the gap
    assert last_pause(audio, RATE, since=len(audio) - int(0.4 * RATE)) is None  # the gap ended before
    short = np.concatenate([_speechlike(2.0, rng), np.zeros(int(0.3 * RATE), np.float32), _speechlike(0.5, rng)])
    assert last_pause(short, RATE) is None  # 0.3 s is a breath, not a pause
    trailing = np.concatenate([_speechlike(2.0, rng), gap])
    assert abs(last_pause(trailing, RATE) - int(2.3 * RATE)) <= 320  # still open at the end
    noisy = audio.copy()
    noisy[int(2.0 * RATE):int(2.6 * RATE)] = 0.05 * rng.standard_normal(int(0.6 * RATE))  # 6 dB down
    assert last_pause(noisy, RATE) is None
    assert last_pause(np.zeros(RATE, np.float32), RATE) == RATE // 2  # digital silence is one pause
    leading = np.concatenate([gap, _speechlike(1.0, rng)])
    assert last_pause(leading, RATE) is not None
    assert last_pause(leading, RATE, leading=False) is None  # quiet before anything was said
    assert last_pause(np.zeros(RATE, np.float32), RATE, leading=False) is None


def test_a_pass_leaves_out_digital_silence_at_the_buffer_start_and_most_of_it_at_the_end():
    from whistle_stream.spans import EDGE_ZEROS_S, sound_span

    audio = np.concatenate([np.zeros(RATE, np.float32), np.full(RATE // 2, 0.1, np.float32),
                            np.zeros(RATE, np.float32)])
    first, last = sound_span(audio, RATE)
    assert first == RATE and last == RATE + RATE // 2 + int(EDGE_ZEROS_S * RATE)
    assert sound_span(np.zeros(100, np.float32), RATE) == (0, 0)


def test_digital_silence_is_what_a_resampler_leaves_of_exact_zeros():
    """A 48 kHz microphone resampled to 16 kHz turns exact zeros into values a few 1e-6 off zero
    (ringing, float round-off); under one step of 16-bit PCM they are still digital silence, so
    the pass is cut as it is for the exact zeros (streams heard through a 48 kHz microphone read up
    to 20 points worse when they counted as sound). A 16-bit sample one step off zero is sound."""
    from whistle_stream.spans import DIGITAL_SILENCE, sound_span

    rng = np.random.default_rng(0)
    audio = np.concatenate([np.zeros(RATE, np.float32), np.full(RATE // 2, 0.1, np.float32),
                            np.zeros(RATE, np.float32)])
    rung = audio + (rng.uniform(-0.99, 0.99, len(audio)) * DIGITAL_SILENCE * (audio == 0)).astype(np.float32)
    assert np.count_nonzero(rung) > 2 * RATE and sound_span(rung, RATE) == sound_span(audio, RATE)
    blip = audio.copy()
    blip[RATE // 2] = 1.0 / 32768                                # one 16-bit step: sound
    assert sound_span(blip, RATE)[0] <= RATE // 2


def test_finishing_a_buffer_of_sub_step_values_runs_no_pass():
    """A buffer holding only digital silence a resampler left a few 1e-6 off zero (a muted 48 kHz
    microphone) has nothing to read: finish runs no pass over it, as for exact zeros."""
    from whistle_stream.spans import DIGITAL_SILENCE

    for fill in (np.zeros(RATE // 2, np.float32),
                 (np.random.default_rng(0).uniform(-0.99, 0.99, RATE // 2) * DIGITAL_SILENCE).astype(np.float32)):
        model = FakeModel()
        session = StreamSession(model)
        session.feed(fill[: RATE // 4])   # under a step's worth of audio: no pass yet
        before = len(model.passes)
        out = session.finish()
        assert out["words"] == () and len(model.passes) == before, model.passes


class Babbler(FakeModel):
    """Reads any audio under `short_s` seconds as a whole sentence (a small model's reading of a
    noise burst); longer audio as the fake hears it."""

    def __init__(self, short_s: float):
        super().__init__()
        self.short_s = short_s

    def transcribe_words(self, audio, **kw):
        heard = super().transcribe_words(audio, **kw)
        if heard["speech"] and len(audio) / RATE < self.short_s:
            said = "Will it rain in Berlin tomorrow?".split()
            step = len(audio) / RATE / len(said)
            heard["words"] = [{"word": w, "start": i * step, "end": (i + 1) * step, "probability": 0.9}
                              for i, w in enumerate(said)]
        return heard


def test_more_words_than_the_audio_could_hold_are_not_heard():
    """A 0.6 s noise burst read as a six-word sentence is not committed when the utterance ends
    (finalize), and the reading does not cut the buffer: the words after it still come."""
    from whistle_stream.spans import MAX_WORDS_PER_S, sayable

    assert sayable(4, 0.5) and not sayable(6, 0.6) and sayable(int(MAX_WORDS_PER_S * 2) + 1, 2.0)
    burst = np.full(int(0.6 * RATE), UNIT, np.float32)
    session = StreamSession(Babbler(short_s=0.8))
    out = session.feed(burst)
    out = session.finalize()
    assert out["words"] == () and session.pending_text == ""
    z = lambda s: np.zeros(int(s * RATE), np.float32)  # noqa: E731
    words = session.feed(np.concatenate([z(0.5), np.full(int(1.2 * RATE), 2 * UNIT, np.float32), z(1.5)]))["words"]
    words += session.finish()["words"]
    assert [w["word"] for w in words] == ["w1"]
    # the same words in audio long enough to say them are heard
    said = StreamSession(Babbler(short_s=1.5))
    said.feed(np.full(int(1.2 * RATE), UNIT, np.float32))
    assert [w["word"] for w in said.finalize()["words"]][:2] == ["Will", "it"]


def test_a_pass_keeps_some_digital_silence_around_clean_speech():
    """Speech with no noise floor (its pauses are exact zeros) keeps CLEAN_MARGIN_S of the zeros
    on each side, as clips with silence around the speech are what the model was trained on."""
    from whistle_stream.spans import CLEAN_MARGIN_S, sound_span

    z = lambda s: np.zeros(int(s * RATE), np.float32)  # noqa: E731
    word = np.full(RATE // 2, 0.1, np.float32)
    audio = np.concatenate([z(1.0), word, z(0.2), word, z(1.0)])
    first, last = sound_span(audio, RATE)
    margin = int(CLEAN_MARGIN_S * RATE)
    assert first == RATE - margin and last == RATE + int(1.2 * RATE) + margin
    tight = np.concatenate([z(0.1), word, z(0.2), word])  # less room than the margin: up to the edges
    assert sound_span(tight, RATE) == (0, len(tight))


def test_finalize_hears_the_words_after_a_pause_in_its_last_pass():
    # w0 runs past the last whole step (3 s), then a 0.6 s pause and w1 end the stream: the final
    # pass ends the utterance at that pause, hearing only the audio before it, so w1 needs its own.
    z = lambda s: np.zeros(int(s * RATE), np.float32)  # noqa: E731
    audio = np.concatenate([z(2.6), np.full(int(0.5 * RATE), UNIT, np.float32), z(0.6),
                            np.full(int(0.2 * RATE), 2 * UNIT, np.float32), z(0.03)])
    dicts, _ = run(audio, 1000)
    assert [w["word"] for d in dicts for w in d["words"]] == ["w0", "w1"]


def test_after_a_new_utterance_words_are_not_filtered_by_the_old_horizon():
    from whistle_stream.commit import CommitPolicy, Word

    policy = CommitPolicy()
    first = [Word("set", 0.2, 0.5), Word("a", 0.5, 0.6), Word("timer.", 0.6, 1.4)]
    policy.update(first)
    policy.update(first)
    assert [w.word for w in policy.committed] == ["set", "a", "timer."]
    policy.new_utterance()
    # The next utterance's buffer starts at the pause; a first word aligned a little early (its
    # DTW start before the old horizon) is still new, and a re-heard "timer." is not committed twice.
    second = [Word("timer.", 1.35, 1.45), Word("call", 1.38, 1.9), Word("laura.", 1.9, 2.4)]
    policy.update(second)
    got = policy.update(second)
    assert [w.word for w in got.committed] == ["set", "a", "timer.", "call", "laura."]


def test_a_faint_sound_after_speech_is_silence_not_a_new_utterance():
    """Audio 40 dB or more under the stream's last speech is not decoded (the silence gate of §8
    judges a clip only against itself: a faint tail passes it, and a model makes words of it)."""
    z = lambda s: np.zeros(int(s * RATE), np.float32)  # noqa: E731
    loud = np.full(int(0.5 * RATE), 100 * UNIT, np.float32)  # "w99."
    faint = np.full(int(0.4 * RATE), 0.6 * UNIT, np.float32)  # 44 dB under it; the fake would say "w0"
    audio = np.concatenate([z(0.3), loud, z(1.0), faint, z(1.2)])
    out, _ = run(audio, 100)
    assert [w["word"] for d in out for w in d["words"]] == ["w99."]
    # the same faint sound with no louder speech before it is heard
    out, _ = run(np.concatenate([z(0.3), faint, z(1.2)]), 100)
    assert [w["word"] for d in out for w in d["words"]] == ["w0"]


class WaveringTail(FakeModel):
    """Reads the last word of an utterance heard up to its pause as "first" on the first such
    pass and "second" after: a tail two passes at the pause do not agree on."""

    def __init__(self):
        super().__init__()
        self.closed_passes = 0

    def transcribe_words(self, audio, language=None, keywords=None, beams=None, open_end=False, prefix="",
                         draft=(), memo=None):
        result = super().transcribe_words(audio, language, keywords, beams, open_end, prefix, draft)
        if not open_end and result["words"]:
            self.closed_passes += 1
            last = {**result["words"][-1], "word": "first" if self.closed_passes == 1 else "second"}
            result = {**result, "words": result["words"][:-1] + [last]}
        return result


def _stream_wavering(stable: bool):
    audio = np.concatenate([np.zeros(RATE // 2, np.float32), np.full(int(0.6 * RATE), UNIT, np.float32),
                            np.zeros(RATE // 5, np.float32), np.full(int(0.5 * RATE), 2 * UNIT, np.float32),
                            np.zeros(4 * RATE, np.float32)])
    session = StreamSession(WaveringTail(), stable_at_pause=stable)
    calls = [session.feed(audio[i:i + RATE // 2]) for i in range(0, len(audio), RATE // 2)]
    return calls, session


def test_silence_finalizes_a_tail_once_two_passes_at_the_pause_read_it():
    """Silence after speech finalizes the pending tail once it has been stable for two
    passes. The first pass at the pause reads the tail differently from the pass before it, so it
    waits; the second pass at the pause decides (here it reads it differently again: it is final
    after that pass in any case, one step later)."""
    calls, session = _stream_wavering(True)
    words = [w["word"] for d in calls for w in d["words"]]
    assert words == ["w0", "second"] and session.pending_text == ""
    first_at = next(i for i, d in enumerate(calls) if "first" in d["pending"].split())
    final_at = next(i for i, d in enumerate(calls) if any(w["word"] == "second" for w in d["words"]))
    assert final_at > first_at  # "first" was pending, not committed, after the first pass at the pause
    immediate, _ = _stream_wavering(False)  # without the rule: the first reading is final
    assert [w["word"] for d in immediate for w in d["words"]] == ["w0", "first"]


def test_the_stream_generator_yields_a_dict_per_chunk_then_the_final_one():
    """Whistle.stream(chunks) (like needle.Whistle.stream): the same dicts as feed() per chunk, then finish()."""
    from whistle_stream.streaming import stream

    audio, _ = scripted_audio(8, seed=12)
    chunks = [audio[i:i + RATE // 2] for i in range(0, len(audio), RATE // 2)]
    got = list(stream(FakeModel(), iter(chunks)))
    want, _ = run(audio, 500)
    assert len(got) == len(chunks) + 1
    strip = [{k: v for k, v in d.items() if k != "pass_ms"} for d in got]
    assert strip == [{k: v for k, v in d.items() if k != "pass_ms"} for d in want]
    assert got[-1]["pending"] == "" and any(d["words"] for d in got)


# ---- checkpoints: a stream that continues another --------------------------------------------

def _resumed_run(audio: np.ndarray, cut_at: list[int], chunk: int = 1600, model=None):
    """Stream `audio` in `chunk`s; at each chunk index in `cut_at`, checkpoint through JSON, restore
    a new stream from it and feed it the audio from the checkpoint's buffer start again."""
    import json

    model = model or FakeModel()
    session = StreamSession(model)
    out, i, k = [], 0, 0
    while i < len(audio):
        if k in cut_at:
            state = json.loads(json.dumps(session.checkpoint()))
            session = StreamSession.restore(model, state)
            i = int(round(session.buffer_start_s * RATE))   # the client replays from there
            replay = audio[i:state["received"]]
            assert session.feed(replay)["words"] == ()         # no pass re-runs on replayed audio
            i = state["received"]
        out.append(session.feed(audio[i:i + chunk]))
        i += chunk
        k += 1
    out.append(session.finish())
    return [w for d in out for w in d["words"]], "".join(d["text"] for d in out)


def test_a_restored_stream_commits_exactly_what_the_uninterrupted_one_does():
    audio, _ = scripted_audio(40, seed=11)
    plain, plain_text = _resumed_run(audio, [])
    for cuts in ([5], [3, 9, 17], list(range(2, 80, 4))):
        words, text = _resumed_run(audio, cuts)
        assert words == plain and text == plain_text, cuts


def test_a_checkpoint_is_refused_when_it_does_not_fit():
    session = StreamSession(FakeModel())
    session.feed(np.zeros(3 * RATE, np.float32))
    state = session.checkpoint()
    with pytest.raises(ValueError, match="out of order"):
        StreamSession.restore(FakeModel(), {**state, "next_pass": state["buffer_start"]})
    with pytest.raises(ValueError, match="not a stream checkpoint"):
        StreamSession.restore(FakeModel(), {"v": 1, "rate": RATE})
    with pytest.raises(ValueError, match="version or sample rate"):
        StreamSession.restore(FakeModel(), {**state, "rate": 8000})


def test_a_pass_is_given_the_utterances_committed_words_to_read_first(monkeypatch):
    """Within an utterance a pass gets the words already committed in it as its prefix (the engine
    reads them in one teacher-forced run); a new utterance starts with none; prefill=False gives
    none; the words committed are the same either way."""
    monkeypatch.setattr(streaming, "PREFILL_MIN_WORDS", 3)             # the script's utterances are short
    speech, _ = scripted_audio(12, seed=2, pause=(0.05, 0.12))
    audio = np.concatenate([speech, np.zeros(3 * RATE, np.float32), speech])   # past CONTEXT_PAUSE_S

    def run(prefill: bool):
        model = FakeModel()
        session = StreamSession(model, language="de", prefill=prefill)
        words, cuts = [], []
        for i in range(0, len(audio), RATE):
            words += [w["word"] for w in session.feed(audio[i:i + RATE])["words"]]
            cuts.append(session.buffer_start_s)
        words += [w["word"] for w in session.finish()["words"]]
        return model.prefixes, words

    prefixes, words = run(True)
    given = [p.split() for p in prefixes if p]
    assert given and min(len(p) for p in given) >= 3 and max(len(p) for p in given) >= 5
    # each a run of the committed words, in order (an utterance's, from its first)
    assert all(any(words[k:k + len(p)] == p for k in range(len(words))) for p in given)
    second = len(speech) / RATE + 3.0                                    # the pause: a new utterance
    assert not prefixes[int(second)] and not prefixes[int(second) + 1]
    plain_prefixes, plain_words = run(False)
    assert not any(plain_prefixes) and plain_words == words


def _caught_up(audio: np.ndarray, chunk_s: float) -> tuple[list[str], StreamSession, list[float]]:
    """A stream fed `chunk_s` seconds at a time with catch_up (a session behind real time)."""
    session = StreamSession(FakeModel())
    ends = []
    session.on_pass = lambda d: ends.append(d["received"])
    step = int(chunk_s * RATE)
    words = [w["word"] for i in range(0, len(audio), step)
             for w in session.feed(audio[i:i + step], catch_up=True)["words"]]
    words += [w["word"] for w in session.finish()["words"]]
    return [w.rstrip(".") for w in words], session, ends


def test_catching_up_skips_passes_and_commits_every_word_once():
    audio, truth = scripted_audio(60, seed=11)
    _, every = run(audio, 3000)
    assert every.passes >= len(audio) // RATE   # without catch_up: a pass per step
    for chunk_s in (3.0, 4.5):
        words, session, ends = _caught_up(audio, chunk_s)
        assert words == [t[0] for t in truth]
        assert session.passes < 0.8 * every.passes
        # every pass ends on the step grid, and each feed's last pass at its newest whole step
        assert all(e == int(e) for e in ends[:-1])
        fed = np.arange(chunk_s, len(audio) / RATE, chunk_s)
        assert set(np.floor(fed)) <= set(ends)


def test_catching_up_still_runs_a_pass_at_each_utterance_end():
    # three words, a 1.5 s pause, then speech to the end of the 6 s fed at once: the step with the
    # pause gets its pass (the first utterance is heard alone and committed), then the newest step.
    def word(k, seconds):
        return np.full(int(seconds * RATE), UNIT * (k + 1), np.float32)
    gap = np.zeros(int(0.2 * RATE), np.float32)
    audio = np.concatenate([np.zeros(int(0.3 * RATE), np.float32), word(0, 0.4), gap, word(1, 0.4), gap,
                            word(2, 0.4), np.zeros(int(1.5 * RATE), np.float32), word(3, 0.5), gap, word(4, 0.5),
                            gap, word(5, 0.5), gap, word(6, 0.5)])
    audio = audio[: 6 * RATE]
    session = StreamSession(FakeModel(), stable_at_pause=False)
    ends = []
    session.on_pass = lambda d: ends.append(d["received"])
    d = session.feed(audio, catch_up=True)
    assert ends == [3.0, 6.0]
    assert [w["word"] for w in d["words"]] == ["w0", "w1", "w2"]
    assert session.model.passes[0] < 3.0   # heard up to the pause, alone


def test_catching_up_never_lets_a_pass_hear_more_than_the_buffer_bound():
    # 40 s of words with tiny gaps, fed in 12 s lumps: a pass may not read past MAX_BUFFER_S,
    # and the forced commits at the bound still give every word once.
    audio, truth = scripted_audio(120, seed=7, pause=(0.02, 0.04), length=(0.25, 0.35))
    words, session, _ = _caught_up(audio, 12.0)
    assert words == [t[0] for t in truth]
    assert max(session.model.passes) <= MAX_BUFFER_S
    assert session.passes < 40


def test_finalize_with_the_last_audio_skips_the_pass_it_would_read_again():
    # 2.5 s fed, then 1.2 s more with the finalize: fed first, a pass would run at 3.0 s and the
    # finalize read on to 3.7 s at once; given to the finalize, only its own pass reads it
    audio, truth = scripted_audio(8, seed=5, pause=(0.1, 0.2))
    head, tail = audio[: int(2.5 * RATE)], audio[int(2.5 * RATE): int(3.7 * RATE)]
    apart = StreamSession(FakeModel())
    apart.feed(head)
    words = [w["word"] for w in apart.feed(tail)["words"]] + [w["word"] for w in apart.finalize()["words"]]
    joined = StreamSession(FakeModel())
    joined.feed(head)
    together = [w["word"] for w in joined.finalize(tail)["words"]]
    assert together == words and len(words) >= 3
    assert joined.passes == apart.passes - 1
    assert joined.model.passes[-1] == apart.model.passes[-1]   # the same audio read last
    # the stream goes on on its step grid: its next pass is where the other's is
    more = audio[int(3.7 * RATE): int(6.2 * RATE)]
    ends = {}
    for name, s in (("apart", apart), ("joined", joined)):
        got = []
        s.on_pass = lambda d, got=got: got.append(d["received"])
        s.feed(more)
        ends[name] = got
    assert ends["joined"] == ends["apart"] == [4.0, 5.0, 6.0]


def test_finalize_with_audio_still_hears_an_utterance_that_ended_inside_it():
    # 8 s at once into a finalize, with a 1.5 s pause inside: the utterance before the pause is
    # heard alone (its pass at the step end after the pause), the rest by the finalize; the words
    # are those of feeding the audio and then finalizing, with fewer passes
    audio, truth = scripted_audio(14, seed=9)
    cuts = (RATE, 9 * RATE, len(audio))
    apart, joined = StreamSession(FakeModel()), StreamSession(FakeModel())
    words = {"apart": [], "joined": []}
    for s in (apart, joined):
        s.feed(audio[: cuts[0]])
    for a, b in zip(cuts, cuts[1:]):
        words["apart"] += apart.feed(audio[a:b])["words"] + apart.finalize()["words"]
        words["joined"] += joined.finalize(audio[a:b])["words"]
    assert [w["word"] for w in words["joined"]] == [w["word"] for w in words["apart"]]
    assert [w["word"].rstrip(".") for w in words["joined"][:7]] == [t[0] for t in truth[:7]]
    assert any(0.0 < p < 8.0 for p in joined.model.passes[1:])   # the first utterance, alone
    assert joined.passes < apart.passes


def test_finalize_with_audio_keeps_a_pass_within_the_buffer_bound():
    # 40 s of speech without a pause given to one finalize: passes cut the buffer on the way
    audio, truth = scripted_audio(120, seed=7, pause=(0.02, 0.04), length=(0.25, 0.35))
    session = StreamSession(FakeModel())
    words = [w["word"].rstrip(".") for w in session.finish(audio)["words"]]
    assert words == [t[0] for t in truth]
    assert max(session.model.passes) <= MAX_BUFFER_S


def test_a_finalize_right_after_a_pass_that_stopped_at_a_pause_reads_what_follows():
    # the pass at 9.0 s reads the utterance up to the pause at 7.4-7.9 s again (its second reading)
    # and leaves w8 (7.9-8.5 s) unread; a finalize at once must read it, not cut it away
    audio, truth = scripted_audio(14, seed=9)
    session = StreamSession(FakeModel())
    words = [w["word"] for w in session.feed(audio[: 9 * RATE])["words"]]
    words += [w["word"] for w in session.finalize()["words"]]
    assert [w.rstrip(".") for w in words[:9]] == [t[0] for t in truth[:9]]


# ---- pauses inside a sentence ------------------------------------------------------------------

def _said(*parts) -> np.ndarray:
    """Audio from (kind, seconds) parts: ("w", k) a 0.4 s word w{k} and 0.05 s of silence, ("z", s)
    s seconds of silence."""
    out = []
    for kind, value in parts:
        if kind == "w":
            out += [np.full(int(0.4 * RATE), UNIT * (value + 1), np.float32), np.zeros(int(0.05 * RATE), np.float32)]
        else:
            out.append(np.zeros(int(value * RATE), np.float32))
    return np.concatenate(out)


class Listening(FakeModel):
    """Records which words each pass heard (the fake's reading of the pass's audio)."""

    def __init__(self):
        super().__init__()
        self.heard: list[list[str]] = []

    def transcribe_words(self, audio, *args, **kwargs):
        result = super().transcribe_words(audio, *args, **kwargs)
        self.heard.append([w["word"] for w in result["words"]])
        return result


def _stream(model, audio, chunk=1600):
    trims: list[float] = []
    session = StreamSession(model, on_trim=trims.append)
    out = [session.feed(audio[i:i + chunk]) for i in range(0, len(audio), chunk)]
    out.append(session.finish())
    return [w["word"] for d in out for w in d["words"]], trims, session


def test_a_pause_inside_a_sentence_keeps_its_first_words_in_the_passes_after_it():
    """w0 w1, a 0.8 s pause, w2 w3 w4. (w4 ends the sentence): the pause commits w0 w1 but their
    audio stays, so the passes after it read the sentence whole; the buffer is cut only after w4."""
    model = Listening()
    audio = _said(("z", 0.3), ("w", 0), ("w", 1), ("z", 0.8), ("w", 2), ("w", 3), ("w", 4), ("z", 1.2),
                  ("w", 5), ("z", 1.0))
    words, trims, _ = _stream(model, audio)
    assert words == ["w0", "w1", "w2", "w3", "w4.", "w5"]              # each once, in order
    assert any(h[:3] == ["w0", "w1", "w2"] for h in model.heard)      # a pass read across the pause
    sentence_end = 0.3 + 5 * 0.45 + 0.8
    assert trims and all(t >= sentence_end for t in trims)            # no cut inside the sentence
    assert not any("w0" in h and "w5" in h for h in model.heard)      # none past its end


def test_without_the_context_the_same_words_are_committed():
    """The words a stream commits do not depend on whether the passes re-read the sentence's start
    (the policy sets the committed words aside), for the scripted streams of this file."""
    for seed in (2, 5, 9):
        audio, truth = scripted_audio(30, seed=seed, pause=(0.5, 0.9))
        words, _, _ = _stream(FakeModel(), audio)
        assert [w.rstrip(".") for w in words] == [t[0] for t in truth], seed


def test_the_context_ends_after_a_long_pause_and_past_ten_seconds():
    from whistle_stream.rules import CONTEXT_PAUSE_S, CONTEXT_S

    model = Listening()
    long_pause = _said(("z", 0.3), ("w", 0), ("w", 1), ("z", CONTEXT_PAUSE_S + 1.5), ("w", 2), ("z", 1.0))
    words, _, _ = _stream(model, long_pause)
    assert words == ["w0", "w1", "w2"]
    assert not any("w0" in h and "w2" in h for h in model.heard)      # w2 read without w0 w1
    # a sentence that has run on for longer than CONTEXT_S without ending
    model = Listening()
    n = int(CONTEXT_S / 1.1) + 2
    parts = [("z", 0.3)] + [p for k in range(n) for p in (("w", 5 * k), ("w", 5 * k + 1), ("z", 0.7))]
    words, _, _ = _stream(model, _said(*parts, ("z", 1.0)))
    assert len(words) == 2 * n and len(set(words)) == 2 * n
    assert max(len(h) for h in model.heard) <= 2 * (int(CONTEXT_S / 1.1) + 1)


def test_a_restored_stream_keeps_the_context_of_the_checkpoint():
    audio = _said(("z", 0.3), ("w", 0), ("w", 1), ("z", 0.8), ("w", 2), ("w", 3), ("w", 4), ("z", 1.2))
    plain, plain_text = _resumed_run(audio, [])
    for cut in range(3, len(audio) // 1600):
        words, text = _resumed_run(audio, [cut])
        assert words == plain and text == plain_text, cut


def test_a_vad_end_of_speech_keeps_the_context_and_a_client_finalize_does_not():
    model = Listening()
    session = StreamSession(model)
    session.feed(_said(("z", 0.3), ("w", 0), ("w", 1)))
    first = session.finalize(_said(("z", 0.5)), keep_context=True)
    assert [w["word"] for w in first["words"]] == ["w0", "w1"]
    second = session.finalize(_said(("w", 2), ("w", 3), ("w", 4), ("z", 0.5)), keep_context=True)
    assert [w["word"] for w in second["words"]] == ["w2", "w3", "w4."]
    assert model.heard[-1][:3] == ["w0", "w1", "w2"]
    session = StreamSession(model := Listening())
    session.feed(_said(("z", 0.3), ("w", 0), ("w", 1)))
    session.finalize(_said(("z", 0.5)))
    session.finalize(_said(("w", 2), ("z", 0.5)))
    assert model.heard[-1] == ["w2"]


# ---- hours: a stream's state is bounded by its window ------------------------------------------

def _hours(first: float, last: float, memory: bool) -> dict:
    """Feed a stream `last` hours of scripted speech as fast as the fake model reads it; its
    committed words held, checkpoint size, buffer and (with `memory`) the process's resident
    memory once `first` and `last` hours are in."""
    import gc
    import json
    import os

    def rss() -> int:
        gc.collect()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    speech, _ = scripted_audio(120, seed=3)
    session = StreamSession(FakeModel())
    hour, fed, seen, committed = 3600 * RATE, 0, {}, 0
    while fed < last * hour:
        for i in range(0, len(speech), RATE):
            committed += len(session.feed(speech[i:i + RATE])["words"])
        fed += len(speech)
        for h in (first, last):
            if h not in seen and fed >= h * hour:
                seen[h] = (len(session.policy.committed), len(json.dumps(session.checkpoint())),
                           session.buffer_s, rss() if memory else 0)
    assert committed > 2000 * last                                # the stream did commit all along
    return seen


def _same_state(seen: dict, first: float, last: float) -> None:
    from whistle_stream.commit import FORGET_AFTER

    (words1, state1, buffer1, memory1), (words2, state2, buffer2, memory2) = seen[first], seen[last]
    assert words1 <= FORGET_AFTER + 40 and words2 <= FORGET_AFTER + 40, (words1, words2)
    assert state2 <= 1.5 * state1 + 2000 and buffer2 <= MAX_BUFFER_S
    assert memory2 - memory1 < 4_000_000, (memory1, memory2)


def test_an_hour_of_audio_leaves_the_stream_as_it_was_after_a_quarter():
    """The short form of the next test: the state a stream holds is bounded by its window."""
    _same_state(_hours(0.25, 1.0, memory=False), 0.25, 1.0)


@pytest.mark.slow
def test_eight_hours_of_audio_leave_the_stream_as_it_was_after_one():
    """Fed 8 hours as fast as the (fake) model reads them, a stream holds what it held after the
    first hour, within a small bound: its committed words (the policy forgets what no pass compares
    with), its checkpoint, its buffer, and the process's resident memory (4 MB)."""
    _same_state(_hours(1.0, 8.0, memory=True), 1.0, 8.0)
