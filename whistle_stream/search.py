"""Beam search and greedy decoding over a step callback (guide §6).

The decoder is hidden behind two things: the logits of the first text position, and
`advance(parents, tokens) -> logits`, which reorders the decoder's per-beam state to `parents`
(row indices into the rows of the previous call, or of `first_logits` for the first call) and feeds
`tokens`, returning the next-token logits of every row. The search owns the rules:

- every live beam proposes its `candidates` best text tokens (ids below `first_tag`, </s> among
  them), log-softmax normalised over the text ids only;
- a proposal scores the beam's running log probability plus the token's (plus a keyword bias, §7);
- all proposals are sorted together (score descending, then lower beam index, then the beam's
  better-ranked token: higher log probability, then lower id)
  and taken in order until `beams` beams are live; a proposal that ends the transcript (</s>, a
  loop, or the length cap) finishes instead of taking a beam, scored as log probability / tokens;
- the search stops once `beams` transcripts have finished or no beam is left; best finished wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from .rules import BEAMS

LOOP_MAX_UNIT = 8  # §6: "a unit of up to eight tokens"
LOOP_REPEATS = 4  # §6: "repeated four times at the end"


@dataclass
class SearchResult:
    """The chosen transcript.

    tokens: generated text ids, without </s> (a loop is cut back to one copy of its unit).
    score: log probability (with keyword bias, if any) divided by the generated token count.
    finished_by: "eos", "loop" or "cap".
    token_logprobs: the model's log probability of each returned token (no bias), normalised over
        the text ids; same length as `tokens`.
    """

    tokens: list[int]
    score: float
    finished_by: str
    token_logprobs: list[float] = field(default_factory=list)


class Biaser(Protocol):
    """What the search needs from a keyword biaser (see keywords.KeywordBiaser)."""

    initial: object

    def bias_candidates(
        self, state: object, token_ids: np.ndarray, position: int
    ) -> tuple[np.ndarray, list]: ...


def find_loop(tokens: Sequence, max_unit: int = LOOP_MAX_UNIT, repeats: int = LOOP_REPEATS) -> int:
    """Length of the shortest unit of 1..max_unit items repeated `repeats` times at the end of
    `tokens` (any sequence of comparable items: token ids or word texts), or 0 if there is none."""
    if max_unit < 1 or repeats < 2:
        raise ValueError(f"find_loop needs max_unit >= 1 and repeats >= 2, got {max_unit}, {repeats}")
    items = list(tokens[-max_unit * repeats :])  # only the tail can hold a loop
    n = len(items)
    for unit in range(1, max_unit + 1):
        if unit * repeats > n:
            break
        tail = items[n - unit :]
        if all(items[n - k * unit - unit : n - k * unit] == tail for k in range(1, repeats)):
            return unit
    return 0


def cut_loop(tokens: Sequence, max_unit: int = LOOP_MAX_UNIT, repeats: int = LOOP_REPEATS) -> list:
    """`tokens` as a list, with a loop at its end (see find_loop) cut back to one copy of the
    repeated unit; every further copy before the loop's last `repeats` is removed too."""
    items = list(tokens)
    unit = find_loop(items, max_unit, repeats)
    if unit:
        tail = items[len(items) - unit :]
        keep = len(items) - (repeats - 1) * unit
        while keep >= 2 * unit and items[keep - 2 * unit : keep - unit] == tail:
            keep -= unit
        del items[keep:]
    return items


