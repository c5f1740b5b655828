"""Every dialect's decoder under hypothesis: whatever a client sends, each raises only its own error
(or accepts the input), never anything else, and one session's bad input never changes another
session's state. Native (/v1/listen), Deepgram, OpenAI REST, OpenAI Realtime and Wyoming."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from whistle_stream.service import deepgram, openai_api, realtime, wyoming, wyoming_server
from whistle_stream.service import protocol as P

LANGUAGES = ("en", "de")
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# JSON values, nested, with the keys and values the dialects look for mixed in
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 40, 2 ** 40), st.floats(allow_nan=True),
                    st.text(max_size=30), st.sampled_from(["en", "xx", "pcm16", "server_vad", "semantic_vad",
                                                           "transcription", "audio/pcm", "AAAA", "%%"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=12), st.sampled_from(
        ["type", "session", "audio", "input", "format", "rate", "transcription", "language", "prompt",
         "turn_detection", "silence_duration_ms", "threshold", "keywords", "event_id", "eagerness",
         "input_audio_format", "input_audio_transcription"])), inner, max_size=5)), max_leaves=20)


def realtime_events():
    kinds = st.sampled_from(["session.update", "transcription_session.update", "input_audio_buffer.append",
                             "input_audio_buffer.commit", "input_audio_buffer.clear", "response.create", "x"])
    return st.one_of(
        st.builds(lambda k, rest: {**(rest if isinstance(rest, dict) else {}), "type": k}, kinds, json_values),
        json_values,
        st.builds(lambda k, b: {"type": k, "audio": b}, st.just("input_audio_buffer.append"),
                  st.one_of(st.text(max_size=40), st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()))))


# ---- native --------------------------------------------------------------------------------------

@FUZZ
@given(st.one_of(st.text(max_size=200), json_values.map(json.dumps)))
def test_native_control_frames_raise_only_protocol_errors(text):
    try:
        P.decode_text(text)
    except P.ProtocolError as e:
        assert e.message
    except RecursionError:
        pytest.fail("a nested frame reached the recursion limit unguarded")


QUERY_PARSERS = {"native": (P.parse_query, P.ProtocolError), "deepgram": (deepgram.parse_query, deepgram.DeepgramError),
                 "realtime": (lambda q, _: realtime.check_query(q), P.ProtocolError)}


@pytest.mark.parametrize("dialect", sorted(QUERY_PARSERS))
@FUZZ
@given(query=st.text(max_size=200))
def test_queries_raise_only_the_dialect_s_error(dialect, query):
    parse, error = QUERY_PARSERS[dialect]
    try:
        parse(query, LANGUAGES)
    except error as e:
        assert e.message


@FUZZ
@given(st.binary(max_size=64), st.sampled_from(sorted(P.ENCODINGS)))
def test_native_audio_raises_only_bad_audio(data, encoding):
    try:
        samples = P.decode_audio(data, encoding)
    except P.ProtocolError as e:
        assert e.code is P.ErrorCode.BAD_AUDIO
    else:
        assert len(samples) * P.ENCODINGS[encoding] == len(data)


# ---- Deepgram ------------------------------------------------------------------------------------

@FUZZ
@given(st.one_of(st.text(max_size=100), json_values.map(json.dumps), st.binary(max_size=20)))
def test_deepgram_frames_raise_only_protocol_errors_and_leave_other_sessions_alone(frame):
    config, options = deepgram.parse_query("encoding=linear16&sample_rate=16000")
    mine = deepgram.Dialect(options, "demo", audio_seconds=lambda: 0.0)
    other = deepgram.Dialect(options, "demo", audio_seconds=lambda: 0.0)
    before = dict(vars(other))
    try:
        mine.incoming(frame)
    except P.ProtocolError as e:
        assert e.message
    assert vars(other) == before


# ---- OpenAI REST ---------------------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=300), st.sampled_from(["multipart/form-data; boundary=XyZ", "multipart/form-data",
                                                 "application/json", "multipart/form-data; boundary=\"\""]))
def test_openai_forms_raise_only_api_errors(body, content_type):
    try:
        openai_api.parse_form(content_type, body, LANGUAGES)
    except openai_api.ApiError as e:
        assert e.status == 400


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["file", "model", "language", "prompt", "response_format",
                                           "timestamp_granularities[]", "stream", "bogus"]),
                          st.binary(max_size=30)), max_size=6))
def test_openai_forms_with_real_parts_raise_only_api_errors(parts):
    body = b"".join(b'--XyZ\r\nContent-Disposition: form-data; name="' + name.encode() + b'"'
                    + (b'; filename="a.wav"' if name == "file" else b"") + b"\r\n\r\n" + value + b"\r\n"
                    for name, value in parts) + b"--XyZ--\r\n"
    try:
        openai_api.parse_form("multipart/form-data; boundary=XyZ", body, LANGUAGES)
    except openai_api.ApiError as e:
        assert e.status == 400


# ---- OpenAI Realtime -----------------------------------------------------------------------------

@FUZZ
@given(st.lists(st.one_of(realtime_events().map(json.dumps), st.text(max_size=50), st.binary(max_size=10)),
                max_size=6))
def test_realtime_events_raise_only_protocol_errors_and_leave_other_sessions_alone(frames):
    mine = realtime.Dialect("demo", LANGUAGES, audio_seconds=lambda: 0.0)
    other = realtime.Dialect("demo", LANGUAGES, audio_seconds=lambda: 0.0)
    before = dict(vars(other))
    for frame in frames:
        try:
            result = mine.incoming(frame)
        except P.ProtocolError as e:
            assert e.message and not e.fatal        # a refused event: the session goes on
        else:
            assert isinstance(result, P.DialectInput)
            for message in result.messages:
                assert isinstance(message, (P.Audio, P.Finalize, P.Configure, P.Retune))
    assert vars(other) == before


# ---- Wyoming -------------------------------------------------------------------------------------

def read_all(data: bytes) -> list:
    """Events read from `data` until the stream ends or the framing fails."""
    async def run():
        reader = asyncio.StreamReader(limit=wyoming_server.MAX_HEADER_BYTES)
        reader.feed_data(data)
        reader.feed_eof()
        events = []
        while True:
            try:
                event = await wyoming_server.read_event(reader, 1 << 20)
            except wyoming_server.FramingError as e:
                events.append(e)
                return events
            if event is None:
                return events
            events.append(event)
    return asyncio.run(run())


def frame(header: dict, data: bytes = b"", payload: bytes = b"") -> bytes:
    return json.dumps(header).encode() + b"\n" + data + payload


@FUZZ
@given(st.one_of(
    st.binary(max_size=200),
    st.builds(lambda h: json.dumps(h).encode() + b"\n", json_values),
    st.builds(frame, st.fixed_dictionaries({"type": st.text(max_size=15)}, optional={
        "data": json_values, "data_length": st.one_of(st.integers(-5, 300), st.text(max_size=3)),
        "payload_length": st.one_of(st.integers(-5, 2 ** 31), st.none())}),
        st.binary(max_size=40), st.binary(max_size=40))))
def test_wyoming_framing_raises_only_framing_errors(data):
    for item in read_all(data):
        if isinstance(item, Exception):
            assert isinstance(item, wyoming_server.FramingError) and str(item)


@FUZZ
@given(st.dictionaries(st.sampled_from(["rate", "width", "channels", "timestamp", "x"]), scalars, max_size=4),
       st.binary(max_size=64), st.sampled_from(["audio-start", "audio-chunk", "audio-stop", "transcribe", "x"]))
def test_wyoming_events_in_a_transcription_raise_only_protocol_errors(data, payload, kind):
    from wyoming.event import Event

    fmt = wyoming.Format(16000, 2, 1)
    mine, other = wyoming.Dialect(fmt, "en"), wyoming.Dialect(fmt, "en")
    before = dict(vars(other))
    try:
        wyoming.Format.of(Event(type=kind, data=data))
    except P.ProtocolError as e:
        assert e.message
    try:
        mine.incoming(Event(type=kind, data=data, payload=payload))
    except P.ProtocolError as e:
        assert e.message
    assert vars(other) == before
