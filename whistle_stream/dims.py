"""Every size the engine uses, read once from a .cact file.

The header describes the decoder (guide §4), the 13-value audio manifest the speech side, and the
tokenizer the languages and the special ids. Nothing else in the engine hard-codes a size.
"""

from __future__ import annotations

from dataclasses import dataclass

# Fixed by the architecture rather than the header (needle's HadamardMLP and Engram).
HADAMARD_COND_RANK = 8
ENGRAM_CONV_TAPS = 4


def unknown_language(language: object, languages) -> str:
    """The one message for a language a model lacks: what was asked and what the model knows."""
    return f"unknown language {str(language)[:20]!r}; this model knows {', '.join(languages)}"


def check_language(language: str | None, languages) -> str | None:
    """`language` when the model knows it (None: detect); ValueError(unknown_language) otherwise."""
    if language is not None and (not isinstance(language, str) or language not in languages):
        raise ValueError(unknown_language(language, languages))
    return language


def hadamard_blocks(n: int) -> tuple[int, int]:
    """The two Kronecker factor sizes of an n-point Hadamard MLP (needle `_hada_blocks`)."""
    a = 1 << ((n - 1).bit_length() // 2)
    return a, n // a


@dataclass(frozen=True)
class Dims:
    # decoder (header, guide §4)
    vocab: int  # embedding rows = text pieces + language tags
    text_vocab: int
    width: int
    heads: int  # width // v_dim (guide §4: not width // qk_dim)
    kv_heads: int
    qk_dim: int
    v_dim: int
    dec_layers: int
    rope_theta: float
    max_tokens: int
    hada_n: int
    lanes: int
    taps: int
    kv_bits: int
    kv_window: int
    engram_slots: int
    engram_sub_dim: int
    engram_tables: int
    engram_conv_taps: int
    engram_dilation: int
    engram_seed_heads: int
    engram_orders: tuple[int, ...]
    engram_sites: tuple[int, ...]
    # speech side (audio manifest)
    enc_layers: int
    enc_lanes: int
    conv_kernel: int
    stem: int
    stem_stages: int
    mels: int
    rate: int
    fft: int
    win: int
    hop: int
    # tokenizer
    languages: tuple[str, ...]
    bos: int
    eos: int
    pad: int
    unk: int

    @property
    def engram_hashes(self) -> int:
        """Hash heads per n-gram order."""
        return self.engram_tables // max(1, len(self.engram_orders))

    @property
    def first_tag(self) -> int:
        """Id of the first language tag; text ids are below it."""
        return self.text_vocab

    @property
    def samples_per_frame(self) -> int:
        """Samples per encoder frame: hop x 2^stages (1280 at 16 kHz, guide §4)."""
        return self.hop * (1 << self.stem_stages)

    @property
    def frame_seconds(self) -> float:
        """Seconds per encoder frame, also the resolution of word times (80 ms, guide §4)."""
        return self.samples_per_frame / self.rate

    def language_id(self, code: str) -> int:
        """Token id of a language tag; ValueError naming the model's languages otherwise."""
        return self.first_tag + self.languages.index(check_language(code, self.languages))
