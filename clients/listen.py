"""`whistle-listen`: live captions from a microphone or a WAV file, through a server or in-process.

    whistle-listen                                 # microphone -> ws://127.0.0.1:8000
    whistle-listen --file clip.wav --speed 4       # a file, paced at 4x real time
    whistle-listen --json                          # server messages as JSON lines
    whistle-listen --local --file clip.wav         # no server: the engine runs in this process

Committed text is printed as it arrives with the pending tail dimmed after it on the same line
(ANSI, when stdout is a terminal). Ctrl-C finalizes and prints a summary to stderr. Exit status
(`whistle_stream.errors.ExitStatus`, shared by every command):
0 done, 1 session error, 2 usage, 3 server unreachable, 4 authentication failed, 5 no audio input.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import soxr

from whistle_stream.errors import ExitStatus
from whistle_stream.service import protocol as P

from .client import AuthFailed, ClientError, ListenClient, ServerUnreachable, check_server_url, to_pcm

RATE = P.DEFAULT_SAMPLE_RATE   # what is sent: the model's own rate, so the server resamples nothing
BLOCK_S = 0.1          # audio sent per frame: 100 ms keeps latency low and frames small
DIM, RESET, CLEAR_LINE = "\x1b[2m", "\x1b[0m", "\r\x1b[K"


class AudioInputError(Exception):
    """No usable audio input (no microphone, unreadable file)."""


# the exit status of each failure, the first that matches (ClientError last: the others are kinds of it)
EXIT_CODES = ((AudioInputError, ExitStatus.NO_AUDIO), (ServerUnreachable, ExitStatus.UNREACHABLE),
              (AuthFailed, ExitStatus.AUTH), (ClientError, ExitStatus.FAILED))


# ---------------------------------------------------------------------------------------------
# Display

class Caption:
    """Committed text followed by the dimmed pending tail on one line; a new line per utterance."""

    def __init__(self, out, ansi: bool, width: int | None = None):
        self.out, self.ansi = out, ansi
        self.width = width or shutil.get_terminal_size((100, 20)).columns
        self.line = ""      # committed text of the current utterance
        self.pending = ""

    def _render(self) -> None:
        if not self.ansi:
            return
        room = max(10, self.width - 1)
        shown = (self.line + self.pending)[-room:]
        cut = max(0, len(shown) - len(self.pending))
        self.out.write(CLEAR_LINE + shown[:cut] + DIM + shown[cut:] + RESET)
        self.out.flush()

    def _newline(self) -> None:
        if self.ansi:
            self.out.write(CLEAR_LINE + self.line[-max(10, self.width - 1):] + "\n")
        elif self.line:
            self.out.write("\n")
        self.out.flush()
        self.line, self.pending = "", ""

    def update(self, message: P.ServerMessage) -> None:
        if isinstance(message, P.Ready):
            if not message.resumed:   # which model listens, and what the demo model can hear
                sys.stderr.write(f"whistle-listen: model {message.model} ({', '.join(message.languages)})\n")
                if message.model_note:
                    sys.stderr.write(f"whistle-listen: {message.model_note}\n")
                sys.stderr.flush()
            return
        if isinstance(message, P.Committed):
            piece = message.text if self.line else message.text.lstrip()
            self.line += piece
            if not self.ansi and piece:
                self.out.write(piece)
            if message.end_of_speech and self.line:
                self._newline()
                return
        elif isinstance(message, P.Partial):
            self.pending = message.pending
        elif isinstance(message, P.Final):
            self.pending = ""
            if self.line:
                self._newline()
            return
        elif isinstance(message, P.Error):
            if self.ansi:
                self.out.write(CLEAR_LINE)
            sys.stderr.write(f"\nserver error {message.code.value}: {message.message}\n")
        self._render()


class JsonLines:
    def __init__(self, out):
        self.out = out

    def update(self, message: P.ServerMessage) -> None:
        self.out.write(P.encode(message) + "\n")
        self.out.flush()


@dataclass
class Summary:
    audio_seconds: float = 0.0
    passes: int = 0
    pass_ms: float = 0.0
    language: str = ""
    sessions: int = 0
    text: list = field(default_factory=list)

    def add(self, final: P.Final) -> None:
        self.audio_seconds += final.audio_seconds
        self.passes += final.passes
        self.pass_ms += final.mean_pass_ms * final.passes
        self.language = final.language or self.language

    def line(self) -> str:
        mean = self.pass_ms / self.passes if self.passes else 0.0
        return (f"audio {self.audio_seconds:.1f} s, {self.passes} passes, mean pass {mean:.0f} ms, "
                f"language {self.language or '-'}" + (f", {self.sessions} sessions" if self.sessions > 1 else ""))


# ---------------------------------------------------------------------------------------------
# Audio sources: async iterators of float32 16 kHz mono blocks

def read_audio(path: str) -> np.ndarray:
    """An audio file (WAV, FLAC, OGG, MP3) -> float32 mono 16 kHz. Raises AudioInputError."""
    from whistle_stream.errors import AudioError
    from whistle_stream.frontend import load_audio

    try:
        return load_audio(path)
    except AudioError as e:
        raise AudioInputError(str(e)) from e


async def file_blocks(samples: np.ndarray, speed: float = 1.0):
    """16 kHz samples (`read_audio`) as blocks of BLOCK_S seconds, paced at `speed` times real time."""
    block = int(BLOCK_S * RATE)
    start = time.monotonic()
    for i in range(0, len(samples), block):
        yield samples[i:i + block]
        delay = start + (i + block) / RATE / speed - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


def load_sounddevice():
    try:
        import sounddevice
    except (ImportError, OSError) as e:   # OSError: the PortAudio library is missing
        raise AudioInputError(f"no microphone: sounddevice/PortAudio is unavailable ({e}); "
                              "use --file clip.wav") from e
    return sounddevice


def microphone_rate(sd, device=None) -> int:
    """The input device's own sample rate. Raises AudioInputError when there is no microphone."""
    try:
        info = sd.query_devices(device, "input")
        return int(info["default_samplerate"])
    except Exception as e:   # sounddevice raises ValueError / PortAudioError for no device
        raise AudioInputError(f"no microphone found ({e}); check the input device or use --file") from e


