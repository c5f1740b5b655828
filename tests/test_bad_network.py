"""Sessions over a bad network: a real server (the bundled demo model) behind `harness.faults`'s
proxy with latency and jitter, a bandwidth cap, a 5 s freeze and a cut connection. Each session
ends with the transcript the same audio gets over a clean link: nothing lost or doubled, resuming
where the connection dropped. A client that stops reading is disconnected with `slow_client`
after the documented limit while the server's memory stays bounded; a client sending faster than
real time is read in full, and a frame past the size limit is refused by its close code."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import psutil
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from harness.audio import demo_stream
from harness.faults import FaultProxy
from harness.servers import ServerProcess
from whistle_stream.clients.client import ListenClient
from whistle_stream.service import protocol as P

pytestmark = pytest.mark.slow
RATE = 16000
SECRET = "bad-network-secret-0123456789"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--resume-secret", SECRET, "--processes", "1") as s:
        yield s



async def stream(port: int, audio: np.ndarray, *, during=None, pace: float = 1.0) -> ListenClient:
    """`audio` at `pace` x real time through 127.0.0.1:port, resuming whatever happens; `during(t)`
    is called with the seconds sent after each frame."""
    client = ListenClient(f"ws://127.0.0.1:{port}", retries=10, backoff=0.2, max_backoff=1.0, resume_retries=30)
    await client.connect()

    async def drain():
        async for _ in client:
            pass
    received = asyncio.create_task(drain())
    t0, frame = time.monotonic(), RATE // 10
    for i in range(0, len(audio), frame):
        await client.send_audio(audio[i:i + frame])
        if during is not None:
            during((i + frame) / RATE)
        await asyncio.sleep(max(0.0, t0 + (i + frame) / RATE / pace - time.monotonic()))
    await client.request_close()
    await asyncio.wait_for(received, 120)
    return client


@pytest.fixture(scope="module")
def clip():
    """Four held-out demo sentences with pauses (16 kHz)."""
    return demo_stream(4, seed=12)[0]


@pytest.fixture(scope="module")
def clean(server, clip):
    """The transcript over a clean link (straight to the server), sent as fast as it is read."""
    return asyncio.run(stream(server.port, clip, pace=8.0)).transcript


def intact(client: ListenClient, clean: str) -> None:
    seqs = [m.seq for m in client.committed]
    assert seqs == list(range(1, len(seqs) + 1))        # no commit lost or sent twice
    assert client.transcript == clean                   # no word lost or doubled


async def test_latency_jitter_and_a_bandwidth_cap_lose_and_double_nothing(server, clip, clean):
    proxy = FaultProxy(server.port, latency=0.08, jitter=0.06, rate=48_000)   # audio is 32 kB/s
    port = await proxy.start()
    try:
        client = await stream(port, clip)
    finally:
        await proxy.close()
    intact(client, clean)
    assert client.reconnects == 0


async def test_a_connection_frozen_for_5_s_carries_on(server, clip, clean):
    proxy = FaultProxy(server.port)
    port = await proxy.start()
    frozen = []

    def during(sent: float) -> None:
        if sent >= 6.0 and not frozen:
            proxy.freeze(5.0)
            frozen.append(sent)
    try:
        client = await stream(port, clip, during=during)
    finally:
        await proxy.close()
    assert frozen
    intact(client, clean)


async def test_a_cut_connection_resumes_where_it_dropped(server, clip, clean):
    proxy = FaultProxy(server.port, latency=0.03)
    port = await proxy.start()
    cut = []

    def during(sent: float) -> None:
        if len(cut) < 2 and sent >= 5.0 * (len(cut) + 1):
            proxy.cut()
            cut.append(sent)
    try:
        client = await stream(port, clip, during=during)
    finally:
        await proxy.close()
    assert len(cut) == 2 and client.reconnects >= 2
    intact(client, clean)


async def test_a_client_that_stops_reading_is_dropped_as_slow_with_bounded_server_memory(clip):
    """--send-queue 16 and --send-timeout 3 (docs/protocol.md, "Limits"): a client whose reading
    stopped is dropped (`slow_client`) once its queue is full or a send blocked for 3 s, and the
    server's memory does not grow with what it could not send."""
    from fakes import start_server_process

    proc, url = start_server_process("--send-queue", "16", "--send-timeout", "3", "--processes", "1",
                                     "--max-session-seconds", "100000")
    server = psutil.Process(proc.pid)
    proxy = FaultProxy(int(url.rsplit(":", 1)[1]))
    port = await proxy.start()
    try:
        async with connect(f"ws://127.0.0.1:{port}/v1/listen?sample_rate=16000&vad=false", max_size=None) as ws:
            await ws.recv()                               # ready; from here on the client reads nothing
            proxy.stall_downstream()
            rss_before = server.memory_info().rss
            t0, closed, peak = time.monotonic(), None, rss_before
            second = (0.1 * np.random.default_rng(0).standard_normal(RATE) * 32767).astype("<i2").tobytes()
            try:
                while time.monotonic() - t0 < 60:         # audio as fast as it goes, until the server drops us
                    await asyncio.wait_for(ws.send(second), 10)
                    peak = max(peak, server.memory_info().rss)
            except (ConnectionClosed, asyncio.TimeoutError, OSError) as e:
                closed = e
            waited = time.monotonic() - t0
        proc.send_signal(2)
        log = proc.communicate(timeout=30)[1]
    finally:
        await proxy.close()
        if proc.poll() is None:
            proc.kill()
    assert '"slow_client"' in log, log[-2000:]
    assert closed is not None and waited < 60
    grown = (peak - rss_before) / 1e6
    print(f"\nslow client dropped after {waited:.1f} s; server RSS grew {grown:.1f} MB meanwhile")
    assert grown < 40


async def test_faster_than_real_time_is_read_in_full_and_an_oversized_frame_is_refused(server, clip, clean):
    client = await stream(server.port, clip, pace=1000.0)          # a file, at once
    intact(client, clean)
    async with connect(f"ws://127.0.0.1:{server.port}/v1/listen?sample_rate=16000", max_size=None) as ws:
        await ws.recv()                                            # ready
        await ws.send(b"\0" * (2 << 20))                           # 2 MiB: past --max-frame-bytes (1 MiB)
        with pytest.raises(ConnectionClosed) as info:
            while True:
                await ws.recv()
    assert info.value.rcvd.code == P.CloseCode.TOO_BIG
