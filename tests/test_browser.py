"""The captions page in a real, headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium), its microphone a WAV of held-out demo sentences (Chromium's fake media device), against
a real server process (the bundled demo model). Screenshots go to test-artifacts/."""

from __future__ import annotations

import functools
import io
import shutil
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from harness.servers import ROOT, ServerProcess, free_port
from harness.wer import wer

pytestmark = pytest.mark.slow
SECRET = "browser-test-secret-0123456789"
ARTIFACTS = ROOT / "test-artifacts"
AXE = ROOT / "tests" / ".cache" / "node_modules" / "axe-core" / "axe.min.js"
RATE = 16000
INSECURE_HOST = "whistle.test"

webdriver = pytest.importorskip("selenium.webdriver")
if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
    pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """The streaming tests' stream (held-out demo sentences with pauses) as the microphone's WAV,
    after a second of silence; and their truth on the WAV's clock."""
    _, utts = stream_clips()
    audio = source_audio()
    path = tmp_path_factory.mktemp("mic") / "speech.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(RATE)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return path, len(audio) / RATE, [(a + 1.0, b + 1.0, text) for a, b, text, _ in utts]


# The server's streaming line (tests/test_demo_model.py, its 48 kHz microphone test among them): a
# stream's WER is within 1 point of the WER of its sentences, each read alone from the source clips
# (one-shot). The page is held to the same line on the same stream: what a user gets through
# Chromium's capture, the page and the socket against what the engine reads from the clean clips.
STREAMING_LINE = 0.01

# The microphone's sentences: tests/test_demo_model.py's first stream (40 sentences, seed 5), so that
# the line means what it means there (one point is 2.5 words of it).
STREAM = (40, 5)

# Wrapped around the page's keepAudio (every block of microphone PCM, in order, whether or not a
# socket is open): the session's audio as the page captured it.
CAPTURE = ("window.__mic = []; const keep = keepAudio;"
           "keepAudio = (buffer) => { window.__mic.push(new Int16Array(buffer.slice(0))); keep(buffer); };")


@pytest.fixture(scope="module")
def model():
    from whistle_stream import Whistle

    return Whistle()


def captured_audio(driver) -> tuple[np.ndarray, int]:
    """The microphone PCM the page captured (int16) and its rate."""
    encoded = driver.execute_script(
        "const all = new Int16Array(window.__mic.reduce((n, b) => n + b.length, 0)); let at = 0;"
        "for (const b of window.__mic) { all.set(b, at); at += b.length; }"
        "let s = ''; const bytes = new Uint8Array(all.buffer);"
        "for (let i = 0; i < bytes.length; i += 32768) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 32768));"
        "return [btoa(s), rate];")
    import base64

    return np.frombuffer(base64.b64decode(encoded[0]), "<i2"), int(encoded[1])


def replay(model, pcm: np.ndarray, rate: int) -> tuple[str, list[dict]]:
    """The session core (what the server runs) on the captured audio, in the page's 0.1 s blocks,
    uninterrupted: the committed text and words."""
    from whistle_stream.service import protocol as P
    from whistle_stream.service.core import SessionCore

    core = SessionCore(model, P.parse_query(f"sample_rate={rate}&encoding=pcm_s16le"))
    messages = core.open()
    block = round(rate * 0.1)
    for i in range(0, len(pcm), block):
        messages += core.audio(pcm[i:i + block].astype("<i2").tobytes())
    messages += core.finish("close")
    words = [{"word": w.word, "start": w.start, "end": w.end}
             for m in messages if isinstance(m, P.Committed) for w in m.words]
    return " ".join(m.text for m in messages if isinstance(m, P.Committed)).strip(), words


