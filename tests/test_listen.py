"""whistle-listen end to end: --file, --json, --local, the microphone (a fake sounddevice), errors."""

import asyncio
import io
import json
import signal
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from harness.servers import free_port
from whistle_stream.clients import listen
from whistle_stream.errors import ExitStatus
from whistle_stream.clients.client import ListenClient
from fakes import FakeWhistle, start_server_process, stream_reference
from whistle_stream.service import protocol as P
from whistle_stream.service.config import ServiceConfig
from whistle_stream.service.server import build_app

ROOT = Path(__file__).resolve().parent.parent


def write_wav(path: Path, seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    audio = (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * rate))).astype(np.float32)
    pcm = (audio * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return pcm.astype(np.float32) / 32768


@pytest.fixture(scope="module")
def server():
    proc, url = start_server_process("--workers", "2")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)


@pytest.fixture(scope="module")
def token_server():
    proc, url = start_server_process("--token", "s3cret")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_file_json_streams_a_wav_and_prints_every_server_message(server, tmp_path, capsys):
    audio = write_wav(tmp_path / "clip.wav", 3.3)
    assert listen.main(["--server", server, "--file", str(tmp_path / "clip.wav"), "--speed", "20",
                        "--json", "--no-vad"]) == 0
    messages = json_lines(capsys.readouterr().out)
    assert messages[0]["type"] == "ready" and messages[-1]["type"] == "final"
    committed = "".join(m["text"] for m in messages if m["type"] == "committed")
    assert committed == messages[-1]["text"] == stream_reference(FakeWhistle(), audio)
    assert messages[-1]["audio_seconds"] == pytest.approx(3.3, abs=0.01)


