"""Tokenizer parity with `sentencepiece` on models trained here, round trips, and bad blobs.

Two normalisation regimes (the blob carries no normaliser, so `Tokenizer.encode` sees text as given):
- a model trained with `normalization_rule_name="identity"`, `remove_extra_whitespaces=False`:
  ids equal sentencepiece's on any text, and decode(encode(s)) == s exactly;
- a model with sentencepiece's default `nmt_nfkc` rule (whitespace collapsing, NFKC): ids equal
  sentencepiece's on text that is already normal (checked: `sp.normalize` leaves it unchanged).
"""

import io
import struct
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

spm = pytest.importorskip("sentencepiece")
from sentencepiece import sentencepiece_model_pb2  # noqa: E402

from whistle_stream.errors import ModelFormatError  # noqa: E402
from whistle_stream.tokenizer import BYTE, CONTROL, SPACE, Tokenizer  # noqa: E402

export = pytest.importorskip("needle.model.export")

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Set a timer for twelve minutes, please.",
    "Call mom at 5:30 p.m. and remind me about the 3rd meeting.",
    "What's the weather like in Berlin tomorrow? 21 degrees!",
    "Turn the lights off in the living room; it's 10:45.",
    "Zażółć gęślą jaźń. Pchnąć w tę łódź jeża lub ośm skrzyń fig.",
    "Grüße aus München! Der Straßenverkehr über die Brücke ist schön.",
    "Café, naïve, résumé, façade, déjà vu, crème brûlée.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9, 100, 2024, 3.14159, -42, 1,000,000.",
    "Punctuation (brackets) [square] {curly} \"quotes\" 'single' - dash / slash & ampersand @ # % * +",
    "hello world hello there hello again world of words",
]
LANGUAGES = ("en", "de", "pl")

CORPUS = [
    "",
    "hello",
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Timer 12:30, room 4B; call +48 123 456 789!",
    "3.14159 and 2,718 and -42",
    "(brackets) [square] {curly} \"quotes\" 'single'?!",
    "Café naïve résumé façade déjà",
    "Zażółć gęślą jaźń",
    "Pchnąć w tę łódź jeża lub ośm skrzyń fig",
    "Grüße aus München, Straße über Äpfel und Öl",
    "ŻÓŁW źdźbło ĄĘ",
    "emoji 🎉 party 🚀🚀 done",
    "🙂",
    "日本語のテキスト",
    "Ωμέγα и кириллица",
    " leading space",
    "trailing space ",
    "  two leading",
    "two trailing  ",
    "multiple   inner    spaces",
    " ",
    "     ",
    "tab\there and\nnewline",
    "helloworldhelloworldhello",
    "aaaaaaaaaaaaaaaa",
    "xyzzy qwrtp",
]
# Already normal for nmt_nfkc: NFKC, no leading/trailing/double spaces, no tabs or newlines.
NORMAL_CORPUS = [s for s in CORPUS if s and s == " ".join(s.split()) and s == unicodedata.normalize("NFKC", s)]


def train(**options) -> bytes:
    model = io.BytesIO()
    settings = dict(model_type="bpe", vocab_size=480, byte_fallback=True, pad_id=0, eos_id=1, bos_id=2,
                    unk_id=3, hard_vocab_limit=False, character_coverage=1.0, minloglevel=2, num_threads=1)
    settings.update(options)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TRAINING_TEXT * 20), model_writer=model, **settings)
    return model.getvalue()


