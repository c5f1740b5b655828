"""The WER function used to evaluate the demo model, against jiwer."""

import jiwer
import pytest

from harness.wer import alignment, edit_ops, normalise, wer


@pytest.mark.parametrize("ref, hyp", [
    ("set a timer for ten minutes", "set the timer for ten minutes"),
    ("turn on the lights", "turn on lights in the kitchen"),
    ("call mom", ""),
    ("a b c d", "a x b c d e"),
    ("one two three", "one two three"),
])
def test_wer_matches_jiwer_on_normalised_words(ref, hyp):
    r, h = " ".join(normalise(ref)), " ".join(normalise(hyp))
    want = jiwer.wer(r, h) if h else 1.0
    assert wer([ref], [hyp]) == pytest.approx(want)


def test_normalisation_ignores_case_and_punctuation():
    assert normalise("Set a timer, please!") == normalise("set a timer please")


def test_edit_ops_counts_each_kind():
    assert edit_ops(["a", "b", "c"], ["a", "c"]) == (0, 1, 0)
    assert edit_ops(["a", "c"], ["a", "b", "c"]) == (0, 0, 1)
    assert edit_ops(["a", "b"], ["a", "x"]) == (1, 0, 0)


@pytest.mark.parametrize("ref, hyp", [
    ("a b c", "a c"), ("a c", "a b c"), ("a b", "a x"), ("", "a b"), ("a b", ""),
    ("a b c d", "a x b c d e"), ("x y z", "x y z"),
])
def test_alignment_ops_agree_with_edit_ops_and_cover_both_sides_in_order(ref, hyp):
    r, h = ref.split(), hyp.split()
    ops = alignment(r, h)
    counts = tuple(sum(kind == k for kind, _, _ in ops) for k in "SDI")
    assert counts == edit_ops(r, h)
    assert [i for _, i, _ in ops if i is not None] == list(range(len(r)))
    assert [j for _, _, j in ops if j is not None] == list(range(len(h)))
    assert all((kind == "=") == (i is not None and j is not None and r[i] == h[j]) for kind, i, j in ops)


def _timed(text, start=0.0, step=0.5):
    return [{"word": w, "start": start + i * step, "end": start + i * step + 0.4} for i, w in enumerate(text.split())]


def test_seam_errors_count_only_what_happens_at_seams():
    from harness.wer import seam_errors

    ref = _timed("a b c d e f g h")  # c at 1.0-1.4, f at 2.5-2.9
    hyp = [w for w in ref if w["word"] not in ("c", "f")]
    got = seam_errors(ref, hyp, seams=[1.2])
    assert got["dropped"] == [("c", 1.0)] and got["counts"] == {"S": 0, "D": 2, "I": 0}  # f is not at a seam
    doubled = ref[:4] + [{"word": "d", "start": 1.8, "end": 2.0}] + ref[4:]
    got = seam_errors(ref, doubled, seams=[1.75])
    assert got["doubled"] and got["across"] == [("d", 1.5)]
    assert seam_errors(ref, ref, seams=[1.2, 2.7]) == {"dropped": [], "doubled": [], "across": [],
                                                        "counts": {"S": 0, "D": 0, "I": 0}}
    repeated = _timed("go go now")  # the reference says it twice: not a doubling
    assert seam_errors(repeated, repeated, seams=[0.45])["across"] == []


def test_seam_errors_with_the_truth_leave_out_what_the_reference_misread():
    from harness.wer import seam_errors

    truth = [(0.0, 1.9, "a b c d"), (2.0, 3.9, "e f g h")]
    ref = _timed("a b x d e f g h")  # the one-shot misread c as x
    hyp = [w for w in _timed("a b c d e f g h") if w["word"] != "c"]  # the stream lost c
    assert seam_errors(ref, hyp, seams=[1.2])["dropped"] == [("x", 1.0)]  # (ref's word, at c's place)
    assert seam_errors(ref, hyp, seams=[1.2], truth=truth)["dropped"] == []  # x is not said there
    lost = [w for w in ref if w["word"] != "b"]
    assert seam_errors(ref, lost, seams=[0.7], truth=truth)["dropped"] == [("b", 0.5)]
    doubled = ref[:5] + [{"word": "e", "start": 2.2, "end": 2.4}] + ref[5:]
    assert [w for w, _ in seam_errors(ref, doubled, seams=[2.1], truth=truth)["doubled"]] == ["e"]
    misread = ref[:5] + [{"word": "z", "start": 2.2, "end": 2.4}] + ref[5:]  # a word nobody said
    assert seam_errors(ref, misread, seams=[2.1])["doubled"] == [("z", 2.2)]
    assert seam_errors(ref, misread, seams=[2.1], truth=truth)["doubled"] == []
