"""Word error rate with whisper-style English normalisation, for evaluating transcripts."""

from __future__ import annotations

import re
import unicodedata

# A word whose audio comes this close to a seam (a point where a stream dropped its buffer's audio, or
# a long-audio window cut) is at that seam. Streams cut utterances in the middle of a pause of at
# least 0.45 s, so the words of a well-placed cut are further away; a cut placed inside speech, or a
# word committed again after its audio went, lands within it.
SEAM_S = 0.3


def normalise(text: str) -> list[str]:
    """Whisper's English normaliser when available (numbers, spellings), else a basic one:
    lower case, punctuation removed, whitespace collapsed. Returns the words."""
    try:
        from whisper_normalizer.english import EnglishTextNormalizer
    except ImportError:  # pragma: no cover - the reference extra brings it
        EnglishTextNormalizer = None
    if EnglishTextNormalizer is not None:
        return EnglishTextNormalizer()(text).split()
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"[^\w\s']", " ", text)
    return text.split()


def edit_ops(ref: list[str], hyp: list[str]) -> tuple[int, int, int]:
    """(substitutions, deletions, insertions) of a minimal alignment of hyp to ref."""
    n, m = len(ref), len(hyp)
    # cost, subs, dels, ins per cell; ties prefer substitutions, then deletions.
    prev = [(j, 0, 0, j) for j in range(m + 1)]
    for i in range(1, n + 1):
        cur = [(i, 0, i, 0)]
        for j in range(1, m + 1):
            c_sub = prev[j - 1]
            same = ref[i - 1] == hyp[j - 1]
            sub = (c_sub[0] + (0 if same else 1), c_sub[1] + (0 if same else 1), c_sub[2], c_sub[3])
            dele = (prev[j][0] + 1, prev[j][1], prev[j][2] + 1, prev[j][3])
            ins = (cur[j - 1][0] + 1, cur[j - 1][1], cur[j - 1][2], cur[j - 1][3] + 1)
            cur.append(min(sub, dele, ins, key=lambda t: t[0]))
        prev = cur
    _, s, d, i = prev[m]
    return s, d, i


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(errors, reference words) after normalisation."""
    ref, hyp = normalise(reference), normalise(hypothesis)
    s, d, i = edit_ops(ref, hyp)
    return s + d + i, len(ref)


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER: total edits / total reference words."""
    errors = words = 0
    for r, h in zip(references, hypotheses, strict=True):
        e, n = word_errors(r, h)
        errors, words = errors + e, words + n
    return errors / max(words, 1)


def alignment(ref: list[str], hyp: list[str]) -> list[tuple[str, int | None, int | None]]:
    """A minimal edit alignment of hyp to ref as ops (kind, ref index, hyp index): kind "=" (same
    word), "S" (substituted), "D" (a ref word missing from hyp, hyp index None) or "I" (a hyp word
    not in ref, ref index None), in order. Same costs and tie order as edit_ops."""
    n, m = len(ref), len(hyp)
    cost = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        cost[i][0] = i
    for j in range(m + 1):
        cost[0][j] = j
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            cost[i][j] = min(cost[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]), cost[i - 1][j] + 1, cost[i][j - 1] + 1)
    ops, i, j = [], n, m
    while i or j:
        if i and j and cost[i][j] == cost[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]):
            ops.append(("=" if ref[i - 1] == hyp[j - 1] else "S", i - 1, j - 1))
            i, j = i - 1, j - 1
        elif i and cost[i][j] == cost[i - 1][j] + 1:
            ops.append(("D", i - 1, None))
            i -= 1
        else:
            ops.append(("I", None, j - 1))
            j -= 1
    return ops[::-1]


def word_key(word: str) -> str:
    """A word compared across transcripts: lower case, letters, digits and apostrophes only."""
    return re.sub(r"[^a-z0-9']", "", word.lower())


def seam_errors(ref: list[dict], hyp: list[dict], seams: list[float], window: float = SEAM_S,
                truth: list[tuple[float, float, str]] | None = None) -> dict:
    """Words dropped or doubled at seams. ref (e.g. one-shot words) and hyp (streamed or long-audio
    words), each [{word, start, end}] on one clock, are aligned word by word; "dropped" are ref
    words missing from hyp and "doubled" hyp words missing from ref whose audio comes within
    `window` seconds of a seam; "across" are two equal hyp words on both sides of a seam where ref
    does not repeat that word there. "counts": the alignment's S / D / I over the whole text.

    truth, [(start, end, text)] of each utterance, keeps out what ref misread rather than what
    hyp lost: a word counts as dropped only if the utterance it falls in says it, and as doubled
    only if the utterance says it and hyp says it there more often than the utterance does (where
    ref read a sentence as another one, its words are "missing" from a correct hyp; a word nobody
    said there is a misreading, which the WER lines count, not a word read twice)."""
    ref = [w for w in ref if word_key(w["word"])]
    hyp = [w for w in hyp if word_key(w["word"])]

    def at_seam(w):
        return any(w["start"] - window <= t <= w["end"] + window for t in seams)

    def said(w):  # the truth's words of the utterance nearest to w
        if truth is None:
            return None
        mid = (w["start"] + w["end"]) / 2
        start, end, text = min(truth, key=lambda u: 0.0 if u[0] <= mid <= u[1] else min(abs(mid - u[0]), abs(mid - u[1])))
        return [word_key(x) for x in text.split()], (start, end)

    def truly_dropped(w):
        words = said(w)
        return words is None or word_key(w["word"]) in words[0]

    def truly_doubled(w):
        words = said(w)
        if words is None:
            return True
        (start, end), key = words[1], word_key(w["word"])
        return key in words[0] and sum(word_key(h["word"]) == key for h in hyp if start - 0.5 <= h["start"] <= end + 0.5) > words[0].count(key)

    ops = alignment([word_key(w["word"]) for w in ref], [word_key(w["word"]) for w in hyp])
    repeats = [a["start"] for a, b in zip(ref, ref[1:]) if word_key(a["word"]) == word_key(b["word"])]
    return {
        "dropped": [(ref[i]["word"], round(ref[i]["start"], 2)) for kind, i, _ in ops
                    if kind == "D" and at_seam(ref[i]) and truly_dropped(ref[i])],
        "doubled": [(hyp[j]["word"], round(hyp[j]["start"], 2)) for kind, _, j in ops
                    if kind == "I" and at_seam(hyp[j]) and truly_doubled(hyp[j])],
        "across": [(a["word"], round(a["start"], 2)) for a, b in zip(hyp, hyp[1:])
                   if word_key(a["word"]) == word_key(b["word"]) and any(a["start"] <= t <= b["end"] for t in seams)
                   and not any(abs(t - a["start"]) < 1.0 for t in repeats)],
        "counts": {k: sum(op[0] == k for op in ops) for k in "SDI"},
    }