def heard_wav(pcm: np.ndarray, rate: int) -> tuple[np.ndarray, int, float]:
    """The captured audio at 16 kHz, where the WAV starts in it (samples; negative: the capture
    began inside the WAV), and how faithfully it holds the WAV: the lowest correlation of any
    sounding 1 s window of the WAV with the capture, each found within 0.5 s of where the one
    before it was (1.0: every sample there). Chromium's capture inserts 10 ms now and then when its
    audio thread falls behind (seen: 30 ms over a 3-minute stream): what follows is found shifted,
    and a window across the insertion reads 0.7-0.9. Audio that never reached the page reads ~0."""
    import soxr

    heard = soxr.resample(pcm.astype(np.float32) / 32768.0, rate, RATE).astype(np.float32)
    wav = source_audio()
    n = 1 << int(np.ceil(np.log2(len(heard) + len(wav))))
    corr = np.fft.irfft(np.fft.rfft(heard, n) * np.conj(np.fft.rfft(wav, n)), n)
    lag = int(np.argmax(corr))
    lag = lag - n if lag > n // 2 else lag
    window, reach, worst, drift = RATE, RATE // 2, 1.0, lag
    for at in range(max(0, -lag), len(wav) - window, window):
        a = wav[at:at + window]
        lo, hi = max(0, at + drift - reach), min(len(heard), at + drift + reach + window)
        if np.sqrt(np.mean(a ** 2)) < 0.01 or hi - lo < window:
            continue
        seg = heard[lo:hi]
        m = 1 << int(np.ceil(np.log2(len(seg) + window)))
        dots = np.fft.irfft(np.fft.rfft(seg, m) * np.conj(np.fft.rfft(a, m)), m)[:len(seg) - window + 1]
        energy = np.sqrt(np.maximum(np.convolve(seg ** 2, np.ones(window), "valid"), 1e-12))
        best = int(np.argmax(dots / energy))
        worst = min(worst, float(dots[best] / (energy[best] * np.linalg.norm(a) + 1e-12)))
        drift = lo + best - at
    return heard, lag, worst


def sentences_alone(model, pcm: np.ndarray, rate: int, utts) -> tuple[float, float, list[tuple]]:
    """Each sentence cut from the captured audio (where the WAV's copy of it lands) and read
    alone: (the WER, the capture's delay in seconds, the sentences' (start, end, text) on the
    capture's clock)."""
    heard, lag, _ = heard_wav(pcm, rate)
    texts = []
    moved = [(a + lag / RATE, b + lag / RATE, text) for a, b, text in utts]
    for a, b, text in moved:
        texts.append(model.transcribe(heard[max(0, int(a * RATE)):int(b * RATE)], by="windows")["text"])
    return wer([" ".join(u[2] for u in utts)], [" ".join(texts)]), lag / RATE, moved


def misread(truth: str, text: str) -> list[str]:
    """The words `text` gets wrong against `truth`, as 'said->read' (read '' for a dropped word)."""
    from harness.wer import alignment, normalise

    ref, hyp = normalise(truth), normalise(text)
    return [f"{'' if i is None else ref[i]}->{'' if j is None else hyp[j]}"
            for kind, i, j in alignment(ref, hyp) if kind != "="]