def test_file_captions_print_the_transcript_and_a_summary(server, tmp_path, capsys):
    write_wav(tmp_path / "clip.wav", 2.5, rate=44100)
    assert listen.main(["--server", server, "--file", str(tmp_path / "clip.wav"), "--speed", "20",
                        "--no-vad"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "alpha bravo charlie delta echo"
    assert "audio 2.5 s, 3 passes" in err and "language en" in err


def test_local_mode_gives_the_same_messages_as_the_server(server, tmp_path, capsys):
    write_wav(tmp_path / "clip.wav", 3.7, seed=3)
    common = ["--file", str(tmp_path / "clip.wav"), "--speed", "50", "--json", "--no-vad"]
    assert listen.main(["--server", server, *common]) == 0
    remote = json_lines(capsys.readouterr().out)
    assert listen.main(["--local", *common], model=FakeWhistle()) == 0
    local = json_lines(capsys.readouterr().out)
    strip = lambda ms: [{k: v for k, v in m.items() if k not in ("session_id", "model", "sample_rate", "resume",
                                                                 "replay_from")}
                        for m in ms if m["type"] != "partial"]
    assert strip(local) == strip(remote)


def test_caption_shows_committed_text_and_the_pending_tail_dimmed():
    out = io.StringIO()
    caption = listen.Caption(out, ansi=True, width=80)
    caption.update(P.Committed(seq=1, text=" hello", words=()))
    caption.update(P.Partial(pending=" wor", language="en", revision=2))
    assert out.getvalue().endswith("\r\x1b[Khello\x1b[2m wor\x1b[0m")
    caption.update(P.Committed(seq=2, text=" world", words=(), end_of_speech=True))
    assert out.getvalue().endswith("\r\x1b[Khello world\n")


def test_caption_keeps_the_tail_of_a_long_line_within_the_terminal():
    out = io.StringIO()
    caption = listen.Caption(out, ansi=True, width=20)
    caption.update(P.Committed(seq=1, text="x" * 50, words=()))
    caption.update(P.Partial(pending=" yy", language="en", revision=1))
    shown = out.getvalue().rsplit("\r\x1b[K", 1)[1]
    assert shown == "x" * 16 + "\x1b[2m yy\x1b[0m"


class FakeSoundDevice:
    """sounddevice's surface: query_devices + a callback InputStream fed by a thread."""

    def __init__(self, rate=44100, fail=None):
        self.rate, self.fail, self.opened = rate, fail, []

    def query_devices(self, device=None, kind=None):
        if self.fail:
            raise ValueError(self.fail)
        return {"name": "fake mic", "default_samplerate": float(self.rate), "max_input_channels": 1}

    def InputStream(self, **kw):
        self.opened.append(kw)
        return FakeInputStream(**kw)


class FakeInputStream:
    def __init__(self, samplerate, channels, dtype, device, blocksize, callback):
        self.rate, self.block, self.callback = samplerate, blocksize, callback
        self.running = False

    def _run(self):
        rng = np.random.default_rng(0)
        while self.running:
            block = (0.1 * rng.standard_normal((self.block, 1))).astype(np.float32)
            self.callback(block, self.block, None, None)
            time.sleep(self.block / self.rate / 10)   # 10x real time

    def __enter__(self):
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def test_the_microphone_is_opened_at_its_own_rate_and_resampled(server, capsys):
    sd = FakeSoundDevice(rate=44100)
    assert listen.main(["--server", server, "--seconds", "2", "--json", "--no-vad"], sounddevice=sd) == 0
    messages = json_lines(capsys.readouterr().out)
    assert sd.opened[0]["samplerate"] == 44100 and sd.opened[0]["channels"] == 1
    final = messages[-1]
    assert final["type"] == "final" and final["audio_seconds"] == pytest.approx(2.0, abs=0.1)
    assert final["text"].startswith(" alpha bravo charlie")


def test_no_microphone_is_a_clear_error(capsys):
    sd = FakeSoundDevice(fail="No input device matching")
    assert listen.main(["--server", "ws://127.0.0.1:9"], sounddevice=sd) == ExitStatus.NO_AUDIO
    assert "no microphone found" in capsys.readouterr().err



def test_an_unreachable_server_is_a_clear_error(tmp_path, capsys):
    write_wav(tmp_path / "clip.wav", 0.5)
    code = listen.main(["--server", f"ws://127.0.0.1:{free_port()}", "--file", str(tmp_path / "clip.wav"),
                        "--retries", "0"])
    assert code == ExitStatus.UNREACHABLE
    assert "cannot reach" in capsys.readouterr().err


def test_a_wrong_token_is_a_clear_error(token_server, tmp_path, capsys):
    write_wav(tmp_path / "clip.wav", 0.5)
    code = listen.main(["--server", token_server, "--file", str(tmp_path / "clip.wav"), "--token", "nope"])
    assert code == ExitStatus.AUTH
    assert "authentication failed" in capsys.readouterr().err
    assert listen.main(["--server", token_server, "--file", str(tmp_path / "clip.wav"), "--token",
                        "s3cret", "--speed", "20"]) == 0


def test_an_unreadable_file_is_a_clear_error_before_any_connection(tmp_path, capsys):
    (tmp_path / "x.wav").write_bytes(b"not a wav")
    assert listen.main(["--local", "--file", str(tmp_path / "x.wav")], model=FakeWhistle()) == ExitStatus.NO_AUDIO
    err = capsys.readouterr().err
    assert "x.wav: not a readable audio file (" in err and "WAV, FLAC" in err
    # with a server that is not there: the file's error, at once, not the connection's
    assert listen.main(["--server", "ws://127.0.0.1:9", "--file", str(tmp_path / "x.wav")]) == ExitStatus.NO_AUDIO
    err = capsys.readouterr().err
    assert "not a readable audio file" in err and "cannot reach" not in err


def test_a_malformed_server_url_is_a_usage_error_without_a_traceback(tmp_path, capsys):
    write_wav(tmp_path / "clip.wav", 0.5)
    for url in ("notaurl", "ftp://host", "ws://host:port"):
        assert listen.main(["--server", url, "--file", str(tmp_path / "clip.wav")]) == ExitStatus.FAILED
        err = capsys.readouterr().err
        assert "must be a URL like ws://127.0.0.1:8000" in err and "Traceback" not in err, url


def test_retries_are_shown_as_they_happen_and_a_wrong_path_fails_at_once(server, tmp_path, capsys):
    import time

    write_wav(tmp_path / "clip.wav", 0.5)
    assert listen.main(["--server", "ws://127.0.0.1:9", "--file", str(tmp_path / "clip.wav"),
                        "--retries", "2"]) == ExitStatus.UNREACHABLE
    err = capsys.readouterr().err
    assert err.count("retry ") == 2 and "retry 1 of 2" in err and "cannot reach" in err
    t0 = time.monotonic()
    assert listen.main(["--server", server + "/wrong/path", "--file", str(tmp_path / "clip.wav")]) == ExitStatus.FAILED
    err = capsys.readouterr().err
    assert time.monotonic() - t0 < 5 and "HTTP 404" in err and "retry" not in err


def test_ctrl_c_finalizes_and_prints_a_summary(server, tmp_path):
    write_wav(tmp_path / "long.wav", 30.0)
    proc = subprocess.Popen([sys.executable, "-m", "whistle_stream.clients.listen", "--server", server, "--file",
                             str(tmp_path / "long.wav"), "--speed", "2", "--no-vad"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.5)   # about 5 s of audio sent
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert out.startswith("alpha bravo")
    seconds = float(err.split("audio ")[1].split(" s,")[0])
    assert 2.0 <= seconds <= 10.0 and "language en" in err


async def test_the_client_retries_with_backoff_until_the_server_is_up():
    port = free_port()
    client = ListenClient(f"ws://127.0.0.1:{port}", retries=6, backoff=0.1)
    connecting = asyncio.create_task(client.connect())
    await asyncio.sleep(0.4)
    assert not connecting.done()
    app = await build_app(FakeWhistle(), ServiceConfig(port=port)).start()
    try:
        ready = await asyncio.wait_for(connecting, 10)
        assert ready.model == "fake-whistle"
        await client.close()
    finally:
        await app.drain()


async def test_listen_resumes_on_a_new_server_when_the_first_goes_away(tmp_path, capsys):
    """A rolling restart: the first server drains (1001), a second with the same resume secret
    takes its port; whistle-listen says it is reconnecting and the captions continue: one seq
    run, no word lost or repeated, the same transcript as an uninterrupted run."""
    write_wav(tmp_path / "clip.wav", 6.0)
    port = free_port()
    config = ServiceConfig(port=port, resume_secret="shared-secret-0123456789")
    first = await build_app(FakeWhistle(), config).start()
    args = listen.build_parser().parse_args(["--server", f"ws://127.0.0.1:{port}", "--file",
                                             str(tmp_path / "clip.wav"), "--speed", "4", "--json",
                                             "--no-vad", "--retries", "8"])
    out = io.StringIO()
    task = asyncio.create_task(listen.amain(args, out=out))
    await asyncio.sleep(0.7)
    await first.drain()                                   # 1001: going away, final(shutdown) with a token
    second = await build_app(FakeWhistle(), config).start()
    try:
        assert await asyncio.wait_for(task, 20) == 0
    finally:
        await second.drain()
    messages = json_lines(out.getvalue())
    committed = [m for m in messages if m["type"] == "committed"]
    assert [m["seq"] for m in committed] == list(range(1, len(committed) + 1))
    assert [m["type"] for m in messages].count("ready") == 1
    assert [m["reason"] for m in messages if m["type"] == "final"] == ["close"]
    audio = listen.read_audio(str(tmp_path / "clip.wav"))
    assert "".join(m["text"] for m in committed) == stream_reference(FakeWhistle(), audio)
    assert "reconnecting" in capsys.readouterr().err
