"""Long audio: the cut-point rule and window stitching (guide §8)."""

from __future__ import annotations

import numpy as np
import pytest

from whistle_stream.longform import cut_point, ends_sentence, iter_windows, transcribe_long, utterance_spans


def w(word, start, end):
    return {"word": word, "start": start, "end": end, "probability": 0.9}


# ---------------------------------------------------------------- cut_point

def test_cut_at_the_last_sentence_end_past_forty_percent():
    words = [w("One.", 0.0, 5.0), w("Two", 5.5, 13.0), w("three.", 13.2, 20.0), w("Four", 20.5, 27.0),
             w("five", 27.2, 29.8)]
    assert cut_point(words, 30.0) == 20.0


def test_a_sentence_end_before_forty_percent_is_not_used():
    words = [w("Hello.", 0.0, 11.0), w("and", 11.5, 20.0), w("then", 20.5, 28.5), w("more", 28.6, 29.9)]
    assert cut_point(words, 30.0) == 28.5  # the last word ending a second before the end


def test_a_sentence_end_within_half_a_second_of_the_end_is_not_used():
    words = [w("Early.", 0.0, 14.0), w("again", 14.1, 25.0), w("late.", 25.1, 29.7)]
    assert cut_point(words, 30.0) == 14.0


def test_sentence_end_margins_are_inclusive():
    assert cut_point([w("a.", 0.0, 12.0), w("b", 12.0, 29.9)], 30.0) == 12.0  # exactly 40%
    assert cut_point([w("a", 0.0, 10.0), w("b.", 10.0, 29.5)], 30.0) == 29.5  # exactly 0.5 s before


def test_without_a_sentence_end_cut_at_the_last_word_a_second_before_the_end():
    words = [w("no", 0.0, 9.0), w("punctuation", 9.1, 29.0), w("here", 29.1, 29.8)]
    assert cut_point(words, 30.0) == 29.0


def test_without_any_usable_word_cut_at_the_window_end():
    assert cut_point([], 30.0) == 30.0
    assert cut_point([w("late", 29.2, 29.9)], 30.0) == 30.0


def test_cut_point_scales_with_a_shorter_window():
    words = [w("a.", 0.0, 3.0), w("b.", 3.1, 5.0), w("c", 5.1, 9.5)]
    assert cut_point(words, 10.0) == 5.0  # 40% of 10 s is 4 s


def test_sentence_ends_include_question_exclamation_ellipsis_and_closing_quotes():
    for text in ("why?", "stop!", "so\u2026", 'said."', "end.)", "it.\u201d"):
        assert ends_sentence(text), text
    for text in ("Mr", "3,5", "and", "e.g"):
        assert not ends_sentence(text), text


def test_cut_point_rejects_a_non_positive_window():
    with pytest.raises(ValueError, match="window_s"):
        cut_point([], 0.0)


# ---------------------------------------------------------------- window stitching

def script(total_s, seed=0, sentences=True):
    """A known transcript: words of 0.2-0.7 s with 0-0.4 s gaps, sentences of 4-14 words."""
    rng = np.random.default_rng(seed)
    words, t, n, left = [], 0.3, 0, int(rng.integers(4, 15))
    while True:
        dur, gap = rng.uniform(0.2, 0.7), rng.uniform(0.0, 0.4)
        if t + dur > total_s - 0.2:
            break
        left -= 1
        text = f"w{n}" + ("." if sentences and left == 0 else "")
        if left == 0:
            left = int(rng.integers(4, 15))
        words.append(w(text, round(t, 3), round(t + dur, 3)))
        t += dur + gap
        n += 1
    return words


class FakeTranscriber:
    """Transcribes a window from the known script: words wholly inside it, with times relative
    to its start; a word cut off by the window end comes back as a garbled fragment."""

    def __init__(self, words):
        self.words = words
        self.calls = []

    def __call__(self, start, length):
        self.calls.append((start, length))
        stop, out = start + length, []
        for word in self.words:
            if word["start"] >= start - 1e-9 and word["end"] <= stop + 1e-9:
                out.append({**word, "start": word["start"] - start, "end": word["end"] - start})
            elif word["start"] < stop < word["end"]:
                out.append(w(word["word"][:1] + "~", word["start"] - start, length))
        return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sentences", [True, False])
def test_a_95_second_clip_is_stitched_without_dropped_or_doubled_words(seed, sentences):
    truth = script(95.0, seed, sentences)
    fake = FakeTranscriber(truth)
    got = transcribe_long(95.0, fake)
    assert [x["word"] for x in got] == [x["word"] for x in truth]
    assert [x["start"] for x in got] == pytest.approx([x["start"] for x in truth])
    assert [x["end"] for x in got] == pytest.approx([x["end"] for x in truth])
    assert len(fake.calls) >= 4  # 95 s cannot fit in three 30 s windows once cut early


