"""Keep Numba's on-disk cache of this package's kernels consistent with their sources.

Numba keys a cached kernel by its own source file only: a kernel that inlines a helper from a
sibling file (`_exp_neg`, the `simd` intrinsics) would load stale machine code after the helper
changed. Every kernel lives in this package, so one stamp over all of its sources guards them
all: when any source differs from the stamp, every cached kernel of the package is dropped.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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
