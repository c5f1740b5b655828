"""Home Assistant's Wyoming protocol and OpenAI Realtime transcription, driven by the real `wyoming`
package's `AsyncTcpClient` and the official `openai` SDK against one real server process (the
bundled demo model) on loopback: the transcript against our own protocol's, text streamed before
the audio ends, the bad-input table, and a full server refusing in each dialect's own way."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import soxr

from harness.audio import demo_stream
from harness.servers import ServerProcess, free_port
from harness.wer import wer
from whistle_stream.clients.client import ListenClient

pytestmark = pytest.mark.slow
TOKEN = "agents-t0ken"
RATE = 16000
CHUNK = 1024                 # samples per audio-chunk, as Home Assistant sends them


@pytest.fixture(scope="module")
def server():
    port = free_port()
    # Wyoming here transcribes whole clips, up to the client's audio-stop (test_wyoming_turns.py: the
    # server ending a command's turn itself, the default)
    with ServerProcess("--token", TOKEN, "--max-sessions", "3", "--wyoming-port", str(port),
                       "--wyoming-end-of-turn", "false") as s:
        s.wyoming = port
        yield s


@pytest.fixture(scope="module")
def clips():
    """Five held-out demo sentences with pauses: (16 kHz audio, the sentences' text)."""
    return demo_stream(5, seed=7)


@pytest.fixture(scope="module")
def ours(server, clips):
    """Our own protocol on the same audio: the committed transcript of /v1/listen."""
    async def run():
        async with ListenClient(server.url, token=TOKEN) as c:
            for i in range(0, len(clips[0]), 1600):
                await c.send_audio(clips[0][i:i + 1600])
            await c.close()
        return c.text
    return asyncio.run(run())


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).round().astype("<i2").tobytes()


# ---- Wyoming ----------------------------------------------------------------------------------

async def wyoming_transcribe(port: int, audio: np.ndarray, *, language: str | None = "en", rate: int = RATE,
                             width: int = 2, channels: int = 1, pace: float = 0.0, client=None):
    """What Home Assistant's integration does: transcribe, audio-start, 1024-sample chunks,
    audio-stop, then read to `transcript`. Returns (events with the audio sent when each arrived,
    seconds of audio sent)."""
    from wyoming.asr import Transcribe
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    own = client is None
    client = client or AsyncTcpClient("127.0.0.1", port)
    if own:
        await client.connect()
    events: list = []
    sent = [0.0]

    async def read():
        while True:
            event = await client.read_event()
            if event is None:
                return
            events.append((event, sent[0]))
            if event.type in ("transcript-stop", "error"):
                return

    reader = asyncio.create_task(read())
    await client.write_event(Transcribe(language=language).event())
    await client.write_event(AudioStart(rate=rate, width=width, channels=channels).event())
    if rate != RATE:
        audio = soxr.resample(audio, RATE, rate)
    data = pcm16(audio) if width == 2 else _pcm(audio, width)
    if channels > 1:
        frames = np.frombuffer(data, np.uint8).reshape(-1, width)
        data = np.repeat(frames, channels, axis=0).tobytes()
    step = CHUNK * width * channels
    for i in range(0, len(data), step):
        await client.write_event(AudioChunk(rate=rate, width=width, channels=channels, audio=data[i:i + step]).event())
        sent[0] = min(len(data), i + step) / (width * channels) / rate
        if pace:
            await asyncio.sleep(pace)
        if reader.done():
            break
    if not reader.done():
        await client.write_event(AudioStop().event())
    await asyncio.wait_for(reader, 120)
    if own:
        await client.disconnect()
    return events, sent[0]


def _pcm(audio: np.ndarray, width: int) -> bytes:
    if width == 4:
        return (np.clip(audio, -1, 1) * (2 ** 31 - 1)).astype("<i4").tobytes()
    if width == 1:
        return (np.clip(audio, -1, 1) * 127 + 128).astype(np.uint8).tobytes()
    raise ValueError(width)


