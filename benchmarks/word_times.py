"""Word-time accuracy: word starts against the synthesiser's own word events, and word spans on clips
of separately synthesised words.

    python benchmarks/word_times.py                 # demo model, held-out espeak-ng sentences
    python benchmarks/word_times.py --clips 120

Continuous speech: each held-out test sentence spoken by an espeak-ng voice is synthesised with
libespeak-ng's word events (tools.demo_data.espeak_words: the sample where each word starts), put
after 0.2-0.8 s of digital silence and before 0.5 s of it, and transcribed with word times.
Sentences whose transcript is not exactly right are left out (a misread word has no true time).
For the rest the start error of every word is reported.

Word by word: the same held-out sentences and voices, each word synthesised alone and followed
by 0.3-0.6 s of digital silence (tools.demo_data.word_by_word_clip, as the word-timing test of
tests/test_demo_model.py builds its clips), again with silence after only 40 % of the words, and
the held-out flite voice's sentences among all 300 test items (flite leaves a silent frame inside
some words, at a stop's closure); each aligned with its true transcript (§8's teacher-forced pass,
as `Whistle.align`). A word is right when its start and its end both fall within 160 ms of where
its sound is.

Every row is measured in the same run over the same cross-attention weights: the engine (the rows
predicting the language tag and </s> in the DTW path, guide §8; word boundaries in the audio's
pauses; edges trimmed to sound) against the same without the pause rule, without the trim, and
with the text rows alone (the first word then starts at frame 0).
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


VARIANTS = (  # label, leading/trailing rows, pause rule, trim
    ("engine: tag and </s> rows, pauses, edges trimmed to sound", 1, True, True),
    ("tag and </s> rows, edges trimmed, no pause rule", 1, False, True),
    ("tag and </s> rows, no pause rule, no trim", 1, False, False),
    ("text rows only, no pause rule, no trim", 0, False, False),
)


def timed_words(model, pcm, language, tokens, probs):
    """{variant label: words} for one clip and transcript (token ids), from one teacher-forced pass."""
    from whistle_stream.alignment import sounding_frames, trim_to_sound, word_times

    d = model.dims
    weights = model.decoder.cross_attention_weights(model.embed(pcm), [d.bos, d.language_id(language)] + tokens)
    sounding = sounding_frames(pcm, int(round(d.frame_seconds * RATE)), weights.shape[2])
    out = {}
    for label, rows, pauses, trim in VARIANTS:
        w = weights if rows else weights[:, 1:-1]
        words = word_times(w, tokens, probs, model.tokenizer, d.frame_seconds, lead=rows, trail=rows,
                           sounding=sounding if pauses else None)
        out[label] = trim_to_sound(words, sounding, d.frame_seconds) if trim else words
    return out


def word_by_word(model, clips: int, seed: int, pause_share: float, synthesiser: str = "espeak-ng"):
    """(pcm, [(word, start_s, end_s)], text) for the sentences of `synthesiser`'s voices among the
    first `clips` held-out test items, each word synthesised alone (demo_data.word_by_word_clip)."""
    from tools import demo_data

    rng = np.random.default_rng(seed)
    for k, item in enumerate(demo_data.test_items(clips, 0)):
        if item["voice"].startswith(synthesiser + "/"):
            pcm, truth = demo_data.word_by_word_clip(item["text"], item["voice"], 1000 + 10 * k, rng,
                                                     pause_share=pause_share)
            yield pcm, truth, item["text"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled demo model)")
    ap.add_argument("--clips", type=int, default=60, help="held-out test items to draw espeak-ng voices from")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    from whistle_stream import Whistle

    model = Whistle(args.model)
    errors = {label: [] for label, *_ in VARIANTS}
    used = 0
    for pcm, truth, out in exact_sentences(model, args.clips, args.seed):
        used += 1
        tokens = list(out["tokens"])
        for label, words in timed_words(model, pcm, out["language"], tokens, np.ones(len(tokens))).items():
            if len(words) == len(truth):
                errors[label] += [abs(w["start"] - t) for w, t in zip(words, truth)]
    print(f"model {model.name}: continuous speech, {used} sentences transcribed exactly (of the espeak-ng voices "
          f"among {args.clips} test items); word starts")
    for label, e in errors.items():
        e = np.array(e)
        if not len(e):
            print(f"  {label}: no words")
            continue
        print(f"  {label}: {len(e)} words, start error median {np.median(e):.3f} s, p90 {np.percentile(e, 90):.3f} s, "
              f"within 160 ms {np.mean(e <= 0.16):.0%}")
    for share, synthesiser, clips in ((1.0, "espeak-ng", args.clips), (0.4, "espeak-ng", args.clips), (1.0, "flite", 300)):
        right = {label: [] for label, *_ in VARIANTS}
        sentences = 0
        for pcm, truth, text in word_by_word(model, clips, args.seed, share, synthesiser):
            sentences += 1
            tokens = model.tokenizer.encode(text)
            timed = timed_words(model, pcm, "en", tokens, np.ones(len(tokens)))
            engine = [(w["start"], w["end"]) for w in model.align(pcm, text, language="en")]
            end = len(pcm) / RATE  # Whistle.align also keeps times within the audio
            assert engine == [(min(w["start"], end), min(w["end"], end)) for w in timed[VARIANTS[0][0]]], \
                "the engine row is not Whistle.align"
            for label, words in timed.items():
                if len(words) == len(truth):
                    right[label] += [abs(w["start"] - s) <= 0.16 and abs(w["end"] - e) <= 0.16
                                     for w, (_, s, e) in zip(words, truth)]
        print(f"word by word, {synthesiser} voices of {clips} test items, silence after {share:.0%} of the words: "
              f"{sentences} sentences; start and end both within 160 ms")
        for label, r in right.items():
            print(f"  {label}: {sum(r)} of {len(r)} words, {np.mean(r) if r else 0:.0%}")


if __name__ == "__main__":
    main()
