"""Model resolution order and the verified, atomic download (against a fake Hugging Face hub)."""

import hashlib
import os
from pathlib import Path

import pytest

from whistle_stream import models
from whistle_stream.errors import DownloadError, ModelNotFoundError, WhistleError


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A clean environment: cache in tmp, no WHISTLE_MODEL, no bundled demo model."""
    monkeypatch.delenv(models.ENV_MODEL, raising=False)
    monkeypatch.setenv(models.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(models, "demo_model_path", lambda: None)
    return tmp_path


def touch(path: Path, size: int = 10) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    return path


@pytest.fixture
def published(monkeypatch):
    """Pretend the published model is a small payload of our own (so no 17 MB fixture)."""
    payload = os.urandom(4096)
    monkeypatch.setattr(models, "MODEL_SIZE", len(payload))
    monkeypatch.setattr(models, "MODEL_SHA256", hashlib.sha256(payload).hexdigest())
    return payload


class FakeHub:
    """Stands in for huggingface_hub.hf_hub_download: writes `payload` where the hub would."""

    def __init__(self, payload: bytes | None = None, error: Exception | None = None, into_local_dir=True):
        self.payload, self.error, self.into_local_dir = payload, error, into_local_dir
        self.calls = []
        self.outside = None

    def __call__(self, *, repo_id, filename, local_dir):
        self.calls.append((repo_id, filename))
        if self.error is not None:
            raise self.error
        if self.into_local_dir:
            path = Path(local_dir) / filename
        else:  # like the default hub cache: a file that is not ours to delete
            path = self.outside
        path.write_bytes(self.payload)
        return str(path)


# ---------------------------------------------------------------------------------------------
# resolution

def test_cache_dir_follows_whistle_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("WHISTLE_CACHE", str(tmp_path / "w"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "w"
    monkeypatch.delenv("WHISTLE_CACHE")
    assert models.cache_dir() == tmp_path / "x" / "whistle-stream"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "whistle-stream"


def test_explicit_path_beats_env_cache_and_demo(env, monkeypatch, published):
    explicit, from_env = touch(env / "a.cact"), touch(env / "b.cact")
    touch(models.cached_model_path(), models.MODEL_SIZE)
    monkeypatch.setenv(models.ENV_MODEL, str(from_env))
    monkeypatch.setattr(models, "demo_model_path", lambda: touch(env / "demo.cact"))
    assert models.resolve_model(explicit) == models.ResolvedModel(explicit, "explicit")
    assert models.resolve_model(str(explicit)).kind == "explicit"


def test_env_beats_cache_and_demo(env, monkeypatch, published):
    from_env = touch(env / "b.cact")
    touch(models.cached_model_path(), models.MODEL_SIZE)
    monkeypatch.setenv(models.ENV_MODEL, str(from_env))
    assert models.resolve_model() == models.ResolvedModel(from_env, "env")


def test_cache_beats_demo(env, monkeypatch, published):
    cached = touch(models.cached_model_path(), models.MODEL_SIZE)
    monkeypatch.setattr(models, "demo_model_path", lambda: touch(env / "demo.cact"))
    assert models.resolve_model() == models.ResolvedModel(cached, "cached")


def test_demo_is_the_last_resort(env, monkeypatch):
    demo = touch(env / "demo.cact")
    monkeypatch.setattr(models, "demo_model_path", lambda: demo)
    assert models.resolve_model() == models.ResolvedModel(demo, "demo")


def test_no_model_at_all_says_how_to_get_one(env):
    with pytest.raises(ModelNotFoundError) as info:
        models.resolve_model()
    message = str(info.value)
    assert "whistle-stream download" in message
    assert models.MODEL_URL in message
    assert str(models.cached_model_path()) in message
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, WhistleError)


def test_missing_explicit_or_env_path_is_named(env, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="nowhere.cact does not exist"):
        models.resolve_model(env / "nowhere.cact")
    monkeypatch.setenv(models.ENV_MODEL, str(env / "gone.cact"))
    with pytest.raises(ModelNotFoundError, match=r"\$WHISTLE_MODEL .*gone.cact does not exist"):
        models.resolve_model()
    with pytest.raises(ModelNotFoundError, match="is not a file"):
        models.resolve_model(env)


def test_truncated_cached_model_is_not_silently_used(env, published):
    touch(models.cached_model_path(), models.MODEL_SIZE - 1)
    with pytest.raises(ModelNotFoundError, match="download --force"):
        models.resolve_model()


def test_bundled_demo_path_points_into_the_package():
    demo = models.demo_model_path()
    if demo is None:
        assert not (Path(models.__file__).parent / "models" / models.DEMO_FILENAME).exists()
    else:
        assert demo == Path(models.__file__).parent / "models" / models.DEMO_FILENAME


# ---------------------------------------------------------------------------------------------
# download

def test_download_caches_a_verified_file(env, published):
    hub = FakeHub(published)
    path = models.download(downloader=hub)
    assert path == models.cached_model_path()
    assert path.read_bytes() == published
    assert hub.calls == [(models.HF_REPO, models.MODEL_FILENAME)]
    assert sorted(p.name for p in path.parent.iterdir()) == [models.MODEL_FILENAME]  # no temp files left


def test_download_keeps_a_verified_cached_copy_unless_forced(env, published):
    models.download(downloader=FakeHub(published))
    hub = FakeHub(published)
    models.download(downloader=hub)
    assert hub.calls == []
    models.download(force=True, downloader=hub)
    assert len(hub.calls) == 1


def test_download_replaces_a_corrupt_cached_copy(env, published):
    touch(models.cached_model_path(), len(published))
    path = models.download(downloader=FakeHub(published))
    assert path.read_bytes() == published


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p[:-1], "bytes, expected"),
    (lambda p: p + b"x", "bytes, expected"),
    (lambda p: bytes([p[0] ^ 1]) + p[1:], "SHA-256"),
])
def test_download_refuses_and_deletes_a_bad_file(env, published, mutate, message):
    with pytest.raises(DownloadError, match=message):
        models.download(downloader=FakeHub(mutate(published)))
    cache = models.cache_dir()
    assert not models.cached_model_path().exists()
    assert list(cache.iterdir()) == []  # neither the staging copy nor a temp file survives


def test_a_bad_download_never_replaces_a_good_cached_model(env, published):
    models.download(downloader=FakeHub(published))
    with pytest.raises(DownloadError):
        models.download(force=True, downloader=FakeHub(published[:-1] + bytes([published[-1] ^ 1])))
    assert models.cached_model_path().read_bytes() == published


def test_download_does_not_delete_files_outside_its_staging_dir(env, published):
    hub = FakeHub(published[::-1], into_local_dir=False)
    hub.outside = env / "hub-cache-file"
    with pytest.raises(DownloadError, match="SHA-256"):
        models.download(downloader=hub)
    assert hub.outside.exists()


def test_offline_download_explains_how_to_place_the_file_by_hand(env, published):
    with pytest.raises(DownloadError) as info:
        models.download(downloader=FakeHub(error=ConnectionError("Name or service not known")))
    message = str(info.value)
    assert models.MODEL_URL in message
    assert str(models.cached_model_path()) in message
    assert "Name or service not known" in message
    assert isinstance(info.value.__cause__, ConnectionError)


def test_real_downloader_offline_fails_with_a_download_error(env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DownloadError, match="copy it to"):
        models.download(progress=False)


def test_published_constants_match_the_issue():
    assert models.MODEL_SIZE == 16_919_407
    assert models.MODEL_SHA256 == "b6e02f048568ac5d01a2042556c658061e699acbc0aa2a1439f52f3d461dffeb"
    assert models.MODEL_URL == "https://huggingface.co/Cactus-Compute/whistle/resolve/main/whistle.cact"
