"""`Whistle`: the public engine API — embed, transcribe, logits, streaming.

One `Whistle` holds one model's read-only weights and may be shared by many threads and streams;
every call allocates its own scratch. Kernels release the GIL, so passes on worker threads run in
parallel.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from . import frontend
from .alignment import _word_starts, sounding_frames, trim_to_sound, word_times
from .decoder import Decoder, DecoderState
from .dims import check_language
from .encoder import Encoder
from .keywords import KeywordBiaser, parse_keywords
from .longform import transcribe_long, utterance_spans
from .models import ModelFile
from .blocks import kernel_path
from .kernels._cache import compiled_here
from .results import Decoding, KernelPath, Transcription, Warmup, Word
from .rules import BEAMS, MAX_BEAMS, READ_BY, WINDOW_S, ends_sentence
from .search import _text_logprobs, beam_search, greedy_draft
from .spans import close_pauses, sound_span
from .streaming import PassMemo, StreamSession
from .streaming import stream as stream_updates

# A prefix is fed only while this many positions stay after it (the prompt, some text, </s>).
PREFIX_ROOM = 64


class Whistle(ModelFile):
    """A loaded Whistle model.

    Whistle(path=None, audio_depth=None): path to a .cact (None resolves the default model:
    $WHISTLE_MODEL, the downloaded full model, then the bundled demo model); audio_depth keeps
    that many decoder layers by the ladder order (guide §6).
    """

    def __init__(self, path: str | Path | None = None, audio_depth: int | None = None):
        super().__init__(path)
        self.encoder = Encoder(self.cact)
        self.decoder = Decoder(self.cact, depth=audio_depth)
        self._special = [i for i in range(self.dims.vocab) if self.tokenizer.is_special(i)]
        self._biasers: dict[tuple[str, ...], KeywordBiaser] = {}
        self._biaser_lock = threading.Lock()

    # ---- audio -----------------------------------------------------------------------------
    def load_audio(self, audio, rate: int | None = None) -> np.ndarray:
        """float32 16 kHz mono samples from an array (float or int16), a WAV path or WAV bytes."""
        return frontend.load_audio(audio, rate)

    def check_language(self, language: str | None) -> str | None:
        return check_language(language, self.dims.languages)

    def parse_keywords(self, keywords) -> list[str]:
        return parse_keywords(keywords)

    # ---- encoder ---------------------------------------------------------------------------
    def embed(self, audio) -> np.ndarray:
        """Encoder output (frames, width) float32, one row per 80 ms (guide §1). Empty audio or
        audio shorter than one frame gives an empty (0, width) array."""
        return self._encode(self.load_audio(audio))

    def _started(self, pcm: np.ndarray, beams: int, memo: PassMemo | None) -> tuple[np.ndarray, DecoderState | None]:
        """The encoder output of `pcm` and a decoder state started on it with room for `beams`
        rows (None when there is no frame). From the memo's when it holds these samples' (its
        `hears` has checked them): a fresh state over the cross-attention K/V of the state the
        pass before started (`Decoder.restart` reads only those, which feeding never changes);
        else computed, and left in the memo."""
        if memo is not None and memo.encoded is not None:
            enc, earlier = memo.encoded
            return enc, None if earlier is None else self.decoder.restart(earlier, beams=beams, record=False)
        enc = self._encode(pcm)
        state = self.decoder.start(enc, beams=beams) if len(enc) else None
        if memo is not None:
            memo.encoded = (enc, state)
        return enc, state

    def _encode(self, pcm: np.ndarray) -> np.ndarray:
        d = self.dims
        if len(pcm) < d.hop:
            return np.zeros((0, d.width), np.float32)
        return self.encoder.encode(self.encoder.features(pcm))

    # ---- decoder ---------------------------------------------------------------------------
    def logits(self, audio, tokens) -> np.ndarray:
        """Teacher-forced next-token logits (len(tokens), vocab) float32; tokens start with <s>."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(tokens) == 0:
            raise ValueError("tokens must hold at least <s>")
        enc = self.embed(audio)
        if len(enc) == 0:
            raise ValueError("audio is shorter than one encoder frame; nothing to attend to")
        return self.decoder.logits(enc, tokens)

    def _biaser(self, keywords) -> KeywordBiaser | None:
        phrases = tuple(parse_keywords(keywords))
        if not phrases:
            return None
        with self._biaser_lock:
            biaser = self._biasers.get(phrases)
            if biaser is None:
                biaser = KeywordBiaser.build(phrases, self.tokenizer, self._special)
                if len(self._biasers) > 64:
                    self._biasers.clear()
                self._biasers[phrases] = biaser
        return biaser

    def _decode(self, pcm: np.ndarray, language: str | None, biaser, beams: int, words: bool,
                open_end: bool = False, prefix: Sequence[int] = (), draft: Sequence[int] = (),
                memo: PassMemo | None = None) -> dict:
        """One window (<= 30 s) of speech: encoder, prompt, search, optionally word times.
        open_end: the audio stops mid-speech (a streaming pass before a pause, a long-audio window
        before the last), so no row after the words takes audio from the last word.
        prefix: text tokens the window is known to begin with (a stream's committed words): fed in
        one teacher-forced run after the prompt, and the search starts after them; the result's
        tokens and words include them. Needs a language (it is never detected after a prefix).
        draft: a guess of the text tokens after the prefix (a stream's reading of the pass
        before): a greedy search (beams 1, no keywords) checks it in one teacher-forced run
        (`search.greedy_draft`); the result is the same without it. memo: a stream's `PassMemo`
        that has checked `pcm` (`hears`): its encoder output and cross-attention K/V are reused."""
        t0 = time.perf_counter()
        d = self.dims
        enc, state = self._started(pcm, beams, memo)
        if len(enc) == 0:
            return {"tokens": [], "text": "", "language": language or "", "words": [], "ttft": 0.0,
                    "decode_s": 0.0}
        assert state is not None   # made whenever there is encoder output
        greedy = beams == 1 and biaser is None
        if words:   # the word times' weights, as the prompt and a greedy search feed the positions
            self.decoder.record(state)
        prefix = list(prefix) if len(prefix) + PREFIX_ROOM <= d.max_tokens else []
        if language is None:  # detected from the row after <s>, then the tag fed
            language = self._detect_language(self.decoder.feed(state, [d.bos])[0, -1])
            tag = d.language_id(language)
            logits = self.decoder.feed(state, [tag] + prefix)[0, -1]
        else:  # the whole prompt in one run (a row's logits do not depend on how it was fed)
            tag = d.language_id(language)
            logits = self.decoder.feed(state, [d.bos, tag] + prefix)[0, -1]
        ttft = time.perf_counter() - t0
        # A search's beams leave no one row's record: its text is fed again after the prompt
        # (`Decoder.rewind`), instead of a teacher-forced pass over the prompt and the text.
        mark = self.decoder.mark(state) if words and not greedy else None
        if greedy:
            result, state = self._greedy_draft(state, logits, [d.bos, tag] + prefix, draft)
        else:
            result = beam_search(logits, self.decoder.advance_fn(state), first_tag=d.first_tag, eos=d.eos,
                                 max_len=d.max_tokens, beams=beams, biaser=biaser, prompt_len=2 + len(prefix))
        decode_s = time.perf_counter() - t0 - ttft
        tokens = prefix + list(result.tokens)
        out = {"tokens": tokens, "text": self.tokenizer.decode(tokens).strip(),
               "language": language, "ttft": ttft, "decode_s": decode_s, "words": []}
        if words and tokens:
            # a committed word was heard and agreed on: its tokens count as certain
            probs = np.concatenate([np.ones(len(prefix)), np.exp(np.asarray(result.token_logprobs, np.float64))])
            if mark is not None:   # (the search's cap leaves the text room after the prompt)
                self.decoder.rewind(state, mark)
                if result.tokens:
                    self.decoder.feed(state, list(result.tokens))
            weights = self.decoder.recorded_weights(state, 2 + len(tokens))
            if weights is None:
                weights = self.decoder.cross_attention_weights(enc, [d.bos, tag] + tokens, same_as=state)
            out["words"] = self._word_times(pcm, len(enc), weights, tokens, probs, open_end)
        return out

    def _greedy_draft(self, state, first_logits: np.ndarray, prompt: list, draft: Sequence[int]):
        """`search.greedy_draft` on a decoder `state` that has read `prompt`: (result, the state
        the search ended on, whose cross-attention K/V and record the word times reuse)."""
        d = self.dims
        holder = [state]

        def follow(guess: np.ndarray) -> np.ndarray:
            return self.decoder.feed(holder[0], guess)[0]

        def back(kept: int) -> None:
            holder[0] = self.decoder.restart(holder[0], beams=1)
            self.decoder.feed(holder[0], list(prompt) + [int(t) for t in draft[:kept]])

        result = greedy_draft(first_logits, lambda parents, tokens: self.decoder.step(holder[0], parents, tokens),
                              follow, back, draft, first_tag=d.first_tag, eos=d.eos, max_len=d.max_tokens,
                              prompt_len=len(prompt))
        return result, holder[0]

    def _detect_language(self, first_logits: np.ndarray) -> str:
        """§6: the language whose tag is likeliest after <s> (first_logits: the row after <s>)."""
        d = self.dims
        return d.languages[int(np.argmax(first_logits[d.first_tag:d.first_tag + len(d.languages)]))]

    def _word_times(self, pcm: np.ndarray, frames: int, weights: np.ndarray, tokens, probs,
                    open_end: bool) -> list[dict]:
        """§8 word times of `tokens` (the transcript after the prompt) over one window's audio of
        `frames` encoder frames; weights: the teacher-forced pass's cross-attention weights over
        [<s>, tag, *tokens]."""
        d = self.dims
        # Row p of the weights is the query that predicts token p + 1: rows 1 .. n predict the
        # transcript's tokens; row 0 (predicting the tag) and row n + 1 (predicting </s>) join
        # the path to take the silence before and after the words (alignment.word_times). Audio
        # that stops mid-speech has no silence after the words, so there the </s> row is left
        # out and the last word keeps the end (the row's job is silence, which such audio does not
        # end with; on the seven demo streams it changed no committed word when it was added).
        trail = 0 if open_end else 1
        if open_end:
            weights = weights[:, :-1]
        duration = len(pcm) / d.rate  # the last encoder frame may reach past the audio
        sounding = sounding_frames(pcm, int(round(d.frame_seconds * d.rate)), frames)
        timed = word_times(weights, list(tokens), probs, self.tokenizer, d.frame_seconds, 0.0, lead=1, trail=trail,
                           sounding=sounding)
        return [{**w, "start": float(min(w["start"], duration)), "end": float(min(w["end"], duration))}
                for w in trim_to_sound(timed, sounding, d.frame_seconds)]

    def align(self, audio, text: str, language: str | None = None) -> list[Word]:
        """Forced alignment: word times of a known transcript over audio of at most 30 s (§8's
        teacher-forced pass, run on `text` instead of a transcript the search chose): `Word`s
        (word, start, end, probability), seconds from the clip start. The language is detected
        as `transcribe` does unless given. For subtitles of a known script, and to measure word
        timing apart from recognition."""
        d = self.dims
        language = self.check_language(language)
        pcm = self.load_audio(audio)
        if len(pcm) > int(WINDOW_S * d.rate):
            raise ValueError(f"align takes at most {WINDOW_S:g} s of audio, got {len(pcm) / d.rate:.1f} s")
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        tokens = self.tokenizer.encode(text.strip())
        if len(tokens) + 3 > d.max_tokens:
            raise ValueError(f"text is {len(tokens)} tokens; the model aligns at most {d.max_tokens - 3}")
        enc = self._encode(pcm)
        if not tokens or len(enc) == 0:
            return []
        if language is None:
            language = self._detect_language(self.decoder.logits(enc, [d.bos])[0])
        tag = d.language_id(language)
        logits, weights = self.decoder.logits_and_weights(enc, [d.bos, tag] + tokens)
        rows, top, log_mass = _text_logprobs(logits[1:-1], d.text_vocab)  # row i predicts tokens[i]
        probs = np.exp((rows[np.arange(len(tokens)), tokens].astype(np.float64) - top) - log_mass)
        return [Word.coerce(w) for w in self._word_times(pcm, len(enc), weights, tokens, probs, open_end=False)]

    def decode(self, audio, language: str | None = None, keywords=None, beams: int = BEAMS) -> Decoding:
        """One window (<= 30 s) without the silence gate: its tokens, text and language.

        The token-level view of `transcribe`, for scoring and tests."""
        pcm = self.load_audio(audio)
        if len(pcm) > int(WINDOW_S * self.dims.rate):
            raise ValueError(f"decode takes at most {WINDOW_S:g} s of audio; use transcribe for longer clips")
        r = self._decode(pcm, self.check_language(language), self._biaser(keywords), _check_beams(beams), False)
        return Decoding(tokens=[int(t) for t in r["tokens"]], text=r["text"], language=r["language"])

    def transcribe(self, audio, language: str | None = None, keywords=None, word_timestamps: bool = False,
                   beams: int = BEAMS, by: str = READ_BY[0],
                   progress: Callable[[float, float], None] | None = None) -> Transcription:
        """Transcribe a clip of any length.

        Returns a `Transcription`: text, language, ttft_ms, decode_tps, and with word_timestamps
        its `Word`s (word, start, end, probability; seconds from the clip start). Audio the silence gate
        (§8) stops returns empty text and language without decoding.

        by="utterances" (the default) reads up to 30 s in one pass as the engine does (§8), and
        longer audio cut at its pauses, in passes of whole utterances (a model whose card reads one
        sentence a pass: whole sentences, however many pauses they hold): what a file of many
        sentences wants. by="windows" runs the guide's passes exactly: up to 30 s in one, longer audio in
        30 s windows (§8). `progress(done_s, total_s)` is called as the audio is read.
        """
        if by not in READ_BY:
            raise ValueError(f"by must be one of {', '.join(map(repr, READ_BY))}, got {by!r}")
        language = self.check_language(language)
        beams = _check_beams(beams)
        biaser = self._biaser(keywords)
        pcm = self.load_audio(audio)
        d = self.dims
        window = int(WINDOW_S * d.rate)
        total_s = len(pcm) / d.rate
        if by == "utterances" and (self.sentences_per_pass is not None or len(pcm) > window):
            return self._transcribe_utterances(pcm, language, biaser, beams, word_timestamps, progress)
        if not self._gate(pcm):
            if progress is not None:
                progress(total_s, total_s)
            return _result("", "", 0.0, 0.0, 0, [] if word_timestamps else None)
        if len(pcm) <= window:
            r = self._decode(pcm, language, biaser, beams, word_timestamps)
            if progress is not None:
                progress(total_s, total_s)
            return _result(r["text"], r["language"], r["ttft"], r["decode_s"], len(r["tokens"]),
                           r["words"] if word_timestamps else None)
        return self._transcribe_long(pcm, language, biaser, beams, word_timestamps, progress)

    def _transcribe_utterances(self, pcm, language, biaser, beams, word_timestamps, progress) -> Transcription:
        """The clip cut at its pauses and read in passes of whole utterances: as many as one
        window holds, or, for a model whose card reads one sentence a pass (`sentences_per_pass`),
        up to the utterance whose reading ends a sentence, so that a sentence said with pauses
        inside it is read whole (faster-whisper's VAD batching packs speech the same way). A span
        longer than a window is read in windows; the language is detected on the first pass with
        speech, then held."""
        d = self.dims
        total_s = len(pcm) / d.rate
        stats = {"language": language, "ttft": None, "decode_s": 0.0, "tokens": 0}
        words: list[Word] = []
        spans = utterance_spans(pcm, d.rate)
        window = int(WINDOW_S * d.rate)

        def read(a: int, b: int) -> list[Word]:
            # framed as a stream's pass frames an utterance (digital silence around it)
            first, last = sound_span(pcm[a:b], d.rate)
            if last <= first:
                return []
            closed = close_pauses(pcm[a + first:a + last], d.rate)   # a sentence said with pauses, as said
            part = self._transcribe_long(closed.audio, stats["language"], biaser, beams, True, None, stats)
            offset = (a + first) / d.rate
            return [replace(w, start=round(closed.original(w.start) + offset, 3),
                            end=round(closed.original(w.end) + offset, 3)) for w in part.words or ()]

        i = 0
        while i < len(spans):
            j = i
            fits = lambda k: k < len(spans) and spans[k][1] - spans[i][0] <= window  # noqa: E731
            while self.sentences_per_pass is None and fits(j + 1):   # as many as a window holds
                j += 1
            part = read(spans[i][0], spans[j][1])
            while not self._whole(part) and fits(j + 1):                # else up to a sentence's end
                j += 1
                part = read(spans[i][0], spans[j][1])
            words += part
            i = j + 1
            if progress is not None:
                progress(spans[j][1] / d.rate, total_s)
        if progress is not None:
            progress(total_s, total_s)
        return _result(" ".join(w["word"] for w in words), stats["language"] or "", stats["ttft"] or 0.0,
                       stats["decode_s"], stats["tokens"], words if word_timestamps else None)

    def _whole(self, words: list[Word]) -> bool:
        """Whether a reading holds as many whole sentences as the model reads in one pass (or
        nothing: there is no sentence to finish)."""
        ends = sum(ends_sentence(w.word) for w in words)
        return not words or (ends_sentence(words[-1].word) and ends >= (self.sentences_per_pass or 1))

    def _transcribe_long(self, pcm, language, biaser, beams, word_timestamps, progress=None,
                         stats=None) -> Transcription:
        """Guide §8: 30 s windows, each cut at its last sentence end / word end; next starts there.
        `stats` carries the language and timings across calls (utterances)."""
        d = self.dims
        stats = stats if stats is not None else {"language": language, "ttft": None, "decode_s": 0.0, "tokens": 0}
        total_s = len(pcm) / d.rate

        def window(start_s: float, length_s: float) -> list[dict]:
            start = int(round(start_s * d.rate))
            chunk = pcm[start:start + int(round(length_s * d.rate))]
            if not self._gate(chunk):
                return []
            r = self._decode(chunk, stats["language"], biaser, beams, True, open_end=start + len(chunk) < len(pcm))
            stats["language"] = stats["language"] or r["language"]  # detected once, then held
            stats["ttft"] = r["ttft"] if stats["ttft"] is None else stats["ttft"]
            stats["decode_s"] += r["decode_s"]
            stats["tokens"] += len(r["tokens"])
            if progress is not None:
                progress(min(total_s, start_s + length_s), total_s)
            return r["words"]

        words = [{**w, "start": round(w["start"], 3), "end": round(w["end"], 3)}
                 for w in transcribe_long(len(pcm) / d.rate, window, WINDOW_S)]
        return _result(" ".join(w["word"] for w in words), stats["language"] or "", stats["ttft"] or 0.0,
                       stats["decode_s"], stats["tokens"], words if word_timestamps else None)

    def transcribe_words(self, audio, language: str | None = None, keywords=None, beams: int | None = None,
                         open_end: bool = False, prefix: str = "", draft: Sequence[int] = (),
                         memo: PassMemo | None = None) -> dict:
        """One streaming pass (<= 30 s): {"speech", "language", "text", "words", "tokens"} with word
        times; open_end: the audio stops mid-speech (no pause after it yet); prefix: words the audio
        is known to begin with (a stream's committed words, with a language): read in one teacher-
        forced run instead of searched for again, and returned at the head of the words. draft: the
        `tokens` of a reading of the same audio's start (the pass before): a greedy pass (beams=1,
        no keywords) checks them first instead of stepping through them (the text is the same),
        all but their last word (the word the audio cut, which a pass hearing more mostly reads
        otherwise: stepped through, not checked and then read again). memo: the stream's record of
        its last pass (`streaming.PassMemo`): a pass that hears the same samples reuses its encoder
        output, and with the same settings its reading (the same result, not computed again)."""
        pcm = self.load_audio(audio)
        language = self.check_language(language)
        beams = _check_beams(beams or BEAMS)
        biaser = self._biaser(keywords)
        guess = _check_draft(draft, self.dims.text_vocab)
        settings = (language, tuple(parse_keywords(keywords)), beams, bool(open_end), prefix)
        # hears() first: it also records the samples a later pass is compared with
        if memo is not None and memo.hears(pcm) and memo.settings == settings and memo.reading is not None:
            return _copy_reading(memo.reading)
        reading = self._read_words(pcm, language, biaser, beams, open_end, prefix, guess, memo)
        if memo is not None:
            memo.settings, memo.reading = settings, reading
            reading = _copy_reading(reading)
        return reading

    def _read_words(self, pcm: np.ndarray, language: str | None, biaser, beams: int, open_end: bool,
                    prefix: str, guess: list[int], memo: PassMemo | None) -> dict:
        """`transcribe_words` on checked arguments (guess: the draft's token ids)."""
        if not self._gate(pcm):
            return {"speech": False, "language": language or "", "text": "", "words": [], "tokens": []}
        tokens = self.tokenizer.encode(prefix) if prefix and language else []
        guess = guess[len(tokens):] if guess[:len(tokens)] == tokens else []
        starts = [i for i, first in enumerate(_word_starts(guess, self.tokenizer)) if first]
        guess = guess[:starts[-1]] if starts else []
        r = self._decode(pcm[-int(WINDOW_S * self.dims.rate):], language, biaser, beams, True, open_end=open_end,
                         prefix=tokens, draft=guess, memo=memo)
        return {"speech": True, "language": r["language"], "text": r["text"], "words": r["words"],
                "tokens": [int(t) for t in r["tokens"]]}

    # ---- streaming -------------------------------------------------------------------------
    def open_stream(self, language: str | None = None, keywords=None, step_s: float = 1.0,
                    beams: int | None = None):
        """A live stream (docs/streaming.md): feed(audio) / finalize() / finish() -> StreamUpdates.
        beams: the width of the passes that commit words (None: BEAMS)."""
        return StreamSession(self, language=language, keywords=keywords, step_s=step_s,
                             beams=None if beams is None else _check_beams(beams))

    def restore_stream(self, state: dict, keywords=None, beams: int | None = None):
        """A live stream that continues another's `checkpoint()` (feed it the audio from the
        checkpoint's `buffer_start_s` on). Raises ValueError for a state it cannot continue."""
        return StreamSession.restore(self, state, keywords=keywords,
                                     beams=None if beams is None else _check_beams(beams))

    def stream(self, chunks, language: str | None = None, keywords=None, step_s: float = 1.0):
        """Generator: one StreamUpdate per chunk of audio, then finish()'s (like needle.Whistle.stream)."""
        return stream_updates(self, chunks, language=language, keywords=keywords, step_s=step_s)

    def kernel_path(self) -> KernelPath:
        """The path the kernels take in this process: tier, simd path, integer products."""
        return kernel_path()

    def warmup(self) -> Warmup:
        """Compile (or load from the cache) every kernel a pass or a stream runs, on a short
        synthetic clip."""
        t0 = time.perf_counter()
        signal = frontend.warm_signal(self.dims.rate)
        enc = self._encode(signal)
        state = self.decoder.start(enc, beams=BEAMS)
        logits = self.decoder.feed(state, [self.dims.bos, self.dims.first_tag])[0, -1]
        beam_search(logits, self.decoder.advance_fn(state), first_tag=self.dims.first_tag, eos=self.dims.eos,
                    max_len=min(self.dims.max_tokens, 8), beams=BEAMS)
        self.decoder.cross_attention_weights(enc, [self.dims.bos, self.dims.first_tag, 5])
        self.align(signal, "a", language=self.dims.languages[0])   # word times: §8's path
        return Warmup(time.perf_counter() - t0, compiled_here())


