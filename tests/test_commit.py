"""The streaming commit policy (two-pass agreement), driven by scripted hypotheses."""

from __future__ import annotations

import numpy as np
import pytest

from whistle_stream.commit import CommitPolicy, CommitResult, Word, doubled_tail, normalise


def hyp(text, start=0.0, step=0.5, jitter=0.0, seed=0):
    """Words of `text`, each `step` seconds long from `start`, times moved by up to `jitter`."""
    rng = np.random.default_rng(seed)
    out = []
    for i, token in enumerate(text.split()):
        s = start + i * step + (rng.uniform(-jitter, jitter) if jitter else 0.0)
        out.append(Word(token, round(max(s, 0.0), 3), round(start + (i + 1) * step - 0.05, 3), 0.9))
    return out


def texts(words):
    return [w.word for w in words]


def test_the_first_pass_commits_nothing():
    policy = CommitPolicy()
    result = policy.update(hyp("the cat sat"))
    assert result.committed == [] and result.new == []
    assert texts(result.pending) == ["the", "cat", "sat"]


def test_words_two_passes_agree_on_are_committed():
    policy = CommitPolicy()
    policy.update(hyp("the cat sat"))
    result = policy.update(hyp("the cat sat on"))
    assert texts(result.committed) == ["the", "cat", "sat"]
    assert texts(result.new) == ["the", "cat", "sat"]
    assert texts(result.pending) == ["on"]
    assert policy.committed_until_s == pytest.approx(1.45)


def test_disagreement_holds_the_rest_back():
    policy = CommitPolicy()
    policy.update(hyp("the cat sat on"))
    result = policy.update(hyp("the hat sat on"))
    assert texts(result.committed) == ["the"]
    assert texts(result.pending) == ["hat", "sat", "on"]


def test_agreement_ignores_case_and_edge_punctuation_and_commits_the_current_spelling():
    policy = CommitPolicy()
    policy.update(hyp("hello world"))
    result = policy.update(hyp("Hello, world and"))
    assert texts(result.committed) == ["Hello,", "world"]
    assert normalise("Hello,") == normalise("hello") == "hello"
    assert normalise("...") == "..."


def test_words_before_the_horizon_in_a_new_pass_are_not_doubled():
    policy = CommitPolicy()
    policy.update(hyp("one two three four"))
    policy.update(hyp("one two three four five"))
    assert texts(policy.committed) == ["one", "two", "three", "four"]
    # the buffer still holds the committed audio: the next passes re-read it with shifted times
    policy.update(hyp("one two three four five six", jitter=0.04, seed=1))
    result = policy.update(hyp("one two three four five six seven", jitter=0.04, seed=2))
    assert texts(result.committed) == ["one", "two", "three", "four", "five", "six"]
    assert texts(result.pending) == ["seven"]


def test_a_committed_word_re_timed_past_the_horizon_is_not_committed_again():
    policy = CommitPolicy()
    policy.update(hyp("red green blue"))
    policy.update(hyp("red green blue"))
    horizon = policy.committed_until_s
    shifted = [Word("blue", horizon - 0.05, horizon + 0.3), Word("sky", horizon + 0.4, horizon + 0.8)]
    policy.update(shifted)
    result = policy.update(shifted + [Word("today", horizon + 0.9, horizon + 1.3)])
    assert texts(result.committed) == ["red", "green", "blue", "sky"]


def test_a_genuine_repeat_after_the_horizon_is_committed():
    policy = CommitPolicy()
    policy.update(hyp("I said that"))
    policy.update(hyp("I said that"))
    later = hyp("that is it", start=2.0)
    policy.update(later)
    result = policy.update(later)
    assert texts(result.committed) == ["I", "said", "that", "that", "is", "it"]


def test_committed_words_never_change_across_many_passes():
    rng = np.random.default_rng(5)
    truth = "so the quick brown fox jumps over the lazy dog and then it runs away home".split()
    policy = CommitPolicy()
    history = []
    for n in range(2, len(truth) + 1):
        words = list(truth[:n])
        if rng.uniform() < 0.5:  # the unstable end of the hypothesis flickers
            words[-1] = rng.choice(["fog", "box", "dug", "hum"])
        history.append(policy.update(hyp(" ".join(words), jitter=0.03, seed=n)).committed)
    history.append(policy.flush().committed)
    for before, after in zip(history, history[1:]):
        assert after[: len(before)] == before
    assert texts(history[-1])[:-1] == truth[:-1]
    ends = [w.end for w in history[-1]]
    assert ends == sorted(ends)


