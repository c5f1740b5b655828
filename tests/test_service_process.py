"""The server as a process: flags and WHISTLE_* variables, JSON logs, and the SIGTERM drain."""

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from whistle_stream.clients.client import ListenClient, ServerUnreachable, SessionEnded
from fakes import FakeWhistle, start_server_process, stream_reference
from whistle_stream.service import protocol as P
from whistle_stream.service.config import ServiceConfig, add_serve_arguments, config_from_args


def parse(argv, environ=None):
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
    return config_from_args(args, environ=environ or {})


def test_flags_beat_environment_variables_which_beat_defaults():
    env = {"WHISTLE_PORT": "9000", "WHISTLE_MAX_SESSIONS": "5", "WHISTLE_ALLOWED_ORIGINS": "http://a, http://b"}
    c = parse(["--port", "9100", "--token", "t"], env)
    assert (c.port, c.max_sessions, c.token, c.allowed_origins) == (9100, 5, "t", ("http://a", "http://b"))
    assert c.idle_timeout == ServiceConfig().idle_timeout and c.host == "127.0.0.1"


def test_every_setting_has_a_flag_and_an_environment_variable():
    from dataclasses import fields
    help_text = add_serve_arguments(argparse.ArgumentParser()).format_help()
    for f in fields(ServiceConfig):
        assert "--" + f.name.replace("_", "-") in help_text
        assert "WHISTLE_" + f.name.upper() in help_text


@pytest.mark.parametrize("argv, env, needle", [
    (["--port", "eighty"], {}, "--port"),
    ([], {"WHISTLE_WORKERS": "0"}, "workers"),
    (["--processes", "0"], {}, "processes must be at least 1"),
    (["--processes", "two"], {}, "--processes"),
    (["--vad-aggressiveness", "4"], {}, "vad_aggressiveness"),
])
def test_bad_settings_are_refused_with_the_setting_named(argv, env, needle):
    with pytest.raises(ValueError, match=needle):
        parse(argv, env)


@pytest.mark.parametrize("cpu_max, cores", [("200000 100000\n", 2), ("50000 100000\n", 1), ("150000 100000", 2),
                                             ("max 100000\n", None), (None, None)])
def test_the_default_engine_processes_follow_a_containers_cpu_limit(tmp_path, cpu_max, cores):
    """Engine processes and threads default to the CPUs the process may use: in a container with a
    CPU limit (cgroup v2 cpu.max) that limit, not the node's cores."""
    from whistle_stream.service.config import _cores
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert _cores(str(path)) == (affinity if cores is None else min(cores, affinity))


def pcm(seconds, seed=0):
    return (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * 16000))).astype(np.float32)


async def test_sigterm_ends_open_sessions_with_a_resume_token_then_exits_zero():
    proc, url = start_server_process("--workers", "2")
    try:
        clients, audios = [], []
        for k in range(2):
            c = ListenClient(url, vad=False, resume=False)   # sees the drain as it happens
            await c.connect()
            audio = pcm(2.3 + 0.4 * k, seed=k)
            for i in range(0, len(audio), 1600):
                await c.send_audio(audio[i:i + 1600])
            while not any(isinstance(m, P.Partial) for m in c.messages):
                await c.receive()
            clients.append(c)
            audios.append(audio)
        await asyncio.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        for c, audio in zip(clients, audios):
            with pytest.raises(SessionEnded) as info:
                while True:
                    await asyncio.wait_for(c.receive(), 10)
            assert info.value.code == P.CloseCode.GOING_AWAY
            final = c.messages[-1]
            assert isinstance(final, P.Final) and final.reason == "shutdown"
            # committed text stays; the pending tail is left for the session that resumes (the token)
            assert final.resume and final.replay_from is not None
            assert c.text == final.text and stream_reference(FakeWhistle(), audio).startswith(c.text)
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10) == 0
        with pytest.raises(ServerUnreachable):
            await ListenClient(url).connect()
        logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
        events = [e["event"] for e in logs]
        assert "draining" in events and events[-1] == "closed"
        opened = [e for e in logs if e["event"] == "session_open"]
        assert len(opened) == 2 and all(len(e["session"]) == 12 for e in opened)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_environment_variables_configure_the_process():
    proc, url = start_server_process(env={"WHISTLE_MAX_SESSIONS": "1"})
    try:
        first = ListenClient(url)
        await first.connect()
        with pytest.raises(SessionEnded) as info:
            await ListenClient(url).connect()
        assert info.value.code == P.CloseCode.TRY_AGAIN and info.value.error.code is P.ErrorCode.SERVER_FULL
        await first.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10) == 0


_GC_SCRIPT = """
import asyncio, collections, gc, sys
sys.path.insert(0, "tests")
from fakes import FakeWhistle
from whistle_stream.clients import WEB_ROOT
from whistle_stream.service.config import ServiceConfig
from whistle_stream.service.server import build_app

START_UP = [[i] for i in range(200_000)]   # what a real start-up leaves: modules, model, compiled code


class Connection:   # a closed connection's leftovers: a cycle (transport, protocol, compressors)
    def __init__(self):
        self.parts = [{"owner": self} for _ in range(30)]


async def main():
    app = await build_app(model=FakeWhistle(), config=ServiceConfig(port=0, workers=1), web_root=WEB_ROOT).start()
    full = gc.get_stats()[2]["collections"]
    open_now = collections.deque(maxlen=16)
    for _ in range(10_000):   # sessions come and go, 16 open at a time, each living through collections
        open_now.append(Connection())
    print(gc.get_stats()[2]["collections"] - full)
    await app.drain()

asyncio.run(main())
"""


def test_closed_sessions_are_freed_by_full_collections_as_they_pile_up():
    """A closed connection leaves reference cycles (~30 KB, most of it zlib state) that, once the
    connection has lived through a few collections, only a full collection frees. A full collection
    waits for a quarter as many new long-lived objects as the process already holds, so a large
    start-up (the real server's ~130k objects) holds them back for tens of minutes while the
    server's memory climbs. Once ready, the server takes the start-up out of the collector's sight, so full
    collections come as sessions' leftovers pile up. (In a process of its own: the test process's
    collector is not this one's.)"""
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", _GC_SCRIPT], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert int(out.split()[-1]) >= 2, "no full collection ran while 10,000 sessions came and went"


def test_session_defaults_parse_from_flags_and_the_environment():
    env = {"WHISTLE_KEYWORDS": "living room, kitchen light", "WHISTLE_LANGUAGE": "", "WHISTLE_BEAMS": "3"}
    c = parse([], env)
    assert (c.keywords, c.language, c.beams) == (("living room", "kitchen light"), None, 3)
    assert parse(["--language", "en"], env).language == "en"
    with pytest.raises(ValueError, match="beams must be 1..16"):
        parse(["--beams", "0"], env)


def test_a_language_the_model_lacks_stops_the_start_naming_the_model_s():
    done = subprocess.run([sys.executable, "-m", "whistle_stream.cli", "serve", "--port", "0", "--processes", "1",
                           "--language", "sv"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--language: unknown language 'sv'; this model knows en" in done.stderr, done.stderr[-2000:]
