"""Keyword phrases, the Aho-Corasick automaton and the per-beam bias (guide §7)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from whistle_stream.keywords import BONUS, KeywordBiaser, parse_keywords, spellings
from whistle_stream.search import beam_search

SP = "\u2581"


class PieceTokenizer:
    """A tiny sentencepiece-like tokenizer: spaces become "▁", then greedy longest-match pieces;
    a character no piece covers becomes <unk>. With add_dummy_prefix a "▁" is put in front."""

    def __init__(self, pieces, add_dummy_prefix=False):
        self.pieces = list(pieces)
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.add_dummy_prefix = add_dummy_prefix

    def encode(self, text):
        s = text.replace(" ", SP)
        if self.add_dummy_prefix:
            s = SP + s
        out, i = [], 0
        while i < len(s):
            for j in range(len(s), i, -1):
                if s[i:j] in self.ids:
                    out.append(self.ids[s[i:j]])
                    i = j
                    break
            else:
                out.append(self.ids["<unk>"])
                i += 1
        return out

    def __getitem__(self, piece):
        return self.ids[piece]


SPECIAL = ["<unk>", "<s>", "</s>", "<kw>"]
WORDS = ["new", "york", "city", "is", "big", "the", "calico", "cat", "we", "met"]
PIECES = (SPECIAL + [SP + w for w in WORDS] + WORDS
          + [SP + "Ka", "Ka", SP + "ka", "ka", "li", "ko", SP + "New", "New", SP + "York", "York", SP + "City"]
          + [SP] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)])
TOK = PieceTokenizer(PIECES)
SPECIAL_IDS = [TOK[p] for p in SPECIAL]
EOS = TOK["</s>"]


def feed(biaser, tokens):
    """Run a token sequence through the bias as one beam would; returns the per-token deltas."""
    state, deltas = biaser.initial, []
    for pos, tok in enumerate(tokens):
        delta, state = biaser.bias(state, tok, pos)
        deltas.append(delta)
    return deltas


def ids(*pieces):
    return [TOK[p] for p in pieces]


# ---------------------------------------------------------------- parsing

def test_one_phrase_per_line():
    assert parse_keywords("Siobhan\nKrzysztof Penderecki\r\nKaliko") == [
        "Siobhan", "Krzysztof Penderecki", "Kaliko"]


def test_a_list_is_joined_with_newlines():
    assert parse_keywords(["Siobhan", "Kaliko\nIrolg"]) == ["Siobhan", "Kaliko", "Irolg"]
    assert parse_keywords(("a", "b")) == ["a", "b"]


def test_a_string_with_commas_is_one_phrase():
    assert parse_keywords("Siobhan, Krzysztof") == ["Siobhan, Krzysztof"]


def test_blank_lines_and_surrounding_whitespace_are_dropped():
    assert parse_keywords("  Siobhan  \n\n \t\n  new   york ") == ["Siobhan", "new york"]


def test_no_keywords_gives_an_empty_list():
    assert parse_keywords(None) == []
    assert parse_keywords("") == []
    assert parse_keywords([]) == []


def test_keywords_of_the_wrong_type_are_rejected():
    with pytest.raises(TypeError, match="one phrase per line"):
        parse_keywords(42)
    with pytest.raises(TypeError, match="list of strings"):
        parse_keywords(["ok", 3])


def test_three_spellings_as_given_lower_and_title_case():
    assert spellings("new YORK") == ["new YORK", "new york", "New York"]
    assert spellings("kaliko") == ["kaliko", "Kaliko"]
    assert spellings("o'neil") == ["o'neil", "O'neil"]


# ---------------------------------------------------------------- building

def test_with_and_without_space_tokenisations_without_a_dummy_prefix():
    b = KeywordBiaser.build(["Kaliko"], TOK, SPECIAL_IDS)
    assert tuple(ids(SP + "Ka", "li", "ko")) in b.anywhere
    assert tuple(ids("Ka", "li", "ko")) in b.first_only
    assert tuple(ids(SP + "ka", "li", "ko")) in b.anywhere  # lower case spelling
    assert tuple(ids("Ka", "li", "ko")) not in b.anywhere


def test_with_a_dummy_prefix_both_tokenisations_are_the_spaced_one():
    tok = PieceTokenizer(PIECES, add_dummy_prefix=True)
    b = KeywordBiaser.build(["Kaliko"], tok, SPECIAL_IDS)
    assert tuple(ids(SP + "Ka", "li", "ko")) in b.anywhere
    assert b.first_only == []
    assert all(seq[0] != TOK[SP] for seq in b.anywhere), "no stray lone '▁' piece"


def test_spellings_with_a_special_token_are_dropped():
    b = KeywordBiaser.build(["café"], TOK, SPECIAL_IDS)  # é has no piece: <unk>
    assert len(b) == 0 and not b
    b = KeywordBiaser.build(["<kw>cat", "cat"], TOK, SPECIAL_IDS)
    assert all(TOK["<kw>"] not in seq for seq in b.anywhere + b.first_only)
    assert tuple(ids(SP + "cat")) in b.anywhere


def test_phrases_must_be_strings():
    with pytest.raises(TypeError, match="strings"):
        KeywordBiaser.build([b"bytes"], TOK, SPECIAL_IDS)


# ---------------------------------------------------------------- the bias

def test_each_matched_token_earns_the_bonus_and_a_completed_phrase_ends_2n_ahead():
    b = KeywordBiaser([ids(SP + "Ka", "li", "ko")])
    deltas = feed(b, ids(SP + "we", SP + "Ka", "li", "ko", SP + "is"))
    assert deltas == [0.0, BONUS, BONUS, BONUS, 0.0]
    assert sum(deltas) == 2.0 * 3


def test_a_broken_match_pays_the_bonus_back():
    b = KeywordBiaser([ids(SP + "Ka", "li", "ko")])
    deltas = feed(b, ids(SP + "Ka", "li", SP + "cat"))
    assert deltas == [BONUS, BONUS, -2 * BONUS]
    assert sum(deltas) == 0.0


def test_a_match_restarts_after_a_broken_one():
    b = KeywordBiaser([ids(SP + "new", SP + "york")])
    deltas = feed(b, ids(SP + "new", SP + "big", SP + "new", SP + "york"))
    assert deltas == [BONUS, -BONUS, BONUS, BONUS]
    assert sum(deltas) == 2 * 2


def test_a_phrase_that_is_a_prefix_of_another_keeps_its_bonus_when_the_longer_one_stops():
    b = KeywordBiaser([ids(SP + "new", SP + "york"), ids(SP + "new", SP + "york", SP + "city")])
    assert sum(feed(b, ids(SP + "new", SP + "york", SP + "city"))) == 2 * 3
    assert sum(feed(b, ids(SP + "new", SP + "york", SP + "is"))) == 2 * 2


def test_a_broken_match_that_is_the_prefix_of_another_phrase_carries_its_bonus():
    # "the big cat" breaks at "is", but "big is" is a phrase: "big" keeps its bonus, "the" pays back
    b = KeywordBiaser([ids(SP + "the", SP + "big", SP + "cat"), ids(SP + "big", SP + "is")])
    deltas = feed(b, ids(SP + "the", SP + "big", SP + "is"))
    assert deltas == [BONUS, BONUS, 0.0]  # -BONUS for "the", +BONUS for "is"
    assert sum(deltas) == 2 * 2  # exactly the completed "big is"


def test_overlapping_phrases_each_complete_and_no_token_earns_twice():
    b = KeywordBiaser([ids(SP + "the", SP + "big", SP + "cat"), ids(SP + "big", SP + "cat", SP + "is")])
    deltas = feed(b, ids(SP + "the", SP + "big", SP + "cat", SP + "is", SP + "we"))
    assert deltas == [BONUS, BONUS, BONUS, BONUS, 0.0]


def test_a_phrase_inside_a_longer_match_completes_through_its_output_link():
    b = KeywordBiaser([ids(SP + "the", SP + "big", SP + "cat", SP + "is"), ids(SP + "big", SP + "cat")])
    deltas = feed(b, ids(SP + "the", SP + "big", SP + "cat", SP + "we"))
    assert deltas[-1] == 0.0  # "big cat" completed at "cat": nothing to pay back


def test_first_word_spellings_only_match_at_the_first_token():
    b = KeywordBiaser.build(["Kaliko"], TOK, SPECIAL_IDS)
    assert sum(feed(b, ids("Ka", "li", "ko"))) == 2 * 3
    later = feed(b, ids(SP + "we", "Ka", "li", "ko"))
    assert later == [0.0, 0.0, 0.0, 0.0]
    assert sum(feed(b, ids(SP + "we", SP + "Ka", "li", "ko"))) == 2 * 3


def test_bias_candidates_matches_bias_per_token():
    b = KeywordBiaser([ids(SP + "new", SP + "york"), ids(SP + "new", SP + "york", SP + "city")])
    _, state = b.bias(b.initial, TOK[SP + "new"], 0)
    cands = np.array(ids(SP + "york", SP + "city", SP + "is", SP + "new"), dtype=np.int64)
    deltas, states = b.bias_candidates(state, cands, 1)
    for tok, d, s in zip(cands, deltas, states):
        assert (d, s) == b.bias(state, int(tok), 1)
    assert list(deltas) == [BONUS, -BONUS, -BONUS, 0.0]


# ---------------------------------------------------------------- inside the search

TAGS = 2
VOCAB = len(PIECES) + TAGS


class TableDecoder:
    """Logits from a prefix table (token -> logit, everything else -30), tracking rows by parents.
    Unlisted prefixes are flat, so junk beams neither win nor finish early."""

    def __init__(self, table):
        self.table, self.rows = table, [()]

    def logits(self, prefix):
        x = np.full(VOCAB, -30.0, dtype=np.float32)
        for tok, val in self.table.get(prefix, {}).items():
            x[tok] = val
        return x

    def advance(self, parents, tokens):
        self.rows = [self.rows[p] + (int(t),) for p, t in zip(parents, tokens)]
        return np.stack([self.logits(r) for r in self.rows])


def search(table, biaser):
    dec = TableDecoder(table)
    return beam_search(dec.logits(()), dec.advance, first_tag=len(PIECES), eos=EOS, max_len=40,
                       biaser=biaser)


KA, LI, KO, CALICO = TOK["Ka"], TOK["li"], TOK["ko"], TOK[SP + "calico"]
HEARD_AS_CALICO = {
    (): {CALICO: 2.0, KA: 0.0},
    (KA,): {LI: 3.0}, (KA, LI): {KO: 3.0, EOS: 2.0}, (KA, LI, KO): {EOS: 3.0},
    (CALICO,): {EOS: 3.0},
}


def test_the_bias_changes_which_beam_wins():
    plain = search(HEARD_AS_CALICO, None)
    biased = search(HEARD_AS_CALICO, KeywordBiaser.build(["Kaliko"], TOK, SPECIAL_IDS))
    assert plain.tokens == [CALICO]
    assert biased.tokens == [KA, LI, KO]


def test_the_winning_score_carries_plus_two_per_matched_token():
    biased = search(HEARD_AS_CALICO, KeywordBiaser.build(["Kaliko"], TOK, SPECIAL_IDS))
    dec = TableDecoder(HEARD_AS_CALICO)
    x = dec.logits((KA, LI, KO))[: len(PIECES)].astype(np.float64)
    eos_lp = x[EOS] - np.log(np.exp(x).sum())
    want = (sum(biased.token_logprobs) + eos_lp + 2.0 * 3) / 4
    assert biased.score == pytest.approx(want, abs=1e-6)


def test_an_abandoned_match_is_worth_nothing_in_the_final_score():
    table = {(): {KA: 1.0, CALICO: 0.0}, (KA,): {LI: 3.0}, (KA, LI): {EOS: 3.0}, (CALICO,): {EOS: -5.0}}
    biased = search(table, KeywordBiaser.build(["Kaliko"], TOK, SPECIAL_IDS))
    plain = search(table, None)
    assert biased.tokens == plain.tokens == [KA, LI]
    assert biased.score == pytest.approx(plain.score, abs=1e-6)


# ---------------------------------------------------------------- a real sentencepiece model

def _train_sentencepiece(add_dummy_prefix):
    spm = pytest.importorskip("sentencepiece")
    corpus = ["we met the calico cat in new york city", "the big city is new", "kaliko is a name",
              "new york is big and the cat is calico", "we met kaliko in the city"] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=60, model_type="bpe",
        character_coverage=1.0, add_dummy_prefix=add_dummy_prefix, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.mark.parametrize("add_dummy_prefix", [True, False])
def test_a_real_sentencepiece_transcript_earns_the_full_bonus(add_dummy_prefix):
    sp = _train_sentencepiece(add_dummy_prefix)
    special = [i for i in (sp.unk_id(), sp.bos_id(), sp.eos_id()) if i >= 0]
    b = KeywordBiaser.build(["Kaliko"], sp, special)
    transcript = sp.encode("we met kaliko in the city")
    phrase = sp.encode("we met kaliko")[len(sp.encode("we met")):]  # "kaliko" as it appears in text
    assert transcript[: len(sp.encode("we met")) + len(phrase)] == sp.encode("we met kaliko")
    assert sum(feed(b, transcript)) == pytest.approx(2.0 * len(phrase))
    first = sp.encode("kaliko in the city")  # as the transcript's first word
    assert sum(feed(b, first)) == pytest.approx(2.0 * len(sp.encode("kaliko")))


def test_title_case_with_an_unknown_piece_is_dropped_on_a_real_sentencepiece_model():
    sp = _train_sentencepiece(True)
    b = KeywordBiaser.build(["Kaliko"], sp, [sp.unk_id()])  # "K" is not in the tiny corpus
    assert all(sp.unk_id() not in seq for seq in b.anywhere + b.first_only)
    assert tuple(sp.encode("kaliko")) in b.anywhere


def test_a_single_biased_beam_takes_the_best_biased_candidate():
    dec = TableDecoder({**HEARD_AS_CALICO, (): {CALICO: 2.0, KA: 0.5}})
    got = beam_search(dec.logits(()), dec.advance, first_tag=len(PIECES), eos=EOS, max_len=40, beams=1,
                      biaser=KeywordBiaser.build(["Kaliko"], TOK, SPECIAL_IDS))
    assert got.tokens == [KA, LI, KO]


def _project_tokenizer(sp, languages=("en", "de")):
    """The engine's own Tokenizer over a trained sentencepiece vocabulary plus language tags."""
    from whistle_stream.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Tokenizer

    n = sp.get_piece_size()
    types = [UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i) else NORMAL
             for i in range(n)]
    pieces = [sp.id_to_piece(i) for i in range(n)] + [f"<|{c}|>" for c in languages]
    return Tokenizer(pieces, [sp.get_score(i) for i in range(n)] + [0.0] * len(languages),
                     types + [USER_DEFINED] * len(languages), pad=max(sp.pad_id(), 0), eos=sp.eos_id(),
                     bos=sp.bos_id(), unk=sp.unk_id(), add_dummy_prefix=True, byte_fallback=False)


def test_the_engine_tokenizer_with_a_dummy_prefix_matches_inside_and_first():
    tok = _project_tokenizer(_train_sentencepiece(True))
    assert tok.encode(" kaliko")[0] != tok.encode("kaliko")[0]  # "▁" + "▁kaliko": not the in-text form
    special = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    b = KeywordBiaser.build(["Kaliko"], tok, special)
    assert b.anywhere == [tuple(tok.encode("kaliko"))] and b.first_only == []
    n = len(tok.encode("kaliko"))
    assert sum(feed(b, tok.encode("we met kaliko in the city"))) == pytest.approx(2.0 * n)
    assert sum(feed(b, tok.encode("kaliko in the city"))) == pytest.approx(2.0 * n)
