"""The Sans-I/O protocol: golden wire messages, decoders, query parsing, the session state machine."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from whistle_stream.results import stream_update
from whistle_stream.service import protocol as P
from whistle_stream.service.protocol import ErrorCode as E

LANGS = ("en", "de", "fr")


# -- golden messages (exact JSON) ------------------------------------------------------------------

GOLDEN = [
    (P.Ready(session_id="abc", model="whistle-demo", languages=("en", "de"), language=None,
             sample_rate=48000, encoding="pcm_s16le", vad=True, keywords=("Kaliko",)),
     '{"type":"ready","session_id":"abc","model":"whistle-demo","languages":["en","de"],'
     '"language":null,"sample_rate":48000,"encoding":"pcm_s16le","vad":true,"keywords":["Kaliko"],'
     '"protocol":2,"resumed":false,"seq":0,"replay_from":0.0,"model_note":null}'),
    (P.Ready(session_id="abc", model="whistle-demo", languages=("en",), language="en", sample_rate=16000,
             encoding="pcm_s16le", vad=True, resumed=True, seq=7, replay_from=12.34),
     '{"type":"ready","session_id":"abc","model":"whistle-demo","languages":["en"],"language":"en",'
     '"sample_rate":16000,"encoding":"pcm_s16le","vad":true,"keywords":[],"protocol":2,"resumed":true,'
     '"seq":7,"replay_from":12.34,"model_note":null}'),
    (P.Partial(pending=" the cat", language="en", revision=3),
     '{"type":"partial","pending":" the cat","language":"en","revision":3}'),
    (P.Committed(seq=2, text=" Hello world", words=(P.Word(" Hello", 0.24, 0.56, 0.91234),
                                                      P.Word(" world", 0.56, 1.04, 0.8)),
                 end_of_speech=True),
     '{"type":"committed","seq":2,"text":" Hello world","words":['
     '{"word":" Hello","start":0.24,"end":0.56,"probability":0.9123},'
     '{"word":" world","start":0.56,"end":1.04,"probability":0.8}],"end_of_speech":true,"resume":null,'
     '"replay_from":null}'),
    (P.Committed(seq=3, text=" Hi.", words=(P.Word("Hi.", 1.2, 1.5, 0.9),), resume="eJx.abc", replay_from=1.1),
     '{"type":"committed","seq":3,"text":" Hi.","words":[{"word":"Hi.","start":1.2,"end":1.5,"probability":0.9}],'
     '"end_of_speech":false,"resume":"eJx.abc","replay_from":1.1}'),
    (P.Final(seq=2, text=" Hello world", language="en", audio_seconds=3.2, passes=3,
             mean_pass_ms=41.26666, reason="close"),
     '{"type":"final","seq":2,"text":" Hello world","language":"en","audio_seconds":3.2,'
     '"passes":3,"mean_pass_ms":41.267,"reason":"close","resume":null,"replay_from":null}'),
    (P.Error(E.BAD_AUDIO, "3 bytes is not a whole number of pcm_s16le samples (2 bytes each)"),
     '{"type":"error","code":"bad_audio","message":"3 bytes is not a whole number of pcm_s16le '
     'samples (2 bytes each)"}'),
    (P.Committed(seq=1, text="", words=(), end_of_speech=True),
     '{"type":"committed","seq":1,"text":"","words":[],"end_of_speech":true,"resume":null,"replay_from":null}'),
    (P.Partial(pending="grüß dich", language="de", revision=1),
     '{"type":"partial","pending":"grüß dich","language":"de","revision":1}'),
]


@pytest.mark.parametrize("message, wire", GOLDEN, ids=[type(m).__name__ for m, _ in GOLDEN])
def test_server_messages_encode_to_golden_json(message, wire):
    assert P.encode(message) == wire


@pytest.mark.parametrize("message, wire", GOLDEN, ids=[type(m).__name__ for m, _ in GOLDEN])
def test_server_messages_decode_back_to_the_same_wire_text(message, wire):
    assert P.encode(P.decode_server(wire)) == wire


def test_decode_server_rejects_text_that_is_not_a_server_message():
    for text in ("", "{}", '{"type":"ready"}', '{"type":"nope"}', "[1]", '{"type":"error","code":"x","message":""}'):
        with pytest.raises(ValueError):
            P.decode_server(text)


# -- control messages --------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ('{"type":"finalize"}', P.Finalize()),
    ('{"type":"close"}', P.Close()),
    (' {"type": "keepalive", "extra": 1} ', P.KeepAlive()),
    ('{"type":"configure","keywords":["Kaliko"," Irolg "]}', P.Configure(("Kaliko", "Irolg"))),
    ('{"type":"configure","keywords":[]}', P.Configure(())),
])
def test_control_messages_decode_to_typed_messages(text, expected):
    assert P.decode_text(text) == expected


@pytest.mark.parametrize("text, code", [
    ('{"type":"finalize"', E.MALFORMED_JSON),
    ("[1, 2", E.MALFORMED_JSON),
    ("hello there", E.EXPECTED_BINARY),
    ("\x00\x01\x02", E.EXPECTED_BINARY),
    ("", E.EXPECTED_BINARY),
    ('"finalize"', E.BAD_MESSAGE),
    ("[1, 2]", E.BAD_MESSAGE),
    ("42", E.BAD_MESSAGE),
    ('{"kind":"close"}', E.BAD_MESSAGE),
    ('{"type":7}', E.BAD_MESSAGE),
    ('{"type":"configure"}', E.BAD_MESSAGE),
    ('{"type":"configure","keywords":"Kaliko"}', E.BAD_MESSAGE),
    ('{"type":"configure","keywords":[1]}', E.BAD_MESSAGE),
    ('{"type":"configure","keywords":["two\\nlines"]}', E.BAD_MESSAGE),
    ('{"type":"configure","keywords":[""]}', E.BAD_MESSAGE),
    ('{"type":"audio","data":"AAAA"}', E.UNKNOWN_TYPE),
    ('{"type":"Close"}', E.UNKNOWN_TYPE),
    ('{"type":"finalize","pad":"' + "x" * P.MAX_TEXT_FRAME_CHARS + '"}', E.TOO_LARGE),
    ("[" * 100000, E.TOO_LARGE),
])
def test_bad_control_messages_raise_their_documented_code(text, code):
    with pytest.raises(P.ProtocolError) as info:
        P.decode_text(text)
    assert info.value.code is code
    assert info.value.message


def test_deeply_nested_json_is_rejected_as_malformed_not_a_crash():
    with pytest.raises(P.ProtocolError) as info:
        P.decode_text("[" * 5000 + "]" * 5000)
    assert info.value.code in (E.MALFORMED_JSON, E.BAD_MESSAGE)


# -- audio -------------------------------------------------------------------------------------

def test_s16le_audio_decodes_to_float32_in_unit_range():
    pcm = np.array([0, 16384, -32768, 32767], "<i2").tobytes()
    out = P.decode_audio(pcm, "pcm_s16le")
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.0, 0.5, -1.0, 32767 / 32768])


def test_f32le_audio_decodes_unchanged():
    samples = np.array([0.25, -0.5, 1.0], "<f4")
    np.testing.assert_array_equal(P.decode_audio(samples.tobytes(), "pcm_f32le"), samples)


@pytest.mark.parametrize("data, encoding, code", [
    (b"\x00\x01\x02", "pcm_s16le", E.BAD_AUDIO),
    (b"\x00" * 6, "pcm_f32le", E.BAD_AUDIO),
    (np.array([0.1, np.nan], "<f4").tobytes(), "pcm_f32le", E.BAD_AUDIO),
    (np.array([np.inf, 0.0], "<f4").tobytes(), "pcm_f32le", E.BAD_AUDIO),
    (np.array([-np.inf], "<f4").tobytes(), "pcm_f32le", E.BAD_AUDIO),
    (b"\x00\x00", "mp3", E.UNSUPPORTED_ENCODING),
])
def test_bad_audio_raises_its_documented_code(data, encoding, code):
    with pytest.raises(P.ProtocolError) as info:
        P.decode_audio(data, encoding)
    assert info.value.code is code


def test_an_empty_audio_frame_is_zero_samples():
    assert P.decode_audio(b"", "pcm_s16le").shape == (0,)


# -- query parameters --------------------------------------------------------------------------

def test_query_defaults():
    assert P.parse_query("", LANGS) == P.SessionConfig()


def test_query_accepts_every_parameter_and_repeated_keywords():
    c = P.parse_query("sample_rate=44100&encoding=pcm_f32le&language=de&keyword=Kaliko&keyword=Irolg"
                      "&token=s3cret&vad=false", LANGS)
    assert c == P.SessionConfig(sample_rate=44100, encoding="pcm_f32le", language="de",
                                keywords=("Kaliko", "Irolg"), token="s3cret", vad=False)


def test_query_accepts_a_mapping_of_lists_and_auto_language():
    c = P.parse_query({"sample_rate": ["8000"], "language": "auto", "keyword": ["a b"]}, LANGS)
    assert (c.sample_rate, c.language, c.keywords) == (8000, None, ("a b",))


@pytest.mark.parametrize("query, code", [
    ("sample_rate=7999", E.BAD_REQUEST),
    ("sample_rate=48001", E.BAD_REQUEST),
    ("sample_rate=16k", E.BAD_REQUEST),
    ("sample_rate=-16000", E.BAD_REQUEST),
    ("sample_rate=16000%C2%B2", E.BAD_REQUEST),  # "16000²": str.isdigit() is True, int() refuses it
    ("sample_rate=", E.BAD_REQUEST),
    ("sample_rate=16000&sample_rate=8000", E.BAD_REQUEST),
    ("encoding=opus", E.UNSUPPORTED_ENCODING),
    ("encoding=PCM_S16LE", E.UNSUPPORTED_ENCODING),
    ("language=xx", E.BAD_REQUEST),
    ("vad=maybe", E.BAD_REQUEST),
    ("langauge=en", E.BAD_REQUEST),
    ("keyword=", E.BAD_REQUEST),
    ("keyword=" + "k" * (P.MAX_KEYWORD_CHARS + 1), E.BAD_REQUEST),
    ("&".join(["keyword=k"] * (P.MAX_KEYWORDS + 1)), E.BAD_REQUEST),
])
def test_bad_query_parameters_raise_their_documented_code(query, code):
    with pytest.raises(P.ProtocolError) as info:
        P.parse_query(query, LANGS)
    assert info.value.code is code
    assert info.value.fatal and info.value.close_code == P.CloseCode.POLICY


def test_an_unknown_parameter_error_names_the_accepted_ones():
    with pytest.raises(P.ProtocolError, match="accepted: sample_rate, encoding, language"):
        P.parse_query("langauge=en", LANGS)


# -- error table -------------------------------------------------------------------------------

def test_every_error_code_is_documented_in_protocol_md():
    from pathlib import Path
    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    for code in E:
        assert f"`{code.value}`" in doc, code
    for value in (1000, 1001, 1008, 1009, 1011, 1013, 4401):
        assert f"`{value}`" in doc, value


def test_frame_level_errors_are_not_fatal_and_limits_are():
    for code in (E.BAD_AUDIO, E.MALFORMED_JSON, E.UNKNOWN_TYPE, E.BAD_MESSAGE, E.EXPECTED_BINARY):
        assert not P.ProtocolError(code, "x").fatal
    assert P.ProtocolError(E.SERVER_FULL, "x").close_code == 1013
    assert P.ProtocolError(E.UNAUTHORIZED, "x").close_code == 4401
    assert P.ProtocolError(E.SHUTTING_DOWN, "x").close_code == 1001


# -- the session state machine -----------------------------------------------------------------

def engine(text="", words=(), pending="", language="en", revision=1, pass_ms=10.0):
    return stream_update(text=text, words=[dict(word=w, start=0.1 * i, end=0.1 * i + 0.1, probability=0.9)
                                           for i, w in enumerate(words)],
                         pending=pending, language=language, received=1.0, pass_ms=pass_ms, revision=revision)


def open_session():
    s = P.Session("sid", P.SessionConfig(), "m", LANGS)
    s.ready()
    return s


def test_a_message_before_ready_is_not_ready():
    s = P.Session("sid", P.SessionConfig(), "m", LANGS)
    with pytest.raises(P.ProtocolError) as info:
        s.check(P.Audio(b"\0\0"))
    assert info.value.code is E.NOT_READY


def test_a_message_after_close_is_session_closed():
    s = open_session()
    s.check(P.Close())
    with pytest.raises(P.ProtocolError) as info:
        s.check(P.Audio(b"\0\0"))
    assert info.value.code is E.SESSION_CLOSED


def test_audio_seconds_count_the_client_samples():
    s = P.Session("sid", P.SessionConfig(sample_rate=8000), "m", LANGS)
    s.ready()
    s.check(P.Audio(b"\0" * 16000))
    assert s.audio_seconds == pytest.approx(1.0)


def test_committed_seq_counts_up_by_one_and_partials_only_on_change():
    s = open_session()
    out = s.results(engine(pending=" a b", revision=1))
    assert out == [P.Partial(" a b", "en", 1)]
    assert s.results(engine(pending=" a b", revision=1, pass_ms=0)) == []
    out = s.results(engine(text=" a", words=[" a"], pending=" b c", revision=2))
    assert [type(m) for m in out] == [P.Committed, P.Partial]
    assert out[0].seq == 1
    out = s.results(engine(text=" b", words=[" b"], pending=" c", revision=3))
    assert out[0].seq == 2


def test_end_of_speech_is_committed_even_without_new_text():
    s = open_session()
    out = s.results(engine(pending="", language="", revision=0), end_of_speech=True)
    assert out == [P.Committed(seq=1, text="", words=(), end_of_speech=True)]


def test_final_sums_up_the_transcript_and_pass_statistics():
    s = open_session()
    s.results(engine(text=" a", words=[" a"], pending=" b", revision=2, pass_ms=30.0), passes=2)
    out = s.final(engine(text=" b", words=[" b"], pending="", revision=3, pass_ms=15.0), "close", passes=1)
    assert [type(m) for m in out] == [P.Committed, P.Partial, P.Final]
    final = out[-1]
    assert (final.seq, final.text, final.passes, final.mean_pass_ms, final.reason) == (2, " a b", 3, 15.0, "close")
    assert s.state is P.SessionState.CLOSED


def test_finalize_keeps_the_session_open():
    s = open_session()
    s.final(engine(text=" a", words=[" a"]), "finalize")
    assert s.state is P.SessionState.OPEN
    s.check(P.Audio(b"\0\0"))


# -- fuzz: the decoders only ever raise ProtocolError --------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_decode_text_raises_only_protocol_errors(text):
    try:
        assert isinstance(P.decode_text(text), (P.Finalize, P.Close, P.KeepAlive, P.Configure))
    except P.ProtocolError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "keywords", "x"]),
                       st.sampled_from(["finalize", "close", "keepalive", "configure", "audio"]) | json_values,
                       max_size=3))
def test_fuzz_decode_text_on_json_objects_raises_only_protocol_errors(obj):
    try:
        P.decode_text(json.dumps(obj))
    except P.ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.sampled_from(["pcm_s16le", "pcm_f32le", "x"]))
def test_fuzz_decode_audio_raises_only_protocol_errors(data, encoding):
    try:
        out = P.decode_audio(data, encoding)
        assert out.dtype == np.float32 and np.isfinite(out).all()
    except P.ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["sample_rate", "encoding", "language", "keyword", "token",
                                            "vad", "zzz"]), st.text(max_size=12)), max_size=6))
def test_fuzz_parse_query_raises_only_protocol_errors(pairs):
    try:
        c = P.parse_query(pairs, LANGS)
        assert P.MIN_SAMPLE_RATE <= c.sample_rate <= P.MAX_SAMPLE_RATE
    except P.ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_fuzz_parse_raw_query_strings_raises_only_protocol_errors(query):
    try:
        P.parse_query(query, LANGS)
    except P.ProtocolError:
        pass


def test_without_a_pass_count_each_call_that_spent_time_in_passes_counts_one():
    s = open_session()
    s.results(engine(pending=" a", pass_ms=20.0))
    s.results(engine(pending=" a", pass_ms=0.0))
    final = s.final(engine(pass_ms=10.0), "close")[-1]
    assert (final.passes, final.mean_pass_ms) == (2, 15.0)


def test_committed_texts_concatenate_with_spaces_for_an_engine_that_joins_words_with_spaces():
    s = open_session()
    first = s.results(engine(text="hello world", words=["hello", "world"], pending="how are"))
    second = s.results(engine(text="how are", words=["how", "are"], pending="you"))
    assert [m.text for m in first + second if isinstance(m, P.Committed)] == ["hello world", " how are"]
    assert [m.pending for m in second if isinstance(m, P.Partial)] == [" you"]
    assert s.final(engine(text="you", words=["you"]), "close")[-1].text == "hello world how are you"


def test_committed_texts_that_bring_their_own_spaces_are_left_alone():
    s = open_session()
    s.results(engine(text=" hello", words=[" hello"], pending=" world"))
    out = s.results(engine(text=" world", words=[" world"]))
    assert out[0].text == " world" and "".join(s.transcript) == " hello world"
