"""The soak: many real-time sessions for an hour, and whether anything creeps.

    python benchmarks/soak.py                          # 16 sessions, 60 minutes, the bundled demo model
    python benchmarks/soak.py --minutes 10 --sessions 8
    python benchmarks/soak.py --held                   # every session held open all hour
    python benchmarks/soak.py --url ws://HOST:PORT --pids 1234   # a running server (its pid)

One `whistle-stream serve` (two engine processes) on loopback. Each of the sessions streams
held-out demo sentences with pauses in real time, closes at the clip's end and opens again, so
sessions come and go all hour; with --held each session stays open for the whole run, its clip
played again and again (live captions of a lecture or a channel), and closes at the end, after
which the processes are sampled once more (what the closed sessions gave back). Commit latency's
p95 is printed for the first and the last ten minutes after the warm-up. Every 30 s the RSS, open file descriptors and threads of the server
and of each engine process are sampled, with the pass times of the interval (p50, p95, from
/metrics). At the end a least-squares line is fitted to each series after the first five minutes
(the warm-up: caches fill, the allocator settles), and its slope printed per hour, with the errors
and the words committed. The samples go to `--out` (JSON) for a second look.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from load import (FRAME_S, RATE, ListenClient, P, demo_sentences, histogram, histogram_quantile, metric,  # noqa: E402
                  one_stream, scrape)

SAMPLE_S = 30.0
WARMUP_S = 300.0


def sample(procs: dict[str, psutil.Process]) -> dict:
    out = {}
    for name, p in procs.items():
        try:
            with p.oneshot():
                out[name] = {"rss_mb": p.memory_info().rss / 1e6, "fds": p.num_fds(), "threads": p.num_threads()}
        except psutil.NoSuchProcess:
            out[name] = None
    return out


def engine_processes(server: psutil.Process) -> dict[str, psutil.Process]:
    """The server and its engine worker processes (multiprocessing's resource tracker left out)."""
    procs = {"server": server}
    workers = [c for c in server.children() if "resource_tracker" not in " ".join(c.cmdline())]
    for i, child in enumerate(sorted(workers, key=lambda c: c.pid)):
        procs[f"engine{i}"] = child
    return procs


def slope_per_hour(times: list[float], values: list[float]) -> float:
    t = np.asarray(times)
    keep = t >= WARMUP_S
    if keep.sum() < 3:
        return float("nan")
    return float(np.polyfit(t[keep] / 3600.0, np.asarray(values)[keep], 1)[0])


async def session_loop(url: str, audio: np.ndarray, start_delay: float, until: float, stats: dict) -> None:
    delay = start_delay
    while time.monotonic() + len(audio) / 16000 < until:
        result = await one_stream(url, audio, None, delay)
        delay = 0.0
        stats["sessions"] += 1
        if result["error"]:
            stats["errors"].append(result["error"])
        elif result["final"] is not None:
            stats["words"] += len(result["final"].text.split())
        stats["latencies"] += result["latencies"]


async def held_session(url: str, audio: np.ndarray, start_delay: float, until: float, stats: dict) -> None:
    """One session open from start_delay to `until`, its clip sent again and again in real time."""
    await asyncio.sleep(start_delay)
    client = ListenClient(url, retries=2, backoff=0.5)
    stats["sessions"] += 1
    try:
        await client.connect()
        t0, frame, sent = time.monotonic(), int(FRAME_S * RATE), 0

        async def receive():
            async for m in client:
                now = time.monotonic()
                if isinstance(m, P.Committed):
                    stats["latencies"] += [now - (t0 + w.end) for w in m.words]
                    stats["latency_at"] += [now] * len(m.words)
                elif isinstance(m, P.Error):
                    stats["errors"].append(f"{m.code.value}: {m.message}")
                elif isinstance(m, P.Final) and m.reason != "finalize":
                    stats["words"] += len(m.text.split())

        reader = asyncio.create_task(receive())
        while time.monotonic() < until:
            for i in range(0, len(audio), frame):
                await client.send_audio(audio[i:i + frame])
                sent += frame
                await asyncio.sleep(max(0.0, t0 + sent / RATE - time.monotonic()))
                if time.monotonic() >= until:
                    break
        await client.request_close()
        await asyncio.wait_for(reader, 120)
    except Exception as e:
        stats["errors"].append(f"{type(e).__name__}: {e}")


async def soak(url: str, http: str, procs: dict[str, psutil.Process], sessions: int, minutes: float,
               clip_s: float, held: bool = False) -> dict:
    audio = demo_sentences(clip_s)
    stats = {"sessions": 0, "errors": [], "words": 0, "latencies": [], "latency_at": []}
    t0 = time.monotonic()
    until = t0 + minutes * 60
    loop = held_session if held else session_loop
    loops = [asyncio.create_task(loop(url, audio, i * clip_s / sessions, until, stats))
             for i in range(sessions)]
    samples = []
    before = scrape(http)
    while time.monotonic() < until:
        await asyncio.sleep(min(SAMPLE_S, max(0.0, until - time.monotonic())))
        now = scrape(http)
        passes_before, passes_now = histogram(before, "whistle_pass_seconds"), histogram(now, "whistle_pass_seconds")
        samples.append({"t": round(time.monotonic() - t0, 1), "procs": sample(procs),
                        "pass_p50": histogram_quantile(passes_before, passes_now, 0.5),
                        "pass_p95": histogram_quantile(passes_before, passes_now, 0.95),
                        "sessions": stats["sessions"], "errors": len(stats["errors"]),
                        "full_gcs": metric(now, 'python_gc_collections_total{generation="2"}')})
        before = now
        s = samples[-1]
        print(f"{s['t']:7.0f} s  " + "  ".join(
            f"{n} {v['rss_mb']:.0f} MB {v['fds']} fds {v['threads']} thr" for n, v in s["procs"].items() if v)
            + f"  pass p95 {1000 * (s['pass_p95'] or 0):.0f} ms  sessions {s['sessions']}  errors {s['errors']}"
            + f"  full GCs {s['full_gcs']:.0f}",
            flush=True)
    await asyncio.gather(*loops)
    await asyncio.sleep(5.0)                     # the closed sessions' memory handed back
    after = {"t": round(time.monotonic() - t0, 1), "procs": sample(procs)}
    lat, at = np.asarray(stats["latencies"]), np.asarray(stats["latency_at"]) - t0

    def p95(lo: float, hi: float) -> float | None:
        part = lat[(at >= lo) & (at < hi)] if len(at) == len(lat) else np.zeros(0)
        return float(np.percentile(part, 95)) if len(part) else None

    end = minutes * 60
    return {"samples": samples, "after_close": after, "sessions": stats["sessions"], "errors": stats["errors"],
            "words": stats["words"], "commit_p95_s": float(np.percentile(lat, 95)) if len(lat) else None,
            "commit_p95_first_s": p95(WARMUP_S, WARMUP_S + 600), "commit_p95_last_s": p95(end - 600, end)}


def report(result: dict, minutes: float, sessions: int) -> int:
    samples = result["samples"]
    times = [s["t"] for s in samples]
    print(f"\n{sessions} real-time sessions for {minutes:g} min: {result['sessions']} sessions opened, "
          f"{len(result['errors'])} errors, {result['words']} words committed, commit p95 "
          f"{result['commit_p95_s'] or float('nan'):.2f} s")
    print(f"slopes after the first {WARMUP_S / 60:.0f} minutes (least squares, per hour):")
    names = [n for n in samples[-1]["procs"]] if samples else []
    for name in names:
        series = [(t, s["procs"].get(name)) for t, s in zip(times, samples)]
        series = [(t, v) for t, v in series if v]
        ts = [t for t, _ in series]
        rss = [v["rss_mb"] for _, v in series]
        line = (f"  {name:8s} RSS {rss[0]:.0f} -> {rss[-1]:.0f} MB, slope {slope_per_hour(ts, rss):+.1f} MB/h; "
                f"fds {series[0][1]['fds']} -> {series[-1][1]['fds']} ({slope_per_hour(ts, [v['fds'] for _, v in series]):+.1f}/h); "
                f"threads {series[0][1]['threads']} -> {series[-1][1]['threads']} "
                f"({slope_per_hour(ts, [v['threads'] for _, v in series]):+.1f}/h)")
        print(line)
    if result.get("after_close") and samples:
        gone = "; ".join(f"{n} {samples[0]['procs'][n]['rss_mb']:.0f} -> {v['rss_mb']:.0f} MB"
                         for n, v in result["after_close"]["procs"].items() if v and samples[0]["procs"].get(n))
        print(f"  after the sessions closed, against the first sample: {gone}")
    first, last = result.get("commit_p95_first_s"), result.get("commit_p95_last_s")
    if first and last:
        print(f"  commit p95 {first:.2f} s in the first ten minutes after the warm-up, {last:.2f} s in the last "
              f"ten ({100 * (last / first - 1):+.0f} %)")
    p95 = [(t, s["pass_p95"]) for t, s in zip(times, samples) if s["pass_p95"] is not None]
    if p95:
        print(f"  pass p95 {1000 * p95[0][1]:.0f} -> {1000 * p95[-1][1]:.0f} ms, slope "
              f"{1000 * slope_per_hour([t for t, _ in p95], [v for _, v in p95]):+.1f} ms/h")
    for error in result["errors"][:10]:
        print(f"  error: {error}")
    return 1 if result["errors"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (default: start one here)")
    p.add_argument("--pids", help="with --url: the server's pid (its engine processes are its children)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--clip-s", type=float, default=60.0, help="seconds of speech one session streams")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--held", action="store_true", help="every session held open for the whole run")
    p.add_argument("--out", help="write the samples here (JSON)")
    args = p.parse_args(argv)
    if args.url:
        server = psutil.Process(int(args.pids))
        run = soak(args.url, args.url.replace("ws://", "http://"), engine_processes(server), args.sessions,
                   args.minutes, args.clip_s, args.held)
        result = asyncio.run(run)
    else:
        from harness.servers import ServerProcess

        with ServerProcess("--processes", str(args.processes), "--max-sessions", str(args.sessions + 4)) as s:
            procs = engine_processes(psutil.Process(s.proc.pid))
            result = asyncio.run(soak(s.url, s.http, procs, args.sessions, args.minutes, args.clip_s, args.held))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return report(result, args.minutes, args.sessions)


if __name__ == "__main__":
    sys.exit(main())
