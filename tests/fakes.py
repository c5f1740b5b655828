"""A fake Whistle with the engine's streaming interface, for testing the service and clients.

The words depend only on how much audio has been fed (one word per `word_s` seconds), so the
output is deterministic and independent of how the audio was chunked. Like the real stream it
re-transcribes once per `step_s` of audio (a "pass"), commits all but the last `tail` words of
each pass, and keeps those as the pending text. `finalize`/`finish` commit the tail.

Run as a script it serves the fake over the real server: `python tests/fakes.py serve --port 0`.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from whistle_stream.results import KernelPath, StreamUpdate, Warmup, stream_update

VOCABULARY = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
              "juliett", "kilo", "lima", "mike", "november", "oscar", "papa")


@dataclass(frozen=True)
class FakeDims:
    languages: tuple = ("en", "de", "fr", "es", "it", "nl", "pl")  # the full model's
    rate: int = 16000


class FakeStream:
    def __init__(self, model: "FakeWhistle", language, keywords, step_s, beams=None):
        self.model = model
        self.beams = beams         # as asked for (the fake reads no differently)
        self.language = language
        self.keywords = list(keywords or [])
        self.step = int(round(step_s * model.dims.rate))
        self.received = 0          # samples fed
        self.passed = 0            # samples covered by passes
        self.committed = 0         # words committed
        self.revision = 0          # bumps when committed or pending text changes, as the engine's does
        self.passes = 0
        self.closed = False
        self.feeds = []            # lengths of every feed call, for tests
        self.catch_ups = 0         # feed calls asked to catch up (SessionCore._behind)
        self.finals = []           # samples each finalize/finish call was given with it, for tests
        self.kept = []             # keep_context of each finalize call

    def _words_heard(self) -> int:
        return int(self.passed / self.model.dims.rate / self.model.word_s)

    def _word(self, i: int) -> dict:
        w = self.model.word_s
        text = VOCABULARY[i % len(VOCABULARY)] * self.model.word_repeat
        return {"word": " " + text, "start": i * w, "end": (i + 1) * w - 0.05, "probability": 0.9}

    def _result(self, commit_to: int, pass_ms: float) -> StreamUpdate:
        words = [self._word(i) for i in range(self.committed, commit_to)]
        self.committed = max(self.committed, commit_to)
        pending = "".join(self._word(i)["word"] for i in range(self.committed, self._words_heard()))
        language = (self.language or "en") if self.revision else ""
        return stream_update(text="".join(w["word"] for w in words), words=words, pending=pending,
                             language=language, received=self.received / self.model.dims.rate,
                             pass_ms=pass_ms, revision=self.revision)

    def _pass(self) -> float:
        if self.model.fail_after is not None and self.revision >= self.model.fail_after:
            raise RuntimeError("fake engine failure")
        self.revision += 1         # every fake pass hears a new word, so the text always changes
        self.passes += 1
        self.model.passes += 1
        if self.model.pass_s:
            time.sleep(self.model.pass_s)
        return 1000.0 * self.model.pass_s + 1.0

    def feed(self, audio: np.ndarray, catch_up: bool = False) -> StreamUpdate:
        if self.closed:
            raise RuntimeError("feed() after finish()")
        audio = np.asarray(audio)
        if audio.dtype != np.float32 or audio.ndim != 1:
            raise TypeError(f"feed() takes float32 mono audio, got {audio.dtype} {audio.shape}")
        self.feeds.append(len(audio))
        self.received += len(audio)
        pass_ms = 0.0
        while self.received - self.passed >= self.step:
            # catch_up: one pass at the newest step end (StreamSession.feed's rule; the fake hears no pauses)
            self.passed += (self.received - self.passed) // self.step * self.step if catch_up else self.step
            pass_ms += self._pass()
        self.catch_ups += catch_up
        commit_to = max(self.committed, self._words_heard() - self.model.tail)
        return self._result(commit_to, pass_ms)

    def finalize(self, audio: np.ndarray | None = None, keep_context: bool = False) -> StreamUpdate:
        self.finals.append(0 if audio is None else len(audio))
        self.kept.append(keep_context)
        if audio is not None:   # fed without its passes: the finalize's one pass reads it all
            self.feeds.append(len(audio))
            self.received += len(audio)
        pass_ms = 0.0
        if self.received > self.passed:
            self.passed = self.received
            pass_ms = self._pass()
        return self._result(self._words_heard(), pass_ms)

    def finish(self, audio: np.ndarray | None = None) -> StreamUpdate:
        d = self.finalize(audio)
        self.closed = True
        return d

    def configure(self, keywords=None, **_):
        self.keywords = list(keywords or [])

    # The engine stream's checkpoint surface: the fake keeps no audio, so its buffer starts where
    # its last pass ended and nothing needs replaying but what came after.
    def checkpoint(self, compact: bool = False) -> dict:
        return {"fake": 1, "language": self.language, "step": self.step, "buffer_start": self.passed,
                "received": self.received, "committed": self.committed, "revision": self.revision,
                "passes": self.passes}


class FakeWhistle:
    """`Whistle`'s streaming surface. `pass_s` sleeps per pass (simulated CPU, GIL released)."""

    def __init__(self, path=None, *, word_s: float = 0.5, tail: int = 2, pass_s: float = 0.0,
                 word_repeat: int = 1, fail_after: int | None = None):
        self.dims = FakeDims()
        self.name = "fake-whistle"
        self.word_s = word_s
        self.tail = tail
        self.pass_s = pass_s
        self.word_repeat = word_repeat
        self.fail_after = fail_after
        self.passes = 0
        self.streams: list[FakeStream] = []
        self._lock = threading.Lock()

    def is_speech(self, pcm) -> bool:
        """The fake has no silence gate: every utterance's audio reaches the stream."""
        return True

    def warmup(self) -> Warmup:
        return Warmup(0.0, 0)

    def kernel_path(self) -> KernelPath:
        return KernelPath("x86_64", None, "fake", False, False)

    def restore_stream(self, state: dict, keywords=None, beams=None) -> FakeStream:
        if state.get("fake") != 1:
            raise ValueError("not a fake stream checkpoint")
        s = self.open_stream(state["language"], keywords, state["step"] / self.dims.rate)
        s.received = s.passed = state["buffer_start"]
        s.committed, s.revision, s.passes = state["committed"], state["revision"], state["passes"]
        return s

    def open_stream(self, language=None, keywords=None, step_s: float = 1.0, beams=None) -> FakeStream:
        s = FakeStream(self, language, keywords, step_s, beams)
        with self._lock:
            self.streams.append(s)
        return s