@functools.lru_cache(maxsize=1)
def stream_clips() -> tuple[np.ndarray, list]:
    """benchmarks/streaming.py's build_stream(*STREAM), made once for the module."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from streaming import build_stream

    return build_stream(*STREAM)


def source_audio() -> np.ndarray:
    audio, _ = stream_clips()
    return np.concatenate([np.zeros(RATE, np.float32), audio, np.zeros(2 * RATE, np.float32)])



@pytest.fixture(scope="module")
def axe_source() -> str:
    if not AXE.exists():
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(AXE.parents[2]),
                        "axe-core@4"], check=True, timeout=300)
    return AXE.read_text()


def browser(wav: Path, downloads: Path):
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 f"--use-file-for-fake-audio-capture={wav}%noloop", "--autoplay-policy=no-user-gesture-required",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=1280,800",
                 # a name for the loopback server that is not localhost: a page over plain http there
                 # is not a secure context, as on another machine of the network
                 f"--host-resolver-rules=MAP {INSECURE_HOST} 127.0.0.1"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    return driver


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def page_state(driver) -> dict:
    return driver.execute_script("return {transcript: transcript, words: words, seqs: seqs,"
                                 " status: ui.status.textContent, statusClass: ui.status.className};")


def console_errors(driver) -> list:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def run_axe(driver, source: str) -> list:
    driver.execute_script(source)
    result = driver.execute_async_script("const done = arguments[arguments.length - 1];"
                                         "axe.run(document).then((r) => done(r.violations));")
    return [v for v in result if v["impact"] in ("serious", "critical")]


def stream_through_page(driver, server, seconds: float, during=None) -> dict:
    driver.get(server.http + "/")
    driver.execute_script(CAPTURE)
    driver.find_element("id", "start").click()
    wait_for(lambda: "live" in page_state(driver)["status"], 60, "the page to go live")
    t0 = time.monotonic()
    model = driver.execute_script("const n = document.getElementById('model-note');"
                                  "return {status: ui.status.textContent, note: n.textContent, shown: !n.hidden};")
    if during is not None:
        during(driver, t0)
    time.sleep(max(0.0, seconds + 3.0 - (time.monotonic() - t0)))
    driver.find_element("id", "stop").click()
    state = wait_for(lambda: (s := page_state(driver))["status"].startswith("done") and s, 30, "the final")
    return {**state, "model": model}


@pytest.fixture(scope="module")
def live(speech, tmp_path_factory, axe_source):
    """One uninterrupted run through the page, shared by the checks below."""
    wav, seconds, _ = speech
    downloads = tmp_path_factory.mktemp("downloads")
    with ServerProcess("--resume-secret", SECRET) as server:
        driver = browser(wav, downloads)
        try:
            state = stream_through_page(driver, server, seconds)
            pcm, rate = captured_audio(driver)
            ARTIFACTS.mkdir(exist_ok=True)
            driver.save_screenshot(str(ARTIFACTS / "captions.png"))
            # the captions overflow their box (40 sentences) and the page has followed them to the end
            follows = driver.execute_script("const c = ui.captions; return [c.scrollHeight > 2 * c.clientHeight,"
                                            " c.scrollHeight - c.scrollTop - c.clientHeight];")
            styles = driver.execute_script(
                "const c = document.querySelector('.committed'), p = document.querySelector('.pending');"
                "const s = (e) => getComputedStyle(e); return [s(c).color, s(p).color, s(p).fontStyle];")
            for kind in ("srt", "vtt", "txt"):
                driver.find_element("id", f"download-{kind}").click()
            files = {kind: wait_for(lambda k=kind: (downloads / f"captions.{k}").exists() and
                                    (downloads / f"captions.{k}").read_text(), 20, f"captions.{kind}")
                     for kind in ("srt", "vtt", "txt")}
            violations = run_axe(driver, axe_source)
            errors = console_errors(driver)
            driver.get(server.http + "/?overlay=1&lines=2&size=56")
            wait_for(lambda: len(page_state(driver)["words"]) >= 6, 60, "overlay captions")
            # the screenshot as OBS composites it: the transparent page over a dark video frame
            driver.execute_script("document.documentElement.style.background = '#2d4a5e';")
            driver.save_screenshot(str(ARTIFACTS / "captions-overlay.png"))
            driver.execute_script("document.documentElement.style.background = '';")
            overlay = driver.execute_script(
                "return {controls: getComputedStyle(document.getElementById('controls')).display,"
                " background: getComputedStyle(document.body).backgroundColor,"
                " size: getComputedStyle(document.getElementById('captions')).fontSize};")
            overlay_violations = run_axe(driver, axe_source)
            driver.execute_script("stop();")                      # the overlay has no controls
            errors += console_errors(driver)
            # over plain http on a name other than localhost the browser gives no microphone
            driver.get(f"http://{INSECURE_HOST}:{server.port}/")
            driver.find_element("id", "start").click()
            insecure = wait_for(lambda: (st := page_state(driver))["statusClass"] == "error" and st, 10, "the error")
            insecure["color"] = driver.execute_script("return [getComputedStyle(ui.status).color,"
                                                      " getComputedStyle(document.body).color];")
            driver.save_screenshot(str(ARTIFACTS / "captions-insecure.png"))
        finally:
            driver.quit()
    return {"state": state, "styles": styles, "files": files, "violations": violations, "errors": errors,
            "overlay": overlay, "overlay_violations": overlay_violations, "pcm": pcm, "rate": rate,
            "follows": follows, "insecure": insecure}


def test_the_page_captions_the_microphone_within_the_streaming_line(live, speech, model):
    """The server's streaming line through the page: its captions read within 1 point of the WER of
    the stream's sentences read alone from the source clips (the streaming tests' one-shot), and the
    server (through the page and the socket) commits exactly what the session core commits on the
    audio the page captured, in-process: the page and the transport lose, add or reorder nothing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from streaming import one_shot

    truth = " ".join(u[2] for u in speech[2])
    page = live["state"]["transcript"]
    shot = wer([truth], [one_shot(model, stream_clips()[1])[0]])
    captured, delay, _ = sentences_alone(model, live["pcm"], live["rate"], speech[2])
    replayed, _ = replay(model, live["pcm"], live["rate"])
    got = wer([truth], [page])
    print(f"\npage WER {100 * got:.1f} %, its sentences alone {100 * shot:.1f} % (cut from the capture and read "
          f"alone: {100 * captured:.1f} %), the session core on the capture {100 * wer([truth], [replayed]):.1f} %; "
          f"capture {len(live['pcm']) / live['rate']:.1f} s at {live['rate']} Hz, {delay:.2f} s behind the page's "
          f"start; {live['state']['status']}")
    _, _, fidelity = heard_wav(live["pcm"], live["rate"])
    print(f"the capture holds the WAV: lowest window correlation {fidelity:.3f}; the page's errors: "
          f"{misread(truth, page)}")
    assert page.strip() and page.split() == replayed.split()   # the page and the socket lose, add, reorder nothing
    committed, pending, style = live["styles"]
    assert committed != pending and style == "italic"          # pending text is styled apart
    assert live["errors"] == []                                 # nothing in the console
    assert (ARTIFACTS / "captions.png").stat().st_size > 10_000
    if fidelity < 0.5:   # seen once in six runs: Chromium's capture lost the microphone's audio
        pytest.xfail(f"Chromium's capture does not hold the microphone WAV (lowest window correlation "
                     f"{fidelity:.3f}, page WER {100 * got:.1f} %): the streaming line cannot be judged on it")
    assert got <= shot + STREAMING_LINE