def build(model: bytes, languages=LANGUAGES):
    """(sentencepiece processor, our Tokenizer, blob) for one trained model."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    blob = export.whistle_tokenizer_blob(proto, list(languages))
    return spm.SentencePieceProcessor(model_proto=model), Tokenizer.from_blob(blob), blob


IDENTITY = dict(normalization_rule_name="identity", remove_extra_whitespaces=False)


@pytest.fixture(scope="module")
def identity():
    return build(train(**IDENTITY))


@pytest.fixture(scope="module")
def nfkc():
    return build(train())


@pytest.fixture(scope="module")
def markers():
    return build(train(user_defined_symbols=["<|im_start|>", "<|im_end|>", "<x>", "<xy>"], **IDENTITY))


# ---------------------------------------------------------------------------------------------
# parity with sentencepiece

@pytest.mark.parametrize("text", CORPUS)
def test_ids_equal_sentencepiece_on_identity_model(identity, text):
    sp, tok, _ = identity
    assert tok.encode(text) == sp.encode(text)


@pytest.mark.parametrize("text", NORMAL_CORPUS)
def test_ids_equal_sentencepiece_on_default_nfkc_model_for_normal_text(nfkc, text):
    sp, tok, _ = nfkc
    assert sp.normalize(text) == SPACE + text.replace(" ", SPACE)  # the premise: text is already normal
    assert tok.encode(text) == sp.encode(text)


def test_corpus_exercises_byte_fallback_and_merges(identity):
    sp, tok, _ = identity
    ids = [i for text in CORPUS for i in tok.encode(text)]
    assert any(tok.is_byte(i) for i in ids)
    assert any(len(tok.piece(i)) > 2 and not tok.is_byte(i) for i in ids)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_encode_round_trips_exactly(identity, text):
    _, tok, _ = identity
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", CORPUS)
def test_decode_equals_sentencepiece_decode(identity, text):
    sp, tok, _ = identity
    ids = sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids)


@pytest.mark.parametrize("text", ["<|im_start|>hi there<|im_end|>", "a<xy>b<x>c<xyz", " <x> <|im_end|>", "<|im_start"])
def test_user_defined_pieces_match_longest_first_like_sentencepiece(markers, text):
    sp, tok, _ = markers
    assert tok.encode(text) == sp.encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_without_dummy_prefix_ids_equal_sentencepiece():
    sp, tok, _ = build(train(add_dummy_prefix=False, **IDENTITY))
    assert not tok.add_dummy_prefix
    for text in CORPUS:
        assert tok.encode(text) == sp.encode(text), text
        assert tok.decode(tok.encode(text)) == text


def test_without_byte_fallback_a_run_of_unknowns_is_one_unk_like_sentencepiece():
    sp, tok, _ = build(train(byte_fallback=False, **IDENTITY))
    assert not tok.byte_fallback
    for text in ["emoji 🎉🚀 x", "日本語", "a🙂b🙂🙂c"]:
        assert tok.encode(text) == sp.encode(text), text
    assert tok.encode("🎉🚀").count(tok.unk) == 1


ALPHABET = st.sampled_from(list("abcdehlortw ,.!?0123479ąęłóśżźüßöäé") + ["🎉", "日", "\t"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(ALPHABET, max_size=40) | st.lists(st.sampled_from(TRAINING_TEXT)).map(" ".join))
def test_property_ids_equal_sentencepiece_and_round_trip(identity, text):
    sp, tok, _ = identity
    ids = tok.encode(text)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == text


def naive_bpe(tok, symbols):
    """Obviously-correct O(n^2) twin: merge the leftmost highest-scoring adjacent pair."""
    symbols = list(symbols)
    while True:
        best = None
        for j in range(len(symbols) - 1):
            token = tok.piece_to_id(symbols[j] + symbols[j + 1])
            if token is not None and not tok.is_byte(token) and (best is None or tok.score(token) > best[0]):
                best = (tok.score(token), j)
        if best is None:
            return symbols
        j = best[1]
        symbols[j:j + 2] = [symbols[j] + symbols[j + 1]]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(ALPHABET, min_size=1, max_size=60))
def test_heap_merge_equals_naive_merge(identity, text):
    _, tok, _ = identity
    normalized = SPACE + text.replace(" ", SPACE)
    assert tok._bpe([(c, False) for c in normalized]) == naive_bpe(tok, normalized)


# ---------------------------------------------------------------------------------------------
# vocabulary facts

def test_header_ids_and_special_pieces(identity):
    sp, tok, _ = identity
    assert (tok.pad, tok.eos, tok.bos, tok.unk) == (0, 1, 2, 3)
    assert tok.vocab_size == sp.get_piece_size() + len(LANGUAGES)
    for i in (tok.bos, tok.eos, tok.pad, tok.unk):
        assert tok.is_special(i)
    assert not tok.is_special(sp.piece_to_id(SPACE + "hello"))
    assert all(tok.piece(i) == sp.id_to_piece(i) for i in range(sp.get_piece_size()))


def test_language_tags_are_the_trailing_user_defined_pieces(identity):
    sp, tok, _ = identity
    assert tok.languages == LANGUAGES
    assert tok.text_vocab == sp.get_piece_size()
    for k, code in enumerate(LANGUAGES):
        token = tok.language_id(code)
        assert token == tok.text_vocab + k
        assert tok.piece(token) == f"<|{code}|>"
        assert tok.is_special(token)
        ids = tok.encode(f"hi <|{code}|>")
        assert ids[-1] == token
        assert tok.decode(ids) == f"hi <|{code}|>"
    with pytest.raises(ValueError, match="en, de, pl"):
        tok.language_id("xx")


def test_no_languages_when_blob_has_no_tags():
    _, tok, _ = build(train(**IDENTITY), languages=())
    assert tok.languages == ()
    assert tok.text_vocab == tok.vocab_size


def test_starts_word_marks_pieces_after_a_space(identity):
    _, tok, _ = identity
    ids = tok.encode("hello world")
    assert tok.starts_word(ids[0])
    words = sum(tok.starts_word(i) for i in ids)
    assert words == 2
    assert not any(tok.starts_word(i) for i in range(tok.vocab_size) if tok.is_byte(i))


def test_decode_skips_control_pieces_and_rejects_out_of_range_ids(identity):
    _, tok, _ = identity
    ids = tok.encode("hello world")
    assert tok.decode([tok.bos, *ids, tok.eos]) == "hello world"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])


def test_decode_replaces_broken_utf8_bytes(identity):
    _, tok, _ = identity
    first_byte_of_emoji = tok.encode("🎉")[-4]
    assert tok.is_byte(first_byte_of_emoji)
    assert tok.decode([first_byte_of_emoji]) == "\ufffd"


def test_encode_rejects_non_text(identity):
    _, tok, _ = identity
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")


# ---------------------------------------------------------------------------------------------
# bad blobs

HEADER = struct.Struct("<IIIIIBBH")
RECORD = struct.Struct("<fBH")


def blob_of(pieces, *, n=None, pad=0, eos=1, bos=2, unk=3, dummy=1, fallback=1, tail=b""):
    """A hand-made blob: pieces is [(score, type, surface bytes)]."""
    out = bytearray(HEADER.pack(len(pieces) if n is None else n, pad, eos, bos, unk, dummy, fallback, 0))
    for score, kind, surface in pieces:
        out += RECORD.pack(score, kind, len(surface)) + surface
    return bytes(out + tail)


BASE = [(0.0, CONTROL, b"<pad>"), (0.0, CONTROL, b"</s>"), (0.0, CONTROL, b"<s>"), (0.0, 1, b"<unk>"),
        (-1.0, 0, SPACE.encode()), (-2.0, 0, b"a"), (0.0, BYTE, b"<0x41>")]


def test_hand_made_blob_parses():
    tok = Tokenizer.from_blob(blob_of(BASE))
    assert tok.vocab_size == len(BASE)
    assert tok.encode("aA") == [4, 5, 6]
    assert tok.decode([4, 5, 6]) == "aA"


@pytest.mark.parametrize("blob, message", [
    (b"", "shorter than its 24-byte header"),
    (blob_of(BASE)[:20], "shorter than its 24-byte header"),
    (blob_of(BASE, n=10 ** 9), "declares 1000000000 pieces"),
    (blob_of(BASE, n=0), "0 pieces"),
    (blob_of(BASE, n=len(BASE) + 1), "truncated at piece 7"),
    (blob_of(BASE, tail=b"\x00\x00"), "2 bytes after its last piece"),
    (blob_of(BASE[:4] + [(0.0, 0, b"\xff\xfe")]), "piece 4 is not valid UTF-8"),
    (blob_of(BASE[:4] + [(0.0, 7, b"a")]), "type 7"),
    (blob_of(BASE[:4] + [(0.0, BYTE, b"<0xZZ>")]), "byte pieces look like"),
    (blob_of(BASE[:4] + [(0.0, 0, b"")]), "piece 4 is empty"),
    (blob_of(BASE, unk=99), "unk id 99"),
    (blob_of(BASE, unk=4), "not UNKNOWN"),
    (blob_of(BASE, dummy=2), "add_dummy_prefix is 2"),
])
def test_bad_blob_raises_model_format_error(blob, message):
    with pytest.raises(ModelFormatError, match=message):
        Tokenizer.from_blob(blob)


def test_surface_length_past_the_end_is_truncation():
    blob = bytearray(blob_of(BASE))
    struct.pack_into("<H", blob, len(blob) - 6 - 2, 200)  # the last piece claims 200 bytes
    with pytest.raises(ModelFormatError, match="truncated at piece 6"):
        Tokenizer.from_blob(bytes(blob))


def test_every_truncation_of_a_real_blob_is_refused(identity):
    *_, blob = identity
    for cut in range(0, len(blob), 7):
        with pytest.raises(ModelFormatError):
            Tokenizer.from_blob(blob[:cut])


def test_non_bytes_blob_is_refused():
    with pytest.raises(ModelFormatError, match="must be bytes"):
        Tokenizer.from_blob("not bytes")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_blobs_parse_or_raise_model_format_error(identity, data):
    *_, blob = identity
    blob = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    try:
        tok = Tokenizer.from_blob(bytes(blob[:cut]))
    except ModelFormatError:
        return
    assert tok.decode(tok.encode("hello world")) is not None


def test_tokenizer_read_from_a_harness_cact_equals_its_sentencepiece(tiny_model):
    """The blob as the container hands it over, against the harness's own (nmt_nfkc) tokenizer."""
    from harness.corpus import CORPUS as HARNESS_CORPUS
    from whistle_stream.container import CactFile

    with CactFile(tiny_model.path) as cact:
        tok = Tokenizer.from_blob(cact.tokenizer_blob)
    assert tok.languages == tuple(tiny_model.cfg.languages)
    lines = [line for text in HARNESS_CORPUS.values() for line in text.splitlines() if line.strip()]
    for line in lines + ["emoji 🎉 and 日本語 fall back to bytes"]:
        assert tok.encode(line) == tiny_model.sp.encode(line), line
        assert tok.decode(tok.encode(line)) == tiny_model.sp.decode(tiny_model.sp.encode(line))
