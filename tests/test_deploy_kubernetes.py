"""The Kubernetes manifests: `kubectl kustomize` builds the example overlay, every object validates
against the schemas of a current Kubernetes release (kubernetes-validate, strict), and the
settings agree with the service's own (drain timeout, probes, WHISTLE_* names, the image's user)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from whistle_stream.service.config import ServiceConfig, env_name

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES_VERSION = "1.33.0"
kubernetes_validate = pytest.importorskip("kubernetes_validate")


OVERLAYS = sorted(p.name for p in (ROOT / "deploy/kubernetes/overlays").iterdir())


def build(overlay: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (.ci/run installs it)")
    built = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy/kubernetes/overlays" / overlay)],
                           capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(built) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request) -> list[dict]:
    return build(request.param)


def by_kind(objects, kind):
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def test_every_object_validates_against_the_kubernetes_schemas(objects):
    kinds = sorted(set(o["kind"] for o in objects) - {"PersistentVolumeClaim", "NetworkPolicy"})
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Ingress", "Namespace",
                     "PodDisruptionBudget", "Secret", "Service"]
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_is_caught(objects):
    bad = by_kind(objects, "Deployment")
    bad = {**bad, "spec": {**bad["spec"], "replicas": "three"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_the_deployment_drains_before_it_is_killed_and_runs_locked_down(objects):
    config = by_kind(objects, "ConfigMap")["data"]
    known = {env_name(f) for f in ServiceConfig.__dataclass_fields__}
    assert set(config) <= known
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    drain = float(config["WHISTLE_DRAIN_TIMEOUT"])
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > drain + pre_stop
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    env = {e["name"]: e for e in container["env"]}
    assert env["WHISTLE_RESUME_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "whistle-stream"
    assert env["WHISTLE_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] in by_kind(objects, "Secret")["data"]
    # the image's user and numba cache are the ones the pod expects
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert f"--uid {pod['securityContext']['runAsUser']}" in dockerfile
    assert f"NUMBA_CACHE_DIR={env['NUMBA_CACHE_DIR']['value']}" in dockerfile
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(env["NUMBA_CACHE_DIR"]["value"].startswith(m) for m in mounts)


def test_the_ingress_keeps_websockets_open_longer_than_a_session(objects):
    annotations = by_kind(objects, "Ingress")["metadata"]["annotations"]
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600
    size = annotations["nginx.ingress.kubernetes.io/proxy-body-size"]
    assert int(re.match(r"(\d+)m", size).group(1)) << 20 >= ServiceConfig().max_upload_bytes


def test_the_pod_starts_with_the_images_compiled_kernels(objects):
    """The cache volume hides the image's kernels at NUMBA_CACHE_DIR: an init container of the same
    image copies them from that path into the volume the server mounts there."""
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    (init,) = pod["initContainers"]
    cache = {e["name"]: e for e in server["env"]}["NUMBA_CACHE_DIR"]["value"]
    assert init["image"] == server["image"]
    volume = next(m for m in server["volumeMounts"] if cache.startswith(m["mountPath"] + "/"))
    seed = next(m for m in init["volumeMounts"] if m["name"] == volume["name"])
    copy = init["command"][-1]
    inside = cache[len(volume["mountPath"]):]                       # /numba
    assert f"cp -a {cache}/. {seed['mountPath']}{inside}/" in copy   # the image's cache: test_service_deploy


def test_the_full_model_overlay_reads_the_model_from_a_read_only_volume():
    objects = build("full-model")
    config = by_kind(objects, "ConfigMap")["data"]
    model = Path(config["WHISTLE_MODEL"])
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    mount = next(m for m in server["volumeMounts"] if m["mountPath"] == str(model.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    claim = by_kind(objects, "PersistentVolumeClaim")
    assert mount["readOnly"] and volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert int(config["WHISTLE_MAX_SESSIONS"]) < int(by_kind(build("example"), "ConfigMap")["data"]["WHISTLE_MAX_SESSIONS"])


def _wyoming_ports(objects) -> list:
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    return ([p for c in pod["containers"] for p in c.get("ports", []) if p["containerPort"] == 10300]
            + [p for p in by_kind(objects, "Service")["spec"]["ports"] if p["port"] == 10300])


def test_wyoming_is_closed_unless_the_home_assistant_overlay_opens_it_behind_a_policy():
    """The Wyoming protocol has no authentication: the base neither turns it on nor exposes it;
    the home-assistant overlay does, with a NetworkPolicy that admits 10300 only from a labelled
    namespace or a CIDR (8000 from anywhere), and settings a token server starts with."""
    from whistle_stream.service.config import config_from_args

    for overlay in ("example", "full-model"):
        objects = build(overlay)
        assert "WHISTLE_WYOMING_PORT" not in by_kind(objects, "ConfigMap")["data"]
        assert not _wyoming_ports(objects) and not [o for o in objects if o["kind"] == "NetworkPolicy"]
    objects = build("home-assistant")
    data = by_kind(objects, "ConfigMap")["data"]
    config = config_from_args(None, environ={**data, "WHISTLE_TOKEN": "t"})
    assert config.wyoming_port == 10300 and config.host == "0.0.0.0" and config.wyoming_allow
    assert len(_wyoming_ports(objects)) == 2
    policy = by_kind(objects, "NetworkPolicy")
    pod_labels = by_kind(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
    assert rules["http"] is None                                  # the WebSocket port: from anywhere
    sources = rules["wyoming"]
    assert {"namespaceSelector": {"matchLabels": {"whistle-stream/wyoming": "allowed"}}} in sources
    assert any("ipBlock" in s for s in sources) and len(sources) == 2
