"""python tools/word_time_variants.py CACT : word-timing post-processing variants on the timing test clips and the
word_times benchmark clips (60 test items, seed 1)."""
import sys
import numpy as np
import soxr
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tests")]
import demo_data
from harness.wer import normalise
from whistle_stream.model import Whistle
from whistle_stream.alignment import dtw_path, sounding_frames, _word_starts
RATE = 16000
m = Whistle(sys.argv[1]); d = m.dims

def times(w, toks, snd, lead, trail, zero, split):
    w = w[:, 1 - lead: w.shape[1] - 1 + trail].astype(np.float64)
    z = (w - w.mean(1, keepdims=True)) / np.maximum(w.std(1, keepdims=True), 1e-6)
    cost = -z.sum(0)
    if zero:
        cost[:, ~snd] = 0.0
    tok, frm = dtw_path(cost)
    n = cost.shape[0]
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
        out.append((use[0] * .08, (use[-1] + 1) * .08))
    return out

VARIANTS = [("engine now: lead1 trail1 trim", 1, 1, False, False), ("lead1 trail0 trim", 1, 0, False, False),
            ("zero-silence lead1 trail1", 1, 1, True, False), ("zero-silence lead1 trail0", 1, 0, True, False),
            ("zero-silence lead1 trail1 split", 1, 1, True, True), ("lead1 trail1 trim split", 1, 1, False, True)]
# timing test clips
rng = np.random.default_rng(0)
sentences = ["set a timer for ten minutes", "turn on the lights in the kitchen", "call my mother tomorrow"]
spell = ["Set a timer for ten minutes.", "Turn on the lights in the kitchen.", "Call my mother tomorrow."]
res = {v[0]: [0, 0, 0, 0] for v in VARIANTS}
for k, sentence in enumerate(sentences):
    parts, truth, t = [np.zeros(int(0.5 * RATE), np.float32)], [], int(0.5 * RATE)
    for j, word in enumerate(sentence.split()):
        audio = demo_data.synthesize(word, "espeak-ng/en-us", np.random.default_rng(100 * k + j))
        s, e = demo_data.speech_span(audio); audio = audio[s:e]
        parts.append(audio); truth.append((t / RATE, (t + len(audio)) / RATE)); t += len(audio)
        gap = int(rng.uniform(0.3, 0.6) * RATE); parts.append(np.zeros(gap, np.float32)); t += gap
    pcm = np.concatenate(parts)
    enc = m._encode(pcm)
    for text in (sentence, spell[k]):
        toks = m.tokenizer.encode(text)
        _, w = m.decoder.logits_and_weights(enc, [d.bos, d.language_id("en")] + toks)
        snd = sounding_frames(pcm, 1280, len(enc))
        for name, *opt in VARIANTS:
            got = times(w, toks, snd, *opt)
            good = sum(abs(a - s) <= .16 and abs(b - e) <= .16 for (a, b), (s, e) in zip(got, truth))
            res[name][0 if text == sentence else 1] += good
# benchmark clips
rng = np.random.default_rng(1); used = 0
for item in demo_data.test_items(60, 0):
    if not item["voice"].startswith("espeak-ng/"):
        continue
    name = item["voice"].split("/", 1)[1]
    speed, pitch = int(rng.integers(130, 221)), int(rng.integers(30, 71))
    audio, rate, starts = demo_data.espeak_words(item["text"], name, speed, pitch)
    lead = float(rng.uniform(0.2, 0.8))
    if any(s < 0 for s in starts):
        continue
    speech = soxr.resample(audio, rate, RATE, quality="HQ").astype(np.float32)
    pcm = np.concatenate([np.zeros(int(lead * RATE), np.float32), speech, np.zeros(RATE // 2, np.float32)])
    out = m.decode(pcm)
    if normalise(out["text"]) != normalise(item["text"]):
        continue
    used += 1
    truth = [lead + s / rate for s in starts]
    toks = list(out["tokens"])
    w = m.decoder.cross_attention_weights(m.embed(pcm), [d.bos, d.language_id(out["language"])] + toks)
    snd = sounding_frames(pcm, 1280, w.shape[2])
    for name, *opt in VARIANTS:
        got = times(w, toks, snd, *opt)
        if len(got) == len(truth):
            res[name][2] += sum(abs(a - t) <= .16 for (a, _), t in zip(got, truth)); res[name][3] += len(truth)
print(f"{sys.argv[1]}: benchmark sentences used {used}")
for name, (lo, sp, ok, tot) in res.items():
    print(f"  {name:34s} timing test lower {lo}/17 spelled {sp}/17   benchmark starts {ok}/{tot} = {ok / max(tot, 1):.0%}")
