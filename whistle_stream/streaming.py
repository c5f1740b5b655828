"""Live transcription: ~1 s passes over a bounded buffer, two-pass agreement commits (guide §8).

A pass runs each time another `step_s` of audio has been *received* (audio time, not arrival
time) and sees exactly the audio up to that point, so the output does not depend on how the audio
was chunked. Each pass re-transcribes the buffer with word times; `commit.CommitPolicy` commits the
words two consecutive passes agree on. The buffer starts at the current sentence: it is cut only at
the end of an utterance (a pause, where the words before it are committed, or a finalize) whose
words end a sentence, never in the middle of one. A pause inside a sentence commits the words
before it but keeps their audio (`rules.CONTEXT_S`, `CONTEXT_PAUSE_S`), so each pass hears whole
sentences as the model was trained on them and re-reads the committed start of the current one
(the policy sets those words aside, by text where the pass repeats them, else by time). So pass
time does not grow with the length of the stream, and the buffer never exceeds `MAX_BUFFER_S`
(past it, the oldest words are committed by the long-audio cut rule and their audio dropped).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np

from .commit import CommitPolicy
from .results import StreamUpdate, Word
from .longform import cut_point
from .rules import CONTEXT_PAUSE_S, CONTEXT_S, LOUDNESS, WINDOW_S, ends_sentence, frame_levels, quiet_under, speech_level

from .spans import DIGITAL_SILENCE, close_pauses, last_pause, sayable, sound_span


class StreamModel(Protocol):
    """What a stream reads of its model (`whistle.Whistle`): no import of the model's module."""

    dims: Any

    def load_audio(self, audio) -> np.ndarray: ...
    def check_language(self, language: str | None) -> str | None: ...
    def parse_keywords(self, keywords) -> list[str]: ...
    def transcribe_words(self, audio, language: str | None = None, keywords=None, beams: int | None = None,
                         open_end: bool = False, prefix: str = "", draft=(), memo: "PassMemo | None" = None) -> dict: ...

MAX_BUFFER_S = WINDOW_S  # one pass covers at most one window
MIN_STEP_S, MAX_STEP_S = 0.1, 10.0  # the pass step a stream accepts (the service's range too)
# Audio kept before the first uncommitted word when trimming: word edges are only known to one
# encoder frame (80 ms), and a little left context keeps the first pending word's onset intact.
TRIM_MARGIN_S = 0.24
# Words two passes agree on are committed only once they end HOLD_S before the pass's audio ends;
# the newest second stays pending, and at a pause the whole utterance is read at once
# (docs/streaming.md has the measurements behind the figure).
HOLD_S = 1.0
# A committed word may start this much before a pass's audio (its sound span starts inside the
# word's first frames) and still be fed as the pass's prefix.
PREFIX_SLACK_S = 0.1
# Committed words are fed as a prefix once an utterance has this many: a long utterance's passes
# then search only its tail. Below it the search is short anyway, and the demo model's streams
# read worse with a prefix (docs/streaming.md has the measurement).
PREFILL_MIN_WORDS = 12
# Beams of a pass that ends mid-speech (its words are pending; most of a stream's passes): greedy,
# checking the pass before's reading in one teacher-forced run (`search.greedy_draft`). A pass that
# ends an utterance, whose reading commits its words, searches with the stream's beams (§6: five).
# docs/streaming.md has what it changes.
INTERIM_BEAMS = 1


class PassMemo:
    """A stream's record of its last pass, which the next pass reuses when it hears the same
    samples (`Whistle.transcribe_words(memo=)`): the encoder output and the decoder's
    cross-attention K/V, and the whole reading too when the pass asks for it with the same settings
    (the engine is deterministic: the same samples and settings give the same reading). The pass
    that finds a pause mostly hears what the pass before heard (the utterance had ended, and its
    trailing silence is trimmed from both), and a second reading at the pause often hears what the
    first did. Nothing else is kept: a pass that hears other samples forgets the last one."""

    def __init__(self):
        self.heard: bytes | None = None      # a digest of the samples the last pass heard
        self.encoded: tuple | None = None    # (encoder output, the decoder state the pass started on it)
        self.settings: tuple | None = None   # the reading's settings (language, keywords, beams, open end, prefix)
        self.reading: dict | None = None     # the reading of those samples with those settings

    def hears(self, pcm: np.ndarray) -> bool:
        """True when `pcm` is what the last pass heard; otherwise remember these samples instead."""
        samples = np.ascontiguousarray(pcm, np.float32)
        heard = hashlib.blake2b(samples.tobytes(), digest_size=32, person=b"whistle-pass").digest()
        if heard == self.heard:
            return True
        self.heard, self.encoded, self.settings, self.reading = heard, None, None, None
        return False


