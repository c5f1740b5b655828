"""Decoder speed: one batched 5-beam step, and a whole 30 s transcription, for our engine and for a
straightforward NumPy implementation of the same decoder, in the same run.

    python benchmarks/decoder.py                  # full architecture, shipped vocabulary
    python benchmarks/decoder.py --shape tiny --steps 10
    python benchmarks/decoder.py --model path.cact --vocab 0
    python benchmarks/decoder.py --threads 2      # only the 2-thread engine (default: 1 and 2 in turn)
    python benchmarks/decoder.py --engine WORKTREE   # this checkout's step against another's

The harness's full-architecture model has the test tokenizer's 519-row embedding; the shipped file
has 8199 rows and the output head is the largest matrix of a step, so by default the head (and
the input embedding) are widened to --vocab rows of random CQ4 codes. The context is 50 tokens
(<s>, a language tag, 48 text tokens) over 375 memory frames (30 s); each timed step reorders the
beams to random parents, as a search does. "Transcription" = start (cross K/V of every layer),
the 2-token prompt, then --tokens 5-beam steps: tokens/s = tokens / that wall time.

On a CPU with the integer products (kernels/integer.py) the engine runs them, and the same engine
on the float products (WHISTLE_INTEGER=0's path) is timed beside it, step by step, in the same run.

Step times are measured twice: alternating one engine step with one baseline step (so machine load
hits both alike, but each engine step starts with caches the baseline's float32 sweep emptied), and
in blocks of 10 engine steps back to back, as a beam search runs them.

The NumPy baseline keeps every matrix dequantised to float32 and multiplies through BLAS, keeps
one KV cache per beam and gathers it on every reorder, and runs the same quantisation points;
its logits are compared with the engine's at the end.

With --engine, only the step is timed, this checkout's engine against another checkout's (a git
worktree), each in a child process of its own (whistle_stream imported from its checkout, one
thread) on the same model, head, memory, context and random parents and tokens: single steps
taken in turn by the two (each starting where the other's step left the caches), then blocks of
10 steps back to back, each engine's block in turn. Prints each side's best and median and
their ratio (this / other).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness_model import shipped_size_embedding  # noqa: E402
from whistle_stream import kernels  # noqa: E402
from whistle_stream.container import CactFile  # noqa: E402
from whistle_stream.decoder import ENGRAM_PRIME, ENGRAM_SEED, ENGRAM_SHIFT, Decoder, sinusoids  # noqa: E402

EPS = 1e-6


# ---------------------------------------------------------------- the NumPy baseline


def fq(x):
    """int8 fake-quant over the last axis."""
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return (np.clip(np.rint(x / scale), -128, 127) * scale).astype(np.float32)


def zc(x, scale):
    return ((1 + scale) * x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)).astype(np.float32)


def rms_unit(x):
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)).astype(np.float32)


def sig(x):
    return (1 / (1 + np.exp(-x))).astype(np.float32)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def kron(z, a, b, perm=None):
    rows = z.shape[0]
    out = np.matmul(np.matmul(a.T, z.reshape(rows, a.shape[0], b.shape[0])), b).reshape(rows, -1)
    return out if perm is None else out[:, perm]


class NumpyDecoder:
    """The decoder written plainly with NumPy, float32 matrices, one KV cache per beam."""

    def __init__(self, dec: Decoder, cact: CactFile, head: np.ndarray):
        self.dec, self.d = dec, dec.dims
        a = cact.array
        self.w = []
        for layer in dec.layers:
            p = f"layer{layer.index:02d}."
            self.w.append({k: a(p + k) for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "out_proj",
                                                 "cross.q_proj", "cross.k_proj", "cross.v_proj",
                                                 "cross.gate_proj", "cross.out_proj")})
        self.engram = {s: (a(f"engram{s}.tables"), a(f"engram{s}.key_proj"), a(f"engram{s}.value_proj"))
                       for s in dec.engrams}
        self.head = head
        self.embedding = head  # the dequantised table: every input row, as the baseline keeps it

    def start(self, enc):
        d, dec = self.d, self.dec
        mem = fq(enc + dec.pe_gate * sinusoids(enc.shape[0], d.width))
        self.cross = []
        for layer, w in zip(dec.layers, self.w):
            k = fq(zc((mem @ w["cross.k_proj"].T).reshape(-1, d.heads, d.qk_dim), layer.ck_norm))
            v = fq((mem @ w["cross.v_proj"].T).reshape(-1, d.heads, d.v_dim))
            self.cross.append((k, v))
        self.tokens = np.zeros((1, 0), np.int64)
        self.cache = [dict(k=np.zeros((1, 0, d.kv_heads, d.qk_dim), np.float32),
                           v=np.zeros((1, 0, d.kv_heads, d.v_dim), np.float32),
                           q_raw=np.zeros((1, 0, d.heads * d.qk_dim), np.float32),
                           k_raw=np.zeros((1, 0, d.kv_heads * d.qk_dim), np.float32),
                           v_raw=np.zeros((1, 0, d.kv_heads * d.v_dim), np.float32)) for _ in dec.layers]
        self.ev_raw = {s: np.zeros((1, 0, d.width), np.float32) for s in self.engram}

    def step(self, parents, tokens):
        d, dec = self.d, self.dec
        self.tokens = np.concatenate([self.tokens[parents], tokens[:, None]], 1)
        for c in self.cache:
            for key in c:
                c[key] = c[key][parents]
        for s in self.ev_raw:
            self.ev_raw[s] = self.ev_raw[s][parents]
        rows, t = tokens.shape[0], self.tokens.shape[1] - 1
        x = self.embedding[tokens] * dec.embed_scale

        engram = {}
        if self.engram:
            seq = self.tokens.astype(np.uint32)
            idx, ok = [], []
            for oi, order in enumerate(dec.orders):
                for h in range(dec.hashes):
                    acc = np.full(rows, (ENGRAM_SEED * (oi * dec.hash_stride + h + 1)) & 0xFFFFFFFF, np.uint32)
                    for j in range(order):
                        acc = (acc ^ (seq[:, t - j] if t - j >= 0 else np.uint32(0))) * np.uint32(ENGRAM_PRIME)
                    acc ^= acc >> np.uint32(ENGRAM_SHIFT)
                    idx.append(acc % np.uint32(d.engram_slots))
                    ok.append(t >= order - 1)
            for s, (tables, wk, wv) in self.engram.items():
                e = np.concatenate([tables[i * d.engram_slots + ix.astype(np.int64)] * o
                                    for i, (ix, o) in enumerate(zip(idx, ok))], 1)
                e = fq(e)
                self.ev_raw[s] = np.concatenate([self.ev_raw[s], (e @ wv.T)[:, None]], 1)
                taps = dec.engrams[s].taps
                v = sum(taps[j] * self.ev_raw[s][:, t - j * d.engram_dilation]
                        for j in range(len(taps)) if t - j * d.engram_dilation >= 0)
                engram[s] = (e @ wk.T, v)

        n = d.lanes
        X = np.repeat(x[:, None], n, 1)
        lanes = dec.lanes
        for layer, w, c, (ck, cv) in zip(dec.layers, self.w, self.cache, self.cross):
            i = layer.index
            nx = fq(rms_unit(X.reshape(rows, -1)))
            z = nx @ lanes.phi[i].weight.T
            lane = layer.lane
            hpre = sig(lanes.a_pre[i] * z[:, :n] + lanes.b_pre[i] + (8 * lane - 4))
            hpost = 2 * sig(lanes.a_post[i] * z[:, n:2 * n] + lanes.b_post[i] - 4 * (1 - lane))
            lg = (lanes.a_res[i] * z[:, 2 * n:]).reshape(rows, n, n) + lanes.b_res[i]
            for _ in range(20):
                lg = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
                lg = lg - np.log(np.exp(lg).sum(-2, keepdims=True))
            hres = np.exp(lg)
            u = np.einsum("rn,rnc->rc", hpre, X)
            xb = u.copy()
            if layer.site is not None and layer.site in engram:
                key, value = engram[layer.site]
                xb = xb + sig((rms_unit(xb) * rms_unit(key)).sum(-1) / dec.embed_scale)[:, None] * value
            h = fq(zc(xb, layer.norm_in))
            for name, proj in (("q_raw", "q_proj"), ("k_raw", "k_proj"), ("v_raw", "v_proj")):
                c[name] = np.concatenate([c[name], (h @ w[proj].T)[:, None]], 1)

            def tapped(raw, taps):
                return sum(taps[j] * raw[:, t - j] for j in range(len(taps)) if t - j >= 0) if len(taps) else raw[:, t]
            q = zc(tapped(c["q_raw"], layer.q_taps).reshape(rows, d.heads, d.qk_dim), layer.q_norm)
            k = zc(tapped(c["k_raw"], layer.k_taps).reshape(rows, d.kv_heads, d.qk_dim), layer.k_norm)
            v = tapped(c["v_raw"], layer.v_taps).reshape(rows, d.kv_heads, d.v_dim)
            cos, sin = dec.rope_cos[t], dec.rope_sin[t]
            half = d.qk_dim // 2

            def rope(a):
                return np.concatenate([a[..., :half] * cos - a[..., half:] * sin,
                                       a[..., half:] * cos + a[..., :half] * sin], -1)
            q, k, v = fq(rope(q)), fq(rope(k)), fq(v)
            c["k"] = np.concatenate([c["k"], k[:, None]], 1)
            c["v"] = np.concatenate([c["v"], v[:, None]], 1)
            g = d.heads // d.kv_heads
            s = np.einsum("rhd,rthd->rht", q.reshape(rows, d.kv_heads, g, d.qk_dim).reshape(rows, -1, d.qk_dim),
                          np.repeat(c["k"], g, axis=2)) / np.float32(math.sqrt(d.qk_dim))
            att = np.einsum("rht,rthd->rhd", softmax(s), np.repeat(c["v"], g, axis=2)).reshape(rows, -1)
            att = fq(att * sig(h @ w["gate_proj"].T)) @ w["out_proj"].T
            xb = xb + layer.attn_gate * zc(att, layer.post_norm)

            h = fq(zc(xb, layer.cross_norm))
            q = fq(zc((h @ w["cross.q_proj"].T).reshape(rows, d.heads, d.qk_dim), layer.cq_norm))
            s = np.einsum("rhd,fhd->rhf", q, ck) / np.float32(math.sqrt(d.qk_dim))
            att = np.einsum("rhf,fhd->rhd", softmax(s), cv).reshape(rows, -1)
            att = fq(att * sig(h @ w["cross.gate_proj"].T)) @ w["cross.out_proj"].T
            xb = xb + layer.cross_gate * zc(att, layer.post_cross_norm)

            m = layer.mlp
            hh = zc(xb, layer.pre_hada)
            cond = softmax(hh @ m.cond_vt.T) @ m.cond_u + 1
            zz = np.zeros((rows, m.n), np.float32)
            zz[:, :d.width] = hh
            zz = kron(m.d1 * zz, *m.factors[0], m.p1)
            zz = m.d2 * cond * zz + m.b2
            zz = kron(zz * sig(zz), *m.factors[1], m.p2)
            zz = kron(m.d3 * zz, *m.factors[2])
            xb = xb + (m.d4 * zz)[:, :d.width]
            X = np.einsum("rij,rjc->ric", hres, X) + hpost[..., None] * (xb - u)[:, None]
        out = fq(zc(X.mean(1), lanes.final_norm))
        return out @ self.head.T


# ---------------------------------------------------------------- a shipped-size head


def widen_head(dec: Decoder, cact: CactFile, vocab: int, seed: int = 0) -> np.ndarray:
    """Give `dec` a random CQ4 embedding of `vocab` rows (text = vocab - languages); returns it
    dequantised (vocab, width) for the NumPy baseline."""
    cq = shipped_size_embedding(dec, cact, vocab, seed)
    dec.dims = dataclasses.replace(dec.dims, vocab=vocab, text_vocab=vocab - len(dec.dims.languages))
    return cq.dequantize()


# ---------------------------------------------------------------- against another checkout

_CHILD = r"""
import dataclasses, json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2] + "/benchmarks"]
import numpy as np
from whistle_stream import kernels
from whistle_stream.container import CactFile
from whistle_stream.decoder import Decoder
from harness_model import shipped_size_embedding
path, vocab, frames, context, beams = sys.argv[3], *map(int, sys.argv[4:8])
kernels.set_threads(1)
cact = CactFile(path)
dec = Decoder(cact)
if vocab:
    shipped_size_embedding(dec, cact, vocab, 0)
    dec.dims = dataclasses.replace(dec.dims, vocab=vocab, text_vocab=vocab - len(dec.dims.languages))
