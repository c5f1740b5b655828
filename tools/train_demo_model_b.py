"""Plan B for the demo Whistle: a float warm-up and a CTC auxiliary loss, so the model listens.

    python tools/train_demo_model_b.py --seed 0 --steps 600 --qat-from 330 --out work-data/planb/demo.cact

Same data (tools/demo_data.py manifests under --data, not regenerated here), tokenizer recipe, model
shape, buckets and .cact export as tools/train_demo_model.py, whose pieces it imports. Two changes:

* Float warm-up: plain float weights and activations until --qat-from, then the CQ straight-through
  weights (CQ4 embedding and mhc_phi lane maps, CQ--bits elsewhere; guide §1/§2) with int8
  activations and KV cache. The phase is a traced flag, so switching costs no recompile.
* A CTC loss on the encoder output (a linear head, dim -> text pieces + blank; weight --ctc) that
  forces the encoder to carry the transcript and the cross-attention to use it. Training only: the
  head is not part of the exported model.

Every --export-every steps it writes the .cact atomically and scores the first --eval-clips test
clips with our own engine (whistle_stream, 5 beams and greedy). Uses the JAX reference; never
imported by the runtime package.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from tools import demo_data  # noqa: E402
from tools.train_demo_model import (LANGUAGE, TOKEN_ROUND, Batches, arrays, bucket, load_split,  # noqa: E402
                                    quantise, train_tokenizer, write_cact, write_card)


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def engine_wer(cact: str, rows: list[dict]) -> dict:
    """WER of our engine on rows (5 beams and greedy), whisper-style normalisation (tests/harness)."""
    from harness.wer import wer
    from whistle_stream import Whistle as Engine

    engine = Engine(cact)
    refs = [r["text"] for r in rows]
    out = {}
    for beams in (5, 1):
        hyps = [engine.transcribe(r["pcm"].astype(np.float32) / 32768, beams=beams)["text"] for r in rows]
        out[beams] = (wer(refs, hyps), hyps)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="work-data/planb/demo.cact")
    ap.add_argument("--data", default="work-data/demo", help="manifests written by train_demo_model.py")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--qat-from", type=int, default=330, help="first step with CQ weights + int8 activations")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ctc", type=float, default=0.3, help="weight of the encoder CTC loss")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--bits", type=int, choices=(2, 4), default=2, help="width of the non-embedding matrices")
    ap.add_argument("--export-every", type=int, default=150)
    ap.add_argument("--eval-clips", type=int, default=40, help="test clips our engine scores at each export")
    args = ap.parse_args(argv)
    t0 = time.time()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import serialization
    from needle.model.export import whistle_tokenizer_blob
    from needle.model.quantize import configure_deploy
    from needle.model.whistle import Whistle, WhistleConfig
    import sentencepiece as spm

    work = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(work, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.join(work, "jax-cache"))
    cq2 = args.bits == 2

    splits = {k: load_split(os.path.join(args.data, f"{k}.jsonl")) for k in ("train", "validation", "test")}
    log(f"clips train {len(splits['train'])} validation {len(splits['validation'])} test {len(splits['test'])}")
    proto = train_tokenizer([r["text"] for r in splits["train"]], args.vocab, args.seed)
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    blob = whistle_tokenizer_blob(proto, (LANGUAGE,))
    cfg = WhistleConfig(text=len(proto.pieces), languages=(LANGUAGE,), dim=128, kv_heads=1, qk_dim=32,
                        v_dim=64, enc_layers=3, dec_layers=2, lanes=4, enc_lanes=4, sites=(1,), orders=(2, 3),
                        slots=2048, stem=64, remat=False)
    ids = {k: [[cfg.bos, cfg.tag(LANGUAGE), *sp.encode(r["text"]), cfg.eos] for r in rows]
           for k, rows in splits.items()}

    configure_deploy(act_bits=8, kv_bits=8)  # used only where the traced `qat` flag is on
    model = Whistle(cfg)
    wav0, len0, tok0 = arrays(splits["train"][:2], ids["train"][:2])
    key = jax.random.PRNGKey(args.seed)
    params = {"whistle": model.init(key, wav0, len0, tok0[:, :-1])["params"],
              "ctc": {"kernel": jax.random.normal(jax.random.fold_in(key, 1), (cfg.dim, cfg.text + 1)) * 0.02,
                      "bias": jnp.zeros(cfg.text + 1)}}
    blank = cfg.text
    log(f"model dim {cfg.dim} enc {cfg.enc_layers} dec {cfg.dec_layers}; float until step {args.qat_from}, "
        f"then CQ{args.bits} (CQ4 embedding, mhc_phi) + A8 + KV8; CTC weight {args.ctc}")

    def losses(p, qat, wav, lengths, tokens):
        w = jax.lax.cond(qat, lambda q: quantise(q, cq2, True), lambda q: q, p["whistle"])
        enc, frames = model.apply({"params": w}, wav, lengths, qat, method=Whistle.encode)
        logits = model.apply({"params": w}, tokens[:, :-1], enc, frames, qat, method=Whistle.logits)
        targets = tokens[:, 1:]
        mask = targets != cfg.pad
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        ce = (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        # CTC on the encoder: labels are the text pieces (no bos, language tag or eos).
        labels = tokens[:, 2:]
        label_pad = ((labels == cfg.pad) | (labels == cfg.eos)).astype(jnp.float32)
        ctc_logits = enc.astype(jnp.float32) @ p["ctc"]["kernel"] + p["ctc"]["bias"]
        frame_pad = (jnp.arange(enc.shape[1]) >= frames[:, None]).astype(jnp.float32)
        per = optax.ctc_loss(ctc_logits, frame_pad, labels, label_pad, blank_id=blank)
        n_labels = (1 - label_pad).sum(-1)
        ok = n_labels < frames  # an alignment exists (repeats aside); others are left out
        ctc = jnp.where(ok, per / jnp.maximum(n_labels, 1), 0).sum() / jnp.maximum(ok.sum(), 1)
        return ce, ctc

    def loss_fn(p, qat, wav, lengths, tokens):
        ce, ctc = losses(p, qat, wav, lengths, tokens)
        return ce + args.ctc * ctc, (ce, ctc)

    warmup = max(1, args.steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, end_value=args.lr * 0.02)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(p, state, qat, wav, lengths, tokens):
        (_, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, qat, wav, lengths, tokens)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, parts

    width = -(-max(len(t) for k in ids for t in ids[k]) // TOKEN_ROUND) * TOKEN_ROUND
    vocabulary = sorted(demo_data.grammar_vocabulary())
    scored = splits["test"][:args.eval_clips]

    def export(p, step, note, path, cq2):
        """Write p's Whistle to path (CQ2 or CQ4 matrices) and score it with our engine."""
        np.save(os.path.join(work, "params.npy"), np.frombuffer(serialization.to_bytes(p), np.uint8))
        info = write_cact(jax.device_get(p["whistle"]), cfg, path, blob, cq2)
        write_card(path, vocabulary, cfg, note)
        try:
            scores = engine_wer(path, scored)
        except Exception as e:  # a scoring failure must not lose the run
            log(f"step {step} wrote {path}; engine scoring failed: {e!r}")
            return
        log(f"step {step} wrote {path} ({info['bytes'] / 1e6:.2f} MB, CQ{2 if cq2 else 4}); engine WER on "
            f"{len(scored)} test clips: 5 beams {scores[5][0]:.2%}, greedy {scores[1][0]:.2%}; "
            f"e.g. {scores[5][1][:3]}")

    batches = Batches(splits["train"], ids["train"], args.batch, np.random.default_rng(args.seed), width)
    step, recent, tick = 0, [], time.time()
    log(f"training {args.steps} steps, batch {args.batch}, {len(batches.groups)} batches/epoch (compiling...)")
    while step < args.steps:
        for wav, lengths, tokens in batches.epoch():
            qat = jnp.asarray(step >= args.qat_from)
            params, opt_state, parts = train_step(params, opt_state, qat, wav, lengths, tokens)
            step += 1
            recent.append([float(x) for x in parts])
            if step % 25 == 0:
                ce, ctc = np.mean(recent, 0)
                log(f"step {step}/{args.steps} ce {ce:.4f} ctc {ctc:.4f} lr {float(schedule(step)):.2e} "
                    f"{'QAT' if step > args.qat_from else 'float'} {(time.time() - tick) / len(recent):.2f} s/step")
                recent, tick = [], time.time()
            if step % args.export_every == 0 or step == args.steps:
                note = f"Plan B step {step} of {args.steps} (float until step {args.qat_from})."
                if step <= args.qat_from:  # float weights: CQ4 shows whether it listens yet
                    export(params, step, note, os.path.join(work, "float-cq4.cact"), False)
                else:
                    export(params, step, note, args.out, cq2)
                if step == args.steps and cq2:  # the CQ4 fallback, for comparison
                    export(params, step, note, os.path.join(work, "final-cq4.cact"), False)
            if step >= args.steps:
                break
    log(f"done in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
