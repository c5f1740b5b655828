"""Score a candidate demo model with OUR engine on the held-out test clips (the README's accuracy measure).

    .venv/bin/python tools/eval_demo_model.py work-data/run19/demo.cact [--clips 200] [--beams 1,5]

Prints the WER for each beam count: overall, by held-out voice, and split into the clips of the
grammar's everyday sentences (`demo_data.everyday_sentences()`) and the rest, so that runs are
compared on what the issue measures rather than on validation loss. The clips are regenerated from
their specs (`demo_data.make_clip`) and cached as one .npz under `--cache` (git-ignored work-data/
by default), so a second candidate is scored in seconds.

`--split festival` (or `flite`, `espeak-ng`) scores the test sentences spoken in turn by every voice
of that synthesiser family (`demo_data.FAMILIES`): for a model whose training left the family out,
its leave-one-family-out figure, the measure of voices it never heard.

`--long N` also reads N 95 s streams of held-out sentences with pauses (`benchmarks/streaming.py`'s
`build_stream`, seeds 8, 1, 2, ...; seed 8's is the clip of the test suite's long-audio seam line)
at once, in 30 s windows (§8), and counts against each sentence read alone the words dropped, made
up or kept twice within 0.5 s of a window cut (`harness.wer.seam_errors`), and the words dropped or
added anywhere: one clip's seam line is a lottery (a candidate passes or fails it on one made-up
word), N clips' seam errors are a measure.

`--split validation` scores the 100 validation clips instead (held-out sentences and voices, none
of them in the test split): pick among candidates (checkpoint-average weights, second stages) there,
then report the chosen one on the test split, so its test figures are not tuned on the test clips.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tools import demo_data  # noqa: E402


def _spec_keys(items: list[dict]) -> list[str]:
    """What makes each test clip: its voice, seed and text."""
    return [f"{it['voice']}|{it['seed']}|{it['text']}" for it in items]


# split -> most clips: the test and validation splits, and the test sentences in each synthesiser family's voices
SPLITS = {"test": 300, "validation": demo_data.VALIDATION, **{family: 300 for family in demo_data.FAMILIES}}


def split_items(split: str, n: int, seed: int) -> list[dict]:
    """The first n clip specs of a held-out split (`demo_data.test_items`, `validation_items`), or of
    the test sentences spoken by a synthesiser family's voices (`demo_data.family_items`)."""
    if split in demo_data.FAMILIES:
        return demo_data.family_items(split, n, seed)
    return getattr(demo_data, f"{split}_items")(n, seed)


def cached_clips(n: int, seed: int, cache: str, split: str = "test") -> list[tuple[np.ndarray, str]]:
    """The first n clips of a held-out split, from `cache` when it holds at least n of them made from
    the clip specs `demo_data.test_items` (or `validation_items`) draws now (a changed grammar or
    voice list draws a new split)."""
    path = os.path.join(cache, f"{split}-clips-seed{seed}.npz")
    items = split_items(split, n, seed)
    if os.path.exists(path):
        saved = np.load(path, allow_pickle=False)
        specs = list(saved["specs"]) if "specs" in saved.files else []
        if len(specs) >= n and specs[:n] == _spec_keys(items):
            bounds = np.concatenate([[0], np.cumsum(saved["lengths"])])
            audio = saved["audio"]  # read once: each read of an .npz member loads it whole again
            return [(audio[bounds[i]:bounds[i + 1]].copy(), it["text"]) for i, it in enumerate(items)]
    clips = [(demo_data.make_clip(it["text"], it["voice"], it["seed"]), it["text"]) for it in items]
    os.makedirs(cache, exist_ok=True)
    np.savez(path + ".tmp.npz", audio=np.concatenate([a for a, _ in clips]),
             lengths=np.array([len(a) for a, _ in clips]), specs=np.array(_spec_keys(items)))
    os.replace(path + ".tmp.npz", path)
    return clips


def voice_group(voice: str) -> str:
    """The variant an espeak-ng voice is built on ('+f4', '+m6') or the voice's name ('rms',
    'kal_diphone')."""
    return "+" + voice.rsplit("+", 1)[-1] if "+" in voice else voice.split("/", 1)[-1]


