"""podman for the image tests: settings that work on hosts like CI's (docs/deploy.md): runc,
cgroupfs, host networking and a lowered process limit, in a containers.conf of the tests' own."""

from __future__ import annotations

import os
import ssl
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "tests" / ".cache"
CONTAINERS_CONF = """[containers]
default_ulimits = ["nproc=4096:4096", "nofile=20000:20000"]
netns = "host"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
"""


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    CACHE.mkdir(parents=True, exist_ok=True)
    conf = CACHE / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check,
                          env={**os.environ, "CONTAINERS_CONF": str(conf)})


def ca_bundle() -> str | None:
    """The host's CA bundle, for pip inside the build behind a proxy with its own CA."""
    for path in (os.environ.get("PIP_CERT"), ssl.get_default_verify_paths().cafile,
                 "/etc/ssl/certs/ca-certificates.crt"):
        if path and Path(path).is_file():
            return path
    return None


def build_env() -> dict:
    """The environment tools/build_image.sh and tools/build_addon.sh run in from a test."""
    podman("info", check=False)   # writes the tests' containers.conf
    ca = ca_bundle()
    return {**os.environ, "CONTAINERS_CONF": str(CACHE / "containers.conf"),
            "WHISTLE_IMAGE_CACHE": str(CACHE / "image"), **({"PIP_CERT": ca} if ca else {})}
