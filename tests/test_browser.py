"""The captions page in a real, headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium), its microphone a WAV of held-out demo sentences (Chromium's fake media device), against
a real server process (the bundled demo model). Screenshots go to test-artifacts/."""

from __future__ import annotations

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

webdriver = pytest.importorskip("selenium.webdriver")
if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
    pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """Eight held-out demo sentences with pauses, as the microphone's WAV; and their truth."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from streaming import build_stream

    audio, utts = build_stream(8, seed=3)
    audio = np.concatenate([np.zeros(RATE, np.float32), audio, np.zeros(2 * RATE, np.float32)])
    path = tmp_path_factory.mktemp("mic") / "speech.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(RATE)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return path, len(audio) / RATE, [(a + 1.0, b + 1.0, text) for a, b, text, _ in utts]


# The browser's capture path (Chromium's fake device plays the WAV from when the page asks for the
# microphone, at 48 kHz, in render quanta on a loaded 2-vCPU machine) shifts the audio against the
# VAD's frames from run to run, and the demo model reads a sentence differently with a tenth of a
# second more or less around it: measured page WER 13.7-27.5 % where each sentence alone reads at
# 13.7 %. The page is held to this many points above the sentences read alone.
BROWSER_WER_MARGIN = 0.20


@pytest.fixture(scope="module")
def one_shot(speech):
    """The demo model on each sentence alone: (WER, its words on the microphone's clock)."""
    from whistle_stream import Whistle

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from streaming import build_stream
    from streaming import one_shot as shots

    model = Whistle()
    _, utts = build_stream(8, seed=3)
    text, words = shots(model, utts)
    words = [dict(w, start=w["start"] + 1.0, end=w["end"] + 1.0) for w in words]   # the WAV's leading second
    return wer([" ".join(u[2] for u in utts)], [text]), words



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
                 "--no-first-run", "--window-size=1280,800"):
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
    driver.find_element("id", "start").click()
    wait_for(lambda: "live" in page_state(driver)["status"], 60, "the page to go live")
    t0 = time.monotonic()
    if during is not None:
        during(driver, t0)
    time.sleep(max(0.0, seconds + 3.0 - (time.monotonic() - t0)))
    driver.find_element("id", "stop").click()
    return wait_for(lambda: (s := page_state(driver))["status"].startswith("done") and s, 30, "the final")


@pytest.fixture(scope="module")
def live(speech, tmp_path_factory, axe_source):
    """One uninterrupted run through the page, shared by the checks below."""
    wav, seconds, _ = speech
    downloads = tmp_path_factory.mktemp("downloads")
    with ServerProcess("--resume-secret", SECRET) as server:
        driver = browser(wav, downloads)
        try:
            state = stream_through_page(driver, server, seconds)
            ARTIFACTS.mkdir(exist_ok=True)
            driver.save_screenshot(str(ARTIFACTS / "captions.png"))
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
            time.sleep(3)
            driver.save_screenshot(str(ARTIFACTS / "captions-overlay.png"))
            overlay = driver.execute_script(
                "return {controls: getComputedStyle(document.getElementById('controls')).display,"
                " background: getComputedStyle(document.body).backgroundColor,"
                " size: getComputedStyle(document.getElementById('captions')).fontSize};")
            overlay_violations = run_axe(driver, axe_source)
            driver.execute_script("stop();")                      # the overlay has no controls
            errors += console_errors(driver)
        finally:
            driver.quit()
    return {"state": state, "styles": styles, "files": files, "violations": violations, "errors": errors,
            "overlay": overlay, "overlay_violations": overlay_violations}


def test_the_page_captions_the_microphone_within_the_streaming_line(live, speech, one_shot):
    truth = " ".join(u[2] for u in speech[2])
    got, one_shot = wer([truth], [live["state"]["transcript"]]), one_shot[0]
    print(f"\npage WER {100 * got:.1f} %, sentences alone {100 * one_shot:.1f} %; {live['state']['status']}; "
          f"the microphone file {speech[1]:.1f} s")
    assert live["state"]["transcript"].strip() and got <= one_shot + BROWSER_WER_MARGIN
    committed, pending, style = live["styles"]
    assert committed != pending and style == "italic"          # pending text is styled apart
    assert live["errors"] == []                                 # nothing in the console
    assert (ARTIFACTS / "captions.png").stat().st_size > 10_000


def test_subtitle_downloads_parse_and_match_the_committed_words(live):
    import srt
    import webvtt

    words = [w for w in live["state"]["words"] if w["word"].strip()]
    cues = list(srt.parse(live["files"]["srt"]))
    assert " ".join(c.content.replace("\n", " ") for c in cues).split() == [w["word"] for w in words]
    starts = {round(w["start"], 3) for w in words}
    assert all(round(c.start.total_seconds(), 3) in starts for c in cues)
    vtt = list(webvtt.from_buffer(io.StringIO(live["files"]["vtt"])))
    assert [c.text for c in vtt] == [c.content for c in cues]
    assert live["files"]["txt"].strip() == live["state"]["transcript"].strip()


def test_axe_finds_no_serious_or_critical_violations_in_either_mode(live):
    assert live["violations"] == [], [v["id"] for v in live["violations"]]
    assert live["overlay_violations"] == [], [v["id"] for v in live["overlay_violations"]]


def test_the_overlay_hides_the_controls_on_a_transparent_background(live):
    o = live["overlay"]
    assert o["controls"] == "none" and o["background"] == "rgba(0, 0, 0, 0)" and o["size"] == "56px"


def test_the_page_reconnects_and_continues_when_the_server_restarts(speech, one_shot, tmp_path):
    wav, seconds, utts = speech
    port = free_port()
    servers = [ServerProcess("--resume-secret", SECRET, "--port", str(port)).start()]
    seen = []

    def restart(driver, t0):
        time.sleep(max(0.0, 9.0 - (time.monotonic() - t0)))
        servers[0].stop()                                     # SIGTERM: drains, final(shutdown) with a token
        seen.append(wait_for(lambda: "reconnecting" in page_state(driver)["status"] and
                             page_state(driver)["statusClass"], 10, "the reconnecting status"))
        servers.append(ServerProcess("--resume-secret", SECRET, "--port", str(port)).start())
        wait_for(lambda: "live again" in page_state(driver)["status"], 30, "the page to resume")

    driver = browser(wav, tmp_path)
    try:
        state = stream_through_page(driver, servers[0], seconds, during=restart)
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
    # Whether a word was dropped or doubled at the restart is not judged here: the browser's capture
    # makes the demo model misread sentences anywhere in a run (a misreading looks like a drop or an
    # insertion). tests/test_resume.py holds the resume itself to no word dropped or doubled within
    # 1 s of an interruption, with audio that is the same in every run.
    truth = " ".join(u[2] for u in utts)
    print(f"\nafter a restart: page WER {100 * wer([truth], [state['transcript']]):.1f} %")
    assert wer([truth], [state["transcript"]]) <= one_shot[0] + BROWSER_WER_MARGIN
