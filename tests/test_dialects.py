"""The Deepgram dialect on its own (Sans-I/O): what our messages become."""

from __future__ import annotations

import json

from whistle_stream.service import deepgram
from whistle_stream.service import protocol as P


def test_interim_results_span_the_audio_the_session_counted_at_any_sample_rate():
    config, options = deepgram.parse_query("encoding=linear16&sample_rate=48000&interim_results=true")
    assert config.sample_rate == 48000
    counted = [0.0]
    dialect = deepgram.Dialect(options, "demo", audio_seconds=lambda: counted[0])
    counted[0] = 2.5                                # what the session counted of 48 kHz audio
    (interim,) = map(json.loads, dialect.outgoing(P.Partial(pending=" turn on the", language="en", revision=1)))
    assert interim["is_final"] is False and interim["start"] == 0.0 and interim["duration"] == 2.5
    committed = P.Committed(seq=1, text=" Turn on.", words=(P.Word("Turn", 0.4, 0.7, 0.9), P.Word("on.", 0.7, 1.1, 0.8)))
    (final,) = map(json.loads, dialect.outgoing(committed))
    assert final["start"] == 0.4 and final["duration"] == 0.7 and final["channel"]["alternatives"][0]["transcript"] == "Turn on."
    (later,) = map(json.loads, dialect.outgoing(P.Partial(pending=" the lights", language="en", revision=2)))
    assert later["start"] == 1.1 and later["duration"] == 1.4
