"""whistle_stream.allocator: freed memory goes back to the system after many threads used it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from whistle_stream import allocator

pytestmark = pytest.mark.skipif(allocator._libc is None, reason="not glibc")

# Four threads each allocate 32 MB in 64 KB blocks (under glibc's mmap threshold, so from the
# arenas), wait until all four hold theirs (else a thread that runs late reuses what an earlier
# one freed, and less is freed to measure), then free all but every 64th block: the heaps are now mostly free pages pinned in
# place by the survivors, the shape a server's heap takes as sessions come and go.
SCRIPT = textwrap.dedent("""
    import sys, threading
    import psutil
    from whistle_stream import allocator
    if sys.argv[1] == "limit":
        allocator.limit_arenas()
    kept, all_hold = [], threading.Barrier(4)
    def work():
        blocks = [bytearray(64 * 1024) for _ in range(512)]
        all_hold.wait()
        kept.extend(blocks[::64])
    threads = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    rss = lambda: psutil.Process().memory_info().rss / 1e6
    before = rss()
    allocator.release(force=True)
    print(before, rss())
""")


def run(mode: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    before, after = map(float, out.stdout.split())
    return before, after


def test_release_hands_the_freed_pages_of_every_arena_back():
    before, after = run("plain")
    assert before - after > 80, (before, after)   # of the ~126 MB freed, most leaves the process


def test_limited_arenas_still_release():
    before, after = run("limit")
    assert before - after > 80, (before, after)


def test_release_is_throttled_unless_forced():
    allocator.release(force=True)
    assert allocator.release() is False
    assert allocator.release(force=True) is True
