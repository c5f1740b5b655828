"""Real `whistle-stream serve` processes on loopback for tests: start, wait for ready, stop."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`whistle-stream serve --port 0 *flags` (the bundled demo model unless --model is given).

        with ServerProcess("--token", "t") as server:
            server.url    # ws://127.0.0.1:PORT
            server.http   # http://127.0.0.1:PORT
    """

    def __init__(self, *flags: str, env: dict | None = None, timeout: float = 300.0,   # a cold JIT cache: minutes
                 command: list[str] | None = None):
        # command: what runs `serve` (default this checkout's CLI; benchmarks/pauses.py runs another's)
        self.flags, self.env, self.timeout = flags, env, timeout
        self.command = command or [sys.executable, "-m", "whistle_stream.cli"]
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.log: list[dict] = []

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen([*self.command, "serve", "--port", "0", *self.flags],
                                     cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(self.env or {})})
        ready = threading.Event()

        def read():   # keeps draining stderr so the server never blocks on a full pipe
            for line in self.proc.stderr:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                self.log.append(event)
                if event.get("event") == "listening":
                    self.port = event["port"]
                if event.get("event") == "ready":
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self.log[-5:]}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
