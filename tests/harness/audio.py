"""Deterministic test audio: 16 kHz mono float32 in [-1, 1], cached under tests/.cache/audio.

Speech comes from the Debian text-to-speech engines (espeak-ng, flite), written to a temporary
WAV and resampled with soxr; the rest is seeded NumPy. Nothing here needs jax or needle.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
CACHE = Path(__file__).resolve().parent.parent / ".cache" / "audio"
VERSION = "a1"

ENGINES = ("espeak", "flite")
DEFAULT_VOICE = {"espeak": "en", "flite": "slt"}

# Sentences the clips are read from, long enough for the 30 s clip.
PASSAGE = (
    "The quick brown fox jumps over the lazy dog near the river bank. "
    "She sells sea shells by the sea shore every summer morning. "
    "The weather today is cold and windy, but tomorrow it should be warm and sunny. "
    "He walked to the station, bought a ticket and waited for the train to London. "
    "The children played in the garden while their parents talked about the harvest. "
    "Speech recognition turns spoken words into text, one small piece at a time. "
    "Could you tell me where the nearest library is, and when it opens on Sunday? "
    "After the storm the streets were quiet, wet and covered with fallen leaves. "
    "Music, painting and poetry were the things she loved most in the world. "
    "The meeting starts at nine o'clock, so do not be late again this week. "
)

# Target lengths in samples of the "about 1, 5, 12 and 30 s" clips. Deliberately not multiples of
# the 160-sample hop or the 320-sample level block, so partial frames and blocks get exercised;
# 30 s stays just under the one-pass limit (480000 samples).
CLIP_SAMPLES = {1: 16_077, 5: 80_123, 12: 192_331, 30: 479_999}


def _read_wav(path: str) -> tuple[np.ndarray, int]:
    with wave.open(path, "rb") as handle:
        if handle.getsampwidth() != 2:
            raise ValueError(f"{path}: expected 16-bit PCM, got {8 * handle.getsampwidth()}-bit")
        rate, channels = handle.getframerate(), handle.getnchannels()
        data = np.frombuffer(handle.readframes(handle.getnframes()), "<i2").astype(np.float32) / 32768.0
    return data.reshape(-1, channels).mean(1), rate


def _synthesise(text: str, engine: str, voice: str, rate: int | None) -> np.ndarray:
    import soxr

    with tempfile.TemporaryDirectory() as tmp:
        wav = os.path.join(tmp, "speech.wav")
        if engine == "espeak":
            command = ["espeak-ng", "-v", voice, "-w", wav] + (["-s", str(rate)] if rate else []) + [text]
        else:
            # flite's rate knob is a duration stretch; map words/minute around its ~170 default.
            stretch = ["--setf", f"duration_stretch={170.0 / rate:.4f}"] if rate else []
            command = ["flite", "-voice", voice, *stretch, "-t", text, "-o", wav]
        subprocess.run(command, check=True, capture_output=True)
        pcm, source_rate = _read_wav(wav)
    if source_rate != SAMPLE_RATE:
        pcm = soxr.resample(pcm, source_rate, SAMPLE_RATE, quality="HQ")
    return np.ascontiguousarray(pcm, np.float32)


def _cached(name: str, make) -> np.ndarray:
    path = CACHE / f"{name}.npy"
    if path.exists():
        return np.load(path)
    pcm = np.asarray(make(), np.float32)
    CACHE.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=CACHE, suffix=".npy.tmp")
    os.close(fd)
    try:
        with open(tmp, "wb") as handle:
            np.save(handle, pcm)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return pcm


def speech(text: str, engine: str = "espeak", voice: str | None = None, rate: int | None = None) -> np.ndarray:
    """Synthesised speech of `text`: 16 kHz mono float32 in [-1, 1].

    engine: "espeak" (espeak-ng; voice a language such as "en", "de", "fr", "pl") or "flite"
    (voice one of `flite -lv`, default "slt"). rate: words per minute (espeak -s; for flite mapped
    to a duration stretch), None for the engine's default. Cached on disk by all four arguments."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be a non-empty string")
    if rate is not None and not 50 <= rate <= 500:
        raise ValueError(f"rate is words per minute in [50, 500], got {rate}")
    binary = "espeak-ng" if engine == "espeak" else "flite"
    if shutil.which(binary) is None:
        raise RuntimeError(f"{binary} is not installed; the {engine} test clips need it (apt-get install {binary})")
    voice = voice or DEFAULT_VOICE[engine]
    digest = hashlib.sha1(repr((VERSION, engine, voice, rate, text)).encode()).hexdigest()[:16]
    return _cached(f"speech-{engine}-{digest}", lambda: _synthesise(text, engine, voice, rate))


def speech_of_length(samples: int, engine: str = "espeak", voice: str | None = None) -> np.ndarray:
    """Speech read from PASSAGE, cut (or the passage repeated) to exactly `samples` samples."""
    pcm = speech(PASSAGE, engine, voice)
    reps = -(-samples // len(pcm))
    return np.tile(pcm, reps)[:samples].copy()


def white_noise(seconds: float, dbfs: float = -30.0, seed: int = 0) -> np.ndarray:
    """Seeded Gaussian white noise with an RMS of `dbfs` dB relative to full scale (1.0)."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(int(round(seconds * SAMPLE_RATE)))
    noise *= 10.0 ** (dbfs / 20.0) / np.sqrt((noise ** 2).mean())
    return noise.astype(np.float32)


def with_bad_samples(pcm: np.ndarray, seed: int = 0) -> np.ndarray:
    """A copy of pcm with NaN, +-inf and out-of-range samples (|x| >= 65536, integer-valued
    floats as a mis-scaled int32 stream would give) at seeded positions: the samples the engine
    reads as zero (guide §3 step 1)."""
    rng = np.random.default_rng(seed)
    bad = np.array([np.nan, np.inf, -np.inf, 65536.0, -65536.0, 70000.0, -1.0e6, 2.0 ** 31], np.float32)
    out = np.array(pcm, np.float32)
    positions = rng.choice(len(out), size=4 * len(bad), replace=False)
    out[positions] = np.resize(bad, len(positions))
    out[:3] = bad[:3]          # at the very start (first frame, first level block)
    out[-2:] = bad[3:5]        # and at the very end
    return out


def clip_set() -> dict[str, np.ndarray]:
    """The clips the encoder parity acceptance runs on (16 kHz float32):

    espeak_1s, espeak_5s, espeak_12s, espeak_30s, flite_1s, ..., flite_30s: speech;
    quiet: espeak 5 s speech x 1e-3; noise: 5 s seeded white noise at -30 dBFS;
    bad_samples: espeak 5 s speech with NaN, inf and |x| >= 65536 samples."""
    clips = {}
    for engine in ENGINES:
        for seconds, samples in CLIP_SAMPLES.items():
            clips[f"{engine}_{seconds}s"] = speech_of_length(samples, engine)
    clips["quiet"] = (clips["espeak_5s"] * np.float32(1e-3)).astype(np.float32)
    clips["noise"] = white_noise(5.0)
    clips["bad_samples"] = with_bad_samples(clips["espeak_5s"])
    return clips


def demo_stream(sentences: int, seed: int) -> tuple[np.ndarray, str]:
    """Held-out demo sentences joined with pauses (benchmarks/streaming.py's stream): 16 kHz audio
    and the sentences' text."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from streaming import build_stream

    audio, utts = build_stream(sentences, seed=seed)
    return audio, " ".join(u[2] for u in utts)
