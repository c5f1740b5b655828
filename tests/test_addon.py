"""The Home Assistant add-on (addon/, repository.yaml): its config against what the Supervisor
accepts, its options as `serve` settings, and its image built as the Supervisor builds it (podman,
a Debian base, addon/ the whole context), run as the Supervisor runs it (options in
/data/options.json), answering Wyoming's `describe` and transcribing as our server does."""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from harness.addon import build_problems, config_problems, value_problems
from harness.audio import demo_stream
from harness.podman import ROOT, build_env, podman
from harness.servers import ServerProcess, free_port
from whistle_stream import __version__
from whistle_stream.service.config import add_serve_arguments, config_from_args
from whistle_stream.service.wyoming import SENSITIVITY_MS

ADDON = ROOT / "addon"
CONFIG = yaml.safe_load((ADDON / "config.yaml").read_text())


def _run_module():
    spec = importlib.util.spec_from_file_location("addon_run", ADDON / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def addon_problems(config: dict) -> list[str]:
    """The Supervisor's rules, and ours: the Wyoming port the discovery announces is the add-on's."""
    ours = [] if "10300/tcp" in (config.get("ports") or {}) else ["the Wyoming port 10300/tcp is not in ports"]
    return config_problems(config) + ours


def test_the_shipped_add_on_is_one_the_supervisor_accepts():
    assert addon_problems(CONFIG) == []
    assert build_problems(yaml.safe_load((ADDON / "build.yaml").read_text())) == []
    repository = yaml.safe_load((ROOT / "repository.yaml").read_text())
    assert repository["name"] and repository["url"].startswith("https://")
    assert set(CONFIG["arch"]) == {"amd64", "aarch64"} and CONFIG["discovery"] == ["wyoming"]
    assert str(CONFIG["version"]) == __version__ == yaml.safe_load((ADDON / "build.yaml").read_text())[
        "args"]["WHISTLE_STREAM_VERSION"]
    # every option has a name and a description on the add-on's page
    names = yaml.safe_load((ADDON / "translations/en.yaml").read_text())["configuration"]
    assert set(names) == set(CONFIG["schema"]) and all(v["name"] and v["description"] for v in names.values())


@pytest.mark.parametrize("break_it, complaint", [
    (lambda c: c.update(arch=["amd64", "arm64"]), "arch 'arm64' is not one of"),
    (lambda c: c.pop("arch"), "arch is missing"),
    (lambda c: c.update(ports={}), "the Wyoming port 10300/tcp is not in ports"),
    (lambda c: c["ports"].update({"10300": "10300"}), "a port 1..65535 or null"),
    (lambda c: c["schema"].update(beam_size="integer(1,16)"), "schema beam_size: 'integer(1,16)' is not a type"),
    (lambda c: c["schema"].update(keywords=[["str"]]), "a list schema holds one element"),
    (lambda c: c["options"].update(beam_size=40), "option beam_size: 40 is outside 1..16"),
    (lambda c: c["options"].update(language="sv"), "option language: 'sv' is not one of"),
    (lambda c: c["options"].update(allow=["home"]), "option allow: 'home' does not match"),
    (lambda c: c["options"].pop("model"), "option model is required by the schema"),
    (lambda c: c.update(slug="whistle stream"), "slug 'whistle stream' is not letters"),
])
def test_the_config_check_catches_what_the_supervisor_refuses(break_it, complaint):
    broken = copy.deepcopy(CONFIG)
    break_it(broken)
    assert any(complaint in p for p in addon_problems(broken)), addon_problems(broken)


def test_a_base_image_the_supervisor_cannot_name_is_caught():
    assert build_problems({"build_from": {"amd64": "debian:bookworm-slim"}})   # Docker Hub needs its namespace
    assert build_problems({"build_from": {"arm64": "docker.io/arm64v8/debian:bookworm-slim"}})


def test_the_options_become_serve_settings_a_token_free_server_starts_with(monkeypatch):
    run = _run_module()
    options = dict(CONFIG["options"])
    config = config_from_args(add_serve_arguments(argparse.ArgumentParser()).parse_args(run.serve_args(options, None)),
                              environ={})
    assert config.wyoming_port == run.WYOMING_PORT and config.host == "0.0.0.0"
    assert run.SUPERVISOR_NETWORK in config.wyoming_allow and "127.0.0.0/8" in config.wyoming_allow
    assert (config.language, config.keywords, config.beams) == (None, (), 5)
    assert config.end_of_speech_ms == SENSITIVITY_MS["default"] and config.max_sessions == 4
    options.update(language="de", keywords=["living room", "Anna, Ben"], beam_size=2, end_of_speech="relaxed",
                   allow=["192.168.1.0/24"], max_sessions=9)
    config = config_from_args(add_serve_arguments(argparse.ArgumentParser()).parse_args(
        run.serve_args(options, "/share/whistle-stream/whistle.cact")), environ={})
    assert (config.language, config.keywords, config.beams) == ("de", ("living room", "Anna  Ben"), 2)
    assert config.end_of_speech_ms == 1250 and config.max_sessions == 9 and config.model.endswith("whistle.cact")
    assert "192.168.1.0/24" in config.wyoming_allow
    # every value the schema allows is one the run script maps
    for level in CONFIG["schema"]["end_of_speech"][5:-1].split("|"):
        assert level in SENSITIVITY_MS and not value_problems(CONFIG["schema"]["end_of_speech"], level)


# ---- the image, built and run as the Supervisor would -----------------------------------------

IMAGE = "localhost/whistle-stream-addon:test"
needs_podman = pytest.mark.skipif(not all(shutil.which(t) for t in ("podman", "mmdebstrap", "runc")),
                                  reason="podman, runc and mmdebstrap are not installed (.ci/run installs them)")


async def wyoming_transcript(port: int, audio: np.ndarray) -> str:
    """What Home Assistant sends for one command, and the transcript it reads back."""
    from wyoming.asr import Transcribe, Transcript
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    pcm = (np.clip(audio, -1, 1) * 32767).round().astype("<i2").tobytes()
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        for i in range(0, len(pcm), 2048):
            await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=pcm[i:i + 2048]).event())
        await client.write_event(AudioStop().event())
        while True:
            event = await asyncio.wait_for(client.read_event(), 120)
            assert event is not None, "the connection closed before the transcript"
            assert event.type != "error", event
            if Transcript.is_type(event.type):
                return Transcript.from_event(event).text


