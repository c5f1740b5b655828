"""Speech with pauses: WER of sentences said fluently, with one pause inside, and word by word,
live and from files, on a synthesiser family the demo model never heard (festival).

    python benchmarks/pauses.py                                # 30 sentences, this checkout, demo model
    python benchmarks/pauses.py --before ../old --before-model OLD.cact   # before and after, one run
    python benchmarks/pauses.py --sentences 6 --no-live        # a quick look

Each held-out test sentence (tools/demo_data.py) is spoken by festival's voices (kal, ked, slt in
turn) five ways: fluently; with one pause of 0.5, 0.7 and 1.0 s at a word boundary drawn per
sentence (the two halves spoken with one voice setting, their edges trimmed); and one word at a
time, 0.6 s apart. Every clip gets 0.5 s of lead-in, 1.5 s of tail and a noise floor 30 dB under
the speech. Files: `Whistle.transcribe(clip)` as `whistle-stream transcribe` reads it. Live: our
protocol against `whistle-stream serve`, paced in real time, 100 ms a frame, `--sessions` clips at
once; the text is the session's `final`; "live" with the server's VAD (the default: it ends an
utterance after 600 ms of non-speech), "no-vad" with `vad=false` (every sample to the engine,
whose pause rule ends utterances). WER is against the sentence; the column after each figure
is its difference from the fluent reading of the same arm (the targets: at most 2 points with one
pause, 10 word by word).

--before ROOT measures another checkout (its engine, service and, unless --before-model says
otherwise, its bundled model) in the same run, on the same clips, first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

RATE = 16000
PAUSES_S = (0.5, 0.7, 1.0)
WORD_GAP_S = 0.6
LEAD_S, TAIL_S, SNR_DB = 0.5, 1.5, 30.0
FRAME_S = 0.1
CONDITIONS = ("fluent", *(f"pause {p:g} s" for p in PAUSES_S), f"word by word {WORD_GAP_S:g} s")


def _speech(text: str, voice: str, seed: int) -> np.ndarray:
    """text spoken by voice with the setting seed draws, its silence trimmed."""
    from tools.demo_data import speech_span, synthesize

    audio = synthesize(text, voice, np.random.default_rng(seed))
    first, last = speech_span(audio)
    return audio[first:last]


def _framed(pieces: list[np.ndarray], seed: int) -> np.ndarray:
    from tools.demo_data import add_noise

    lead, tail = np.zeros(int(LEAD_S * RATE), np.float32), np.zeros(int(TAIL_S * RATE), np.float32)
    audio = np.concatenate([lead, *pieces, tail])
    return add_noise(audio, SNR_DB, np.random.default_rng(seed)).astype(np.float32)


def sentence_clips(n: int, seed: int = 0) -> tuple[list[str], dict[str, list[np.ndarray]]]:
    """The n sentences and, per condition (`CONDITIONS`), one clip of each."""
    from tools.demo_data import family_items

    texts, clips = [], {c: [] for c in CONDITIONS}
    rng = np.random.default_rng(seed)
    for item in family_items("festival", n, seed):
        text, voice, s = item["text"], item["voice"], item["seed"]
        words = text.split()
        texts.append(text)
        silence = lambda seconds: np.zeros(int(seconds * RATE), np.float32)  # noqa: E731
        clips["fluent"].append(_framed([_speech(text, voice, s)], s))
        cut = int(rng.integers(1, len(words))) if len(words) > 1 else 1
        head, rest = _speech(" ".join(words[:cut]), voice, s), _speech(" ".join(words[cut:]) or ".", voice, s)
        for p in PAUSES_S:
            clips[f"pause {p:g} s"].append(_framed([head, silence(p), rest], s))
        spoken = []
        for k, word in enumerate(words):
            spoken += [silence(WORD_GAP_S)] if k else []
            spoken.append(_speech(word, voice, s))
        clips[f"word by word {WORD_GAP_S:g} s"].append(_framed(spoken, s))
    return texts, clips


def load_clips(n: int, cache: Path) -> tuple[list[str], dict[str, list[np.ndarray]]]:
    if cache.exists():
        with np.load(cache, allow_pickle=False) as f:
            texts = [str(t) for t in f["texts"]]
            return texts, {c: [f[f"{c}/{i}"] for i in range(len(texts))] for c in CONDITIONS}
    texts, clips = sentence_clips(n)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, texts=np.array(texts), **{f"{c}/{i}": a for c in CONDITIONS for i, a in enumerate(clips[c])})
    return texts, clips


# ---- one arm: a checkout and a model, in a process of its own ---------------------------------

async def _live_one(url: str, audio: np.ndarray, delay: float, vad: bool) -> str:
    from whistle_stream.clients.client import ListenClient

    await asyncio.sleep(delay)
    async with ListenClient(url, resume=False, vad=vad) as client:
        t0, frame = time.monotonic(), int(FRAME_S * RATE)
        for i in range(0, len(audio), frame):
            await client.send_audio(audio[i:i + frame])
            await asyncio.sleep(max(0.0, t0 + (i + frame) / RATE - time.monotonic()))
        final = await client.close()
    return final.text


async def _live(url: str, clips: list[np.ndarray], sessions: int, vad: bool) -> list[str]:
    out: list[str] = [""] * len(clips)
    queue = list(enumerate(clips))

    async def worker(k: int):
        first = True
        while queue:
            i, audio = queue.pop(0)
            out[i] = await _live_one(url, audio, 0.37 * k if first else 0.0, vad)
            first = False
    await asyncio.gather(*(worker(k) for k in range(sessions)))
    return out


def arm(args) -> None:
    """Read every clip from files and live with this process's checkout; writes JSON texts."""
    from harness.servers import ServerProcess
    from whistle_stream import Whistle

    texts, clips = load_clips(args.sentences, Path(args.clips))
    model = Whistle(args.model)
    model.warmup()
    out: dict[str, dict[str, list[str]]] = {"files": {}, "live": {}, "no-vad": {}}
    for c in CONDITIONS:
        out["files"][c] = [model.transcribe(a)["text"] for a in clips[c]]
    if not args.no_live:
        launcher = [sys.executable, str(Path(__file__).resolve()), "--serve", str(args.engine)]
        # the engine in the server's process, which runs the arm's checkout (engine processes
        # would import the installed one)
        flags = ["--max-sessions", str(args.sessions + 4), "--processes", "1"] + (["--model", args.model] if args.model else [])
        with ServerProcess(*flags, command=launcher) as server:
            for mode, vad in (("live", True), ("no-vad", False)):
                for c in CONDITIONS:
                    out[mode][c] = asyncio.run(_live(server.url, clips[c], args.sessions, vad))
    Path(args.json).write_text(json.dumps(out))


