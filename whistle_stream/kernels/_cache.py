"""Keep Numba's on-disk cache of this package's kernels consistent with their sources.

Numba keys a cached kernel by its own source file only: a kernel that inlines a helper from a
sibling file (`_exp_neg`, the `simd` intrinsics) would load stale machine code after the helper
changed. Every kernel lives in this package, so one stamp over all of its sources guards them
all: when any source differs from the stamp, every cached kernel of the package is dropped.

A kernel loaded from the cache keeps the IR it would lend to a later compile as bitcode, not
parsed (`link_on_demand`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import llvmlite.binding as llvm_binding
from numba.core.caching import FunctionCache
from numba.core.dispatcher import Dispatcher

STAMP = "sources.sha256"
CACHE_SUFFIXES = (".nbi", ".nbc")


def sources_digest(package_dir: Path) -> str:
    """SHA-256 over the package's .py files, names and contents, in name order."""
    h = hashlib.sha256()
    for path in sorted(package_dir.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_dirs(package_dir: Path) -> list[Path]:
    """Where Numba writes this package's cache: __pycache__ beside the sources, and, when
    NUMBA_CACHE_DIR is set, the folder Numba names there after the source folder
    (`numba.core.caching._CacheLocator.get_suitable_cache_subpath`: its name, "_", the SHA-1
    of its absolute path)."""
    dirs = [package_dir / "__pycache__"]
    root = os.environ.get("NUMBA_CACHE_DIR")
    if root:
        folder = os.path.abspath(package_dir)
        digest = hashlib.sha1(folder.encode()).hexdigest()
        dirs.append(Path(root) / f"{os.path.basename(folder)}_{digest}")
    return dirs


def drop_stale(package_dir: Path) -> int:
    """Delete the package's cached kernels if its sources changed since they were cached; returns
    how many files went. A cache folder that cannot be written is left alone (Numba then
    compiles without it)."""
    digest = sources_digest(package_dir)
    dropped = 0
    for folder in cache_dirs(package_dir):
        stamp = folder / STAMP
        try:
            if stamp.read_text().strip() == digest:
                continue
        except OSError:
            pass
        try:
            # a folder Numba has not made yet gets its stamp now: else the first process's cache
            # would find no stamp in the next process and be dropped
            folder.mkdir(parents=True, exist_ok=True)
            for path in folder.iterdir():
                if path.suffix in CACHE_SUFFIXES:
                    path.unlink()
                    dropped += 1
            stamp.write_text(digest + "\n")
        except OSError:
            continue
    return dropped


class _LinkOnDemandCache(FunctionCache):
    """Numba's cache of one kernel, except that a loaded kernel keeps its LLVM IR as bitcode.

    A kernel loaded from the cache holds, besides its machine code, the LLVM IR of itself and of
    every helper it inlined, parsed, in case a kernel compiled later links it in. A process that
    loads every kernel from the cache never links one, and that parsed IR is about ten times its
    bitcode: 30 MB of an engine process's anonymous memory on the bundled model. This cache keeps
    the bitcode instead and parses it again only when a new kernel links this one.
    """

    def load_overload(self, sig, target_context):
        cres = super().load_overload(sig, target_context)
        if cres is not None:
            _park_linking_ir(cres.library)
        return cres


def _park_linking_ir(library) -> None:
    """Replace a loaded library's parsed linking module by its bitcode, parsed again on demand
    (Numba's CPUCodeLibrary: `_shared_module`, returned by `_get_module_for_linking`). A Numba
    without those attributes is left alone."""
    module = getattr(library, "_shared_module", None)
    if module is None or not hasattr(library, "_get_module_for_linking"):
        return
    bitcode = module.as_bitcode()

    def module_for_linking():
        del library._get_module_for_linking          # Numba's own method from now on
        library._shared_module = llvm_binding.parse_bitcode(bitcode)
        return library._shared_module

    library._shared_module = None
    library._get_module_for_linking = module_for_linking


def link_on_demand(namespace: dict) -> int:
    """Give every cached kernel in a module's namespace the cache above, before any of them
    loads; returns how many it changed."""
    kernels = [v for v in namespace.values() if isinstance(v, Dispatcher) and type(v._cache) is FunctionCache]
    for kernel in kernels:
        kernel._cache = _LinkOnDemandCache(kernel.py_func)
    return len(kernels)


def compiled_here() -> int:
    """How many kernel signatures of this package this process compiled rather than loaded from
    the cache (Numba's per-dispatcher cache misses): 0 after a start that found every kernel
    cached."""
    prefix = __name__.rpartition(".")[0]
    kernels = {id(v): v for name, module in list(sys.modules.items())
               if name == prefix or name.startswith(prefix + ".")
               for v in vars(module).values() if isinstance(v, Dispatcher)}
    return sum(sum(k.stats.cache_misses.values()) for k in kernels.values())
