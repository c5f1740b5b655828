"""Subtitle cues from word times, and the SRT / WebVTT files, read back by PyPI's parsers."""

from __future__ import annotations

import io

import pytest
import srt as srt_parser
import webvtt

from whistle_stream.subtitles import MAX_CUE_S, MAX_LINE_CHARS, MAX_LINES, make_cues, srt, vtt


def words_of(text: str, start: float = 0.0, each: float = 0.4, gap: float = 0.05) -> list[dict]:
    out, t = [], start
    for w in text.split():
        out.append({"word": w, "start": round(t, 3), "end": round(t + each, 3)})
        t += each + gap
    return out


def test_cues_break_at_sentence_ends_pauses_length_and_duration():
    words = words_of("Turn on the lights. Set a timer for ten minutes.")
    words += words_of("Call Diana tomorrow at half past seven in the evening please and thank you "
                      "very much for everything today my friend", start=words[-1]["end"] + 2.0)
    cues = make_cues(words)
    assert [c.text for c in cues[:2]] == ["Turn on the lights.", "Set a timer for ten minutes."]
    for c in cues:
        assert len(c.lines) <= MAX_LINES and all(len(line) <= MAX_LINE_CHARS for line in c.lines)
        assert c.end - c.start <= MAX_CUE_S + 1e-9
    for a, b in zip(cues, cues[1:]):
        assert a.end <= b.start            # no overlap
    assert " ".join(" ".join(c.lines) for c in cues).split() == [w["word"] for w in words]


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_the_files_parse_and_their_times_are_the_words(fmt):
    words = words_of("One two three. Four five six seven.", start=1.25)
    cues = make_cues(words)
    text = srt(cues) if fmt == "srt" else vtt(cues)
    if fmt == "srt":
        parsed = [(c.start.total_seconds(), c.end.total_seconds(), c.content) for c in srt_parser.parse(text)]
    else:
        parsed = [(_seconds(c.start), _seconds(c.end), c.text) for c in webvtt.from_buffer(io.StringIO(text))]
    assert [p[2] for p in parsed] == ["One two three.", "Four five six seven."]
    assert parsed[0][0] == pytest.approx(words[0]["start"]) and parsed[0][1] == pytest.approx(words[2]["end"])
    assert parsed[1][0] == pytest.approx(words[3]["start"]) and parsed[1][1] == pytest.approx(words[-1]["end"])


def _seconds(stamp: str) -> float:
    h, m, s = stamp.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def test_no_words_make_an_empty_but_valid_file():
    assert srt(make_cues([])) == ""
    assert vtt(make_cues([])) == "WEBVTT\n\n"
    assert list(webvtt.from_buffer(io.StringIO(vtt([])))) == []