def serve(root: str, argv: list[str]) -> None:
    """`whistle-stream serve` of the checkout `root`."""
    from harness_model import import_checkout

    import_checkout(Path(root))
    from whistle_stream.cli import main as cli

    sys.exit(cli(argv))


# ---- the report ----------------------------------------------------------------------------------

def report(name: str, texts: list[str], out: dict) -> dict[str, dict[str, float]]:
    from harness.wer import wer

    figures: dict[str, dict[str, float]] = {}
    for mode in ("files", "live", "no-vad"):
        if not out[mode]:
            continue
        figures[mode] = {c: 100 * wer(texts, out[mode][c]) for c in CONDITIONS}
        base = figures[mode]["fluent"]
        cells = "  ".join(f"{c} {v:5.1f} % ({v - base:+5.1f})" for c, v in figures[mode].items())
        print(f"{name:8s} {mode:6s}  {cells}", flush=True)
    return figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=30)
    ap.add_argument("--sessions", type=int, default=4, help="live clips read at once")
    ap.add_argument("--model", help="model file (default: the checkout's bundled demo model)")
    ap.add_argument("--before", help="another checkout, measured first in the same run")
    ap.add_argument("--before-model", help="its model (default: its bundled demo model)")
    ap.add_argument("--no-live", action="store_true", help="files only")
    ap.add_argument("--show", action="store_true", help="print each reading that is not the sentence")
    ap.add_argument("--arm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("--clips", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3:])
    args = ap.parse_args(argv)
    if args.arm:
        from harness_model import import_checkout

        import_checkout(Path(args.engine))
        arm(args)
        return 0
    cache = ROOT / "work-data" / f"pauses-{args.sentences}.npz"
    t0 = time.perf_counter()
    texts, _ = load_clips(args.sentences, cache)
    print(f"{len(texts)} sentences, festival voices, clips in {time.perf_counter() - t0:.0f} s "
          f"(cached in {cache.relative_to(ROOT)})", flush=True)
    arms = ([("before", args.before, args.before_model)] if args.before else []) + [("after", str(ROOT), args.model)]
    results = {}
    for name, root, model in arms:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.json")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--arm", "--engine", root, "--clips", str(cache),
                   "--json", path, "--sentences", str(args.sentences), "--sessions", str(args.sessions)]
            cmd += (["--model", model] if model else []) + (["--no-live"] if args.no_live else [])
            t1 = time.perf_counter()
            subprocess.run(cmd, check=True)
            out = json.loads(Path(path).read_text())
        print(f"{name}: {root} ({model or 'its demo model'}), {time.perf_counter() - t1:.0f} s", flush=True)
        results[name] = report(name, texts, out)
        if args.show:
            for mode, readings in out.items():
                for c, said in readings.items():
                    for truth, text in zip(texts, said):
                        if text.strip() != truth:
                            print(f"  {mode} {c}: {text.strip()!r} for {truth!r}")
    print("\nWER, points over the fluent reading of the same arm (targets: <= 2 with one pause, <= 10 word by word):")
    for name, figures in results.items():
        report_lines = []
        for mode, row in figures.items():
            worst = max(row[c] - row["fluent"] for c in CONDITIONS[1:-1])
            words = row[CONDITIONS[-1]] - row["fluent"]
            report_lines.append(f"{mode}: one pause {worst:+.1f} (worst of {', '.join(f'{p:g}' for p in PAUSES_S)} s), "
                                f"word by word {words:+.1f}")
        print(f"{name:8s} " + "; ".join(report_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
