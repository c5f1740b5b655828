"""What the engine hands its callers: frozen, typed results (as whisper's `DecodingResult`).

    r = Whistle().transcribe("clip.wav", word_timestamps=True)   # Transcription
    r.text, r.language, r.words[0].start
    update = stream.feed(pcm)                                     # StreamUpdate
    update.text, update.pending, update.words

Field names are the keys of the dicts earlier versions returned, and each result can still be
read by name (`r["text"]`, `r.get("words")`, `dict(r)`) so that code written against those dicts
keeps working; `to_dict()` gives the JSON shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Iterator


class _ByName:
    """Read access by field name, as the engine's dicts had it."""

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]  # type: ignore[arg-type]

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def items(self) -> list[tuple[str, Any]]:
        return [(k, getattr(self, k)) for k in self.keys()]

    def values(self) -> list[Any]:
        return [getattr(self, k) for k in self.keys()]


@dataclass(frozen=True)
class Word(_ByName):
    """One word; times in seconds (from the clip's start, or from a stream's)."""

    word: str
    start: float
    end: float
    probability: float = 1.0

    @classmethod
    def coerce(cls, item: "Word | dict") -> "Word":
        """A Word from a Word or a {"word", "start", "end"[, "probability"]} dict."""
        if isinstance(item, Word):
            return item
        if not isinstance(item, dict):
            raise TypeError(f"words must be Word objects or dicts with word/start/end, got {type(item).__name__}")
        try:
            return cls(str(item["word"]), float(item["start"]), float(item["end"]),
                       float(item.get("probability", 1.0)))
        except KeyError as e:
            raise ValueError(f"a word dict needs the keys word, start and end; missing {e}") from e

    def rounded(self) -> "Word":
        """Times rounded to the microsecond, as a stream's `received` is (rounding both the same way
        keeps a word that ends with the audio within what was received)."""
        return replace(self, start=round(float(self.start), 6), end=round(float(self.end), 6))

    def to_dict(self) -> dict:
        return asdict(self.rounded())


def _words(words) -> tuple[Word, ...]:
    return tuple(Word.coerce(w) for w in words)


@dataclass(frozen=True)
class Transcription(_ByName):
    """`Whistle.transcribe`: the text, its language (detected unless given), the time to the first
    token and the decoding rate, and with word_timestamps the words (None without)."""

    text: str
    language: str
    ttft_ms: float
    decode_tps: float
    words: tuple[Word, ...] | None = None

    def keys(self) -> list[str]:
        return [k for k in super().keys() if k != "words" or self.words is not None]

    def to_dict(self) -> dict:
        out = {"text": self.text, "language": self.language, "ttft_ms": self.ttft_ms, "decode_tps": self.decode_tps}
        if self.words is not None:
            out["words"] = [asdict(w) for w in self.words]
        return out


@dataclass(frozen=True)
class Decoding(_ByName):
    """`Whistle.decode`: one window's tokens after the prompt, their text, and the language."""

    tokens: list[int]   # a list, as the reference's decode gives them (compared with lists)
    text: str
    language: str

    def to_dict(self) -> dict:
        return {"tokens": list(self.tokens), "text": self.text, "language": self.language}


@dataclass(frozen=True)
class StreamUpdate(_ByName):
    """What one call of a live stream (`feed`, `finalize`, `finish`) returns: the text it committed
    (opening with a space when words were committed before it, so a stream's pieces concatenate
    to its transcript) and those words, the unconfirmed tail (`pending`), the language, the
    seconds received, the pass time of the call (0 when no pass ran) and the revision, which
    grows whenever committed or pending text changed."""

    text: str
    words: tuple[Word, ...]
    pending: str
    language: str
    received: float
    pass_ms: float
    revision: int

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.keys() if k != "words"},
                "words": [w.to_dict() for w in self.words]}


def stream_update(text: str = "", words=(), pending: str = "", language: str = "", received: float = 0.0,
                  pass_ms: float = 0.0, revision: int = 0) -> StreamUpdate:
    """A StreamUpdate from plain values (words as Words or dicts)."""
    return StreamUpdate(text, _words(words), pending, language, float(received), float(pass_ms), int(revision))


@dataclass(frozen=True)
class Warmup:
    """What an engine's warm-up did: the seconds it took and how many kernel signatures it
    compiled (0: every kernel came from the cache; with worker processes, their sum)."""

    seconds: float
    compiled: int


@dataclass(frozen=True)
class KernelPath:
    """What the kernels run as in this process: the tier compiled for (None: the host CPU), the
    5-row products' simd path, and whether the encoder's and the decoder's products are integer."""

    machine: str
    tier: str | None
    simd: str
    integer_encoder: bool
    integer_decoder: bool

    def __str__(self) -> str:
        where = {(True, True): "encoder and decoder", (True, False): "encoder"}.get(
            (self.integer_encoder, self.integer_decoder), "none")
        return (f"{self.machine} {self.tier or 'host CPU'}, simd {self.simd}, "
                f"integer products: {where}")
