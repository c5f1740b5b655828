"""Encoder speed: our engine against the jitted JAX reference, in the same run, on 30 s of audio.

    python benchmarks/encoder.py                      # full architecture, 30 s espeak clip
    python benchmarks/encoder.py --shape tiny --repeats 10
    python benchmarks/encoder.py --model path.cact --no-reference
    python benchmarks/encoder.py --threads 2          # only the 2-thread engine (default: 1 and 2)
    python benchmarks/encoder.py --products float     # only the float products (default: both where the CPU has the integer ones)
    python benchmarks/encoder.py --engine WORKTREE --lengths 3,10,30   # against another checkout's engine

Both sides run the whole embed path (front end with level gain, stem, encoder) on the same clip,
warm (JIT compiled, caches loaded), alternating so machine load hits both alike. Prints best and
median wall time, their ratio, the cosine between the outputs and the peak RSS of the process
of our engine alone (measured in a child process that never imports JAX) and of the whole run.
On a CPU with the integer products (kernels/integer.py: AVX-512 VNNI, or the AVX2 path) the
engine runs both ways in the same run, integer and float products, each with its cosine to the
reference, its times and the peak RSS of a child that builds only that path (WHISTLE_INTEGER=1
or 0). Under WHISTLE_JIT_TARGET=x86-64-v3 an AVX-512 host compiles and times the AVX2 path.

With --engine, this checkout's engine runs against the engine of another checkout (a git worktree
of the previous commit, say) instead of the reference: each in its own child process that loads
only the engine, both on the same clips of each length, their encodes alternating so machine
load hits both alike; prints each side's best and median per length, their ratio, the largest
difference between their outputs, and each child's peak and anonymous RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from whistle_stream import kernels  # noqa: E402
from whistle_stream.container import CactFile  # noqa: E402
from whistle_stream.encoder import Encoder  # noqa: E402
from whistle_stream.kernels import integer  # noqa: E402


def peak_rss_mb() -> float:
    """Peak resident set of this process in MB. VmHWM, since ru_maxrss survives exec on Linux
    and would report the parent's peak in the child."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def clip(seconds: float) -> np.ndarray:
    from tests.harness.audio import speech_of_length

    return speech_of_length(int(seconds * 16000) - 1)


_AB_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[2])
import numpy as np
from whistle_stream import kernels
from whistle_stream.container import CactFile
from whistle_stream.encoder import Encoder
from tests.harness.audio import speech_of_length
kernels.set_threads(int(sys.argv[4]))
engine = Encoder(CactFile(sys.argv[3]))
feats = {}
for line in sys.stdin:
    seconds = float(line)
    if seconds not in feats:
        feats[seconds] = engine.features(speech_of_length(int(seconds * 16000) - 1))
        out = engine.encode(feats[seconds])   # warm-up (JIT cache), and the output to compare
        np.save(sys.argv[5] + f"-{seconds:g}.npy", out)
    start = time.perf_counter()
    engine.encode(feats[seconds])
    took = time.perf_counter() - start
    with open("/proc/self/status") as f:
        mem = {l.split(":")[0]: int(l.split()[1]) / 1024.0 for l in f if l.startswith(("VmHWM", "RssAnon"))}
    print(took, mem["VmHWM"], mem["RssAnon"], flush=True)
