"""Which model file to load, and fetching the full Whistle model into the local cache.

Resolution order (`resolve_model`): an explicit path > `$WHISTLE_MODEL` > the cached full model
(`<cache>/whistle.cact`, put there by `download`) > the demo model bundled with the package.
The cache directory is `$WHISTLE_CACHE`, else `$XDG_CACHE_HOME/whistle-stream`, else
`~/.cache/whistle-stream`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np

from . import frontend
from .container import CactFile
from .errors import DownloadError, ModelNotFoundError

# The published full model (Hugging Face `Cactus-Compute/whistle`); the only place these live.
HF_REPO = "Cactus-Compute/whistle"
MODEL_FILENAME = "whistle.cact"
MODEL_SIZE = 16_919_407  # bytes
MODEL_SHA256 = "b6e02f048568ac5d01a2042556c658061e699acbc0aa2a1439f52f3d461dffeb"
MODEL_URL = f"https://huggingface.co/{HF_REPO}/resolve/main/{MODEL_FILENAME}"

DEMO_FILENAME = "demo.cact"
# What a person is told wherever the demo model runs (the server's log, the captions page,
# whistle-listen): it answers speech outside its training with fluent sentences that were not said.
DEMO_NOTE = ("The bundled demo model hears only its own command vocabulary (numbers, times, timers, "
             "lights, calls, reminders) in synthetic voices; for real speech get Whistle: "
             "whistle-stream download")
DEMO_MANIFEST = "demo.json"

ENV_MODEL = "WHISTLE_MODEL"
ENV_CACHE = "WHISTLE_CACHE"

_CHUNK = 1 << 20  # bytes per read when hashing and copying

Kind = Literal["explicit", "env", "cached", "demo"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model file and how it was chosen: "explicit", "env", "cached" or "demo"."""
    path: Path
    kind: Kind


def cache_dir() -> Path:
    """Where `download` puts the full model (not created here)."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "whistle-stream"
    return Path.home() / ".cache" / "whistle-stream"


def cached_model_path() -> Path:
    return cache_dir() / MODEL_FILENAME


def demo_model_path() -> Path | None:
    """The bundled demo model's path, or None when this install carries none."""
    return _package_file(DEMO_FILENAME)


def demo_manifest_path() -> Path | None:
    """`models/demo.json` (the demo model's sha256 and training facts), or None."""
    return _package_file(DEMO_MANIFEST)


def _package_file(name: str) -> Path | None:
    entry = resources.files("whistle_stream").joinpath("models", name)
    # setuptools installs package data as plain files; a zipped install has no path to mmap
    return Path(str(entry)) if entry.is_file() and Path(str(entry)).is_file() else None


def _how_to_get_a_model() -> str:
    return (f"run `whistle-stream download` to fetch the full model into {cached_model_path()}, "
            f"or download {MODEL_URL} by hand and place it there, "
            f"or pass a model path (--model PATH or ${ENV_MODEL})")


def resolve_model(path: str | os.PathLike | None = None) -> ResolvedModel:
    """Pick the model file to load; raise `ModelNotFoundError` saying how to get one."""
    if path is not None:
        return ResolvedModel(_existing(Path(path).expanduser(), "model file"), "explicit")
    if os.environ.get(ENV_MODEL):
        return ResolvedModel(_existing(Path(os.environ[ENV_MODEL]).expanduser(), f"${ENV_MODEL}"), "env")
    cached = cached_model_path()
    if cached.is_file():
        size = cached.stat().st_size
        if size != MODEL_SIZE:
            raise ModelNotFoundError(
                f"the cached model {cached} is {size} bytes, not the {MODEL_SIZE} of {MODEL_FILENAME}; "
                f"run `whistle-stream download --force` to replace it")
        return ResolvedModel(cached, "cached")
    demo = demo_model_path()
    if demo is not None:
        return ResolvedModel(demo, "demo")
    raise ModelNotFoundError(f"no model found and this install bundles no demo model; {_how_to_get_a_model()}")


