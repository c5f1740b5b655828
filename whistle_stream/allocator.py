"""glibc's allocator, kept from hoarding what a long-running process frees.

A service runs for days while sessions come and go. glibc gives each thread that allocates its own
arena (up to eight per core) and returns freed memory to the system only from the top of a heap,
so audio buffers and pass scratch freed by many threads stay resident: RSS creeps although the
Python heap is flat (benchmarks/soak.py measures it). Two calls keep it flat:

- `limit_arenas()`, once at a process's start, before its threads allocate: two arenas.
- `release()`, after a session (or stream) ends: `malloc_trim(0)` hands every arena's free pages
  back. At most once per `RELEASE_EVERY_S`, since a trim walks the heaps.

Elsewhere (musl, macOS) both do nothing.
"""

from __future__ import annotations

import ctypes
import threading
import time

ARENAS = 2
RELEASE_EVERY_S = 5.0
_M_ARENA_MAX = -8          # mallopt's parameter number in glibc's malloc.h

_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallopt.argtypes, _libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _libc.malloc_trim.argtypes, _libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
except (OSError, AttributeError):
    _libc = None

_lock = threading.Lock()
_last = float("-inf")


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At most `arenas` malloc arenas in this process; whether glibc took it."""
    return bool(_libc is not None and _libc.mallopt(_M_ARENA_MAX, arenas))


def release(force: bool = False) -> bool:
    """Return the allocator's free pages to the system (throttled unless `force`); whether it ran."""
    global _last
    if _libc is None:
        return False
    now = time.monotonic()
    with _lock:
        if not force and now - _last < RELEASE_EVERY_S:
            return False
        _last = now
    _libc.malloc_trim(0)
    return True