def test_wyoming_describe_says_what_home_assistant_reads(server):
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info

    async def run():
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            await client.write_event(Describe().event())
            return Info.from_event(await client.read_event())
    info = asyncio.run(run())
    (program,) = info.asr
    assert program.installed and program.supports_transcript_streaming is True and program.version
    (model,) = program.models
    assert model.name == "demo.cact" and "en" in model.languages and model.installed
    # what a Home Assistant user reads: the model, its languages, and what the demo model hears
    assert "demo model (en)" in model.description and "synthetic voices" in model.description
    assert model.description in program.description
    assert program.requires_external_vad is True        # --wyoming-end-of-turn false: the client's VAD ends it


def test_wyoming_streams_committed_text_and_reads_as_our_protocol(server, clips, ours):
    from wyoming.asr import Transcript, TranscriptChunk

    events, _ = asyncio.run(wyoming_transcribe(server.wyoming, clips[0], pace=0.004))
    kinds = [e.type for e, _ in events]
    assert kinds[0] == "transcript-start" and kinds[-2:] == ["transcript", "transcript-stop"], kinds
    chunks = [(TranscriptChunk.from_event(e).text, at) for e, at in events if e.type == "transcript-chunk"]
    transcript = Transcript.from_event(next(e for e, _ in events if e.type == "transcript"))
    assert "".join(text for text, _ in chunks).strip() == transcript.text      # the chunks add up to it
    assert transcript.language == "en"
    truth = clips[1]
    print(f"\nWyoming WER {100 * wer([truth], [transcript.text]):.1f} %, /v1/listen {100 * wer([truth], [ours]):.1f} %")
    assert wer([truth], [transcript.text]) <= wer([truth], [ours]) + 0.01
    total = len(clips[0]) / RATE
    assert len(chunks) >= 2 and chunks[0][1] < total - 2.0                    # text before the audio ended


def test_wyoming_converts_rate_width_and_channels_and_runs_several_on_one_connection(server, clips):
    from wyoming.client import AsyncTcpClient

    audio = clips[0][: int(6 * RATE)]

    async def run():
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            plain, _ = await wyoming_transcribe(server.wyoming, audio, client=client)
            stereo, _ = await wyoming_transcribe(server.wyoming, audio, rate=44100, width=4, channels=2, client=client)
            return plain, stereo
    plain, stereo = asyncio.run(run())
    text = [next(e.data["text"] for e, _ in got if e.type == "transcript") for got in (plain, stereo)]
    assert text[0] and wer([text[0]], [text[1]]) <= 0.2, text


@pytest.mark.parametrize("case", ["unknown_language", "audio_before_start", "bad_width", "odd_bytes",
                                  "unknown_event", "oversized", "not_json"])
def test_wyoming_bad_input_gets_an_error_event_and_the_connection_goes_on(server, case):
    from wyoming.asr import Transcribe
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.event import Event
    from wyoming.info import Describe

    async def run():
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            if case == "unknown_language":
                await client.write_event(Transcribe(language="xx").event())
            elif case == "audio_before_start":
                await client.write_event(AudioChunk(rate=RATE, width=2, channels=1, audio=b"\0" * 64).event())
            elif case == "bad_width":
                await client.write_event(AudioStart(rate=RATE, width=5, channels=1).event())
            elif case == "odd_bytes":
                await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
                await client.write_event(AudioChunk(rate=RATE, width=2, channels=1, audio=b"\0" * 3).event())
            elif case == "unknown_event":
                await client.write_event(Event(type="synthesize", data={"text": "hi"}))
            elif case == "oversized":
                client._writer.write(json.dumps({"type": "audio-chunk", "payload_length": 1 << 30}).encode() + b"\n")
                await client._writer.drain()
            elif case == "not_json":
                client._writer.write(b"this is not an event\n")
                await client._writer.drain()
            error = await asyncio.wait_for(client.read_event(), 30)
            after = None
            if case not in ("oversized", "not_json"):   # the framing holds: the connection goes on
                if case == "odd_bytes":
                    await client.write_event(AudioStop().event())
                    while (e := await asyncio.wait_for(client.read_event(), 30)).type != "transcript-stop":
                        pass
                await client.write_event(Describe().event())
                after = await asyncio.wait_for(client.read_event(), 30)
            else:
                after = await asyncio.wait_for(client.read_event(), 30)   # the server closed: None
            return error, after
    error, after = asyncio.run(run())
    if case == "odd_bytes":   # the transcription opened first, then the bad chunk's error
        assert error.type == "transcript-start"
        return
    assert error.type == "error" and error.data["text"] and error.data["code"], error
    if case in ("oversized", "not_json"):
        assert after is None
    else:
        assert after.type == "info"


