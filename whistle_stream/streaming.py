"""Live transcription: ~1 s passes over a bounded buffer, two-pass agreement commits (guide §8).

A pass runs each time another `step_s` of audio has been *received* (audio time, not arrival
time) and sees exactly the audio up to that point, so the output does not depend on how the audio
was chunked. Each pass re-transcribes the buffer with word times; `commit.CommitPolicy` commits the
words two consecutive passes agree on. Audio before the committed words is dropped, so pass time
does not grow with the length of the stream, and the buffer never exceeds `MAX_BUFFER_S`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np

from .commit import CommitPolicy, Word
from .longform import cut_point

if TYPE_CHECKING:  # pragma: no cover
    from .model import Whistle

MAX_BUFFER_S = 30.0  # guide §8: one pass covers at most 30 s
# Audio kept before the first uncommitted word when trimming: word edges are only known to one
# encoder frame (80 ms), and a little left context keeps the first pending word's onset intact.
TRIM_MARGIN_S = 0.24
STABLE_PASSES_TO_FINALIZE = 2  # issue 7: silence finalizes a tail stable for two passes


class StreamSession:
    """One live stream over a shared model. Not thread-safe: feed it from one thread at a time.

    feed(audio) -> dict, finalize() -> dict, finish() -> dict; each dict holds what this call
    committed (`text`, `words` with times in seconds from the stream start), the unconfirmed tail
    (`pending`), `language`, `received` seconds, `pass_ms` (0 when no pass ran) and `revision`.
    """

    def __init__(self, model: "Whistle", language: str | None = None, keywords=None, step_s: float = 1.0,
                 beams: int | None = None, on_pass: Callable[[dict], None] | None = None):
        if not (0.1 <= float(step_s) <= 10.0):
            raise ValueError(f"step_s must be between 0.1 and 10 seconds, got {step_s!r}")
        self.model = model
        self.rate = model.dims.rate
        self.step = int(round(float(step_s) * self.rate))
        self.language_forced = language is not None
        self.language = model.check_language(language) if language is not None else ""
        self.keywords = keywords
        self.beams = beams
        self.on_pass = on_pass  # called with the dict of each single pass (tests, metrics)
        self.policy = CommitPolicy()
        self.revision = 0
        self.closed = False
        self._buffer = np.zeros(0, np.float32)  # audio from _buffer_start onwards
        self._buffer_start = 0  # samples since the stream start
        self._received = 0  # samples
        self._next_pass = self.step  # sample count at which the next pass runs
        self._pending: list[Word] = []
        self._stable = 0  # passes the pending tail has not changed for
        self.passes = 0
        self.pass_seconds_total = 0.0

    # ---- public API ------------------------------------------------------------------------
    def configure(self, keywords=None) -> None:
        """Keywords for the passes from now on (§7)."""
        self.model.parse_keywords(keywords)  # validate now, not at the next pass
        self.keywords = keywords

    def feed(self, audio) -> dict:
        """Append audio (float32 16 kHz mono, or anything `load_audio` accepts at the model's rate)."""
        self._check_open()
        samples = self.model.load_audio(audio)
        self._buffer = np.concatenate([self._buffer, samples])
        self._received += len(samples)
        out = self._empty()
        while self._received >= self._next_pass:
            self._pass_and_report(self._next_pass, out)
            self._next_pass += self.step
        return self._finish_dict(out)

    def finalize(self) -> dict:
        """Commit the pending tail now (end of an utterance) and keep streaming."""
        self._check_open()
        out = self._empty()
        if self._received > self._last_pass_end():
            self._pass_and_report(self._received, out)
        self._commit(self.policy.flush(), out)
        return self._finish_dict(out)

    def finish(self) -> dict:
        """Commit everything and close the stream."""
        out = self.finalize()
        self.closed = True
        return out

    @property
    def received_s(self) -> float:
        return self._received / self.rate

    @property
    def buffer_s(self) -> float:
        return len(self._buffer) / self.rate

    @property
    def pending_text(self) -> str:
        return _join(self._pending)

    # ---- passes ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this stream is finished; open a new one with Whistle.open_stream()")

    def _last_pass_end(self) -> int:
        return self._next_pass - self.step

    def _empty(self) -> dict:
        return {"words": [], "pass_ms": 0.0}

    def _pass_and_report(self, end: int, out: dict) -> None:
        if self.on_pass is None:
            self._run_pass(end, out)
            return
        single = self._empty()
        self._run_pass(end, single)
        out["words"].extend(single["words"])
        out["pass_ms"] += single["pass_ms"]
        self.on_pass(self._finish_dict(single, received=end))

    def _run_pass(self, end: int, out: dict) -> None:
        """Transcribe the buffer up to sample `end` and update commits/pending."""
        t0 = time.perf_counter()
        audio = self._buffer[: end - self._buffer_start]
        offset = self._buffer_start / self.rate
        result = self.model.transcribe_words(
            audio, language=self.language or None, keywords=self.keywords, beams=self.beams)
        self.passes += 1
        words = [Word(w["word"], w["start"] + offset, w["end"] + offset, w["probability"])
                 for w in result["words"]]
        if result["language"] and not self.language:
            self.language = result["language"]  # detected on the first pass with speech, then held
        if not result["speech"]:
            # Silence gate (§8): no decode; whatever is pending is final.
            if self._pending:
                self._commit(self.policy.flush(), out)
        else:
            self._commit(self.policy.update(words), out)
            tail = audio[-self.step:]
            if self._pending and self._stable + 1 >= STABLE_PASSES_TO_FINALIZE \
                    and not self.model.is_speech(tail):
                # Speech has stopped and the tail did not change: finalize it now.
                self._commit(self.policy.flush(), out)
        self._bound_buffer(end, out)
        elapsed = time.perf_counter() - t0
        self.pass_seconds_total += elapsed
        out["pass_ms"] += elapsed * 1000.0

    def _commit(self, result, out: dict) -> None:
        pending = list(result.pending)
        changed = bool(result.new) or _join(pending) != _join(self._pending)
        self._stable = 0 if changed else self._stable + 1
        self._pending = pending
        if result.new:
            out["words"].extend(result.new)
        if changed:
            self.revision += 1

    def _bound_buffer(self, end: int, out: dict) -> None:
        """Drop audio before the committed words; force a commit if the buffer would pass 30 s."""
        limit = int(MAX_BUFFER_S * self.rate)
        if end - self._buffer_start + self.step > limit and self._pending:
            origin = self._buffer_start / self.rate
            window = (end - self._buffer_start) / self.rate
            cut = cut_point([{"word": w.word, "start": w.start - origin, "end": w.end - origin}
                             for w in self._pending], window)
            through = origin + cut
            self._commit(self.policy.commit_through(through), out)
        horizon = self.policy.committed_until_s
        trim_s = horizon - TRIM_MARGIN_S if self._pending else horizon
        if self._pending:
            trim_s = min(trim_s, self._pending[0].start - TRIM_MARGIN_S)
        trim = int(max(0.0, trim_s) * self.rate)
        # Never keep more than 30 s minus one step: the oldest audio goes even if uncommitted.
        trim = max(trim, end + self.step - limit)
        trim = min(trim, end)
        if trim > self._buffer_start:
            self._buffer = self._buffer[trim - self._buffer_start:]
            self._buffer_start = trim

    def _finish_dict(self, out: dict, received: int | None = None) -> dict:
        words = out["words"]
        received = self._received if received is None else received
        return {
            "text": _join(words),
            "words": [w.to_dict() for w in words],
            "pending": _join(self._pending),
            "language": self.language,
            "received": round(received / self.rate, 6),
            "pass_ms": round(out["pass_ms"], 3),
            "revision": self.revision,
        }


def _join(words: Iterable[Word]) -> str:
    return " ".join(w.word for w in words)


def stream(model: "Whistle", chunks: Iterable, language=None, keywords=None, step_s: float = 1.0) -> Iterator[dict]:
    """Generator form: one dict per chunk, then the dict of finish()."""
    session = StreamSession(model, language=language, keywords=keywords, step_s=step_s)
    for chunk in chunks:
        yield session.feed(chunk)
    yield session.finish()