async def describe(port: int):
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info

    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Describe().event())
        return Info.from_event(await asyncio.wait_for(client.read_event(), 10))


@needs_podman
@pytest.mark.slow
def test_the_add_on_image_runs_as_the_supervisor_runs_it_and_transcribes_as_our_server(tmp_path):
    t0 = time.monotonic()
    build = subprocess.run(["bash", "tools/build_addon.sh", "--arch", "amd64", "--tag", IMAGE], cwd=ROOT,
                           env={**build_env(), "PYTHON": sys.executable},
                           capture_output=True, text=True, timeout=2400)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    print(f"\nadd-on image built in {time.monotonic() - t0:.0f} s")
    data = tmp_path / "data"
    data.mkdir()
    (data / "options.json").write_text(json.dumps({**CONFIG["options"], "language": "en", "max_sessions": 2}))
    os.chmod(data, 0o777)
    wyoming, http = free_port(), free_port()
    name = f"whistle-addon-test-{os.getpid()}"
    podman("run", "-d", "--name", name, "-v", f"{data}:/data", "-e", f"WHISTLE_WYOMING_PORT={wyoming}",
           "-e", f"WHISTLE_PORT={http}", "-e", "WHISTLE_PROCESSES=1", IMAGE)
    clip = demo_stream(2, seed=11)[0]
    try:
        deadline = time.monotonic() + 300
        while podman("healthcheck", "run", name, check=False).returncode != 0:
            running = podman("inspect", name, "--format", "{{.State.Running}}", check=False).stdout.strip()
            assert running == "true" and time.monotonic() < deadline, podman("logs", name, check=False).stdout[-3000:]
            time.sleep(1)
        info = asyncio.run(describe(wyoming))
        ours = asyncio.run(wyoming_transcript(wyoming, clip))
        log = podman("logs", name, check=False)
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)
    (program,) = info.asr
    assert program.name == "whistle-stream" and program.models[0].languages == ["en"]
    assert "demo model" in program.models[0].description
    # the first start says what it does in plain lines, as `serve` does on a terminal
    lines = (log.stdout + log.stderr).splitlines()
    assert any(line.startswith("whistle-stream add-on: model demo, language en") for line in lines), lines[:20]
    assert any("ready in" in line and "loaded from the cache" in line for line in lines), lines[:20]
    assert not any(line.lstrip().startswith("{") for line in lines), lines[:20]        # no JSON lines
    port = free_port()
    with ServerProcess("--processes", "1", "--wyoming-port", str(port)):
        theirs = asyncio.run(wyoming_transcript(port, clip))
    assert ours and ours == theirs
