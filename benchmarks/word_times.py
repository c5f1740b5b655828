"""Word-time accuracy: word starts against the synthesiser's own word events.

    python benchmarks/word_times.py                 # demo model, held-out espeak-ng sentences
    python benchmarks/word_times.py --clips 120

Each held-out test sentence spoken by an espeak-ng voice is synthesised with libespeak-ng's word
events (tools.demo_data.espeak_words: the sample where each word starts), put after 0.2-0.8 s of
digital silence and before 0.5 s of it, and transcribed with word times. Sentences whose transcript
is not exactly right are left out (a misread word has no true time). For the rest the start error
of every word is reported for the engine's alignment (the rows predicting the language tag and
</s> take part in the DTW path, guide §8) and, in the same run over the same cross-attention
weights, for the text rows alone (the first word then starts at frame 0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import soxr

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

RATE = 16000


def exact_sentences(model, clips: int, seed: int):
    """(pcm, true word starts in seconds, model.decode's result) for each held-out espeak-ng sentence
    among the first `clips` test items that the model transcribes exactly: synthesised with
    libespeak-ng's word events at a random speed and pitch, after 0.2-0.8 s of digital silence and
    before 0.5 s of it. Sentences where espeak-ng merged a word into its neighbour are skipped."""
    from harness.wer import normalise
    from tools import demo_data

    rng = np.random.default_rng(seed)
    for item in demo_data.test_items(clips, 0):
        if not item["voice"].startswith("espeak-ng/"):
            continue
        name = item["voice"].split("/", 1)[1]
        speed, pitch = int(rng.integers(130, 221)), int(rng.integers(30, 71))
        audio, rate, starts = demo_data.espeak_words(item["text"], name, speed, pitch)
        lead = float(rng.uniform(0.2, 0.8))
        if any(s < 0 for s in starts):
            continue  # espeak-ng merged a word into its neighbour: no start of its own
        speech = soxr.resample(audio, rate, RATE, quality="HQ").astype(np.float32)
        pcm = np.concatenate([np.zeros(int(lead * RATE), np.float32), speech, np.zeros(RATE // 2, np.float32)])
        out = model.decode(pcm)
        if normalise(out["text"]) == normalise(item["text"]):
            yield pcm, [lead + s / rate for s in starts], out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled demo model)")
    ap.add_argument("--clips", type=int, default=60, help="held-out test items to draw espeak-ng voices from")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    from whistle_stream import Whistle
    from whistle_stream.alignment import sounding_frames, trim_to_sound, word_times

    model = Whistle(args.model)
    d = model.dims
    errors = {"engine: tag and </s> rows, edges trimmed to sound": [], "tag and </s> rows, no trim": [],
              "text rows only, no trim": []}
    used = 0
    for pcm, truth, out in exact_sentences(model, args.clips, args.seed):
        used += 1
        tokens = list(out["tokens"])
        weights = model.decoder.cross_attention_weights(model.embed(pcm), [d.bos, d.language_id(out["language"])] + tokens)
        probs = np.ones(len(tokens))
        sounding = sounding_frames(pcm, int(round(d.frame_seconds * RATE)), weights.shape[2])
        for label, rows, lead_rows, trail_rows, trim in (
                ("engine: tag and </s> rows, edges trimmed to sound", weights, 1, 1, True),
                ("tag and </s> rows, no trim", weights, 1, 1, False),
                ("text rows only, no trim", weights[:, 1:-1], 0, 0, False)):
            words = word_times(rows, tokens, probs, model.tokenizer, d.frame_seconds, lead=lead_rows, trail=trail_rows)
            if trim:
                words = trim_to_sound(words, sounding, d.frame_seconds)
            if len(words) == len(truth):
                errors[label] += [abs(w["start"] - t) for w, t in zip(words, truth)]
    print(f"model {model.name}: {used} sentences transcribed exactly (of the espeak-ng voices among {args.clips} test items)")
    for label, e in errors.items():
        e = np.array(e)
        if not len(e):
            print(f"  {label}: no words")
            continue
        print(f"  {label}: {len(e)} words, start error median {np.median(e):.3f} s, p90 {np.percentile(e, 90):.3f} s, "
              f"within 160 ms {np.mean(e <= 0.16):.0%}")


if __name__ == "__main__":
    main()