# ---- OpenAI Realtime --------------------------------------------------------------------------

def realtime_client(server, key=TOKEN):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=server.http + "/v1", api_key=key, max_retries=0)


async def realtime_transcribe(server, audio: np.ndarray, *, session: dict | None = None, commit: bool = False,
                              key=TOKEN, beta: bool = False, events=None):
    """Stream `audio` (16 kHz, sent as 24 kHz pcm16 in 100 ms appends), then commit or wait, and
    return every event with the audio sent when it arrived."""
    pcm = pcm16(soxr.resample(audio, RATE, 24000))
    got: list = []
    sent = [0.0]
    headers = {"OpenAI-Beta": "realtime=v1"} if beta else {}
    async with realtime_client(server, key).realtime.connect(extra_query={"intent": "transcription"},
                                                             extra_headers=headers) as conn:
        if session is not None:
            await conn.send({"type": "transcription_session.update" if beta else "session.update", "session": session})
        for e in events or ():
            await conn.send(e)

        async def receive():
            async for event in conn:
                got.append((event, sent[0]))
        task = asyncio.create_task(receive())
        step = 4800 * 2
        for i in range(0, len(pcm), step):
            await conn.send({"type": "input_audio_buffer.append",
                             "audio": base64.b64encode(pcm[i:i + step]).decode()})
            sent[0] = min(len(pcm), i + step) / 2 / 24000
            await asyncio.sleep(0.01)
        if commit:
            await conn.send({"type": "input_audio_buffer.commit"})
        deadline = asyncio.get_running_loop().time() + 60
        expect = len(got)
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
            done = [e for e, _ in got if e.type == "conversation.item.input_audio_transcription.completed"]
            if (commit and done and got[-1][0].type.endswith("completed")) or (not commit and len(got) == expect
                                                                              and done):
                break
            expect = len(got)
        task.cancel()
    return got


GA_SESSION = {"type": "transcription", "audio": {"input": {
    "format": {"type": "audio/pcm", "rate": 24000},
    "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
    "turn_detection": {"type": "server_vad", "silence_duration_ms": 600, "prefix_padding_ms": 300,
                       "threshold": 0.5}}}}


def test_realtime_deltas_arrive_while_talking_and_items_read_as_our_protocol(server, clips, ours):
    got = asyncio.run(realtime_transcribe(server, clips[0], session=GA_SESSION))
    kinds = [e.type for e, _ in got]
    assert kinds[0] == "session.created" and "session.updated" in kinds
    assert type(got[0][0]).__name__ == "SessionCreatedEvent"          # parsed by the SDK as its own type
    deltas = [(e, at) for e, at in got if e.type == "conversation.item.input_audio_transcription.delta"]
    completed = [e for e, _ in got if e.type == "conversation.item.input_audio_transcription.completed"]
    assert "input_audio_buffer.speech_started" in kinds and "input_audio_buffer.committed" in kinds
    assert "conversation.item.added" in kinds and "input_audio_buffer.speech_stopped" in kinds
    for item in completed:   # each item's deltas join to its transcript
        assert "".join(e.delta for e, _ in deltas if e.item_id == item.item_id) == item.transcript
    transcript = " ".join(e.transcript for e in completed if e.transcript)
    truth = clips[1]
    print(f"\nRealtime WER {100 * wer([truth], [transcript]):.1f} %, /v1/listen {100 * wer([truth], [ours]):.1f} %")
    assert wer([truth], [transcript]) <= wer([truth], [ours]) + 0.01
    total = len(clips[0]) / RATE
    assert len(completed) >= 3 and deltas[0][1] < total - 2.0                # text before the audio ended
    committed = [e for e, _ in got if e.type == "input_audio_buffer.committed"]
    assert committed[0].previous_item_id is None
    assert [c.previous_item_id for c in committed[1:]] == [c.item_id for c in committed[:-1]]