def test_each_window_starts_at_the_previous_cut_and_is_at_most_thirty_seconds():
    fake = FakeTranscriber(script(95.0, 1))
    windows = list(iter_windows(95.0, fake))
    assert windows[0].start_s == 0.0
    for prev, nxt in zip(windows, windows[1:]):
        assert nxt.start_s == pytest.approx(prev.start_s + prev.cut_s)
    assert all(0 < win.length_s <= 30.0 for win in windows)
    assert windows[-1].last and not any(win.last for win in windows[:-1])
    assert windows[-1].start_s + windows[-1].length_s == pytest.approx(95.0)


def test_windows_with_sentences_cut_at_sentence_ends():
    fake = FakeTranscriber(script(95.0, 2, sentences=True))
    for win in list(iter_windows(95.0, fake))[:-1]:
        assert win.words[-1]["word"].endswith(".")
        assert win.cut_s >= 0.4 * win.length_s


def test_a_clip_up_to_thirty_seconds_is_one_pass():
    truth = script(30.0, 3)
    fake = FakeTranscriber(truth)
    assert transcribe_long(30.0, fake) == truth
    assert fake.calls == [(0.0, 30.0)]


def test_a_clip_with_no_words_still_advances_window_by_window():
    fake = FakeTranscriber([])
    windows = list(iter_windows(75.0, fake))
    assert [win.start_s for win in windows] == [0.0, 30.0, 60.0]
    assert all(win.words == [] for win in windows)


def test_empty_audio_runs_one_empty_window():
    fake = FakeTranscriber([])
    assert transcribe_long(0.0, fake) == []
    assert fake.calls == [(0.0, 0.0)]


# ---- utterances: files cut at their pauses --------------------------------------------------

def _tone(seconds: float, amp: float = 0.3, rate: int = 16000):
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_utterance_spans_cut_in_the_middle_of_each_pause():
    import numpy as np

    from whistle_stream.longform import utterance_spans

    z = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    audio = np.concatenate([z(0.3), _tone(1.0), z(1.0), _tone(0.8), z(0.2), _tone(0.5), z(0.6)])
    spans = utterance_spans(audio)
    # the 1 s pause parts two utterances; the 0.2 s gap inside the second does not
    assert len(spans) == 2
    assert spans[0][0] == 0 and spans[-1][1] == len(audio) and spans[0][1] == spans[1][0]
    assert abs(spans[0][1] / 16000 - 1.8) < 0.03       # the middle of the 1.0 s pause
    assert utterance_spans(z(3.0)) == [] and utterance_spans(_tone(2.0)) == [(0, 32000)]


def test_a_quiet_stretch_40_db_down_is_a_pause_and_one_20_db_down_is_not():
    import numpy as np

    from whistle_stream.longform import utterance_spans

    for db, parts in ((45, 2), (20, 1)):
        audio = np.concatenate([_tone(1.0), _tone(1.0, 0.3 * 10 ** (-db / 20)), _tone(1.0)])
        assert len(utterance_spans(audio)) == parts, db


def test_a_long_utterance_is_split_again_at_its_short_breaths():
    import numpy as np

    from whistle_stream.longform import SPLIT_OVER_S, utterance_spans

    z = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    # four 2 s sentences with 0.25 s breaths: one 8.75 s stretch without a full pause
    audio = np.concatenate([_tone(2.0), z(0.25), _tone(2.0), z(0.25), _tone(2.0), z(0.25), _tone(2.0)])
    spans = utterance_spans(audio)
    assert all((b - a) / 16000 <= SPLIT_OVER_S for a, b in spans) and len(spans) >= 2
    for a, b in spans[:-1]:   # every cut falls in a breath, not in a sentence
        t = (b / 16000) % 2.25
        assert t > 2.0 or t < 0.01, b / 16000
    # a long stretch without any breath stays whole
    assert utterance_spans(_tone(9.0)) == [(0, 9 * 16000)]


def test_the_stream_and_the_file_cut_by_one_pause_rule():
    """rules.quiet_runs is the one measure: the stream's last pause and a file's utterance cuts
    fall at the same sample for the same audio, and digital silence is one pause (the stream) and
    no utterance (a file) alike."""
    import numpy as np

    from whistle_stream.rules import quiet_runs
    from whistle_stream.spans import last_pause

    rate = 16000
    t = np.arange(rate) / rate
    speech = (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)
    clip = np.concatenate([speech, np.zeros(rate, np.float32), speech])
    (first, _), (second, _) = utterance_spans(clip, rate)
    assert first == 0 and second == last_pause(clip, rate) and rate < second < 2 * rate
    silence = np.zeros(2 * rate, np.float32)
    q = quiet_runs(silence, rate)
    assert q.silent and q.runs == [(0, q.frames)]
    assert utterance_spans(silence, rate) == [] and last_pause(silence, rate) == rate