def test_a_loop_in_the_hypothesis_is_committed_at_most_once():
    policy = CommitPolicy()
    policy.update(hyp("thank you " * 5))
    result = policy.update(hyp("thank you " * 6))
    assert texts(result.committed) == ["thank", "you"]
    assert result.pending == []
    assert texts(policy.flush().committed) == ["thank", "you"]


def test_a_loop_that_grows_after_a_commit_adds_no_copies():
    policy = CommitPolicy()
    policy.update(hyp("go on go on go on"))
    policy.update(hyp("go on go on go on"))  # three copies is not a loop yet: committed
    assert texts(policy.committed) == ["go", "on"] * 3
    policy.update(hyp("go on " * 6))
    result = policy.update(hyp("go on " * 7))
    assert texts(result.committed) == ["go", "on"] * 3
    assert result.new == [] and result.pending == []


def test_flush_commits_everything_pending():
    policy = CommitPolicy()
    policy.update(hyp("good morning"))
    policy.update(hyp("good morning every"))
    result = policy.flush()
    assert texts(result.new) == ["every"]
    assert texts(result.committed) == ["good", "morning", "every"]
    assert result.pending == []
    assert policy.flush().new == []


def test_after_a_flush_the_next_pass_starts_fresh_beyond_the_horizon():
    policy = CommitPolicy()
    policy.update(hyp("first part"))
    policy.flush()
    again = hyp("first part next bit")
    assert policy.update(again).new == []  # one pass since the flush: nothing agreed yet
    result = policy.update(again)
    assert texts(result.committed) == ["first", "part", "next", "bit"]


def test_committed_times_do_not_overlap():
    policy = CommitPolicy()
    policy.update(hyp("a b"))
    policy.update(hyp("a b"))
    overlapping = [Word("a", 0.0, 0.45), Word("b", 0.5, 0.95), Word("c", 0.9, 1.4)]
    policy.update(overlapping)
    result = policy.update(overlapping)
    c = result.committed[-1]
    assert c.word == "c" and c.start >= result.committed[-2].end


def test_update_accepts_word_dicts_and_returns_a_commit_result():
    policy = CommitPolicy()
    d = [{"word": "hi", "start": 0.0, "end": 0.3, "probability": 0.8}, {"word": "there", "start": 0.4, "end": 0.8}]
    policy.update(d)
    result = policy.update(d)
    assert isinstance(result, CommitResult)
    assert result.committed == [Word("hi", 0.0, 0.3, 0.8), Word("there", 0.4, 0.8, 1.0)]
    assert result.committed[0].to_dict() == d[0]


def test_bad_words_are_rejected():
    policy = CommitPolicy()
    with pytest.raises(ValueError, match="word, start and end"):
        policy.update([{"word": "x", "start": 0.0}])
    with pytest.raises(TypeError, match="Word objects or dicts"):
        policy.update(["x"])


@pytest.mark.parametrize("text, unit", [
    ("a b c a b c", 3), ("x a b c d a b c d", 4), ("a b a b", 0), ("a b c d", 0),
    ("set the alarm set the alarm set the alarm", 3), ("", 0)])
def test_doubled_tail_finds_the_longest_unit_said_twice_at_the_end(text, unit):
    assert doubled_tail(text.split()) == unit


def test_a_sentence_said_again_after_itself_is_committed_once():
    policy = CommitPolicy()
    doubled = "remind me to call mom at five . remind me to call mom at five ."
    policy.update(hyp(doubled))
    result = policy.update(hyp(doubled))
    assert " ".join(texts(result.committed)) == "remind me to call mom at five ."
    assert result.pending == []


def test_the_utterance_re_read_from_its_start_past_the_horizon_is_not_committed_again():
    policy = CommitPolicy()
    policy.update(hyp("dim the lights to", step=0.2))  # squeezed times: the horizon ends early
    policy.update(hyp("dim the lights to", step=0.2))
    assert policy.committed_until_s < 1.0
    later = hyp("dim the lights to sixty percent", start=1.0)  # the same words, re-timed later
    policy.update(later)
    result = policy.update(later)
    assert texts(result.committed) == ["dim", "the", "lights", "to", "sixty", "percent"]


