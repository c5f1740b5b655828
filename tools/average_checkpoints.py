"""Average the params of training checkpoints and pack the mean as a demo .cact.

Checkpoint averaging (a "weight soup"): the mean of the weights at nearby points of one run, or of
a run and a second stage fine-tuned from it, often decodes better than either end point. The
inputs are `train_demo_model.py` checkpoints (`DATA/checkpoint.npz`, `DATA/params-stepS.npz`),
all of one shape and one tokenizer; the tokenizer is retrained, exactly as the run trained it, from
the first `--tokenizer-clips` transcripts of DATA's training manifest (`--manifest`, train.jsonl; a run with
`--voices V` trained on train-V.jsonl).

    .venv/bin/python tools/average_checkpoints.py --data work-data/demo22 --out work-data/soup.cact \
        work-data/run22-step3500.npz work-data/run23-step600.npz [--weights 0.5,0.5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_demo_model as train  # noqa: E402


def load_params(path: str):
    """A checkpoint's params as a nested dict of float arrays (no model needed to read them)."""
    from flax import serialization

    with np.load(path, allow_pickle=False) as saved:
        if "params" not in saved:
            raise SystemExit(f"{path}: not a train_demo_model checkpoint (no 'params' array); "
                             "expected DATA/checkpoint.npz or DATA/params-stepS.npz")
        return serialization.msgpack_restore(saved["params"].tobytes())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="checkpoint .npz files of one run's shape and tokenizer")
    ap.add_argument("--weights", help="comma-separated weights, one per checkpoint, summing to 1 (default: equal)")
    ap.add_argument("--data", default="work-data/demo", help="the run's data folder (its training manifest trains the tokenizer)")
    ap.add_argument("--manifest", default="train.jsonl",
                    help="the training manifest in --data (a run with --voices V trained on train-V.jsonl)")
    ap.add_argument("--out", required=True, help="the .cact to write (its card beside it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--tokenizer-clips", type=int, default=6000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--enc-layers", type=int, default=3)
    ap.add_argument("--dec-layers", type=int, default=2)
    ap.add_argument("--bits", type=int, choices=(2, 4), default=4)
    args = ap.parse_args(argv)
    weights = None
    if args.weights:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            ap.error(f"--weights is comma-separated numbers, got {args.weights!r}")
    manifest = os.path.join(args.data, args.manifest)
    if not os.path.exists(manifest):
        ap.error(f"{manifest} not found: --data is the run's data folder (its training manifest trains the tokenizer)")

    from needle.model.export import whistle_tokenizer_blob

    try:
        params = train.average_params([load_params(p) for p in args.checkpoints], weights)
    except ValueError as e:
        ap.error(str(e))
    texts = [json.loads(line)["text"] for line in open(manifest)][:args.tokenizer_clips]
    proto = train.train_tokenizer(texts, args.vocab, args.seed)
    cfg = train.whistle_config(len(proto.pieces), args.dim, args.enc_layers, args.dec_layers)
    info = train.write_cact(params, cfg, args.out, whistle_tokenizer_blob(proto, (train.LANGUAGE,)), args.bits == 2)
    names = ", ".join(f"{os.path.basename(p)} x {w:.2f}" for p, w in
                      zip(args.checkpoints, weights or [1 / len(args.checkpoints)] * len(args.checkpoints)))
    import demo_data

    train.write_card(args.out, sorted(demo_data.grammar_vocabulary()), cfg, f"Checkpoint average: {names}.")
    print(f"wrote {info['path']} ({info['bytes'] / 1e6:.2f} MB): the mean of {names}")


if __name__ == "__main__":
    main()
