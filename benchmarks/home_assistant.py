"""Home Assistant's case: a spoken command of 2-4 s over Wyoming, and the time from `audio-stop` to
`transcript` (what a person waits for after they stop talking).

    python benchmarks/home_assistant.py                 # 12 commands, the bundled demo model
    python benchmarks/home_assistant.py --commands 30

One `whistle-stream serve --wyoming-port` process on loopback (one engine process, as on a
Raspberry Pi or an HA Green). Each command is sent as Home Assistant sends it: `transcribe`,
`audio-start`, 1024-sample chunks paced at real time, `audio-stop`. The peer, in the same run and
on the same server: the same command sent whole after it was spoken to `POST
/v1/audio/transcriptions`, which is what a server that transcribes at `audio-stop` does (the
common Wyoming server, wyoming-faster-whisper, reads the whole command then). Printed: the median
and p95 of each, and the ratio peer / Wyoming.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import soundfile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from harness.servers import ServerProcess, free_port  # noqa: E402

RATE = 16000
CHUNK = 1024


def commands(n: int, seed: int = 11) -> list[tuple[np.ndarray, str]]:
    """n held-out demo sentences of 2-4 s, with 0.3 s of silence after each (HA's VAD stops there)."""
    from tools.demo_data import test_clips

    out = []
    for audio, text in test_clips(6 * n, seed):
        if 2.0 <= len(audio) / RATE <= 4.0:
            out.append((np.concatenate([audio, np.zeros(int(0.3 * RATE), np.float32)]), text))
        if len(out) == n:
            break
    return out


async def wyoming_command(port: int, audio: np.ndarray) -> tuple[float, str]:
    from wyoming.asr import Transcribe
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    data = (np.clip(audio, -1, 1) * 32767).round().astype("<i2").tobytes()
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
        start = time.perf_counter()
        for n, i in enumerate(range(0, len(data), 2 * CHUNK)):
            await client.write_event(AudioChunk(rate=RATE, width=2, channels=1, audio=data[i:i + 2 * CHUNK]).event())
            await asyncio.sleep(max(0.0, start + (n + 1) * CHUNK / RATE - time.perf_counter()))   # real time
        await client.write_event(AudioStop().event())
        stopped = time.perf_counter()
        while True:
            event = await client.read_event()
            if event is None:
                raise RuntimeError("the server closed the connection")
            if event.type == "transcript":
                return time.perf_counter() - stopped, event.data["text"]


def rest_command(http: str, audio: np.ndarray) -> tuple[float, str]:
    import json

    wav = io.BytesIO()
    soundfile.write(wav, audio, RATE, format="WAV", subtype="PCM_16")
    boundary = "whistlebench"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\nen\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"c.wav\"\r\n"
            "Content-Type: audio/wav\r\n\r\n").encode() + wav.getvalue() + f"\r\n--{boundary}--\r\n".encode()
    request = urllib.request.Request(http + "/v1/audio/transcriptions", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as r:
        text = json.loads(r.read())["text"]
    return time.perf_counter() - t0, text


def p95(xs: list[float]) -> float:
    return float(np.percentile(xs, 95))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commands", type=int, default=12)
    args = parser.parse_args(argv)
    spoken = commands(args.commands)
    port = free_port()
    with ServerProcess("--wyoming-port", str(port), "--processes", "1", "--workers", "2") as server:
        for audio, _ in spoken[:2]:   # warm both paths once
            asyncio.run(wyoming_command(port, audio))
            rest_command(server.http, audio)
        ours, peer = [], []
        for audio, text in spoken:
            w, w_text = asyncio.run(wyoming_command(port, audio))
            r, r_text = rest_command(server.http, audio)
            ours.append(w)
            peer.append(r)
            print(f"{len(audio) / RATE:4.1f} s  wyoming {1000 * w:6.1f} ms  at stop {1000 * r:6.1f} ms  "
                  f"{w_text!r}", flush=True)
    print(f"\n{len(spoken)} commands of 2-4 s, audio-stop to transcript:")
    print(f"  Wyoming (streamed, committed while spoken): median {1000 * statistics.median(ours):.0f} ms, "
          f"p95 {1000 * p95(ours):.0f} ms")
    print(f"  whole command read at audio-stop (peer):    median {1000 * statistics.median(peer):.0f} ms, "
          f"p95 {1000 * p95(peer):.0f} ms")
    print(f"  ratio peer / Wyoming (median): {statistics.median(peer) / statistics.median(ours):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
