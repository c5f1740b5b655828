"""Sessions that survive: real server processes on loopback (the bundled demo model), a client
that resumes, and servers killed, drained and cut off under it."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import websockets

from harness.servers import ServerProcess
from harness.wer import seam_errors, wer
from whistle_stream.clients.client import REPLAY_LIMIT_S, ListenClient, ReplayBuffer, listen_url
from whistle_stream.service import protocol as P
from whistle_stream.service import resume as R

pytestmark = pytest.mark.slow
SECRET = "resume-test-secret-0123456789"
RATE = 16000
BLOCK = RATE // 10


@pytest.fixture(scope="module")
def speech():
    """Twelve held-out demo sentences with pauses: (audio, [(start, end, text)])."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from streaming import build_stream

    audio, utts = build_stream(12, seed=7)
    return audio, [(a, b, text) for a, b, text, _ in utts]


def server(*flags: str) -> ServerProcess:
    return ServerProcess("--resume-secret", SECRET, "--resume-ttl", "120", *flags).start()


async def stream(audio: np.ndarray, servers: list[ServerProcess], events: dict[float, str], speed: float = 4.0):
    """Stream `audio` to servers[0] at `speed` x real time; at each event time (audio seconds sent)
    do the event: "kill" (SIGKILL the server, start another on a new port), "term" (SIGTERM it,
    start another) or "cut" (abort the client's TCP connection). Returns the client."""
    client = ListenClient(servers[0].url, resume_retries=20, backoff=0.2, max_backoff=1.0)
    await client.connect()
    received: list[P.ServerMessage] = []

    async def receive():
        async for message in client:
            received.append(message)

    receiver = asyncio.create_task(receive())
    pending = sorted(events.items())
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    for i in range(0, len(audio), BLOCK):
        while pending and i / RATE >= pending[0][0]:
            _, what = pending.pop(0)
            if what == "cut":
                client.ws.transport.abort()          # no close frame: the client sees 1006
            else:
                old = servers[-1]
                if what == "kill":
                    old.proc.kill()
                else:
                    old.proc.terminate()              # drains: final(shutdown) with a token, 1001
                new = await loop.run_in_executor(None, server)
                servers.append(new)
                client.url = listen_url(new.url)      # the address the client reconnects to
                await loop.run_in_executor(None, old.stop)
        await client.send_audio(audio[i:i + BLOCK])
        delay = t0 + (i + BLOCK) / RATE / speed - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    await client.request_close()
    await asyncio.wait_for(receiver, 120)
    client.received = received
    return client


def words_of(client) -> list[dict]:
    return [{"word": w.word, "start": w.start, "end": w.end} for m in client.committed for w in m.words]


@pytest.fixture(scope="module")
def uninterrupted(speech):
    s = server()
    try:
        return asyncio.run(stream(speech[0], [s], {}))
    finally:
        s.stop()


def mid_utterance(utts, fractions):
    """Times in the middle of the utterances nearest the given fractions of the stream."""
    end = utts[-1][1]
    out = []
    for f in fractions:
        a, b, _ = min(utts, key=lambda u: abs((u[0] + u[1]) / 2 - f * end))
        out.append(round((a + b) / 2, 1))
    return out


@pytest.mark.parametrize("scenario", ["sigkill x3", "sigterm", "tcp cut x2"])
def test_a_stream_survives_with_no_committed_word_lost_or_doubled(speech, uninterrupted, scenario):
    audio, utts = speech
    what, times = {"sigkill x3": ("kill", [0.25, 0.5, 0.75]), "sigterm": ("term", [0.5]),
                   "tcp cut x2": ("cut", [0.33, 0.66])}[scenario]
    at = mid_utterance(utts, times)
    servers = [server()]
    try:
        client = asyncio.run(stream(audio, servers, {t: what for t in at}))
    finally:
        for s in servers:
            s.stop()
    seqs = [m.seq for m in client.committed]
    assert seqs == list(range(1, len(seqs) + 1))                        # no gap, no repeat
    words = words_of(client)
    starts = [w["start"] for w in words]
    assert starts == sorted(starts)                                    # times never go backwards
    assert client.reconnects == len(at)
    resumed_at = [e for s in servers for e in s.log if e.get("event") == "session_resumed"]
    assert len(resumed_at) == len(at)                                  # each reconnect resumed, none started afresh
    seams = seam_errors(words_of(uninterrupted), words, at, window=1.0,
                        truth=[(a, b, text) for a, b, text in utts])
    assert seams["dropped"] == [] and seams["doubled"] == [] and seams["across"] == [], seams
    truth = " ".join(u[2] for u in utts)
    ours, plain = wer([truth], [client.transcript]), wer([truth], [uninterrupted.transcript])
    print(f"\n{scenario}: WER {100 * ours:.2f} % against {100 * plain:.2f} % uninterrupted, "
          f"{len(seqs)} commits, interruptions at {at} s")
    assert ours <= plain + 0.01