def _check_draft(draft, text_vocab: int) -> list[int]:
    """A pass's `draft` as a list of text token ids; refuses anything else by name."""
    if isinstance(draft, (str, bytes)) or not hasattr(draft, "__iter__"):
        raise ValueError(f"draft must be a sequence of integer token ids (a pass's `tokens`), got {draft!r}")
    ids = list(draft)
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"draft must be a sequence of integer token ids (a pass's `tokens`), got {ids!r}")
    ids = [int(t) for t in ids]
    if any(not 0 <= t < text_vocab for t in ids):
        raise ValueError(f"draft holds ids outside the text ids [0, {text_vocab}): {ids!r}")
    return ids


def _copy_reading(reading: dict) -> dict:
    """A pass's result for its caller: its word dicts and token list its own."""
    return {**reading, "words": [dict(w) for w in reading["words"]], "tokens": list(reading["tokens"])}


def _check_beams(beams) -> int:
    if isinstance(beams, bool) or not isinstance(beams, (int, np.integer)) or not 1 <= beams <= MAX_BEAMS:
        raise ValueError(f"beams must be an integer from 1 to {MAX_BEAMS}, got {beams!r}")
    return int(beams)


def _result(text, language, ttft_s, decode_s, tokens, words) -> Transcription:
    return Transcription(text=text, language=language, ttft_ms=round(ttft_s * 1000.0, 3),
                         decode_tps=round(tokens / decode_s, 3) if decode_s > 0 else 0.0,
                         words=None if words is None else tuple(Word.coerce(w) for w in words))