async def microphone_blocks(sd, device=None, block_s: float = BLOCK_S):
    """The microphone at its own rate (sounddevice), resampled to 16 kHz blocks."""
    rate = microphone_rate(sd, device)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=200)

    def callback(indata, frames, time_info, status):
        block = np.array(indata[:, 0] if indata.ndim == 2 else indata, dtype=np.float32)
        loop.call_soon_threadsafe(_offer, queue, block)

    resampler = None if rate == RATE else soxr.ResampleStream(rate, RATE, 1, dtype="float32")
    try:
        stream = sd.InputStream(samplerate=rate, channels=1, dtype="float32", device=device,
                                blocksize=int(rate * block_s), callback=callback)
    except Exception as e:
        raise AudioInputError(f"cannot open the microphone ({e})") from e
    with stream:
        while True:
            block = await queue.get()
            yield block if resampler is None else resampler.resample_chunk(block).astype(np.float32)


def _offer(queue: asyncio.Queue, block) -> None:
    if queue.full():
        queue.get_nowait()  # the consumer fell behind: drop the oldest block, keep the newest
    queue.put_nowait(block)


async def limited(blocks, seconds: float | None, stop: asyncio.Event):
    """Pass blocks through until `seconds` of audio or `stop` (Ctrl-C)."""
    sent = 0.0
    async for block in blocks:
        if stop.is_set():
            return
        yield block
        sent += len(block) / RATE
        if seconds is not None and sent >= seconds:
            return


# ---------------------------------------------------------------------------------------------
# Running a session

async def run_remote(args, blocks, display, summary: Summary) -> None:
    """Stream blocks to the server. The client resumes the session when the connection drops or
    the server restarts (docs/protocol.md, "Resuming a session"): the captions carry on."""
    def on_reconnect(error) -> None:
        sys.stderr.write(f"\nwhistle-listen: reconnecting ({error})\n" if error is not None
                         else "whistle-listen: reconnected; the captions continue\n")
        sys.stderr.flush()

    client = ListenClient(args.server, sample_rate=RATE, language=args.language, keywords=args.keyword,
                          token=args.token, vad=not args.no_vad, retries=args.retries, on_retry=_say_retry,
                          resume_retries=max(args.retries, 1), on_reconnect=on_reconnect)
    display.update(await client.connect())
    summary.sessions = 1

    async def receive():
        async for message in client:
            display.update(message)
            if isinstance(message, P.Final) and message.reason != "finalize":
                summary.add(message)

    receiver = asyncio.create_task(receive())
    try:
        async for block in blocks:
            if receiver.done():
                break
            await client.send_audio(block)
        if not receiver.done():
            await client.request_close()
        await receiver
    finally:
        receiver.cancel()
    summary.sessions += client.reconnects


def _say_retry(attempt: int, retries: int, delay: float, error: Exception) -> None:
    sys.stderr.write(f"whistle-listen: {error}; retry {attempt} of {retries} in {delay:.1f} s\n")
    sys.stderr.flush()


