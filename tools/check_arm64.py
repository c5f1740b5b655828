"""The engine on 64-bit ARM against x86: what `tools/check_arm64.sh` runs on each side.

    python tools/check_arm64.py make DIR      # on x86: held clips, a stream, and their x86 text
    python tools/check_arm64.py compare DIR   # on arm64 (under qemu): the same, checked word for word

`make` writes DIR/clips.npz (CLIPS held-out demo clips, `demo_data.test_items`, and a stream of
held sentences with pauses, `benchmarks/streaming.py`'s), the stream as DIR/stream.wav, and
DIR/x86.json: the demo model's transcript of each clip (5 beams, the default) and the text a
stream commits, fed in 100 ms chunks. It also writes the readings x86 gives each clip under float noise (TIE_NOISE). `compare`
computes the same on this machine and prints each pair and the kernels' path. A clip read
otherwise than x86 reads it is a float tie when x86 gives that reading too under noise; it exits 1
if any clip differs otherwise, if fewer than 5 clips are word for word x86's, or if the stream's
committed text differs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CLIPS = 8
SEED = 7          # which held-out clips (demo_data.test_items' seed)
CHUNK_S = 0.1     # what a microphone client sends at a time
# x86's readings of each clip under float noise: relative perturbations of the samples far below
# anything audible, in seeded draws. A clip x86 itself reads two ways under them is a near tie,
# which another CPU's float sums (NEON lanes, its BLAS kernels, libm) may tip either way.
TIE_NOISE, TIE_DRAWS = 1e-6, 8


def readings(audio: dict[str, np.ndarray]) -> dict:
    """{"clips": [text per clip], "stream": committed text, "kernels": the path}: this machine's."""
    from whistle_stream import Whistle

    model = Whistle()
    texts = [model.transcribe(audio[f"clip{i}"]).text for i in range(CLIPS)]
    stream, pcm = model.open_stream(), audio["stream"]
    step = int(CHUNK_S * model.dims.rate)
    pieces = [stream.feed(pcm[i:i + step]).text for i in range(0, len(pcm), step)]
    pieces.append(stream.finish().text)
    return {"clips": texts, "stream": "".join(pieces), "kernels": str(model.kernel_path()),
            "machine": platform.machine()}


def noise_readings(audio: dict[str, np.ndarray]) -> list[list[str]]:
    """Per clip, the distinct texts this machine reads under TIE_NOISE in TIE_DRAWS seeded draws."""
    from whistle_stream import Whistle

    model, rng = Whistle(), np.random.default_rng(0)
    out = []
    for i in range(CLIPS):
        a = audio[f"clip{i}"]
        noisy = [(a * (1 + TIE_NOISE * rng.standard_normal(a.shape))).astype(np.float32) for _ in range(TIE_DRAWS)]
        out.append(sorted({model.transcribe(n).text for n in noisy}))
    return out


def make(folder: Path) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tools"))
    sys.path.insert(0, str(ROOT / "tests"))
    import demo_data
    from harness.audio import demo_stream

    items = demo_data.test_items(CLIPS, SEED)
    audio = {f"clip{i}": demo_data.make_clip(it["text"], it["voice"], it["seed"]) for i, it in enumerate(items)}
    audio["stream"], said = demo_stream(3, seed=SEED)
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "clips.npz", **audio)
    with wave.open(str(folder / "stream.wav"), "wb") as w:   # for `whistle-listen --local --file`
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(audio["stream"], -1, 1) * 32767).astype("<i2").tobytes())
    got = readings(audio)
    got["said"] = [it["text"] for it in items] + [said]
    got["ties"] = noise_readings(audio)
    (folder / "x86.json").write_text(json.dumps(got, indent=1))
    print(f"x86 ({got['kernels']}): {CLIPS} clips and a stream of {len(audio['stream']) / 16000:.1f} s")


def compare(folder: Path) -> int:
    want = json.loads((folder / "x86.json").read_text())
    with np.load(folder / "clips.npz") as saved:
        audio = {name: saved[name] for name in saved.files}
    t0 = time.perf_counter()
    got = readings(audio)
    print(f"arm64 ({got['kernels']}, {got['machine']}): read in {time.perf_counter() - t0:.0f} s")
    same = ties = 0
    for i, (a, b, noisy) in enumerate(zip(got["clips"], want["clips"], want["ties"])):
        tie = a != b and a in noisy
        same, ties = same + (a == b), ties + tie
        verdict = ("same" if a == b else f"a float tie: x86 reads it so too under {TIE_NOISE:g} noise" if tie
                   else "DIFFERENT")
        print(f"clip {i}: {verdict}\n  arm64: {a}\n  x86:   {b}")
    stream_same = got["stream"] == want["stream"]
    print(f"stream: {'same' if stream_same else 'DIFFERENT'}\n  arm64: {got['stream']}\n  x86:   {want['stream']}")
    print(f"transcripts equal to x86's: {same} of {CLIPS}, {ties} float ties, {CLIPS - same - ties} different; "
          f"stream's committed text equal: {stream_same}")
    return 0 if same + ties == CLIPS and same >= 5 and stream_same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("make", "compare"))
    ap.add_argument("folder", type=Path)
    args = ap.parse_args()
    if args.mode == "make":
        make(args.folder)
        return 0
    return compare(args.folder)


if __name__ == "__main__":
    sys.exit(main())
