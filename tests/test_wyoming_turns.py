"""The end of a turn over Wyoming: the server's VAD decides when a command ends
(`requires_external_vad: false`), the `transcript` goes out while audio still arrives, each
`vad_sensitivity` sets the silence it waits for, and audio after the transcript is read and dropped.
Driven by the real `wyoming` package's client against a real server process (the demo model),
audio paced in real time as Home Assistant sends it."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from harness.audio import demo_stream
from harness.servers import ServerProcess, free_port
from whistle_stream.service import protocol as P
from whistle_stream.service.wyoming import MID_SENTENCE_WAIT_S, SENSITIVITY_MS, Dialect, Format

RATE = 16000
CHUNK = 1024                 # samples per audio-chunk, as Home Assistant sends them


@pytest.fixture(scope="module")
def command():
    """One held-out demo command: its audio up to the end of speech, and its text."""
    audio, text = demo_stream(1, seed=21)
    voiced = np.flatnonzero(np.abs(audio) > 0.01)
    return audio[:voiced[-1] + 1], text


# ---- the dialect on its own ---------------------------------------------------------------------

def _committed(text: str, end: bool) -> P.Committed:
    return P.Committed(seq=1, text=text, words=(), end_of_speech=end)


def _chunk(seconds: float):
    from wyoming.audio import AudioChunk
    return AudioChunk(rate=RATE, width=2, channels=1, audio=b"\0\0" * int(seconds * RATE)).event()


def test_an_utterance_that_ends_a_sentence_ends_the_turn_at_once():
    d = Dialect(Format(RATE, 2, 1), "en")
    d.outgoing(_committed("Turn on the", False))
    assert not d.turn_over
    d.outgoing(_committed("kitchen lights.", True))
    assert d.turn_over


def test_one_that_stops_mid_sentence_waits_for_more_silence_or_goes_on_with_more_speech():
    d = Dialect(Format(RATE, 2, 1), "en")
    d.outgoing(_committed("Set a timer for", True))
    assert not d.turn_over
    d.incoming(_chunk(MID_SENTENCE_WAIT_S / 2))
    d.speech_started(3.0)                       # "... twelve minutes."
    d.incoming(_chunk(MID_SENTENCE_WAIT_S))
    assert not d.turn_over
    d.outgoing(_committed("twelve minutes", True))
    d.incoming(_chunk(MID_SENTENCE_WAIT_S * 0.9))
    assert not d.turn_over
    d.incoming(_chunk(MID_SENTENCE_WAIT_S * 0.2))
    assert d.turn_over


def test_silence_alone_never_ends_a_turn():
    d = Dialect(Format(RATE, 2, 1), "en")
    d.outgoing(_committed("", True))
    d.incoming(_chunk(5.0))
    assert not d.turn_over


# ---- a real server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    port = free_port()
    with ServerProcess("--processes", "1", "--wyoming-port", str(port)) as s:
        s.wyoming = port
        yield s


async def speak(port: int, audio: np.ndarray, *, sensitivity: str | None = "default", tail_s: float = 4.0,
                after_s: float = 1.0, stop: bool = True, client=None):
    """Home Assistant with no VAD of its own: transcribe, audio-start, the command and then
    silence in real time until the transcript comes (and `after_s` more, as a client that has not
    noticed yet), then audio-stop. Returns (the transcript's text or None, audio seconds sent when it
    came, events after it, the client still connected)."""
    from wyoming.asr import Transcribe, Transcript
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    if client is None:
        client = AsyncTcpClient("127.0.0.1", port)
        await client.connect()
    got: dict = {}
    after: list = []
    sent = [0.0]

    async def read():
        while True:
            event = await client.read_event()
            if event is None:
                return
            if Transcript.is_type(event.type) and "text" not in got:
                got.update(text=Transcript.from_event(event).text, at=sent[0])
            elif "text" in got:
                after.append(event)

    reader = asyncio.create_task(read())
    await client.write_event(Transcribe(language="en", vad_sensitivity=sensitivity).event())
    await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
    pcm = (np.clip(np.concatenate([audio, np.zeros(int(tail_s * RATE), np.float32)]), -1, 1) * 32767).astype("<i2")
    t0, extra = time.monotonic(), None
    for i in range(0, len(pcm), CHUNK):
        await client.write_event(AudioChunk(rate=RATE, width=2, channels=1, audio=pcm[i:i + CHUNK].tobytes()).event())
        sent[0] = (i + CHUNK) / RATE
        if "text" in got and extra is None:
            extra = sent[0] + after_s
        if extra is not None and sent[0] >= extra:
            break
        await asyncio.sleep(max(0.0, t0 + sent[0] - time.monotonic()))
    if stop:
        await client.write_event(AudioStop().event())
    await asyncio.sleep(1.0)
    reader.cancel()
    return got.get("text"), got.get("at"), after, client


def test_info_tells_home_assistant_it_needs_no_vad_of_its_own(server):
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info

    async def run():
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            await client.write_event(Describe().event())
            return Info.from_event(await asyncio.wait_for(client.read_event(), 10))
    (program,) = asyncio.run(run()).asr
    assert program.requires_external_vad is False


def test_the_transcript_comes_without_audio_stop_and_the_connection_goes_on(server, command):
    from wyoming.info import Describe

    audio, text = command
    transcript, at, after, client = asyncio.run(_and_close(speak(server.wyoming, audio, stop=False)))
    assert transcript and at is not None, "no transcript before audio-stop"
    assert at < len(audio) / RATE + 2.5, (at, len(audio) / RATE)
    assert [e.type for e in after] == ["transcript-stop"], after          # and nothing else
    # audio after the transcript, then audio-stop: no second transcript; the connection answers on

    async def then():
        text2, _, after2, c = await speak(server.wyoming, audio, after_s=1.5)
        try:
            await c.write_event(Describe().event())
            info = await asyncio.wait_for(c.read_event(), 10)
            text3, _, _, _ = await speak(server.wyoming, audio, client=c)   # a new transcribe: a new transcript
        finally:
            await c.disconnect()
        return text2, after2, info, text3
    text2, after2, info, text3 = asyncio.run(then())
    assert text2 == transcript == text3 and info.type == "info"
    assert not [e for e in after2 if e.type in ("transcript", "transcript-start")], after2


async def _and_close(coro):
    text, at, after, client = await coro
    await client.disconnect()
    return text, at, after, client


def test_each_vad_sensitivity_waits_its_own_silence(server, command):
    audio, _ = command
    speech_s = len(audio) / RATE
    waited = {}
    for level in ("aggressive", "default", "relaxed"):
        text, at, _, _ = asyncio.run(_and_close(speak(server.wyoming, audio, sensitivity=level)))
        assert text, level
        waited[level] = at - speech_s
    print(f"\nfrom the last loud sample to the transcript: {waited}")
    # The VAD hears the speech end before the last quiet samples: measured from the last sample
    # over -40 dBFS, each level waits what it adds to the others' silence (two chunks' slack), in
    # order, and none waits more than its silence and a second.
    for a, b in (("aggressive", "default"), ("default", "relaxed")):
        expected = (SENSITIVITY_MS[b] - SENSITIVITY_MS[a]) / 1000
        assert abs(waited[b] - waited[a] - expected) <= 2 * CHUNK / RATE, waited
    assert all(waited[level] <= ms / 1000 + 1.0 for level, ms in SENSITIVITY_MS.items()), waited


def test_a_bad_vad_sensitivity_is_named_with_what_is_accepted(server):
    from wyoming.asr import Transcribe
    from wyoming.client import AsyncTcpClient

    async def run():
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            await client.write_event(Transcribe(language="en", vad_sensitivity="eager").event())
            return await asyncio.wait_for(client.read_event(), 10)
    event = asyncio.run(run())
    assert event.type == "error" and "vad_sensitivity 'eager' is not accepted; aggressive, default, relaxed" \
        in event.data["text"], event


# ---- the benchmark, on its short setting ------------------------------------------------------

@pytest.mark.slow
def test_the_turns_benchmark_measures_every_dialect_and_the_ratio_to_home_assistant_s_vad():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "benchmarks/turns.py", "--short"], cwd=root, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    print(out[out.index("commands x"):] if "commands x" in out else out)
    summary = out[out.index("commands x"):]
    for dialect in ("wyoming+ha-vad (default)", "wyoming, our end (default)", "wyoming, our end (default), paused",
                    "realtime+server-vad (600 ms)", "realtime+commit (200 ms)", "native+finalize"):
        row = next(line for line in summary.splitlines() if line.startswith(dialect + " "))
        assert re.search(r"p50 +-?\d+ ms +p99 +-?\d+ ms +waits +\d+ ms +after it p50 +-?\d+ ms", row), row
    assert re.search(r"its VAD / ours \(p50\) = \d+\.\d\dx", summary)
    assert re.search(r"our end read \d+ of 3 as Home Assistant's VAD did", summary)
