"""The layers hold: import-linter's contracts, the engine without the service's packages, and the
installed package's import names."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from harness.blocked import ROOT, run_without

sys.path.insert(0, str(ROOT / "tools"))
import check_layers  # noqa: E402

SERVICE_PACKAGES = ["websockets", "webrtcvad", "sounddevice", "prometheus_client", "uvloop"]


def _engine_modules_in_contract() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (engine,) = [c for c in config["contracts"] if c["name"].startswith("The engine imports")]
    return set(engine["source_modules"])


def test_the_contracts_are_kept():
    with_tmp = check_layers.main([])
    assert with_tmp == 0


def test_an_upward_import_breaks_a_contract(tmp_path):
    staged = check_layers.stage(tmp_path / "tree")
    assert check_layers.lint(staged).returncode == 0
    model = staged / "whistle_stream" / "whistle.py"
    model.write_text(model.read_text() + "\nfrom .service import server  # an engine module reaching up\n")
    done = check_layers.lint(staged)
    assert done.returncode != 0
    assert "The engine imports no layer above it" in done.stdout and "BROKEN" in done.stdout


def test_a_client_importing_the_transport_breaks_a_contract(tmp_path):
    staged = check_layers.stage(tmp_path / "tree")
    listen = staged / "whistle_stream" / "clients" / "listen.py"
    listen.write_text(listen.read_text() + "\nfrom whistle_stream.service.server import App\n")
    done = check_layers.lint(staged)
    assert done.returncode != 0 and "never the server's transport BROKEN" in done.stdout


def test_the_engine_contract_names_every_engine_module():
    upper = {"cli", "service", "clients"}
    found = {f"whistle_stream.{p.stem}" for p in (ROOT / "whistle_stream").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__" or (p / "__init__.py").exists())
             and p.stem not in upper}
    assert found == _engine_modules_in_contract()


def test_the_engine_transcribes_without_the_service_packages():
    done = run_without(SERVICE_PACKAGES, """
        import numpy as np
        from whistle_stream import Whistle
        model = Whistle()
        t = np.arange(32000) / 16000
        result = model.transcribe((0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32))
        assert isinstance(result["text"], str)
        stream = model.open_stream()
        stream.feed(np.zeros(16000, np.float32))
        stream.finish()
        import sys
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED
                        or m.startswith(("whistle_stream.service", "whistle_stream.clients")))
        assert not leaked, leaked
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.slow
def test_a_fresh_install_has_no_top_level_service_or_clients(tmp_path):
    """`pip install .` into a new venv (using this venv's packages for the dependencies): the
    service and clients import under whistle_stream only, and both console scripts run."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = env_dir / "bin" / "python"
    sites = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (next((env_dir / "lib").glob("python*")) / "site-packages" / "deps.pth").write_text("\n".join(sites) + "\n")
    quiet = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                           str(ROOT)], capture_output=True, text=True, env=quiet, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = """
import importlib, json, whistle_stream
out = {}
for name in ("service", "clients", "whistle_stream.service.server", "whistle_stream.clients.listen"):
    try:
        module = importlib.import_module(name)
        out[name] = module.__file__
    except ModuleNotFoundError:
        out[name] = None
print(json.dumps(out))
"""
    # Run outside the repository, so the checkout's folders are not on the path.
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    found = __import__("json").loads(done.stdout)
    assert found["service"] is None and found["clients"] is None
    assert "site-packages" in found["whistle_stream.service.server"]
    web = Path(found["whistle_stream.clients.listen"]).parent / "web" / "index.html"
    assert web.is_file()
    for script in ("whistle-stream", "whistle-listen"):
        run = subprocess.run([str(env_dir / "bin" / script), "--help"], capture_output=True, text=True,
                             cwd=tmp_path)
        assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]


def test_a_stream_importing_the_model_module_breaks_a_contract(tmp_path):
    """The stream reads its model through `streaming.StreamModel`; importing `whistle` back (even
    for type checking) would make the two modules a circle."""
    staged = check_layers.stage(tmp_path / "tree")
    stream = staged / "whistle_stream" / "streaming.py"
    stream.write_text(stream.read_text() + "\nfrom .whistle import Whistle  # the model, imported back\n")
    done = check_layers.lint(staged)
    assert done.returncode != 0 and "whistle_stream.streaming -> whistle_stream.whistle" in done.stdout