def test_realtime_beta_form_and_a_client_commit_without_turn_detection(server, clips):
    audio = clips[0][: int(5 * RATE)]
    session = {"input_audio_format": "pcm16", "input_audio_transcription": {"model": "whisper-1", "language": "en"},
               "turn_detection": None}
    got = asyncio.run(realtime_transcribe(server, audio, session=session, commit=True, beta=True))
    kinds = [e.type for e, _ in got]
    assert kinds[0] == "transcription_session.created" and "transcription_session.updated" in kinds
    assert "input_audio_buffer.speech_started" not in kinds                    # no server VAD
    (completed,) = [e for e, _ in got if e.type == "conversation.item.input_audio_transcription.completed"]
    assert completed.transcript and "conversation.item.created" in kinds


@pytest.mark.parametrize("bad,code", [
    ({"type": "input_audio_buffer.append", "audio": "%%% not base64"}, "bad_audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\0\0\0").decode()}, "bad_audio"),
    ({"type": "response.create"}, "unknown_type"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000}}}}}, "unsupported_encoding"),
    ({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "transcription": {"language": "xx"}}}}}, "bad_message"),
    ({"type": "session.update", "session": {"type": "realtime"}}, "bad_message"),
    ("{not json", "malformed_json"),
])
def test_realtime_bad_input_gets_openai_error_events_and_the_session_goes_on(server, clips, bad, code):
    async def run():
        async with realtime_client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
            created = await conn.recv()
            if isinstance(bad, str):
                await conn._connection.send(bad)
            else:
                await conn.send({**bad, "event_id": "evt_client_1"})
            error = await asyncio.wait_for(conn.recv(), 30)
            await conn.send({"type": "session.update", "session": GA_SESSION})   # still served
            after = await asyncio.wait_for(conn.recv(), 30)
            return created, error, after
    created, error, after = asyncio.run(run())
    assert created.type == "session.created"
    assert error.type == "error" and error.error.code == code and error.error.message
    assert error.error.type == "invalid_request_error"
    if not isinstance(bad, str):
        assert error.error.event_id == "evt_client_1"
    assert after.type == "session.updated"


def test_realtime_wrong_key_is_refused_with_an_error_event(server):
    async def run():
        async with realtime_client(server, key="wrong").realtime.connect(extra_query={"intent": "transcription"}) as conn:
            return await asyncio.wait_for(conn.recv(), 30)
    error = asyncio.run(run())
    assert error.type == "error" and error.error.code == "unauthorized"


# ---- Both: a full server ------------------------------------------------------------------------

def test_a_full_server_refuses_in_each_dialect_s_own_way(server):
    from wyoming.client import AsyncTcpClient
    from wyoming.audio import AudioStart

    async def run():
        held = [ListenClient(server.url, token=TOKEN, resume=False) for _ in range(3)]
        for c in held:
            await c.connect()
        try:
            async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
                await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
                wyoming_error = await asyncio.wait_for(client.read_event(), 30)
            async with realtime_client(server).realtime.connect(extra_query={"intent": "transcription"}) as conn:
                realtime_error = await asyncio.wait_for(conn.recv(), 30)
        finally:
            for c in held:
                await c.close()
        return wyoming_error, realtime_error
    wyoming_error, realtime_error = asyncio.run(run())
    assert wyoming_error.type == "error" and wyoming_error.data["code"] == "server_full"
    assert realtime_error.type == "error" and realtime_error.error.code == "server_full"


