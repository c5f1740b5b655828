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


VNNI = {**AVX512, "avx512vnni": True}
# What LLVM reports on a Raspberry Pi 5 (Cortex-A76) and a Pi 4 (Cortex-A72): ARM's names only
PI5 = {f: True for f in ("neon", "fp-armv8", "crc", "crypto", "dotprod", "fullfp16", "lse", "rcpc", "rdm")}
PI4 = {f: True for f in ("neon", "fp-armv8", "crc")}


@pytest.mark.parametrize("features, tier", [(VNNI, "x86-64-v4-vnni"), (AVX512, "x86-64-v4"), (AVX2, "x86-64-v3"),
                                            ({**AVX2, "fma": False}, "x86-64"), ({}, "x86-64"),
                                            ({**AVX512, "avx512vl": False}, "x86-64-v3"),
                                            ({**VNNI, "avx512vl": False}, "x86-64-v3")])
def test_a_host_gets_the_highest_tier_whose_features_it_has(features, tier):
    assert _target.host_tier(features, "x86_64") == tier


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ARM64"])
@pytest.mark.parametrize("features", [PI5, PI4, {}])
def test_an_arm_host_gets_the_armv8_tier_never_an_x86_name(machine, features):
    name = _target.host_tier(features, machine)
    tier = _target.TIERS[name]
    assert (name, tier.machine, tier.cpu, tier.features) == ("armv8-a", "aarch64", "generic", "")
    assert (tier.simd, tier.integer) == ("generic", None)   # no x86 intrinsic, the float products
    assert _target.chosen("portable", machine) == "armv8-a"
    assert [t.name for t in _target.tiers_of(machine)] == ["armv8-a"]


def test_a_machine_no_tier_covers_compiles_for_its_host():
    assert _target.host_tier({"altivec": True}, "ppc64le") is None
    assert _target.chosen("portable", "ppc64le") is None


def test_the_setting_names_a_tier_the_host_or_portable():
    assert _target.chosen("") is None and _target.chosen("host") is None
    assert _target.chosen("portable") == _target.host_tier()
    assert _target.chosen("x86-64-v3", "x86_64") == "x86-64-v3"
    assert _target.chosen("armv8-a", "aarch64") == "armv8-a"
    with pytest.raises(ValueError, match="WHISTLE_JIT_TARGET must be 'host', 'portable' or one of x86-64-v4"):
        _target.chosen("skylake")


def test_a_tier_of_another_machine_is_refused_by_name():
    with pytest.raises(ValueError, match="WHISTLE_JIT_TARGET=armv8-a is a tier of aarch64, and this machine is "
                                         "x86_64: its tiers are x86-64-v4-vnni, x86-64-v4, x86-64-v3, x86-64"):
        _target.chosen("armv8-a", "x86_64")
    with pytest.raises(ValueError, match="x86-64-v3 is a tier of x86_64, and this machine is aarch64: its tiers are armv8-a"):
        _target.chosen("x86-64-v3", "aarch64")


def _on_arm(monkeypatch, features):
    """This process as a 64-bit ARM host with `features` would see it (platform and LLVM)."""
    import platform

    import llvmlite.binding as llvm_binding
    from numba import config

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(llvm_binding, "get_host_cpu_features", lambda: dict(features))
    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(config, "CPU_FEATURES", None)


@pytest.mark.parametrize("setting", ["portable", "armv8-a"])
def test_on_an_arm_host_the_tier_compiles_the_generic_simd_path_and_the_float_products(monkeypatch, setting):
    """The image's setting on a Raspberry Pi: Numba gets the ARM baseline CPU (never an x86 name),
    the 5-row kernels the portable vector IR, the products their float path."""
    from numba import config

    from whistle_stream.kernels import integer, simd

    _on_arm(monkeypatch, PI5)
    monkeypatch.setenv(_target.ENV, setting)
    monkeypatch.delenv("WHISTLE_SIMD", raising=False)
    assert _target.configure() == "armv8-a"
    assert (config.CPU_NAME, config.CPU_FEATURES) == ("generic", "")
    assert _target.compiled_tier() is _target.TIERS["armv8-a"] and _target.simd_path() == "generic"
    monkeypatch.setattr(simd, "PATH", simd._choose_path())
    assert simd.PATH == "generic" and integer._path() is None


def test_on_an_arm_host_the_host_cpu_takes_the_generic_simd_path_and_the_float_products(monkeypatch):
    from whistle_stream.kernels import integer, simd

    _on_arm(monkeypatch, PI4)
    monkeypatch.delenv(_target.ENV, raising=False)
    monkeypatch.delenv("WHISTLE_SIMD", raising=False)
    assert _target.configure() is None and _target.compiled_tier() is None
    monkeypatch.setattr(simd, "PATH", simd._choose_path())
    assert simd.PATH == "generic" and integer._path() is None


