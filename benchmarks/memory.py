"""Peak memory of the engine: one process loads a model, transcribes 30 s with word times, then
streams the same 30 s in 1 s steps; the peak RSS (VmHWM) is printed after each phase.

    python benchmarks/memory.py                 # the harness's full architecture (random weights)
    python benchmarks/memory.py --model demo    # the bundled model
    python benchmarks/memory.py --model PATH.cact

The phases run in one child process that imports only the engine (no JAX), so the figures are the
engine's own. The first line, "loaded and warm", is that process with numpy, numba, the model and
its kernels loaded from the JIT cache (`whistle-stream warm` runs first, so no compile counts):
what any process of ours holds before it reads audio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness_model import model_path  # noqa: E402

_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024.0 for l in f if l.startswith("VmHWM:"))
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024.0 for l in f if l.startswith("VmRSS:"))
out = {}
from whistle_stream import Whistle
from tests.harness.audio import speech_of_length
model = Whistle(sys.argv[1] or None)
model.warmup()
out["loaded and warm"] = (rss(), peak())
audio = speech_of_length(30 * 16000 - 1)
model.transcribe(audio, word_timestamps=True)
out["30 s transcribed with word times"] = (rss(), peak())
stream = model.open_stream()
for i in range(0, len(audio), 16000):
    stream.feed(audio[i:i + 16000])
stream.finish()
out["30 s streamed in 1 s steps"] = (rss(), peak())
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="full", help="full (default), demo, or a .cact path")
    args = ap.parse_args(argv)
    model = model_path(args.model) or ""
    subprocess.run([sys.executable, "-m", "whistle_stream.cli", "warm"] + (["--model", model] if model else []),
                   check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-c", _CHILD, model, str(ROOT)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    phases = json.loads(done.stdout.splitlines()[-1])
    print(f"model: {model or 'bundled demo'}")
    print(f"{'after':<36} {'RSS':>8} {'peak RSS':>9}")
    for name, (now, peak) in phases.items():
        print(f"{name:<36} {now:>5.0f} MB {peak:>6.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