"""


def against_engine(path: str, other: Path, lengths: list[float], repeats: int, threads: int) -> None:
    """--engine: this checkout's encoder against `other`'s, alternating, in two child processes."""
    import tempfile

    sides = {"this": ROOT, "other": other.resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        procs = {name: subprocess.Popen([sys.executable, "-c", _AB_CHILD, str(root), str(ROOT), str(path),
                                         str(threads), f"{tmp}/{name}"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for name, root in sides.items()}

        def encode(name: str, seconds: float) -> list[float]:
            procs[name].stdin.write(f"{seconds}\n")
            procs[name].stdin.flush()
            return [float(v) for v in procs[name].stdout.readline().split()]

        times = {(n, s): [] for n in sides for s in lengths}
        mem = {}
        for _ in range(repeats + 1):  # the first round only warms up
            for seconds in lengths:
                for name in sides:
                    took, hwm, anon = encode(name, seconds)
                    times[name, seconds].append(took)
                    mem[name] = (hwm, anon)
        diffs = {s: float(np.abs(np.load(f"{tmp}/this-{s:g}.npy") - np.load(f"{tmp}/other-{s:g}.npy")).max())
                 for s in lengths}
        for p in procs.values():
            p.stdin.close()
            p.wait()
    print(f"model {path}; {threads} thread{'s' if threads > 1 else ''}; this checkout {ROOT}, other {other}")
    for seconds in lengths:
        this, base = times["this", seconds][1:], times["other", seconds][1:]
        print(f"{seconds:g} s: this best {min(this) * 1e3:.1f} ms, median {np.median(this) * 1e3:.1f} ms; "
              f"other best {min(base) * 1e3:.1f} ms, median {np.median(base) * 1e3:.1f} ms; "
              f"other / this: best {min(base) / min(this):.2f}x, median {np.median(base) / np.median(this):.2f}x; "
              f"largest output difference {diffs[seconds]:.3g}")
    for name in sides:
        print(f"{name}: peak RSS {mem[name][0]:.0f} MB, anonymous now {mem[name][1]:.0f} MB")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="full", help="harness model shape (tiny, odd, full)")
    ap.add_argument("--model", help="a .cact to run instead of the harness model (implies --no-reference)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--threads", default="1,2",
                    help="comma-separated engine thread counts to time (kernels.set_threads); JAX uses its own")
    ap.add_argument("--engine", type=Path, help="another checkout's root: time its encoder against this one's")
    ap.add_argument("--lengths", default="3,10,30", help="with --engine: comma-separated clip lengths in seconds")
    ap.add_argument("--products", default="integer,float",
                    help="comma-separated product paths to time: integer (where the CPU has them), float")
    ap.add_argument("--rss-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        if not (args.engine / "whistle_stream" / "encoder.py").is_file():
            ap.error(f"--engine {args.engine}: not a checkout (no whistle_stream/encoder.py there)")
        path = args.model
        if path is None:
            from tests.harness.reference import build_model

            path = build_model(args.shape).path
        against_engine(str(path), args.engine, [float(v) for v in args.lengths.split(",")], args.repeats,
                       int(args.threads.split(",")[0]))
        return

    pcm = clip(args.seconds)
    ref_model = None
    if args.model:
        path, args.no_reference = args.model, True
    else:
        from tests.harness.reference import build_model

        ref_model = build_model(args.shape)
        path = ref_model.path

    products = [p for p in args.products.split(",") if p == "float" or (p == "integer" and integer.AVAILABLE)]
    if not products:
        ap.error(f"--products {args.products}: none of these runs here (integer needs AVX-512 VNNI or AVX2)")

    def use(product: str) -> None:
        kernels.INTEGER_PRODUCTS = product == "integer"

    start = time.perf_counter()
    use("integer" if "integer" in products else "float")  # the matrices built for both paths
    engine = Encoder(CactFile(path))
    if args.rss_only:
        use(products[0])
        engine.embed(pcm)
        print(f"{peak_rss_mb():.0f}")
        return
    ours = {}
    for product in products:
        use(product)
        engine.embed(pcm[:16000])  # JIT / cache warm-up
        ours[product] = engine.embed(pcm)
    print(f"engine load + warm-up: {time.perf_counter() - start:.2f} s")
    # Peak RSS of the engine alone, in a process that never imports JAX and builds only this path.
    rss_engine = {}
    for product in products:
        env = dict(os.environ, **{integer.ENV: "1" if product == "integer" else "0"})
        rss_engine[product] = float(subprocess.run(
            [sys.executable, __file__, "--model", str(path), "--seconds", str(args.seconds), "--rss-only",
             "--products", product], check=True, capture_output=True, text=True, env=env).stdout.split()[-1])

    run_ref = None
    if not args.no_reference:
        import jax.numpy as jnp
        from tests.harness import reference as R

        R._deploy()
        levelled = R.reference_level(R.reference_sanitize(pcm))
        fn = R._encode_fn(ref_model.cfg)
        wav, lengths = jnp.asarray(levelled)[None], jnp.array([len(levelled)], jnp.int32)

        def run_ref():
            enc, frames = fn(ref_model.qparams, wav, lengths)
            enc.block_until_ready()
            return np.asarray(enc[0, :int(frames[0])])

        start = time.perf_counter()
        ref = run_ref()
        print(f"reference compile + first run: {time.perf_counter() - start:.2f} s")
        for product, out in ours.items():
            cos = float((out.ravel() @ ref.ravel()) / (np.linalg.norm(out) * np.linalg.norm(ref)))
            print(f"{product} products: frames: engine {len(out)}, reference {len(ref)}; cosine over the clip {cos:.6f}")

    settings = [(int(t), p) for t in args.threads.split(",") for p in products]
    t_ours, t_ref = {s: [] for s in settings}, []
    for threads, product in settings:  # compile / pool warm-up of every setting
        kernels.set_threads(threads)
        use(product)
        engine.embed(pcm)
    for _ in range(args.repeats):  # interleaved so machine load hits every side alike
        for threads, product in settings:
            kernels.set_threads(threads)
            use(product)
            t_ours[threads, product].append(timed(lambda: engine.embed(pcm)))
        if run_ref is not None:
            t_ref.append(timed(run_ref))

    kernels.set_threads(settings[0][0])
    use(products[0])
    feats = engine.features(pcm)
    t_front = min(timed(lambda: engine.features(pcm)) for _ in range(3))
    t_stem = min(timed(lambda: engine.stem(feats)) for _ in range(3))

    def name(threads: int, product: str) -> str:
        return f"{threads} thread{'s' if threads > 1 else ''}, {product} products"

    print(f"audio: {len(pcm) / 16000:.2f} s, {len(ours[products[0]])} encoder frames, model {path}")
    for setting, ts in t_ours.items():
        print(f"engine, {name(*setting)}: best {min(ts):.3f} s, median {np.median(ts):.3f} s")
    print(f"  ({name(*settings[0])}: front end {t_front * 1e3:.0f} ms, stem {t_stem * 1e3:.0f} ms)")
    if t_ref:
        print(f"reference: best {min(t_ref):.3f} s, median {np.median(t_ref):.3f} s (JAX, jitted, warm)")
        for setting, ts in t_ours.items():
            print(f"ratio engine / reference ({name(*setting)}): "
                  f"best {min(ts) / min(t_ref):.2f}, median {np.median(ts) / np.median(t_ref):.2f}")
    if len(products) == 2:
        for threads in dict.fromkeys(t for t, _ in settings):
            a, b = t_ours[threads, "integer"], t_ours[threads, "float"]
            print(f"integer / float products ({threads} thread{'s' if threads > 1 else ''}): "
                  f"best {min(a) / min(b):.2f}, median {np.median(a) / np.median(b):.2f}")
    for product in products:
        print(f"peak RSS, {product} products: engine alone {rss_engine[product]:.0f} MB (own process, no JAX)")
    print(f"peak RSS of this run with the reference {peak_rss_mb():.0f} MB")

if __name__ == "__main__":
    main()
