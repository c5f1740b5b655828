"""One stream's passes on the full architecture, this checkout's engine against another's.

    python benchmarks/passes.py --engine WORKTREE              # 30 s of demo sentences with pauses
    python benchmarks/passes.py --engine WORKTREE --audio espeak --seconds 30   # speech without pauses
    python benchmarks/passes.py --engine . --this-env WHISTLE_INTEGER=1          # one checkout, two settings

What a live session costs the server, without the server: a `StreamSession` over the full
architecture (random weights, the shipped 8199-row vocabulary) reads a stream in 1 s steps, its
passes held to --tokens-per-second and scripted as `load.py --scripted` holds them
(benchmarks/spoken_tokens.py), so words commit and each pass decodes what a real model's would.
Each engine runs in its own child process (`whistle_stream` imported from its checkout, one
thread); the streams alternate between them --repeats times after a warm-up. Prints each side's
median and best of the summed pass time, the pass count, the p95 pass, their ratio, and whether the
two engines committed the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

_CHILD = r"""
import hashlib, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2] + "/benchmarks"]
import numpy as np
import whistle_stream.search, whistle_stream.streaming   # this engine's, first
from whistle_stream import Whistle
from whistle_stream import kernels
import spoken_tokens
spoken_tokens.install(float(sys.argv[4]), scripted=True)
spoken_tokens.shipped_vocabulary(int(sys.argv[5]))
kernels.set_threads(1)
model = Whistle(sys.argv[3])
audio = np.load(sys.argv[6])
for line in sys.stdin:
    passes = []
    stream = whistle_stream.streaming.StreamSession(model, language="en", on_pass=passes.append)
    text = []
    for i in range(0, len(audio), 1600):
        text.append(stream.feed(audio[i:i + 1600])["text"])
    text.append(stream.finish()["text"])
    ms = [p["pass_ms"] for p in passes if p["pass_ms"] > 0]
    print(json.dumps({"total_s": sum(ms) / 1e3, "passes": len(ms), "p95_ms": float(np.percentile(ms, 95)),
                      "text": hashlib.sha256("".join(text).encode()).hexdigest()[:12],
                      "words": len("".join(text).split())}), flush=True)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True, help="another checkout's root (a git worktree)")
    ap.add_argument("--audio", choices=("demo", "espeak"), default="demo",
                    help="held-out demo sentences with pauses (default), or espeak-ng reading a paragraph")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens-per-second", type=float, default=4.0)
    ap.add_argument("--vocab", type=int, default=8199, help="embedding and head rows (0: the model's own)")
    ap.add_argument("--this-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for this checkout's child only (repeatable)")
    args = ap.parse_args(argv)
    if any("=" not in e for e in args.this_env):
        ap.error("--this-env takes NAME=VALUE")
    this_env = dict(e.split("=", 1) for e in args.this_env)
    if not (args.engine / "whistle_stream" / "streaming.py").exists():
        ap.error(f"--engine {args.engine}: not a checkout (no whistle_stream/streaming.py there)")
    if args.repeats < 1 or args.seconds <= 0:
        ap.error("--repeats must be at least 1 and --seconds positive")

    from harness_model import ENGINE_ROOT, model_path
    from load import RATE, stream_audio

    audio = stream_audio(args.audio, args.seconds)
    path = model_path("full")
    sides = {"this": ROOT, "other": args.engine.resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/audio.npy", audio.astype(np.float32))
        procs = {name: subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(ROOT), path,
                                         str(args.tokens_per_second), str(args.vocab), f"{tmp}/audio.npy"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, ENGINE_ROOT: str(root),
                                             **(this_env if name == "this" else {})})
                 for name, root in sides.items()}

        def stream(name: str) -> dict:
            procs[name].stdin.write("go\n")
            procs[name].stdin.flush()
            line = procs[name].stdout.readline()
            if not line:
                raise SystemExit(f"the {name} engine's child exited: {procs[name].wait()}")
            return json.loads(line)

        runs = {name: [] for name in sides}
        for _ in range(args.repeats + 1):   # the first round only warms up
            for name in sides:
                runs[name].append(stream(name))
        for p in procs.values():
            p.stdin.close()
            p.wait()
    print(f"full architecture, {args.vocab}-row vocabulary, {len(audio) / RATE:.0f} s of "
          f"{'demo sentences with pauses' if args.audio == 'demo' else 'espeak-ng speech'}, 1 s steps, "
          f"{args.tokens_per_second:g} scripted tokens per audio second, 1 thread; other: {args.engine}"
          + (f"; this with {' '.join(args.this_env)}" if args.this_env else ""))
    summary = {}
    for name in sides:
        kept = runs[name][1:]
        totals = [r["total_s"] for r in kept]
        summary[name] = float(np.median(totals))
        print(f"{name}: passes {kept[0]['passes']}, summed pass time median {np.median(totals):.3f} s, best "
              f"{min(totals):.3f} s, p95 pass {np.median([r['p95_ms'] for r in kept]):.0f} ms; "
              f"{kept[0]['words']} words committed, text {kept[0]['text']}")
    same = len({r["text"] for name in sides for r in runs[name]}) == 1
    print(f"other / this: {summary['other'] / summary['this']:.2f}x (median summed pass time); "
          f"committed text {'identical' if same else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
