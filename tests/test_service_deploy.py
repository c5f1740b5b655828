"""The Docker deployment files agree with the code: paths, settings, health checks, drain time."""

from pathlib import Path

import pytest

from whistle_stream.service.config import ServiceConfig, env_name

DOCKER = Path(__file__).resolve().parent.parent / "docker"
ROOT = DOCKER.parent


def test_the_dockerfile_copies_existing_paths_and_checks_readiness():
    text = (DOCKER / "Dockerfile").read_text()
    copies = [line.split()[1] for line in text.splitlines() if line.startswith("COPY ")]
    assert copies and all((ROOT / p).exists() for p in copies)
    assert "/readyz" in text and 'CMD ["whistle-stream", "serve"]' in text and "STOPSIGNAL SIGTERM" in text


def test_compose_sets_only_real_settings_and_outlives_the_drain():
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    service = compose["services"]["whistle"]
    known = {env_name(name) for name in ServiceConfig.__dataclass_fields__}
    assert set(service["environment"]) <= known
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace > int(service["environment"]["WHISTLE_DRAIN_TIMEOUT"])
    assert "replicas" in service["deploy"]
    assert "./haproxy.cfg" in compose["services"]["lb"]["volumes"][0]


def test_the_load_balancer_routes_by_readiness_and_keeps_websockets_open():
    cfg = (DOCKER / "haproxy.cfg").read_text()
    assert "option httpchk GET /readyz" in cfg and "balance leastconn" in cfg
    assert "timeout tunnel" in cfg and "server-template whistle" in cfg
