"""The load balancer we ship, for real: Debian's HAProxy on loopback with a configuration generated
from docker/haproxy.cfg (only the addresses change), in front of server processes (the fake engine:
the balancer's behaviour is under test, and the fake's transcript is exact for any chunking)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from harness.balancer import Balancer
from harness.servers import free_port
from fakes import FakeWhistle, start_server_process, stream_reference
from whistle_stream.clients.client import ListenClient, SessionEnded
from whistle_stream.service import protocol as P

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SECRET = "balancer-test-secret-0123456789"
PER_REPLICA = 6          # --max-sessions of each replica
RATE = 16000

if shutil.which("haproxy") is None:
    pytest.skip("Debian's haproxy is not installed (.ci/run installs it)", allow_module_level=True)



class Fleet:
    def __init__(self, tmp: Path, replicas: int = 3):
        self.ports = {f"whistle{i}": free_port() for i in range(replicas)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.lb_port, self.stats_port = free_port(), free_port()
        for name in self.ports:
            self.start(name)
        self.balancer = Balancer(tmp, self.ports, self.lb_port, self.stats_port)
        self.log = self.balancer.log
        self.wait_up(list(self.procs))

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.lb_port}"

    def start(self, name: str) -> None:
        proc, _ = start_server_process("--port", str(self.ports[name]), "--resume-secret", SECRET,
                                       "--max-sessions", str(PER_REPLICA), "--drain-timeout", "10")
        threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()   # keep its log pipe flowing
        self.procs[name] = proc

    def states(self) -> dict[str, str]:
        return self.balancer.states()

    def sessions(self, name: str) -> int:
        port = self.ports[name]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("whistle_sessions_open "):
                    return int(float(line.split()[1]))
        return 0

    def wait_up(self, names, timeout=20.0):
        self.balancer.wait_up(names, timeout)

    def close(self):
        self.balancer.close()
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def audio_of(seconds: float, seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * RATE))).astype(np.float32)


async def speak(url: str, audio: np.ndarray, started: asyncio.Event | None = None, retries: int = 0) -> ListenClient:
    """One real-time session through the balancer, resuming whatever happens to its replica."""
    client = ListenClient(url, vad=False, retries=retries, backoff=0.3, max_backoff=1.0, resume_retries=60)
    try:
        await client.connect()
    finally:
        if started is not None:
            started.set()
    received = asyncio.create_task(_drain(client))
    t0, block = time.monotonic(), RATE // 10
    for i in range(0, len(audio), block):
        await client.send_audio(audio[i:i + block])
        delay = t0 + (i + block) / RATE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    await client.request_close()
    await asyncio.wait_for(received, 60)
    return client


async def _drain(client):
    async for _ in client:
        pass


def test_the_shipped_balancer_spreads_sessions_and_survives_kills_restarts_and_a_full_fleet(tmp_path):
    fleet = Fleet(tmp_path)
    loop_log = []

    async def scenario():
        audios = [audio_of(24.0, seed=k) for k in range(12)]
        tasks = []
        for k, audio in enumerate(audios):          # twelve sessions, opened one after another
            started = asyncio.Event()
            tasks.append(asyncio.create_task(speak(fleet.url, audio, started)))
            await started.wait()
        spread = {name: fleet.sessions(name) for name in fleet.procs}
        loop_log.append(("spread", spread))

        await asyncio.sleep(3)
        killed = "whistle0"
        fleet.procs[killed].send_signal(signal.SIGKILL)            # a replica dies mid-stream
        deadline = time.monotonic() + 30                            # ... its sessions resume on the others
        while sum(fleet.sessions(n) for n in fleet.procs if n != killed) < 12 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        loop_log.append(("after kill", {n: fleet.sessions(n) for n in fleet.procs if n != killed},
                         fleet.states()))

        # the fleet is full now (2 x 6): a new session is refused (1013) until capacity comes back
        with pytest.raises(SessionEnded) as refused:
            await ListenClient(fleet.url, vad=False).connect()
        loop_log.append(("refused", refused.value.code))
        late = asyncio.create_task(speak(fleet.url, audio_of(6.0, seed=99), retries=40))
        await asyncio.sleep(1.0)
        fleet.start(killed)                                         # a new replica joins (in the dead one's slot) ...
        fleet.wait_up([killed])
        late_client = await asyncio.wait_for(late, 60)              # ... and takes the waiting session

        # the browser page sends its token in the query: the balancer's log keeps the path only
        import websockets
        async with websockets.connect(fleet.url + "/v1/listen?token=leak-me-0123&vad=false") as ws:
            assert json.loads(await ws.recv())["type"] in ("ready", "error")

        fleet.procs["whistle1"].send_signal(signal.SIGTERM)        # a rolling restart: one replica drains
        t_term = time.monotonic()
        while fleet.states().get("whistle1") == "UP" and time.monotonic() - t_term < 10:
            await asyncio.sleep(0.2)
        loop_log.append(("left rotation after", round(time.monotonic() - t_term, 1), fleet.states()))
        clients = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return audios, clients, late_client

    try:
        audios, clients, late_client = asyncio.run(asyncio.wait_for(scenario(), 240))
    finally:
        fleet.close()
    print("\n" + "\n".join(map(str, loop_log)))
    print(f"resumed: {sum(c.reconnects for c in clients)} reconnects over the {len(clients)} sessions")
    spread = loop_log[0][1]
    assert sorted(spread.values()) == [4, 4, 4]                       # least connections: even spread
    assert loop_log[2] == ("refused", P.CloseCode.TRY_AGAIN)
    assert loop_log[3][0] == "left rotation after" and loop_log[3][1] < 8
    assert loop_log[3][2]["whistle1"] != "UP"
    for audio, client in zip(audios, clients):                       # nothing lost or doubled anywhere
        seqs = [m.seq for m in client.committed]
        assert seqs == list(range(1, len(seqs) + 1))
        assert client.transcript == stream_reference(FakeWhistle(), audio)
    assert sum(c.reconnects for c in clients) >= 4                   # the killed replica's sessions, at least
    assert late_client.transcript == stream_reference(FakeWhistle(), audio_of(6.0, seed=99))
    logged = [line for line in fleet.log if "/v1/listen" in line]
    assert logged and not any("leak-me" in line for line in fleet.log)


def test_the_shipped_balancer_terminates_tls_when_given_a_certificate(tmp_path):
    """WHISTLE_TLS_CERT turns on the config's TLS listener: https and a session over wss through it, with the token kept out of HAProxy's log as on plain http."""
    import ssl

    import websockets

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    pem = tmp_path / "whistle.pem"
    pem.write_bytes(cert.read_bytes() + key.read_bytes())
    proc, url = start_server_process("--token", "tls-token-0123")
    threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()
    tls_port = free_port()
    balancer = Balancer(tmp_path, {"whistle0": int(url.rsplit(":", 1)[1])}, free_port(), free_port(),
                        tls_port=tls_port, cert=str(pem))
    try:
        balancer.wait_up(["whistle0"])
        trust = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://127.0.0.1:{tls_port}/healthz", context=trust, timeout=5) as page:
            assert page.status == 200

        async def session():
            async with websockets.connect(f"wss://127.0.0.1:{tls_port}/v1/listen?token=tls-token-0123&vad=false",
                                          ssl=trust) as ws:
                ready = P.decode_server(await ws.recv())
                await ws.send(json.dumps({"type": "close"}))
                ends = [P.decode_server(m) async for m in ws]
                return ready, ends

        ready, ends = asyncio.run(session())
        assert isinstance(ready, P.Ready) and isinstance(ends[-1], P.Final)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # TLS for real
            urllib.request.urlopen(f"https://127.0.0.1:{tls_port}/healthz", context=ssl.create_default_context(),
                                   timeout=5)
    finally:
        balancer.close()
        proc.kill()
        proc.wait()
    logged = [line for line in balancer.log if "/v1/listen" in line]
    assert logged and not any("tls-token" in line for line in balancer.log)


def test_the_load_benchmark_measures_replicas_behind_the_balancer_against_one_alone():
    """`benchmarks/load.py --replicas 3` (the fake engine here: the benchmark's plumbing is under
    test) sweeps one replica, then three behind the shipped HAProxy config, and prints the ratio."""
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/load.py"), "--fake", "--replicas", "3",
                           "--sweep", "3,6", "--seconds", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "one replica alone:" in out and "3 replicas behind HAProxy" in out
    assert out.count("   6      0 ") == 2          # N=6 with no errors, alone and through the balancer
    assert "largest sustained N: 6 through the balancer against 6 alone: ratio 1.00x" in out


@pytest.mark.parametrize("allow, admitted", [("10.0.0.0/8 192.168.1.0/24", False), ("10.0.0.0/8 127.0.0.0/8", True),
                                             ("", False)])
def test_the_balancer_admits_to_wyoming_only_the_networks_it_is_given(tmp_path, allow, admitted):
    """The shipped Wyoming frontend, on loopback, in front of a TCP server that greets each
    connection: a client from outside WHISTLE_WYOMING_ALLOW is closed before it reaches a replica."""
    from harness.balancer import wyoming_config

    async def run() -> bytes:
        reached = []

        async def greet(reader, writer):
            reached.append(1)
            writer.write(b'{"type": "info"}\n')
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(greet, "127.0.0.1", 0)
        port = free_port()
        cfg = tmp_path / "wyoming.cfg"
        cfg.write_text(wyoming_config(server.sockets[0].getsockname()[1], port))
        proc = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={"WHISTLE_WYOMING_ALLOW": allow, "PATH": "/usr/sbin:/usr/bin:/bin"})
        try:
            for _ in range(100):
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    break
                except OSError:
                    await asyncio.sleep(0.1)
            try:
                got = await asyncio.wait_for(reader.read(), 10)
            except ConnectionError:
                got = b""
            writer.close()
            assert bool(reached) == admitted
            return got
        finally:
            proc.terminate()
            proc.wait(10)
            server.close()

    got = asyncio.run(run())
    assert (got == b'{"type": "info"}\n') == admitted, got
