"""Keyword biasing: phrases -> an Aho-Corasick automaton over token ids, and a per-beam bias (§7).

Each beam carries a state `(node, unbanked)`: its position in the automaton and how many of the
current match's tokens have earned a bonus that is not yet safe. A token that extends a match earns
BONUS; a token that breaks it pays back the unbanked bonus of the tokens the match drops (a fail
transition keeps the part of the match that is a prefix of another phrase, and keeps its bonus);
when a phrase completes, its bonus is banked, so a completed n-token phrase ends 2n ahead and a
phrase abandoned halfway is worth nothing. The next token restarts from the completed node, so an
overlapping longer phrase can still extend it.

Two tokenisations per spelling (§7): "with a leading space" for use anywhere in the transcript and
"without one" for use only as its first word. The first is the spelling's pieces as they appear after
a space inside text; it is read off encode(s + " " + s) minus encode(s), because encode(" " + s) is not
that on every sentencepiece setup: with a dummy prefix the reference tokenizer gives "▁" + "▁word",
and a normaliser that strips whitespace gives "word" (the in-text form there may be "▁" + "word").
Without a dummy prefix the two forms differ ("▁word" inside, "word" first); with one they coincide
("▁word" both) and the first-word form adds nothing. If the spelling's pieces merge across the space
(only a vocabulary with pieces spanning a space allows that), the literal encode(" " + s) is used.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Protocol, Sequence

import numpy as np

BONUS = 2.0  # §7: +2.0 log probability per matched token, so an n-token phrase ends 2n ahead

ROOT = 0  # the automaton's root: no match in progress
START = 1  # the root at the transcript's first token, where first-word spellings may begin

State = tuple[int, int]  # (automaton node, unbanked matched tokens)


class TextEncoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def parse_keywords(keywords: str | Sequence[str] | None) -> list[str]:
    """Keyword phrases from the public `keywords` argument (§7).

    One string holds one phrase per line; a list or tuple of strings is joined with newlines; commas
    do not split (a single string with commas is one phrase). Lines are stripped, inner whitespace
    collapsed, blank lines and repeats dropped. None or "" gives [].
    """
    if keywords is None:
        return []
    if isinstance(keywords, (list, tuple)):
        bad = [type(k).__name__ for k in keywords if not isinstance(k, str)]
        if bad:
            raise TypeError(f"keywords must be a string (one phrase per line) or a list of strings, "
                            f"got a list holding {bad[0]}")
        keywords = "\n".join(keywords)
    if not isinstance(keywords, str):
        raise TypeError(f"keywords must be a string (one phrase per line), a list of strings or None, "
                        f"got {type(keywords).__name__}")
    phrases: list[str] = []
    for line in keywords.splitlines():
        phrase = " ".join(line.split())
        if phrase and phrase not in phrases:
            phrases.append(phrase)
    return phrases


def spellings(phrase: str) -> list[str]:
    """The three spellings of §7: as given, lower case, title case (each word's first letter upper,
    the rest lower; unlike str.title, an apostrophe does not start a word). Repeats removed."""
    title = " ".join(w[:1].upper() + w[1:].lower() for w in phrase.split(" "))
    out: list[str] = []
    for s in (phrase, phrase.lower(), title):
        if s not in out:
            out.append(s)
    return out


class KeywordBiaser:
    """An Aho-Corasick automaton over token ids with the §7 per-beam bias.

    Build it with `KeywordBiaser.build(phrases, tokenizer, special_ids)`, or directly from token
    sequences with `KeywordBiaser(anywhere, first_only)`: `anywhere` sequences match at any position,
    `first_only` sequences only when they start at the transcript's first token. `len(biaser)` is
    the number of distinct token sequences; an empty biaser is falsy and biases nothing.
    """

    def __init__(self, anywhere: Iterable[Sequence[int]], first_only: Iterable[Sequence[int]] = ()):
        self._goto: list[dict[int, int]] = [{}, {}]  # node -> {token: child}
        self._depth: list[int] = [0, 0]
        self._terminal: list[bool] = [False, False]
        self.anywhere = sorted({tuple(int(t) for t in s) for s in anywhere if len(s)})
        self.first_only = sorted({tuple(int(t) for t in s) for s in first_only if len(s)} - set(self.anywhere))
        for seq in self.anywhere:
            self._insert(ROOT, seq)
        for seq in self.first_only:
            self._insert(START, seq)
        self._fail, self._out = self._link()
        self.alphabet = frozenset(t for edges in self._goto for t in edges)
        self.initial: State = (ROOT, 0)

    @classmethod
    def build(cls, phrases: Iterable[str], tokenizer: TextEncoder, special_ids: Iterable[int]
              ) -> "KeywordBiaser":
        """Tokenise each phrase's three spellings twice (§7) and build the automaton.

        phrases: from `parse_keywords`. tokenizer: anything with `encode(text) -> list[int]`.
        special_ids: control, unknown, user-defined and language-tag ids; a spelling whose tokens
            include one is dropped.
        """
        special = {int(i) for i in special_ids}
        anywhere, first_only = [], []
        for phrase in phrases:
            if not isinstance(phrase, str):
                raise TypeError(f"keyword phrases must be strings, got {type(phrase).__name__}")
            for s in spellings(phrase):
                first = list(tokenizer.encode(s))
                twice = list(tokenizer.encode(s + " " + s))
                inside = twice[len(first):] if twice[: len(first)] == first else list(tokenizer.encode(" " + s))
                for seq, bucket in ((inside, anywhere), (first, first_only)):
                    if seq and not special.intersection(seq):
                        bucket.append(seq)
        return cls(anywhere, first_only)

    def __len__(self) -> int:
        return len(self.anywhere) + len(self.first_only)

    def _insert(self, root: int, seq: tuple[int, ...]) -> None:
        node = root
        for tok in seq:
            child = self._goto[node].get(tok)
            if child is None:
                child = len(self._goto)
                self._goto.append({})
                self._depth.append(self._depth[node] + 1)
                self._terminal.append(False)
                self._goto[node][tok] = child
            node = child
        self._terminal[node] = True

    def _link(self) -> tuple[list[int], list[bool]]:
        """Fail links (longest proper suffix that is a trie node) and outputs (some phrase ends
        here, directly or as a suffix), breadth first. START fails to ROOT: a first-word match
        that breaks can continue as an ordinary one."""
        n = len(self._goto)
        fail = [ROOT] * n
        out = list(self._terminal)
        queue = deque([ROOT, START])
        while queue:
            v = queue.popleft()
            for tok, child in self._goto[v].items():
                f = fail[v] if v != ROOT else ROOT
                while tok not in self._goto[f] and f != ROOT:
                    f = fail[f]
                target = self._goto[f].get(tok, ROOT)
                fail[child] = target if target != child else ROOT
                out[child] = out[child] or out[fail[child]]
                queue.append(child)
        return fail, out

    def bias(self, state: State, token: int, position: int) -> tuple[float, State]:
        """Bias of feeding `token` as generated text token number `position` (0 = the transcript's
        first) to a beam in `state`: returns (delta to add to its log probability, new state)."""
        node, unbanked = state
        if position == 0 and node == ROOT:
            node = START
        n = node
        goto, fail = self._goto, self._fail
        while token not in goto[n] and n != ROOT:
            n = fail[n]
        nxt = goto[n].get(token, ROOT)
        kept = min(unbanked, self._depth[n])  # matched tokens the suffix match still carries
        matched = kept + (nxt != ROOT)
        delta = BONUS * (matched - unbanked)
        if self._out[nxt]:
            matched = 0  # a phrase completed: its bonus is kept for good
        return delta, (nxt, matched)

    def bias_candidates(self, state: State, token_ids: np.ndarray, position: int
                        ) -> tuple[np.ndarray, list[State]]:
        """`bias` for each of a beam's candidate tokens: (deltas (k,) float64, new states)."""
        token_ids = np.asarray(token_ids)
        unbanked = state[1]
        deltas = np.full(len(token_ids), -BONUS * unbanked, dtype=np.float64)  # off-alphabet: pay back
        states: list[State] = [(ROOT, 0)] * len(token_ids)
        for i, tok in enumerate(token_ids.tolist()):
            if tok in self.alphabet:
                deltas[i], states[i] = self.bias(state, tok, position)
        return deltas, states
