"""File transcription: the guide's 30 s windows against utterances cut at pauses, in one run.

    python benchmarks/files.py                    # demo model: a 25 s file of ten sentences, a 180 s file
    python benchmarks/files.py --seeds 5,7,9      # more files

Each file is held-out demo sentences joined with natural pauses (benchmarks/streaming.py's
build_stream). Printed per file: WER of `transcribe(by="windows")` (the engine's §8 passes exactly),
of `transcribe(by="utterances")` (cut at pauses, what `whistle-stream transcribe` and the REST
endpoint do), and of every sentence transcribed alone (the peer: what the model can do at best),
with each one's wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from streaming import RATE, build_stream  # noqa: E402

from harness.wer import wer  # noqa: E402
from whistle_stream import Whistle  # noqa: E402


def measure(model, sentences: int, seed: int, pause=(0.6, 1.6)) -> dict:
    audio, utts = build_stream(sentences, seed, pause)
    truth = " ".join(u[2] for u in utts)
    out = {"seconds": len(audio) / RATE, "sentences": sentences}
    for by in ("windows", "utterances"):
        t0 = time.perf_counter()
        text = model.transcribe(audio, by=by)["text"]
        out[by] = (wer([truth], [text]), time.perf_counter() - t0)
    t0 = time.perf_counter()
    alone = " ".join(model.transcribe(u[3], by="windows")["text"] for u in utts)
    out["alone"] = (wer([truth], [alone]), time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model file (default: the bundled demo model)")
    ap.add_argument("--seeds", default="3", help="comma-separated seeds, one pair of files each")
    args = ap.parse_args(argv)
    model = Whistle(args.model)
    model.warmup()
    print("file | windows (§8) WER, time | utterances WER, time | sentences alone WER, time")
    for seed in (int(s) for s in args.seeds.split(",")):
        for sentences, pause in ((10, (0.2, 0.9)), (55, (0.6, 1.6))):
            r = measure(model, sentences, seed, pause)
            cells = " | ".join(f"{100 * r[k][0]:.1f} %, {r[k][1]:.2f} s" for k in ("windows", "utterances", "alone"))
            print(f"seed {seed}: {r['seconds']:.0f} s, {sentences} sentences | {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
