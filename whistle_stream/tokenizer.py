"""SentencePiece-BPE tokenizer read from the RAW `tokenizer` record of a .cact file.

The blob (format in the docstring of `needle/model/export.py`) is little-endian:

    header  u32 n_pieces, u32 pad, u32 eos, u32 bos, u32 unk, u8 add_dummy_prefix,
            u8 byte_fallback, u16 padding                                     (24 bytes)
    then n_pieces records in id order: f32 score, u8 type, u16 surface_len,
            surface_len bytes of UTF-8

Types: 0 NORMAL, 1 UNKNOWN, 2 CONTROL, 3 USER_DEFINED, 4 BYTE (`<0xXX>`). The Whistle file
appends its language tags (`<|en|>` ... `<|pl|>`, guide §4) as trailing USER_DEFINED pieces.

`encode` reproduces `sentencepiece`'s BPE encoder on the *normalised* text: the blob carries no
normaliser, so text goes in as given (no NFKC, no whitespace collapsing). For a model trained with
`normalization_rule_name="identity"` and `remove_extra_whitespaces=False` the ids are identical to
`sentencepiece` on any text; for the default `nmt_nfkc` model they are identical on text that is
already normal (NFKC, single inner spaces, no leading/trailing space).
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Iterable

from .dims import check_language
from .errors import ModelFormatError
from .rules import WORD_START as SPACE

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 0, 1, 2, 3, 4
_TYPE_NAMES = ("NORMAL", "UNKNOWN", "CONTROL", "USER_DEFINED", "BYTE")


_HEADER = struct.Struct("<IIIIIBBH")
_RECORD = struct.Struct("<fBH")
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")
_LANGUAGE_TAG = re.compile(r"<\|([^|<>]+)\|>")


class Tokenizer:
    """Encode text to token ids and decode ids to text, as sentencepiece BPE does.

    Build it with `Tokenizer.from_blob(blob)`. Ids are ints in `[0, vocab_size)`.
    """

    def __init__(self, pieces: list[str], scores: list[float], types: list[int], *,
                 pad: int, eos: int, bos: int, unk: int,
                 add_dummy_prefix: bool, byte_fallback: bool):
        self._pieces = tuple(pieces)
        self._scores = tuple(scores)
        self._types = tuple(types)
        self.pad, self.eos, self.bos, self.unk = pad, eos, bos, unk
        self.add_dummy_prefix = add_dummy_prefix
        self.byte_fallback = byte_fallback

        # sentencepiece keeps two maps: mergeable pieces (NORMAL, USER_DEFINED) and reserved ones
        # (CONTROL, UNKNOWN, BYTE); a lookup tries the reserved map first. First id wins on duplicates.
        self._mergeable: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self._byte_ids: dict[int, int] = {}
        user_defined: dict[str, list[str]] = {}
        for i, (piece, kind) in enumerate(zip(self._pieces, self._types)):
            if kind in (NORMAL, USER_DEFINED):
                self._mergeable.setdefault(piece, i)
            else:
                self._reserved.setdefault(piece, i)
            if kind == BYTE:
                self._byte_ids.setdefault(int(piece[3:5], 16), i)
            if kind == USER_DEFINED and piece:
                user_defined.setdefault(piece[0], []).append(piece)
        # user-defined pieces by first character, longest first: the greedy prefix match
        self._user_defined = {c: sorted(set(ps), key=len, reverse=True) for c, ps in user_defined.items()}

        tags = []
        for i in range(len(self._pieces) - 1, -1, -1):
            match = _LANGUAGE_TAG.fullmatch(self._pieces[i])
            if self._types[i] != USER_DEFINED or match is None:
                break
            tags.append(match.group(1))
        self.languages: tuple[str, ...] = tuple(reversed(tags))

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_blob(cls, blob: bytes | bytearray | memoryview) -> "Tokenizer":
        """Parse the RAW tokenizer blob; raise `ModelFormatError` naming what is wrong."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise ModelFormatError(f"tokenizer blob must be bytes, got {type(blob).__name__}")
        blob = bytes(blob)
        if len(blob) < _HEADER.size:
            raise ModelFormatError(
                f"tokenizer blob is {len(blob)} bytes, shorter than its {_HEADER.size}-byte header")
        n, pad, eos, bos, unk, dummy, fallback, _ = _HEADER.unpack_from(blob, 0)
        if n == 0:
            raise ModelFormatError("tokenizer blob declares 0 pieces")
        room = (len(blob) - _HEADER.size) // _RECORD.size
        if n > room:
            raise ModelFormatError(
                f"tokenizer blob declares {n} pieces but its {len(blob)} bytes hold at most {room}")
        for name, value in (("pad", pad), ("eos", eos), ("bos", bos), ("unk", unk)):
            if value >= n:
                raise ModelFormatError(f"tokenizer {name} id {value} is outside the {n} pieces")
        for name, value in (("add_dummy_prefix", dummy), ("byte_fallback", fallback)):
            if value > 1:
                raise ModelFormatError(f"tokenizer flag {name} is {value}; accepted values are 0 and 1")

        pieces, scores, types = [], [], []
        off = _HEADER.size
        for i in range(n):
            if off + _RECORD.size > len(blob):
                raise ModelFormatError(
                    f"tokenizer blob truncated at piece {i} of {n}: record header at byte {off} "
                    f"runs past its {len(blob)} bytes")
            score, kind, length = _RECORD.unpack_from(blob, off)
            off += _RECORD.size
            if kind > BYTE:
                raise ModelFormatError(
                    f"tokenizer piece {i} has type {kind}; accepted types are 0..4 ({', '.join(_TYPE_NAMES)})")
            if off + length > len(blob):
                raise ModelFormatError(
                    f"tokenizer blob truncated at piece {i} of {n}: surface of {length} bytes at byte "
                    f"{off} runs past its {len(blob)} bytes")
            try:
                piece = blob[off:off + length].decode("utf-8")
            except UnicodeDecodeError as e:
                raise ModelFormatError(f"tokenizer piece {i} is not valid UTF-8: {e.reason}") from e
            off += length
            if kind == BYTE and _BYTE_PIECE.fullmatch(piece) is None:
                raise ModelFormatError(f"tokenizer byte piece {i} is {piece!r}; byte pieces look like <0x41>")
            if kind in (NORMAL, USER_DEFINED) and not piece:
                raise ModelFormatError(f"tokenizer piece {i} is empty")
            pieces.append(piece)
            scores.append(score)
            types.append(kind)
        if off != len(blob):
            raise ModelFormatError(
                f"tokenizer blob has {len(blob) - off} bytes after its last piece (expected exactly {off} bytes)")
        if types[unk] != UNKNOWN:
            raise ModelFormatError(f"tokenizer unk id {unk} is a {_TYPE_NAMES[types[unk]]} piece, not UNKNOWN")
        return cls(pieces, scores, types, pad=pad, eos=eos, bos=bos, unk=unk,
                   add_dummy_prefix=bool(dummy), byte_fallback=bool(fallback))

    # ------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of pieces, language tags included."""
        return len(self._pieces)

    @property
    def text_vocab(self) -> int:
        """Pieces before the trailing language tags; the first tag's id."""
        return len(self._pieces) - len(self.languages)

    def piece(self, token_id: int) -> str:
        """The surface of one id, with "▁" for spaces (e.g. "▁hello", "<0xF0>", "<|en|>")."""
        return self._pieces[self._check_id(token_id)]

    id_to_piece = piece

    def piece_to_id(self, piece: str) -> int | None:
        """The id of a piece surface, or None when the vocabulary lacks it."""
        found = self._reserved.get(piece)
        return found if found is not None else self._mergeable.get(piece)

    def score(self, token_id: int) -> float:
        return self._scores[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """True for control, unknown and user-defined pieces (language tags included)."""
        return self._types[self._check_id(token_id)] in (CONTROL, UNKNOWN, USER_DEFINED)

    def is_byte(self, token_id: int) -> bool:
        return self._types[self._check_id(token_id)] == BYTE

    def starts_word(self, token_id: int) -> bool:
        """True when the piece begins with "▁", i.e. a space precedes it in the text."""
        return self._pieces[self._check_id(token_id)].startswith(SPACE)

    def language_id(self, code: str) -> int:
        """The id of the language tag `<|code|>`; ValueError names the accepted codes."""
        return self.text_vocab + self.languages.index(check_language(code, self.languages))

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._pieces):
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {len(self._pieces)})")
        return token_id

    # ------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no <s>/</s> added). "" encodes to []."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        if not text:
            return []
        normalized = text.replace(" ", SPACE)
        if self.add_dummy_prefix:
            normalized = SPACE + normalized
        ids: list[int] = []
        prev_unknown = False
        for symbol in self._bpe(self._split(normalized)):
            token = self._reserved.get(symbol)
            if token is None:
                token = self._mergeable.get(symbol, self.unk)
            unknown = self._types[token] == UNKNOWN
            if unknown and self.byte_fallback:
                ids.extend(self._byte_ids.get(b, self.unk) for b in symbol.encode("utf-8"))
            elif not (unknown and prev_unknown):  # without byte fallback a run of unknowns is one <unk>
                ids.append(token)
            prev_unknown = unknown and not self.byte_fallback
        return ids

    def _split(self, normalized: str) -> list[tuple[str, bool]]:
        """Initial symbols: a user-defined piece (longest match, frozen) or one character."""
        symbols = []
        i, n = 0, len(normalized)
        while i < n:
            for candidate in self._user_defined.get(normalized[i], ()):
                if normalized.startswith(candidate, i):
                    symbols.append((candidate, True))
                    i += len(candidate)
                    break
            else:
                symbols.append((normalized[i], False))
                i += 1
        return symbols

    def _bpe(self, symbols: list[tuple[str, bool]]) -> list[str]:
        """sentencepiece's BPE: merge the adjacent pair whose concatenation is a piece with the
        highest score (ties: leftmost), until no pair is a piece. Frozen symbols never merge."""
        text = [s for s, _ in symbols]
        frozen = [f for _, f in symbols]
        n = len(text)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        agenda: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length)

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0 or frozen[left] or frozen[right]:
                return
            merged = text[left] + text[right]
            token = self._mergeable.get(merged)
            if token is not None:
                heapq.heappush(agenda, (-self._scores[token], left, right, len(merged)))

        for i in range(1, n):
            push(i - 1, i)
        while agenda:
            _, left, right, size = heapq.heappop(agenda)
            # stale entry: one side was merged away or grew since the pair was pushed
            if not text[left] or not text[right] or len(text[left]) + len(text[right]) != size:
                continue
            text[left] += text[right]
            text[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        return [t for t in text if t]

    # ------------------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: byte pieces reassembled as UTF-8 (invalid runs become U+FFFD), control and
        unknown pieces skipped, "▁" read as a space, and the dummy-prefix space removed."""
        out = bytearray()
        for token in ids:
            token = self._check_id(int(token))
            kind = self._types[token]
            if kind == BYTE:
                out.append(int(self._pieces[token][3:5], 16))
            elif kind not in (CONTROL, UNKNOWN):
                out += self._pieces[token].encode("utf-8")
        text = out.decode("utf-8", "replace").replace(SPACE, " ")
        if self.add_dummy_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, languages={self.languages}, "
                f"bos={self.bos}, eos={self.eos})")
