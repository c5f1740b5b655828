// Browser captions for whistle-stream: microphone -> AudioWorklet -> 16-bit PCM -> /v1/listen.
// Committed text is appended and never revised; the pending tail is shown apart after it. The page
// is served by the server itself, so the WebSocket goes back to the same host (wss on https).
// URL parameters: token (browsers cannot set headers), overlay=1 (OBS and meeting screens),
// lines (overlay lines, default 2), size (font px), language, keywords (comma separated).
// The session resumes after a dropped connection or a server restart (docs/protocol.md,
// "Resuming a session"): the audio after the latest replay_from is kept and sent again.
"use strict";

const BLOCK_SECONDS = 0.1;            // audio per WebSocket frame
const REPLAY_LIMIT_SECONDS = 35;      // audio kept for a resume (the Python client's limit)
const RESUMABLE = new Set([1001, 1006, 1011, 1012, 1013]);
const MAX_LINES_KEPT = 500;

const params = new URLSearchParams(location.search);
const overlay = params.get("overlay") === "1";
const ui = Object.fromEntries(["start", "stop", "language", "keywords", "status", "model-note", "captions", "announce",
  "level", "copy", "download-txt", "download-srt", "download-vtt"].map((id) => [id, document.getElementById(id)]));

let socket = null, context = null, media = null, node = null;
let stopping = false, attempt = 0, resumeToken = null, rate = 16000;
const replay = { start: 0, chunks: [], bytes: 0 };   // session audio (PCM16) from replay.start bytes on
const words = [];                                     // every committed word, session times
const seqs = [];                                      // every committed seq (one run across resumes)
let transcript = "";

function setStatus(text, kind) {
  ui.status.textContent = text;
  ui.status.className = kind || "";
}

function currentLine() {
  const p = ui.captions.lastElementChild;
  return { committed: p.querySelector(".committed"), pending: p.querySelector(".pending") };
}

function newLine() {
  const p = document.createElement("p");
  p.innerHTML = '<span class="committed"></span><span class="pending"></span>';
  ui.captions.appendChild(p);
  const keep = overlay ? Math.max(1, Number(params.get("lines")) || 2) : MAX_LINES_KEPT;
  while (ui.captions.children.length > keep) ui.captions.removeChild(ui.captions.firstElementChild);
}

function scrollToEnd() {
  const near = ui.captions.scrollHeight - ui.captions.scrollTop - ui.captions.clientHeight < 120;
  if (near) ui.captions.scrollTop = ui.captions.scrollHeight;   // follow, unless the reader scrolled up
}

// Float32 [-1, 1] -> little-endian signed 16-bit PCM.
function toPcm16(samples) {
  const out = new DataView(new ArrayBuffer(samples.length * 2));
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    out.setInt16(2 * i, s < 0 ? s * 0x8000 : s * 0x7fff, true);
  }
  return out.buffer;
}

function listenUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const q = new URLSearchParams();
  if (resumeToken) {
    q.set("resume", resumeToken);
  } else {
    q.set("sample_rate", String(rate));
    q.set("encoding", "pcm_s16le");
    if (ui.language.value) q.set("language", ui.language.value);
    for (const k of ui.keywords.value.split(",").map((s) => s.trim()).filter(Boolean)) q.append("keyword", k);
  }
  const token = params.get("token");
  if (token) q.set("token", token);
  return `${scheme}//${location.host}/v1/listen?${q}`;
}

// ---- the replay buffer -------------------------------------------------------------------------
function keepAudio(buffer) {
  replay.chunks.push(buffer);
  replay.bytes += buffer.byteLength;
  const limit = REPLAY_LIMIT_SECONDS * rate * 2;
  while (replay.bytes > limit && replay.chunks.length > 1) dropFirst();
}

function dropFirst() {
  const first = replay.chunks.shift();
  replay.bytes -= first.byteLength;
  replay.start += first.byteLength;
}

function settle(seconds) {
  const offset = Math.round(seconds * rate) * 2;
  while (replay.chunks.length && replay.start + replay.chunks[0].byteLength <= offset) dropFirst();
}

function replayFrom(seconds) {
  const offset = Math.round(seconds * rate) * 2;
  if (offset < replay.start) return false;
  let at = replay.start;
  for (const chunk of replay.chunks) {
    const next = at + chunk.byteLength;
    if (next > offset) socket.send(chunk.slice(Math.max(0, offset - at)));
    at = next;
  }
  return true;
}

