"""Start-up: seconds from `whistle-stream serve` starting to /readyz answering 200, and the server's
peak RSS by then, with the JIT cache the way a replica finds it.

    python benchmarks/startup.py                     # the bundled demo model
    python benchmarks/startup.py --model full        # the harness's full-architecture model (JAX reference)
    python benchmarks/startup.py --model PATH.cact

Each case gets a JIT cache of its own (NUMBA_CACHE_DIR in a temporary folder), filled the way its
name says, then one server process is started and timed:

- `portable, tier cache`: WHISTLE_JIT_TARGET=portable, the cache compiled by `whistle-stream warm`
  under the same setting (what the image ships, `warm --all-tiers`): keyed by the CPU tier alone,
  so it is what a node of any CPU model of the tier finds.
- `host, cache of another CPU`: the default target, the cache compiled for another CPU name
  (NUMBA_CPU_NAME=skylake-avx512 with its own feature list: an image built on another machine):
  every kernel misses and compiles at start.
- `host, cache of this CPU`: the default target with this machine's own cache (a developer's
  machine, after its first start).

It prints each case's time to ready and peak RSS (VmHWM), and the ratio of the other-CPU start to
the portable one, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness_model import model_path  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))

from harness.servers import free_port  # noqa: E402
FOREIGN_CPU = ("skylake-avx512", "+avx512f,+avx512bw,+avx512cd,+avx512dq,+avx512vl,+avx2,+fma")



def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def warm(env: dict, model: str | None) -> float:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "whistle_stream.cli", "warm"] + (["--model", model] if model else [])
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def tree_peak_rss_mb(pid: int) -> list[float]:
    """Peak RSS of the server and of each engine worker process it started, MB."""
    import psutil
    return [peak_rss_mb(pid)] + [peak_rss_mb(c.pid) for c in psutil.Process(pid).children(recursive=True)]


def time_to_ready(env: dict, model: str | None, processes: int = 1,
                  limit_s: float = 600.0) -> tuple[float, list[float]]:
    """(seconds from process start to /readyz 200, the peak RSS in MB then of the server and of each
    engine worker process)."""
    port = free_port()
    cmd = [sys.executable, "-m", "whistle_stream.service.server", "--port", str(port)]
    cmd += ["--model", model] if model else []
    cmd += ["--processes", str(processes)] if processes > 1 else []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - t0 < limit_s:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0, tree_peak_rss_mb(proc.pid)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise SystemExit(f"the server was not ready within {limit_s:.0f} s")
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="demo (default), full, or a .cact path")
    ap.add_argument("--processes", type=int, default=1, help="engine worker processes (serve --processes)")
    args = ap.parse_args(argv)
    model = model_path(args.model)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CPU", "WHISTLE_JIT", "WHISTLE_SIMD"))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            ("portable, tier cache", {"WHISTLE_JIT_TARGET": "portable"}, {"WHISTLE_JIT_TARGET": "portable"}),
            ("host, cache of another CPU", {"NUMBA_CPU_NAME": FOREIGN_CPU[0], "NUMBA_CPU_FEATURES": FOREIGN_CPU[1]}, {}),
            ("host, cache of this CPU", {}, {}),
        ]
        for k, (name, build_env, run_env) in enumerate(cases):
            cache = {"NUMBA_CACHE_DIR": os.path.join(tmp, f"cache{k}")}
            warm_s = warm({**base, **cache, **build_env}, model)
            ready_s, rss = time_to_ready({**base, **cache, **run_env}, model, args.processes)
            rows.append((name, warm_s, ready_s, rss))
            print(f"{name}: warm {warm_s:.1f} s, ready {ready_s:.2f} s, peak RSS {sum(rss):.0f} MB "
                  f"({' + '.join(f'{r:.0f}' for r in rss)})", file=sys.stderr)
    print(f"\nmodel: {model or 'bundled demo'}; {os.cpu_count()} CPUs; {args.processes} engine process(es)")
    print(f"{'case':<30} {'compile the cache':>18} {'start to /readyz':>17} {'peak RSS':>9}  (server + workers)")
    for name, warm_s, ready_s, rss in rows:
        print(f"{name:<30} {warm_s:>17.1f}s {ready_s:>16.2f}s {sum(rss):>6.0f} MB  "
              f"({' + '.join(f'{r:.0f}' for r in rss)})")
    portable, foreign = rows[0][2], rows[1][2]
    print(f"\nstart with another CPU's cache / with the tier cache: {foreign / portable:.1f}x "
          f"({foreign:.1f} s against {portable:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
