"""Load test: N concurrent real-time streams of a speech WAV against a whistle-stream server.

    python benchmarks/load.py --sessions 16                    # starts `whistle-stream serve` itself
    python benchmarks/load.py --sweep 4,8,16,24,32             # largest N that stays real time
    python benchmarks/load.py --url ws://host:8000 --sessions 8
    python benchmarks/load.py --fake --sessions 16             # the fake engine (tests/fakes.py), a smoke run
    python benchmarks/load.py --replicas 3 --sweep 8,16,24     # one replica alone, then 3 behind HAProxy
    python benchmarks/load.py --model full --spoken-tokens 4   # full architecture, realistic token counts
    python benchmarks/load.py --model full --spoken-tokens 4 --scripted --prefill both   # words commit
    python benchmarks/load.py --engine WORKTREE --sweep 16,24  # against another checkout, level by level

Audio: --wav, else held-out demo sentences with pauses (what the bundled model reads steadily), or
with --audio espeak espeak-ng reading text outside its vocabulary. Each stream sends its audio in
100 ms frames paced at real time, then `close`. Commit latency is
measured at the client: the time a word arrives in a `committed` message minus the time its last
audio was sent. Pass time comes from the server's /metrics histogram (the delta over the run),
CPU from the server process when this script started it (else the whole machine). A level is
"sustained" when every stream ends without an error and p95 commit latency is under --target-p95.
A model with random weights commits few words, late, however idle the server is (the full
architecture's p95 is over 3 s with one stream); for it, `--judge tail` holds each level to the
server keeping up instead: the p95 over streams of the tail (seconds from a stream's last audio to
its final message) under --target-tail. A server that falls behind real time queues passes, and the
backlog shows in the tail.

--replicas R measures the sweep twice in one run: against one replica alone, then against R
replicas behind Debian's HAProxy running the shipped docker/haproxy.cfg on loopback
(tests/harness/balancer.py), and prints the ratio of their largest sustained N. On one machine
the replicas share its cores, so the ratio shows what the balancer costs, not what more machines
give (3x on three machines is the ideal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))

from harness_model import ENGINE_ROOT, SHIPPED_VOCAB, model_path  # noqa: E402
from whistle_stream.clients.client import ListenClient  # noqa: E402
from whistle_stream.service import protocol as P  # noqa: E402

RATE = 16000
FRAME_S = 0.1
SPEECH = ("The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore. "
          "A journey of a thousand miles begins with a single step. Peter Piper picked a peck of "
          "pickled peppers. How much wood would a woodchuck chuck if a woodchuck could chuck wood.")


def load_wav(path: str) -> np.ndarray:
    with wave.open(path, "rb") as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        data = w.readframes(w.getnframes())
    if width != 2:
        raise SystemExit(f"{path}: need 16-bit PCM WAV, got {8 * width}-bit")
    audio = np.frombuffer(data, "<i2").reshape(-1, channels).mean(1).astype(np.float32) / 32768
    if rate != RATE:
        import soxr
        audio = soxr.resample(audio, rate, RATE).astype(np.float32)
    return audio


def demo_sentences(seconds: float) -> np.ndarray:
    """Held-out demo-model sentences joined with pauses (benchmarks/streaming.py's stream), the
    default: speech the bundled model reads steadily, so latency measures the server, not the
    model changing its mind."""
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
    from streaming import build_stream

    audio, _ = build_stream(max(1, int(seconds / 3.5) + 1), seed=3)
    return audio


def synthesize_speech() -> np.ndarray:
    """A speech clip from espeak-ng (installed on the dev machine): text outside the demo model's
    vocabulary (`--audio espeak`)."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit("no --wav given and espeak-ng is not installed")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "speech.wav")
        subprocess.run(["espeak-ng", "-s", "150", "-w", path, SPEECH], check=True)
        return load_wav(path)


def scrape(http_url: str) -> str:
    with urllib.request.urlopen(http_url + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float:
    """One sample's value from a /metrics scrape (name with its labels); nan when absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return float("nan")


def histogram(text: str, name: str) -> dict[float, float]:
    out = {}
    for le, value in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} ([0-9.e+-]+)$', text, re.M):
        out[float("inf") if le == "+Inf" else float(le)] = float(value)
    return out


def _summed(scrapes: list[str], name: str = "whistle_pass_seconds") -> dict[float, float]:
    """One histogram over several servers' scrapes: the sum of each bucket."""
    out: dict[float, float] = {}
    for text in scrapes:
        for bound, count in histogram(text, name).items():
            out[bound] = out.get(bound, 0.0) + count
    return out


def histogram_quantile(before: dict, after: dict, q: float) -> float | None:
    """Quantile of the observations between two scrapes, interpolated within a bucket."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0
    if not total:
        return None
    rank, previous_bound, previous_count = q * total, 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return previous_bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / max(count - previous_count, 1e-9)
        previous_bound, previous_count = bound, count
    return bounds[-2] if len(bounds) > 1 else None


async def one_stream(url: str, audio: np.ndarray, token: str | None, start_delay: float) -> dict:
    await asyncio.sleep(start_delay)
    result = {"latencies": [], "error": None, "final": None}
    client = ListenClient(url, token=token, retries=2, backoff=0.5)
    try:
        await client.connect()
    except Exception as e:
        result["error"] = f"connect: {e}"
        return result
    t0 = time.monotonic()

    async def receive():
        async for m in client:
            now = time.monotonic()
            if isinstance(m, P.Committed):
                result["latencies"] += [now - (t0 + w.end) for w in m.words]
            elif isinstance(m, P.Error):
                result["error"] = f"{m.code.value}: {m.message}"
            elif isinstance(m, P.Final) and m.reason != "finalize":
                result["final"] = m

    receiver = asyncio.create_task(receive())
    frame = int(FRAME_S * RATE)
    try:
        for i in range(0, len(audio), frame):
            await client.send_audio(audio[i:i + frame])
            delay = t0 + (i + frame) / RATE - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        result["sent_s"] = time.monotonic() - t0
        await client.request_close()
        await asyncio.wait_for(receiver, 120)
        result["tail_s"] = time.monotonic() - t0 - len(audio) / RATE
    except Exception as e:
        result["error"] = result["error"] or f"{type(e).__name__}: {e}"
        receiver.cancel()
    return result


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def _cpu(procs):
    """CPU seconds of the server processes and their engine worker processes (the machine's when none)."""
    import psutil
    if not procs:
        t = psutil.cpu_times()
        return t.user + t.system
    total = 0.0
    for p in procs:
        for q in [p] + p.children(recursive=True):
            try:
                t = q.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


async def run_level(url: str, http_urls: list[str], audio: np.ndarray, n: int, token, server_pids) -> dict:
    """One level: n streams against url; pass times summed over the servers at http_urls, CPU over
    server_pids (the whole machine when empty)."""
    import psutil
    procs = [psutil.Process(pid) for pid in server_pids]
    before = [scrape(u) for u in http_urls]
    cpu0 = _cpu(procs)
    wall0 = time.monotonic()
    # stagger the starts over one step so the passes do not all land at once
    results = await asyncio.gather(*(one_stream(url, audio, token, k / n) for k in range(n)))
    wall = time.monotonic() - wall0
    busy = _cpu(procs) - cpu0
    after = [scrape(u) for u in http_urls]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    latencies = [x for r in results for x in r["latencies"]]
    errors = [r["error"] for r in results if r["error"] or r["final"] is None]
    return {
        "sessions": n,
        "errors": len(errors),
        "error_examples": [e for e in errors if e][:3],
        "words": len(latencies),
        "commit_p50": percentile(latencies, 50),
        "commit_p95": percentile(latencies, 95),
        "pass_p95": histogram_quantile(_summed(before), _summed(after), 0.95),
        "cpu_percent": 100.0 * busy / wall,   # percent of one core
        "cores": cores,
        "tail_p95": percentile([r.get("tail_s", float("nan")) for r in results if "tail_s" in r], 95),
    }


def forward_errors(lines) -> None:
    """Read a server's JSON log lines to the end, printing those at level error (with their
    traceback) to stderr: a session's `internal` error in the table has its cause beside it."""
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("level") in ("error", "critical"):
            print(f"server {event.get('level')}: {event.get('event')} {event.get('session', '')}\n"
                  f"{event.get('exc', '')}", file=sys.stderr, flush=True)


def start_server(args, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """Start a server on a free port: the real one (`whistle-stream serve`) or the fake; returns it
    and its ws:// URL once it is ready. root: the checkout whose code it runs (--engine)."""
    env = dict(os.environ)
    if args.fake:
        cmd = [sys.executable, str(root / "tests" / "fakes.py"), "serve", "--fake-pass-s", str(args.fake_pass_s)]
    else:
        model = model_path(args.model)
        cmd = [sys.executable, "-m", "whistle_stream.service.server"]
        if args.spoken_tokens or args.prefill == "off" or args.vocab or root != ROOT:
            # this checkout's harness (it does nothing with --tokens-per-second 0 and --vocab 0)
            # serving the code of `root`: both servers of --engine get the same harness, and each
            # its own checkout's engine and service
            env = {**env, ENGINE_ROOT: str(root)}
            cmd = [sys.executable, str(ROOT / "benchmarks" / "spoken_tokens.py"),
                   "--tokens-per-second", str(args.spoken_tokens), "--prefill", args.prefill,
                   "--vocab", str(args.vocab)] + (["--scripted"] if args.scripted else [])
        cmd += ["--model", model] if model else []
    cmd += ["--port", "0", "--max-sessions", str(max(args.levels) + 8)]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    if args.processes and root == ROOT:   # (another checkout's server may not know the flag)
        cmd += ["--processes", str(args.processes)]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stderr=subprocess.PIPE, text=True)
    port = None
    deadline = time.monotonic() + 600   # the first start may compile the JIT cache
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit(f"the server exited: {proc.wait()}")
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "listening":
            port = event["port"]
        elif event.get("event") == "ready":
            # keep draining stderr so the server never blocks on a full pipe, passing its errors on
            import threading
            threading.Thread(target=forward_errors, args=(proc.stderr,), daemon=True).start()
            return proc, f"ws://127.0.0.1:{port}"
    proc.kill()
    raise SystemExit("the server did not become ready")


def print_table(rows, target):
    head = f"{'N':>4} {'errors':>6} {'words':>6} {'commit p50':>11} {'commit p95':>11} {'pass p95':>9} {'CPU %':>7} {'tail p95':>9}  sustained"
    print(head)
    print("-" * len(head))
    def sec(x, digits=2):
        return "-" if x is None or x != x else f"{x:.{digits}f}s"

    for r in rows:
        ok = sustained(r, target)
        print(f"{r['sessions']:>4} {r['errors']:>6} {r['words']:>6} {sec(r['commit_p50']):>11} "
              f"{sec(r['commit_p95']):>11} {sec(r['pass_p95'], 3):>9} {r['cpu_percent']:>7.0f} "
              f"{sec(r['tail_p95']):>9}  {'yes' if ok else 'no'}")
        for e in r["error_examples"]:
            print(f"       error: {e}")


async def sweep(args, url: str, servers: list[tuple[subprocess.Popen, str]], audio) -> list[dict]:
    http_urls = ["http" + u[2:] for _, u in servers] or ["http" + url[2:]]
    rows = []
    for n in args.levels:
        row = await run_level(url, http_urls, audio, n, args.token, [p.pid for p, _ in servers])
        rows.append(row)
        print(f"N={n}: errors {row['errors']}, words {row['words']}, commit p95 {row['commit_p95']:.2f} s",
              file=sys.stderr)
        if args.stop_on_failure and not sustained(row, args.target):
            break
    return rows


class Target:
    """What a sustained level must stay under: p95 commit latency (judge "commit") or the p95 tail
    (judge "tail")."""

    def __init__(self, judge: str, seconds: float):
        self.judge, self.seconds = judge, seconds

    def __str__(self) -> str:
        what = "commit latency" if self.judge == "commit" else "tail after the last audio"
        return f"p95 {what} < {self.seconds:g} s, no errors"


def sustained(row: dict, target: Target) -> bool:
    value = row["commit_p95"] if target.judge == "commit" else row["tail_p95"]
    return row["errors"] == 0 and value < target.seconds


def largest(rows: list[dict], target: "Target") -> int:
    return max((r["sessions"] for r in rows if sustained(r, target)), default=0)


def stop(servers) -> None:
    for proc, _ in servers:
        proc.terminate()
    for proc, _ in servers:
        proc.wait(30)


async def through_balancer(args, audio) -> list[dict]:
    """args.replicas servers behind the shipped HAProxy configuration on loopback."""
    sys.path.insert(0, str(ROOT / "tests"))
    from harness.balancer import Balancer
    from harness.servers import free_port

    if shutil.which("haproxy") is None:
        raise SystemExit("--replicas needs Debian's haproxy (apt-get install haproxy)")
    servers = [start_server(args) for _ in range(args.replicas)]
    names = {f"whistle{i}": int(u.rsplit(":", 1)[1]) for i, (_, u) in enumerate(servers)}
    with tempfile.TemporaryDirectory() as folder:
        port = free_port()
        balancer = Balancer(Path(folder), names, port, free_port())
        try:
            balancer.wait_up(list(names))
            return await sweep(args, f"ws://127.0.0.1:{port}", servers, audio)
        finally:
            balancer.close()
            stop(servers)


def print_ratio(args, after_rows: list[dict], before_rows: list[dict], after: str, before: str) -> None:
    """The two sweeps' largest sustained N and their ratio, in one line."""
    new, old = largest(after_rows, args.target), largest(before_rows, args.target)
    ratio = f"{new / old:.2f}x" if old else "n/a"
    print(f"\nlargest sustained N ({args.target}): {new or 'none'} {after} against {old or 'none'} {before}: "
          f"{ratio}; model {args.model or 'demo'}"
          + (f", passes held to {args.spoken_tokens:g} tokens per audio second" if args.spoken_tokens else ""))


async def compare_prefill(args, audio) -> int:
    """The sweep against a server whose streams search their committed words again (the engine
    before the prefill), then against one that prefills them, in the same run."""
    found = {}
    for mode in ("off", "on"):
        args.prefill = mode
        servers = [start_server(args)]
        try:
            found[mode] = await sweep(args, servers[0][1], servers, audio)
        finally:
            stop(servers)
        print(f"\nprefill {mode}:")
        print_table(found[mode], args.target)
    print_ratio(args, found["on"], found["off"], "with the prefill", "without")
    return 0


def link_transport(root: Path) -> None:
    """Make `root`'s own service and clients what `whistle_stream.service` / `.clients` import when
    Python starts in `root` (links whistle_stream/service -> ../service and clients -> ../clients,
    where absent); else the editable install maps them to this checkout's folders."""
    for name in ("service", "clients"):
        link = root / "whistle_stream" / name
        if not link.exists() and (root / name).is_dir():
            link.symlink_to(Path("..") / name)


async def compare_engine(args, audio) -> int:
    """The sweep against a server running another checkout's code (--engine; started in that
    folder, so `whistle_stream` imports from it, and its service and clients through
    `link_transport`) and one running this checkout's, alternating level by level so machine load
    hits both alike. Each level starts its server afresh and stops it before the other's runs: only
    the server being measured is alive (docs/benchmarks.md has what two live servers did to a run)."""
    roots = {"other": args.engine.resolve(), "this": ROOT}
    link_transport(roots["other"])
    found = {name: [] for name in roots}
    for n in args.levels:
        for name, root in roots.items():
            proc, url = start_server(args, root)
            try:
                row = await run_level(url, ["http" + url[2:]], audio, n, args.token, [proc.pid])
            finally:
                stop([(proc, url)])
            found[name].append(row)
            print(f"{name} N={n}: errors {row['errors']}, words {row['words']}, "
                  f"commit p95 {row['commit_p95']:.2f} s, tail p95 {row['tail_p95']:.2f} s", file=sys.stderr)
    for name, label in (("other", f"the engine of {args.engine}"), ("this", "this checkout")):
        print(f"\n{label}:")
        print_table(found[name], args.target)
    print_ratio(args, found["this"], found["other"], "with this checkout", f"with {args.engine}")
    return 0


def stream_audio(kind: str, seconds: float, wav: str | None = None) -> np.ndarray:
    """Each stream's audio: the --wav file, else `kind` ("demo": held-out demo sentences with pauses;
    "espeak": espeak-ng reading a paragraph), looped or cut to `seconds` (0: as it is)."""
    if wav:
        audio = load_wav(wav)
    else:
        audio = synthesize_speech() if kind == "espeak" else demo_sentences(seconds)
    if seconds:
        reps = int(np.ceil(seconds * RATE / len(audio)))
        audio = np.tile(audio, reps)[: int(seconds * RATE)]
    return audio


async def amain(args) -> int:
    audio = stream_audio(args.audio, args.seconds, args.wav)
    if args.prefill == "both":
        return await compare_prefill(args, audio)
    if args.engine:
        return await compare_engine(args, audio)
    servers = [] if args.url else [start_server(args)]
    url = args.url or servers[0][1]
    try:
        rows = await sweep(args, url, servers, audio)
    finally:
        stop(servers)
    fleet = await through_balancer(args, audio) if args.replicas > 1 else None
    cores = rows[0]["cores"] if rows else "?"
    print(f"\nclip {len(audio) / RATE:.1f} s per stream, real-time pacing, {FRAME_S * 1000:.0f} ms frames, "
          f"server {'started here' if servers else url}, {cores} cores; model {args.model or 'demo'}"
          + (f", passes held to {args.spoken_tokens:g} tokens per audio second" if args.spoken_tokens else "")
          + (f", {args.vocab}-row embedding and head" if args.vocab else ""))
    if fleet is not None:
        print("\none replica alone:")
    print_table(rows, args.target)
    single = largest(rows, args.target)
    print(f"\nlargest sustained N: {single or 'none'} ({args.target})")
    if fleet is not None:
        print(f"\n{args.replicas} replicas behind HAProxy (docker/haproxy.cfg on loopback), same machine:")
        print_table(fleet, args.target)
        several = largest(fleet, args.target)
        ratio = f"{several / single:.2f}x" if single else "n/a"
        print(f"\nlargest sustained N: {several or 'none'} through the balancer against {single or 'none'} "
              f"alone: ratio {ratio} ({args.replicas} replicas sharing {cores} cores)")
    if args.json:
        Path(args.json).write_text(json.dumps({"single": rows, "replicas": fleet} if fleet is not None else rows,
                                              indent=2))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (default: start one here on a free port)")
    p.add_argument("--model", help="model for the server started here: demo (default), full (the harness's "
                                    "full architecture, random weights), or a .cact path")
    p.add_argument("--spoken-tokens", type=float, default=0.0, metavar="R",
                   help="passes decode R tokens per second of their audio before </s> may end them "
                        "(benchmarks/spoken_tokens.py: a random-weight model's passes cost what a real "
                        "model's would; 4 is about 3 words a second); 0: the model decides")
    p.add_argument("--workers", type=int, help="engine workers for the server started here")
    p.add_argument("--processes", type=int, help="engine worker processes for this checkout's server "
                   "(not for --engine's: that one keeps its default)")
    p.add_argument("--fake", action="store_true", help="start the fake engine instead (smoke test)")
    p.add_argument("--fake-pass-s", type=float, default=0.05, help="fake engine seconds per pass")
    p.add_argument("--wav", help="16-bit speech WAV (default: --audio)")
    p.add_argument("--audio", choices=("demo", "espeak"), default="demo",
                   help="without --wav: held-out demo sentences with pauses (default), or espeak-ng reading "
                        "text the demo model does not know (its readings change pass to pass; words wait "
                        "for pauses)")
    p.add_argument("--seconds", type=float, default=30.0, help="audio per stream (the clip loops)")
    p.add_argument("--sessions", type=int, default=16, help="concurrent streams")
    p.add_argument("--sweep", help="comma-separated session counts, run in order")
    p.add_argument("--stop-on-failure", action="store_true", help="stop the sweep at the first level not sustained")
    p.add_argument("--target-p95", type=float, default=3.0, help="p95 commit latency target, seconds")
    p.add_argument("--judge", choices=("commit", "tail"), default="commit",
                   help="what a sustained level is held to: p95 commit latency (default), or the p95 tail "
                        "(the server keeps up: for models with random weights, which commit late anyway)")
    p.add_argument("--target-tail", type=float, default=1.0, help="p95 tail target for --judge tail, seconds")
    p.add_argument("--token", default=os.environ.get("WHISTLE_TOKEN"))
    p.add_argument("--replicas", type=int, default=1,
                   help="also run the sweep against this many replicas behind HAProxy, in the same run")
    p.add_argument("--vocab", type=int, default=None,
                   help=f"embedding and head rows of the server's model (default: {SHIPPED_VOCAB}, the shipped "
                        "file's, for --model full, whose harness model has 519; else the model's own)")
    p.add_argument("--prefill", choices=("on", "off", "both"), default="on",
                   help="streams read their committed words in one teacher-forced run (on: the engine's "
                        "default), search them again (off: the engine before it), or sweep both in turn, "
                        "in the same run")
    p.add_argument("--scripted", action="store_true",
                   help="with --spoken-tokens: every pass reads one fixed word sequence, so passes agree and "
                        "words commit as a real model's do (benchmarks/spoken_tokens.py)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--engine", type=Path, help="another checkout's root (a git worktree of the previous commit): "
                                               "the sweep against its server (its engine and service) and this one's, level by level")
    args = p.parse_args(argv)
    if args.prefill == "both" and args.replicas > 1:
        p.error("--prefill both compares one server each way; leave out --replicas")
    if args.engine and (args.url or args.replicas > 1 or args.prefill == "both" or args.fake):
        p.error("--engine starts both servers here, one each: leave out --url, --replicas, --prefill both and --fake")
    if args.engine and not (args.engine / "whistle_stream" / "encoder.py").is_file():
        p.error(f"--engine {args.engine}: not a checkout (no whistle_stream/encoder.py there)")
    if args.replicas < 1 or (args.replicas > 1 and args.url):
        p.error("--replicas is 1 or more, and starts its servers here (not with --url)")
    args.levels = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.sessions]
    if args.vocab is not None and args.vocab < 0:
        p.error(f"--vocab is a row count (0: the model's own), got {args.vocab}")
    if args.vocab is None:
        args.vocab = SHIPPED_VOCAB if args.model == "full" and not args.fake else 0
    args.target = Target(args.judge, args.target_p95 if args.judge == "commit" else args.target_tail)
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
