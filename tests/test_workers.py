"""Engine worker processes (`whistle_stream.workers.ProcessEngine`): the same results as the model in
this process, errors by name, and a dead worker costs only its own streams."""

import gc

import numpy as np
import pytest

from whistle_stream import Whistle
from whistle_stream.service.workers import ProcessEngine, WorkerDied

pytestmark = pytest.mark.slow

RATE = 16000


@pytest.fixture(scope="module")
def model():
    return Whistle()


@pytest.fixture(scope="module")
def engine():
    with ProcessEngine(processes=2) as e:
        e.warmup()
        yield e


@pytest.fixture(scope="module")
def speech():
    """Four held-out sentences, each followed by half a second of silence (commits and pauses)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools import demo_data
    return np.concatenate([np.concatenate([a, np.zeros(RATE // 2, np.float32)])
                           for a, _ in demo_data.test_clips(4, seed=0)])


def run(stream, audio, start=0):
    """Feed in 1 s pieces; the last 2.5 s go with a finalize and the finish (`finalize(audio)`)."""
    out = []
    a, b = len(audio) - int(2.5 * RATE), len(audio) - int(1.2 * RATE)
    for i in range(start, a, RATE):
        out.append(stream.feed(audio[i:min(i + RATE, a)]))
    out.append(stream.finalize(audio[a:b]))
    out.append(stream.finish(audio[b:]))
    return [{k: v for k, v in d.items() if k != "pass_ms"} for d in out], stream.passes


def test_a_stream_in_a_worker_gives_exactly_what_it_gives_here(model, engine, speech):
    here, passes = run(model.open_stream(), speech)
    there, remote_passes = run(engine.open_stream(), speech)
    assert there == here and remote_passes == passes > 0
    assert any(d["words"] for d in here)


def test_the_workers_report_the_kernels_path_they_run(model, engine):
    """The server's ready line names the workers' path: theirs, asked of them, as a typed record."""
    assert engine.kernel_path() == model.kernel_path()
    assert engine.kernel_path().simd in ("avx512", "avx2", "generic")


def test_a_checkpoint_restores_in_every_worker(model, engine, speech):
    local = model.open_stream()
    for i in range(0, 4 * RATE, RATE):
        local.feed(speech[i:i + RATE])
    state = local.checkpoint()
    start = int(state["buffer_start"])
    expected, _ = run(model.restore_stream(state), speech, start)
    # a stream goes to the worker with the fewest streams: one restored stream lands on each
    restored = [engine.restore_stream(state) for _ in engine.workers]
    assert {id(s._worker) for s in restored} == {id(w) for w in engine.workers}
    for s in restored:
        assert run(s, speech, start)[0] == expected


def test_a_call_that_commits_brings_its_checkpoint_back_and_no_second_call_asks_for_it(model, engine, speech):
    """The session seals a resume token into each committed message: the checkpoint comes back
    with the feed that committed, the same one a call would fetch; a call that committed nothing
    brings none, and checkpoint() then asks the worker."""
    here, there = model.open_stream(), engine.open_stream()
    calls = []
    worker_call = there._worker.call

    def counted(op, sid, args=(), kwargs=None):
        calls.append(args[0] if op == "stream" else op)
        return worker_call(op, sid, args, kwargs)

    there._worker.call = counted
    try:
        seen = {"committed": 0, "not": 0}
        for i in range(0, len(speech) - RATE, RATE):
            update = there.feed(speech[i:i + RATE])
            assert here.feed(speech[i:i + RATE]).words == update.words
            del calls[:]
            assert there.checkpoint() == here.checkpoint()
            assert calls == ([] if update.words else ["checkpoint"])
            seen["committed" if update.words else "not"] += 1
        there.finish(speech[len(speech) - RATE:])
        here.finish(speech[len(speech) - RATE:])
        del calls[:]
        assert there.checkpoint() == here.checkpoint() and calls == []
        assert there.checkpoint(compact=True) == here.checkpoint(compact=True) and calls == ["checkpoint"]
    finally:
        there._worker.call = worker_call
    assert seen["committed"] and seen["not"]


def untimed(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("ttft_ms", "decode_tps")}


def test_uploads_transcribe_as_here(model, engine, speech):
    there = engine.transcribe(speech[:3 * RATE], word_timestamps=True)
    assert untimed(there) == untimed(model.transcribe(speech[:3 * RATE], word_timestamps=True))
    assert there["text"]


def test_a_long_upload_crosses_the_pipe_as_raw_bytes_not_in_a_pickle(model, engine, speech, monkeypatch):
    # an hour of uploaded audio is 230 MB of samples: pickled, the server and the worker each held
    # a second copy; sent as bytes after the call, the worker receives it into its own array
    import pickle
    pickled = []
    for w in engine.workers:
        send = w.conn.send
        monkeypatch.setattr(w.conn, "send", lambda obj, send=send: pickled.append(len(pickle.dumps(obj))) or send(obj))
    audio = np.concatenate([speech, speech])[: 20 * RATE]   # 1.28 MB of float32
    there = engine.transcribe(audio)
    assert untimed(there) == untimed(model.transcribe(audio)) and there["text"]
    assert pickled and max(pickled) < 64 * 1024
    # a bad array is refused by name, and the worker goes on
    with pytest.raises(Exception, match="audio|sample|dtype|float"):
        engine.transcribe(np.full((20 * RATE, 2, 2), "x"))
    assert engine.transcribe(audio[: 2 * RATE]) is not None


def test_an_engine_error_is_raised_here_by_name_and_the_worker_goes_on(engine, speech):
    with pytest.raises(ValueError, match="unknown language 'xx'") as info:
        engine.open_stream(language="xx")
    assert any("engine worker process" in note for note in getattr(info.value, "__notes__", []))
    stream = engine.open_stream()
    with pytest.raises(TypeError, match="keywords must be a string"):
        stream.configure(keywords=42)
    assert "words" in stream.feed(speech[:RATE])
    assert engine.is_speech(speech[:RATE]) and not engine.is_speech(np.zeros(RATE, np.float32))


def test_a_dead_worker_fails_only_its_own_streams_and_is_started_again(engine, model, speech):
    a, b = engine.open_stream(), engine.open_stream()
    assert a._worker is not b._worker
    a.feed(speech[:RATE])
    b.feed(speech[:RATE])
    a._worker.process.kill()
    a._worker.process.join()
    with pytest.raises(WorkerDied, match="exited"):
        a.feed(speech[RATE:2 * RATE])
    rest, _ = run(b, speech, RATE)   # the other worker's stream goes on as if nothing happened
    fresh = model.open_stream()
    fresh.feed(speech[:RATE])
    assert rest == run(fresh, speech, RATE)[0]
    again, _ = run(engine.open_stream(), speech[:2 * RATE])   # a new stream gets a new worker
    assert all(w.process.is_alive() for w in engine.workers)
    assert again == run(model.open_stream(), speech[:2 * RATE])[0]


def test_a_stream_let_go_here_is_dropped_there(engine, speech):
    gc.collect()   # streams earlier tests left in reference cycles (a caught exception's traceback)
    before = engine.open_streams()
    streams = [engine.open_stream() for _ in range(6)]
    for s in streams:
        s.feed(speech[:RATE])
    assert sum(engine.open_streams()) == sum(before) + 6
    del streams, s
    gc.collect()
    assert engine.open_streams() == before


def test_processes_must_be_at_least_one():
    with pytest.raises(ValueError, match="processes must be at least 1"):
        ProcessEngine(processes=0)


def test_ctrl_c_reaches_the_server_not_its_workers(engine, speech):
    """A terminal's Ctrl-C signals the whole process group; the server drains its sessions through
    the workers, so they must not die of it."""
    import os
    import signal
    stream = engine.open_stream()
    for w in engine.workers:
        os.kill(w.process.pid, signal.SIGINT)
    assert "words" in stream.feed(speech[:RATE])
    assert all(w.process.is_alive() for w in engine.workers)


def test_workers_exit_when_their_server_is_killed(tmp_path):
    """A server killed outright (SIGKILL, the OOM killer) leaves no engine workers behind: each
    sees its pipe close and exits."""
    import subprocess
    import sys
    import time

    import psutil
    script = ("from whistle_stream.service.workers import ProcessEngine\n"
              "e = ProcessEngine(processes=2)\n"
              "e.open_stream()\n"
              "print(' '.join(str(w.process.pid) for w in e.workers), flush=True)\n"
              "import time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                              for p in pids):
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_closing_a_worker_mid_upload_gives_its_caller_worker_died(speech):
    """A worker that is not reading (frozen here; on a slow machine, still loading its model) while
    a long upload's bytes are being written to it: stopping it ends the write with WorkerDied, not
    a TypeError from the closed pipe."""
    import os
    import signal
    import threading
    import time
    engine = ProcessEngine(processes=1)
    worker = engine.workers[0]
    os.kill(worker.process.pid, signal.SIGSTOP)
    errors: list = []

    def upload():
        try:
            engine.transcribe(np.tile(speech, 60))
        except Exception as e:  # noqa: BLE001 - the test asserts which
            errors.append(e)

    caller = threading.Thread(target=upload)
    caller.start()
    while not worker.busy:
        time.sleep(0.01)
    time.sleep(0.3)
    worker.stop(timeout=0.2)
    caller.join(30)
    assert not caller.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], WorkerDied), errors
    assert not worker.process.is_alive()


def test_closing_does_not_wait_for_a_busy_worker(speech):
    """A worker busy past the timeout (a first start compiling, a long upload) is killed, not
    waited for; its caller gets WorkerDied."""
    import threading
    import time
    engine = ProcessEngine(processes=1)
    long = np.tile(speech, 60)   # 20 minutes of audio: seconds to transcribe, far over the timeout
    errors = []

    def upload():
        try:
            engine.transcribe(long)
        except WorkerDied as e:
            errors.append(e)

    caller = threading.Thread(target=upload)
    caller.start()
    while not engine.workers[0].busy:
        time.sleep(0.01)
    time.sleep(0.5)
    t0 = time.monotonic()
    engine.workers[0].stop(timeout=0.5)
    caller.join(30)
    assert time.monotonic() - t0 < 10 and not caller.is_alive() and errors
    assert not engine.workers[0].process.is_alive()
