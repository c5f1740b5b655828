// Browser captions for whistle-stream: microphone -> AudioWorklet -> 16-bit PCM -> /v1/listen.
// Committed text is appended and never revised; the pending tail is shown dimmed after it.
// The page is served by the server itself, so the WebSocket goes back to the same host.
// A ?token=... in the page URL is passed on to the server (browsers cannot set headers).
"use strict";

const BLOCK_SECONDS = 0.1; // audio per WebSocket frame

// Runs on the audio thread: forwards each 128-sample render quantum of channel 0.
const WORKLET = `
class Tap extends AudioWorkletProcessor {
  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) this.port.postMessage(channel.slice(0));
    return true;
  }
}
registerProcessor("tap", Tap);
`;

const ui = {
  start: document.getElementById("start"),
  stop: document.getElementById("stop"),
  language: document.getElementById("language"),
  keywords: document.getElementById("keywords"),
  status: document.getElementById("status"),
  captions: document.getElementById("captions"),
};

let socket = null, context = null, media = null, node = null;

function setStatus(text, isError) {
  ui.status.textContent = text;
  ui.status.className = isError ? "error" : "";
}

function currentLine() {
  const p = ui.captions.lastElementChild;
  return { committed: p.querySelector(".committed"), pending: p.querySelector(".pending") };
}

function newLine() {
  const p = document.createElement("p");
  p.innerHTML = '<span class="committed"></span><span class="pending"></span>';
  ui.captions.appendChild(p);
  while (ui.captions.children.length > 50) ui.captions.removeChild(ui.captions.firstElementChild);
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

function listenUrl(rate) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const params = new URLSearchParams({ sample_rate: String(rate), encoding: "pcm_s16le" });
  if (ui.language.value) params.set("language", ui.language.value);
  for (const k of ui.keywords.value.split(",").map((s) => s.trim()).filter(Boolean)) params.append("keyword", k);
  const token = new URLSearchParams(location.search).get("token");
  if (token) params.set("token", token);
  return `${scheme}//${location.host}/v1/listen?${params}`;
}

function onMessage(event) {
  const m = JSON.parse(event.data);
  const line = currentLine();
  if (m.type === "ready") {
    setStatus(`listening (${m.model})`);
    if (ui.language.options.length === 1) {
      for (const code of m.languages) ui.language.add(new Option(code, code));
    }
  } else if (m.type === "partial") {
    line.pending.textContent = m.pending;
  } else if (m.type === "committed") {
    line.committed.textContent += m.text;
    if (m.end_of_speech) { line.pending.textContent = ""; newLine(); }
  } else if (m.type === "final") {
    line.pending.textContent = "";
    if (line.committed.textContent) newLine();
    setStatus(`done: ${m.audio_seconds.toFixed(1)} s of audio, language ${m.language || "-"}`);
  } else if (m.type === "error") {
    setStatus(`${m.code}: ${m.message}`, true);
  }
}

async function start() {
  ui.start.disabled = true;
  try {
    media = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
  } catch (e) {
    setStatus(`no microphone: ${e.message}`, true);
    ui.start.disabled = false;
    return;
  }
  context = new AudioContext();
  const url = URL.createObjectURL(new Blob([WORKLET], { type: "text/javascript" }));
  await context.audioWorklet.addModule(url);
  node = new AudioWorkletNode(context, "tap");
  context.createMediaStreamSource(media).connect(node);

  socket = new WebSocket(listenUrl(context.sampleRate));
  socket.binaryType = "arraybuffer";
  socket.onmessage = onMessage;
  socket.onclose = (e) => {
    if (e.code === 4401) setStatus("authentication failed: add ?token=... to the page URL", true);
    else if (e.code === 1013) setStatus("the server is full; try again shortly", true);
    else if (e.code !== 1000) setStatus(`disconnected (${e.code} ${e.reason})`, true);
    stopAudio();
  };
  socket.onerror = () => setStatus("cannot reach the server", true);

  const block = Math.round(context.sampleRate * BLOCK_SECONDS);
  let pending = [], count = 0;
  node.port.onmessage = (e) => {
    pending.push(e.data);
    count += e.data.length;
    if (count < block || !socket || socket.readyState !== WebSocket.OPEN) return;
    const joined = new Float32Array(count);
    let offset = 0;
    for (const part of pending) { joined.set(part, offset); offset += part.length; }
    pending = []; count = 0;
    socket.send(toPcm16(joined));
  };
  ui.stop.disabled = false;
  setStatus("connecting");
}

function stopAudio() {
  if (node) { node.port.onmessage = null; node.disconnect(); node = null; }
  if (media) { media.getTracks().forEach((t) => t.stop()); media = null; }
  if (context) { context.close(); context = null; }
  ui.start.disabled = false;
  ui.stop.disabled = true;
}

function stop() {
  if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "close" }));
  stopAudio();
}

ui.start.addEventListener("click", start);
ui.stop.addEventListener("click", stop);
