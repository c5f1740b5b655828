"""Beam search and greedy decoding (guide §6), driven by scripted logit sources."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from whistle_stream.search import SearchResult, beam_search, cut_loop, find_loop, greedy_draft

TEXT = 12  # text ids 0..11
TAGS = 3  # language tags 12..14
VOCAB = TEXT + TAGS
EOS = 2


class ScriptedDecoder:
    """A fake decoder whose logits are a function of the prefix it has been fed.

    It keeps one prefix per row and reorders them by `parents` exactly as the real decoder reorders
    its caches, so a search that passes wrong parents gets the wrong logits back.
    """

    def __init__(self, logits_of):
        self.logits_of = logits_of
        self.rows: list[tuple[int, ...]] = [()]
        self.calls: list[tuple[np.ndarray, np.ndarray]] = []

    def first(self) -> np.ndarray:
        return self.logits_of(())

    def advance(self, parents: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        assert parents.dtype == np.int64 and tokens.dtype == np.int64
        assert parents.shape == tokens.shape and parents.ndim == 1
        assert all(0 <= p < len(self.rows) for p in parents), "parent row out of range"
        self.calls.append((parents.copy(), tokens.copy()))
        self.rows = [self.rows[p] + (int(t),) for p, t in zip(parents, tokens)]
        return np.stack([self.logits_of(r) for r in self.rows]).astype(np.float32)


def random_lm(seed: int, eos_ramp: float = 0.35, vocab: int = VOCAB, eos: int = EOS):
    """Deterministic pseudo-random logits per prefix; </s> grows likelier with length."""

    def logits_of(prefix: tuple[int, ...]) -> np.ndarray:
        key = zlib.crc32(np.asarray((seed,) + prefix, dtype=np.int64).tobytes())
        x = np.random.default_rng(key).normal(0.0, 2.0, vocab).astype(np.float32)
        x[eos] += eos_ramp * len(prefix) - 1.0
        return x

    return logits_of


def table_lm(table: dict[tuple[int, ...], dict[int, float]], floor: float = -30.0):
    """Logits from a table prefix -> {token: logit}; every other id gets `floor`."""

    def logits_of(prefix):
        x = np.full(VOCAB, floor, dtype=np.float32)
        for tok, val in table.get(prefix, {EOS: 0.0}).items():
            x[tok] = val
        return x

    return logits_of


def naive_beam(logits_of, *, first_tag, eos, max_len, beams, candidates, prompt_len=2):
    """A slow, obviously-literal reading of the §6 rules (the oracle for these tests)."""
    cap = max_len - 1 - prompt_len
    live = [((), 0.0)]
    finished = []
    while True:
        props = []
        for b, (seq, run) in enumerate(live):
            x = logits_of(seq)[:first_tag].astype(np.float64)
            lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
            best = sorted(range(first_tag), key=lambda t: (-lp[t], t))[:candidates]
            props += [(run + lp[t], b, rank, t) for rank, t in enumerate(best)]
        props.sort(key=lambda p: (-p[0], p[1], p[2]))
        nxt = []
        for score, b, _, t in props:
            seq = live[b][0]
            if t == eos:
                finished.append((score / (len(seq) + 1), list(seq)))
                continue
            seq = seq + (t,)
            unit = next((u for u in range(1, 9) if len(seq) >= 4 * u
                         and all(seq[len(seq) - (k + 1) * u: len(seq) - k * u] == seq[-u:] for k in range(4))), 0)
            if unit:
                finished.append((score / len(seq), list(seq[: len(seq) - 3 * unit])))
            elif len(seq) >= cap:
                finished.append((score / len(seq), list(seq)))
            else:
                nxt.append((seq, score))
                if len(nxt) == beams:
                    break
        if len(finished) >= beams or not nxt:
            break
        live = nxt
    best = max(finished, key=lambda f: f[0])
    return best[1], best[0]


def naive_greedy(logits_of, *, first_tag, eos, cap):
    seq = ()
    while True:
        tok = int(np.argmax(logits_of(seq)[:first_tag]))
        if tok == eos:
            return list(seq)
        seq += (tok,)
        unit = find_loop(seq)
        if unit:
            return list(seq[: len(seq) - 3 * unit])
        if len(seq) >= cap:
            return list(seq)


def run(logits_of, **kw):
    dec = ScriptedDecoder(logits_of)
    kw.setdefault("first_tag", TEXT)
    kw.setdefault("eos", EOS)
    kw.setdefault("max_len", 40)
    return beam_search(dec.first(), dec.advance, **kw), dec


# ---------------------------------------------------------------- loop helpers

def test_find_loop_reports_the_shortest_unit_repeated_four_times():
    assert find_loop([9, 1, 1, 1, 1]) == 1
    assert find_loop([5, 3, 4, 3, 4, 3, 4, 3, 4]) == 2
    assert find_loop(list(range(8)) * 4) == 8


def test_find_loop_needs_four_copies_at_the_end():
    assert find_loop([3, 4, 3, 4, 3, 4]) == 0
    assert find_loop([1, 1, 1, 1, 2]) == 0
    assert find_loop(list(range(9)) * 4) == 0  # a nine-token unit is too long to count
    assert find_loop([]) == 0


def test_find_loop_works_on_word_texts():
    assert find_loop(["so", "the", "end", "the", "end", "the", "end", "the", "end"]) == 2


def test_cut_loop_keeps_one_copy_of_the_unit():
    assert cut_loop([7, 3, 4, 3, 4, 3, 4, 3, 4]) == [7, 3, 4]
    assert cut_loop([7, 3, 4]) == [7, 3, 4]


def test_cut_loop_removes_copies_beyond_the_fourth_too():
    assert cut_loop([7] + [3, 4] * 6) == [7, 3, 4]
    assert cut_loop(["a"] * 9) == ["a"]


# ---------------------------------------------------------------- greedy

@pytest.mark.parametrize("seed", range(6))
def test_one_beam_equals_plain_greedy_argmax(seed):
    lm = random_lm(seed)
    got, _ = run(lm, beams=1)
    assert got.tokens == naive_greedy(lm, first_tag=TEXT, eos=EOS, cap=40 - 3)


class DraftDecoder(ScriptedDecoder):
    """ScriptedDecoder with greedy_draft's two extra calls: follow feeds a guess in one run and
    returns each position's logits; back(k) keeps the first k tokens of the guess fed."""

    def __init__(self, logits_of):
        super().__init__(logits_of)
        self.followed: list[list[int]] = []
        self.backs: list[int] = []
        self.guess: tuple[int, ...] = ()

    def follow(self, guess: np.ndarray) -> np.ndarray:
        assert guess.dtype == np.int64 and len(self.rows) == 1
        self.followed.append(guess.tolist())
        self.guess = tuple(int(t) for t in guess)
        base = self.rows[0]
        self.rows = [base + self.guess]
        return np.stack([self.logits_of(base + self.guess[:j + 1]) for j in range(len(guess))]).astype(np.float32)

    def back(self, kept: int) -> None:
        self.backs.append(kept)
        self.rows = [self.guess[:kept]]


