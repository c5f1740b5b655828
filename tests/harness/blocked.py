"""Run Python in a fresh process where some packages cannot be imported, as if not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

_PRELUDE = '''
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
'''


def run_without(blocked: list[str], code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `code` with the top-level packages `blocked` unimportable; returns the finished process."""
    source = f"BLOCKED = {set(blocked)!r}\n" + _PRELUDE + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
