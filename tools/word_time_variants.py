"""python tools/word_time_variants.py CACT : word-timing post-processing variants on the timing test clips and the
word_times benchmark clips (60 test items, seed 1)."""
import sys
import numpy as np
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tests"), str(ROOT / "benchmarks")]
import demo_data
from word_times import exact_sentences
from whistle_stream.model import Whistle
from whistle_stream.alignment import dtw_path, sounding_frames, _word_starts
m = Whistle(sys.argv[1]); d = m.dims

def times(w, toks, snd, lead, trail, zero, split):
    w = w[:, 1 - lead: w.shape[1] - 1 + trail].astype(np.float64)
    z = (w - w.mean(1, keepdims=True)) / np.maximum(w.std(1, keepdims=True), 1e-6)
    cost = -z.sum(0)
    if zero:
        cost[:, ~snd] = 0.0
    tok, frm = dtw_path(cost)
    owner = {}
    for t, f in zip(tok, frm):
        owner.setdefault(t, []).append(f)
    starts = _word_starts(toks, m.tokenizer); b = [i for i, s in enumerate(starts) if s] + [len(toks)]
    out = []
    for a, c in zip(b[:-1], b[1:]):
        frames = sorted(set(f for t in range(a + lead, c + lead) for f in owner[t]))
        s_frames = [f for f in frames if snd[f]]
        if split and s_frames:
            runs, cur = [], [s_frames[0]]
            for f in s_frames[1:]:
                if f == cur[-1] + 1: cur.append(f)
                else: runs.append(cur); cur = [f]
            runs.append(cur)
            s_frames = max(runs, key=len)
        use = s_frames or frames
        out.append((use[0] * d.frame_seconds, (use[-1] + 1) * d.frame_seconds))
    return out

VARIANTS = [("engine now: lead1 trail1 trim", 1, 1, False, False), ("lead1 trail0 trim", 1, 0, False, False),
            ("zero-silence lead1 trail1", 1, 1, True, False), ("zero-silence lead1 trail0", 1, 0, True, False),
            ("zero-silence lead1 trail1 split", 1, 1, True, True), ("lead1 trail1 trim split", 1, 1, False, True)]
sentences = ["set a timer for ten minutes", "turn on the lights in the kitchen", "call my mother tomorrow"]
spell = ["Set a timer for ten minutes.", "Turn on the lights in the kitchen.", "Call my mother tomorrow."]
res = {v[0]: [0, 0, 0, 0] for v in VARIANTS}
frame_samples = int(round(d.frame_seconds * d.rate))
rng = np.random.default_rng(0)
for k, sentence in enumerate(sentences):  # the timing test's clips (tests/test_demo_model.py)
    pcm, truth = demo_data.word_by_word_clip(sentence, "espeak-ng/en-us", 100 * k, rng)
    enc = m._encode(pcm)
    snd = sounding_frames(pcm, frame_samples, len(enc))
    for text in (sentence, spell[k]):
        toks = m.tokenizer.encode(text)
        _, w = m.decoder.logits_and_weights(enc, [d.bos, d.language_id("en")] + toks)
        for name, *opt in VARIANTS:
            got = times(w, toks, snd, *opt)
            good = sum(abs(a - s) <= .16 and abs(b - e) <= .16 for (a, b), (_, s, e) in zip(got, truth))
            res[name][0 if text == sentence else 1] += good
used = 0
for pcm, truth, out in exact_sentences(m, 60, 1):  # benchmarks/word_times.py's sentences
    used += 1
    toks = list(out["tokens"])
    w = m.decoder.cross_attention_weights(m.embed(pcm), [d.bos, d.language_id(out["language"])] + toks)
    snd = sounding_frames(pcm, frame_samples, w.shape[2])
    for name, *opt in VARIANTS:
        got = times(w, toks, snd, *opt)
        if len(got) == len(truth):
            res[name][2] += sum(abs(a - t) <= .16 for (a, _), t in zip(got, truth)); res[name][3] += len(truth)
print(f"{sys.argv[1]}: benchmark sentences used {used}")
for name, (lo, sp, ok, tot) in res.items():
    print(f"  {name:34s} timing test lower {lo}/17 spelled {sp}/17   benchmark starts {ok}/{tot} = {ok / max(tot, 1):.0%}")
