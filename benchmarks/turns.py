"""The end of a turn: from the end of speech to the final text, per dialect, and what of that time
is the silence a dialect must wait for and what is work after it.

    python benchmarks/turns.py                               # demo model, 8 commands, 1 session
    python benchmarks/turns.py --model full --sessions 8     # the full architecture (random weights)
    python benchmarks/turns.py --short                       # 3 commands (the test runs this)

Commands are held-out demo sentences of 1.5-6 s, each followed by silence, paced in real time as a
microphone sends them. The clock starts when the client has sent the end of speech: the last 10 ms
of the command over -30 dBFS. It stops at the final text. Per dialect:
- wyoming+ha-vad: Home Assistant's own VAD (before 2026.5): silence for its wait at each
  sensitivity (0.25 / 0.7 / 1.25 s), then audio-stop, to a server with --wyoming-end-of-turn false;
- wyoming: our end of turn (requires_external_vad: false), at each vad_sensitivity;
- realtime+server-vad: OpenAI Realtime with server_vad at silence_duration_ms 200 and 600;
- realtime+commit: the client commits 200 ms after the end, as Pipecat's local VAD does;
- native+finalize: our protocol's finalize at the end (a client that knows: push-to-talk; the
  audio stops there, so its words may differ from the others', which hear the silence too).
Printed: p50 and p99 of end-to-text, the silence the dialect waits (its setting), and the time
after it (end-to-text less that silence: the engine's work, VAD frames and chunking).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness.servers import ServerProcess, free_port  # noqa: E402
from harness_model import model_path  # noqa: E402

RATE = 16000
CHUNK = 1024                   # samples per send, as Home Assistant sends them (64 ms)
TAIL_S = 3.0                   # silence after each command: more than any wait
END_DB = -30.0                 # the end of speech: the last 10 ms window louder than this
HA_WAIT_S = {"aggressive": 0.25, "default": 0.7, "relaxed": 1.25}   # HA's VadSensitivity.to_seconds


def commands(n: int, seed: int = 17) -> list[tuple[np.ndarray, int, str]]:
    """n held-out demo sentences of 1.5-6 s: (audio with TAIL_S of silence, the end-of-speech
    sample, the text)."""
    from tools.demo_data import test_clips

    out = []
    for audio, text in test_clips(8 * n, seed):
        end = speech_end(audio)
        if 1.5 <= end / RATE <= 6.0:
            out.append((np.concatenate([audio[:end], np.zeros(int(TAIL_S * RATE), np.float32)]), end, text))
        if len(out) == n:
            break
    return out


PAUSE_S = 0.6                  # a pause inside a command: under Home Assistant's default wait


def with_pause(audio: np.ndarray, end: int) -> tuple[np.ndarray, int]:
    """The command with PAUSE_S of silence at its quietest 30 ms between 35 % and 65 % of the speech
    (a word boundary: "set a timer for ... twelve minutes")."""
    window = 480
    lo, hi = int(0.35 * end) // window, int(0.65 * end) // window
    rms = [float(np.sqrt(np.mean(audio[k * window:(k + 1) * window] ** 2))) for k in range(lo, hi)]
    cut = (lo + int(np.argmin(rms))) * window + window // 2
    pause = np.zeros(int(PAUSE_S * RATE), np.float32)
    return np.concatenate([audio[:cut], pause, audio[cut:]]), end + len(pause)


def speech_end(audio: np.ndarray, window: int = 160) -> int:
    frames = audio[:len(audio) // window * window].reshape(-1, window)
    loud = np.flatnonzero(20 * np.log10(np.sqrt(np.mean(frames ** 2, axis=1)) + 1e-9) > END_DB)
    return int((loud[-1] + 1) * window) if len(loud) else len(audio)


class Paced:
    """Sends a command's samples in real time; `end_at`: the clock when the end of speech went."""

    def __init__(self, audio: np.ndarray, end: int):
        self.audio, self.end, self.end_at = audio, end, None

    async def chunks(self, size: int = CHUNK, stop_after: float | None = None):
        t0 = time.perf_counter()
        self.end_at = t0 + self.end / RATE     # a VAD may hear the end sooner: the time can be negative
        for i in range(0, len(self.audio), size):
            yield self.audio[i:i + size]
            await asyncio.sleep(max(0.0, t0 + (i + size) / RATE - time.perf_counter()))
            if stop_after is not None and (i + size - self.end) / RATE >= stop_after:
                await asyncio.sleep(max(0.0, self.end_at + stop_after - time.perf_counter()))
                return


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).round().astype("<i2").tobytes()


