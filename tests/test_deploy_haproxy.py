"""The load balancer we ship, for real: Debian's HAProxy on loopback with a configuration generated
from docker/haproxy.cfg (only the addresses change), in front of server processes (the fake engine:
the balancer's behaviour is under test, and the fake's transcript is exact for any chunking)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_config(servers: dict[str, int], port: int, stats: int) -> str:
    """docker/haproxy.cfg with loopback addresses: the replicas as static servers instead of Docker
    DNS, the frontends bound to loopback ports. Every other line is the shipped one."""
    text = (ROOT / "docker/haproxy.cfg").read_text()
    swaps = [("    bind :8000\n", f"    bind 127.0.0.1:{port}\n"),
             ("    bind :8404\n", f"    bind 127.0.0.1:{stats}\n"),
             (" resolvers docker init-addr none", ""),
             ("    server-template whistle 16 whistle:8000\n",
              "".join(f"    server {name} 127.0.0.1:{p}\n" for name, p in servers.items()))]
    for old, new in swaps:
        assert old in text, f"docker/haproxy.cfg changed: {old!r} is gone; update this test"
        text = text.replace(old, new)
    start = text.index("resolvers docker")
    return text[:start] + text[text.index("frontend listen"):]


class Fleet:
    def __init__(self, tmp: Path, replicas: int = 3):
        self.ports = {f"whistle{i}": free_port() for i in range(replicas)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.lb_port, self.stats_port = free_port(), free_port()
        cfg = tmp / "haproxy.cfg"
        cfg.write_text(loopback_config(self.ports, self.lb_port, self.stats_port))
        for name in self.ports:
            self.start(name)
        self.haproxy = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.haproxy.stdout), daemon=True).start()
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
        """HAProxy's view of each server (its stats CSV): UP, DOWN, MAINT..."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2) as r:
            rows = r.read().decode().splitlines()
        head = rows[0].lstrip("# ").split(",")
        out = {}
        for row in rows[1:]:
            cells = dict(zip(head, row.split(",")))
            if cells.get("pxname") == "whistle" and cells.get("svname", "").startswith("whistle"):
                out[cells["svname"]] = cells["status"].split(" ")[0]
        return out

    def sessions(self, name: str) -> int:
        port = self.ports[name]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("whistle_sessions_open "):
                    return int(float(line.split()[1]))
        return 0

    def wait_up(self, names, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = self.states()
                if all(states.get(n) == "UP" for n in names):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not all of {names} came up: {self.states()}")

    def close(self):
        self.haproxy.terminate()
        self.haproxy.wait(10)
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
        await asyncio.sleep(6)                                      # ... its sessions resume on the others
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
