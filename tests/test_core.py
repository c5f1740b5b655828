"""The session core on its own: no event loop, no socket. A fake engine and a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import FakeWhistle
from whistle_stream.service import protocol as P
from whistle_stream.service.core import Feed, SessionCore, SessionLimits, check_token
from whistle_stream.service.protocol import ErrorCode as E

RATE = 16000


def voiced(seconds: float) -> np.ndarray:
    """A 140 Hz sawtooth: webrtcvad calls every frame of it speech."""
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.5 * ((t * 140) % 1.0 - 0.5)).astype(np.float32)


def pcm(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).round().astype("<i2").tobytes()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def open_core(model=None, clock=None, **kw) -> tuple[SessionCore, FakeWhistle]:
    model = model or FakeWhistle()
    limits = SessionLimits(**{k: kw.pop(k) for k in list(kw) if k in SessionLimits.__dataclass_fields__})
    core = SessionCore(model, P.SessionConfig(**kw), limits, clock=clock or Clock())
    (ready,) = core.open()
    assert isinstance(ready, P.Ready)
    return core, model


def send(core: SessionCore, audio: np.ndarray, block: float = 0.1) -> list:
    out = []
    step = int(block * RATE)
    for i in range(0, len(audio), step):
        out += core.audio(pcm(audio[i:i + step]))
    return out


def committed(messages) -> list[P.Committed]:
    return [m for m in messages if isinstance(m, P.Committed)]


def test_speech_then_silence_commits_the_utterance_with_end_of_speech():
    core, model = open_core()
    out = send(core, voiced(2.0)) + send(core, np.zeros(RATE, np.float32))
    ends = [m for m in committed(out) if m.end_of_speech]
    assert len(ends) == 1 and model.passes >= 2
    assert [m.seq for m in committed(out)] == list(range(1, len(committed(out)) + 1))


def test_silence_never_reaches_the_engine_and_times_are_session_times():
    core, model = open_core()
    out = send(core, np.zeros(3 * RATE, np.float32))
    assert out == [] and model.passes == 0 and model.streams[0].feeds == []
    out += send(core, voiced(2.0)) + core.finish("close")
    words = [w for m in committed(out) for w in m.words]
    # the engine heard the speech alone; its word times come back on the session's clock
    assert sum(model.streams[0].feeds) < 2.6 * RATE
    assert 2.6 <= words[0].start <= 3.05 and words[-1].end <= 5.05
    assert isinstance(out[-1], P.Final) and out[-1].reason == "close"


def test_the_engine_gate_runs_only_at_the_start_of_an_utterance():
    calls = []
    model = FakeWhistle()
    model.is_speech = lambda audio: calls.append(len(audio)) or len(calls) > 1   # first chunk: "noise"
    core, _ = open_core(model)
    send(core, voiced(3.0))
    # the first chunk was judged silence and dropped; the second opened the utterance, and no
    # later chunk of it went through the gate again
    assert len(calls) == 2
    assert sum(model.streams[0].feeds) == pytest.approx(3.0 * RATE - calls[0], abs=RATE)


def test_a_gate_that_hears_nothing_means_no_pass_and_no_text():
    model = FakeWhistle()
    model.is_speech = lambda audio: False
    core, _ = open_core(model)
    out = send(core, voiced(2.5)) + core.finish("close")
    assert model.passes == 0 and out[-1].text == ""


def test_without_vad_every_sample_reaches_the_engine_in_steps():
    core, model = open_core(vad=False, step_s=0.5)
    send(core, np.zeros(2 * RATE, np.float32))
    assert model.streams[0].feeds and sum(model.streams[0].feeds) == 2 * RATE


def test_the_audio_limit_ends_the_session():
    core, _ = open_core(max_session_seconds=1.0, vad=False)
    core.audio(pcm(np.zeros(RATE, np.float32)))
    with pytest.raises(P.ProtocolError) as info:
        core.audio(pcm(np.zeros(1600, np.float32)))
    assert info.value.code is E.SESSION_LIMIT and info.value.fatal and "1 audio seconds" in info.value.message


def test_control_messages_are_rate_limited_by_the_clock():
    clock = Clock()
    core, _ = open_core(clock=clock, control_rate=2.0, control_burst=3)
    for _ in range(3):
        core.control('{"type": "keepalive"}')
    with pytest.raises(P.ProtocolError) as info:
        core.control('{"type": "keepalive"}')
    assert info.value.code is E.RATE_LIMITED
    clock.now += 0.5   # one token back
    core.control('{"type": "keepalive"}')


def test_bad_frames_are_refused_and_the_core_carries_on():
    core, model = open_core(vad=False)
    for frame, code in ((b"\x01\x02\x03", E.BAD_AUDIO), ("hello", E.EXPECTED_BINARY),
                        ("{", E.MALFORMED_JSON), ('{"type": "dance"}', E.UNKNOWN_TYPE)):
        with pytest.raises(P.ProtocolError) as info:
            core.receive(frame)
        assert info.value.code is code and not info.value.fatal
    send(core, np.zeros(2 * RATE, np.float32))
    assert model.passes == 2


def test_finalize_commits_everything_and_answers_final_then_the_session_goes_on():
    core, _ = open_core(vad=False)
    out = send(core, np.zeros(int(2.5 * RATE), np.float32))
    out += core.control('{"type": "finalize"}')
    assert isinstance(out[-1], P.Final) and out[-1].reason == "finalize"
    assert out[-1].seq == len(committed(out)) >= 1
    assert out[-1].text == "".join(m.text for m in committed(out)) != ""
    more = send(core, np.zeros(RATE, np.float32)) + core.finish("close")
    assert more[-1].reason == "close" and more[-1].seq >= out[-1].seq


def test_the_last_audio_of_an_utterance_reaches_the_engine_with_its_end():
    # the audio the path held back goes to the engine's finalize with it, not in a feed of its own
    # (whose passes the finalize would read again at once): at the end of speech, a finalize, a close
    core, model = open_core()
    send(core, voiced(1.5))
    out = send(core, np.zeros(RATE, np.float32))
    stream = model.streams[0]
    assert any(m.end_of_speech for m in committed(out))
    assert len(stream.finals) == 1 and stream.finals[0] > 0
    assert sum(stream.feeds) == stream.received
    send(core, voiced(1.3))
    core.control('{"type": "finalize"}')
    assert len(stream.finals) == 2 and stream.finals[-1] > 0
    send(core, voiced(1.4))
    final = core.finish("close")[-1]
    assert final.reason == "close" and stream.closed
    assert len(stream.finals) == 3 and stream.finals[-1] > 0


def test_a_keyword_the_engine_refuses_is_an_error_and_the_old_ones_stay():
    core, model = open_core()

    def refuse(keywords=None, **_):
        raise ValueError("keyword 'x' has no tokens")

    model.streams[0].configure = refuse
    (error,) = core.control('{"type": "configure", "keywords": ["x"]}')
    assert error.code is E.BAD_MESSAGE and "no tokens" in error.message


def test_receive_is_cheap_and_execute_does_the_engine_work():
    core, model = open_core(vad=False)
    received = core.receive(pcm(np.zeros(2 * RATE, np.float32)))
    assert model.passes == 0 and all(isinstance(w, Feed) for w in received.work)
    out = core.execute(received.work)
    assert model.passes == 2 and model.streams[0].feeds == [2 * RATE]   # one call for the backlog
    assert committed(out) or any(isinstance(m, P.Partial) for m in out)


def _marked_core(clock: Clock) -> tuple[SessionCore, FakeWhistle]:
    """An open core without VAD, resume marks on (a mark after each frame's work)."""
    model = FakeWhistle()
    core = SessionCore(model, P.SessionConfig(vad=False), clock=clock, resume_secret=b"k" * 32)
    core.open()
    return core, model


def _queued(clock_step: float, wait: float) -> tuple[SessionCore, FakeWhistle]:
    """3 s of audio received in 0.1 s frames `clock_step` apart, its work run at once `wait`
    seconds after the last frame (a session whose engine calls queued behind others')."""
    clock = Clock()
    core, model = _marked_core(clock)
    work = []
    for _ in range(30):
        work += core.receive(pcm(np.zeros(1600, np.float32))).work
        clock.now += clock_step
    clock.now += wait
    core.execute(work)
    return core, model


def test_a_live_session_that_fell_behind_reads_its_backlog_in_one_pass():
    _, model = _queued(clock_step=0.1, wait=0.5)
    (stream,) = model.streams
    assert stream.feeds == [3 * RATE] and stream.catch_ups == 1 and model.passes == 1


def test_a_backlog_sent_faster_than_real_time_gets_a_pass_per_step():
    # a file sent at once, its work done 1.5 s later: late enough that a live stream would catch up
    _, model = _queued(clock_step=0.0, wait=1.5)
    (stream,) = model.streams
    assert stream.feeds == [3 * RATE] and stream.catch_ups == 0 and model.passes == 3


def test_a_live_session_keeping_up_gets_a_pass_per_step():
    clock = Clock()
    core, model = _marked_core(clock)
    for _ in range(30):
        core.audio(pcm(np.zeros(1600, np.float32)))
        clock.now += 0.1
    (stream,) = model.streams
    assert stream.catch_ups == 0 and model.passes == 3


def test_an_engine_failure_marks_the_core_failed():
    core, _ = open_core(FakeWhistle(fail_after=0), vad=False)
    with pytest.raises(RuntimeError):
        send(core, np.zeros(2 * RATE, np.float32))
    assert core.failed


def test_commit_latency_is_measured_on_the_core_clock():
    clock = Clock()
    seen = []

    class Observer:
        def audio(self, seconds): pass
        def passes(self, count, seconds_each): pass
        def commit_latency(self, seconds): seen.append(seconds)

    model = FakeWhistle()
    core = SessionCore(model, P.SessionConfig(vad=False), clock=clock, observer=Observer())
    core.open()
    for _ in range(30):
        core.audio(pcm(np.zeros(1600, np.float32)))
        clock.now += 0.1
    assert seen and all(0.0 <= s <= 3.0 for s in seen)


@pytest.mark.parametrize("expected, header, query, ok", [
    (None, None, "", True),
    ("t0k", "Bearer t0k", "", True),
    ("t0k", None, "token=t0k&sample_rate=bad", True),   # the token alone decides
    ("t0k", "Bearer wrong", "token=t0k", False),        # the header wins over the query
    ("t0k", "Basic t0k", "", False),
    ("t0k", "Token t0k", "", True),                      # Deepgram's scheme
    ("t0k", None, "", False),
    ("t0k", None, "token=", False),
])
def test_the_auth_decision(expected, header, query, ok):
    if ok:
        check_token(expected, header, query)
    else:
        with pytest.raises(P.ProtocolError) as info:
            check_token(expected, header, query)
        assert info.value.code is E.UNAUTHORIZED and info.value.close_code == 4401


def test_the_service_step_range_is_the_engine_s():
    from whistle_stream.service.config import ServiceConfig
    from whistle_stream.streaming import MAX_STEP_S, StreamSession

    ServiceConfig(step_s=MAX_STEP_S)
    with pytest.raises(ValueError, match="step_s must be 0.1..10 seconds"):
        ServiceConfig(step_s=20)
    with pytest.raises(ValueError):
        StreamSession(FakeWhistle(), step_s=MAX_STEP_S + 0.1)


def test_the_cheap_half_and_the_engine_half_run_on_two_threads():
    """As the server runs a session: frames are received on the event loop's thread while the
    engine half runs on a pool thread. Reading the arrival times while audio arrives must not
    fail the session (it did: `deque mutated during iteration`, an `internal` under load)."""
    import queue
    import sys
    import threading
    import time

    core, model = open_core(vad=False, max_session_seconds=10_000)
    frame = pcm(voiced(0.02))
    work: queue.Queue = queue.Queue()
    errors: list = []
    done = threading.Event()

    def engine_half():
        while not done.is_set() or not work.empty():
            try:
                item = work.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                core.execute(item)
            except Exception as e:  # noqa: BLE001 - the test reports what failed
                errors.append(e)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as possible: the race shows in seconds
    try:
        engine = threading.Thread(target=engine_half)
        engine.start()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not errors:
            work.put(core.receive(frame).work)
        done.set()
        engine.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert model.passes > 10


def test_a_session_that_names_no_language_or_keywords_takes_the_services():
    model = FakeWhistle()
    limits = SessionLimits(language="en", keywords=("living room", "kitchen"), beams=2)
    for asked, (language, keywords) in [(P.SessionConfig(), ("en", ["living room", "kitchen"])),
                                        (P.SessionConfig(language="en", keywords=("garage",)), ("en", ["garage"]))]:
        SessionCore(model, asked, limits, clock=Clock()).open()
        stream = model.streams[-1]
        assert (stream.language, stream.keywords, stream.beams) == (language, keywords, 2)
    SessionCore(model, P.SessionConfig(), SessionLimits(), clock=Clock()).open()
    assert (model.streams[-1].language, model.streams[-1].keywords, model.streams[-1].beams) == (None, [], 5)


def test_an_end_of_speech_keeps_the_sentence_and_a_long_pause_or_a_finalize_does_not():
    """The VAD ends an utterance, not the speaker's sentence: its finalize keeps the words before a
    short pause for the passes after it (`keep_context`). After a pause longer than
    CONTEXT_PAUSE_S (the engine never hears the VAD's silences) the stream is told to start
    afresh before the next speech; a client's finalize always starts afresh."""
    from whistle_stream.rules import CONTEXT_PAUSE_S

    core, model = open_core()
    send(core, voiced(1.0))
    send(core, np.zeros(int(1.0 * RATE), np.float32))               # end of speech after 600 ms
    stream = model.streams[0]
    assert stream.kept == [True]
    send(core, voiced(1.0))
    send(core, np.zeros(int((CONTEXT_PAUSE_S + 1.0) * RATE), np.float32))
    assert stream.kept == [True, True]
    send(core, voiced(1.5))                                           # after the long pause
    assert stream.kept == [True, True, False] and stream.finals[-1] == 0
    core.control('{"type": "finalize"}')
    assert stream.kept[-1] is False


def test_a_retuned_language_is_the_models_code_and_an_unknown_one_is_refused():
    """A dialect's session update names a language by the one rule (`params.model_language`): the
    session then holds the model's code, and a language the model lacks is refused by name."""
    core, model = open_core()
    core.receive(P.Retune(language="en-US", vad=True, end_of_speech_ms=600, vad_aggressiveness=2))
    assert core.config.language == "en"
    with pytest.raises(P.ProtocolError, match="unknown language 'xx'"):
        core.receive(P.Retune(language="xx", vad=True, end_of_speech_ms=600, vad_aggressiveness=2))
    assert core.config.language == "en"
