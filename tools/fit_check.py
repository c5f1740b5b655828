"""Where a demo checkpoint's validation loss comes from: unseen sentences or unseen voices.

    .venv/bin/python tools/fit_check.py work-data/run13-step3500.npz --data work-data/demo

prints the quantised model's decoder cross entropy on three sets of clips:
  training   the first --clips training clips that fit validation's length bucket (seen sentences, seen voices)
  validation the validation split (unseen sentences, held-out voices)
  swapped    the validation sentences spoken by training voices (unseen sentences, seen voices)
The checkpoint must have the shape the script's defaults build (docs/demo-model.md's recipe); the tokenizer is
retrained from the first 6000 training transcripts, as train_demo_model.py does. Uses the JAX
reference; a development tool, never imported by the runtime package.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import demo_data  # noqa: E402
from tools import train_demo_model as tdm  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", help="a train_demo_model.py checkpoint .npz")
    ap.add_argument("--data", default="work-data/demo", help="the --data folder of the run (train and validation manifests)")
    ap.add_argument("--clips", type=int, default=300, help="training clips to score")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jax
    import sentencepiece as spm
    from flax import serialization
    from needle.model.quantize import configure_deploy
    from needle.model.whistle import Whistle

    train = tdm.load_split(os.path.join(args.data, "train.jsonl"))
    val = tdm.load_split(os.path.join(args.data, "validation.jsonl"))
    proto = tdm.train_tokenizer([r["text"] for r in train[:6000]], 512, args.seed)
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    cfg = tdm.whistle_config(len(proto.pieces))
    configure_deploy(act_bits=8, kv_bits=8)
    model = Whistle(cfg)

    def ids(rows):
        return tdm.transcript_ids(cfg, sp, rows)

    wav, lengths, tokens = tdm.arrays(train[:2], ids(train[:2]))
    params = model.init(jax.random.PRNGKey(args.seed), wav, lengths, tokens[:, :-1])["params"]
    params = serialization.from_bytes(params, np.load(args.checkpoint)["params"].tobytes())
    q = tdm.quantise(params, False, False)

    @jax.jit
    def cross_entropy(q, wav, lengths, tokens):
        enc, frames = model.apply({"params": q}, wav, lengths, True, method=Whistle.encode)
        logits = model.apply({"params": q}, tokens[:, :-1], enc, frames, True, method=Whistle.logits)
        return tdm.masked_cross_entropy(logits, tokens, cfg.pad)

    samples = tdm.bucket(max(len(r["pcm"]) for r in val))  # one shape for all three sets: one compile
    width = tdm.token_width(ids(val))

    def score(rows):
        t = ids(rows)
        return float(np.mean([cross_entropy(q, *tdm.arrays(rows[i:i + 20], t[i:i + 20], samples, width))
                              for i in range(0, len(rows), 20)]))

    seen = [r for r in train if len(r["pcm"]) <= samples and len(ids([r])[0]) <= width][:args.clips]
    rng = np.random.default_rng(args.seed + 5)
    swapped = []
    for r in val:
        voice = demo_data.CORE_VOICES[int(rng.integers(len(demo_data.CORE_VOICES)))]
        pcm = demo_data.make_clip(r["text"], voice, int(rng.integers(2 ** 30)))
        if len(pcm) <= samples:
            swapped.append({"text": r["text"], "pcm": (pcm * 32768).astype(np.int16)})
    print(f"cross entropy  training {score(seen):.4f} ({len(seen)} clips)  validation {score(val):.4f} "
          f"({len(val)})  validation sentences, training voices {score(swapped):.4f} ({len(swapped)})")


if __name__ == "__main__":
    main()