async def wyoming(port: int, audio, end, *, sensitivity: str | None = None, ha_wait: float | None = None):
    """Our end of turn (ha_wait None), or Home Assistant's VAD: audio-stop after `ha_wait` of silence."""
    from wyoming.asr import Transcribe, Transcript
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    paced = Paced(audio, end)
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Transcribe(language="en", vad_sensitivity=sensitivity).event())
        await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
        done: dict = {}

        async def read():
            while True:
                event = await client.read_event()
                if event is None or Transcript.is_type(event.type):
                    done.update(at=time.perf_counter(), text=event and Transcript.from_event(event).text)
                    return
        reader = asyncio.create_task(read())
        async for chunk in paced.chunks(stop_after=ha_wait):
            if reader.done():
                break
            await client.write_event(AudioChunk(rate=RATE, width=2, channels=1, audio=pcm16(chunk)).event())
        await client.write_event(AudioStop().event())
        await asyncio.wait_for(reader, 60)
    return done["at"] - paced.end_at, done["text"]


async def realtime(http: str, audio, end, *, silence_ms: int | None = None, commit_after: float | None = None):
    """OpenAI Realtime: server_vad at `silence_ms`, or no turn detection and a commit `commit_after`
    seconds after the end of speech."""
    import soxr
    from websockets.asyncio.client import connect

    turn = None if silence_ms is None else {"type": "server_vad", "silence_duration_ms": silence_ms}
    session = {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 24000}, "transcription": {"language": "en"}, "turn_detection": turn}}}
    paced = Paced(audio, end)
    url = http.replace("http", "ws", 1) + "/v1/realtime?intent=transcription"
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        done: dict = {}

        async def read():
            async for raw in ws:
                event = json.loads(raw)
                if event["type"] == "conversation.item.input_audio_transcription.completed" and event["transcript"]:
                    done.update(at=time.perf_counter(), text=event["transcript"])
                    return
        reader = asyncio.create_task(read())
        committed = False
        async for chunk in paced.chunks():
            if reader.done():
                break
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(pcm16(soxr.resample(chunk, RATE, 24000))).decode()}))
            if commit_after is not None and not committed and time.perf_counter() >= paced.end_at + commit_after:
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                committed = True
        await asyncio.wait_for(reader, 60)
    return done["at"] - paced.end_at, done["text"]


async def native(url: str, audio, end):
    """Our protocol: the client sends the command and finalizes at its end (push-to-talk)."""
    from whistle_stream.clients.client import ListenClient

    paced = Paced(audio[:end], end)
    async with ListenClient(url, resume=False) as client:
        async for chunk in paced.chunks():
            await client.send_audio(chunk)
        final = await client.finalize()
        at = time.perf_counter()
        await client.close()
    return at - paced.end_at, final.text


def summary(name: str, silence: float, times: list[float]) -> str:
    p50, p99 = (float(np.percentile(times, q)) for q in (50, 99))
    return (f"{name:34s} end to text p50 {1000 * p50:6.0f} ms  p99 {1000 * p99:6.0f} ms   waits {1000 * silence:5.0f} ms"
            f"   after it p50 {1000 * (p50 - silence):6.0f} ms  p99 {1000 * (p99 - silence):6.0f} ms")


