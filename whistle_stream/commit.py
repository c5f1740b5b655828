"""The streaming commit policy: commit the words two consecutive passes agree on (guide §8).

A small pure class, fed one hypothesis per pass and returning dataclasses; no audio, no model.
Each pass re-transcribes the stream's buffer, so it repeats words that are already committed. Those
are set aside first (words lying mostly before the committed time horizon, then a repeat of the
committed tail near the horizon, or of the current utterance's committed words from its start
when a pass places them later), a loop at the hypothesis end is cut back to one copy (§6 loop
rule, on word texts) and so is a doubled ending (a unit of 3 or more words twice in a row: a small
model continuing a sentence heard in part by saying it again), and the longest prefix on which
this pass and the previous one agree word for word is committed. Committed words never change; the rest of the pass is pending.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .results import Word
from .rules import ends_sentence
from .search import LOOP_MAX_UNIT, LOOP_REPEATS, cut_loop, find_loop

_EPS = 1e-6
REPEAT_WINDOW_S = 0.25  # DTW word times shift by a frame or two (80 ms each) between passes
REPEAT_WORDS = 5  # the longest committed tail a new pass is checked for repeating
DOUBLED_MIN_WORDS = 3  # a hypothesis ending in a unit of at least this many words said twice keeps one
# Two consecutive sentences of one pass that begin with the same this-many words are two readings
# of the same audio, not two sentences: a small model hearing a sentence in part says a guessed
# version squeezed into a fraction of a second, then the one the audio supports ("We are meeting
# Victor at the airport tonight. We are meeting Victor at the airport this afternoon."). The later
# reading is kept. A pass that re-reads the utterance's committed words is recognised by the same
# number of equal first words, then aligned with them word by word (substitutions allowed).
RESTART_MIN_WORDS = 3
MIN_COMMIT_PROBABILITY = 0.6  # see CommitPolicy's min_probability
# Committed words no pass compares with any more (before the current utterance, beyond the last
# repeat_words) are forgotten once this many have gathered: a policy's memory stays bounded by
# its utterance, however long the stream runs.
FORGET_AFTER = 64


@dataclass(frozen=True)
class CommitResult:
    """committed: the committed words the policy still holds (the current utterance's and the last
    few before it; see FORGET_AFTER); new: the words this call committed; pending: the current
    hypothesis beyond the committed words (may still change)."""

    committed: list[Word]
    pending: list[Word]
    new: list[Word] = field(default_factory=list)


def doubled_tail(texts: Sequence[str], min_words: int = DOUBLED_MIN_WORDS) -> int:
    """Length of the longest unit of at least `min_words` words that `texts` ends with twice in a
    row (0 if none): "... on the fifth of May. Remind me ... on the fifth of May." ends doubled."""
    for k in range(len(texts) // 2, min_words - 1, -1):
        if list(texts[len(texts) - k:]) == list(texts[len(texts) - 2 * k:len(texts) - k]):
            return k
    return 0


def restarted_sentence(words: Sequence[str], min_words: int = RESTART_MIN_WORDS) -> tuple[int, int] | None:
    """(a, b) when the sentence words[a:b] is followed by a sentence starting at b whose first
    `min_words` words equal its own: the earlier of two readings of the same audio. Sentences start
    at words[0] and after a word that ends one (`rules.ends_sentence`); words are raw texts (compared
    normalised)."""
    starts = [0] + [i + 1 for i in range(len(words) - 1) if ends_sentence(words[i])]
    for a, b in zip(starts, starts[1:]):
        if len(words) - b >= min_words and b - a >= min_words and \
                [normalise(w) for w in words[a:a + min_words]] == [normalise(w) for w in words[b:b + min_words]]:
            return a, b
    return None


def aligned_prefix(said: Sequence[str], texts: Sequence[str]) -> int:
    """How many of `texts` a word-by-word alignment (edit distance, substitutions, insertions and
    deletions alike) pairs with the whole of `said`: the re-read part of a pass."""
    n, m = len(said), len(texts)
    row = list(range(m + 1))  # distance of said[:0] to texts[:j]
    for i in range(1, n + 1):
        prev, row = row, [i] + [0] * m
        for j in range(1, m + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (said[i - 1] != texts[j - 1]))
    return min(range(m + 1), key=lambda j: (row[j], -j))  # the longest prefix among the closest


def normalise(text: str) -> str:
    """Word text for comparison: case-folded, punctuation stripped from both ends ("Hello," = "hello")."""
    folded = text.casefold().strip()
    lo, hi = 0, len(folded)
    while lo < hi and unicodedata.category(folded[lo])[0] in "PS":
        lo += 1
    while hi > lo and unicodedata.category(folded[hi - 1])[0] in "PS":
        hi -= 1
    return folded[lo:hi] or folded  # a word of pure punctuation compares as itself


class CommitPolicy:
    """Two-pass agreement over a stream of hypotheses.

    repeat_words / repeat_window_s: a pass whose first word beyond the horizon starts less than
    `repeat_window_s` after it, and whose first up to `repeat_words` words equal the committed tail,
    is re-reading committed audio with shifted times; those words are not committed twice.
    """

    def __init__(self, *, repeat_words: int = REPEAT_WORDS, repeat_window_s: float = REPEAT_WINDOW_S,
                 loop_max_unit: int = LOOP_MAX_UNIT, loop_repeats: int = LOOP_REPEATS,
                 min_probability: float = MIN_COMMIT_PROBABILITY):
        # A word two passes agree on is committed before the utterance ends only if the current pass
        # gives it at least min_probability: a small model guessing the rest of a sentence from its
        # first words can guess the same word twice ("Remind me to take out the trash next ..." for
        # "... at three fifteen", "next" at 0.93 then 0.49). docs/streaming.md has the measurement.
        self.min_probability = min_probability
        self._committed: list[Word] = []
        self._since = 0  # committed words before this index belong to audio no pass re-reads
        self._previous: list[Word] = []
        self._pending: list[Word] = []
        self.repeat_words = repeat_words
        self.repeat_window_s = repeat_window_s
        self.loop_max_unit = loop_max_unit
        self.loop_repeats = loop_repeats

    @property
    def committed(self) -> list[Word]:
        """The committed words still held (older ones are forgotten: FORGET_AFTER)."""
        return list(self._committed)

    @property
    def pending(self) -> list[Word]:
        """The last hypothesis beyond the committed words."""
        return list(self._pending)

    @property
    def rereads(self) -> list[Word]:
        """The committed words whose audio passes still read (the current utterance's)."""
        return list(self._committed[self._since:])

    def state(self) -> dict:
        """What a restored policy needs to decide as this one would (JSON-able): the committed
        words passes still compare with (the current utterance's, and the last `repeat_words`),
        the last pass's hypothesis and the pending words."""
        keep = self._stale()
        words = lambda ws: [[w.word, float(w.start), float(w.end), float(w.probability)] for w in ws]  # noqa: E731
        return {"committed": words(self._committed[keep:]), "since": self._since - keep,
                "previous": words(self._previous), "pending": words(self._pending)}

    def restore(self, state: dict) -> "CommitPolicy":
        """Take a `state()`; returns self."""
        words = lambda ws: [Word(str(w[0]), float(w[1]), float(w[2]), float(w[3])) for w in ws]  # noqa: E731
        self._committed = words(state["committed"])
        self._since = int(state["since"])
        self._previous = words(state.get("previous", []))
        self._pending = words(state.get("pending", []))
        if not 0 <= self._since <= len(self._committed):
            raise ValueError(f"policy state: since {self._since} out of range")
        return self

    @property
    def committed_until_s(self) -> float:
        """End of the last committed word in seconds (0.0 before any); audio before it can be trimmed."""
        return self._committed[-1].end if self._committed else 0.0

    def update(self, words: Iterable[Word | dict], hold_after_s: float | None = None) -> CommitResult:
        """Take one pass's hypothesis (words over the whole buffer, stream times) and commit what it
        and the previous pass agree on beyond the committed words; with hold_after_s, agreed words
        ending after that time stay pending."""
        current = [Word.coerce(w) for w in words]
        tail = self._beyond_committed(current)
        before = self._beyond_committed(self._previous)
        agree = 0
        while agree < min(len(tail), len(before)) and \
                normalise(tail[agree].word) == normalise(before[agree].word) and \
                (hold_after_s is None or tail[agree].end <= hold_after_s + _EPS) and \
                (hold_after_s is None or tail[agree].probability >= self.min_probability):
            agree += 1
        new = self._commit(tail[:agree])
        self._pending = tail[agree:]
        self._previous = current
        return CommitResult(committed=self.committed, pending=list(self._pending), new=new)

    def flush(self) -> CommitResult:
        """Commit everything pending (end of stream or of an utterance) and forget the last pass."""
        new = self._commit(self._pending)
        self._pending, self._previous = [], []
        return CommitResult(committed=self.committed, pending=[], new=new)

    def new_utterance(self) -> None:
        """The audio of the committed words is gone from the buffer: from now on no pass re-reads
        them, so a new pass's words are compared only with words committed after this call."""
        self._since = len(self._committed)
        self._previous = []
        self._forget()

    def _stale(self) -> int:
        """How many of the first committed words no pass compares with any more: before the current
        utterance and beyond the last `repeat_words` (what `state` leaves out)."""
        return min(self._since, max(0, len(self._committed) - self.repeat_words))

    def _forget(self) -> None:
        """Drop the committed words no pass compares with, in batches of FORGET_AFTER or more."""
        old = self._stale()
        if old >= FORGET_AFTER:
            del self._committed[:old]
            self._since -= old

    def commit_through(self, until_s: float) -> CommitResult:
        """Commit the pending words that end by `until_s` (seconds), agreed or not: the streaming
        buffer is full and its oldest audio must go (the long-audio cut rule of §8 picks `until_s`)."""
        keep = [w for w in self._pending if w.end <= until_s + _EPS]
        new = self._commit(keep)
        self._pending = self._pending[len(keep):]
        return CommitResult(committed=self.committed, pending=list(self._pending), new=new)

    def _beyond_committed(self, words: Sequence[Word]) -> list[Word]:
        """The words of a pass that extend the committed text, with a trailing loop cut back."""
        current = self._committed[self._since:]  # committed words whose audio passes still read
        said = [normalise(w.word) for w in current]
        head = min(len(said), RESTART_MIN_WORDS)
        texts = [normalise(w.word) for w in words]
        starts_there = bool(words) and bool(current) and words[0].start < current[0].end + self.repeat_window_s
        if said and (texts[:head] == said[:head] or starts_there):
            # The pass re-reads the utterance (it begins with the same words, or where the
            # utterance's first committed word lies): align by text, not by time, allowing it to
            # read committed words differently ("Ben" where "Victor" was committed) without saying
            # the whole sentence again.
            tail = list(words[aligned_prefix(said, texts):])
        else:
            tail = self._beyond_horizon(words, bool(current))
            if said and [normalise(w.word) for w in tail[:len(said)]] == said:
                tail = tail[len(said):]  # the utterance re-read from its start, re-timed past the horizon
        while True:
            reading = [w.word for w in current] + [w.word for w in tail]
            restart = restarted_sentence(reading)
            if restart is None or not restart[0] < len(current) <= restart[1]:
                break
            # The earlier reading is (partly) committed: the later one goes, through its sentence end.
            b = restart[1]
            end = next((i + 1 for i in range(b, len(reading)) if ends_sentence(reading[i])),
                       len(reading))
            tail = tail[:b - len(current)] + tail[end - len(current):]
        while (restart := restarted_sentence([w.word for w in tail])) is not None:
            a, b = restart
            tail = tail[:a] + tail[b:]  # the earlier reading of the same sentence goes
        texts = said + [normalise(w.word) for w in tail]
        if find_loop(texts, self.loop_max_unit, self.loop_repeats):
            keep = len(cut_loop(texts, self.loop_max_unit, self.loop_repeats))
            tail = tail[: max(0, keep - len(current))]
            texts = texts[:keep]
        keep = len(texts) - doubled_tail(texts)
        return tail[: max(0, keep - len(current))]

    def _beyond_horizon(self, words: Sequence[Word], rereads: bool) -> list[Word]:
        """The words past the committed time horizon, then past a repeat of the committed tail."""
        horizon = self.committed_until_s
        tail = [w for w in words if w.end > horizon + _EPS and (w.start + w.end) / 2 >= horizon - _EPS] \
            if rereads else list(words)
        if tail and self._committed and tail[0].start < horizon + self.repeat_window_s:
            done = [normalise(w.word) for w in self._committed[-self.repeat_words:]]
            for k in range(min(len(done), len(tail)), 0, -1):  # the longest repeat of the committed tail
                if done[len(done) - k:] == [normalise(w.word) for w in tail[:k]]:
                    tail = tail[k:]
                    break
        return tail

    def _commit(self, words: Sequence[Word]) -> list[Word]:
        """Append words, keeping committed times non-decreasing and non-overlapping."""
        new = []
        for w in words:
            start = max(w.start, self.committed_until_s)
            word = Word(w.word, start, max(w.end, start), w.probability)
            self._committed.append(word)
            new.append(word)
        return new
