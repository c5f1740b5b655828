"""WHISTLE_JIT_TARGET: kernels compiled for a fixed CPU tier, so that a JIT cache compiled on one CPU
loads on another CPU of the tier (what the image ships; `whistle-stream warm --all-tiers`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from whistle_stream.kernels import _target

AVX512 = {f: True for f in ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma",
                            "bmi2", "f16c", "movbe")}
AVX2 = {f: True for f in ("avx2", "fma", "bmi2", "f16c", "movbe")}


@pytest.mark.parametrize("features, tier", [(AVX512, "x86-64-v4"), (AVX2, "x86-64-v3"),
                                            ({**AVX2, "fma": False}, "x86-64"), ({}, "x86-64"),
                                            ({**AVX512, "avx512vl": False}, "x86-64-v3")])
def test_a_host_gets_the_highest_tier_whose_features_it_has(features, tier):
    assert _target.host_tier(features) == tier


def test_the_setting_names_a_tier_the_host_or_portable():
    assert _target.chosen("") is None and _target.chosen("host") is None
    assert _target.chosen("portable") == _target.host_tier()
    assert _target.chosen("x86-64-v3") == "x86-64-v3"
    with pytest.raises(ValueError, match="WHISTLE_JIT_TARGET must be 'host', 'portable' or one of x86-64-v4"):
        _target.chosen("skylake")


def test_an_unknown_setting_is_reported_and_the_host_cpu_used(monkeypatch):
    monkeypatch.setenv(_target.ENV, "fastest")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _target.configure() is None
    assert "got 'fastest'; compiling for the host CPU" in str(caught[0].message)


# A child process: compiles (or loads) two of the package's kernels and reports what Numba keyed them by.
_PROBE = r"""
import json, numpy as np
from whistle_stream import kernels as k
from whistle_stream.kernels import simd
from numba.core.registry import cpu_target
x = np.ones((5, 128), np.float32); w = np.ones((16, 128), np.float32); out = np.zeros((5, 16), np.float32)
k._gemm_rows(x, w, out)
k._softmax_rows(x.copy(), np.zeros_like(x))
hits = sum(sum(f.stats.cache_hits.values()) for f in (k._gemm_rows, k._softmax_rows))
print(json.dumps({"key": list(cpu_target.target_context.codegen().magic_tuple()), "hits": hits,
                  "path": simd.PATH, "sum": float(out.sum())}))
"""


def _probe(cache, target: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), _target.ENV: target}
    env.pop("WHISTLE_SIMD", None)
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_tier_cache_is_keyed_by_the_tier_alone_and_loads_in_the_next_process(tmp_path):
    tier = "x86-64-v3"                    # every x86-64 CI machine here runs it
    first = _probe(tmp_path, tier)
    # Nothing of the host CPU in the key: a cache compiled on any CPU of the tier has this key
    assert first["key"][1:] == [tier, ""] and first["path"] == "avx2" and first["hits"] == 0
    again = _probe(tmp_path, tier)
    assert again["hits"] == 2 and again["sum"] == first["sum"] == 5 * 16 * 128
    # the host's own key is another one: a cache compiled elsewhere for the host CPU misses here
    host = _probe(tmp_path, "host")
    assert host["hits"] == 0 and host["key"][1] != tier


_DECODE = r"""
import sys
import numpy as np
from whistle_stream import Whistle
from whistle_stream.kernels import integer
model = Whistle()   # the demo model: every decoder kernel, the integer products' callers among them
d = model.dims
enc = np.random.default_rng(0).standard_normal((20, d.width)).astype(np.float32)
logits = model.decoder.logits(enc, [d.bos, d.first_tag, 5, 6])
print(integer.PATH, integer.VNNI, logits.shape, bool(np.isfinite(logits).all()))
"""


@pytest.mark.slow
def test_a_tier_without_the_integer_instructions_compiles_every_decoder_kernel(tmp_path):
    """The decoder's layer kernels call the integer products; a tier's code (the image's caches)
    must compile without their AVX-512 VNNI intrinsics, which LLVM cannot lower for AVX2 (it
    aborted the process): the branch is left out where `integer.VNNI` is false (the tier takes
    the AVX2 path of the encoder's products, not the decoder's)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), _target.ENV: "x86-64-v3"}
    env.pop("WHISTLE_SIMD", None)
    done = subprocess.run([sys.executable, "-c", _DECODE], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    path, vnni, *_, finite = done.stdout.split()
    assert (path, vnni, finite) == ("avx2", "False", "True")


@pytest.mark.slow
def test_the_avx2_integer_products_pass_the_integer_product_tests(tmp_path):
    """The integer products' AVX2 path (vpmaddwd, levels looked up by compare and select), as the
    x86-64-v3 tier's cache compiles it, through the tests the VNNI path passes: exactly the int64
    twin's sums at every tile and tail shape, the products of fake-quantised rows, the blocks a
    split writes. Exact sums make its outputs the VNNI path's bit for bit, so the parity the
    encoder holds on one holds on the other."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), _target.ENV: "x86-64-v3"}
    for name in ("WHISTLE_SIMD", "WHISTLE_INTEGER"):
        env.pop(name, None)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", "from whistle_stream.kernels import integer; print(integer.PATH)"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.stdout.split() == ["avx2"], done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
                           "-k", "integer or quant_rotate", "-rs"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary and int(summary.split()[0]) >= 20, summary