def test_metrics_count_sessions_by_dialect(server, clips):
    import urllib.request

    asyncio.run(wyoming_transcribe(server.wyoming, clips[0][: 2 * RATE]))
    asyncio.run(realtime_transcribe(server, clips[0][: 2 * RATE], session=GA_SESSION, commit=True))
    text = urllib.request.urlopen(server.http + "/metrics", timeout=10).read().decode()
    counts = {d: float(next(line.split()[-1] for line in text.splitlines()
                            if line.startswith(f'whistle_sessions_total{{dialect="{d}"}}')))
              for d in ("wyoming", "realtime")}
    assert counts["wyoming"] >= 1 and counts["realtime"] >= 1, counts


def test_wyoming_is_advertised_over_zeroconf_and_drained_on_sigterm(clips):
    """A server of its own: `--wyoming-zeroconf` is found by a zeroconf browser (on loopback), and
    SIGTERM during a transcription still answers it with its transcript before the exit."""
    from wyoming.asr import Transcribe
    from wyoming.audio import AudioChunk, AudioStart
    from wyoming.client import AsyncTcpClient
    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

    async def browse():
        zc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
        found: list = []

        class Listener:
            def add_service(self, zc_, kind, name):
                found.append(name)

            def update_service(self, *_):
                pass

            def remove_service(self, *_):
                pass

        browser = AsyncServiceBrowser(zc.zeroconf, "_wyoming._tcp.local.", listener=Listener())
        for _ in range(50):
            if found:
                break
            await asyncio.sleep(0.2)
        info = await zc.async_get_service_info("_wyoming._tcp.local.", found[0]) if found else None
        await browser.async_cancel()
        await zc.async_close()
        return info

    async def transcribe_then_sigterm(server):
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            await client.write_event(Transcribe(language="en").event())
            await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
            data = pcm16(clips[0][: 6 * RATE])
            for i in range(0, len(data), 2 * CHUNK):
                await client.write_event(AudioChunk(rate=RATE, width=2, channels=1, audio=data[i:i + 2 * CHUNK]).event())
            await asyncio.sleep(1.0)
            server.proc.terminate()   # no audio-stop: the drain ends the transcription
            events = []
            while (event := await asyncio.wait_for(client.read_event(), 60)) is not None:
                events.append(event)
                if event.type == "transcript-stop":
                    break
            return events

    port = free_port()
    with ServerProcess("--wyoming-port", str(port), "--wyoming-zeroconf") as s:
        s.wyoming = port
        info = asyncio.run(browse())
        assert info is not None and info.port == port
        events = asyncio.run(transcribe_then_sigterm(s))
        assert s.proc.wait(60) == 0
    kinds = [e.type for e in events]
    assert kinds[0] == "transcript-start" and kinds[-2:] == ["transcript", "transcript-stop"], kinds
    assert events[-2].data["text"]


def test_a_transcription_the_server_ends_early_drops_the_rest_of_its_audio_quietly():
    """--max-session-seconds 1: the limit's error and the transcript come once; the audio the client
    still sends up to its audio-stop is dropped without an error per chunk, and the connection goes on."""
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe

    port = free_port()
    with ServerProcess("--wyoming-port", str(port), "--max-session-seconds", "1") as s:
        async def run():
            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
                chunk = AudioChunk(rate=RATE, width=2, channels=1, audio=b"\1\0" * CHUNK).event()
                for _ in range(24):   # 1.5 s of audio into a session limited to 1 s
                    await client.write_event(chunk)
                seen = []
                while (event := await asyncio.wait_for(client.read_event(), 30)).type != "transcript-stop":
                    seen.append((event.type, (event.data or {}).get("code")))
                seen.append((event.type, None))
                await asyncio.sleep(0.5)   # the transcription is over; the client has not noticed yet
                for _ in range(5):
                    await client.write_event(chunk)
                await client.write_event(AudioStop().event())
                await client.write_event(Describe().event())
                while (event := await asyncio.wait_for(client.read_event(), 30)).type != "info":
                    seen.append((event.type, (event.data or {}).get("code")))
                return seen
        seen = asyncio.run(run())
    assert seen.count(("error", "session_limit")) == 1 and seen[-1][0] == "transcript-stop", seen
    assert [e for e in seen if e[0] == "error"] == [("error", "session_limit")], seen
