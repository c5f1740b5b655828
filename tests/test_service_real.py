"""The service around the real engine (the default model, usually the bundled demo model).

Skipped when no model can be loaded. The expected outputs are not hard-coded: the server must
produce exactly what the engine's own stream produces for the same audio.
"""

import asyncio
import shutil
import subprocess
import wave

import numpy as np
import pytest
import soxr

from whistle_stream.clients.client import ListenClient, to_pcm
from whistle_stream.service import protocol as P
from whistle_stream.service.config import ServiceConfig
from whistle_stream.service.server import build_app

pytestmark = pytest.mark.slow

SENTENCES = ["The weather today is cold and windy, but tomorrow it should be warm and sunny.",
             "He walked to the station, bought a ticket and waited for the train."]


@pytest.fixture(scope="module")
def model():
    whistle = pytest.importorskip("whistle_stream")
    try:
        return whistle.Whistle()
    except (FileNotFoundError, ImportError, AttributeError) as e:
        pytest.skip(f"no model to load: {e}")


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    clips = []
    for i, text in enumerate(SENTENCES):
        path = tmp_path_factory.mktemp("speech") / f"{i}.wav"
        subprocess.run(["espeak-ng", "-s", "150", "-w", str(path), text], check=True)
        with wave.open(str(path)) as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
        clips.append(soxr.resample(pcm, rate, 16000).astype(np.float32))
    return clips


def engine_messages(model, audio: np.ndarray) -> list:
    """What protocol.Session makes of the engine's own stream over the same audio, fed as the server
    feeds it (whole 1 s steps, then the tail, then finish)."""
    # The clients send pcm_s16le: the engine must see the same int16-rounded samples the server decodes.
    audio = P.decode_audio(to_pcm(audio), "pcm_s16le")
    session = P.Session("ref", P.SessionConfig(vad=False), model.name, model.dims.languages)
    session.ready()
    stream = model.open_stream(step_s=1.0)
    out = []
    for i in range(0, len(audio) - len(audio) % 16000, 16000):
        out += session.results(stream.feed(audio[i:i + 16000]))
    if len(audio) % 16000:
        out += session.results(stream.feed(audio[len(audio) - len(audio) % 16000:]))
    return out + session.final(stream.finish(), "close")


async def stream_clip(url, audio, frame=1600):
    async with ListenClient(url, vad=False) as c:
        for i in range(0, len(audio), frame):
            await c.send_audio(audio[i:i + frame])
            await asyncio.sleep(0)
        await c.close()
    return c


@pytest.fixture
async def app(model):
    a = await build_app(model=model, config=ServiceConfig(port=0, max_sessions=16)).start()
    yield a
    await a.drain()


async def test_served_transcript_equals_the_engines_own_stream(app, model, speech):
    for audio in speech:
        c = await stream_clip(app.url, audio)
        expected = engine_messages(model, audio)
        committed = [m for m in expected if isinstance(m, P.Committed)]
        assert c.text == "".join(m.text for m in committed) == expected[-1].text
        assert [m.seq for m in c.committed] == list(range(1, len(c.committed) + 1))
        assert c.messages[-1].language == expected[-1].language


async def test_sixteen_concurrent_real_sessions_complete_correctly(app, model, speech):
    audio = speech[0]
    expected = engine_messages(model, audio)[-1].text
    clients = await asyncio.wait_for(asyncio.gather(*(stream_clip(app.url, audio) for _ in range(16))), 600)
    assert all(c.text == expected for c in clients)


async def test_two_engine_processes_serve_what_the_engine_streams_and_exit_with_the_server(model, speech):
    """`serve --processes 2`: sessions pinned to two worker processes get exactly the engine's own
    stream; the workers exit when the server closes."""
    app = await build_app(config=ServiceConfig(port=0, max_sessions=8, processes=2)).start()
    try:
        workers = app.model.workers
        assert len(workers) == 2 and all(w.process.is_alive() for w in workers)
        clients = await asyncio.wait_for(asyncio.gather(*(stream_clip(app.url, audio) for audio in speech * 2)), 600)
        for c, audio in zip(clients, speech * 2):
            expected = engine_messages(model, audio)
            assert c.text == expected[-1].text and c.messages[-1].language == expected[-1].language
    finally:
        await app.drain()
    assert not any(w.process.is_alive() for w in workers)
