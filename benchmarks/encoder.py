"""Encoder speed: our engine against the jitted JAX reference, in the same run, on 30 s of audio.

    python benchmarks/encoder.py                      # full architecture, 30 s espeak clip
    python benchmarks/encoder.py --shape tiny --repeats 10
    python benchmarks/encoder.py --model path.cact --no-reference
    python benchmarks/encoder.py --threads 2          # only the 2-thread engine (default: 1 and 2)

Both sides run the whole embed path (front end with level gain, stem, encoder) on the same clip,
warm (JIT compiled, caches loaded), alternating so machine load hits both alike. Prints best and
median wall time, their ratio, the cosine between the outputs and the peak RSS of the process
of our engine alone (measured in a child process that never imports JAX) and of the whole run.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--rss-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    pcm = clip(args.seconds)
    ref_model = None
    if args.model:
        path, args.no_reference = args.model, True
    else:
        from tests.harness.reference import build_model

        ref_model = build_model(args.shape)
        path = ref_model.path

    start = time.perf_counter()
    engine = Encoder(CactFile(path))
    engine.embed(pcm[:16000])  # JIT / cache warm-up
    ours = engine.embed(pcm)
    if args.rss_only:
        print(f"{peak_rss_mb():.0f}")
        return
    print(f"engine load + warm-up: {time.perf_counter() - start:.2f} s")
    # Peak RSS of the engine alone, in a process that never imports JAX.
    rss_engine = float(subprocess.run(
        [sys.executable, __file__, "--model", str(path), "--seconds", str(args.seconds), "--rss-only"],
        check=True, capture_output=True, text=True).stdout.split()[-1])

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
        cos = float((ours.ravel() @ ref.ravel()) / (np.linalg.norm(ours) * np.linalg.norm(ref)))
        print(f"frames: engine {len(ours)}, reference {len(ref)}; cosine over the clip {cos:.6f}")

    settings = [int(t) for t in args.threads.split(",")]
    t_ours, t_ref = {t: [] for t in settings}, []
    for threads in settings:  # compile / pool warm-up of every setting
        kernels.set_threads(threads)
        engine.embed(pcm)
    for _ in range(args.repeats):  # interleaved so machine load hits every side alike
        for threads in settings:
            kernels.set_threads(threads)
            t_ours[threads].append(timed(lambda: engine.embed(pcm)))
        if run_ref is not None:
            t_ref.append(timed(run_ref))

    kernels.set_threads(settings[0])
    feats = engine.features(pcm)
    t_front = min(timed(lambda: engine.features(pcm)) for _ in range(3))
    t_stem = min(timed(lambda: engine.stem(feats)) for _ in range(3))

    print(f"audio: {len(pcm) / 16000:.2f} s, {len(ours)} encoder frames, model {path}")
    for threads, ts in t_ours.items():
        print(f"engine, {threads} thread{'s' if threads > 1 else ''}: best {min(ts):.3f} s, "
              f"median {np.median(ts):.3f} s")
    print(f"  ({settings[0]} thread{'s' if settings[0] > 1 else ''}: front end {t_front * 1e3:.0f} ms, "
          f"stem {t_stem * 1e3:.0f} ms)")
    if t_ref:
        print(f"reference: best {min(t_ref):.3f} s, median {np.median(t_ref):.3f} s (JAX, jitted, warm)")
        for threads, ts in t_ours.items():
            print(f"ratio reference / engine ({threads} thread{'s' if threads > 1 else ''}): "
                  f"best {min(t_ref) / min(ts):.2f}x, median {np.median(t_ref) / np.median(ts):.2f}x")
    print(f"peak RSS: engine alone {rss_engine:.0f} MB (own process, no JAX), "
          f"this run with the reference {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