d = dec.dims
rng = np.random.default_rng(0)
enc = rng.standard_normal((frames, d.width)).astype(np.float32)
prompt = [d.bos, d.first_tag] + list(rng.integers(3, d.text_vocab, context - 2))
zero = np.zeros(beams, np.int64)
state = None
for line in sys.stdin:
    steps, seed, fresh = map(int, line.split())
    if fresh or state is None or state.position + steps >= d.max_tokens:
        state = dec.start(enc, beams=beams)
        dec.feed(state, prompt)
        dec.step(state, zero, np.full(beams, 3))
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(steps):
        parents, tokens = rng.integers(0, beams, beams), rng.integers(3, d.text_vocab, beams)
        t0 = time.perf_counter()
        dec.step(state, parents, tokens)
        times.append(time.perf_counter() - t0)
    print(json.dumps(times), flush=True)
"""


def against(args, path: str) -> None:
    """--engine: this checkout's 5-beam step against another's, each in its own child process."""
    root = args.engine.resolve()
    if not (root / "whistle_stream" / "decoder.py").exists():
        raise SystemExit(f"--engine {args.engine}: not a checkout (no whistle_stream/decoder.py there)")
    sides = {"this": ROOT, "other": root}
    procs = {name: subprocess.Popen([sys.executable, "-c", _CHILD, str(r), str(ROOT), path, str(args.vocab),
                                     str(args.frames), str(args.context), str(args.beams)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
             for name, r in sides.items()}

    def run(name: str, steps: int, seed: int, fresh: bool) -> list:
        procs[name].stdin.write(f"{steps} {seed} {int(fresh)}\n")
        procs[name].stdin.flush()
        line = procs[name].stdout.readline()
        if not line:
            raise SystemExit(f"the {name} engine's child exited: {procs[name].wait()}")
        return json.loads(line)

    for name in sides:   # compile, load, warm
        run(name, 10, 0, True)
    turns = {name: [] for name in sides}
    blocks = {name: [] for name in sides}
    for i in range(args.steps):   # one step each in turn, from where the state stands (context 50 on)
        for name in list(sides)[::1 if i % 2 else -1]:
            turns[name] += run(name, 1, 1000 + i, i == 0)
    for i in range(max(1, args.steps // 10)):   # blocks of 10 from context 50, each engine's in turn
        for name in list(sides)[::1 if i % 2 else -1]:
            blocks[name] += run(name, 10, 2000 + i, True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    vocab = f"{args.vocab}-row vocabulary" if args.vocab else "the model's vocabulary"
    print(f"{args.beams}-beam step, 1 thread, {args.frames} frames, {vocab}, context {args.context} on; "
          f"other: {args.engine}")
    for label, runs in (("in turn", turns), ("back to back", blocks)):
        ms = {name: np.array(t) * 1e3 for name, t in runs.items()}
        print(f"{label:>12}: " + "; ".join(f"{name} best {m.min():.2f} ms, median {np.median(m):.2f} ms"
                                           for name, m in ms.items())
              + f"; this / other {np.median(ms['this']) / np.median(ms['other']):.2f}x (medians), "
              f"{ms['this'].min() / ms['other'].min():.2f}x (bests) over {len(ms['this'])} steps")


# ---------------------------------------------------------------- timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="full", help="harness model shape (tiny, odd, full)")
    ap.add_argument("--model", help="a .cact to run instead of the harness model")
    ap.add_argument("--vocab", type=int, default=8199, help="head rows (0: the model's own)")
    ap.add_argument("--frames", type=int, default=375)
    ap.add_argument("--context", type=int, default=50)
    ap.add_argument("--beams", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    ap.add_argument("--tokens", type=int, default=100, help="tokens of the timed transcription")
    ap.add_argument("--threads", default="1,2",
                    help="comma-separated engine thread counts (kernels.set_threads), taken in turn per step")
    ap.add_argument("--engine", type=Path, help="time only the step, against this other checkout's (a git worktree)")
    args = ap.parse_args()
    settings = [int(t) for t in args.threads.split(",")]

    path = args.model
    if path is None:
        from tests.harness.reference import build_model  # cached under tests/.cache/models
        path = build_model(args.shape).path
    if args.engine is not None:
        against(args, str(path))
        return
    cact = CactFile(path)
    dec = Decoder(cact)
    head = widen_head(dec, cact, args.vocab) if args.vocab else cact.array("embedding")
    floats = None   # the same engine on the float products, where the integer ones run
    if kernels.INTEGER_PRODUCTS:
        kernels.INTEGER_PRODUCTS = False
        floats = Decoder(cact)
        if args.vocab:
            widen_head(floats, cact, args.vocab)
        kernels.INTEGER_PRODUCTS = True
    base = NumpyDecoder(dec, cact, head)
    d = dec.dims
    rng = np.random.default_rng(0)
    enc = rng.standard_normal((args.frames, d.width)).astype(np.float32)
    prompt = [d.bos, d.first_tag] + list(rng.integers(3, d.text_vocab, args.context - 2))
    print(f"model {path}: {len(dec.layers)} layers, width {d.width}, vocab {d.vocab}, "
          f"{args.frames} frames, {args.beams} beams, context {args.context}")

    # warm the JIT, then build both states at the same context
    dec.logits(enc[:8], prompt[:3])
    state = dec.start(enc, beams=args.beams)
    dec.feed(state, prompt)
    base.start(enc)
    zero = np.zeros(args.beams, np.int64)
    first = rng.integers(3, d.text_vocab, args.beams)
    ours_first = dec.step(state, zero, first)
    if floats is not None:
        floats.logits(enc[:8], prompt[:3])
        float_state = floats.start(enc, beams=args.beams)
        floats.feed(float_state, prompt)
        floats.step(float_state, zero, first)
    for tok in prompt:
        base.step(np.zeros(1, np.int64), np.array([tok]))
    theirs_first = base.step(zero, first)

    starts = []
    for _ in range(3):
        t0 = time.perf_counter()
        dec.start(enc, beams=args.beams)
        starts.append(time.perf_counter() - t0)
    print(f"engine start (cross K/V of every layer over {args.frames} frames): best {min(starts) * 1e3:.1f} ms")

    names = {t: f"engine {t}T" for t in settings}
    float_names = {t: f"float products {t}T" for t in settings} if floats is not None else {}
    times = {**{names[t]: [] for t in settings}, **{float_names[t]: [] for t in float_names}, "numpy": []}
    agree = [np.abs(ours_first - theirs_first).max()]
    top1 = [bool((ours_first.argmax(1) == theirs_first.argmax(1)).all())]
    for t in settings:  # warm each setting's pool
        kernels.set_threads(t)
        dec.logits(enc[:8], prompt[:3])
        if floats is not None:
            floats.logits(enc[:8], prompt[:3])
    for i in range(args.steps):  # alternate so machine load hits every side alike
        threads = settings[i % len(settings)]
        kernels.set_threads(threads)
        parents = rng.integers(0, args.beams, args.beams)
        tokens = rng.integers(3, d.text_vocab, args.beams)
        if floats is not None:   # the two engines take turns at following the baseline's sweep
            order = [(dec, state, names), (floats, float_state, float_names)][::1 if i % 2 else -1]
            for engine, st, label in order:
                t0 = time.perf_counter()
                out = engine.step(st, parents, tokens)
                times[label[threads]].append(time.perf_counter() - t0)
                if engine is dec:
                    a = out
        else:
            t0 = time.perf_counter()
            a = dec.step(state, parents, tokens)
            times[names[threads]].append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        b = base.step(parents, tokens)
        t2 = time.perf_counter()
        times["numpy"].append(t2 - t1)
        agree.append(np.abs(a - b).max())
        top1.append(bool((a.argmax(1) == b.argmax(1)).all()))
    for name, ts in times.items():
        ts = np.array(ts) * 1e3
        print(f"{name:>9} 5-beam step at context {args.context}..{args.context + args.steps}: "
              f"best {ts.min():.2f} ms, median {np.median(ts):.2f} ms")
    print(f"engine vs numpy logits: max |delta| {max(agree):.3g}, top-1 identical on "
          f"{sum(top1)}/{len(top1)} steps")

    # The steps above alternate with the baseline's, which sweeps ~100 MB of float32 weights
    # between two engine steps (every engine step starts with cold caches). A search runs its steps
    # back to back: blocks of 10 consecutive engine steps from context 50, a fresh state each block.
    engines = [(dec, names)] + ([(floats, float_names)] if floats is not None else [])
    for threads in settings:
        kernels.set_threads(threads)
        runs = {id(engine): [] for engine, _ in engines}
        for block in range(max(1, args.steps // 10)):
            for engine, _ in engines[::1 if block % 2 else -1]:   # blocks of each engine in turn
                st = engine.start(enc, beams=args.beams)
                engine.feed(st, prompt)
                engine.step(st, zero, first)
                for _ in range(10):
                    parents, tokens = rng.integers(0, args.beams, args.beams), rng.integers(3, d.text_vocab, args.beams)
                    t0 = time.perf_counter()
                    engine.step(st, parents, tokens)
                    runs[id(engine)].append(time.perf_counter() - t0)
        for engine, label in engines:
            run = np.array(runs[id(engine)]) * 1e3
            print(f"{label[threads]:>9} 5-beam step back to back at context {args.context}..{args.context + 10}: "
                  f"best {run.min():.2f} ms, median {np.median(run):.2f} ms ({len(run)} steps)")

    def transcribe(impl) -> float:
        t0 = time.perf_counter()
        if impl is not base:
            st = impl.start(enc, beams=args.beams)
            impl.feed(st, prompt[:2])
            for _ in range(args.tokens):
                impl.step(st, rng.integers(0, st.rows, args.beams), rng.integers(3, d.text_vocab, args.beams))
        else:
            base.start(enc)
            for tok in prompt[:2]:
                base.step(np.zeros(1, np.int64), np.array([tok]))
            rows = 1
            for _ in range(args.tokens):
                base.step(rng.integers(0, rows, args.beams), rng.integers(3, d.text_vocab, args.beams))
                rows = args.beams
        return time.perf_counter() - t0

    for threads in settings:
        kernels.set_threads(threads)
        for engine, label in engines:
            best = min(transcribe(engine) for _ in range(2))
            print(f"{label[threads]:>9} 30 s transcription ({args.tokens} tokens, {args.beams} beams): {best:.2f} s, "
                  f"{args.tokens / best:.0f} tokens/s")
    best = transcribe(base)
    print(f"{'numpy':>9} 30 s transcription ({args.tokens} tokens, {args.beams} beams): {best:.2f} s, "
          f"{args.tokens / best:.0f} tokens/s")


if __name__ == "__main__":
    main()
