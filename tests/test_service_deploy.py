"""The Docker deployment files agree with the code: paths, settings, health checks, drain time."""

from pathlib import Path

import pytest

import re
import tomllib

from whistle_stream import cli, models
from whistle_stream.kernels import _target
from whistle_stream.service.config import ServiceConfig, env_name

DOCKER = Path(__file__).resolve().parent.parent / "docker"
ROOT = DOCKER.parent


# Every setting a deployment may set: the service's, and the engine's model and JIT target.
KNOWN = ({env_name(name) for name in ServiceConfig.__dataclass_fields__}
         | {models.ENV_MODEL, _target.ENV, "NUMBA_CACHE_DIR"})


def test_the_dockerfile_copies_existing_paths_and_checks_readiness():
    text = (DOCKER / "Dockerfile").read_text()
    copies = [line.split()[1] for line in text.splitlines() if line.startswith("COPY ") and "--from=" not in line]
    assert copies and all((ROOT / p).exists() for p in copies)
    assert "/readyz" in text and 'CMD ["whistle-stream", "serve"]' in text and "STOPSIGNAL SIGTERM" in text
    env = dict(re.findall(r"^\s+(\w+)=(\S+?)\s*\\?$", text.split("ENV ", 1)[1].split("\n\n")[0], re.M))
    assert {n for n in env if n.startswith(("WHISTLE_", "NUMBA_"))} <= KNOWN and env[_target.ENV] == "portable"


def test_the_commands_the_image_runs_exist():
    """The console script the image runs is the package's, and its warm and serve commands parse."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["whistle-stream"] == "whistle_stream.cli:main"
    text = (DOCKER / "Dockerfile").read_text()
    (warm,) = re.findall(r"whistle-stream (warm[^;\n]*)", text)
    args = cli.build_parser().parse_args(warm.split())
    assert args.command == "warm" and args.all_tiers
    import argparse

    from whistle_stream.service.config import add_serve_arguments, config_from_args
    serve = add_serve_arguments(argparse.ArgumentParser()).parse_args([])
    assert config_from_args(serve, environ={}).port == int(re.search(r"WHISTLE_PORT=(\d+)", text).group(1))


def test_compose_sets_only_real_settings_and_outlives_the_drain():
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    service = compose["services"]["whistle"]
    assert set(service["environment"]) <= KNOWN
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace > int(service["environment"]["WHISTLE_DRAIN_TIMEOUT"])
    assert "replicas" in service["deploy"]
    assert "./haproxy.cfg" in compose["services"]["lb"]["volumes"][0]


def test_the_load_balancer_routes_by_readiness_and_keeps_websockets_open():
    cfg = (DOCKER / "haproxy.cfg").read_text()
    assert "option httpchk GET /readyz" in cfg and "balance leastconn" in cfg
    assert "timeout tunnel" in cfg and "server-template whistle" in cfg


def test_compose_mounts_the_full_model_and_the_certificate_where_its_settings_point():
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    whistle, lb = compose["services"]["whistle"], compose["services"]["lb"]
    (models_mount,) = [v for v in whistle["volumes"] if v.endswith(":/models:ro")]
    assert (DOCKER / models_mount.split(":")[0]).is_dir()
    assert "/models/whistle.cact" in (DOCKER / "compose.yaml").read_text()   # the documented WHISTLE_MODEL
    (certs,) = [v for v in lb["volumes"] if v.endswith(":/certs:ro")]
    assert (DOCKER / certs.split(":")[0]).is_dir()
    assert set(lb["environment"]) == {"WHISTLE_TLS_CERT"}
    assert '"$WHISTLE_TLS_CERT"' in (DOCKER / "haproxy.cfg").read_text()
    assert any(p.endswith(":8443") for p in lb["ports"])


def test_the_default_compose_stack_keeps_wyoming_closed_and_the_overlay_opens_it_to_a_list():
    """Wyoming has no authentication: the default stack neither turns it on nor publishes 10300;
    compose.wyoming.yaml does both, and the balancer's list is one the user must give."""
    yaml = pytest.importorskip("yaml")
    base = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    ports = [str(p) for s in base["services"].values() for p in s.get("ports", []) + s.get("expose", [])]
    assert not any("10300" in p for p in ports), ports
    assert not any("WYOMING" in k for s in base["services"].values() for k in s.get("environment", {}))
    overlay = yaml.safe_load((DOCKER / "compose.wyoming.yaml").read_text())
    whistle, lb = overlay["services"]["whistle"], overlay["services"]["lb"]
    assert set(whistle["environment"]) <= KNOWN and whistle["environment"]["WHISTLE_WYOMING_PORT"] == "10300"
    # the replicas' list parses, and it is what lets a token stack on 0.0.0.0 start
    allow = whistle["environment"]["WHISTLE_WYOMING_ALLOW"]
    from whistle_stream.service.config import config_from_args
    config = config_from_args(None, environ={"WHISTLE_HOST": "0.0.0.0", "WHISTLE_TOKEN": "t",
                                             "WHISTLE_WYOMING_PORT": "10300", "WHISTLE_WYOMING_ALLOW": allow})
    assert "192.168.0.0/16" in config.wyoming_allow
    assert lb["environment"]["WHISTLE_WYOMING_ALLOW"].startswith("${WHISTLE_WYOMING_ALLOW:?")   # no default: required
    assert any(str(p).endswith(":10300") for p in lb["ports"])
    assert '"${WHISTLE_WYOMING_ALLOW[*]}"' in (DOCKER / "haproxy.cfg").read_text()
