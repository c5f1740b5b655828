"""The Docker image, built and run for real with podman: a Debian base made with mmdebstrap (cached
between runs), docker/Dockerfile built, the container run with the bundled model and with a model
mounted read-only, a stream through it, SIGTERM's drain, the user it runs as, and its size.

Runs wherever podman, runc and mmdebstrap are (`.ci/run` installs them); skipped elsewhere.
Settings that work on hosts like CI's (docs/deploy.md): runc, cgroupfs, host networking, a lowered
process limit, in a containers.conf of the test's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from harness.audio import demo_stream
from harness.podman import CACHE, CONTAINERS_CONF, ROOT, build_env, podman
from harness.servers import ServerProcess, free_port
from whistle_stream.clients.client import ListenClient, SessionEnded
from whistle_stream.models import demo_model_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not all(shutil.which(t) for t in ("podman", "mmdebstrap", "runc")),
                                 reason="podman, runc and mmdebstrap are not installed (.ci/run installs them)")]

IMAGE = "localhost/whistle-stream:test"
RATE = 16000


@pytest.fixture(scope="module")
def image():
    """The image for this host's architecture, as users build it (tools/build_image.sh: the base
    made once by mmdebstrap and kept in podman's store, --format docker; podman's layer cache
    makes a rebuild of unchanged sources quick). Prints the build time and the image's size."""
    env = build_env()
    t0 = time.monotonic()
    arch = {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]
    build = subprocess.run(["bash", "tools/build_image.sh", "--arch", arch, "--tag", IMAGE], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=2400)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    size = int(podman("image", "inspect", IMAGE, "--format", "{{.Size}}").stdout.strip())
    print(f"\nimage built in {time.monotonic() - t0:.0f} s; size {size / 1e6:.0f} MB")
    return {"size": size}


class Container:
    """`podman run -d` of the image with WHISTLE_* settings; `ready_s`: from the run command to
    /readyz answering 200."""

    def __init__(self, *run_args: str, env: dict | None = None, ready_timeout: float = 180):
        self.port = free_port()
        self.name = f"whistle-test-{os.getpid()}-{self.port}"
        settings = {"WHISTLE_PORT": str(self.port), "WHISTLE_PROCESSES": "1", "WHISTLE_HOST": "127.0.0.1",
                    **(env or {})}
        flags = [x for k, v in settings.items() for x in ("-e", f"{k}={v}")]
        t0 = time.monotonic()
        podman("run", "-d", "--name", self.name, *flags, *run_args, IMAGE)
        self.ready_s = self._wait_ready(t0, ready_timeout)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def _wait_ready(self, t0: float, timeout: float = 180) -> float:
        while time.monotonic() - t0 < timeout:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            if podman("container", "exists", self.name, check=False).returncode != 0 or \
                    podman("inspect", self.name, "--format", "{{.State.Running}}").stdout.strip() != "true":
                break
            time.sleep(0.2)
        raise AssertionError(f"the container did not get ready: {self.logs()[-3000:]}")

    def logs(self) -> str:
        out = podman("logs", self.name, check=False)
        return out.stdout + out.stderr

    def events(self) -> list[dict]:
        out = []
        for line in self.logs().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


def stream_text(url: str, audio: np.ndarray) -> str:
    async def run():
        async with ListenClient(url, resume=False) as c:
            for i in range(0, len(audio), 1600):
                await c.send_audio(audio[i:i + 1600])
            await c.close()
        return c.text
    return asyncio.run(run())


@pytest.fixture(scope="module")
def clip():
    return demo_stream(3, seed=5)[0]


def _host_path(target: str) -> str:
    """The kernels' path a checkout takes on this host with WHISTLE_JIT_TARGET=target."""
    code = "from whistle_stream.blocks import kernel_path; print(kernel_path())"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "WHISTLE_JIT_TARGET": target},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_image_runs_the_bundled_model_as_a_checkout_does(image, clip):
    box = Container()
    try:
        print(f"\ncontainer start to /readyz: {box.ready_s:.1f} s (the JIT cache baked in); "
              f"image {image['size'] / 1e6:.0f} MB")
        assert box.ready_s < 60            # a cold JIT compile would take about a minute on its own
        # the ready line names the path that runs (this host's tier: the image's `portable`) and
        # how many kernels the start compiled
        ready = next(e for e in box.events() if e.get("event") == "ready")
        assert ready["compiled"] == 0, f"the baked JIT cache was not used: {ready}"
        assert ready["kernels"] == _host_path("portable"), ready
        uid = podman("exec", box.name, "id", "-u").stdout.strip()
        assert uid == "10001"
        ours = stream_text(box.url, clip)
    finally:
        box.remove()
    with ServerProcess("--processes", "1") as checkout:
        theirs = stream_text(checkout.url, clip)
    assert ours and ours == theirs