def test_the_page_says_which_model_runs_and_what_the_demo_model_hears(live):
    from whistle_stream.models import DEMO_NOTE

    model = live["state"]["model"]
    assert model["status"] == "live (demo.cact)"
    assert model["shown"] and model["note"] == DEMO_NOTE and "whistle-stream download" in model["note"]


def test_subtitle_downloads_parse_and_match_the_committed_words(live):
    import srt
    import webvtt

    from whistle_stream.subtitles import make_cues

    words = [w for w in live["state"]["words"] if w["word"].strip()]
    cues = list(srt.parse(live["files"]["srt"]))
    assert " ".join(c.content.replace("\n", " ") for c in cues).split() == [w["word"] for w in words]
    # each cue's times are its words' (whistle_stream.subtitles' rules, the CLI's), to the millisecond
    expected = make_cues(words)
    assert [(round(c.start.total_seconds() * 1000), round(c.end.total_seconds() * 1000), c.content.split("\n"))
            for c in cues] == [(round(c.start * 1000), round(c.end * 1000), list(c.lines)) for c in expected]
    assert [round(c.start.total_seconds(), 3) for c in cues] == [
        round(words[sum(len(e.text.split()) for e in expected[:i])]["start"], 3) for i in range(len(expected))]
    vtt = list(webvtt.from_buffer(io.StringIO(live["files"]["vtt"])))
    stamp = srt.timedelta_to_srt_timestamp
    assert [(c.start.replace(".", ","), c.end.replace(".", ","), c.text) for c in vtt] == [
        (stamp(c.start), stamp(c.end), c.content) for c in cues]
    assert live["files"]["txt"].strip() == live["state"]["transcript"].strip()


