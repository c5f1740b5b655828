"""The interfaces users already have clients for, driven by the official `openai` and `deepgram-sdk`
packages against one real server process (the bundled demo model) on loopback."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import soundfile

from harness.audio import demo_stream
from harness.servers import ServerProcess
from harness.wer import wer
from whistle_stream.clients.client import ListenClient

pytestmark = pytest.mark.slow
TOKEN = "compat-t0ken"
RATE = 16000


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--token", TOKEN, "--max-sessions", "4") as s:
        yield s


@pytest.fixture(scope="module")
def clips():
    """Six held-out demo sentences with pauses: (16 kHz audio, the sentences' text)."""
    return demo_stream(6, seed=4)


@pytest.fixture(scope="module")
def wav_bytes(clips):
    out = io.BytesIO()
    soundfile.write(out, clips[0], RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


@pytest.fixture(scope="module")
def ours(server, clips):
    """Our own protocol on the same audio: the committed transcript of /v1/listen."""
    async def run():
        async with ListenClient(server.url, token=TOKEN) as c:
            audio = clips[0]
            for i in range(0, len(audio), 1600):
                await c.send_audio(audio[i:i + 1600])
            await c.close()
        return c.text
    return asyncio.run(run())


def openai_client(server, key=TOKEN):
    from openai import OpenAI

    return OpenAI(base_url=server.http + "/v1", api_key=key, max_retries=0)


# ---- OpenAI -----------------------------------------------------------------------------------

def test_openai_json_reads_within_the_line_of_our_own_protocol(server, clips, wav_bytes, ours):
    result = openai_client(server).audio.transcriptions.create(model="whisper-1", file=("six.wav", wav_bytes))
    truth = clips[1]
    print(f"\nOpenAI WER {100 * wer([truth], [result.text]):.1f} %, /v1/listen {100 * wer([truth], [ours]):.1f} %")
    assert wer([truth], [result.text]) <= wer([truth], [ours]) + 0.02


def test_openai_verbose_json_has_word_times_and_segments(server, clips, wav_bytes):
    r = openai_client(server).audio.transcriptions.create(
        model="whisper-1", file=("six.wav", wav_bytes), response_format="verbose_json",
        timestamp_granularities=["word", "segment"])
    assert r.language == "english" and r.duration == pytest.approx(len(clips[0]) / RATE, abs=0.01)
    words = r.words
    assert [w.word for w in words] == r.text.split()
    assert all(0 <= w.start <= w.end <= r.duration for w in words)
    assert [w.start for w in words] == sorted(w.start for w in words)
    assert " ".join(s.text.strip() for s in r.segments) == r.text
    assert r.segments[0].start == words[0].start and r.segments[-1].end == words[-1].end


@pytest.mark.parametrize("fmt", ["srt", "vtt", "text"])
def test_openai_subtitles_and_text_parse(server, wav_bytes, fmt):
    import srt
    import webvtt

    client = openai_client(server)
    body = client.audio.transcriptions.create(model="whisper-1", file=("six.wav", wav_bytes), response_format=fmt)
    body = body if isinstance(body, str) else getattr(body, "text", str(body))
    verbose = client.audio.transcriptions.create(model="whisper-1", file=("six.wav", wav_bytes),
                                                 response_format="verbose_json", timestamp_granularities=["word"])
    if fmt == "text":
        assert body.strip() == verbose.text
        return
    cues = ([(c.start.total_seconds(), c.end.total_seconds(), c.content) for c in srt.parse(body)] if fmt == "srt"
            else [(c.start_in_seconds + int(c.start[-3:]) / 1000, c.end_in_seconds + int(c.end[-3:]) / 1000, c.text)
                  for c in webvtt.from_buffer(io.StringIO(body))])
    assert " ".join(c[2].replace("\n", " ") for c in cues).split() == verbose.text.split()
    starts = {round(w.start, 3) for w in verbose.words}
    assert all(round(c[0], 3) in starts for c in cues)       # every cue opens on a committed word's start


def test_openai_errors_come_as_the_sdk_raises_them(server, wav_bytes):
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai_client(server, key="wrong").audio.transcriptions.create(model="whisper-1", file=("a.wav", wav_bytes))
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(server).audio.transcriptions.create(model="whisper-1", file=("a.wav", b"not audio"))
    assert "not a readable audio file" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(server).audio.transcriptions.create(model="whisper-1", file=("a.wav", wav_bytes),
                                                          response_format="pdf")
    assert "response_format" in str(info.value)
    models = openai_client(server).models.list()
    assert [m.id for m in models.data] == ["demo.cact"]


# ---- Deepgram ---------------------------------------------------------------------------------

def deepgram_client(server, key=TOKEN):
    from deepgram import AsyncDeepgramClient
    from deepgram.environment import DeepgramClientEnvironment

    base = f"127.0.0.1:{server.port}/deepgram"
    env = DeepgramClientEnvironment(base="http://" + base, production="ws://" + base, agent="ws://" + base,
                                    agent_rest="http://" + base)
    return AsyncDeepgramClient(api_key=key, environment=env)


async def deepgram_stream(server, audio, *, finalize_at=None, **options):
    """Stream `audio` in real-time-sized frames (sent fast), Finalize at `finalize_at` seconds if
    given, then CloseStream; returns every message the SDK parsed."""
    pcm = (np.clip(audio, -1, 1) * 32767).round().astype("<i2")
    got = []
    async with deepgram_client(server).listen.v1.connect(model="nova-3", encoding="linear16", sample_rate=RATE,
                                                        **options) as conn:
        async def receive():
            async for message in conn:
                got.append(message)
        task = asyncio.create_task(receive())
        for i in range(0, len(pcm), 1600):
            await conn.send_media(pcm[i:i + 1600].tobytes())
            if finalize_at is not None and i <= finalize_at * RATE < i + 1600:
                await conn.send_finalize()
            await asyncio.sleep(0.005)
        await conn.send_close_stream()
        await asyncio.wait_for(task, 120)
    return got


def test_deepgram_results_carry_our_protocol_s_transcript(server, clips, ours):
    got = asyncio.run(deepgram_stream(server, clips[0], interim_results=True, vad_events=True,
                                      utterance_end_ms=1000))
    kinds = [type(m).__name__ for m in got]
    finals = [m for m in got if type(m).__name__ == "ListenV1Results" and m.is_final]
    transcript = " ".join(t for t in (m.channel.alternatives[0].transcript for m in finals) if t)
    assert transcript == ours.strip()                        # the same session core as /v1/listen
    assert "ListenV1SpeechStarted" in kinds and kinds[-1] == "ListenV1Metadata"
    assert any(m.speech_final for m in finals) and "ListenV1UtteranceEnd" in kinds
    assert any(type(m).__name__ == "ListenV1Results" and not m.is_final for m in got)   # interim results
    words = [w for m in finals for w in m.channel.alternatives[0].words]
    assert [w.punctuated_word for w in words] == transcript.split()
    assert all(0 <= w.start <= w.end and 0 < w.confidence <= 1 for w in words)
    assert got[-1].duration == pytest.approx(len(clips[0]) / RATE, abs=0.05)


def test_deepgram_finalize_and_close_stream_flush_everything(server, clips):
    audio = clips[0][: int(4.5 * RATE)]   # stops mid-speech: only Finalize / CloseStream commit the tail
    got = asyncio.run(deepgram_stream(server, audio, finalize_at=len(audio) / RATE - 0.05))
    finals = [m for m in got if type(m).__name__ == "ListenV1Results" and m.is_final]
    assert any(m.from_finalize for m in finals)
    with_words = [m for m in finals if m.channel.alternatives[0].words]
    assert with_words and with_words[-1].channel.alternatives[0].words[-1].end > 3.0
    assert type(got[-1]).__name__ == "ListenV1Metadata"


def test_deepgram_refusals_come_as_the_sdk_raises_them(server):
    from deepgram.core.api_error import ApiError

    async def connect(key=TOKEN, **options):
        async with deepgram_client(server, key).listen.v1.connect(model="nova-3", **options):
            pass

    with pytest.raises(ApiError) as info:
        asyncio.run(connect(key="wrong", encoding="linear16", sample_rate=RATE))
    assert info.value.status_code == 401
    for bad in ({"encoding": "mulaw", "sample_rate": 8000}, {"encoding": "linear16", "diarize": True},
                {"encoding": "linear16", "channels": 2}):
        with pytest.raises(ApiError) as info:
            asyncio.run(connect(**bad))
        assert info.value.status_code == 400, bad