def drafted(logits_of, draft, max_len=40):
    dec = DraftDecoder(logits_of)
    return greedy_draft(dec.first(), dec.advance, dec.follow, dec.back, draft, first_tag=TEXT, eos=EOS,
                        max_len=max_len), dec


@pytest.mark.parametrize("seed", range(12))
def test_greedy_with_a_draft_returns_what_greedy_returns_whatever_the_draft(seed):
    lm = random_lm(seed, eos_ramp=0.15)
    want, _ = run(lm, beams=1)
    truth = want.tokens
    rng = np.random.default_rng(seed)
    wrong_mid = list(truth)
    if truth:
        k = len(truth) // 2
        wrong_mid[k] = (truth[k] + 1) % TEXT if (truth[k] + 1) % TEXT != EOS else (truth[k] + 3) % TEXT
    drafts = [truth, truth[:-1], truth[: len(truth) // 2], wrong_mid, truth + [3, 4, 5], [],
              [int(t) for t in rng.choice([t for t in range(TEXT) if t != EOS], 30)]]
    for draft in drafts:
        got, dec = drafted(lm, draft)
        assert (got.tokens, got.score, got.finished_by, got.token_logprobs) == \
            (want.tokens, want.score, want.finished_by, want.token_logprobs), draft
    # a right draft is read in one run: the search steps only past it (here: to read </s>)
    got, dec = drafted(lm, truth)
    if truth:
        assert dec.followed == [truth] and dec.backs == [] and dec.calls == []
    # a draft wrong from its middle on keeps the agreed part and steps from there
    if len(truth) >= 2:
        got, dec = drafted(lm, wrong_mid)
        assert dec.backs == [len(truth) // 2]
        assert [int(c[1][0]) for c in dec.calls] == truth[len(truth) // 2:]


def test_greedy_with_a_draft_loops_and_caps_as_greedy_does():
    table = np.random.default_rng(3).normal(0, 3, (TEXT, VOCAB)).astype(np.float32)
    table[:, EOS] -= 8.0

    def lm(prefix):
        return table[prefix[-1] if prefix else 0].copy()

    for max_len in (12, 60):
        want, _ = run(lm, beams=1, max_len=max_len)
        for draft in (want.tokens, want.tokens * 3, [1] * 80):
            got, _ = drafted(lm, draft, max_len=max_len)
            assert (got.tokens, got.finished_by) == (want.tokens, want.finished_by)


def test_a_draft_holding_eos_or_a_language_tag_is_refused_by_name():
    for bad in ([1, EOS, 3], [1, TEXT + 1]):
        with pytest.raises(ValueError, match="draft holds text ids"):
            drafted(random_lm(0), bad)


def test_greedy_never_picks_a_language_tag_even_when_it_is_the_largest_logit():
    def lm(prefix):
        x = np.zeros(VOCAB, dtype=np.float32)
        x[TEXT:] = 50.0
        x[5 if len(prefix) < 3 else EOS] = 10.0
        return x

    for beams in (1, 5):
        got, _ = run(lm, beams=beams)
        assert got.tokens == [5, 5, 5]
        assert got.finished_by == "eos"


# ---------------------------------------------------------------- beam rules

@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("beams,candidates", [(5, 6), (3, 2), (2, 6)])
def test_beam_search_matches_a_literal_reading_of_the_rules(seed, beams, candidates):
    lm = random_lm(seed)
    got, _ = run(lm, beams=beams, candidates=candidates)
    want_tokens, want_score = naive_beam(lm, first_tag=TEXT, eos=EOS, max_len=40,
                                         beams=beams, candidates=candidates)
    assert got.tokens == want_tokens
    assert got.score == want_score


def test_beam_finds_a_transcript_that_greedy_misses():
    # token 3 looks best first but leads to a flat continuation; token 4 is then near-certain
    table = {
        (): {3: 1.0, 4: 0.8},
        (3,): {5: 0.0, 6: 0.0, 7: 0.0, 8: 0.0},
        (4,): {9: 8.0},
        (3, 5): {EOS: 5.0}, (3, 6): {EOS: 5.0}, (3, 7): {EOS: 5.0}, (3, 8): {EOS: 5.0},
        (4, 9): {EOS: 5.0},
    }
    greedy, _ = run(table_lm(table), beams=1)
    beam, _ = run(table_lm(table), beams=5)
    assert greedy.tokens == [3, 5]
    assert beam.tokens == [4, 9]
    assert beam.score > greedy.score


def test_finished_score_is_log_probability_over_token_count_including_eos():
    table = {(): {7: 0.0, EOS: -40.0}, (7,): {8: 0.0}, (7, 8): {EOS: 0.0}}
    got, _ = run(table_lm(table, floor=-60.0), beams=5)
    assert got.tokens == [7, 8]
    assert got.finished_by == "eos"
    # three near-certain tokens (7, 8, </s>): mean log probability close to zero
    assert got.score == pytest.approx(sum(got.token_logprobs) / 3, abs=1e-6)
    assert got.score == pytest.approx(0.0, abs=1e-6)


def test_token_logprobs_are_normalised_over_text_ids_only():
    def lm(prefix):
        x = np.zeros(VOCAB, dtype=np.float32)
        x[TEXT:] = 100.0  # huge tag logits must not dilute the text distribution
        x[EOS if prefix else 4] = 5.0
        return x

    got, _ = run(lm, beams=1)
    want = 5.0 - np.log(np.exp(5.0) + (TEXT - 1))
    assert got.tokens == [4]
    assert got.token_logprobs == pytest.approx([want], abs=1e-6)


def test_a_loop_finishes_and_is_cut_back_to_one_copy():
    def lm(prefix):
        x = np.full(VOCAB, -5.0, dtype=np.float32)
        x[EOS] = -20.0
        x[[6, 7][len(prefix) % 2]] = 5.0  # 6 7 6 7 ... forever
        return x

    for beams in (1, 5):
        got, _ = run(lm, beams=beams)
        assert got.finished_by == "loop"
        assert got.tokens == [6, 7]
        assert len(got.token_logprobs) == 2


def test_reaching_the_cap_finishes_at_max_len_minus_one_positions():
    def lm(prefix):
        x = np.zeros(VOCAB, dtype=np.float32)
        x[EOS] = -50.0
        x[3 + len(prefix) % 9] = 6.0  # never repeats within 8-token units, never ends
        return x

    for beams in (1, 5):
        got, dec = run(lm, beams=beams, max_len=20, prompt_len=2)
        assert got.finished_by == "cap"
        assert len(got.tokens) == 20 - 1 - 2
        assert max(len(r) for r in dec.rows) <= 20 - 1 - 2 - 1


def test_tokens_are_returned_without_eos():
    got, _ = run(table_lm({(): {5: 0.0}, (5,): {EOS: 0.0}}), beams=5)
    assert got.tokens == [5]
    assert EOS not in got.tokens


def test_ties_are_broken_towards_lower_beam_then_better_ranked_lower_token():
    # all text logits equal: every candidate ties, so the lowest ids must be kept and chosen
    def lm(prefix):
        x = np.zeros(VOCAB, dtype=np.float32)
        x[TEXT:] = 9.0
        if len(prefix) >= 2:
            x[EOS] = 30.0
        return x

    got, _ = run(lm, beams=5, candidates=6)
    want, _ = naive_beam(lm, first_tag=TEXT, eos=EOS, max_len=40, beams=5, candidates=6)
    assert got.tokens == want == [0, 0]


def test_search_stops_once_beams_transcripts_have_finished():
    # every beam's best continuation is </s> from the second step on: five finish in one step
    def lm(prefix):
        x = np.full(VOCAB, -3.0, dtype=np.float32)
        x[3:9] = np.linspace(1.0, 0.5, 6)
        if prefix:
            x[EOS] = 10.0
        return x

    got, dec = run(lm, beams=5)
    assert len(dec.calls) == 1  # only the first step's five beams were ever fed
    assert len(got.tokens) == 1


def test_advance_is_fed_only_live_beams_with_valid_parents():
    lm = random_lm(3)
    got, dec = run(lm, beams=5)
    assert dec.calls, "the search should have advanced at least once"
    assert len(dec.calls[0][0]) <= 5 and set(dec.calls[0][0]) == {0}
    for parents, tokens in dec.calls:
        assert 1 <= len(parents) <= 5
        assert np.all(tokens < TEXT) and np.all(tokens != EOS)


def test_the_winning_transcript_was_actually_fed_through_advance():
    lm = random_lm(11)
    got, dec = run(lm, beams=5)
    fed = {r for r in dec.rows}
    prefixes = set()
    rows = [()]
    for parents, tokens in dec.calls:
        rows = [rows[p] + (int(t),) for p, t in zip(parents, tokens)]
        prefixes.update(rows)
    assert tuple(got.tokens[:-1]) in prefixes | {()}
    assert fed  # the decoder state was kept per row


def test_bad_input_is_rejected_with_a_clear_message():
    x = np.zeros(VOCAB, dtype=np.float32)
    with pytest.raises(ValueError, match="eos"):
        beam_search(x, lambda p, t: None, first_tag=TEXT, eos=TEXT + 1, max_len=40)
    with pytest.raises(ValueError, match="first_logits"):
        beam_search(x[:5], lambda p, t: None, first_tag=TEXT, eos=EOS, max_len=40)
    with pytest.raises(ValueError, match="beams"):
        beam_search(x, lambda p, t: None, first_tag=TEXT, eos=EOS, max_len=40, beams=0)
    with pytest.raises(ValueError, match="max_len"):
        beam_search(x, lambda p, t: None, first_tag=TEXT, eos=EOS, max_len=3)
    with pytest.raises(ValueError, match="advance"):
        x[5] = 3.0
        beam_search(x, lambda p, t: np.zeros((len(p), VOCAB - 1), np.float32),
                    first_tag=TEXT, eos=EOS, max_len=40)


def test_result_is_a_search_result_with_aligned_logprobs():
    got, _ = run(random_lm(5), beams=5)
    assert isinstance(got, SearchResult)
    assert len(got.token_logprobs) == len(got.tokens)
    assert all(lp <= 0.0 for lp in got.token_logprobs)


def test_a_long_five_beam_search_over_the_shipped_vocabulary_ends_by_cap_or_loop():
    """(Its speed is measured by benchmarks/decoder.py's transcription figure, not timed here.)"""
    vocab, text = 8199, 8192
    rng = np.random.default_rng(0)
    table = rng.normal(0, 3, (64, vocab)).astype(np.float32)
    table[:, 2] = -30.0  # no </s>: every step runs all five beams
    steps = 0

    def advance(parents, tokens):
        nonlocal steps
        steps += 1
        return table[(tokens + steps) % 64]

    max_len = 200
    got = beam_search(table[0], advance, first_tag=text, eos=2, max_len=max_len)
    assert got.finished_by in ("cap", "loop")
    assert steps > 20
    assert len(got.tokens) <= max_len and all(t < text for t in got.tokens)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("quantum", [0.0, 0.5])
def test_large_vocabulary_candidates_match_the_rules_even_with_tied_logits(seed, quantum):
    text, vocab = 1600, 1603  # wide enough for the chunked top-k prefilter
    base = random_lm(seed, vocab=vocab)

    def lm(prefix):
        x = base(prefix)
        return np.round(x / quantum) * quantum if quantum else x

    dec = ScriptedDecoder(lm)
    got = beam_search(dec.first(), dec.advance, first_tag=text, eos=EOS, max_len=30)
    want_tokens, want_score = naive_beam(lm, first_tag=text, eos=EOS, max_len=30, beams=5, candidates=6)
    assert got.tokens == want_tokens
    assert got.score == want_score


@pytest.mark.parametrize("seed", range(40))
def test_tie_heavy_markov_sources_loop_and_cap_exactly_as_the_rules_say(seed):
    # logits depend on the last token only: many beams share scores exactly, loops are common
    table = np.random.default_rng(seed).normal(0, 3, (TEXT, VOCAB)).astype(np.float32)
    table[:, EOS] -= 4.0

    def lm(prefix):
        return table[prefix[-1] if prefix else 0].copy()

    for max_len in (25, 60):
        got, _ = run(lm, beams=5, max_len=max_len)
        want_tokens, want_score = naive_beam(lm, first_tag=TEXT, eos=EOS, max_len=max_len, beams=5, candidates=6)
        assert (got.tokens, got.score) == (want_tokens, want_score)
