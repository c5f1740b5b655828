"""Peak memory of one long upload: the engine transcribes N minutes of audio the way the server's
/v1/audio/transcriptions does (`by="utterances"`, word times; `--by windows` as `Whistle.transcribe`
defaults), in a child process per checkout.

    python benchmarks/upload_memory.py --minutes 60                    # this checkout
    python benchmarks/upload_memory.py --minutes 60 --engine WORKTREE  # and another, same run
    python benchmarks/upload_memory.py --minutes 20 --by windows       # Whistle.transcribe's default

The audio is a 300 Hz tone in 2 s bursts over a low noise floor (pauses the utterance rule cuts
at), made in 10 s pieces so that making it costs no more than the samples themselves. Prints the
child's peak RSS (VmHWM) with the demo model loaded and warm and the audio in memory, then after
the transcription, and the ratio of the transcriptions' own peaks (after minus before).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, sys
import numpy as np
from whistle_stream.whistle import Whistle

def peak_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024

minutes, by = float(sys.argv[1]), sys.argv[2]
model = Whistle()
model.warmup()
n, rate = int(16000 * 60 * minutes), 16000
rng = np.random.default_rng(0)
audio = np.empty(n, np.float32)
for a in range(0, n, rate * 10):
    b = min(n, a + rate * 10)
    t = np.arange(a, b) / rate
    audio[a:b] = 0.1 * np.sin(2 * np.pi * 300 * t) * (np.sin(2 * np.pi * 0.25 * t) > 0) + 0.003 * rng.standard_normal(b - a)
before = peak_mb()
result = model.transcribe(audio, by=by, word_timestamps=True)
print(json.dumps({"before": before, "after": peak_mb(), "words": len(result["words"])}))
"""


def measure(root: Path, minutes: float, by: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(minutes), by], cwd=root, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="audio length (default 60)")
    ap.add_argument("--by", choices=("utterances", "windows"), default="utterances",
                    help="how the clip is read (default utterances: what the server's uploads do)")
    ap.add_argument("--engine", type=Path, help="another checkout's root (a git worktree), measured in the same run")
    args = ap.parse_args(argv)
    rows = [("this checkout", measure(ROOT, args.minutes, args.by))]
    if args.engine:
        rows.append((str(args.engine), measure(args.engine.resolve(), args.minutes, args.by)))
    print(f"{args.minutes:g} min of audio ({args.minutes * 60 * 16000 * 4 / 2 ** 20:.0f} MB of float32), "
          f"demo model, by {args.by} with word times")
    print(f"{'engine':<28} {'peak RSS before':>16} {'after':>8} {'the transcription':>18} {'words':>6}")
    for name, r in rows:
        print(f"{name:<28} {r['before']:>13.0f} MB {r['after']:>5.0f} MB {r['after'] - r['before']:>15.0f} MB "
              f"{r['words']:>6}")
    if len(rows) == 2:
        (_, a), (_, b) = rows
        print(f"\nthe transcription's own peak: {(b['after'] - b['before']) / max(1.0, a['after'] - a['before']):.2f}x "
              f"less with this checkout; same words: {a['words'] == b['words']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
