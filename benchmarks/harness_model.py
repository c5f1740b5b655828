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