def stream_reference(model: FakeWhistle, audio: np.ndarray, *, step_s: float = 1.0, chunk: int = 1600,
                     language=None) -> str:
    """The committed text of feeding `audio` through one stream in `chunk`-sample pieces, then finish."""
    s = model.open_stream(language=language, step_s=step_s)
    text = "".join(s.feed(audio[i:i + chunk])["text"] for i in range(0, len(audio), chunk))
    return text + s.finish()["text"]


def start_server_process(*flags: str, env: dict | None = None, timeout: float = 30.0):
    """`python tests/fakes.py serve --port 0 *flags` as a subprocess -> (Popen, "ws://127.0.0.1:PORT").

    Waits for the JSON log lines "listening" (for the port) and "ready". stderr stays readable
    through `proc.stderr` (JSON lines).
    """
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, str(Path(__file__)), "serve", "--port", "0", *flags],
                            cwd=root, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, **(env or {})})
    port, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "listening":
            port = event["port"]
        if event.get("event") == "ready" and port:
            return proc, f"ws://127.0.0.1:{port}"
    proc.kill()
    raise RuntimeError(f"the fake server did not start: {proc.stderr.read()[-2000:]}")


if __name__ == "__main__":
    # `python tests/fakes.py serve [serve flags] [--fake-pass-s S] [--fake-fail-after N]`
    from whistle_stream.service.server import main

    argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    options = {}
    for flag, key, cast in (("--fake-pass-s", "pass_s", float), ("--fake-fail-after", "fail_after", int)):
        if flag in argv:
            i = argv.index(flag)
            options[key] = cast(argv[i + 1])
            del argv[i:i + 2]
    sys.exit(main(argv, model=FakeWhistle(**options)))
