"""Check the import-linter contracts in pyproject.toml against the package as it installs.

The service and the clients keep their own folders in the repository and install as
`whistle_stream.service` and `whistle_stream.clients` (pyproject's `package-dir`). import-linter
reads a package from one folder, so this stages the installed layout in a temporary folder
(the `package-dir` mapping, nothing else) and runs `lint-imports` there.

    python tools/check_layers.py            # exit 0: every contract kept
    python tools/check_layers.py --stage D  # stage into D and keep it (for a look, or a test)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """Installed package name -> its folder in the repository, for every top-level folder."""
    config = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    mapping = config.get("package-dir", {})
    out = {}
    for name in config["packages"]:
        if name in mapping:
            out[name] = ROOT / mapping[name]
        elif "." not in name:
            out[name] = ROOT / name
    return out


def stage(target: Path) -> Path:
    """Copy the packages into `target` in their installed layout; returns `target`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc", "*.cact", "*.json")
    for name, folder in sorted(package_dirs().items(), key=lambda kv: kv[0].count(".")):
        shutil.copytree(folder, target.joinpath(*name.split(".")), ignore=ignore, dirs_exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", target / "pyproject.toml")
    return target


def lint(staged: Path) -> subprocess.CompletedProcess:
    """Run lint-imports on a staged tree, with only that tree importable as whistle_stream."""
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), str(staged / "pyproject.toml"), "--no-cache"],
                          cwd=staged, env={"PYTHONPATH": str(staged), "PATH": ""},
                          capture_output=True, text=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=Path, help="stage into this folder and keep it")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        staged = stage(args.stage or Path(tmp))
        done = lint(staged)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
