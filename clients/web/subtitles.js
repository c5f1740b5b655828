// Subtitle cues from committed words: the rules of whistle_stream/subtitles.py (the CLI's and the
// REST endpoint's), so a page download and `whistle-stream transcribe --format srt` agree.
"use strict";

const Subtitles = (() => {
  const MAX_LINE_CHARS = 42, MAX_LINES = 2, MAX_CUE_S = 6.0, MIN_CUE_S = 0.5, CUE_GAP_S = 1.0;
  const CLOSERS = "\"'\u201d\u2019)]}\u00bb";
  const endsSentence = (w) => {
    let t = w.trimEnd();
    while (t && CLOSERS.includes(t[t.length - 1])) t = t.slice(0, -1);
    return /[.!?\u2026]$/.test(t);
  };
  function wrap(words) {
    const lines = [];
    for (const w of words) {
      if (lines.length && lines[lines.length - 1].length + 1 + w.length <= MAX_LINE_CHARS) lines[lines.length - 1] += " " + w;
      else lines.push(w);
    }
    return lines;
  }
  function cues(words) {
    const groups = [];
    for (const raw of words) {
      const text = String(raw.word).trim();
      if (!text) continue;
      const w = { word: text, start: Number(raw.start), end: Number(raw.end) };
      const cur = groups[groups.length - 1];
      if (cur) {
        const last = cur[cur.length - 1];
        const fits = wrap(cur.map((x) => x.word).concat([text])).length <= MAX_LINES;
        if (fits && w.end - cur[0].start <= MAX_CUE_S && w.start - last.end < CUE_GAP_S && !endsSentence(last.word)) {
          cur.push(w);
          continue;
        }
      }
      groups.push([w]);
    }
    return groups.map((g, i) => {
      let start = g[0].start, end = Math.max(g[g.length - 1].end, start + MIN_CUE_S);
      if (i + 1 < groups.length) end = Math.min(end, groups[i + 1][0].start);
      end = Math.max(end, start + 0.001);
      return { start, end, lines: wrap(g.map((x) => x.word)) };
    });
  }
  function stamp(seconds, sep) {
    let ms = Math.round(Math.max(0, seconds) * 1000);
    const h = Math.floor(ms / 3600000); ms -= h * 3600000;
    const m = Math.floor(ms / 60000); ms -= m * 60000;
    const s = Math.floor(ms / 1000); ms -= s * 1000;
    const p = (n, k) => String(n).padStart(k, "0");
    return `${p(h, 2)}:${p(m, 2)}:${p(s, 2)}${sep}${p(ms, 3)}`;
  }
  const srt = (cs) => cs.map((c, i) => `${i + 1}\n${stamp(c.start, ",")} --> ${stamp(c.end, ",")}\n${c.lines.join("\n")}\n`).join("\n");
  const vtt = (cs) => "WEBVTT\n\n" + cs.map((c) => `${stamp(c.start, ".")} --> ${stamp(c.end, ".")}\n${c.lines.join("\n")}\n`).join("\n");
  return { cues, srt, vtt };
})();
