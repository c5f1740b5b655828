"""`whistle-stream serve` whose passes decode as many tokens as speech holds (`load.py --spoken-tokens`).

A model with random weights (the harness's full architecture, until the real one can be measured
here) ends most passes after a few tokens, where a real model reads 2.5-3 words a second: each of
its passes decodes several times more tokens, and costs that much more. Here every pass keeps
</s> out of the search, and does not stop at a repeated phrase, until its hypothesis has
`--tokens-per-second` x the pass's audio seconds tokens (the default 4: about three words a second
of 1.3 tokens each, counted over the whole pass, pauses included, so it errs on the costly side).
The search, the decoder and everything else are the engine's own.

    python benchmarks/spoken_tokens.py --tokens-per-second 4 [--prefill off] [--vocab 8199] [serve options]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import threading
from pathlib import Path

import numpy as np

from harness_model import ENGINE_ROOT, import_checkout  # this script's folder, first on sys.path

import_checkout(Path(os.environ.get(ENGINE_ROOT) or Path(__file__).resolve().parent.parent))

try:   # the module that holds Whistle (an older checkout, compared with --engine, calls it model)
    from whistle_stream import whistle as engine_model  # noqa: E402
except ImportError:
    from whistle_stream import model as engine_model  # type: ignore[no-redef]  # noqa: E402
from whistle_stream import search  # noqa: E402

RATE = 16000
_pass = threading.local()   # the running pass's token target, per engine worker thread


SCRIPT_BONUS = 30.0  # added to the scripted token's logit: far above a random model's spread


def script_for(tokenizer, vocab: int, length: int = 4096, seed: int = 0) -> np.ndarray:
    """A fixed token sequence that reads as words: a word-start piece, then on 3 words in 10 a
    continuation piece (about 1.3 pieces a word), drawn from the model's own alphabetic pieces."""
    from whistle_stream.rules import WORD_START

    starts, rests = [], []
    for i in range(vocab):
        if tokenizer.is_special(i):
            continue
        piece = tokenizer.piece(i)
        if piece.startswith(WORD_START) and piece[1:].isalpha() and len(piece) > 2:
            starts.append(i)
        elif piece.isalpha():
            rests.append(i)
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < length:
        out.append(int(rng.choice(starts)))
        if rests and rng.random() < 0.3:
            out.append(int(rng.choice(rests)))
    return np.array(out[:length], np.int64)


# A scripted pass reads its last EDGE_TOKENS from a second script: a real model's guess at the
# word the audio stops inside, which the next pass (hearing more) reads otherwise. So consecutive
# passes agree on all but their edge, and a pass that checks the reading before it
# (`search.greedy_draft`) finds it wrong there, as it would on real speech.
EDGE_TOKENS = 2


