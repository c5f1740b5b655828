"""Audio in, log-mel features out: the engine's front end (guide §3) and silence gate (§8).

Every function takes float32 samples at the model rate (16 kHz) in [-1, 1] unless it says
otherwise. `load_audio` is the public door for arrays, WAV files and WAV bytes.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import AudioError

MODEL_RATE = 16000  # samples per second every model in this family expects (audio manifest `rate`)
BAD_SAMPLE = 65536.0  # §3.1: samples of this magnitude or more read as zero
LEVEL_BLOCK = 320  # §3.2: level gain block length, samples
LEVEL_QUANTILE = 0.99  # §3.2: the loud block, by selection
LEVEL_TARGET = 0.1  # §3.2: the loud block's RMS after the gain
LEVEL_FLOOR = 1e-6  # §3.2: below this the clip is left alone
LOG_FLOOR = 2.0 ** -24  # §3.7: log(x + 2^-24)
STD_EPS = 1e-5  # §3.8: (x - mean) / (std + 1e-5)
LEVEL_CHUNK = 1 << 16  # samples per float64 step of the level gain (bounds its temporaries)
FFT_BLOCK_FRAMES = 256  # frames per block of the power spectrum (bounds its temporaries, not its result)
GATE_BLOCK_FRAMES = 3000  # frames the silence gate reads at a time (30 s at the 10 ms hop: a pass's clip in one)
GATE_BAND_HZ = (250.0, 3500.0)  # §8: bands whose filters lie inside this range feed the gate
GATE_QUANTILES = (0.99, 0.10)  # §8: loud and quiet frame, by the same selection rule as §3.2
GATE_MARGIN_DB = 5.0  # §8: speech only when the loud frame is this far above the quiet one
GATE_POWER_FLOOR = 1e-20  # keeps log10 finite on digital silence; far below any real frame
MAX_CHANNELS = 8
_WAVE_PCM, _WAVE_FLOAT, _WAVE_EXTENSIBLE = 1, 3, 0xFFFE

Split = Callable[[Callable[[int, int], object], int], None]
"""split(fn, total) calls fn(a, b) over ranges that cover range(total) (the engine's worker
threads: blocks.run_split); the front end's rows are independent, so any such split gives the
same numbers."""


def _whole(fn: Callable[[int, int], object], total: int) -> None:
    fn(0, total)


# ---------------------------------------------------------------- loading


def warm_signal(rate: int = 16000) -> np.ndarray:
    """1.5 s that warms every path: 0.5 s of silence, then a noisy 220 Hz tone loud enough to pass
    the §8 silence gate (the engine's warm-up, and the service's first session through its core)."""
    t = np.arange(int(1.5 * rate)) / rate
    rng = np.random.default_rng(0)
    tone = 0.2 * np.sin(2 * np.pi * 220 * t) + 0.02 * rng.standard_normal(len(t))
    tone[: rate // 2] = 0.0
    return tone.astype(np.float32)


def load_audio(audio, rate: int | None = None) -> np.ndarray:
    """Any supported audio -> float32 mono samples at 16 kHz.

    audio: a float32/float64 array in [-1, 1], an int16 array (scaled by 1/32768), an audio file
    path, or the bytes of an audio file (WAV read here; FLAC, OGG/Vorbis/Opus and MP3 through
    libsndfile, the `soundfile` package). Arrays are 1-D, or 2-D (samples, channels) with up to 8
    channels, which are averaged. rate: the array's sample rate in Hz (default 16000; other rates
    are resampled with soxr); a WAV carries its own rate, so `rate` must not be given with one.
    NaN, infinite and |x| >= 65536 samples are zeroed (§3.1) before any resampling.
    Raises AudioError naming what was wrong and what is accepted.
    """
    if isinstance(audio, (str, os.PathLike)):
        if rate is not None:
            raise AudioError("rate= applies to arrays only; an audio file's rate is read from its header")
        path = Path(audio)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise AudioError(f"cannot read audio file {path}: {e.strerror or e}") from e
        samples, rate = decode_file(data, str(path))
    elif isinstance(audio, (bytes, bytearray, memoryview)):
        if rate is not None:
            raise AudioError("rate= applies to arrays only; audio file bytes carry their own rate")
        samples, rate = decode_file(bytes(audio), "audio bytes")
    elif isinstance(audio, np.ndarray):
        samples = _array_samples(audio)
    else:
        raise AudioError(
            f"unsupported audio of type {type(audio).__name__}; pass a NumPy array "
            "(float32, float64 or int16), an audio file path, or an audio file's bytes")
    samples = sanitize(_to_mono(samples))
    rate = MODEL_RATE if rate is None else rate
    if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate <= 0:
        raise AudioError(f"rate must be a positive integer number of samples per second, got {rate!r}")
    if rate != MODEL_RATE and len(samples):
        import soxr

        samples = soxr.resample(samples, int(rate), MODEL_RATE).astype(np.float32)
    return np.ascontiguousarray(samples, dtype=np.float32)


def _array_samples(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.int16:
        a = a.astype(np.float32) / np.float32(32768.0)
    elif a.dtype in (np.float32, np.float64):
        a = a.astype(np.float32, copy=False)   # `sanitize` makes the one copy
    else:
        raise AudioError(f"audio arrays must be float32, float64 or int16, got {a.dtype}")
    if a.ndim not in (1, 2):
        raise AudioError(f"audio arrays must be 1-D (mono) or 2-D (samples, channels), got shape {a.shape}")
    return a


def _to_mono(a: np.ndarray) -> np.ndarray:
    if a.ndim == 1:
        return a
    if a.shape[1] > MAX_CHANNELS:
        raise AudioError(
            f"a 2-D audio array is (samples, channels) with at most {MAX_CHANNELS} channels, got shape {a.shape}")
    return a.mean(axis=1, dtype=np.float32) if a.shape[1] > 1 else a[:, 0]


FILE_FORMATS = "WAV, FLAC, OGG (Vorbis, Opus) and MP3"


def decode_file(data: bytes, what: str) -> tuple[np.ndarray, int]:
    """An audio file's bytes -> ((samples, channels) float32, rate). WAV is read here, exactly;
    other formats through libsndfile (`soundfile`). Raises AudioError naming the formats read."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return _decode_wav(data, what)
    if not data:
        raise AudioError(f"{what}: empty file; {FILE_FORMATS} files are read")
    try:
        import soundfile
    except ImportError as e:   # pragma: no cover - soundfile is a dependency
        raise AudioError(f"{what}: not a WAV file, and the soundfile package that reads other formats "
                         "is not installed") from e
    import io

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, ValueError, TypeError, soundfile.LibsndfileError) as e:
        detail = str(e).strip().rsplit(": ", 1)[-1] or type(e).__name__   # "Error opening <obj>: why"
        raise AudioError(f"{what}: not a readable audio file ({detail.rstrip('.')}); "
                         f"{FILE_FORMATS} files are read") from e
    return samples, int(rate)


