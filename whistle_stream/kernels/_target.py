"""The CPU the kernels are compiled for, and so the cache entries they load.

Numba keys every cached kernel by the CPU it was compiled for: LLVM's name of the host CPU and
its full feature list. A cache compiled on one CPU model (an image's build machine) misses on any
other (a cluster node of another generation), and the replica compiles for about a minute before
it is ready. `WHISTLE_JIT_TARGET` chooses instead:

- `host` (the default): the host CPU, as Numba does by itself.
- `portable`: the tier of the host below, picked from its machine and features, so a cache
  compiled on any CPU of a tier loads on every other CPU of it. The image compiles every tier's
  cache of its architecture.
- a tier's name (`x86-64-v4-vnni`, `x86-64-v3`, `armv8-a`, ...): that tier, to compile its cache.

A tier is a micro-architecture level of one machine (x86-64's psABI levels, AArch64's Armv8-A
baseline), named as LLVM names its CPU, with no extra features but the ones it lists, the `simd`
path its instructions allow and the integer products' path (`integer`) they allow.
"""

from __future__ import annotations

import os
import platform
import warnings
from dataclasses import dataclass

import llvmlite.binding as llvm_binding
from numba import config

ENV = "WHISTLE_JIT_TARGET"

_V3 = ("avx2", "fma", "bmi2", "f16c", "movbe")
_V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl") + _V3


@dataclass(frozen=True)
class Tier:
    """One CPU tier: what `WHISTLE_JIT_TARGET` names, what Numba compiles for, what the host needs."""

    name: str                 # the setting's value, and the name logs print
    machine: str              # `machine()` of the hosts it runs on
    cpu: str                  # LLVM's CPU name Numba compiles for (config.CPU_NAME)
    features: str             # LLVM features added to that CPU ("" for none; config.CPU_FEATURES)
    needs: tuple[str, ...]    # the host features (LLVM's names) a CPU of the tier has
    simd: str                 # `simd.PATH` its code takes
    integer: str | None       # `integer.PATH` its code takes (None: the float products)


# Highest first within each machine: a host gets the first tier of its machine whose needs it has.
TIERS = {t.name: t for t in (
    Tier("x86-64-v4-vnni", "x86_64", "x86-64-v4", "+avx512vnni", _V4 + ("avx512vnni",), "avx512", "vnni"),
    Tier("x86-64-v4", "x86_64", "x86-64-v4", "", _V4, "avx512", "avx2"),
    Tier("x86-64-v3", "x86_64", "x86-64-v3", "", _V3, "avx2", "avx2"),
    Tier("x86-64", "x86_64", "x86-64", "", (), "generic", None),
    # Armv8-A with NEON, which every AArch64 CPU has (LLVM's "generic" AArch64 CPU): Raspberry Pi
    # 4 and 5, Graviton, an ARM Mac's Linux VM. The kernels' portable vector IR lowers to NEON.
    Tier("armv8-a", "aarch64", "generic", "", (), "generic", None),
)}
_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def machine(name: str | None = None) -> str:
    """The host's machine as the tiers name it ("x86_64", "aarch64"), or platform's own name for
    one no tier covers."""
    raw = platform.machine() if name is None else name
    return _MACHINES.get(raw.lower(), raw)


def tiers_of(machine_name: str | None = None) -> list[Tier]:
    """The tiers of a machine (the host's by default), highest first; empty for another machine."""
    m = machine(machine_name)
    return [t for t in TIERS.values() if t.machine == m]


def host_tier(features: dict | None = None, machine_name: str | None = None) -> str | None:
    """The highest tier of the host's machine (or `machine_name`'s) whose features the host (or
    `features`, LLVM's {name: bool}) has; None on a machine no tier covers."""
    have = llvm_binding.get_host_cpu_features() if features is None else features
    return next((t.name for t in tiers_of(machine_name) if all(have.get(f) for f in t.needs)), None)


def chosen(value: str | None = None, machine_name: str | None = None) -> str | None:
    """The tier `WHISTLE_JIT_TARGET` (or value) asks for; None for the host CPU (also `portable`
    on a machine no tier covers). A tier of another machine is refused."""
    value = (os.environ.get(ENV, "") if value is None else value).strip()
    if value in ("", "host"):
        return None
    if value == "portable":
        return host_tier(machine_name=machine_name)
    if value in TIERS:
        here = machine(machine_name)
        if TIERS[value].machine != here:
            raise ValueError(f"{ENV}={value} is a tier of {TIERS[value].machine}, and this machine is "
                             f"{here}: its tiers are {', '.join(t.name for t in tiers_of(here)) or 'none'}")
        return value
    raise ValueError(f"{ENV} must be 'host', 'portable' or one of {', '.join(TIERS)}; got {value!r}")


def configure() -> str | None:
    """Point Numba at the chosen tier before any kernel compiles or loads; returns the tier. An
    unknown WHISTLE_JIT_TARGET is reported and the host CPU used (as for WHISTLE_SIMD)."""
    try:
        name = chosen()
    except ValueError as e:
        warnings.warn(f"{e}; compiling for the host CPU", RuntimeWarning, stacklevel=2)
        return None
    if name is not None:
        config.CPU_NAME, config.CPU_FEATURES = TIERS[name].cpu, TIERS[name].features
    return name


def compiled_tier() -> Tier | None:
    """The tier Numba compiles for (config.CPU_NAME and CPU_FEATURES, on this machine); None when it
    compiles for the host or for a CPU no tier names."""
    for t in tiers_of():
        if config.CPU_NAME == t.cpu and (config.CPU_FEATURES or "") == t.features:
            return t
    return None


def simd_path() -> str | None:
    """The simd path of the tier Numba compiles for; None when it compiles for the host."""
    t = compiled_tier()
    return None if t is None else t.simd
