"""Streaming benchmark: pass time, commit latency, long-stream stability.

    python benchmarks/streaming.py                      # demo model, a 3-minute stream of held-out clips
    python benchmarks/streaming.py --minutes 60         # + the 60-minute stability run (pass p95, RSS)
    python benchmarks/streaming.py --full               # + the full architecture: a pass over a 10 s buffer
    python benchmarks/streaming.py --accuracy 5,7,9,11  # + per stream: streamed vs one-shot WER, words dropped/added
    python benchmarks/streaming.py --prefill both       # each measure with and without the committed-word prefill

Commit latency of a word = audio received when the word was committed - the word's end in the audio
(audio time, 1 s steps). whisper_streaming reports 3.3 s for the same measure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

RATE = 16000

from whistle_stream.streaming import StreamSession  # noqa: E402


def build_stream(n: int, seed: int = 0, pause=(0.6, 1.6)):
    """Held-out demo clips joined with natural pauses -> (audio, [(start_s, end_s, text)])."""
    from tools.demo_data import test_clips

    rng = np.random.default_rng(seed)
    parts, utts, t = [], [], 0
    for audio, text in test_clips(n, seed):
        gap = np.zeros(int(rng.uniform(*pause) * RATE), np.float32)
        parts += [gap, audio]
        t += len(gap)
        utts.append((t / RATE, (t + len(audio)) / RATE, text, audio))
        t += len(audio)
    parts.append(np.zeros(RATE, np.float32))
    return np.concatenate(parts), utts


def one_shot(model, utts) -> tuple[str, list[dict]]:
    """Each utterance of build_stream transcribed alone: the texts joined, and the words with times
    moved to the stream's clock."""
    shots = [model.transcribe(u[3], word_timestamps=True, by="windows") for u in utts]
    words = [{**w, "start": w["start"] + u[0], "end": w["end"] + u[0]} for u, shot in zip(utts, shots)
             for w in shot["words"]]
    return " ".join(shot["text"] for shot in shots), words


def in_windows(model, audio: np.ndarray) -> tuple[dict, list]:
    """`model.transcribe(audio, word_timestamps=True, by="windows")` of a clip over 30 s, and the
    `longform.WindowCut` of each window it was read in (§8), in order."""
    from whistle_stream import longform

    windows, original = [], longform.iter_windows

    def recording(*args, **kwargs):
        for window in original(*args, **kwargs):
            windows.append(window)
            yield window

    longform.iter_windows = recording
    try:
        out = model.transcribe(audio, word_timestamps=True, by="windows")
    finally:
        longform.iter_windows = original
    return out, windows


