"""`--model` for the benchmarks: the bundled demo model, a harness shape built by the JAX reference
(`full`: the shipped architecture with random weights; `tiny`, `odd`), or a .cact path."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ("full", "tiny", "odd")


def model_path(name: str | None) -> str | None:
    """The .cact to pass as --model; None for the bundled demo model."""
    if name in (None, "demo"):
        return None
    if name in SHAPES:
        sys.path.insert(0, str(ROOT / "tests"))
        from harness.reference import build_model

        return str(build_model(name).path)
    return name


# benchmarks/spoken_tokens.py serves this checkout's code, or the checkout this variable names
# (load.py --engine runs this harness on the other checkout's engine and service).
ENGINE_ROOT = "WHISTLE_BENCH_ENGINE_ROOT"


class _CheckoutFinder:
    """Finds whistle_stream.service, .clients and .cli in one checkout's service/, clients/ and
    cli/ folders (a meta path finder ahead of the others)."""

    def __init__(self, root: Path):
        self.folders = {"whistle_stream.service": root / "service", "whistle_stream.clients": root / "clients",
                        "whistle_stream.cli": root / "cli"}

    def find_spec(self, name, path=None, target=None):
        from importlib.util import spec_from_file_location

        folder = self.folders.get(name)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])


def import_checkout(root: Path) -> None:
    """Make this process import whistle_stream, its service, clients and CLI from the checkout
    `root`. The engine package is found on sys.path; the service and clients live in folders of
    their own that the editable install maps to the installed checkout's, whatever sys.path
    says, so a server of another checkout ran that checkout's engine under this one's service."""
    sys.path.insert(0, str(root))
    sys.meta_path.insert(0, _CheckoutFinder(Path(root)))

SHIPPED_VOCAB = 8199  # embedding rows of the shipped whistle.cact (the harness's tokenizer has 519)


def shipped_size_embedding(dec, cact, vocab: int = SHIPPED_VOCAB, seed: int = 0):
    """Give the engine decoder `dec` a random CQ embedding of `vocab` rows at the file's own width,
    group and codebook (the harness's full architecture has the test tokenizer's 519 rows, and the
    tied embedding is the decoder's largest matrix): the output head built from it as the engine
    builds it, the input rows packed as a file holds them. Returns the CQMatrix."""
    import numpy as np

    from whistle_stream.container import CQMatrix
    from whistle_stream.decoder import _LevelsLinear

    try:
        from whistle_stream.container import PackedCQ
    except ImportError:   # an engine before PackedCQ
        PackedCQ = None

    rng = np.random.default_rng(seed)
    real = cact.cq("embedding")
    codes = rng.integers(0, len(real.codebook), (vocab, real.codes.shape[1])).astype(np.uint8)
    norms = rng.uniform(0.5, 1.5, (vocab, real.norms.shape[1])).astype(np.float16)
    cq = CQMatrix(codes, norms, real.codebook, real.bits, real.group, (vocab, real.shape[1]))
    packed = None
    if PackedCQ is not None:
        fields = (codes[:, :, None] >> np.arange(real.bits, dtype=np.uint8)) & 1
        bits = np.packbits(fields.reshape(vocab, -1), axis=1, bitorder="little")
        packed = PackedCQ(bits, norms, real.codebook, real.bits, real.group, cq.shape)
        assert np.array_equal(packed.codes(np.arange(3)), codes[:3])

    class Shim:   # the file's reader, holding the wide embedding
        def cq(self, name):
            return cq

        def packed_cq(self, name):
            return packed

    dec.head = _LevelsLinear(Shim(), "embedding")
    if isinstance(dec.embedding, np.ndarray):   # an engine before the input rows stayed packed
        dec.embedding = cq.dequantize()
        return cq
    try:   # the input rows read packed as the engine reads them
        from whistle_stream.decoder import _PackedRows
    except ImportError:   # an engine that read them through PackedCQ.rows
        dec.embedding = packed
    else:
        dec.embedding = _PackedRows(packed)
    return cq


def serve_shipped_vocabulary(model, vocab: int = SHIPPED_VOCAB) -> None:
    """Give a loaded Whistle `model` the shipped vocabulary's embedding and head (see
    shipped_size_embedding): each step computes logits over all `vocab` rows, and the search reads
    the first ones, the ids its tokenizer spells. Nothing changes when the model has `vocab` rows."""
    own = model.dims.vocab
    if vocab <= own:
        return
    shipped_size_embedding(model.decoder, model.cact, vocab)
    dec_head = model.decoder.head
    name = "quantised" if hasattr(dec_head, "quantised") else "rotated"   # an engine before the integer head
    head = getattr(dec_head, name)
    setattr(dec_head, name, lambda x: head(x)[:, :own])
