"""A first start that speaks to a person: on a terminal, readable log lines, the page's URL and
progress while the kernels compile; JSON lines off a terminal and with --log-format json; the
demo model's note wherever a person meets the model."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes import FakeWhistle
from whistle_stream.models import DEMO_NOTE
from whistle_stream.results import Warmup
from whistle_stream.service import observe, server
from whistle_stream.service.config import ServiceConfig

ROOT = Path(__file__).resolve().parent.parent


def read_until(fd: int, pattern: str, timeout: float) -> str:
    """What a terminal shows until `pattern` appears (or the time runs out)."""
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline and not re.search(pattern, out.decode(errors="replace")):
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:
                break
    return out.decode(errors="replace")


@pytest.mark.slow
def test_serve_on_a_terminal_says_what_is_happening_and_where_to_go():
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "whistle_stream.cli", "serve", "--port", "0",
                             "--processes", "1"], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    try:
        shown = read_until(leader, r"note: .*download", 300)
    finally:
        proc.send_signal(signal.SIGTERM)
        shown += read_until(leader, r"closed", 30)
        proc.wait(30)
        os.close(leader)
    lines = [line for line in shown.splitlines() if line.strip()]
    assert lines and all(not line.lstrip().startswith("{") for line in lines), lines   # no JSON on a terminal
    assert re.search(r"^\d\d:\d\d:\d\d  info +listening on 127\.0\.0\.1:\d+", shown, re.M), shown
    page = re.search(r"open (http://127\.0\.0\.1:\d+/) for live captions; WebSocket (ws://\S+/v1/listen)", shown)
    assert page, shown
    assert re.search(r"ready in [\d.]+ s: model demo\.cact \(en\)", shown)
    assert "note: " + DEMO_NOTE in shown.replace("\r", "")
    assert proc.returncode == 0


def test_off_a_terminal_and_with_log_format_json_the_lines_are_json():
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fakes.py"), "serve", "--port", "0",
                           "--log-format", "nonsense"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "log_format must be auto, text or json" in proc.stderr
    for fmt in ("auto", "json"):   # stderr is a pipe here: auto means JSON
        p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fakes.py"), "serve", "--port", "0",
                              "--log-format", fmt], cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             text=True)
        events = []
        for line in p.stderr:
            events.append(json.loads(line)["event"])
            if events[-1] == "open":
                break
        p.terminate()
        p.wait(30)
        assert events[:1] == ["listening"] and "ready" in events and events[-1] == "open", (fmt, events)


async def test_a_start_still_warming_after_a_few_seconds_says_it_is_compiling(monkeypatch):
    class Slow(FakeWhistle):
        def warmup(self) -> Warmup:
            time.sleep(0.35)
            return Warmup(0.35, 1)

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(observe.TextFormatter().format(record))

    monkeypatch.setattr(server, "COMPILE_NOTICE_S", 0.05)
    monkeypatch.setattr(server, "COMPILE_TICK_S", 0.1)
    keep = Keep()
    logging.getLogger("whistle").addHandler(keep)
    logging.getLogger("whistle").setLevel(logging.INFO)
    try:
        app = server.build_app(model=Slow(), config=ServiceConfig(port=0, processes=1))
        await app.start()
        await app.drain()
    finally:
        logging.getLogger("whistle").removeHandler(keep)
    compiling = [r for r in records if "still warming up" in r]
    assert "a first start compiles the engine's kernels for this CPU (about a minute)" in compiling[0], records
    assert any(re.search(r"still warming up: \d+ s", r) for r in compiling[1:]), records
    ready = next(i for i, r in enumerate(records) if "ready in" in r)
    assert all(records.index(r) < ready for r in compiling)            # it stops once the start is done
    assert records[ready].endswith("1 compiled"), records[ready]       # what the warm-up compiled


def test_the_text_format_shows_unknown_events_with_their_fields_and_tracebacks():
    formatter = observe.TextFormatter()
    record = logging.LogRecord("whistle.service", logging.WARNING, __file__, 1, "rejected", (), None)
    record.fields = {"reason": "server_full", "dialect": "wyoming"}
    assert re.fullmatch(r"\d\d:\d\d:\d\d  warning  rejected reason=server_full dialect=wyoming",
                        formatter.format(record))
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("whistle.service", logging.ERROR, __file__, 1, "engine_error", (),
                                   sys.exc_info())
    record.fields = {"session": "ab12"}
    assert "ValueError: boom" in formatter.format(record)


def test_whistle_listen_shows_the_model_and_the_demo_note(capsys):
    from whistle_stream.clients.listen import Caption
    from whistle_stream.service import protocol as P

    display = Caption(sys.stdout, ansi=False)
    display.update(P.Ready(session_id="a", model="demo.cact", languages=("en",), language=None, sample_rate=16000,
                           encoding="pcm_s16le", vad=True, model_note=DEMO_NOTE))
    err = capsys.readouterr().err
    assert "model demo.cact (en)" in err and DEMO_NOTE in err
    display.update(P.Ready(session_id="a", model="whistle.cact", languages=("en", "de"), language=None,
                           sample_rate=16000, encoding="pcm_s16le", vad=True))
    err = capsys.readouterr().err
    assert "model whistle.cact (en, de)" in err and "note" not in err.lower().replace("whistle-listen: model", "")


def test_the_remote_listen_client_runs_without_webrtcvad(tmp_path):
    """`whistle-listen --file` against a server, in a process where webrtcvad cannot be imported:
    the remote client needs the protocol, not the session core's audio path."""
    from fakes import start_server_process

    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "webrtcvad.py").write_text("raise ImportError('webrtcvad is blocked in this test')\n")
    wav = tmp_path / "tone.wav"
    import numpy as np
    import soundfile

    t = np.arange(16000 * 2) / 16000
    soundfile.write(wav, (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000)
    proc, url = start_server_process()
    try:
        out = subprocess.run([sys.executable, "-c", "import sys; import whistle_stream.clients.listen as l; "
                              "assert 'webrtcvad' not in sys.modules or sys.modules['webrtcvad'] is None; "
                              "sys.exit(l.main(sys.argv[1:]))", "--server", url, "--file", str(wav), "--speed", "8"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    finally:
        proc.terminate()
        proc.wait(30)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "model fake-whistle" in out.stderr


# In a fresh process: every kernel a file, a live stream and word times run is one the warm-up
# already compiled or loaded (a first session never stalls on a compile), and the warm-up's count
# of compiled kernels is Numba's own.
_WARM_COVERS = """
import sys
from numba.core.dispatcher import Dispatcher
from harness.audio import demo_stream
from whistle_stream import Whistle
from whistle_stream.kernels._cache import compiled_here

def touched():
    kernels = {id(v): v for n, m in list(sys.modules.items()) if n.startswith("whistle_stream.kernels")
               for v in vars(m).values() if isinstance(v, Dispatcher)}
    return sum(len(k.overloads) for k in kernels.values())

model = Whistle()
warmed = model.warmup()
after_warm = touched()
clip = demo_stream(2, seed=3)[0]
model.transcribe(clip, word_timestamps=True)
list(model.stream([clip[i:i + 8000] for i in range(0, len(clip), 8000)]))
print(after_warm, touched(), warmed.compiled, compiled_here())
"""


def test_the_warm_up_loads_every_kernel_a_session_runs():
    done = subprocess.run([sys.executable, "-c", _WARM_COVERS], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    after_warm, after_sessions, compiled, compiled_by_then = map(int, done.stdout.split())
    assert after_warm > 20 and after_sessions == after_warm, done.stdout
    assert compiled == compiled_by_then, done.stdout