def _text_logprobs(logits: np.ndarray, text_vocab: int,
                   scratch: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Text logits (B, text_vocab) float32, and in float64 each row's max (B,) and log of the
    softmax mass (B,), so that log p(t) = (x[t] - max) - log_mass: exactly log_softmax in float64
    (the reference oracle's arithmetic, so that equal scores stay equal and ties break alike).
    scratch: a float64 buffer of at least (B, text_vocab) that a search reuses step after step
    (the same arithmetic in place: a 5-beam step's three temporaries of 330 KB each cost five
    times the arithmetic in page faults)."""
    text = logits[:, :text_vocab]  # (B, text_vocab)
    rows = text.shape[0]
    if scratch is None or scratch.shape[0] < rows or scratch.shape[1] != text_vocab:
        scratch = np.empty((rows, text_vocab), np.float64)
    wide = scratch[:rows]
    np.copyto(wide, text)
    top = wide.max(axis=1)  # (B,)
    np.subtract(wide, top[:, None], out=wide)
    np.exp(wide, out=wide)
    log_mass = np.log(wide.sum(axis=1))  # (B,)
    return text, top, log_mass


_CHUNK = 128  # top-k prefilter: chunk maxima bound the k-th largest value from below


def _top_candidates(text: np.ndarray, k: int) -> np.ndarray:
    """(B, k) int64 ids of each row's k largest values, ordered by value descending then id
    ascending (so ties keep the lower id)."""
    rows, width = text.shape
    starts = np.arange(0, width, _CHUNK)
    if len(starts) < 2 * k:
        return np.argsort(-text, axis=1, kind="stable")[:, :k].astype(np.int64)
    # the k largest chunk maxima are k distinct values, so the k-th largest value is >= their min
    chunk_max = np.maximum.reduceat(text, starts, axis=1)  # (B, chunks)
    bound = np.partition(chunk_max, len(starts) - k, axis=1)[:, len(starts) - k]  # (B,)
    out = np.empty((rows, k), dtype=np.int64)
    for r in range(rows):
        ids = np.flatnonzero(text[r] >= bound[r])  # ascending ids, a few dozen at most in practice
        out[r] = ids[np.argsort(-text[r, ids], kind="stable")[:k]]
    return out


def _check_logits(logits: np.ndarray, rows: int, vocab: int, where: str) -> np.ndarray:
    arr = np.asarray(logits)
    if arr.shape != (rows, vocab):
        raise ValueError(f"{where} must have shape ({rows}, {vocab}) (rows, vocab), got {arr.shape}")
    if arr.dtype != np.float32:
        arr = arr.astype(np.float32)
    return arr


def beam_search(
    first_logits: np.ndarray,
    advance: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    first_tag: int,
    eos: int,
    max_len: int,
    beams: int = BEAMS,
    candidates: int = 6,
    biaser: Biaser | None = None,
    prompt_len: int = 2,
) -> SearchResult:
    """Decode one transcript (guide §6).

    first_logits: (vocab,) logits of the first text position (after <s> and the language tag).
    advance(parents, tokens): int64 (B,) row indices into the previous call's rows and int64 (B,)
        tokens to feed; returns (B, vocab) logits. Called only for beams that stay live.
    first_tag: id of the first language tag; text ids are below it. eos: the </s> id (a text id).
    max_len: decoder positions (320); a proposal finishes when prompt_len + generated tokens
        reaches max_len - 1. beams=1 without a biaser is plain greedy argmax decoding.
    """
    first = np.asarray(first_logits)
    if first.ndim != 1 or first.shape[0] < first_tag:
        raise ValueError(f"first_logits must be a 1-D (vocab,) array with vocab >= first_tag={first_tag}, "
                         f"got shape {first.shape}")
    if not 0 <= eos < first_tag:
        raise ValueError(f"eos must be a text id in [0, first_tag={first_tag}), got {eos}")
    if beams < 1 or candidates < 1:
        raise ValueError(f"beams and candidates must be >= 1, got beams={beams} candidates={candidates}")
    cap = max_len - 1 - prompt_len  # generated tokens at which a transcript is cut off
    if cap < 1:
        raise ValueError(f"max_len={max_len} leaves no room for text after a prompt of {prompt_len}")
    vocab = first.shape[0]
    candidates = min(candidates, first_tag)
    logits = _check_logits(first[None, :], 1, vocab, "first_logits")
    if beams == 1 and biaser is None:
        return _greedy(logits, advance, first_tag, eos, cap, vocab)

    # live beams: parallel lists, row r of `logits` belongs to beam r
    live_tokens: list[list[int]] = [[]]
    live_lps: list[list[float]] = [[]]
    live_score = np.zeros(1, dtype=np.float64)  # running log probability (with bias)
    live_state: list = [biaser.initial] if biaser is not None else [None]
    finished: list[tuple[float, list[int], str, list[float]]] = []
    scratch = np.empty((beams, first_tag), np.float64)

    while True:
        n_live = len(live_tokens)
        text, top, log_mass = _text_logprobs(logits, first_tag, scratch)
        cand = _top_candidates(text, candidates)  # (B, k)
        cand_x = np.take_along_axis(text, cand, axis=1).astype(np.float64)  # (B, k)
        cand_lp = (cand_x - top[:, None]) - log_mass[:, None]  # (B, k)
        scores = live_score[:, None] + cand_lp  # (B, k)
        new_states = None
        if biaser is not None:
            new_states = []
            for b in range(n_live):
                deltas, states = biaser.bias_candidates(live_state[b], cand[b], len(live_tokens[b]))
                scores[b] += deltas
                new_states.append(states)
        flat_scores = scores.ravel()
        beam_of = np.repeat(np.arange(n_live), cand.shape[1])
        rank = np.tile(np.arange(cand.shape[1]), n_live)  # within a beam: better token first, then lower id
        order = np.lexsort((rank, beam_of, -flat_scores))

        parents: list[int] = []
        fed: list[int] = []
        next_tokens, next_lps, next_scores, next_states = [], [], [], []
        for j in order:
            b, c = divmod(int(j), cand.shape[1])
            tok = int(cand[b, c])
            score = float(flat_scores[j])
            lp = float(cand_lp[b, c])
            if tok == eos:
                n = len(live_tokens[b]) + 1
                finished.append((score / n, live_tokens[b], "eos", live_lps[b]))
            else:
                seq = live_tokens[b] + [tok]
                lps = live_lps[b] + [lp]
                if find_loop(seq):
                    kept = cut_loop(seq)
                    finished.append((score / len(seq), kept, "loop", lps[: len(kept)]))
                elif len(seq) >= cap:
                    finished.append((score / len(seq), seq, "cap", lps))
                else:
                    parents.append(b)
                    fed.append(tok)
                    next_tokens.append(seq)
                    next_lps.append(lps)
                    next_scores.append(score)
                    next_states.append(new_states[b][c] if new_states is not None else None)
                    if len(parents) == beams:
                        break
        if len(finished) >= beams or not parents:
            break
        live_tokens, live_lps, live_state = next_tokens, next_lps, next_states
        live_score = np.asarray(next_scores, dtype=np.float64)
        logits = _check_logits(
            advance(np.asarray(parents, dtype=np.int64), np.asarray(fed, dtype=np.int64)),
            len(parents), vocab, "advance(...) result")

    # best finished score; ties go to the earliest finished (max keeps the first maximum)
    best = max(range(len(finished)), key=lambda i: finished[i][0])
    score, tokens, how, lps = finished[best]
    return SearchResult(tokens=list(tokens), score=float(score), finished_by=how, token_logprobs=list(lps))


def greedy_draft(
    first_logits: np.ndarray,
    advance: Callable[[np.ndarray, np.ndarray], np.ndarray],
    follow: Callable[[np.ndarray], np.ndarray],
    back: Callable[[int], None],
    draft: Sequence[int],
    *,
    first_tag: int,
    eos: int,
    max_len: int,
    prompt_len: int = 2,
) -> SearchResult:
    """Greedy decoding (`beam_search` with beams=1 and no biaser: the same result, token for token)
    that checks a guess of the transcript first: a streaming pass's guess is the pass before's
    reading, which it mostly repeats.

    follow(draft) feeds the guess after the prompt in one teacher-forced run and returns its rows'
    logits (len(draft), vocab): row j is what greedy would read after draft[:j + 1], since a row's
    logits do not depend on how the decoder was fed. Greedy keeps the guess while its argmax agrees;
    at the first token that differs, back(k) makes the decoder hold the prompt and draft[:k] only
    (the k agreed tokens), and the search steps on with advance as `_greedy` does. The guess costs
    one teacher-forced run instead of a step per token (about a fifth of a 5-beam step each on
    the full architecture), plus a second run of the agreed part when it is wrong before its end.
    """
    first = np.asarray(first_logits)
    vocab = first.shape[0]
    cap = max_len - 1 - prompt_len
    if cap < 1:
        raise ValueError(f"max_len={max_len} leaves no room for text after a prompt of {prompt_len}")
    guess = np.asarray(draft, dtype=np.int64).reshape(-1)[: max(cap - 1, 0)]
    if guess.size and (guess.min() < 0 or guess.max() >= first_tag or np.any(guess == eos)):
        raise ValueError(f"a draft holds text ids in [0, {first_tag}) other than </s>, got {guess.tolist()}")
    logits = _check_logits(first[None, :], 1, vocab, "first_logits")
    return _greedy(logits, advance, first_tag, eos, cap, vocab, guess, follow, back)


def _greedy(logits: np.ndarray, advance, first_tag: int, eos: int, cap: int, vocab: int,
            draft: np.ndarray | None = None, follow=None, back=None) -> SearchResult:
    """Argmax over the text ids until </s>, a loop or the cap (§6: "greedy gives a correct model");
    with a draft, as `greedy_draft` describes."""
    tokens: list[int] = []
    lps: list[float] = []
    total = 0.0
    rows = None
    if draft is not None and len(draft):
        rows = _check_logits(follow(draft), len(draft), vocab, "follow(...) result")
    scratch = np.empty((1, first_tag), np.float64)
    while True:
        text, top, log_mass = _text_logprobs(logits, first_tag, scratch)
        tok = int(np.argmax(text[0]))
        lp = float((np.float64(text[0, tok]) - top[0]) - log_mass[0])
        total += lp
        if tok == eos:
            return SearchResult(tokens, total / (len(tokens) + 1), "eos", lps)
        tokens.append(tok)
        lps.append(lp)
        if find_loop(tokens):
            kept = cut_loop(tokens)
            return SearchResult(kept, total / len(tokens), "loop", lps[: len(kept)])
        if len(tokens) >= cap:
            return SearchResult(tokens, total / len(tokens), "cap", lps)
        k = len(tokens) - 1  # tok's place in the transcript
        if rows is not None:
            if k < len(draft) and tok == draft[k]:
                logits = rows[k:k + 1]  # the decoder has read it already
                continue
            if k < len(draft):
                back(k)  # the guess is wrong from here: keep its first k tokens only
            rows = None
        logits = _check_logits(advance(np.zeros(1, dtype=np.int64), np.array([tok], dtype=np.int64)),
                               1, vocab, "advance(...) result")
