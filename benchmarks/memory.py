"""Peak memory of the engine: one process loads a model, transcribes 30 s with word times, then
streams the same 30 s in 1 s steps; the peak RSS (VmHWM) is printed after each phase, with the RSS
then and its anonymous and file-backed parts.

    python benchmarks/memory.py                 # the harness's full architecture (random weights)
    python benchmarks/memory.py --model demo    # the bundled model
    python benchmarks/memory.py --model PATH.cact

With `--model full` the embedding (tied to the output head) is widened to the shipped file's 8199
rows of random codes: the harness has the test tokenizer's 519, and the head is the decoder's
largest matrix.

The phases run in one child process that imports only the engine (no JAX), so the figures are the
engine's own. The first line, "loaded and warm", is that process with numpy, numba, the model and
its kernels loaded from the JIT cache (`whistle-stream warm` runs first, so no compile counts):
what any process of ours holds before it reads audio.

The child runs twice: as deployed, then in this environment. numba imports scipy.linalg (~12 MB)
whenever scipy is importable; the image installs `.[server]`, whose dependencies do not include
scipy (checked here from the installed packages' metadata), while this environment has it for the
JAX reference. So the deployed run hides scipy from the child (if the server's dependencies ever
pull it in, both runs keep it and say so).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness_model import SHIPPED_VOCAB, model_path  # noqa: E402

_CHILD = r"""
import json, sys
if sys.argv[3] == "hide":
    sys.modules["scipy"] = None   # as deployed: not installed
sys.path.insert(0, sys.argv[2])
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024.0 for l in f if l.startswith("VmHWM:"))
def rss():   # (RSS, of it anonymous, of it file pages: shared libraries, the mapped model)
    with open("/proc/self/status") as f:
        v = {l.split(":")[0]: int(l.split()[1]) / 1024.0 for l in f if l.startswith(("VmRSS", "RssAnon", "RssFile"))}
    return v["VmRSS"], v["RssAnon"], v["RssFile"]
out = {}
from whistle_stream import Whistle
from tests.harness.audio import speech_of_length
model = Whistle(sys.argv[1] or None)
if int(sys.argv[4]):   # the shipped vocabulary's embedding and head
    sys.path.insert(0, sys.argv[5])
    from harness_model import serve_shipped_vocabulary
    serve_shipped_vocabulary(model, int(sys.argv[4]))
model.warmup()
out["loaded and warm"] = (*rss(), peak())
audio = speech_of_length(30 * 16000 - 1)
model.transcribe(audio, word_timestamps=True, by="windows")
out["30 s transcribed with word times"] = (*rss(), peak())
stream = model.open_stream()
for i in range(0, len(audio), 16000):
    stream.feed(audio[i:i + 16000])
stream.finish()
out["30 s streamed in 1 s steps"] = (*rss(), peak())
print(json.dumps(out))
"""


def server_dependencies() -> set[str]:
    """Distribution names `pip install '.[server]'` installs (the image), from installed metadata."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [("whistle-stream", {"server"})]
    while todo:
        name, extras = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        for req in map(Requirement, reqs):
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((req.name, set(req.extras)))
    return seen


def phases(model: str, scipy: str, vocab: int, engine: Path = ROOT) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, model, str(engine), scipy, str(vocab), str(ROOT / "benchmarks")],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="full", help="full (default), demo, or a .cact path")
    ap.add_argument("--engine", type=Path, default=None,
                    help="also measure the engine of this checkout (another commit's worktree: the code "
                         "before a change), as deployed, in the same run")
    ap.add_argument("--vocab", type=int, default=None,
                    help=f"embedding rows (default: {SHIPPED_VOCAB}, the shipped file's, for --model full; "
                         "else the model's own)")
    args = ap.parse_args(argv)
    if args.engine is not None and not (args.engine / "whistle_stream" / "__init__.py").is_file():
        ap.error(f"--engine must be a checkout of this repository (a folder holding whistle_stream/), got {args.engine}")
    if args.vocab is not None and args.vocab < 0:
        ap.error(f"--vocab is a row count (0: the model's own), got {args.vocab}")
    model = model_path(args.model) or ""
    vocab = args.vocab if args.vocab is not None else (SHIPPED_VOCAB if args.model == "full" else 0)
    for engine in [ROOT] + ([args.engine.resolve()] if args.engine is not None else []):   # no compile counts
        subprocess.run([sys.executable, "-m", "whistle_stream.cli", "warm"] + (["--model", model] if model else []),
                       check=True, capture_output=True, cwd=engine)
    deployed = "keep" if "scipy" in server_dependencies() else "hide"
    print(f"model: {model or 'bundled demo'}" + (f", embedding and head widened to {vocab} rows of random CQ codes "
                                                 "(the shipped vocabulary)" if vocab else ""))
    for title, scipy in ((f"as deployed (scipy {'installed' if deployed == 'keep' else 'not installed'})", deployed),
                         ("this environment (scipy importable)", "keep")):
        show(title, phases(model, scipy, vocab))
    if args.engine is not None:
        show(f"the engine of {args.engine}, as deployed", phases(model, deployed, vocab, args.engine.resolve()))
    print("\n(anonymous: the process's own memory; file: pages of mapped files, shared libraries' code above "
          "all, which processes share and the kernel maps in more or fewer of, by machine)")
    return 0


def show(title: str, figures: dict) -> None:
    print(f"\n{title}\n{'after':<36} {'RSS':>8} {'peak RSS':>9} {'anonymous':>10} {'file':>8}")
    for name, (now, anon, file, peak) in figures.items():
        print(f"{name:<36} {now:>5.0f} MB {peak:>6.0f} MB {anon:>7.0f} MB {file:>5.0f} MB")


if __name__ == "__main__":
    sys.exit(main())