// ---- messages ----------------------------------------------------------------------------------
function onMessage(event) {
  const m = JSON.parse(event.data);
  const line = currentLine();
  if (m.type === "ready") {
    attempt = 0;
    if (m.resumed && !replayFrom(m.replay_from)) {   // the audio it needs is gone: start afresh
      resumeToken = null;
      socket.close(1000, "restart");
      return;
    }
    setStatus(m.resumed ? `live again (${m.model})` : `live (${m.model})`, "live");
    ui["model-note"].textContent = m.model_note || "";   // the demo model's limits, or nothing
    ui["model-note"].hidden = !m.model_note;
    if (ui.language.options.length === 1) {
      for (const code of m.languages) ui.language.add(new Option(code, code));
    }
  } else if (m.type === "partial") {
    line.pending.textContent = m.pending;
  } else if (m.type === "committed") {
    if (m.resume) { resumeToken = m.resume; settle(m.replay_from); }
    if (seqs.length && m.seq <= seqs[seqs.length - 1]) return;   // already shown
    seqs.push(m.seq);
    line.committed.textContent += m.text;
    transcript += m.text;
    for (const w of m.words) words.push(w);
    if (m.text.trim()) ui.announce.textContent = m.text.trim();   // the live region says committed text only
    for (const id of ["copy", "download-txt", "download-srt", "download-vtt"]) ui[id].disabled = !transcript.trim();
    if (m.end_of_speech) { line.pending.textContent = ""; newLine(); }
  } else if (m.type === "final") {
    if (m.resume) { resumeToken = m.resume; settle(m.replay_from); }
    if (m.reason === "shutdown") return;             // the server restarts: the session resumes
    line.pending.textContent = "";
    if (line.committed.textContent) newLine();
    setStatus(`done: ${m.audio_seconds.toFixed(1)} s of audio, language ${m.language || "-"}`);
  } else if (m.type === "error") {
    if (m.code !== "shutting_down") setStatus(`${m.code}: ${m.message}`, "error");
  }
  scrollToEnd();
}

function onClose(e) {
  socket = null;
  if (stopping) return;
  if (e.code === 4401) return fail("authentication failed: add ?token=... to the page URL");
  if (e.code === 4400) { resumeToken = null; return reconnect("the session could not resume; starting again"); }
  if (RESUMABLE.has(e.code) || (e.code === 1000 && e.reason === "restart")) return reconnect(`connection lost (${e.code})`);
  fail(`disconnected (${e.code}${e.reason ? " " + e.reason : ""})`);
}

function fail(text) {
  setStatus(text, "error");
  stopAudio();
}

function reconnect(why) {
  attempt += 1;
  const delay = Math.min(8000, 250 * 2 ** Math.min(attempt, 6)) * (0.75 + 0.5 * Math.random());
  setStatus(`reconnecting: ${why}; retry ${attempt} in ${(delay / 1000).toFixed(1)} s`, "reconnecting");
  setTimeout(() => { if (!stopping) connect(); }, delay);
}

function connect() {
  socket = new WebSocket(listenUrl());
  socket.binaryType = "arraybuffer";
  socket.onmessage = onMessage;
  socket.onclose = onClose;
}

// ---- audio -------------------------------------------------------------------------------------
async function start() {
  ui.start.disabled = true;
  stopping = false;
  if (!window.isSecureContext || !navigator.mediaDevices) {
    return fail("the microphone needs a secure page: open this page over https (or on localhost)");
  }
  try {
    // Raw audio: echo cancellation, noise suppression and gain control are for calls, and they change
    // what the model hears.
    media = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: false,
      noiseSuppression: false, autoGainControl: false } });
  } catch (e) {
    return fail(`no microphone: ${e.message}`);
  }
  context = new AudioContext();
  rate = context.sampleRate;
  await context.audioWorklet.addModule("tap-worklet.js");
  node = new AudioWorkletNode(context, "tap");
  context.createMediaStreamSource(media).connect(node);
  setStatus("connecting");
  connect();

  const block = Math.round(rate * BLOCK_SECONDS);
  let pending = [], count = 0;
  node.port.onmessage = (e) => {
    pending.push(e.data);
    count += e.data.length;
    if (count < block) return;
    const joined = new Float32Array(count);
    let offset = 0, peak = 0;
    for (const part of pending) { joined.set(part, offset); offset += part.length; }
    for (let i = 0; i < joined.length; i++) peak = Math.max(peak, Math.abs(joined[i]));
    ui.level.value = peak;
    pending = []; count = 0;
    const pcm = toPcm16(joined);
    keepAudio(pcm);                                   // kept for a resume, sent when connected
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(pcm);
  };
  ui.stop.disabled = false;
}

function stopAudio() {
  if (node) { node.port.onmessage = null; node.disconnect(); node = null; }
  if (media) { media.getTracks().forEach((t) => t.stop()); media = null; }
  if (context) { context.close(); context = null; }
  ui.level.value = 0;
  ui.start.disabled = false;
  ui.stop.disabled = true;
}

function stop() {
  stopping = true;
  if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "close" }));
  stopAudio();
}

// ---- transcript --------------------------------------------------------------------------------
function download(name, text, type) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([text], { type }));
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
}

ui.start.addEventListener("click", start);
ui.stop.addEventListener("click", stop);
ui.copy.addEventListener("click", async () => {
  try { await navigator.clipboard.writeText(transcript.trim()); setStatus("transcript copied", ui.status.className); }
  catch (e) { setStatus(`cannot copy: ${e.message}`, "error"); }
});
ui["download-txt"].addEventListener("click", () => download("captions.txt", transcript.trim() + "\n", "text/plain"));
ui["download-srt"].addEventListener("click", () => download("captions.srt", Subtitles.srt(Subtitles.cues(words)), "application/x-subrip"));
ui["download-vtt"].addEventListener("click", () => download("captions.vtt", Subtitles.vtt(Subtitles.cues(words)), "text/vtt"));

if (params.get("keywords")) ui.keywords.value = params.get("keywords");
if (params.get("language")) ui.language.add(new Option(params.get("language"), params.get("language"), true, true));
if (params.get("size")) document.documentElement.style.setProperty("--size", `${Number(params.get("size")) || 28}px`);
if (overlay) {
  document.body.classList.add("overlay");
  start();
}
