"""The session audio path: resampling, re-chunking to engine steps, the VAD gate, the time map."""

import numpy as np
import pytest

from whistle_stream.frontend import MODEL_RATE as RATE
from whistle_stream.service.audio import AudioPath, Chunk, EndOfSpeech, TimeMap


def voiced(seconds: float, rate: int = RATE) -> np.ndarray:
    """A 140 Hz sawtooth: webrtcvad calls every frame of it speech."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * ((t * 140) % 1.0 - 0.5)).astype(np.float32)


def silence(seconds: float, rate: int = RATE) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.float32)


def push_in_pieces(path: AudioPath, audio: np.ndarray, piece: int) -> list:
    events = []
    for i in range(0, len(audio), piece):
        events += path.push(audio[i:i + piece])
    return events


def test_without_vad_audio_is_cut_into_whole_steps_in_order():
    path = AudioPath(RATE, vad=False)
    audio = np.random.default_rng(0).standard_normal(int(3.5 * RATE)).astype(np.float32)
    events = push_in_pieces(path, audio, 1234)
    assert [len(e.audio) for e in events] == [RATE] * 3
    assert [e.start for e in events] == [0.0, 1.0, 2.0]
    tail = path.flush(last=True)
    assert [len(e.audio) for e in tail] == [RATE // 2]
    np.testing.assert_array_equal(np.concatenate([e.audio for e in events + tail]), audio)


def test_client_rates_are_resampled_to_16k_keeping_duration():
    path = AudioPath(44100, vad=False)
    events = push_in_pieces(path, voiced(2.0, 44100), 4410) + path.flush(last=True)
    total = sum(len(e.audio) for e in events)
    assert abs(total - 2 * RATE) <= 2


def test_silence_never_reaches_the_engine():
    path = AudioPath(RATE, vad=True)
    events = push_in_pieces(path, silence(5.0), 1600) + path.flush(last=True)
    assert events == []


def test_speech_then_silence_gives_chunks_then_one_end_of_speech():
    path = AudioPath(RATE, vad=True, end_of_speech_ms=600)
    audio = np.concatenate([silence(1.0), voiced(2.5), silence(1.5)])
    events = push_in_pieces(path, audio, 800)
    chunks = [e for e in events if isinstance(e, Chunk)]
    ends = [e for e in events if isinstance(e, EndOfSpeech)]
    assert len(ends) == 1 and isinstance(events[-1], EndOfSpeech)
    assert chunks[0].first and not any(c.first for c in chunks[1:])
    # speech starts within the 300 ms pre-roll before the onset; the utterance is contiguous
    assert 0.65 <= chunks[0].start <= 1.0
    for a, b in zip(chunks, chunks[1:]):
        assert b.start == pytest.approx(a.start + len(a.audio) / RATE)
    assert 3.5 + 0.6 <= ends[0].at <= 3.5 + 0.6 + 0.25  # webrtcvad adds a short hangover of its own


@pytest.mark.parametrize("model_rate", [8000, 32000])
def test_the_path_runs_at_the_model_s_rate(model_rate):
    """The engine's samples are the model's: a model at another rate gets chunks at its rate,
    with the same session times, VAD frames and end of speech as at 16 kHz."""
    path = AudioPath(RATE, rate=model_rate, vad=True, end_of_speech_ms=600)
    audio = np.concatenate([silence(1.0), voiced(2.5), silence(1.5)])
    events = push_in_pieces(path, audio, 800)
    chunks = [e for e in events if isinstance(e, Chunk)]
    ends = [e for e in events if isinstance(e, EndOfSpeech)]
    assert path.frame == 30 * model_rate // 1000
    assert all(len(c.audio) == model_rate for c in chunks[:-1])    # 1 s steps at the model's rate
    assert 0.65 <= chunks[0].start <= 1.0 and len(ends) == 1
    assert 3.5 + 0.6 <= ends[0].at <= 3.5 + 0.6 + 0.25
    for a, b in zip(chunks, chunks[1:]):
        assert b.start == pytest.approx(a.start + len(a.audio) / model_rate)
    tm = TimeMap(model_rate)
    tm.add(Chunk(np.zeros(model_rate, np.float32), 5.0, True))
    assert tm.session_ranges(0.0, 0.5) == [(5 * model_rate, 5 * model_rate + model_rate // 2)]


def test_two_utterances_each_start_a_first_chunk():
    path = AudioPath(RATE, vad=True, end_of_speech_ms=300)
    audio = np.concatenate([voiced(1.2), silence(1.0), voiced(1.2), silence(1.0)])
    events = push_in_pieces(path, audio, 480)
    kinds = ["first" if isinstance(e, Chunk) and e.first else type(e).__name__ for e in events]
    assert kinds.count("first") == 2 and kinds.count("EndOfSpeech") == 2


def test_flush_mid_utterance_hands_over_the_partial_step():
    path = AudioPath(RATE, vad=True)
    events = push_in_pieces(path, voiced(0.5), 480)
    assert events == []
    flushed = path.flush()
    assert len(flushed) == 1 and len(flushed[0].audio) == pytest.approx(0.5 * RATE, abs=480)


def test_time_map_restores_session_time_across_skipped_silence():
    tm = TimeMap()
    tm.add(Chunk(np.zeros(RATE, np.float32), start=2.0, first=True))
    tm.add(Chunk(np.zeros(RATE // 2, np.float32), start=3.0, first=False))
    tm.add(Chunk(np.zeros(RATE, np.float32), start=10.0, first=True))
    assert tm(0.0) == 2.0
    assert tm(1.25) == pytest.approx(3.25)
    assert tm(1.5) == pytest.approx(10.0)
    assert tm(2.2) == pytest.approx(10.7)


def test_a_time_map_forgets_what_no_engine_buffer_reaches_back_to():
    """Hours of utterances keep the map to the segments of the last KEEP_S engine seconds, and
    those still map exactly."""
    from whistle_stream.service.audio import Chunk, TimeMap

    tm, rate = TimeMap(16000), 16000
    for k in range(20_000):                        # 1 s of speech every 3 s of session: 5.5 hours
        tm.add(Chunk(np.zeros(rate, np.float32), start=3.0 * k, first=True))
    assert len(tm.state()["engine"]) <= 64 + TimeMap.KEEP_S
    assert tm(19_999.5) == 3.0 * 19_999 + 0.5 and tm(19_950.25) == 3.0 * 19_950 + 0.25
