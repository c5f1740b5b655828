"""The `whistle-stream` command: info, download, transcribe, warm, serve.

    whistle-stream info [MODEL] [--json]
    whistle-stream download [--force] [--quiet]
    whistle-stream transcribe FILE [FILE ...] [--format txt|json|srt|vtt] [--output-dir DIR]
                              [--by utterances|windows] [--model PATH] [--language CODE]
                              [--keyword PHRASE ...] [--word-timestamps] [--beams N]
    whistle-stream warm [--model PATH] [--all-tiers]
    whistle-stream serve ...          (the WebSocket service; its own options)

Errors the engine raises on purpose (`WhistleError`) print one line to stderr and exit with
`ExitStatus.USAGE` (2, argparse's status for a bad argument), or `FAILED` (1) for a failed download
or warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any
from importlib import metadata
from pathlib import Path

from whistle_stream import models
from whistle_stream.errors import DownloadError, ExitStatus, WhistleError
from whistle_stream.frontend import FILE_FORMATS
from whistle_stream.rules import READ_BY

PROG = "whistle-stream"
FORMATS = ("txt", "json", "srt", "vtt")


def _version() -> str:
    try:
        return metadata.version("whistle-stream")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Live speech-to-text with Cactus Compute's Whistle model.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = commands.add_parser("info", help="describe a .cact model: dims, languages, records, sizes, SHA-256")
    info.add_argument("model", nargs="?", help="model file (default: the resolved model, see `transcribe --model`)")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    download = commands.add_parser("download", help=f"fetch the full {models.MODEL_FILENAME} from Hugging Face "
                                                    f"({models.HF_REPO}) into the cache")
    download.add_argument("--force", action="store_true", help="download again even if a verified copy is cached")
    download.add_argument("--quiet", action="store_true", help="no progress bar")

    transcribe = commands.add_parser("transcribe", help="transcribe audio files (text, JSON, SRT or WebVTT)")
    transcribe.add_argument("files", nargs="+", metavar="FILE",
                            help=f"audio files: {FILE_FORMATS}, any sample rate, mono or stereo")
    transcribe.add_argument("--format", choices=FORMATS, default="txt",
                            help="txt (default), json (the full result), srt or vtt (subtitles from word times)")
    transcribe.add_argument("--output-dir", metavar="DIR",
                            help="write FILE's transcript to DIR/<FILE's name>.<format> instead of printing it "
                                 "(needed for srt/vtt with several files)")
    transcribe.add_argument("--by", choices=READ_BY, default=READ_BY[0],
                            help="utterances (default): cut the audio at its pauses, as a stream does, and read "
                                 "each alone; windows: the engine's 30 s windows exactly (guide §8)")
    transcribe.add_argument("--model", help=f"model file (default: ${models.ENV_MODEL}, then the cached full "
                                            "model, then the bundled demo model)")
    transcribe.add_argument("--language", help="force a language code (default: detect)")
    transcribe.add_argument("--keyword", action="append", default=[], metavar="PHRASE",
                            help="bias decoding toward this phrase (repeatable)")
    transcribe.add_argument("--word-timestamps", action="store_true", help="print per-word start and end times (txt)")
    transcribe.add_argument("--beams", type=_positive_int, default=None, metavar="N",
                            help="beam width (default: the engine's, 5; 1 is greedy)")
    transcribe.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                            help="threads one pass splits its large products over (default: "
                                 "$WHISTLE_THREADS, else 1)")
    transcribe.add_argument("--json", action="store_true", help="the same as --format json")
    transcribe.add_argument("--no-progress", action="store_true",
                            help="no progress bar (it is shown only when stderr is a terminal)")

    warm = commands.add_parser("warm", help="compile the engine's kernels into the JIT cache (NUMBA_CACHE_DIR), "
                                            "so a process started later is ready in seconds")
    warm.add_argument("--model", help="model file (default: as `transcribe --model`)")
    warm.add_argument("--all-tiers", action="store_true",
                      help="compile for every CPU tier this machine can run (WHISTLE_JIT_TARGET=portable then "
                           "loads the cache on any CPU of those tiers: what an image ships)")

    commands.add_parser("serve", help="run the WebSocket service (`whistle-stream serve --help` for its options)",
                        add_help=False)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# info

def describe(path: str | Path | None) -> dict:
    """Everything `info` prints, as a JSON-ready dict."""
    from whistle_stream.container import CactFile

    resolved = models.resolve_model(path)
    sha = models.sha256_of(resolved.path)
    with CactFile(resolved.path) as cact:
        dims = dataclasses.asdict(cact.dims)
        records = len(cact.records)
        by_kind = dict(sorted(cact.bytes_by_kind().items()))
    return {
        "path": str(resolved.path),
        "resolved_as": resolved.kind,
        "identity": _identity(resolved, sha),
        "size": resolved.path.stat().st_size,
        "sha256": sha,
        "records": records,
        "languages": list(dims["languages"]),
        "bytes_by_dtype": by_kind,
        "dims": {k: list(v) if isinstance(v, tuple) else v for k, v in dims.items()},
    }


def _identity(resolved: models.ResolvedModel, sha: str) -> str:
    if sha == models.MODEL_SHA256:
        return f"full model (the published {models.MODEL_FILENAME})"
    manifest = models.demo_manifest_path()
    if manifest is not None:
        try:
            demo_sha = json.loads(manifest.read_text()).get("sha256")
        except (OSError, ValueError, AttributeError):
            demo_sha = None
        if sha == demo_sha:
            return "demo model (bundled)"
    if resolved.kind == "demo":
        return "demo model (bundled)"
    return "custom model"


def _print_info(info: dict) -> None:
    rows = [
        ("model", f"{info['path']}  [{info['identity']}; chosen as {info['resolved_as']}]"),
        ("size", f"{info['size']:,} bytes"),
        ("sha256", info["sha256"]),
        ("records", str(info["records"])),
        ("languages", ", ".join(info["languages"])),
        ("dtypes", ", ".join(f"{k} {v:,} B" for k, v in info["bytes_by_dtype"].items())),
    ]
    for key, value in rows:
        print(f"{key:<10} {value}")
    print("dims")
    for key, value in info["dims"].items():
        print(f"  {key:<18} {', '.join(map(str, value)) if isinstance(value, list) else value}")


# ---------------------------------------------------------------------------------------------
# transcribe

def _transcribe(args: argparse.Namespace) -> None:
    """Transcribe every file in turn; print or write each result in the chosen format."""
    from whistle_stream import Whistle
    from whistle_stream.errors import AudioError

    fmt = "json" if args.json else args.format
    files = [Path(f) for f in args.files]
    for audio in files:
        if not audio.is_file():
            raise AudioError(f"audio file {audio} does not exist")
    out_dir = Path(args.output_dir) if args.output_dir else None
    if out_dir is None and fmt in ("srt", "vtt") and len(files) > 1:
        raise _UsageError(f"{len(files)} files as {fmt} need --output-dir DIR (one subtitle file each)")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    if args.threads is not None:
        from whistle_stream.kernels import set_threads

        set_threads(args.threads)
    model = Whistle(models.resolve_model(args.model).path)
    options = {"language": args.language, "keywords": args.keyword or None, "by": args.by,
               "word_timestamps": args.word_timestamps or fmt in ("json", "srt", "vtt")}
    if args.beams is not None:
        options["beams"] = args.beams
    show_progress = not args.no_progress and sys.stderr.isatty()
    for audio in files:
        with _Progress(audio.name, show_progress) as progress:
            result = model.transcribe(str(audio), progress=progress, **options).to_dict()
        text = render(result, fmt, args.word_timestamps)
        if out_dir is not None:
            target = out_dir / f"{audio.stem}.{fmt}"
            target.write_text(text, encoding="utf-8")
            print(target)
        elif len(files) > 1 and fmt == "txt":
            print(f"==> {audio} <==\n{text}", end="")
        elif len(files) > 1 and fmt == "json":
            print(json.dumps({"file": str(audio), **result}, ensure_ascii=False))
        else:
            print(text, end="")


def render(result: dict, fmt: str, word_timestamps: bool = False) -> str:
    """A transcription result as the text of a txt, json, srt or vtt file."""
    from whistle_stream.subtitles import make_cues, srt, vtt

    if fmt == "json":
        return json.dumps(result, ensure_ascii=False, indent=1) + "\n"
    if fmt in ("srt", "vtt"):
        cues = make_cues(result.get("words") or [])
        return srt(cues) if fmt == "srt" else vtt(cues)
    lines = [result.get("text", "")]
    if word_timestamps:
        lines += [f"[{w['start']:7.2f} -> {w['end']:7.2f}] {w['word']}" for w in result.get("words") or []]
    return "\n".join(lines) + "\n"


class _Progress:
    """A tqdm bar over a file's audio seconds on stderr, or nothing."""

    def __init__(self, name: str, enabled: bool):
        self.name, self.enabled = name, enabled
        self.bar: Any = None   # a tqdm bar once the engine reports progress

    def __enter__(self):
        return self if self.enabled else None

    def __call__(self, done_s: float, total_s: float) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=round(total_s, 1), desc=self.name, unit="s", leave=False,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}]")
        self.bar.update(round(done_s, 1) - self.bar.n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


class _UsageError(WhistleError):
    """An option the engine refused, reported like any other error."""


class _Failed(WhistleError):
    """A step that failed at run time, not through what the user asked for."""


# ---------------------------------------------------------------------------------------------
# warm

def _warm(args: argparse.Namespace) -> None:
    """Compile the kernels for the CPU target WHISTLE_JIT_TARGET chooses; with --all-tiers, in one
    child process per tier the host can run (a tier above the host's cannot run its warm-up)."""
    import os
    import subprocess
    import time

    from whistle_stream.kernels import _target

    if not args.all_tiers:
        from whistle_stream import Whistle

        model = Whistle(args.model)
        done = model.warmup()
        print(f"warm: {model.kernel_path()} in {done.seconds:.1f} s ({done.compiled} kernels compiled, "
              "the rest loaded from the cache)")
        return
    tiers = [t.name for t in _target.tiers_of()]
    host = _target.host_tier()
    if host is None:
        raise _Failed(f"no CPU tier covers this machine ({_target.machine()}): "
                      "run `whistle-stream warm` for the host CPU instead")
    runnable = tiers[tiers.index(host):]
    for tier in tiers:
        if tier not in runnable:
            print(f"warm: {tier} skipped: this CPU cannot run it (build on a CPU of that tier to ship it)")
            continue
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "whistle_stream.cli", "warm"] + (["--model", args.model] if args.model else [])
        done = subprocess.run(cmd, env={**os.environ, _target.ENV: tier})
        if done.returncode:
            raise _Failed(f"warming the {tier} tier failed (exit status {done.returncode})")
        print(f"warm: {tier} done in {time.perf_counter() - t0:.1f} s (process and model load included)")


# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `whistle-stream` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        try:   # the service is an extra of the engine: load it only here
            from whistle_stream.clients import WEB_ROOT
            from whistle_stream.service import server
        except ModuleNotFoundError as e:
            print(f"{PROG}: error: the WebSocket service needs {e.name!r}, which is not installed; "
                  "install it with: pip install 'whistle-stream[server]'", file=sys.stderr)
            return ExitStatus.USAGE
        return server.main(argv[1:], web_root=WEB_ROOT) or 0
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            info = describe(args.model)
            if args.json:
                print(json.dumps(info, indent=1))
            else:
                _print_info(info)
        elif args.command == "download":
            print(models.download(force=args.force, progress=not args.quiet))
        elif args.command == "warm":
            _warm(args)
        elif args.command == "transcribe":
            try:
                _transcribe(args)
            except ValueError as e:  # the engine's refusal of a user-supplied option (--language, --beams)
                raise _UsageError(str(e)) from e
    except WhistleError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return ExitStatus.FAILED if isinstance(e, (DownloadError, _Failed)) else ExitStatus.USAGE
    except KeyboardInterrupt:
        return ExitStatus.INTERRUPTED
    return 0