def run_stream(model, audio: np.ndarray, chunk_s: float = 1.0, rss_every: int = 0, prefill: bool = True):
    """Feed audio in chunks; returns committed words, per-word commit latency, pass times, RSS samples."""
    session = StreamSession(model, prefill=prefill)
    step = int(chunk_s * RATE)
    words, latency, passes, rss = [], [], [], []
    for i in range(0, len(audio), step):
        d = session.feed(audio[i:i + step])
        if d["pass_ms"]:
            passes.append(d["pass_ms"] / 1000.0)
        for w in d["words"]:
            latency.append(d["received"] - w["end"])
        words += d["words"]
        if rss_every and (i // step) % rss_every == 0:
            rss.append(_rss_mb())
    final = session.finish()
    words += final["words"]
    return words, latency, passes, rss


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _pct(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def long_stream(n_minutes: float, seed: int = 1):
    """A long synthetic stream: held-out clips with pauses, repeated to length."""
    audio, _ = build_stream(40, seed)
    reps = int(np.ceil(n_minutes * 60 * RATE / len(audio)))
    return np.tile(audio, reps)[: int(n_minutes * 60 * RATE)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled demo model)")
    ap.add_argument("--utterances", type=int, default=40)
    ap.add_argument("--minutes", type=float, default=0.0, help="also run a long stream of this many minutes")
    ap.add_argument("--full", action="store_true", help="also time a 10 s pass on the full architecture")
    ap.add_argument("--accuracy", default="", help="comma-separated stream seeds: streamed text against the "
                    "truth and against the one-shot transcripts of the same utterances")
    ap.add_argument("--prefill", choices=("on", "off", "both"), default="on",
                    help="passes read the utterance's committed words in one teacher-forced run (on, the "
                         "engine's default), search them again (off), or each measure both ways in turn")
    ap.add_argument("--rate", type=int, default=RATE,
                    help="--accuracy streams heard as a microphone at this rate (16-bit PCM, resampled to 16 kHz "
                         "by the server's audio path), e.g. 48000 as browsers capture; default 16000: as built")
    ap.add_argument("--silence", choices=("new", "exact", "both"), default="new",
                    help="--accuracy streams with the engine's digital silence (new: under one 16-bit step), "
                         "the earlier rule (exact: only exact zeros), or each seed both ways in turn")
    ap.add_argument("--behind", type=float, default=0.0, metavar="S",
                    help="--accuracy streams fed S seconds at a time with catch_up, as the service feeds a "
                         "session that has fallen S seconds behind real time (one pass per feed)")
    args = ap.parse_args(argv)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.prefill]

    from whistle_stream import Whistle

    model = Whistle(args.model)
    model.warmup()
    audio, utts = build_stream(args.utterances)
    for prefill in modes:
        t0 = time.perf_counter()
        words, latency, passes, _ = run_stream(model, audio, prefill=prefill)
        wall = time.perf_counter() - t0
        print(f"model {model.name}: stream of {len(audio) / RATE:.0f} s, {len(utts)} utterances, {len(words)} words"
              f"{'' if prefill else ', no prefill'}")
        print(f"  pass time      p50 {_pct(passes, 50) * 1000:7.1f} ms   p95 {_pct(passes, 95) * 1000:7.1f} ms")
        print(f"  commit latency p50 {_pct(latency, 50):7.2f} s    p95 {_pct(latency, 95):7.2f} s   (audio time; whisper_streaming: 3.3 s)")
        print(f"  real-time factor {wall / (len(audio) / RATE):.3f}")

    if args.minutes:
        long_audio = long_stream(args.minutes)
        t0 = time.perf_counter()
        _, _, passes, rss = run_stream(model, long_audio, rss_every=60)
        ten = int(min(10.0, args.minutes / 3) * 60)
        first, last = passes[:ten], passes[-ten:]
        print(f"  {args.minutes:g}-minute stream: pass p95 first {_pct(first, 95) * 1000:.1f} ms, "
              f"last {_pct(last, 95) * 1000:.1f} ms; RSS {min(rss):.0f}..{max(rss):.0f} MB "
              f"(growth after the first minute {max(rss[1:]) - rss[1]:.1f} MB); wall {time.perf_counter() - t0:.0f} s")

    if args.full:
        full_pass_breakdown()

    import whistle_stream.streaming as engine_streaming

    rules = {"new": [engine_streaming.DIGITAL_SILENCE], "exact": [np.finfo(np.float32).tiny],
             "both": [np.finfo(np.float32).tiny, engine_streaming.DIGITAL_SILENCE]}[args.silence]
    for seed in [int(x) for x in args.accuracy.split(",") if x.strip()]:
        for prefill in modes:
            for silence in rules:
                engine_streaming.DIGITAL_SILENCE = silence  # sound_span reads it at each call
                if len(rules) > 1:
                    print(f"  digital silence: {'only exact zeros' if silence < 1e-30 else 'under one 16-bit step'}")
                stream_accuracy(model, args.utterances, seed, prefill, args.rate, args.behind)


def as_microphone(audio: np.ndarray, rate: int) -> np.ndarray:
    """16 kHz audio as the server hears a microphone at `rate`: 16-bit PCM at that rate, resampled
    back to 16 kHz by the session's streaming resampler (service.audio.AudioPath, 0.1 s blocks)."""
    import soxr

    from service.audio import AudioPath, Chunk

    padded = np.concatenate([audio, np.zeros(2 * RATE, np.float32)])  # the path hands on whole steps
    pcm = np.clip(np.rint(soxr.resample(padded, RATE, rate) * 32767), -32768, 32767) / 32768.0
    path = AudioPath(rate, vad=False)
    block = rate // 10
    heard = [c.audio for i in range(0, len(pcm), block)
             for c in path.push(pcm[i:i + block].astype(np.float32), last=i + block >= len(pcm))
             if isinstance(c, Chunk)]
    return np.concatenate(heard)[:len(audio)].astype(np.float32)


def stream_accuracy(model, utterances: int, seed: int, prefill: bool = True, rate: int = RATE,
                    behind: float = 0.0) -> None:
    """The streaming accuracy lines on one stream: streamed WER minus the one-shot WER of the same
    utterances (target <= 1 point); words dropped or doubled at the stream's trim seams against the
    one-shot words (target: none); and, stricter, words dropped + added anywhere. With `rate` the
    stream is heard as a microphone at that rate (`as_microphone`); the one-shot reads stay 16 kHz.
    With `behind` (seconds) the stream is fed that much at a time with catch_up."""
    from harness.wer import edit_ops, normalise, seam_errors, wer

    audio, utts = build_stream(utterances, seed)
    if rate != RATE:
        audio = as_microphone(audio, rate)
    session, seams, words = StreamSession(model, prefill=prefill), [], []
    session.on_trim = seams.append
    lump = int(behind * RATE) if behind else RATE
    for i in range(0, len(audio), lump):
        words += session.feed(audio[i:i + lump], catch_up=bool(behind))["words"]
    words += session.finish()["words"]
    streamed = " ".join(w["word"] for w in words)
    shot_text, shot_words = one_shot(model, utts)
    truth = " ".join(u[2] for u in utts)
    _, dropped, added = edit_ops(normalise(shot_text), normalise(streamed))
    at_seams = seam_errors(shot_words, words, seams, truth=[u[:3] for u in utts])
    s_wer, o_wer = wer([truth], [streamed]), wer([truth], [shot_text])
    print(f"  stream seed {seed}{'' if prefill else ' (no prefill)'}{'' if rate == RATE else f' ({rate} Hz microphone)'}"
          f"{f' ({behind:g} s behind, {session.passes} passes)' if behind else ''}: streamed WER {s_wer:.2%}, one-shot {o_wer:.2%} ({(s_wer - o_wer) * 100:+.2f} points); "
          f"at {len(seams)} seams {len(at_seams['dropped'])} dropped + {len(at_seams['doubled']) + len(at_seams['across'])} "
          f"doubled; anywhere vs one-shot: {dropped} dropped + {added} added of {len(normalise(shot_text))} words")


def full_pass_breakdown() -> None:
    """The full architecture (random weights, shipped shape): one pass over a 10 s buffer."""
    from harness.audio import clip_set
    from harness.reference import build_model
    from whistle_stream import Whistle

    model = Whistle(build_model("full").path)
    pcm = clip_set()["espeak_12s"][: 10 * RATE]
    model.warmup()
    d = model.dims
    t0 = time.perf_counter()
    enc = model.embed(pcm)
    t_enc = time.perf_counter() - t0
    state = model.decoder.start(enc, beams=5)
    model.decoder.feed(state, [d.bos, d.first_tag])
    parents, tokens = np.zeros(5, np.int64), np.full(5, 5, np.int64)
    model.decoder.step(state, np.zeros(1, np.int64), np.array([5]))
    times = []
    for _ in range(30):
        t = time.perf_counter()
        model.decoder.step(state, np.arange(state.rows) if state.rows == 5 else parents, tokens)
        times.append(time.perf_counter() - t)
    print(f"full architecture, 10 s buffer: encoder {t_enc * 1000:.0f} ms, 5-beam decoder step "
          f"{np.median(times) * 1000:.1f} ms (median of 30)")
    prefill_against_search(model, pcm)


def prefill_against_search(model, pcm: np.ndarray, committed: int = 32, pending: int = 8, repeats: int = 3) -> None:
    """The decoder's part of a pass over a long utterance with `committed` tokens already
    committed and `pending` more to find: 5-beam steps through all of them (the engine before its
    prefill), against one teacher-forced run of the committed tokens and steps for the rest, in
    the same run (random weights: the tokens are fixed ones, fed as each step's choice)."""
    d = model.dims
    enc = model.embed(pcm)
    text = np.arange(committed + pending) % (d.first_tag - 10) + 5

    def search_all():
        state = model.decoder.start(enc, beams=5)
        model.decoder.feed(state, [d.bos, d.first_tag])
        model.decoder.step(state, np.zeros(1, np.int64), text[:1])
        for tok in text[1:]:
            model.decoder.step(state, np.arange(5) % state.rows, np.full(5, tok))

    def prefill_then_search():
        state = model.decoder.start(enc, beams=5)
        model.decoder.feed(state, [d.bos, d.first_tag] + list(text[:committed]))
        model.decoder.step(state, np.zeros(1, np.int64), text[committed:committed + 1])
        for tok in text[committed + 1:]:
            model.decoder.step(state, np.arange(5) % state.rows, np.full(5, tok))

    best = {}
    for fn in (search_all, prefill_then_search) * repeats:
        t = time.perf_counter()
        fn()
        best[fn.__name__] = min(best.get(fn.__name__, np.inf), time.perf_counter() - t)
    print(f"  a pass's decoder over {committed} committed + {pending} new tokens: 5-beam steps through all "
          f"{best['search_all'] * 1000:.0f} ms; committed tokens prefilled, steps for the rest "
          f"{best['prefill_then_search'] * 1000:.0f} ms ({best['search_all'] / best['prefill_then_search']:.1f}x)")


if __name__ == "__main__":
    main()
