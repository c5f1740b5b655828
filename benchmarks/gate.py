"""Silence gate speed (guide §8): 30 s of audio the gate stops, against a full pass over 30 s of speech.

    python benchmarks/gate.py                  # demo model
    python benchmarks/gate.py --model PATH --repeats 9

The gate's line: digital silence, -90 dBFS noise and steady noise return empty results in under
50 ms for 30 s of audio. Each gated clip goes through `Whistle.transcribe(..., word_timestamps=True, by="windows")`
as a user calls it (resampling check, front end, gate); the peer is the same call on 30 s of
held-out demo sentences, which the gate lets through to the encoder and the 5-beam search.
Calls alternate so machine load hits both alike. Prints best and median, the ratio to the peer,
and exits with status 1 if a gated clip's best time misses the line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RATE = 16000
LINE_S = 0.050


def gated_clips(seconds: float = 30.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = int(seconds * RATE)
    return {"digital silence": np.zeros(n, np.float32),
            "-90 dBFS noise": (10 ** (-90 / 20) * rng.standard_normal(n)).astype(np.float32),
            "steady noise": (0.05 * rng.standard_normal(n)).astype(np.float32)}


def speech_clip(seconds: float = 30.0) -> np.ndarray:
    """Held-out demo sentences back to back, cut to `seconds`."""
    from tools import demo_data

    parts, total = [], 0
    for item in demo_data.test_items(300, 0):  # synthesised one at a time, until there is enough
        parts.append(demo_data.make_clip(item["text"], item["voice"], item["seed"]))
        total += len(parts[-1])
        if total >= seconds * RATE:
            break
    return np.concatenate(parts)[:int(seconds * RATE)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled demo model)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    from whistle_stream import Whistle

    model = Whistle(args.model)
    clips = gated_clips()
    speech = speech_clip()
    for pcm in (*clips.values(), speech):  # warm: JIT and caches
        model.transcribe(pcm[:RATE], word_timestamps=True, by="windows")
    peer = model.transcribe(speech, word_timestamps=True, by="windows")
    assert peer["text"], "the peer clip must pass the gate"
    times = {name: [] for name in clips}
    peer_times = []
    for _ in range(args.repeats):
        for name, pcm in clips.items():
            times[name].append(timed(lambda: model.transcribe(pcm, word_timestamps=True, by="windows")))
        peer_times.append(timed(lambda: model.transcribe(speech, word_timestamps=True, by="windows")))
    peer_best = min(peer_times)
    print(f"model {model.name}: 30 s of audio, transcribe(word_timestamps=True, by='windows'), best / median of {args.repeats}")
    print(f"  peer, 30 s of demo sentences (passes the gate): {peer_best * 1e3:.1f} / {np.median(peer_times) * 1e3:.1f} ms")
    missed = []
    for name, t in times.items():
        out = model.transcribe(clips[name], word_timestamps=True, by="windows")
        empty = out["text"] == "" and out["language"] == "" and not out["words"]
        best = min(t)
        ok = empty and best < LINE_S
        if not ok:
            missed.append(name)
        print(f"  {name}: {best * 1e3:.1f} / {np.median(t) * 1e3:.1f} ms, {peer_best / best:.0f}x faster than the peer, "
              f"{'empty' if empty else 'NOT EMPTY'}; line {LINE_S * 1e3:.0f} ms {'met' if ok else 'MISSED'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