def install(tokens_per_second: float, scripted: bool = False) -> None:
    """Patch the engine (this process only) so each pass decodes its audio's share of tokens.
    scripted: each pass reads the same fixed word sequence (`script_for`) from the utterance's start
    and ends at its target, its last EDGE_TOKENS read otherwise, so consecutive passes agree as a
    real model's do on real speech: words commit, and the prefill of committed words runs as it
    would. Greedy passes that check a draft (`search.greedy_draft`, where the engine has it) are
    held to the same tokens."""
    decode, beam_search, find_loop = engine_model.Whistle._decode, engine_model.beam_search, search.find_loop
    greedy_draft = getattr(engine_model, "greedy_draft", None)

    def _decode(self, pcm, *args, **kwargs):
        _pass.need = math.ceil(tokens_per_second * len(pcm) / RATE)
        if scripted and getattr(self, "_scripts", None) is None:
            # one assignment: engine threads start their first passes together, and a thread that
            # saw one script set before the other read a missing attribute (an `internal` error)
            self._scripts = (script_for(self.tokenizer, self.dims.vocab),
                             script_for(self.tokenizer, self.dims.vocab, seed=1))
        _pass.script = self._scripts if scripted else None
        try:
            return decode(self, pcm, *args, **kwargs)
        finally:
            _pass.need = 0

    def holder(eos, prompt_len):
        """held(logits, i): the logits of the i-th generated position (0: the first) as the pass's
        target and script have them."""
        # the pass's target less the committed words fed before the search (the prefill)
        fed = prompt_len - 2
        need = getattr(_pass, "need", 0) - fed
        script = getattr(_pass, "script", None)

        def held(logits, i):
            logits = np.array(logits, dtype=np.float32, copy=True)
            if i < need:
                logits[..., eos] = -np.inf
                if script is not None:   # the text position counts the prefilled tokens too
                    main, edge = script
                    source = main if i < need - EDGE_TOKENS else edge
                    logits[..., source[(fed + i) % len(source)]] += SCRIPT_BONUS
            elif script is not None:
                logits[..., eos] += SCRIPT_BONUS
            return logits

        return held

    def forced_search(first_logits, advance, *, eos, prompt_len=2, **kwargs):
        held, step = holder(eos, prompt_len), [0]

        def advanced(parents, tokens):
            step[0] += 1
            return held(advance(parents, tokens), step[0])

        return beam_search(held(first_logits, 0), advanced, eos=eos, prompt_len=prompt_len, **kwargs)

    def forced_greedy_draft(first_logits, advance, follow, back, draft, *, eos, prompt_len=2, **kwargs):
        held, fed = holder(eos, prompt_len), [0]   # fed: generated tokens the decoder holds

        def followed(guess):
            rows = follow(guess)
            fed[0] = len(guess)
            return np.stack([held(rows[j], j + 1) for j in range(len(rows))])

        def backed(kept):
            back(kept)
            fed[0] = kept

        def advanced(parents, tokens):
            fed[0] += 1
            return held(advance(parents, tokens), fed[0])

        return greedy_draft(held(first_logits, 0), advanced, followed, backed, draft, eos=eos,
                            prompt_len=prompt_len, **kwargs)

    def loop_after_target(tokens, *args, **kwargs):
        return 0 if len(tokens) < getattr(_pass, "need", 0) else find_loop(tokens, *args, **kwargs)

    if tokens_per_second > 0:
        engine_model.Whistle._decode = _decode
        engine_model.beam_search = forced_search
        if greedy_draft is not None:
            engine_model.greedy_draft = forced_greedy_draft
        search.find_loop = loop_after_target


def without_prefill() -> None:
    """Streams search the committed words again (the engine before its prefill), for comparison."""
    from whistle_stream import streaming

    init = streaming.StreamSession.__init__

    def no_prefill(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "prefill": False})

    streaming.StreamSession.__init__ = no_prefill


def shipped_vocabulary(vocab: int) -> None:
    """Every model this process loads gets a `vocab`-row embedding and head of random codes (the
    shipped file's 8199; the harness's full architecture has the test tokenizer's 519): each step
    computes the full head, and the search reads the ids the test tokenizer spells."""
    from harness_model import serve_shipped_vocabulary

    init = engine_model.Whistle.__init__

    def widened(self, *args, **kwargs):
        init(self, *args, **kwargs)
        serve_shipped_vocabulary(self, vocab)

    engine_model.Whistle.__init__ = widened


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--tokens-per-second", type=float, default=4.0, help="0: the model decides")
    ap.add_argument("--vocab", type=int, default=0, help="embedding and head rows (0: the model's own)")
    ap.add_argument("--scripted", action="store_true",
                    help="every pass reads one fixed word sequence (script_for), so passes agree and words commit")
    ap.add_argument("--prefill", choices=("on", "off"), default="on",
                    help="off: passes search the committed words again (the engine before its prefill)")
    known, rest = ap.parse_known_args(argv)
    if known.vocab < 0:
        ap.error(f"--vocab is a row count (0: the model's own), got {known.vocab}")
    settings = (known.tokens_per_second, known.scripted, known.vocab, known.prefill)
    patch(*settings)
    from whistle_stream.service import server

    if hasattr(server, "load_engine"):   # engine worker processes (--processes) get the same patches
        server.load_engine = functools.partial(server.load_engine, initializer=patch, initargs=settings)
    return server.main(rest) or 0


def patch(tokens_per_second: float, scripted: bool, vocab: int, prefill: str) -> None:
    """Every patch main's options ask for, in this process (the server, or an engine worker)."""
    install(tokens_per_second, scripted)
    if vocab:
        shipped_vocabulary(vocab)
    if prefill == "off":
        without_prefill()


if __name__ == "__main__":
    sys.exit(main())