def test_agreed_words_ending_after_the_hold_stay_pending():
    policy = CommitPolicy()
    policy.update(hyp("one two three four"))  # words end at 0.45, 0.95, 1.45, 1.95 s
    result = policy.update(hyp("one two three four"), hold_after_s=1.0)
    assert texts(result.committed) == ["one", "two"] and texts(result.pending) == ["three", "four"]
    result = policy.update(hyp("one two three four five"), hold_after_s=2.0)
    assert texts(result.committed) == ["one", "two", "three", "four"]


@pytest.mark.parametrize("text, want", [
    ("We are meeting Victor tonight. We are meeting Ben today.", (0, 5)),
    ("Set a timer. Set a timer for ten. Set a timer now.", (0, 3)),  # the first of three readings
    ("Set a timer. Call my mother.", None),
    ("Set a. Set a timer.", None),  # fewer than three words in the earlier sentence
    ("Call Tom. Call Tom now.", None),
])
def test_restarted_sentence_finds_two_readings_of_one_sentence(text, want):
    from whistle_stream.commit import restarted_sentence

    assert restarted_sentence(text.split()) == want


@pytest.mark.parametrize("said, pass_text, want", [
    ("we are meeting victor at the airport", "we are meeting ben at the airport this afternoon", 7),
    ("we are meeting", "we are meeting ben", 3),
    ("how long does it take to", "how are you today", 4),  # a different reading: all of it re-read
    ("set the oven to", "set the oven to two hundred", 4),
])
def test_aligned_prefix_pairs_a_pass_with_the_committed_words(said, pass_text, want):
    from whistle_stream.commit import aligned_prefix

    assert aligned_prefix(said.split(), pass_text.split()) == want


def test_the_earlier_of_two_readings_in_a_pass_is_dropped():
    """A guessed reading squeezed before the one the audio supports is not committed."""
    policy = CommitPolicy()
    guess = hyp("We are meeting Victor tonight.", start=0.0, step=0.05)
    reading = hyp("We are meeting Victor at the airport", start=0.25, step=0.4)
    policy.update(guess + reading)
    result = policy.update(guess + reading, hold_after_s=2.0)
    assert texts(result.committed) == ["We", "are", "meeting", "Victor"]
    assert result.committed[0].start == pytest.approx(0.25)  # the reading's times, not the guess's
    assert texts(result.pending) == ["at", "the", "airport"]


def test_a_re_read_utterance_with_a_word_read_differently_is_not_committed_again():
    """The pass at the pause reads a committed word differently: only what follows is new."""
    policy = CommitPolicy()
    policy.update(hyp("we are meeting victor at the airport"))
    policy.update(hyp("we are meeting victor at the airport"))
    assert len(policy.committed) == 7
    result = policy.update(hyp("We are meeting Ben at the airport this afternoon."))
    assert texts(result.pending) == ["this", "afternoon."]
    assert texts(policy.flush().new) == ["this", "afternoon."]


def test_a_second_reading_of_a_partly_committed_sentence_is_dropped():
    """The pass reads the sentence whose start is committed, then reads it again from its start:
    the committed reading stays, the later one goes through its sentence end, what follows stays."""
    policy = CommitPolicy()
    first = "Room five hundred and sixty-five is on the"
    policy.update(hyp(first))
    policy.update(hyp(first + " sixteenth"))
    assert texts(policy.committed) == first.split()  # agreed by two passes (the last word held)
    again = first + " sixteenth floor. Room five hundred and sixteen is on the sixteenth floor. Call Tom."
    result = policy.update(hyp(again))
    assert texts(result.new) == ["sixteenth"] and texts(result.pending) == ["floor.", "Call", "Tom."]
    result = policy.update(hyp(again))
    assert texts(result.committed) == first.split() + ["sixteenth", "floor.", "Call", "Tom."]


def test_an_agreed_word_below_the_commit_probability_waits():
    policy = CommitPolicy()
    policy.update(hyp("remind me to take out"), hold_after_s=10.0)
    unsure = [w if w.word != "take" else Word(w.word, w.start, w.end, 0.4) for w in hyp("remind me to take out it")]
    result = policy.update(unsure, hold_after_s=10.0)
    assert texts(result.new) == ["remind", "me", "to"] and texts(result.pending) == ["take", "out", "it"]
    result = policy.update(hyp("remind me to take out it"), hold_after_s=10.0)  # now sure: committed
    assert texts(result.new) == ["take", "out", "it"]
    # at a pause (no hold) the pass's reading is final whatever its probabilities
    policy = CommitPolicy()
    policy.update(unsure)
    assert texts(policy.update(unsure).new) == texts(unsure)