def test_the_image_keeps_its_health_check_and_podman_reports_it_healthy(image):
    """Built with --format docker, the image keeps the Dockerfile's HEALTHCHECK (the OCI format
    drops it); podman runs it (here by hand: no systemd timers) and reports the container healthy."""
    check = json.loads(podman("image", "inspect", IMAGE, "--format", "{{json .HealthCheck}}").stdout)
    assert "/readyz" in " ".join(check["Test"]), check
    box = Container()
    try:
        ran = podman("healthcheck", "run", box.name, check=False)
        status = podman("inspect", box.name, "--format", "{{.State.Health.Status}}").stdout.strip()
    finally:
        box.remove()
    assert ran.returncode == 0 and status == "healthy", (ran.stdout, ran.stderr, status)


def test_a_tier_the_image_lacks_compiles_once_into_a_volume_and_says_so(image):
    """A host whose tier the build machine could not warm (a VNNI host under an image built on
    AVX2) compiles its kernels at its first start: the log says so and names the folder; with a
    volume there, the next container loads them. Forced here with the host CPU's own target,
    which no image ships."""
    volume = f"whistle-jit-test-{os.getpid()}"
    podman("volume", "create", volume)
    try:
        first = Container("-v", f"{volume}:/var/cache/whistle/numba", env={"WHISTLE_JIT_TARGET": "host"},
                          ready_timeout=900)   # every kernel compiles: about a minute on an idle machine
        try:
            compiling = [e for e in first.events() if e.get("event") == "compiling"]
            ready = next(e for e in first.events() if e.get("event") == "ready")
        finally:
            first.remove()
        second = Container("-v", f"{volume}:/var/cache/whistle/numba", env={"WHISTLE_JIT_TARGET": "host"})
        try:
            again = next(e for e in second.events() if e.get("event") == "ready")
        finally:
            second.remove()
    finally:
        podman("volume", "rm", "-f", volume, check=False)
    print(f"\nfirst start, compiling: {first.ready_s:.1f} s; second, from the volume: {second.ready_s:.1f} s")
    assert compiling and compiling[0]["cache"] == "/var/cache/whistle/numba", first.events()[:5]
    assert ready["kernels"] == _host_path("host") and ready["compiled"] > 0, ready
    assert again["compiled"] == 0, again                 # the second start loaded them all from the volume


def test_sigterm_answers_the_open_session_then_the_container_exits_0(image, clip):
    box = Container(env={"WHISTLE_DRAIN_TIMEOUT": "20"})
    try:
        async def run():
            async with ListenClient(box.url, resume=False) as c:
                messages = []

                async def receive():
                    try:
                        async for m in c:
                            messages.append(m)
                    except SessionEnded as e:   # the server closed with 1001 after its final
                        messages.append(e)
                reader = asyncio.create_task(receive())
                for i in range(0, len(clip), 1600):
                    try:
                        await c.send_audio(clip[i:i + 1600])
                    except SessionEnded:   # the close can reach the sender before the reader
                        break
                    await asyncio.sleep(0.05)   # about real time
                    if i == 40 * 1600:
                        podman("kill", "--signal", "TERM", box.name)
                        t0 = time.monotonic()
                    if reader.done():
                        break
                await asyncio.wait_for(reader, 30)
                return messages, t0
        messages, t0 = asyncio.run(run())
        status = podman("wait", box.name, timeout=60).stdout.strip()
        waited = time.monotonic() - t0
    finally:
        box.remove()
    finals = [m for m in messages if type(m).__name__ == "Final"]
    assert finals and finals[-1].reason == "shutdown", messages[-3:]
    assert isinstance(messages[-1], SessionEnded) and messages[-1].code == 1001
    assert status == "0" and waited < 20
    # nothing lost: the final sums up what was committed, and carries the token that resumes the rest
    committed = "".join(m.text for m in messages if type(m).__name__ == "Committed")
    assert finals[-1].text == committed and finals[-1].resume