def _decode_wav(data: bytes, what: str) -> tuple[np.ndarray, int]:
    """RIFF/WAVE bytes -> ((samples, channels) float32, rate). PCM 8/16/24/32-bit and float 32/64."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioError(f"{what}: not a WAV file (no RIFF/WAVE header)")
    fmt = body = None
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        chunk = data[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            fmt = chunk
        elif cid == b"data":
            body = chunk
        pos += 8 + size + (size & 1)
    if fmt is None or len(fmt) < 16 or body is None:
        raise AudioError(f"{what}: WAV file without a valid 'fmt ' or 'data' chunk")
    tag, channels, rate, _, align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAVE_EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack_from("<H", fmt, 24)[0]
    if channels < 1 or rate < 1 or align < 1:
        raise AudioError(f"{what}: WAV header says {channels} channels at {rate} Hz")
    width = align // channels
    frames = len(body) // align
    raw = np.frombuffer(body[:frames * align], np.uint8).reshape(frames, channels, width)
    if tag == _WAVE_FLOAT and width in (4, 8):
        samples = raw.copy().view("<f4" if width == 4 else "<f8").reshape(frames, channels).astype(np.float32)
    elif tag == _WAVE_PCM and width == 1:
        samples = (raw[..., 0].astype(np.float32) - 128.0) / 128.0
    elif tag == _WAVE_PCM and width in (2, 3, 4):
        # Little-endian signed integers of `width` bytes, placed in the top of an int32.
        wide = np.zeros((frames, channels, 4), np.uint8)
        wide[..., 4 - width:] = raw
        samples = (wide.view("<i4")[..., 0].astype(np.float64) / 2.0 ** 31).astype(np.float32)
    else:
        raise AudioError(
            f"{what}: unsupported WAV encoding (format tag {tag}, {bits} bits); "
            "read are PCM 8/16/24/32-bit and IEEE float 32/64-bit")
    return samples, rate


# ---------------------------------------------------------------- §3 front end


SANITIZE_BLOCK = 1 << 18  # samples `sanitize` checks at a time


def sanitize(pcm: np.ndarray) -> np.ndarray:
    """§3.1: NaN, infinite and |x| >= 65536 samples read as zero. float32 copy."""
    pcm = np.array(pcm, dtype=np.float32, copy=True)
    with np.errstate(invalid="ignore"):
        for a in range(0, len(pcm), SANITIZE_BLOCK):   # a block at a time: no clip-sized masks
            block = pcm[a:a + SANITIZE_BLOCK]
            block[~(np.abs(block) < BAD_SAMPLE)] = 0.0
    return pcm


def _select(values: np.ndarray, quantile: float) -> float:
    """The element at index floor(quantile * (n - 1)) of the sorted values (a selection, not
    an interpolated percentile, §3.2)."""
    k = int(quantile * (len(values) - 1))
    return float(np.partition(values, k)[k])


def level_gain(pcm: np.ndarray) -> float:
    """§3.2: the factor that brings the clip's loud 320-sample block to RMS 0.1 (1.0 when the
    loud block is at or below 1e-6, or the clip is shorter than one block)."""
    blocks = len(pcm) // LEVEL_BLOCK
    if blocks == 0:
        return 1.0
    rms = np.empty(blocks)
    step = LEVEL_CHUNK // LEVEL_BLOCK
    for a in range(0, blocks, step):   # each block's mean is its own: any chunking gives the same
        b = min(blocks, a + step)
        x = np.asarray(pcm[a * LEVEL_BLOCK:b * LEVEL_BLOCK], np.float64).reshape(b - a, LEVEL_BLOCK)
        rms[a:b] = np.sqrt((x * x).mean(axis=1))
    loud = _select(rms, LEVEL_QUANTILE)
    return LEVEL_TARGET / loud if loud > LEVEL_FLOOR else 1.0


def apply_level(pcm: np.ndarray, in_place: bool = False) -> np.ndarray:
    """pcm scaled by `level_gain` (product in float64, rounded to float32 once): a new float32
    array, or pcm itself (float32, the front end's own copy) in_place; LEVEL_CHUNK samples at a
    time, no clip-sized float64 temporaries (fresh pages cost more than the arithmetic here)."""
    gain = level_gain(pcm)
    out = pcm if in_place else np.array(pcm, dtype=np.float32, copy=True)
    if gain != 1.0:
        for a in range(0, len(pcm), LEVEL_CHUNK):
            out[a:a + LEVEL_CHUNK] = np.asarray(pcm[a:a + LEVEL_CHUNK], np.float64) * gain
    return out


def hann_symmetric(win: int) -> np.ndarray:
    """§3.4: 0.5 - 0.5 cos(2 pi i / (win - 1)), i = 0 .. win - 1 (not the periodic window)."""
    i = np.arange(win, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * i / (win - 1))).astype(np.float32)


def power_spectrum(pcm: np.ndarray, hop: int, win: int, fft: int, split: Split = _whole) -> np.ndarray:
    """§3.3-3.5: (samples // hop, fft // 2 + 1) float32 power re^2 + im^2 of the symmetric-Hann
    windowed frames; frame t reads samples hop*t - win/2 .. hop*t + win/2 - 1, zero outside.
    The frames over `split` at once (numpy's FFT releases the GIL)."""
    frames = len(pcm) // hop
    power = np.empty((frames, fft // 2 + 1), np.float32)

    def rows(first: int, end: int) -> None:
        for a, b, part in power_blocks(pcm, hop, win, fft, max(end - first, 1), first, end):
            power[a:b] = part

    split(rows, frames)
    return power


def power_blocks(pcm: np.ndarray, hop: int, win: int, fft: int, block_frames: int,
                 first: int = 0, end: int | None = None):
    """`power_spectrum`'s rows `block_frames` at a time from frame `first` to `end` (the last
    frame when None): yields (first frame, end frame, power), each block's rows exactly those of
    the whole (a long clip's gate never holds all of them)."""
    end = len(pcm) // hop if end is None else end
    if end <= first:
        return
    half = win // 2
    window = hann_symmetric(win)
    # numpy's float64 real FFT of an already zero-padded frame is faster than its float32 path
    # with n= padding, and more exact. Blocks of frames bound the float64 and complex
    # temporaries (30 s at once: ~35 MB); each frame's FFT is independent of the others.
    framed = np.zeros((min(end - first, FFT_BLOCK_FRAMES), fft), np.float64)
    for a in range(first, end, block_frames):
        b = min(end, a + block_frames)
        power = np.empty((b - a, fft // 2 + 1), np.float32)
        for c in range(a, b, FFT_BLOCK_FRAMES):
            d = min(b, c + FFT_BLOCK_FRAMES)
            # frames c .. d-1 read samples c*hop - half .. (d-1)*hop + half - 1, zero outside the clip
            lo = c * hop - half
            seg = np.zeros((d - c - 1) * hop + win, np.float32)
            s0, s1 = max(lo, 0), min(lo + len(seg), len(pcm))
            seg[s0 - lo:s1 - lo] = pcm[s0:s1]
            view = np.lib.stride_tricks.sliding_window_view(seg, win)[::hop]
            block = framed[:d - c]
            np.multiply(view, window, out=block[:, :win])
            spec = np.fft.rfft(block, axis=1)
            power[c - a:d - a] = np.square(spec.real) + np.square(spec.imag)
        yield a, b, power


def filter_support(mel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each mel filter's bins: (has any, first non-zero bin, one past the last), each (mels,). A
    filter's weights are non-zero only over its triangle, so the bins between are its support."""
    nonzero = mel != 0
    has = nonzero.any(axis=0)
    first = nonzero.argmax(axis=0)
    end = mel.shape[0] - nonzero[::-1].argmax(axis=0)
    return has, first, end


def mel_energies(power: np.ndarray, mel: np.ndarray, split: Split = _whole) -> np.ndarray:
    """power (frames, bins) @ mel (bins, mels), one band at a time over its non-zero bins, the
    bands' ranges of `split` at once (by bands, not frames: each band's sums are the same
    whatever the split).

    Each triangular filter spans a few bins, so this is ~30x fewer operations than the dense
    product (and BLAS is erratic at this odd inner size, 257).
    """
    out = np.zeros((mel.shape[1], power.shape[0]), np.float32)  # band-major, transposed at the end
    has, lo, hi = filter_support(mel)
    spans = [(band, lo[band], hi[band]) for band in np.flatnonzero(has)]

    def bands(a: int, b: int) -> None:
        # power is finite by construction (sanitised, levelled pcm), but numpy's dot reports the
        # FPU's invalid flag without clearing it first, and a kernel earlier in this thread may
        # have left it set (seen once in a 60-minute stream: "invalid value encountered in dot"
        # on finite input).
        with np.errstate(invalid="ignore"):
            for band, lo, hi in spans[a:b]:
                np.dot(power[:, lo:hi], mel[lo:hi, band], out=out[band])

    split(bands, len(spans))
    return out.T


def log_mel(pcm: np.ndarray, mel: np.ndarray, hop: int, win: int, split: Split = _whole) -> np.ndarray:
    """§3.3-3.8: (samples // hop, mels) float32 normalised log-mel features of a clip.

    mel is the file's (fft // 2 + 1, mels) filterbank; pcm is taken as already sanitised and
    levelled. Each channel is standardised over the clip with the n - 1 standard deviation.
    The spectrum (by frames) and the mel energies (by bands) run over `split`.
    """
    fft = 2 * (mel.shape[0] - 1)
    power = power_spectrum(pcm, hop, win, fft, split)
    x = np.log(mel_energies(power, mel, split) + np.float32(LOG_FLOOR))
    if len(x) == 0:
        return x.astype(np.float32)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=0)
    std = np.sqrt(((x64 - mean) ** 2).sum(axis=0) / max(len(x) - 1, 1))
    return ((x64 - mean) / (std + STD_EPS)).astype(np.float32)


def features(pcm: np.ndarray, mel: np.ndarray, hop: int, win: int, split: Split = _whole) -> np.ndarray:
    """The whole §3 front end: sanitise, level, log-mel. float32 16 kHz in, (frames, mels) out."""
    return log_mel(apply_level(sanitize(pcm), in_place=True), mel, hop, win, split)


# ---------------------------------------------------------------- §8 silence gate


def gate_bands(mel: np.ndarray, rate: int) -> np.ndarray:
    """Indices of the mel bands whose filter (its non-zero bins) lies within 250-3500 Hz."""
    bins = mel.shape[0]
    freqs = np.arange(bins) * (rate / 2.0) / (bins - 1)
    has, lo, hi = filter_support(mel)
    return np.flatnonzero(has & (freqs[lo] >= GATE_BAND_HZ[0]) & (freqs[hi - 1] <= GATE_BAND_HZ[1])).astype(np.int64)


def silence_gate_db(pcm: np.ndarray, mel: np.ndarray, rate: int, hop: int, win: int) -> float:
    """§8: how far (dB) the loud frame (99th by selection) sits above the quiet one (10th) in
    per-frame power summed over the gate's mel bands. 0.0 for digital silence or no frames."""
    if not np.any(pcm):
        return 0.0
    fft = 2 * (mel.shape[0] - 1)
    frames = len(pcm) // hop
    if frames == 0:
        return 0.0
    gate_mel = mel[:, gate_bands(mel, rate)]   # only the bands it sums: each band's energy is its own
    band = np.empty(frames, np.float32)
    # GATE_BLOCK_FRAMES at a time: an hour's power spectrum at once was ~1 GB
    for a, b, power in power_blocks(pcm, hop, win, fft, GATE_BLOCK_FRAMES):
        band[a:b] = mel_energies(power, gate_mel).sum(axis=1)
    db = 10.0 * np.log10(band.astype(np.float64) + GATE_POWER_FLOOR)
    return _select(db, GATE_QUANTILES[0]) - _select(db, GATE_QUANTILES[1])


def is_speech(pcm: np.ndarray, mel: np.ndarray, rate: int, hop: int, win: int) -> bool:
    """§8: False when the clip should return empty text without decoding (silence, steady noise)."""
    return silence_gate_db(pcm, mel, rate, hop, win) >= GATE_MARGIN_DB