def breakdown(items: list[dict], refs: list[str], hyps: list[str]) -> dict[str, tuple[int, int]]:
    """{group: (word errors, reference words)} for 'all', each voice group, 'everyday' and 'other'."""
    from harness.wer import edit_ops, normalise

    everyday = demo_data.everyday_sentences()
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for item, ref, hyp in zip(items, refs, hyps):
        r, h = normalise(ref), normalise(hyp)
        errors = sum(edit_ops(r, h))
        for group in ("all", voice_group(item["voice"]), "everyday" if ref in everyday else "other"):
            out[group][0] += errors
            out[group][1] += len(r)
    return {k: (v[0], v[1]) for k, v in out.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cact", help="the candidate .cact")
    ap.add_argument("--clips", type=int, default=200, help="held-out clips (the test uses 200 test clips)")
    ap.add_argument("--split", choices=sorted(SPLITS), default="test",
                    help="test (the README's measure), validation (to choose among candidates) or a synthesiser "
                         "family (voices a model trained without them never heard)")
    ap.add_argument("--beams", default="1,5", help="comma-separated beam counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=str(ROOT / "work-data" / "eval"))
    ap.add_argument("--show", type=int, default=0, help="print the first N wrong transcripts")
    ap.add_argument("--long", type=int, default=0, metavar="N",
                    help="also count window-seam errors over N 95 s streams (0: none)")
    args = ap.parse_args(argv)
    if args.long < 0:
        ap.error(f"--long is a number of 95 s streams, 0 or more; got {args.long}")
    try:
        beams = [int(b) for b in args.beams.split(",")]
    except ValueError:
        ap.error(f"--beams is a comma-separated list of integers, got {args.beams!r}")
    most = SPLITS[args.split]
    if not 1 <= args.clips <= most:
        ap.error(f"--clips is 1 to {most} for the {args.split} split, got {args.clips}")

    from harness.wer import normalise
    from whistle_stream import Whistle

    model = Whistle(args.cact)
    items = split_items(args.split, args.clips, args.seed)
    clips = cached_clips(args.clips, args.seed, args.cache, args.split)
    refs = [text for _, text in clips]
    for b in beams:
        t0 = time.time()
        hyps = [model.transcribe(audio, beams=b, by="windows")["text"] for audio, _ in clips]
        table = breakdown(items, refs, hyps)
        parts = "  ".join(f"{k} {e / max(n, 1):.2%} ({e}/{n})" for k, (e, n) in sorted(table.items()) if k != "all")
        e, n = table["all"]
        print(f"beams {b}: WER {e / n:.2%} ({e}/{n} words, {len(clips)} {args.split} clips, {time.time() - t0:.0f} s)  {parts}")
        wrong = [(r, h) for r, h in zip(refs, hyps) if normalise(r) != normalise(h)]
        for r, h in wrong[:args.show]:
            print(f"    {r!r} -> {h!r}")
    if args.long:
        long_seams(model, LONG_SEEDS[:args.long] + list(range(9, 9 + args.long - len(LONG_SEEDS))))


LONG_SEEDS = [8, 1, 2, 3, 4, 5, 6, 7]  # 8 first: the test suite's 95 s clip
LONG_S = 95


def long_seams(model, seeds: list[int]) -> None:
    """Print, for each seed's 95 s stream read in 30 s windows, its seam errors and its words dropped
    or added against its sentences read alone; then the totals."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness.wer import edit_ops, normalise, seam_errors
    from streaming import RATE, build_stream, in_windows, one_shot

    seam_total = changed = words = cut_total = 0
    t0 = time.time()
    for seed in seeds:
        audio, utts = build_stream(30, seed)
        audio, utts = audio[:LONG_S * RATE], [u for u in utts if u[1] <= LONG_S]
        out, windows = in_windows(model, audio)
        shot_text, shot_words = one_shot(model, utts)
        cuts = [w.start_s + w.cut_s for w in windows[:-1]]
        cut_total += len(cuts)
        found = seam_errors(shot_words, out["words"], cuts, truth=[u[:3] for u in utts])
        errors = found["dropped"] + found["doubled"] + found["across"]
        _, d, i = edit_ops(normalise(shot_text), normalise(out["text"]))
        seam_total, changed, words = seam_total + len(errors), changed + d + i, words + len(normalise(shot_text))
        print(f"long seed {seed}: {len(errors)} seam errors {errors}; "
              f"{d + i} of {len(normalise(shot_text))} words dropped or added")
    print(f"long: {seam_total} seam errors at {cut_total} window cuts of {len(seeds)} 95 s streams; "
          f"{changed} of {words} words ({changed / max(words, 1):.1%}) dropped or added; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