@dataclass
class _Reading:
    """One pass's reading: its words (stream seconds), whether it heard speech, the language it
    detected, the frame levels and the seconds of sound it read; `silent`: not read at all."""

    words: list[Word]
    speech: bool
    language: str
    levels: np.ndarray
    seconds: float
    silent: bool = False


class StreamSession:
    """One live stream over a shared model. Not thread-safe: feed it from one thread at a time.

    feed(audio), finalize(), finish() -> `results.StreamUpdate`: what this call committed (`text`,
    `words` with times in seconds from the stream start), the unconfirmed tail (`pending`),
    `language`, `received` seconds, `pass_ms` (0 when no pass ran) and `revision`.
    """

    def __init__(self, model: StreamModel, language: str | None = None, keywords=None, step_s: float = 1.0,
                 beams: int | None = None, on_pass: Callable[[StreamUpdate], None] | None = None,
                 on_trim: Callable[[float], None] | None = None, stable_at_pause: bool = True,
                 prefill: bool = True, interim_beams: int | None = INTERIM_BEAMS):
        if not (MIN_STEP_S <= float(step_s) <= MAX_STEP_S):
            raise ValueError(f"step_s must be between {MIN_STEP_S:g} and {MAX_STEP_S:g} seconds, "
                             f"got {step_s!r}")
        # Silence after speech finalizes the pending tail once two passes read it the same: the pass
        # that finds the pause hears the utterance up to it; a tail it reads differently from the
        # pass before waits for a second pass at the pause (final after it in any case).
        # False commits the tail at the first pass that finds the pause.
        self.stable_at_pause = stable_at_pause
        # Once an utterance has PREFILL_MIN_WORDS committed words, a pass reads them in one
        # teacher-forced run (they are final) and searches only beyond them.
        self.prefill = prefill
        # Beams of the passes that end mid-speech (None: the stream's beams, as every pass).
        self.interim_beams = interim_beams
        self.model = model
        self.rate = model.dims.rate
        self.step = int(round(float(step_s) * self.rate))
        self.language_forced = language is not None
        self.language = model.check_language(language) if language is not None else ""
        self.keywords = keywords
        self.beams = beams
        self.on_pass = on_pass  # called with the StreamUpdate of each single pass (tests, metrics)
        self.on_trim = on_trim  # called with the buffer's new start (seconds) at each trim (tests)
        self.policy = CommitPolicy()
        self.revision = 0
        self.closed = False
        self._buffer = np.zeros(0, np.float32)  # audio from _buffer_start onwards
        self._buffer_start = 0  # samples since the stream start
        self._received = 0  # samples
        self._next_pass = self.step  # sample count at which the next pass runs
        self._heard_to = 0  # the sample the last pass heard up to (its end, or the pause it stopped at)
        self._pending: list[Word] = []
        self._speech_level = 0.0  # frame RMS (90th percentile) of the last pass that heard speech
        self._pause_at: int | None = None  # an utterance end (sample) waiting for a second reading
        # The end (sample) of an utterance that stopped mid-sentence: its words are committed, their
        # audio kept for the passes after it, which read the sentence whole.
        self._context_at: int | None = None
        self.passes = 0
        self.pass_seconds_total = 0.0
        self._committed_words = 0  # words committed so far: later text pieces open with a space
        self._reading: tuple[int, list[int]] = (-1, [])  # the last pass's buffer start and tokens
        self._memo = PassMemo()  # what the last pass heard and read, for a pass that hears it again

    # ---- checkpoints -----------------------------------------------------------------------
    def checkpoint(self, compact: bool = False) -> dict:
        """The stream's state without its audio (JSON-able): with `restore` and the audio from
        `buffer_start_s` on fed again, a new stream continues exactly as this one would. Passes do
        not run again on the re-fed audio: the next pass is where this stream's next pass is.
        compact: without the last pass's reading (a state that must be small: the restored stream
        then waits one pass longer before two passes agree)."""
        policy = self.policy.state()
        if compact:
            policy["previous"] = []
        return {"v": 1, "rate": int(self.rate), "step": int(self.step), "buffer_start": int(self._buffer_start),
                "received": int(self._received), "next_pass": int(self._next_pass), "heard_to": int(self._heard_to),
                "speech_level": float(self._speech_level),
                "pause_at": None if self._pause_at is None else int(self._pause_at),
                "context_at": None if self._context_at is None else int(self._context_at), "language": self.language,
                "revision": int(self.revision), "committed_words": int(self._committed_words),
                "passes": int(self.passes), "policy": policy}

    @property
    def buffer_start_s(self) -> float:
        """Seconds of stream audio before the buffer: settled, never read again."""
        return self._buffer_start / self.rate

    @classmethod
    def restore(cls, model: StreamModel, state: dict, keywords=None, beams: int | None = None,
                **options) -> "StreamSession":
        """A stream that continues a `checkpoint()`: feed it the audio from the checkpoint's
        `buffer_start_s` on. Raises ValueError for a state this model and step cannot continue."""
        try:
            if state.get("v") != 1 or int(state["rate"]) != model.dims.rate:
                raise ValueError("a checkpoint of another version or sample rate")
            step_s = int(state["step"]) / model.dims.rate
            forced = state.get("language") or None
            session = cls(model, language=None, keywords=keywords, step_s=step_s, beams=beams, **options)
            session.language = model.check_language(forced) if forced else ""
            session._buffer_start = session._received = int(state["buffer_start"])
            session._next_pass = int(state["next_pass"])
            session._heard_to = int(state.get("heard_to", session._next_pass - session.step))
            session._speech_level = float(state["speech_level"])
            session._pause_at = None if state.get("pause_at") is None else int(state["pause_at"])
            session._context_at = None if state.get("context_at") is None else int(state["context_at"])
            session.revision = int(state["revision"])
            session._committed_words = int(state["committed_words"])
            session.passes = int(state.get("passes", 0))
            session.policy.restore(state["policy"])
            received = int(state["received"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a stream checkpoint: {e}") from e
        if not session._buffer_start <= received < session._next_pass:
            raise ValueError("a checkpoint whose buffer, received audio and next pass are out of order")
        session._pending = session.policy.pending
        return session

    # ---- public API ------------------------------------------------------------------------
    def configure(self, keywords=None) -> None:
        """Keywords for the passes from now on (§7)."""
        self.model.parse_keywords(keywords)  # validate now, not at the next pass
        self.keywords = keywords

    def feed(self, audio, catch_up: bool = False) -> StreamUpdate:
        """Append audio (float32 16 kHz mono, or anything `load_audio` accepts at the model's rate).

        catch_up: when the audio completes several steps, skip the passes that would only read
        again what a later pass reads: a pass runs at each step end where a pass would find an
        utterance's end (a pause in that step: each utterance is still heard alone) and at the
        newest step's end; passes stay on the step grid and the buffer within MAX_BUFFER_S. A live
        service whose session has fallen behind real time sets it (`service.core`): its passes
        then come as often as the machine allows instead of queueing. Without it (the default)
        the passes do not depend on how the audio was chunked."""
        self._check_open()
        self._append(audio)
        out = self._empty()
        while self._received >= self._next_pass:
            since = self._last_pass_end()
            if catch_up:
                self._next_pass = self._catch_up_end()
            self._pass_and_report(self._next_pass, out, since=since)
            self._next_pass += self.step
        return self._finish_dict(out)

    def _catch_up_end(self) -> int:
        """Where the next pass of a stream catching up ends: the first step end from the next one
        whose pass would find a pause in its newest step (an utterance ends there), else the
        newest step end received, or the last one that keeps the buffer within bounds. A reading
        waiting for its second pass at a pause gets it at the next step end, as without catch_up."""
        newest = self._newest_step_end()
        bound = self._buffer_start + int(MAX_BUFFER_S * self.rate) - self.step
        newest = min(newest, self._next_pass + max(0, bound - self._next_pass) // self.step * self.step)
        if self._pause_at is not None:
            return self._next_pass
        for end in range(self._next_pass, newest, self.step):
            if self._utterance_end(self._buffer[: end - self._buffer_start], self.step) is not None:
                return end
        return newest

    def _newest_step_end(self) -> int:
        """The last step end on the pass grid at or before the audio received (from `_next_pass` on)."""
        return self._next_pass + (self._received - self._next_pass) // self.step * self.step

    def _utterance_end(self, audio: np.ndarray, new: int) -> int | None:
        """Where an utterance ends in `audio` (a pass's buffer): the middle of the last pause that
        ends in its newest `new` samples (the audio since the pass before), or None."""
        return self._pause_after(audio, len(audio) - new)

    def _pause_after(self, audio: np.ndarray, since: int) -> int | None:
        """`last_pause` of a pass's buffer after sample `since`, among the audio after the kept
        context (the pause that ended the context's utterance ends no other)."""
        kept = self._kept(audio)
        gap = last_pause(audio[kept:], self.rate, max(0, since - kept), leading=False)
        return None if gap is None else kept + gap

    def _kept(self, audio: np.ndarray) -> int:
        """Samples of `audio` (from the buffer start) that are kept context, 0 when none."""
        return 0 if self._context_at is None else min(len(audio), max(0, self._context_at - self._buffer_start))

    def finalize(self, audio=None, keep_context: bool = False) -> StreamUpdate:
        """Commit the pending tail now (end of an utterance) and keep streaming.

        audio: the utterance's last audio, appended first: `feed(audio)` then `finalize()` in
        one call, without the passes the feed would run only for the finalize to read the same
        utterance again at once (a pass at a step end runs where it would find an utterance's end,
        as with feed's catch_up, and where the buffer must be cut; not at the newest step end).
        keep_context: the utterance ended at a pause (a VAD's end of speech), not the speaker's
        sentence: when its words stop mid-sentence, the passes after it still read them, as after
        a pause the stream finds itself. Without it the next utterance starts afresh."""
        self._check_open()
        out = self._empty()
        if audio is not None:
            self._append(audio)
            self._passes_before_end(out)
        if self._pause_at is not None:  # an utterance end waiting for a second reading: final now
            self._commit(self.policy.commit_through(self._pause_at / self.rate), out)
            self._end_utterance(self._pause_at, keep_context)
            self._pause_at = None
        if self._received > self._heard_to:
            state = None
            # A pass that ends an utterance at a pause hears only the audio before it; the rest of
            # the buffer (the start of the next utterance) gets its own pass before the flush.
            while self._heard_to < self._received and state != self._reader_state() \
                    and np.any(np.abs(self._buffer) >= DIGITAL_SILENCE):
                state = self._reader_state()
                self._pass_and_report(self._received, out, closing=True, since=self._last_pass_end())
        self._commit(self.policy.flush(), out)
        self._end_utterance(self._received, keep_context)
        if self._next_pass <= self._received:  # passes skipped before the end: the grid goes on after it
            self._next_pass = self._newest_step_end() + self.step
        return self._finish_dict(out)

    def finish(self, audio=None) -> StreamUpdate:
        """Commit everything and close the stream (audio: its last audio, as `finalize` takes it)."""
        out = self.finalize(audio)
        self.closed = True
        return out

    def _reader_state(self) -> tuple:
        """Where the reader stands: a pass that changes none of it made no progress."""
        return self._buffer_start, self._heard_to, self._context_at, self._pause_at

    def _append(self, audio) -> None:
        samples = self.model.load_audio(audio)
        self._buffer = np.concatenate([self._buffer, samples])
        self._received += len(samples)

    def _passes_before_end(self, out: dict) -> None:
        """The passes of `finalize(audio)` before its own: at the step ends `_catch_up_end` picks
        short of the newest one (an utterance ends there, the buffer must be cut first, or a reading
        waits for its second pass at a pause). The newest step's pass is left to
        the finalize, which reads on to the end of the audio, when the buffer fits one pass."""
        while self._received >= self._next_pass:
            end = self._catch_up_end()
            if end >= self._newest_step_end() and self._received - self._buffer_start <= int(MAX_BUFFER_S * self.rate):
                return
            since = self._last_pass_end()
            self._next_pass = end
            self._pass_and_report(end, out, since=since)
            self._next_pass += self.step

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

    def _pass_and_report(self, end: int, out: dict, closing: bool = False, since: int | None = None) -> None:
        if self.on_pass is None:
            self._run_pass(end, out, closing, since)
            return
        single = self._empty()
        self._run_pass(end, single, closing, since)
        out["words"].extend(single["words"])
        out["pass_ms"] += single["pass_ms"]
        self.on_pass(self._finish_dict(single, received=end))

    def _run_pass(self, end: int, out: dict, closing: bool = False, since: int | None = None) -> None:
        """Transcribe the buffer up to sample `end` and update commits/pending. `closing`: the
        pass of finalize(), whose reading is committed without a second one. `since`: the end of
        the pass before (default: one step before `end`)."""
        t0 = time.perf_counter()
        audio = self._buffer[: end - self._buffer_start]
        gap, waiting = self._pass_end(audio, end, since)
        # After an utterance kept as context, a pass runs only once something is said after it.
        idle = self._context_at is not None and not waiting and self._silent(audio[self._kept(audio):])
        reading = self._read(audio if gap is None else audio[:gap], gap is None, gap is None and not closing, idle)
        if reading.silent:
            gap = None
        # what this pass heard: a pass that ends an utterance at a pause leaves what follows unread
        self._heard_to = end if gap is None else self._buffer_start + gap
        self.passes += 1
        unsayable = reading.speech and (closing or gap is not None) and not sayable(len(reading.words), reading.seconds)
        if unsayable:
            # A reading about to be committed (the utterance ends here) with more words than its
            # audio could hold: a noise burst or the first breath of an utterance read as a
            # sentence (a small model reads 0.7 s of noise as "Will it rain in Berlin tomorrow?").
            # The pass counts for nothing: no words, and the buffer stays as it is. (An open pass
            # reading ahead of its audio only shows pending words; the next pass reads them again.)
            reading = _Reading([], False, "", reading.levels, reading.seconds)
        if reading.speech and len(reading.levels):
            self._speech_level = speech_level(reading.levels)
        if reading.language and not self.language:
            self.language = reading.language  # detected on the first pass with speech, then held
        if reading.speech:
            hold = None if gap is not None else end / self.rate - HOLD_S
            self._commit(self.policy.update(reading.words, hold), out)
        elif idle:
            self._forget_after_long_pause(end)
        elif gap is None and not unsayable:
            # Silence gate (§8): no speech yet, the buffer is a pause, but the newest step is kept:
            # a quiet lead-in (breath, room noise) that the gate passed over may be the start of the
            # next utterance, and the model was trained on clips with 0.1-0.8 s of it (cut to less,
            # the next utterance's first words are misread).
            gap = max(0, len(audio) - self.step)
        self._settle(gap, waiting, reading.speech, out)
        self._bound_buffer(end, out)
        elapsed = time.perf_counter() - t0
        self.pass_seconds_total += elapsed
        out["pass_ms"] += elapsed * 1000.0

    def _pass_end(self, audio: np.ndarray, end: int, since: int | None) -> tuple[int | None, bool]:
        """(where the pass's reading stops: an utterance's end in `audio`, or None for its end;
        whether it reads again an utterance end the pass before found)."""
        # An utterance that ended at a pause in the audio since the last pass (the newest step) is
        # heard up to the pause, as a one-shot transcription would hear it; what follows the
        # pause waits for the next pass.
        gap = self._utterance_end(audio, self.step if since is None else max(self.step, end - since))
        if self._pause_at is not None and self._pause_at <= self._buffer_start:
            self._pause_at = None  # its audio is gone (a forced trim): nothing left to read again
        if self._pause_at is None:
            return gap, False
        # The previous pass found the utterance's end but its reading was not yet confirmed: this
        # pass reads it again, up to the middle of the same pause as it stands now.
        stored = self._pause_at - self._buffer_start
        again = self._pause_after(audio, max(0, stored - 1))
        return (stored if again is None else again), True

    def _read(self, heard: np.ndarray, open_end: bool, interim: bool, idle: bool) -> "_Reading":
        """The model's reading of `heard` (a pass's audio up to where it stops; `open_end`: at the
        newest audio, not a pause; `interim`: its words stay pending, so one beam), its words in
        stream seconds; silence when `idle` or when every frame is pause_db under the stream's last
        speech, however the silence gate (§8, relative to the clip itself) judges a faint tail: a
        faint tail decoded reads as a sentence that was never said."""
        first, last = sound_span(heard, self.rate)
        levels = frame_levels(heard[first:last], self.rate)
        seconds = (last - first) / self.rate
        if idle or self._speech_level > 0.0 and self._quiet(levels):
            return _Reading([], False, "", levels, seconds, silent=True)
        offset = (self._buffer_start + first) / self.rate
        beams = self.interim_beams if interim and self.interim_beams is not None else self.beams
        start, tokens = self._reading
        closed = close_pauses(heard[first:last], self.rate)   # a sentence's start and its rest, as said
        result = self.model.transcribe_words(
            closed.audio, language=self.language or None, keywords=self.keywords, beams=beams,
            open_end=open_end, prefix=self._prefix(offset),
            draft=tokens if start == self._buffer_start else (), memo=self._memo)
        self._reading = (self._buffer_start, result.get("tokens", []))
        words = [Word(w["word"], closed.original(w["start"]) + offset, closed.original(w["end"]) + offset,
                      w["probability"]) for w in result["words"]]
        return _Reading(words, bool(result["speech"]), result["language"], levels, seconds)

    def _forget_after_long_pause(self, end: int) -> None:
        """Silence after a sentence's first words: past CONTEXT_PAUSE_S it is over for the reader
        too, and what follows starts afresh (the newest step kept, as the silence gate keeps it)."""
        if self._context_at is not None and end - self._context_at > CONTEXT_PAUSE_S * self.rate:
            self._cut_utterance(max(self._context_at, end - self.step))

    def _settle(self, gap: int | None, waiting: bool, speech: bool, out: dict) -> None:
        """After a pass that stopped at an utterance's end (`gap`): its words final, or, when the
        tail read differently from the pass before, one more reading at the pause first."""
        if gap is not None and self.stable_at_pause and not waiting and self._pending and speech:
            # It is final once a second pass at the pause reads it the same (or after that pass
            # in any case).
            self._pause_at = self._buffer_start + gap
        elif gap is not None:
            boundary = (self._buffer_start + gap) / self.rate
            self._commit(self.policy.commit_through(boundary), out)
            self._end_utterance(self._buffer_start + gap, keep_context=True)
            self._pause_at = None
        else:
            self._pause_at = None

    def _prefix(self, offset: float) -> str:
        """The committed words a pass from `offset` (seconds) begins with: the current utterance's,
        once there are PREFILL_MIN_WORDS of them, when all lie in its audio (after a forced trim
        they do not, and none is fed)."""
        words = self.policy.rereads
        if not self.prefill or not self.language or len(words) < PREFILL_MIN_WORDS \
                or words[0].start < offset - PREFIX_SLACK_S:
            return ""
        return _join(words)

    def _commit(self, result, out: dict) -> None:
        pending = list(result.pending)
        changed = bool(result.new) or _join(pending) != _join(self._pending)
        self._pending = pending
        if result.new:
            out["words"].extend(result.new)
            self._committed_words += len(result.new)
        if changed:
            self.revision += 1

    def _bound_buffer(self, end: int, out: dict) -> None:
        """Force a commit if the buffer would pass 30 s (the long-audio cut rule picks the words)."""
        limit = int(MAX_BUFFER_S * self.rate)
        if end - self._buffer_start + self.step > limit and self._pending:
            origin = self._buffer_start / self.rate
            window = (end - self._buffer_start) / self.rate
            cut = cut_point([{"word": w.word, "start": w.start - origin, "end": w.end - origin}
                             for w in self._pending], window)
            through = origin + cut
            self._commit(self.policy.commit_through(through), out)
            # The words through the cut are committed: the buffer restarts before the next one.
            trim_s = self._pending[0].start - TRIM_MARGIN_S if self._pending else through
            self._trim(int(max(0.0, trim_s) * self.rate), end)
        # Never keep more than 30 s minus one step: the oldest audio goes even if uncommitted.
        self._trim(end + self.step - limit, end)

    def _silent(self, audio: np.ndarray) -> bool:
        """Every 20 ms frame of `audio`'s sound is pause_db under the stream's last speech (or none)."""
        first, last = sound_span(audio, self.rate)
        return self._quiet(frame_levels(audio[first:last], self.rate))

    def _quiet(self, levels: np.ndarray) -> bool:
        """Every frame level is pause_db under the stream's last speech (or there are none)."""
        return float(levels.max(initial=0.0)) <= quiet_under(self._speech_level, LOUDNESS.pause_db)

    def _end_utterance(self, at: int, keep_context: bool) -> None:
        """An utterance ended at sample `at`, its words committed. With keep_context, words that stop
        mid-sentence keep their audio for the passes after it (`_context_at`), when the sentence so
        far lies within CONTEXT_S; otherwise the next utterance starts there (`_cut_utterance`)."""
        said = self.policy.rereads
        if keep_context and said and not ends_sentence(said[-1].word) \
                and at - self._buffer_start <= CONTEXT_S * self.rate:
            self._context_at = at
            return
        self._cut_utterance(at)

    def _cut_utterance(self, at: int) -> None:
        """The words before sample `at` are committed: the next utterance starts there (or at the
        committed words' end, whichever is later). The audio before goes, and the policy stops
        comparing new words with the committed ones by time (none is re-read; a re-heard tail
        is still caught by the policy's repeat check)."""
        horizon = int(round(self.policy.committed_until_s * self.rate))
        self._context_at = None
        if self._trim(max(horizon, at), self._received):
            self.policy.new_utterance()

    def _trim(self, trim: int, end: int) -> bool:
        """Drop the buffer's audio before sample `trim` (at most up to `end`); True if any went."""
        trim = min(trim, end)
        if trim > self._buffer_start:
            self._buffer = self._buffer[trim - self._buffer_start:]
            self._buffer_start = trim
            if self._context_at is not None and self._context_at <= trim:
                self._context_at = None   # the kept context is gone (a forced trim)
            if self.on_trim is not None:
                self.on_trim(trim / self.rate)
            return True
        return False

    def _finish_dict(self, out: dict, received: int | None = None) -> StreamUpdate:
        """What a call (or a pass, for on_pass) returns. Its `text` opens with a space when
        words were committed before its own, and `pending` when any were, so that the committed
        pieces of a stream concatenate to its transcript and the pending tail follows it."""
        words = out["words"]
        received = self._received if received is None else received
        text = _join(words)
        if text and self._committed_words > len(words):
            text = " " + text
        pending = _join(self._pending)
        if pending and self._committed_words:
            pending = " " + pending
        return StreamUpdate(text=text, words=tuple(w.rounded() for w in words), pending=pending,
                            language=self.language or "", received=round(received / self.rate, 6),
                            pass_ms=round(out["pass_ms"], 3), revision=self.revision)


def _join(words: Iterable[Word]) -> str:
    return " ".join(w.word for w in words)


def stream(model: StreamModel, chunks: Iterable, language=None, keywords=None,
           step_s: float = 1.0) -> Iterator[StreamUpdate]:
    """Generator form: one StreamUpdate per chunk, then finish()'s."""
    session = StreamSession(model, language=language, keywords=keywords, step_s=step_s)
    for chunk in chunks:
        yield session.feed(chunk)
    yield session.finish()