class ModelFile:
    """A resolved model file, opened: what every engine over it shares (its name, kind, dims,
    tokenizer and the front end's silence gate), without the encoder and decoder (no Numba here).
    `Whistle` runs the model in this process; `workers.ProcessEngine` serves it from others."""

    def __init__(self, path: str | os.PathLike | None = None):
        resolved = resolve_model(path)
        self.path = Path(resolved.path)
        self.kind = resolved.kind
        self.cact = CactFile(self.path)
        self.dims = self.cact.dims
        self.tokenizer = self.cact.tokenizer
        self.mel = np.ascontiguousarray(self.cact.mel)
        self.card = read_card(self.path)
        self.sentences_per_pass = card_sentences_per_pass(self.card, self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def languages(self) -> tuple[str, ...]:
        return self.dims.languages

    @property
    def note(self) -> str | None:
        """What a person should know about this model before speaking to it (the demo model's
        limits), or None."""
        return DEMO_NOTE if self.kind == "demo" else None

    def is_speech(self, pcm: np.ndarray) -> bool:
        """The engine's silence gate (§8) on float32 samples at the model rate."""
        return self._gate(frontend.sanitize(pcm))

    def _gate(self, pcm: np.ndarray) -> bool:
        """`is_speech` on samples already sanitised (`load_audio`'s): no second copy of them."""
        d = self.dims
        return frontend.is_speech(pcm, self.mel, d.rate, d.hop, d.win)


CARD_SENTENCES_PER_PASS = "sentences_per_pass"


def read_card(model: Path) -> dict:
    """The model's card: the JSON file beside it with its name (`demo.json` for `demo.cact`), or
    {} when there is none. Raises ModelNotFoundError for a card that is not a JSON object."""
    path = model.with_suffix(".json")
    if not path.is_file():
        return {}
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelNotFoundError(f"the model card {path} is not readable JSON ({e}); fix or remove it") from e
    if not isinstance(card, dict):
        raise ModelNotFoundError(f"the model card {path} is not a JSON object; fix or remove it")
    return card


def card_sentences_per_pass(card: dict, model: Path) -> int | None:
    """How many sentences the model reads well in one pass, as its card says (None: as many as a
    30 s window holds). A small model trained on single sentences reads one: the file reader then
    packs a pass's utterances up to a sentence end, not up to 30 s."""
    value = card.get(CARD_SENTENCES_PER_PASS)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelNotFoundError(f"the model card of {model}: {CARD_SENTENCES_PER_PASS} must be a whole "
                                 f"number of sentences, 1 or more (or absent), got {value!r}")
    return value


def _existing(path: Path, what: str) -> Path:
    if not path.exists():
        raise ModelNotFoundError(f"{what} {path} does not exist")
    if not path.is_file():
        raise ModelNotFoundError(f"{what} {path} is not a file (expected a .cact model file)")
    return path


def sha256_of(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_verified_model(path: str | os.PathLike) -> bool:
    """True when `path` is the published whistle.cact (size and SHA-256 both match)."""
    path = Path(path)
    return path.is_file() and path.stat().st_size == MODEL_SIZE and sha256_of(path) == MODEL_SHA256


Downloader = Callable[..., str]


def _hf_hub_download(*, progress: bool, **kwargs) -> str:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        return hf_hub_download(**kwargs)
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()


def download(force: bool = False, progress: bool = True, downloader: Downloader | None = None) -> Path:
    """Fetch whistle.cact from Hugging Face into the cache; return its path.

    The file must be exactly `MODEL_SIZE` bytes with SHA-256 `MODEL_SHA256`; anything else is deleted
    and refused. It lands under its final name by one `os.replace` from a temporary file in the same
    directory, so a reader never sees half a model. An already cached, verified file is kept unless
    `force`. `downloader` replaces `huggingface_hub.hf_hub_download` (tests); it takes the same keyword
    arguments (`repo_id`, `filename`, `local_dir`) and returns a local file path.
    Raises `DownloadError` (offline, unreachable, wrong size or hash) with how to place the file by hand.
    """
    target = cached_model_path()
    if not force and is_verified_model(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DownloadError(f"cannot create the model cache {target.parent}: {e}") from e

    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    try:
        try:
            if downloader is None:
                fetched = _hf_hub_download(progress=progress, repo_id=HF_REPO, filename=MODEL_FILENAME,
                                           local_dir=staging)
            else:
                fetched = downloader(repo_id=HF_REPO, filename=MODEL_FILENAME, local_dir=staging)
        except Exception as e:  # offline, DNS, HTTP, auth: all end the same way for the user
            raise DownloadError(
                f"could not download {MODEL_FILENAME} from {MODEL_URL} ({type(e).__name__}: {e}). "
                f"If this machine is offline, download that URL elsewhere and copy it to {target} "
                f"(it must be {MODEL_SIZE} bytes with SHA-256 {MODEL_SHA256})") from e
        _install_verified(Path(fetched), target, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _install_verified(fetched: Path, target: Path, staging: Path) -> None:
    """Copy `fetched` to a temp file beside `target`, hashing what is written; os.replace on a match."""
    size = fetched.stat().st_size
    if size != MODEL_SIZE:
        _discard(fetched, staging)
        raise DownloadError(f"downloaded {MODEL_FILENAME} is {size} bytes, expected {MODEL_SIZE}; refused and deleted")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{MODEL_FILENAME}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, open(fetched, "rb") as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != MODEL_SHA256:
            _discard(fetched, staging)
            raise DownloadError(
                f"downloaded {MODEL_FILENAME} has SHA-256 {digest.hexdigest()}, expected {MODEL_SHA256}; "
                f"refused and deleted")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _discard(fetched: Path, staging: Path) -> None:
    """Delete a bad download, but only when it is our own staging copy (never a caller's file)."""
    if staging.resolve() in fetched.resolve().parents:
        fetched.unlink(missing_ok=True)
