"""One boolean parser and one repeated-key policy, the same in every dialect and in the settings."""

from __future__ import annotations

import pytest

from whistle_stream.service import deepgram, openai_api, realtime
from whistle_stream.service import protocol as P
from whistle_stream.service.config import config_from_args
from whistle_stream.service.params import FALSE, TRUE, group, parse_bool

LANGS = ("en", "de")


def form(*fields: tuple[str, str]) -> tuple[str, bytes]:
    parts = [f'--XyZ\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in fields]
    parts.append('--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n--XyZ--\r\n')
    return "multipart/form-data; boundary=XyZ", "".join(parts).encode()


@pytest.mark.parametrize("raw", TRUE + tuple(s.upper() for s in TRUE))
def test_every_true_spelling_is_true(raw):
    assert parse_bool("x", raw) is True


@pytest.mark.parametrize("raw", FALSE + tuple(s.title() for s in FALSE))
def test_every_false_spelling_is_false(raw):
    assert parse_bool("x", raw) is False


def test_anything_else_is_refused_naming_the_setting_and_the_spellings():
    with pytest.raises(ValueError, match=r"vad must be true or false .*yes.*no.*got 'maybe'"):
        parse_bool("vad", "maybe")


def test_a_repeated_setting_is_refused_by_name_and_list_keys_keep_every_value():
    one, many = group([("a", "1"), ("k", "x"), ("k", "y")], repeatable=("k",))
    assert one == {"a": "1"} and many == {"k": ["x", "y"]}
    with pytest.raises(ValueError, match="parameter 'a' given more than once; only 'k' may repeat"):
        group([("a", "1"), ("a", "2")], repeatable=("k",))


# The same two rules, dialect by dialect, each in its own error type.

def test_the_native_query():
    assert P.parse_query("vad=off", LANGS).vad is False and P.parse_query("vad=YES", LANGS).vad is True
    assert P.parse_query("keyword=a&keyword=b", LANGS).keywords == ("a", "b")
    with pytest.raises(P.ProtocolError, match="'language' given more than once"):
        P.parse_query("language=en&language=de", LANGS)
    with pytest.raises(P.ProtocolError, match="vad must be true or false"):
        P.parse_query("vad=maybe", LANGS)


def test_the_deepgram_query():
    config, options = deepgram.parse_query("interim_results=yes&vad_events=0&keyterm=a&keyterm=b&tag=x&tag=y", LANGS)
    assert options.interim_results is True and options.vad_events is False and config.keywords == ("a", "b")
    assert deepgram.parse_query("endpointing=off", LANGS)[0] is not None
    for query, what in [("language=en&language=de", "'language' given more than once"),
                        ("sample_rate=16000&sample_rate=8000", "'sample_rate' given more than once"),
                        ("interim_results=sometimes", "interim_results must be true or false")]:
        with pytest.raises(deepgram.DeepgramError, match=what):
            deepgram.parse_query(query, LANGS)


def test_the_openai_form():
    content_type, body = form(("model", "whisper-1"), ("timestamp_granularities[]", "word"),
                              ("timestamp_granularities[]", "segment"), ("stream", "off"))
    request = openai_api.parse_form(content_type, body, LANGS)
    assert set(request.granularities) == {"word", "segment"}
    for fields, what in [((("model", "a"), ("model", "b")), "'model' given more than once"),
                         ((("model", "a"), ("stream", "perhaps")), "stream must be true or false")]:
        with pytest.raises(openai_api.ApiError, match=what):
            openai_api.parse_form(*form(*fields), LANGS)


def test_the_realtime_query():
    realtime.check_query("intent=transcription&model=x")
    with pytest.raises(P.ProtocolError, match="'intent' given more than once"):
        realtime.check_query("intent=transcription&intent=transcription")


def test_the_service_settings():
    import argparse

    from whistle_stream.service.config import add_serve_arguments

    parser = add_serve_arguments(argparse.ArgumentParser())
    switch = next(a for a in parser._actions if a.const == "true")   # a boolean setting: --flag[=BOOL]
    name = switch.option_strings[0]
    for raw, expected in [("on", True), ("0", False)]:
        assert getattr(config_from_args(parser.parse_args([f"{name}={raw}"])), switch.dest) is expected
    with pytest.raises(ValueError, match=rf"invalid value 'maybe' for {name} .*expected true or false"):
        config_from_args(parser.parse_args([f"{name}=maybe"]))


def test_every_dialect_reads_a_language_by_one_rule():
    """`params.model_language`: a region is dropped, auto and multi detect, and a language the model
    lacks is refused with one message naming what it knows, in every dialect's own error."""
    from whistle_stream.service.params import model_language

    assert model_language("en-US", ("en", "de")) == "en" and model_language("DE", ("en", "de")) == "de"
    assert model_language("auto", ("en",)) is None and model_language("multi", ("en",)) is None
    assert model_language(None, ("en",)) is None and model_language("", ("en",)) is None
    assert model_language("fr", ()) == "fr"                        # no list: any
    for bad in ("fr", "-", 7):
        with pytest.raises(ValueError, match="this model knows en, de"):
            model_language(bad, ("en", "de"))
    refusals = [
        (lambda: P.parse_query("language=fr", ("en",)), P.ProtocolError),
        (lambda: deepgram.parse_query("encoding=linear16&sample_rate=16000&language=fr-FR", ("en",)),
         deepgram.DeepgramError),
        (lambda: realtime.parse_session({"session": {"audio": {"input": {"transcription": {"language": "fr"}}}}},
                                        realtime.Settings(), ("en",)), P.ProtocolError),
    ]
    for call, error in refusals:
        with pytest.raises(error, match="unknown language 'fr.*'; this model knows en"):
            call()
    assert P.parse_query("language=en-GB", ("en",)).language == "en"
