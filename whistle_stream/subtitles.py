"""Subtitles from word times: cues of a readable length and duration, written as SRT or WebVTT.

    cues = make_cues(words)        # words: [{"word", "start", "end"}, ...] in order, seconds
    srt(cues), vtt(cues)           # the file's text

A cue holds at most `MAX_LINES` lines of at most `MAX_LINE_CHARS` characters and lasts at most
`MAX_CUE_S`; a new cue starts after a sentence end or a pause of `CUE_GAP_S`, so a cue never runs
across a silence. Cue times are the first word's start and the last word's end (at least
`MIN_CUE_S`, never overlapping the next cue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .rules import ends_sentence

MAX_LINE_CHARS = 42   # the common broadcast guideline for one subtitle line
MAX_LINES = 2
MAX_CUE_S = 6.0
MIN_CUE_S = 0.5
CUE_GAP_S = 1.0       # silence between two words that starts a new cue


@dataclass(frozen=True)
class Cue:
    start: float
    end: float
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _wrap(words: Sequence[str], width: int) -> list[str]:
    lines: list[str] = []
    for w in words:
        if lines and len(lines[-1]) + 1 + len(w) <= width:
            lines[-1] += " " + w
        else:
            lines.append(w)
    return lines


def make_cues(words: Iterable[Mapping], *, max_line_chars: int = MAX_LINE_CHARS, max_lines: int = MAX_LINES,
              max_cue_s: float = MAX_CUE_S, pause_s: float = CUE_GAP_S) -> list[Cue]:
    """Group timed words into cues (see the module docstring)."""
    groups: list[list[Mapping]] = []
    for w in words:
        text = str(w["word"]).strip()
        if not text:
            continue
        w = {"word": text, "start": float(w["start"]), "end": float(w["end"])}
        current = groups[-1] if groups else None
        if current is not None:
            last = current[-1]
            fits = len(_wrap([x["word"] for x in current] + [text], max_line_chars)) <= max_lines
            if (fits and w["end"] - current[0]["start"] <= max_cue_s and w["start"] - last["end"] < pause_s
                    and not ends_sentence(last["word"])):
                current.append(w)
                continue
        groups.append([w])
    cues = []
    for i, group in enumerate(groups):
        start, end = group[0]["start"], max(group[-1]["end"], group[0]["start"] + MIN_CUE_S)
        if i + 1 < len(groups):
            end = min(end, groups[i + 1][0]["start"])
        end = max(end, start + 0.001)
        cues.append(Cue(start, end, tuple(_wrap([x["word"] for x in group], max_line_chars))))
    return cues


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(max(0.0, seconds) * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(cues: Sequence[Cue]) -> str:
    """SubRip text: numbered cues, `HH:MM:SS,mmm --> HH:MM:SS,mmm`."""
    blocks = [f"{i}\n{_stamp(c.start, ',')} --> {_stamp(c.end, ',')}\n{c.text}\n" for i, c in enumerate(cues, 1)]
    return "\n".join(blocks)


def vtt(cues: Sequence[Cue]) -> str:
    """WebVTT text: the header, then `HH:MM:SS.mmm --> HH:MM:SS.mmm` cues."""
    blocks = [f"{_stamp(c.start, '.')} --> {_stamp(c.end, '.')}\n{c.text}\n" for c in cues]
    return "WEBVTT\n\n" + "\n".join(blocks)
