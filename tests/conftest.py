"""Shared fixtures: reference models of each shape (tests/harness/reference.py) and test clips.

Import the harness as `from harness import reference` / `from harness.audio import clip_set`
(this file puts tests/ on sys.path). Tests that take a model fixture are marked `reference`
automatically, and `full_model` ones `slow` too; they skip with the reason when jax/needle are
not installed.
"""
import shutil
import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

_MODEL_FIXTURES = {"tiny_model", "odd_model", "full_model", "reference"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & _MODEL_FIXTURES:
            item.add_marker(pytest.mark.reference)
        if "full_model" in used:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def reference():
    """The harness.reference module, or a skip when the JAX reference is not installed."""
    try:
        from harness import reference as module
    except ImportError as error:
        pytest.skip(f"the JAX reference is not importable ({error}); "
                    "install it with: pip install -e '.[reference]'")
    return module


@pytest.fixture(scope="session")
def tiny_model(reference):
    """RefModel of the "tiny" shape (built once, cached under tests/.cache/models)."""
    return reference.build_model("tiny")


@pytest.fixture(scope="session")
def odd_model(reference):
    """RefModel of the "odd" shape: odd layer/lane/tap counts, two engram sites, 128-token cap."""
    return reference.build_model("odd")


@pytest.fixture(scope="session")
def full_model(reference):
    """RefModel of the shipped architecture (first build ~1.5 min, then loaded from the cache)."""
    return reference.build_model("full")


@pytest.fixture(scope="session")
def clips():
    """harness.audio.clip_set(): name -> 16 kHz float32 clip (cached under tests/.cache/audio)."""
    missing = [tool for tool in ("espeak-ng", "flite") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"test speech needs {' and '.join(missing)} (apt-get install {' '.join(missing)})")
    from harness.audio import clip_set
    return clip_set()