async def run_dialect(make, spoken, sessions: int) -> tuple[list[float], list[str]]:
    """Every command through `make(audio, end)`, `sessions` at once (each its own command list,
    staggered by a fraction of a command)."""
    times: list[float] = []
    texts: list[str] = []

    async def one(k: int):
        await asyncio.sleep(k * 0.37)
        for audio, end, _ in spoken[k % len(spoken):] + spoken[:k % len(spoken)]:
            t, text = await make(audio, end)
            times.append(t)
            if k == 0:
                texts.append(text)
    await asyncio.gather(*(one(k) for k in range(sessions)))
    return times, texts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="demo, full, tiny, odd or a .cact path")
    parser.add_argument("--commands", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--short", action="store_true", help="3 commands, one setting per dialect")
    args = parser.parse_args(argv)
    n = 3 if args.short else args.commands
    spoken = commands(n)
    model = model_path(args.model)
    flags = ["--processes", "1", "--max-sessions", str(4 * args.sessions + 4)] + (["--model", model] if model else [])
    levels = ("default",) if args.short else tuple(HA_WAIT_S)
    rows: list[str] = []
    texts: dict[str, list[str]] = {}
    print(f"{len(spoken)} commands of {min(e for _, e, _ in spoken) / RATE:.1f}-{max(e for _, e, _ in spoken) / RATE:.1f} s, "
          f"{args.sessions} session(s) at once, model {args.model}", flush=True)

    paused = [(*with_pause(a[:e], e), t) for a, e, t in spoken]
    paused = [(np.concatenate([a, np.zeros(int(TAIL_S * RATE), np.float32)]), e, t) for a, e, t in paused]

    def measure(name: str, silence: float, make, commands=spoken) -> None:
        asyncio.run(make(*commands[0][:2]))                     # this path warmed once
        times, said = asyncio.run(run_dialect(make, commands, args.sessions))
        texts[name] = said
        rows.append(summary(name, silence, times))
        print(rows[-1], flush=True)

    port = free_port()
    with ServerProcess(*flags, "--wyoming-port", str(port), "--wyoming-end-of-turn", "false"):
        for level in levels:
            measure(f"wyoming+ha-vad ({level})", HA_WAIT_S[level],
                    lambda a, e, w=HA_WAIT_S[level]: wyoming(port, a, e, ha_wait=w))
        measure("wyoming+ha-vad (default), paused", HA_WAIT_S["default"],
                lambda a, e: wyoming(port, a, e, ha_wait=HA_WAIT_S["default"]), paused)
    port = free_port()
    with ServerProcess(*flags, "--wyoming-port", str(port)) as server:
        from whistle_stream.service.wyoming import SENSITIVITY_MS
        for level in levels:
            measure(f"wyoming, our end ({level})", SENSITIVITY_MS[level] / 1000,
                    lambda a, e, s=level: wyoming(port, a, e, sensitivity=s))
        measure("wyoming, our end (default), paused", SENSITIVITY_MS["default"] / 1000,
                lambda a, e: wyoming(port, a, e, sensitivity="default"), paused)
        for ms in ((600,) if args.short else (200, 600)):
            measure(f"realtime+server-vad ({ms} ms)", ms / 1000,
                    lambda a, e, m=ms: realtime(server.http, a, e, silence_ms=m))
        measure("realtime+commit (200 ms)", 0.2, lambda a, e: realtime(server.http, a, e, commit_after=0.2))
        measure("native+finalize", 0.0, lambda a, e: native(server.url, a, e))
    print(f"\n{len(spoken)} commands x {args.sessions} session(s), model {args.model}:")
    for row in rows:
        print(row)
    # the same audio (with its silence) read to the same words: each dialect against Home Assistant's
    # own VAD at the same sensitivity (the default one where a dialect has none)
    differ = 0
    for name, said in texts.items():
        level = next((lv for lv in HA_WAIT_S if f"({lv})" in name), "default")
        reference = f"wyoming+ha-vad ({level})" + (", paused" if name.endswith("paused") else "")
        if name == reference or reference not in texts:
            continue
        for mine, theirs in zip(said, texts[reference]):
            if mine != theirs:
                differ += 1
                print(f"  {name}: {mine!r} where {reference} read {theirs!r}")
    print(f"commands read differently from Home Assistant's VAD at the same sensitivity: {differ}")
    if "wyoming, our end (default), paused" in texts:
        ours, theirs = texts["wyoming, our end (default), paused"], texts["wyoming+ha-vad (default), paused"]
        print(f"with a {PAUSE_S:g} s pause inside each command, our end read {sum(a == b for a, b in zip(ours, theirs))} "
              f"of {len(ours)} as Home Assistant's VAD did (a turn ended at the pause reads only its first half)")
    ha, ours = (next(r for r in rows if r.startswith(p)) for p in ("wyoming+ha-vad (default)", "wyoming, our end (default)"))
    p50 = [float(r.split("p50")[1].split("ms")[0]) for r in (ha, ours)]
    print(f"Home Assistant's transcript at the default sensitivity: its VAD / ours (p50) = {p50[0] / p50[1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