def test_a_model_mounted_read_only_is_served_from_whistle_model(image, clip, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(demo_model_path(), models / "whistle.cact")
    os.chmod(models, 0o755)
    box = Container("-v", f"{models}:/models:ro,Z", env={"WHISTLE_MODEL": "/models/whistle.cact"})
    try:
        ready = next(e for e in box.events() if e.get("event") == "ready")
        text = stream_text(box.url, clip)
        writable = podman("exec", box.name, "sh", "-c", "touch /models/x 2>/dev/null && echo yes || echo no").stdout
    finally:
        box.remove()
    assert ready["model"] == "whistle.cact" and text
    assert writable.strip() == "no"


COMPOSE_CONF = CONTAINERS_CONF.replace('netns = "host"\n', "")   # compose gives each service its network


def test_compose_runs_replicas_behind_the_balancer_and_a_session_survives_a_killed_replica(image, clip):
    """docker/compose.yaml run by podman-compose (Debian's), on a bridge network of its own, with the
    balancer built from Debian's HAProxy (docker/Dockerfile.haproxy): a live session through the
    balancer goes on, with nothing lost or doubled, after `podman kill` of the replica serving it."""
    if not shutil.which("podman-compose"):
        pytest.skip("podman-compose is not installed (.ci/run installs it)")
    conf = CACHE / "containers-compose.conf"
    conf.write_text(COMPOSE_CONF)
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    podman("tag", IMAGE, "localhost/whistle-stream:latest")
    arch = {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]
    lb = subprocess.run(["podman", "build", "--build-arg", f"BASE=localhost/debian-{arch}:bookworm-slim",
                         "-f", "docker/Dockerfile.haproxy", "-t", "localhost/whistle-stream-lb:latest", "docker"],
                        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert lb.returncode == 0, lb.stderr[-2000:]
    port = free_port()
    env.update(WHISTLE_RESUME_SECRET="compose-test-secret-0123456789ab", WHISTLE_REPLICAS="2",
               WHISTLE_REPLICA_CPUS="1", WHISTLE_LB_PORT=str(port), WHISTLE_LB_TLS_PORT=str(free_port()),
               WHISTLE_LB_STATS_PORT=str(free_port()))
    compose = ["podman-compose", "-p", f"whistletest{os.getpid()}", "-f", "docker/compose.yaml"]
    up = subprocess.run([*compose, "up", "-d"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        replicas = [f"whistletest{os.getpid()}_whistle_{i}" for i in (1, 2)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            logs = subprocess.run([*compose, "logs"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
            ps = subprocess.run(["podman", "ps", "-a", "--filter", f"name=whistletest{os.getpid()}", "--format",
                                 "{{.Names}} {{.Status}}"], capture_output=True, text=True, env=env, timeout=60)
            raise AssertionError("the balancer never answered /readyz; the containers: " + ps.stdout + ps.stderr
                                 + "; up said:\n" + up.stdout[-1500:] + up.stderr[-1500:]
                                 + "\nthe containers said:\n" + (logs.stdout + logs.stderr)[-3000:])
        time.sleep(3)   # both replicas up in HAProxy's checks (rise 2, every 2 s)

        def serving() -> str | None:
            for name in replicas:
                logs = subprocess.run(["podman", "logs", name], capture_output=True, text=True, env=env)
                if '"session_open"' in logs.stdout + logs.stderr:
                    return name
            return None

        async def run():
            client = ListenClient(f"ws://127.0.0.1:{port}", retries=5, backoff=0.3, max_backoff=1.0,
                                  resume_retries=60)
            await client.connect()

            async def drain():
                async for _ in client:
                    pass
            received = asyncio.create_task(drain())
            killed = None
            t0, block = time.monotonic(), RATE // 10
            for i in range(0, len(clip), block):
                await client.send_audio(clip[i:i + block])
                if killed is None and i >= len(clip) // 2 and client.committed:
                    killed = serving()
                    subprocess.run(["podman", "kill", killed], capture_output=True, env=env, timeout=60)
                await asyncio.sleep(max(0.0, t0 + (i + block) / RATE - time.monotonic()))
            await client.request_close()
            await asyncio.wait_for(received, 120)
            return client, killed
        client, killed = asyncio.run(run())
    finally:
        logs = subprocess.run([*compose, "logs"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
        subprocess.run([*compose, "down", "-t", "1"], cwd=ROOT, capture_output=True, env=env, timeout=300)
        subprocess.run(["podman", "network", "rm", f"whistletest{os.getpid()}_default"], capture_output=True,
                       env=env, timeout=60)   # Debian's podman-compose leaves its network behind
    assert killed is not None and client.reconnects >= 1, logs.stdout[-2000:]
    seqs = [m.seq for m in client.committed]
    assert seqs == list(range(1, len(seqs) + 1))                       # nothing lost or doubled
    with ServerProcess("--processes", "1") as checkout:
        theirs = stream_text(checkout.url, clip)
    assert client.transcript == theirs
