"""The CPU the kernels are compiled for, and so the cache entries they load.

Numba keys every cached kernel by the CPU it was compiled for: LLVM's name of the host CPU and
its full feature list. A cache compiled on one CPU model (an image's build machine) misses on any
other (a cluster node of another generation), and the replica compiles for about a minute before
it is ready. `WHISTLE_JIT_TARGET` chooses instead:

- `host` (the default): the host CPU, as Numba does by itself.
- `portable`: the tier of the host below, picked from its features, so a cache compiled on any
  CPU of a tier loads on every other CPU of it. The image compiles all three tiers' caches.
- a tier's name (`x86-64-v4`, `x86-64-v3`, `x86-64`): that tier, to compile its cache.

A tier is an x86-64 micro-architecture level (the psABI's), named as LLVM names it, with no extra
features, and the `simd` path its instructions allow.
"""

from __future__ import annotations

import os
import warnings

import llvmlite.binding as llvm_binding
from numba import config

# tier -> (the host features it needs, the simd path it compiles)
TIERS = {
    "x86-64-v4": (("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma"), "avx512"),
    "x86-64-v3": (("avx2", "fma", "bmi2", "f16c", "movbe"), "avx2"),
    "x86-64": ((), "generic"),
}
ENV = "WHISTLE_JIT_TARGET"


def host_tier(features: dict | None = None) -> str:
    """The highest tier whose features the host (or `features`, LLVM's {name: bool}) has."""
    have = llvm_binding.get_host_cpu_features() if features is None else features
    return next(tier for tier, (needs, _) in TIERS.items() if all(have.get(f) for f in needs))


def chosen(value: str | None = None) -> str | None:
    """The tier `WHISTLE_JIT_TARGET` (or value) asks for; None for the host CPU."""
    value = (os.environ.get(ENV, "") if value is None else value).strip()
    if value in ("", "host"):
        return None
    if value == "portable":
        return host_tier()
    if value in TIERS:
        return value
    raise ValueError(f"{ENV} must be 'host', 'portable' or one of {', '.join(TIERS)}; got {value!r}")


def configure() -> str | None:
    """Point Numba at the chosen tier before any kernel compiles or loads; returns the tier. An
    unknown WHISTLE_JIT_TARGET is reported and the host CPU used (as for WHISTLE_SIMD)."""
    try:
        tier = chosen()
    except ValueError as e:
        warnings.warn(f"{e}; compiling for the host CPU", RuntimeWarning, stacklevel=2)
        return None
    if tier is not None:
        config.CPU_NAME, config.CPU_FEATURES = tier, ""
    return tier


def simd_path() -> str | None:
    """The simd path of the tier Numba compiles for; None when it compiles for the host."""
    for tier, (_, path) in TIERS.items():
        if config.CPU_NAME == tier and not config.CPU_FEATURES:
            return path
    return None
