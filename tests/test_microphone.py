"""whistle-listen on a real microphone path: PulseAudio with a null sink, a clip played into it with
`paplay`, and `whistle-listen --local` recording the sink's monitor through the real sounddevice,
PortAudio and ALSA's PulseAudio plugin. The fake sounddevice (test_listen.py) stays for the
error cases. `.ci/run` installs pulseaudio, pulseaudio-utils and libasound2-plugins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from harness.audio import demo_stream

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not all(shutil.which(t) for t in ("pulseaudio", "pactl", "paplay")),
                                 reason="PulseAudio is not installed (.ci/run installs it)")]

LISTEN = [str(Path(sys.executable).parent / "whistle-listen")]   # the console script, as users run it
RATE = 16000
SINK = "room"


@pytest.fixture(scope="module")
def pulse(tmp_path_factory):
    """A PulseAudio daemon of the test's own (its runtime folder private), with a null sink whose
    monitor is the default source: what a microphone records is what is played into the sink."""
    runtime = tmp_path_factory.mktemp("pulse")
    os.chmod(runtime, 0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "HOME": str(runtime)}
    started = subprocess.run(["pulseaudio", "-D", "--exit-idle-time=-1", "-n", "--load=module-native-protocol-unix",
                              f"--load=module-null-sink sink_name={SINK}", "--load=module-always-sink"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        subprocess.run(["pactl", "set-default-source", f"{SINK}.monitor"], env=env, check=True, timeout=30)
        yield env
    finally:
        subprocess.run(["pulseaudio", "--kill"], env=env, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> tuple[Path, float]:
    audio, _ = demo_stream(3, seed=5)
    path = tmp_path_factory.mktemp("mic") / "clip.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return path, len(audio) / RATE


def _recording(env: dict) -> bool:
    out = subprocess.run(["pactl", "list", "short", "source-outputs"], env=env, capture_output=True, text=True,
                         timeout=30)
    return bool(out.stdout.strip())


def test_the_microphone_hears_what_the_file_holds(pulse, clip):
    """The clip played into the room and heard through PortAudio comes out as `--file` reads it."""
    path, seconds = clip
    from_file = subprocess.run([*LISTEN, "--local", "--file", str(path), "--speed", "50"], env=pulse,
                               capture_output=True, text=True, timeout=600)
    assert from_file.returncode == 0, from_file.stderr[-2000:]
    mic = subprocess.Popen([*LISTEN, "--local", "--seconds", f"{seconds + 4:.1f}"], env=pulse,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300   # the model loads and the stream opens first
        while not _recording(pulse):
            assert mic.poll() is None and time.monotonic() < deadline, mic.stderr.read()[-2000:]
            time.sleep(0.1)
        time.sleep(0.5)
        subprocess.run(["paplay", "-d", SINK, str(path)], env=pulse, check=True, timeout=120)
        out, err = mic.communicate(timeout=300)
    finally:
        mic.kill()
    assert mic.returncode == 0, err[-2000:]
    assert from_file.stdout.strip() and out == from_file.stdout, (out, from_file.stdout)
