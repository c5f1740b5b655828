"""The front end (guide §3) and silence gate (§8) against NumPy twins written from the guide."""

import io
import time
import wave

import numpy as np
import pytest

from whistle_stream import frontend as F
from whistle_stream.errors import AudioError

RATE, HOP, WIN, FFT, MELS = 16000, 160, 400, 512, 80
RNG = np.random.default_rng(0)


def mel_bank():
    """A triangular mel filterbank shaped like the file's (257, 80) record (values differ)."""
    freqs = np.linspace(0, RATE / 2, FFT // 2 + 1)[:, None]
    mel = lambda f: 2595 * np.log10(1 + f / 700)
    hz = lambda m: 700 * (10 ** (m / 2595) - 1)
    pts = hz(np.linspace(0, mel(RATE / 2), MELS + 2))
    lo, mid, hi = pts[:-2], pts[1:-1], pts[2:]
    return np.maximum(0, np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid))).astype(np.float32)


MEL = mel_bank()


def twin_log_mel(pcm, window="symmetric", pad="zeros", spectrum="power", ddof=1):
    """§3 steps 3-8 with explicit loops; the keyword arguments switch in each trap's wrong variant."""
    frames = len(pcm) // HOP
    i = np.arange(WIN)
    if window == "symmetric":
        w = 0.5 - 0.5 * np.cos(2 * np.pi * i / (WIN - 1))
    else:
        w = 0.5 - 0.5 * np.cos(2 * np.pi * i / WIN)
    padded = np.pad(pcm.astype(np.float64), WIN // 2 + HOP, mode="constant" if pad == "zeros" else "reflect")
    out = np.empty((frames, MELS))
    for t in range(frames):
        start = HOP * t - WIN // 2 + WIN // 2 + HOP
        spec = np.fft.rfft(padded[start:start + WIN] * w, n=FFT)
        p = spec.real ** 2 + spec.imag ** 2 if spectrum == "power" else np.abs(spec)
        out[t] = np.log(p @ MEL.astype(np.float64) + 2.0 ** -24)
    std = out.std(0, ddof=ddof)
    return ((out - out.mean(0)) / (std + 1e-5)).astype(np.float32)


def speechlike(seconds=2.0, seed=0):
    """Amplitude-modulated harmonics with pauses: varied enough to separate every trap."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    x = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / RATE) / k for k in range(1, 12))
    env = np.clip(np.sin(2 * np.pi * 2.5 * t), 0, None) ** 2
    return (0.3 * x * env + 1e-3 * rng.standard_normal(len(t))).astype(np.float32)


# ---------------------------------------------------------------- §3


def test_log_mel_matches_the_guide_twin():
    pcm = speechlike(1.37)
    got = F.log_mel(pcm, MEL, HOP, WIN)
    assert got.shape == (len(pcm) // HOP, MELS)
    np.testing.assert_allclose(got, twin_log_mel(pcm), atol=1e-5 * 10, rtol=1e-5)
    assert np.abs(got - twin_log_mel(pcm)).mean() < 1e-5


@pytest.mark.parametrize("trap", [dict(window="periodic"), dict(pad="reflect"), dict(spectrum="magnitude"),
                                  dict(ddof=0)], ids=["periodic_hann", "reflect_padding", "magnitude", "n_std"])
def test_each_section3_trap_changes_the_features_and_we_take_the_right_side(trap):
    pcm = speechlike(1.0, seed=1)
    ours, right, wrong = F.log_mel(pcm, MEL, HOP, WIN), twin_log_mel(pcm), twin_log_mel(pcm, **trap)
    assert np.abs(ours - right).max() < 1e-4
    assert np.abs(ours - wrong).max() > 1e-3


def test_window_is_the_symmetric_hann():
    w = F.hann_symmetric(WIN)
    assert w[0] == 0 and w[-1] == 0 and np.allclose(w, w[::-1])
    np.testing.assert_allclose(w, np.hanning(WIN), atol=1e-7)


def test_frames_are_centred_with_zero_padding():
    pcm = np.zeros(HOP * 4, np.float32)
    pcm[:WIN // 2] = 1.0  # only frame 0 sees these samples in its second half
    power = F.power_spectrum(pcm, HOP, WIN, FFT)
    assert power.shape[0] == 4
    dc = F.hann_symmetric(WIN)[WIN // 2:].astype(np.float64).sum() ** 2
    np.testing.assert_allclose(power[0, 0], dc, rtol=1e-5)


def test_the_power_spectrum_in_blocks_equals_every_frame_at_once():
    """power_spectrum runs FFT_BLOCK_FRAMES frames at a time (bounded temporaries): across the
    blocks' edges every frame is the one-pass float64 computation, to the bit."""
    rng = np.random.default_rng(3)
    pcm = (0.1 * rng.standard_normal(HOP * (2 * F.FFT_BLOCK_FRAMES + 37))).astype(np.float32)
    padded = np.zeros(len(pcm) // HOP * HOP + WIN, np.float32)
    padded[WIN // 2:WIN // 2 + len(pcm)] = pcm[:len(padded) - WIN // 2]
    frames = np.lib.stride_tricks.sliding_window_view(padded, WIN)[::HOP][:len(pcm) // HOP]
    framed = np.zeros((len(frames), FFT))
    framed[:, :WIN] = frames * F.hann_symmetric(WIN)
    spec = np.fft.rfft(framed, axis=1)
    assert np.array_equal(F.power_spectrum(pcm, HOP, WIN, FFT), (spec.real ** 2 + spec.imag ** 2).astype(np.float32))


def test_frame_count_is_samples_floor_divided_by_hop():
    for n in (0, 159, 160, 161, 16077):
        assert F.log_mel(np.ones(n, np.float32) * 0.1, MEL, HOP, WIN).shape == (n // HOP, MELS)


def test_level_gain_selects_the_block_rather_than_interpolating():
    blocks = 150
    rms = np.linspace(0.01, 0.5, blocks)
    rms[-3:] = [2.0, 3.0, 4.0]  # the percentile interpolates between 2.0 and 3.0 at index 147.51
    pcm = np.concatenate([np.full(F.LEVEL_BLOCK, r) * np.where(np.arange(F.LEVEL_BLOCK) % 2, 1, -1)
                          for r in rms]).astype(np.float32)
    k = int(0.99 * (blocks - 1))
    assert F.level_gain(pcm) == pytest.approx(0.1 / np.sort(rms)[k], rel=1e-6)
    assert F.level_gain(pcm) != pytest.approx(0.1 / np.percentile(rms, 99), rel=1e-3)


def test_level_gain_leaves_silence_and_short_clips_alone():
    assert F.level_gain(np.zeros(16000, np.float32)) == 1.0
    assert F.level_gain(np.full(319, 0.5, np.float32)) == 1.0
    np.testing.assert_array_equal(F.apply_level(np.full(100, 1e-7, np.float32)), np.full(100, 1e-7, np.float32))


def test_sanitize_zeroes_nan_inf_and_huge_samples_only():
    pcm = np.array([np.nan, np.inf, -np.inf, 65536.0, -70000.0, 65535.5, -1.0, 0.25], np.float32)
    np.testing.assert_array_equal(F.sanitize(pcm), [0, 0, 0, 0, 0, 65535.5, -1.0, 0.25])


def test_features_are_invariant_to_input_level():
    pcm = speechlike(1.0, seed=2)
    np.testing.assert_allclose(F.features(pcm * 0.01, MEL, HOP, WIN), F.features(pcm, MEL, HOP, WIN), atol=2e-4)


@pytest.mark.reference
def test_log_mel_matches_the_reference_jax_features():
    import jax.numpy as jnp
    from needle.model.whistle import WhistleConfig, features, mel_matrix

    cfg = WhistleConfig()
    mel = mel_matrix(cfg)
    pcm = speechlike(2.3, seed=3)
    ref, frames = features(cfg, jnp.asarray(pcm)[None], jnp.array([len(pcm)]))
    ref = np.asarray(ref[0, :int(frames[0])])
    got = F.log_mel(pcm, mel, cfg.hop, cfg.win)
    assert got.shape == ref.shape
    # The reference's float32 FFT loses a few ulps on the quietest bins; ours runs in float64.
    assert np.abs(got - ref).max() < 5e-4
    assert np.abs(got - ref).mean() < 5e-6


# ---------------------------------------------------------------- §8


def test_gate_stops_digital_silence_fast():
    pcm = np.zeros(30 * RATE, np.float32)
    F.is_speech(pcm[:RATE], MEL, RATE, HOP, WIN)
    start = time.perf_counter()
    assert not F.is_speech(pcm, MEL, RATE, HOP, WIN)
    assert time.perf_counter() - start < 0.05


def test_gate_stops_steady_white_noise():
    noise = (RNG.standard_normal(5 * RATE) * 0.03).astype(np.float32)
    assert not F.is_speech(noise, MEL, RATE, HOP, WIN)


def test_gate_passes_speech_at_minus_40_dbfs():
    from tests.harness.audio import speech

    pcm = speech("The quick brown fox jumps over the lazy dog.")
    pcm = pcm * np.float32(10 ** (-40 / 20) / np.sqrt((pcm.astype(np.float64) ** 2).mean()))
    assert F.is_speech(pcm, MEL, RATE, HOP, WIN)


def test_gate_bands_lie_within_250_to_3500_hz():
    bands = F.gate_bands(MEL, RATE)
    freqs = np.arange(MEL.shape[0]) * RATE / FFT
    assert len(bands) > 10
    for b in bands:
        support = freqs[MEL[:, b] > 0]
        assert support.min() >= 250 and support.max() <= 3500
    assert bands[0] > 0 and bands[-1] < MELS - 1


def test_filter_support_is_each_filters_first_and_last_non_zero_bin():
    mel = np.zeros((9, 4), np.float32)
    mel[2:5, 0] = [0.5, 1.0, 0.5]
    mel[[3, 7], 2] = 0.25            # a gap inside: the support spans it
    mel[8, 3] = 1.0                  # the last bin
    has, first, end = F.filter_support(mel)
    assert has.tolist() == [True, False, True, True]
    assert (first[has].tolist(), end[has].tolist()) == ([2, 3, 8], [5, 8, 9])
    for band in np.flatnonzero(F.filter_support(MEL)[0]):
        nz = np.flatnonzero(MEL[:, band])
        assert (F.filter_support(MEL)[1][band], F.filter_support(MEL)[2][band]) == (nz[0], nz[-1] + 1)


# ---------------------------------------------------------------- loading


def wav_bytes(samples: np.ndarray, rate: int, width: int, float_format=False) -> bytes:
    """A WAV of (frames, channels) float samples at `width` bytes, written by hand for float."""
    frames, channels = samples.shape
    if float_format:
        body = samples.astype("<f4").tobytes()
        fmt = (b"fmt " + (16).to_bytes(4, "little") + (3).to_bytes(2, "little") + channels.to_bytes(2, "little")
               + rate.to_bytes(4, "little") + (rate * 4 * channels).to_bytes(4, "little")
               + (4 * channels).to_bytes(2, "little") + (32).to_bytes(2, "little"))
        data = b"data" + len(body).to_bytes(4, "little") + body
        return b"RIFF" + (4 + len(fmt) + len(data)).to_bytes(4, "little") + b"WAVE" + fmt + data
    scale = 2 ** (8 * width - 1)
    ints = np.clip(np.round(samples * scale), -scale, scale - 1).astype("<i4")
    raw = ints.view(np.uint8).reshape(frames, channels, 4)[..., :width].tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


@pytest.mark.parametrize("width", [2, 3, 4])
def test_load_audio_reads_pcm_wav_files(tmp_path, width):
    pcm = (RNG.uniform(-0.5, 0.5, (1000, 1))).astype(np.float32)
    path = tmp_path / "a.wav"
    path.write_bytes(wav_bytes(pcm, RATE, width))
    np.testing.assert_allclose(F.load_audio(path), pcm[:, 0], atol=2.0 ** -15)


def test_load_audio_reads_float_wav_and_averages_stereo():
    pcm = RNG.uniform(-0.5, 0.5, (800, 2)).astype(np.float32)
    np.testing.assert_allclose(F.load_audio(wav_bytes(pcm, RATE, 4, float_format=True)), pcm.mean(1), atol=1e-7)


def test_load_audio_scales_int16_and_averages_stereo_arrays():
    a = np.array([[32767, -32768], [16384, 0]], np.int16)
    np.testing.assert_allclose(F.load_audio(a), [(32767 - 32768) / 2 / 32768, 0.25], atol=1e-7)


def test_load_audio_resamples_other_rates():
    pcm = np.sin(2 * np.pi * 440 * np.arange(44100) / 44100).astype(np.float32)
    out = F.load_audio(pcm, rate=44100)
    assert out.dtype == np.float32 and abs(len(out) - RATE) <= 1
    path_rate = F.load_audio(wav_bytes(pcm[:, None] * 0.5, 8000, 2))
    assert abs(len(path_rate) - 2 * 44100) <= 2


def test_load_audio_zeroes_bad_samples_before_resampling():
    pcm = np.zeros(8000, np.float32)
    pcm[100] = np.nan
    assert np.all(np.isfinite(F.load_audio(pcm, rate=8000)))


@pytest.mark.parametrize("bad", [np.zeros(10, np.int32), np.zeros((3, 2, 2), np.float32),
                                 np.zeros((10, 20), np.float32), [0.0, 1.0], b"RIFFxxxxJUNK"])
def test_load_audio_rejects_unsupported_input_clearly(bad):
    with pytest.raises(AudioError, match="audio|WAV|channels"):
        F.load_audio(bad)


def test_load_audio_rejects_missing_files_and_rate_with_a_file(tmp_path):
    with pytest.raises(AudioError, match="cannot read"):
        F.load_audio(tmp_path / "missing.wav")
    path = tmp_path / "a.wav"
    path.write_bytes(wav_bytes(np.zeros((10, 1), np.float32), RATE, 2))
    with pytest.raises(AudioError, match="rate"):
        F.load_audio(path, rate=RATE)


def test_load_audio_keeps_empty_clips_empty():
    assert F.load_audio(np.zeros(0, np.float32)).shape == (0,)


def _speechlike(seconds: float, seed: int = 4) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    bursts = (np.sin(2 * np.pi * 0.7 * t) > 0.2).astype(np.float32)
    return (bursts * 0.2 * np.sin(2 * np.pi * 300 * t) + 0.003 * rng.standard_normal(len(t))).astype(np.float32)


def test_the_gate_in_blocks_reads_every_frame_as_the_whole_clip_at_once(monkeypatch):
    """silence_gate_db reads GATE_BLOCK_FRAMES frames at a time; its figure is the one of the
    whole clip's power spectrum at once, to the bit, across the blocks' edges."""
    pcm = _speechlike(9.37)
    power = F.power_spectrum(pcm, HOP, WIN, FFT)
    band = F.mel_energies(power, MEL)[:, F.gate_bands(MEL, RATE)].sum(axis=1)
    db = 10.0 * np.log10(band.astype(np.float64) + F.GATE_POWER_FLOOR)
    whole = F._select(db, F.GATE_QUANTILES[0]) - F._select(db, F.GATE_QUANTILES[1])
    monkeypatch.setattr(F, "GATE_BLOCK_FRAMES", 130)
    assert F.silence_gate_db(pcm, MEL, RATE, HOP, WIN) == whole != 0.0
    blocks = list(F.power_blocks(pcm, HOP, WIN, FFT, 130))
    assert len(blocks) == 8 and np.array_equal(np.concatenate([p for _, _, p in blocks]), power)


def test_the_front_end_split_over_ranges_or_threads_gives_the_whole_clip_s_numbers(monkeypatch):
    """features(split=): the spectrum by frames and the mel energies by bands over any split
    (uneven ranges called in turn, or the engine's two worker threads) are the whole clip's
    numbers to the bit (the mel sums split by frames rounded differently)."""
    from whistle_stream import blocks as B
    from whistle_stream import kernels as K

    calls = []

    def uneven(fn, total):
        bounds = [0, total // 5, total // 5 + 1, total]
        calls.append(total)
        for a, b in zip(bounds, bounds[1:]):
            fn(a, b)

    pcm = _speechlike(12.3)
    whole = F.features(pcm, MEL, HOP, WIN)
    assert np.array_equal(F.features(pcm, MEL, HOP, WIN, uneven), whole)
    assert calls == [len(pcm) // HOP, MELS]
    monkeypatch.setattr(K, "GEMM_THREADS", 2)
    assert np.array_equal(F.features(pcm, MEL, HOP, WIN, B.run_split), whole)


def test_a_long_clip_s_gate_and_loader_hold_no_clip_sized_temporaries():
    """Ten minutes (38 MB of float32): the loader makes its one sanitised copy, and the gate, the
    frame levels and the sound span hold no more than a few MB besides (the whole clip's power
    spectrum was 48 MB, its float64 squares 77 MB, its index of every sample 77 MB)."""
    import tracemalloc

    from whistle_stream import rules, spans
    pcm = np.tile(_speechlike(30.0), 20)
    tracemalloc.start()
    try:
        for fn, budget in ((lambda: F.load_audio(pcm), pcm.nbytes + (4 << 20)),
                           (lambda: F.silence_gate_db(pcm, MEL, RATE, HOP, WIN), 24 << 20),
                           (lambda: rules.frame_levels(pcm, RATE), 4 << 20),
                           (lambda: spans.sound_span(pcm, RATE), 4 << 20)):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            fn()
            assert tracemalloc.get_traced_memory()[1] - base < budget
    finally:
        tracemalloc.stop()
