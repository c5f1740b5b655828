"""The load balancer we ship, on loopback: docker/haproxy.cfg with loopback addresses, run by
Debian's HAProxy in front of server processes (the balancer tests and `benchmarks/load.py
--replicas`)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def loopback_config(servers: dict[str, int], port: int, stats: int, tls_port: int | None = None) -> str:
    """docker/haproxy.cfg with loopback addresses: the replicas as static servers instead of Docker
    DNS, the frontends bound to loopback ports (the TLS one to tls_port, when WHISTLE_TLS_CERT is
    set for HAProxy). Every other line is the shipped one."""
    text = (ROOT / "docker/haproxy.cfg").read_text()
    swaps = [("    bind :8000\n", f"    bind 127.0.0.1:{port}\n"),
             ("    bind :8404\n", f"    bind 127.0.0.1:{stats}\n"),
             ("    bind :8443 ssl", f"    bind 127.0.0.1:{tls_port or 0} ssl"),
             (" resolvers docker init-addr none", ""),
             ("    server-template whistle 16 whistle:8000\n",
              "".join(f"    server {name} 127.0.0.1:{p}\n" for name, p in servers.items()))]
    for old, new in swaps:
        if old not in text:
            raise AssertionError(f"docker/haproxy.cfg changed: {old!r} is gone; update tests/harness/balancer.py")
        text = text.replace(old, new)
    start = text.index("resolvers docker")
    text = text[:start] + text[text.index("frontend listen"):]
    # the Wyoming frontend forwards TCP to the replicas by Docker DNS: left out on loopback (the
    # compose test, tests/test_image.py, runs it)
    return text[:text.index("# Home Assistant's Wyoming protocol")] + text[text.index("frontend stats"):]


def wyoming_config(server: int, port: int) -> str:
    """docker/haproxy.cfg's defaults and Wyoming frontend and backend, on loopback: bound to `port`,
    forwarding to one server on `server`, without the HTTP health check (the server under it is
    a plain TCP one). Every other line of those sections is the shipped one."""
    text = (ROOT / "docker/haproxy.cfg").read_text()
    defaults = text[text.index("defaults"):text.index("resolvers docker")]
    section = text[text.index("# Home Assistant's Wyoming protocol"):text.index("frontend stats")]
    swaps = [("    bind :10300\n", f"    bind 127.0.0.1:{port}\n"),
             ("    option httpchk GET /readyz\n    http-check expect status 200\n", ""),
             ("    default-server check port 8000 inter 2s fall 2 rise 2 resolvers docker init-addr none\n", ""),
             ("    server-template whistle 16 whistle:10300\n", f"    server whistle0 127.0.0.1:{server}\n")]
    for old, new in swaps:
        if old not in section:
            raise AssertionError(f"docker/haproxy.cfg changed: {old!r} is gone; update tests/harness/balancer.py")
        section = section.replace(old, new)
    return defaults + section


class Balancer:
    """HAProxy running a loopback_config; its log lines collect in `log`."""

    def __init__(self, folder: Path, servers: dict[str, int], port: int, stats: int,
                 tls_port: int | None = None, cert: str | None = None):
        self.port, self.stats_port = port, stats
        cfg = Path(folder) / "haproxy.cfg"
        cfg.write_text(loopback_config(servers, port, stats, tls_port))
        env = {**os.environ, "WHISTLE_TLS_CERT": cert or ""}
        self.proc = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def states(self) -> dict[str, str]:
        """HAProxy's view of each server (its stats CSV): UP, DOWN, MAINT..."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2) as r:
            rows = r.read().decode().splitlines()
        head = rows[0].lstrip("# ").split(",")
        out = {}
        for row in rows[1:]:
            cells = dict(zip(head, row.split(",")))
            if cells.get("pxname") == "whistle" and cells.get("svname") not in ("FRONTEND", "BACKEND"):
                out[cells["svname"]] = cells["status"].split(" ")[0]
        return out

    def wait_up(self, names, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = self.states()
                if all(states.get(n) == "UP" for n in names):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not all of {list(names)} came up: {self.states()}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