def test_axe_finds_no_serious_or_critical_violations_in_either_mode(live):
    assert live["violations"] == [], [v["id"] for v in live["violations"]]
    assert live["overlay_violations"] == [], [v["id"] for v in live["overlay_violations"]]


def test_the_captions_follow_the_newest_line(live):
    overflowing, below = live["follows"]
    assert overflowing and below <= 2, live["follows"]


def test_a_page_without_a_secure_context_says_it_needs_https_as_an_error(live):
    """Opened over plain http on a name other than localhost (no getUserMedia there), Start says
    what is needed, styled as an error (not the status line's muted grey)."""
    state = live["insecure"]
    assert "https" in state["status"] and "undefined" not in state["status"], state["status"]
    status_color, text_color = state["color"]
    assert status_color == "rgb(255, 138, 138)" and status_color != text_color


def test_the_overlay_hides_the_controls_on_a_transparent_background(live):
    o = live["overlay"]
    assert o["controls"] == "none" and o["background"] == "rgba(0, 0, 0, 0)" and o["size"] == "56px"


def test_the_page_reconnects_and_continues_when_the_server_restarts(speech, model, tmp_path):
    """SIGTERM mid-sentence: the page says it is reconnecting, resumes the session on the new
    process, replays the audio the server had not settled, and its captions lose and repeat no
    committed word: against the session core reading the same captured audio uninterrupted, no word
    is dropped or doubled within 1 s of the restart (test_resume's seam line) and the whole reads
    within 1 point of it."""
    from harness.wer import seam_errors

    wav, seconds, utts = speech
    port = free_port()
    servers = [ServerProcess("--resume-secret", SECRET, "--port", str(port)).start()]
    seen, at = [], []

    def restart(driver, t0):
        time.sleep(max(0.0, 9.0 - (time.monotonic() - t0)))
        at.append(driver.execute_script("return window.__mic.reduce((n, b) => n + b.length, 0) / rate;"))
        servers[0].stop()                                     # SIGTERM: drains, final(shutdown) with a token
        seen.append(wait_for(lambda: "reconnecting" in page_state(driver)["status"] and
                             page_state(driver)["statusClass"], 10, "the reconnecting status"))
        driver.save_screenshot(str(ARTIFACTS / "captions-reconnecting.png"))
        servers.append(ServerProcess("--resume-secret", SECRET, "--port", str(port)).start())
        wait_for(lambda: "live again" in page_state(driver)["status"], 30, "the page to resume")

    ARTIFACTS.mkdir(exist_ok=True)
    driver = browser(wav, tmp_path)
    try:
        state = stream_through_page(driver, servers[0], seconds, during=restart)
        pcm, rate = captured_audio(driver)
        driver.save_screenshot(str(ARTIFACTS / "captions-after-restart.png"))
        errors = [e for e in console_errors(driver) if "WebSocket" not in e["message"]]
    finally:
        driver.quit()
        for s in servers:
            s.stop()
    assert seen == ["reconnecting"]
    assert errors == []
    resumed = [e for e in servers[1].log if e.get("event") == "session_resumed"]
    assert len(resumed) == 1
    assert state["seqs"] == list(range(1, len(state["seqs"]) + 1))     # no commit lost or repeated
    starts = [w["start"] for w in state["words"]]
    assert starts == sorted(starts)
    plain, plain_words = replay(model, pcm, rate)
    _, _, moved = sentences_alone(model, pcm, rate, utts)
    seams = seam_errors(plain_words, state["words"], at, window=1.0, truth=moved)
    truth = " ".join(u[2] for u in utts)
    ours, uninterrupted = wer([truth], [state["transcript"]]), wer([truth], [plain])
    print(f"\nafter a restart at {at[0]:.1f} s: page WER {100 * ours:.1f} %, the same audio uninterrupted "
          f"{100 * uninterrupted:.1f} %; seams {seams}")
    assert seams["dropped"] == [] and seams["doubled"] == [] and seams["across"] == [], seams
    assert ours <= uninterrupted + STREAMING_LINE
