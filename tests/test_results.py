"""The engine's public calls hand back typed, frozen results (`whistle_stream.results`), readable by
name as the dicts of earlier versions were, with `to_dict()` as their JSON shape."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from whistle_stream.results import Decoding, StreamUpdate, Transcription, Word, stream_update

RATE = 16000


@pytest.fixture(scope="module")
def demo():  # the bundled demo model
    from whistle_stream import Whistle

    return Whistle()


@pytest.fixture(scope="module")
def sentence():
    from tools.demo_data import test_clips

    (audio, text), = test_clips(1, seed=21)
    return audio, text


def test_transcribe_decode_and_align_return_their_dataclasses(demo, sentence):
    audio, _ = sentence
    plain = demo.transcribe(audio)
    assert isinstance(plain, Transcription) and plain.words is None and plain.text and plain.language == "en"
    timed = demo.transcribe(audio, word_timestamps=True)
    assert isinstance(timed, Transcription) and timed.words and all(isinstance(w, Word) for w in timed.words)
    assert " ".join(w.word for w in timed.words) == timed.text
    decoded = demo.decode(audio)
    assert isinstance(decoded, Decoding) and decoded.text == plain.text and all(isinstance(t, int) for t in decoded.tokens)
    aligned = demo.align(audio, plain.text)
    assert all(isinstance(w, Word) for w in aligned) and [w.word for w in aligned] == plain.text.split()
    with pytest.raises(dataclasses.FrozenInstanceError):
        timed.text = "changed"   # type: ignore[misc]


def test_a_stream_returns_stream_updates_whose_pieces_make_its_transcript(demo, sentence):
    audio, _ = sentence
    stream = demo.open_stream(language="en")
    updates = [stream.feed(audio[i:i + RATE]) for i in range(0, len(audio), RATE)]
    updates.append(stream.finish())
    assert all(isinstance(u, StreamUpdate) for u in updates)
    assert all(isinstance(w, Word) for u in updates for w in u.words)
    text = "".join(u.text for u in updates)
    assert text.strip() and text.split() == [w.word for u in updates for w in u.words]
    assert updates[-1].received == pytest.approx(len(audio) / RATE, abs=1e-6)


def test_results_read_by_name_as_the_engine_dicts_did_and_serialise(demo, sentence):
    audio, _ = sentence
    timed = demo.transcribe(audio, word_timestamps=True)
    assert timed["text"] == timed.text and timed.get("words") == timed.words and "words" in timed
    assert timed["words"][0]["start"] == timed.words[0].start
    assert set(demo.transcribe(audio)) == {"text", "language", "ttft_ms", "decode_tps"}   # no words asked
    shape = json.loads(json.dumps(timed.to_dict()))
    assert shape["text"] == timed.text and shape["words"][0] == dataclasses.asdict(timed.words[0])
    with pytest.raises(KeyError):
        timed["nonsense"]
    update = stream_update(text=" hi", words=[{"word": "hi", "start": 0.1234567, "end": 0.5}], pending=" there",
                           language="en", received=1.0, pass_ms=3.0, revision=2)
    assert update.to_dict() == {"text": " hi", "pending": " there", "language": "en", "received": 1.0,
                                "pass_ms": 3.0, "revision": 2,
                                "words": [{"word": "hi", "start": 0.123457, "end": 0.5, "probability": 1.0}]}
    assert dict(update.words[0]) == {"word": "hi", "start": 0.1234567, "end": 0.5, "probability": 1.0}


def test_the_service_core_reads_stream_updates_by_attribute():
    """The session core hands the protocol typed updates: a stream whose results are plain dicts
    (the engine's old surface) is refused at the seam instead of being read by key."""
    from whistle_stream.service import protocol as P

    session = P.Session("s", P.SessionConfig(), "m", ("en",))
    session.ready()
    with pytest.raises(AttributeError):
        session.results({"text": " a", "words": [], "pending": "", "language": "en", "pass_ms": 1.0, "revision": 1})
    out = session.results(stream_update(text=" a", words=[{"word": "a", "start": 0.0, "end": 0.2}], language="en",
                                        pass_ms=1.0, revision=1))
    assert isinstance(out[0], P.Committed) and out[0].words[0].word == "a"
    assert np.isclose(out[0].words[0].end, 0.2)