async def run_local(args, blocks, display, summary: Summary, model=None) -> None:
    """The engine in this process, through the session core the server runs (`SessionCore`)."""
    from whistle_stream.service.core import SessionCore   # webrtcvad and the engine: --local only
    if model is None:
        from whistle_stream import Whistle
        model = Whistle(args.model)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, model.warmup)   # compile before the audio starts
    # The frames the server would receive from `run_remote`'s client, so both give the same messages.
    config = P.SessionConfig(language=args.language, keywords=tuple(args.keyword), vad=not args.no_vad)
    core = SessionCore(model, config)

    def show(messages) -> None:
        for m in messages:
            display.update(m)
            if isinstance(m, P.Final) and m.reason != "finalize":
                summary.add(m)

    try:
        show(core.open())
    except P.ProtocolError as e:
        raise ClientError(e.message) from e
    summary.sessions = 1
    async for block in blocks:
        work = core.receive(to_pcm(block, config.encoding)).work
        if work:
            show(await loop.run_in_executor(None, core.execute, work))
    show(await loop.run_in_executor(None, core.execute, core.end("close")))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="whistle-listen", description="Live captions from a microphone "
                                "or a WAV file, via a whistle-stream server or in-process.")
    p.add_argument("--server", default=os.environ.get("WHISTLE_SERVER", "ws://127.0.0.1:8000"),
                   help="server URL [env WHISTLE_SERVER, default ws://127.0.0.1:8000]")
    p.add_argument("--language", help="force a language (default: detect)")
    p.add_argument("--keyword", action="append", default=[], help="keyword phrase to bias toward (repeatable)")
    p.add_argument("--token", default=os.environ.get("WHISTLE_TOKEN"), help="server token [env WHISTLE_TOKEN]")
    p.add_argument("--file", help="stream this audio file (WAV, FLAC, OGG, MP3) instead of the microphone")
    p.add_argument("--speed", type=float, default=1.0, help="--file pace, times real time (default 1)")
    p.add_argument("--seconds", type=float, help="stop after this much audio")
    p.add_argument("--device", help="sounddevice input device (name or index)")
    p.add_argument("--json", action="store_true", help="print the server messages as JSON lines")
    p.add_argument("--local", action="store_true", help="run the engine in this process, no server")
    p.add_argument("--model", help="model file for --local (default: model resolution)")
    p.add_argument("--no-vad", action="store_true", help="send everything to the engine (no speech gate)")
    p.add_argument("--retries", type=int, default=5, help="reconnect attempts with backoff (default 5)")
    return p


async def amain(args, *, sounddevice=None, model=None, out=None) -> int:
    out = out or sys.stdout
    display = JsonLines(out) if args.json else Caption(out, ansi=out.isatty())
    summary = Summary()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_sigint():   # first Ctrl-C: finish cleanly; second: give up now
        if stop.is_set() and task is not None:
            task.cancel()
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):
        pass
    try:
        if not args.local:
            check_server_url(args.server)   # a malformed URL fails before any audio is opened
        if args.file:
            source = file_blocks(read_audio(args.file), args.speed)   # unreadable: fails before connecting
        else:
            device = int(args.device) if args.device and args.device.isdecimal() else args.device
            sd = sounddevice or load_sounddevice()
            microphone_rate(sd, device)   # fail before connecting when there is no microphone
            source = microphone_blocks(sd, device)
        blocks = limited(source, args.seconds, stop)
        if args.local:
            await run_local(args, blocks, display, summary, model=model)
        else:
            await run_remote(args, blocks, display, summary)
    except (AudioInputError, ClientError) as e:   # each failure a person can act on has its exit status
        sys.stderr.write(f"whistle-listen: {e}\n")
        return next(code for kind, code in EXIT_CODES if isinstance(e, kind))
    except asyncio.CancelledError:
        sys.stderr.write("whistle-listen: interrupted\n")
        return ExitStatus.INTERRUPTED
    finally:
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError):
            pass
    if not args.json:
        sys.stderr.write(summary.line() + "\n")
    return 0


def main(argv=None, *, sounddevice=None, model=None) -> int:
    """Console entry point. `sounddevice` and `model` let tests inject a fake device or engine."""
    args = build_parser().parse_args(argv)
    if args.speed <= 0:
        build_parser().error("--speed must be positive")
    try:
        return asyncio.run(amain(args, sounddevice=sounddevice, model=model))
    except KeyboardInterrupt:
        return ExitStatus.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