def test_the_vnni_tier_compiles_the_vnni_products_and_the_avx512_tier_the_avx2_ones(monkeypatch):
    """The image on an AVX-512 VNNI host runs the decoder's integer products (x86-64-v4-vnni); on
    AVX-512 without VNNI the encoder's AVX2-path ones; each a tier of its own cache key."""
    from numba import config

    from whistle_stream.kernels import integer, simd

    monkeypatch.delenv("WHISTLE_SIMD", raising=False)
    for name, want in (("x86-64-v4-vnni", "vnni"), ("x86-64-v4", "avx2"), ("x86-64-v3", "avx2"), ("x86-64", None)):
        tier = _target.TIERS[name]
        monkeypatch.setattr(config, "CPU_NAME", tier.cpu)
        monkeypatch.setattr(config, "CPU_FEATURES", tier.features)
        assert _target.compiled_tier() is tier
        monkeypatch.setattr(simd, "PATH", simd._choose_path())
        assert (simd.PATH, integer._path()) == (tier.simd, want), name


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



# A child process: the demo model's warm-up, a transcription and a stream (every kernel a session
# runs), then the LLVM IR of every kernel it compiled, searched for x86 intrinsics.
_IR_PROBE = r"""
import importlib, json, pkgutil
import numpy as np
from numba.core.registry import CPUDispatcher
from whistle_stream import Whistle, kernels
from whistle_stream.blocks import kernel_path
model = Whistle()
model.warmup()
t = np.arange(32000) / 16000
model.transcribe((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32))
stream = model.open_stream()
stream.feed(np.zeros(16000, np.float32)); stream.finish()
found, kernels_seen = {}, 0
for info in pkgutil.iter_modules(kernels.__path__, "whistle_stream.kernels."):
    module = importlib.import_module(info.name)
    for name, obj in vars(module).items():
        if isinstance(obj, CPUDispatcher) and obj.__module__ == module.__name__:
            for sig in obj.signatures:
                kernels_seen += 1
                ir = obj.inspect_llvm(sig)
                # Numba's own reference counts use the triple's atomics (llvm.x86.atomic.*, on
                # AArch64 its own): only the instructions our kernels ask for are the code's
                hits = sorted({line.split("@")[1].split("(")[0] for line in ir.splitlines()
                               if line.startswith("declare") and "@llvm.x86." in line
                               and "@llvm.x86.atomic." not in line})
                if hits:
                    found[f"{module.__name__}.{name}"] = hits
print(json.dumps({"path": str(kernel_path()), "kernels": kernels_seen, "x86": found}))
"""


@pytest.mark.slow
def test_the_code_arm_runs_declares_no_x86_intrinsic(tmp_path):
    """What an ARM tier compiles (the generic simd path, the float products), compiled here as the
    baseline x86-64 tier takes the same paths: every kernel a session runs, none of them declaring
    an x86 intrinsic, which LLVM cannot lower for AArch64. (tools/check_arm64.sh runs it on arm64.)"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), _target.ENV: "x86-64"}
    for name in ("WHISTLE_SIMD", "WHISTLE_INTEGER"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", _IR_PROBE], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    arm = _target.TIERS["armv8-a"]
    assert got["path"] == f"x86_64 x86-64, simd {arm.simd}, integer products: none"
    assert got["kernels"] > 20 and got["x86"] == {}, got


@pytest.mark.parametrize("machine, features, ran, skipped", [
    ("x86_64", AVX2, ["x86-64-v3", "x86-64"], ["x86-64-v4-vnni", "x86-64-v4"]),
    ("x86_64", VNNI, ["x86-64-v4-vnni", "x86-64-v4", "x86-64-v3", "x86-64"], []),
    ("aarch64", PI5, ["armv8-a"], [])])
def test_warm_all_tiers_compiles_each_tier_of_the_machine_it_can_run(monkeypatch, capsys, machine, features, ran,
                                                                    skipped):
    """What the image's build runs: a child process per tier of the build machine's architecture
    that it can run, and a line for each tier above it (an arm64 build never names an x86 tier)."""
    import argparse
    import platform

    import llvmlite.binding as llvm_binding

    from whistle_stream import cli

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(llvm_binding, "get_host_cpu_features", lambda: dict(features))
    children = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, env: children.append(env[_target.ENV]) or
                        subprocess.CompletedProcess(cmd, 0))
    cli._warm(argparse.Namespace(all_tiers=True, model=None))
    out = capsys.readouterr().out
    assert children == ran
    assert [line.split()[1] for line in out.splitlines() if "skipped" in line] == skipped