# ---- bad tokens --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def token_server():
    s = server()
    yield s
    s.stop()


async def _one_token(url: str, audio: np.ndarray, **params) -> str:
    client = ListenClient(url, vad=False, **params)
    await client.connect()
    await client.send_audio(audio)
    final = await client.finalize()
    await client.ws.close()
    return final.resume


def _tampered(token: str) -> str:
    body, _, mac = token.partition(".")
    i = len(body) // 2
    return body[:i] + ("A" if body[i] != "A" else "B") + body[i + 1:] + "." + mac


def _expired(token: str) -> str:
    state = R.unseal(token, SECRET.encode(), time.time())
    return R.seal(state, SECRET.encode(), time.time() - 1000, ttl_s=10)


def test_bad_tokens_are_refused_and_a_parallel_session_carries_on(token_server, speech):
    audio = speech[0][: 4 * RATE]

    async def run():
        good = await _one_token(token_server.url, audio)
        other = R.seal(R.unseal(good, SECRET.encode(), time.time()), b"another-secret-0123456789", time.time())
        cases = {"tampered signature": _tampered(good), "other secret": other, "expired": _expired(good),
                 "truncated": good[: len(good) // 2], "10 kB long": good + "A" * 10_000,
                 "other parameters": good}
        parallel = ListenClient(token_server.url, vad=False)
        await parallel.connect()
        for name, bad in cases.items():
            extra = "&sample_rate=48000" if name == "other parameters" else ""
            url = token_server.url + "/v1/listen?" + "resume=" + bad + extra
            async with websockets.connect(url, max_size=2 ** 22) as ws:
                first = json.loads(await ws.recv())
                with pytest.raises(websockets.ConnectionClosed):
                    await ws.recv()
                assert first["type"] == "error" and first["code"] == "bad_resume", (name, first)
                assert ws.close_code == P.CloseCode.BAD_RESUME, name
            await parallel.send_audio(audio[: RATE // 2])       # the other session is unaffected
        final = await parallel.close()
        assert final.audio_seconds == pytest.approx(0.5 * len(cases), abs=0.01)
        async with websockets.connect(token_server.url + "/v1/listen?resume=" + good) as ws:   # still good
            ready = json.loads(await ws.recv())
            assert ready["type"] == "ready" and ready["resumed"] and ready["seq"] >= 1

    asyncio.run(run())


# ---- the client's replay buffer ------------------------------------------------------------------

def test_the_replay_buffer_stays_bounded_over_ten_minutes():
    """Ten minutes of audio through a ReplayBuffer: with the server settling every 2 s it holds a
    few seconds; when the server stops settling it holds REPLAY_LIMIT_S at most."""
    buf = ReplayBuffer(RATE, 2)
    block = bytes(2 * BLOCK)
    most = 0.0
    for k in range(10 * 60 * 10):             # 0.1 s blocks
        buf.add(block)
        if k % 20 == 0 and k < 3000:          # settles for five minutes, then stops
            buf.settle(k / 10 - 1.0)
        most = max(most, buf.seconds)
        if k == 2999:
            assert buf.seconds <= 3.2
    assert most <= REPLAY_LIMIT_S + 1e-9 and buf.seconds == pytest.approx(REPLAY_LIMIT_S)
    assert buf.since(600 - REPLAY_LIMIT_S - 1) is None and len(buf.since(600 - 1.0)) == 2 * RATE
