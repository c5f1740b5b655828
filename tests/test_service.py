"""End to end: the real server (in this process, on 127.0.0.1, a free port) around the fake engine."""

import asyncio
import time
import dataclasses
import logging
import json
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from whistle_stream.clients import WEB_ROOT
from whistle_stream.clients.client import ListenClient, SessionEnded, to_pcm
from fakes import FakeWhistle, stream_reference
from whistle_stream.service import protocol as P
from whistle_stream.service.config import ServiceConfig
from whistle_stream.service.server import build_app

RATE = 16000


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * RATE))).astype(np.float32)


def voiced(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.5 * ((t * 140) % 1.0 - 0.5)).astype(np.float32)


async def start(model=None, **settings):
    config = ServiceConfig(port=0, workers=2, **settings)
    return await build_app(model=model or FakeWhistle(), config=config, web_root=WEB_ROOT).start()


async def http_get(app, path: str) -> tuple[int, str, str]:
    def get():
        url = f"http://127.0.0.1:{app.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type", ""), e.read().decode()
    return await asyncio.get_running_loop().run_in_executor(None, get)


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def stream(client: ListenClient, audio: np.ndarray, frame: int = 1600) -> None:
    for i in range(0, len(audio), frame):
        await client.send_audio(audio[i:i + frame])


async def eventually(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.fixture
async def app():
    a = await start()
    yield a
    await a.drain()


# -- the happy path --------------------------------------------------------------------------------

async def test_golden_message_sequence_for_a_short_clip(app):
    async with ListenClient(app.url, vad=False) as c:
        sid = c.ready.session_id
        audio = noise(2.5)
        await stream(c, audio[:RATE])
        assert isinstance(await c.receive(), P.Partial)
        await stream(c, audio[RATE:2 * RATE])
        assert isinstance(await c.receive(), P.Committed) and isinstance(await c.receive(), P.Partial)
        await stream(c, audio[2 * RATE:])
        await c.close()
    w = lambda t, s: f'{{"word":" {t}","start":{s},"end":{s + 0.45:g},"probability":0.9}}'
    expected = [
        f'{{"type":"ready","session_id":"{sid}","model":"fake-whistle","languages":["en","de","fr",'
        '"es","it","nl","pl"],"language":null,"sample_rate":16000,"encoding":"pcm_s16le","vad":false,'
        '"keywords":[],"protocol":2,"resumed":false,"seq":0,"replay_from":0.0,"model_note":null}',
        '{"type":"partial","pending":" alpha bravo","language":"en","revision":1}',
        f'{{"type":"committed","seq":1,"text":" alpha bravo","words":[{w("alpha", 0.0)},{w("bravo", 0.5)}],'
        '"end_of_speech":false,"resume":"T","replay_from":2.0}',
        '{"type":"partial","pending":" charlie delta","language":"en","revision":2}',
        f'{{"type":"committed","seq":2,"text":" charlie delta echo","words":[{w("charlie", 1.0)},'
        f'{w("delta", 1.5)},{w("echo", 2.0)}],"end_of_speech":false,"resume":"T","replay_from":2.5}}',
        '{"type":"partial","pending":"","language":"en","revision":3}',
        '{"type":"final","seq":2,"text":" alpha bravo charlie delta echo","language":"en",'
        '"audio_seconds":2.5,"passes":3,"mean_pass_ms":1.0,"reason":"close","resume":"T","replay_from":2.5}',
    ]
    tokens = [m.resume for m in c.messages if isinstance(m, (P.Committed, P.Final))]
    from whistle_stream.service.resume import unseal
    assert [unseal(t, app.resume_secret, time.time())["seq"] for t in tokens] == [1, 2, 2]
    # the tokens are signed with the server's random secret: shown here as "T"
    assert [P.encode(dataclasses.replace(m, resume="T") if isinstance(m, (P.Committed, P.Final)) else m)
            for m in c.messages] == expected
    assert c.ws.close_code == P.CloseCode.NORMAL


async def test_committed_text_equals_the_engines_own_stream_output(app):
    audio = noise(7.3, seed=1)
    async with ListenClient(app.url, vad=False) as c:
        rng = np.random.default_rng(2)
        i = 0
        while i < len(audio):      # frames of random length, including odd sample counts
            n = int(rng.integers(1, 9000))
            await c.send_audio(audio[i:i + n])
            i += n
        final = await c.close()
    reference = stream_reference(FakeWhistle(), audio)
    assert c.text == final.text == reference
    assert [m.seq for m in c.committed] == list(range(1, len(c.committed) + 1))


async def test_finalize_commits_everything_and_the_stream_continues(app):
    async with ListenClient(app.url, vad=False) as c:
        await stream(c, noise(1.3))
        first = await c.finalize()
        assert first.reason == "finalize" and first.text == " alpha bravo"
        assert c.messages[-2] == P.Partial("", "en", 2)
        await stream(c, noise(1.0))
        final = await c.close()
    assert final.text.startswith(first.text) and len(final.text) > len(first.text)
    assert [m.seq for m in c.committed] == list(range(1, len(c.committed) + 1))
    assert final.seq == c.committed[-1].seq


async def test_close_flushes_audio_shorter_than_one_step(app):
    async with ListenClient(app.url, vad=False) as c:
        await stream(c, noise(0.6))
        final = await c.close()
    assert final.text == " alpha" and final.audio_seconds == pytest.approx(0.6)


async def test_resampled_48k_audio_gives_the_same_words(app):
    import soxr
    audio = noise(3.0)
    async with ListenClient(app.url, vad=False, sample_rate=48000, encoding="pcm_f32le") as c:
        await stream(c, soxr.resample(audio, RATE, 48000).astype(np.float32), frame=4800)
        final = await c.close()
    assert final.text == stream_reference(FakeWhistle(), audio)


async def test_language_and_keywords_reach_the_engine_and_configure_updates_them():
    model = FakeWhistle()
    app = await start(model)
    try:
        async with ListenClient(app.url, vad=False, language="de", keywords=["Kaliko", "Irolg"]) as c:
            assert (c.ready.language, c.ready.keywords) == ("de", ("Kaliko", "Irolg"))
            await c.configure(["Wacker"])
            await stream(c, noise(1.0))
            final = await c.close()
        s = model.streams[-1]
        assert (s.language, s.keywords, final.language) == ("de", ["Wacker"], "de")
    finally:
        await app.drain()


async def test_sixteen_concurrent_sessions_all_complete_correctly():
    app = await start(FakeWhistle(pass_s=0.005), max_sessions=16)
    try:
        async def one(k):
            audio = noise(2.0 + 0.25 * k, seed=k)
            async with ListenClient(app.url, vad=False) as c:
                await stream(c, audio, frame=800 + 37 * k)
                final = await c.close()
            assert c.text == final.text == stream_reference(FakeWhistle(), audio)
            assert [m.seq for m in c.committed] == list(range(1, len(c.committed) + 1))
            return c.ready.session_id
        ids = await asyncio.wait_for(asyncio.gather(*(one(k) for k in range(16))), 60)
        assert len(set(ids)) == 16
        _, _, text = await http_get(app, "/metrics")
        assert metric(text, "whistle_sessions_open") == 0
        # the process's own families, for a dashboard beside the service's
        assert metric(text, "process_resident_memory_bytes") > 1e6 and metric(text, "process_open_fds") > 0
        assert 'python_gc_collections_total{generation="2"}' in text
    finally:
        await app.drain()


# -- voice activity ---------------------------------------------------------------------------------

async def test_no_passes_on_silence_and_end_of_speech_is_marked():
    model = FakeWhistle()
    app = await start(model, end_of_speech_ms=600)
    try:
        warm_passes = model.passes
        async with ListenClient(app.url) as c:
            await stream(c, np.zeros(3 * RATE, np.float32))
            await c.keepalive()
            await c.finalize()
            assert model.passes == warm_passes and c.committed == []
            await stream(c, voiced(2.0))
            await stream(c, np.zeros(RATE, np.float32))
            while not (c.committed and c.committed[-1].end_of_speech):
                await c.receive()
            final = await c.close()
        eos = c.committed[-1]
        assert final.text.strip() and model.passes > warm_passes
        words = [w for m in c.committed for w in m.words]
        # word times are session time: the engine never saw the 3 s of silence
        assert 2.6 <= words[0].start <= 3.05
        assert words[-1].end <= 6.0 and eos.end_of_speech
    finally:
        await app.drain()


async def test_the_engine_silence_gate_stops_passes_the_vad_lets_through():
    model = FakeWhistle()
    model.is_speech = lambda audio: False     # §8 gate: e.g. steady noise
    app = await start(model)
    try:
        warm_passes = model.passes
        async with ListenClient(app.url) as c:
            await stream(c, voiced(2.5))
            final = await c.close()
        assert model.passes == warm_passes and final.text == ""
    finally:
        await app.drain()


# -- operations -----------------------------------------------------------------------------------

async def test_readyz_is_503_and_listen_is_refused_until_the_model_is_warm():
    app = await build_app(model=FakeWhistle(), config=ServiceConfig(port=0)).start(warm=False)
    try:
        assert (await http_get(app, "/healthz"))[0] == 200
        assert (await http_get(app, "/readyz"))[0] == 503
        with pytest.raises(InvalidStatus) as info:
            await connect(app.url + "/v1/listen")
        assert info.value.response.status_code == 503
        await app.warm()
        assert (await http_get(app, "/readyz"))[0] == 200
    finally:
        await app.drain()


async def test_metrics_count_sessions_passes_audio_and_latency(app):
    async with ListenClient(app.url, vad=False) as c:
        await stream(c, noise(3.0))
        await c.close()
    status, kind, text = await http_get(app, "/metrics")
    assert status == 200 and kind.startswith("text/plain")
    assert metric(text, "whistle_passes_total") >= 3
    assert metric(text, "whistle_audio_seconds_total") == pytest.approx(3.0)
    assert metric(text, "whistle_pass_seconds_count") >= 3
    assert metric(text, "whistle_commit_latency_seconds_count") == 6
    assert metric(text, "whistle_sessions_open") == 0


async def test_a_live_session_on_a_server_too_slow_for_it_catches_up_and_the_metrics_say_so():
    # Each fake pass takes 1.5 s of a 1 s step: a live stream falls behind, and its backlog is read
    # with one pass per engine call (the fake hears no pauses) instead of one per step.
    model = FakeWhistle(pass_s=1.5)
    app = await start(model)
    try:
        async with ListenClient(app.url, vad=False) as c:
            audio = noise(6.0)
            for i in range(0, len(audio), 1600):
                await c.send_audio(audio[i:i + 1600])
                await asyncio.sleep(0.1)   # real time
            await c.close()
        stream_ = model.streams[-1]   # (the first is the warm-up's)
        # fewer passes than the 6 steps (a pass per step, plus finalize's, without catching up)
        assert stream_.catch_ups >= 1 and stream_.passes < 6
        text = (await http_get(app, "/metrics"))[2]
        assert metric(text, "whistle_catch_ups_total") == stream_.catch_ups
    finally:
        await app.drain()


async def test_the_captions_page_and_script_are_served(app):
    status, kind, body = await http_get(app, "/")
    assert status == 200 and kind.startswith("text/html") and "captions.js" in body
    status, kind, body = await http_get(app, "/captions.js")
    assert status == 200 and "javascript" in kind and "/v1/listen" in body
    assert (await http_get(app, "/nope"))[0] == 404


async def test_the_page_is_served_with_its_types_a_content_security_policy_and_etags(app):
    """Each file of the captions page with its content type, a policy that lets the page run only
    its own files and open only its own WebSocket, nosniff, and revalidation by ETag (304)."""
    def get(path, headers=None):
        request = urllib.request.Request(f"http://127.0.0.1:{app.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    loop = asyncio.get_running_loop()
    kinds = {"/": "text/html", "/captions.js": "javascript", "/subtitles.js": "javascript",
             "/tap-worklet.js": "javascript", "/captions.css": "text/css", "/favicon.ico": "image/svg+xml"}
    for path, kind in kinds.items():
        status, headers, body = await loop.run_in_executor(None, get, path)
        assert status == 200 and kind in headers["Content-Type"] and body, path
        policy = dict(part.strip().split(" ", 1) for part in headers["Content-Security-Policy"].split(";"))
        assert policy["default-src"] == "'none'" and policy["script-src"] == "'self'", policy
        assert policy["connect-src"].split() == ["'self'", f"ws://127.0.0.1:{app.port}", f"wss://127.0.0.1:{app.port}"]
        assert headers["X-Content-Type-Options"] == "nosniff" and headers["Cache-Control"] == "no-cache"
        status, again, body = await loop.run_in_executor(None, get, path, {"If-None-Match": headers["ETag"]})
        assert status == 304 and body == b"" and again["ETag"] == headers["ETag"], path
    status, headers, _ = await loop.run_in_executor(None, get, "/", {"If-None-Match": '"stale"'})
    assert status == 200


async def test_health_probes_write_no_info_log_lines(app):
    from whistle_stream.service.observe import setup_logging

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    setup_logging("info")
    keep = Keep()
    logging.getLogger("whistle").addHandler(keep)
    try:
        for path in ("/healthz", "/readyz", "/healthz"):
            assert (await http_get(app, path))[0] == 200
        await asyncio.sleep(0.1)
    finally:
        logging.getLogger("whistle").removeHandler(keep)
    assert [r.getMessage() for r in keep.records if r.levelno <= logging.INFO] == []


async def test_without_a_web_root_the_server_serves_no_page():
    app = await build_app(model=FakeWhistle(), config=ServiceConfig(port=0)).start(warm=False)
    try:
        assert (await http_get(app, "/"))[0] == 404
        assert (await http_get(app, "/healthz"))[0] == 200
    finally:
        await app.close()


# -- bad input: every case gets its documented code, the server stays up, others are unaffected ------

TOKEN = "s3cret"
GOOD_ORIGIN = "http://captions.example"
LIMITS = dict(token=TOKEN, allowed_origins=(GOOD_ORIGIN,), max_sessions=4, max_frame_bytes=64 * 1024,
              max_session_seconds=6.0, idle_timeout=1.5, control_rate=5.0, control_burst=10)


def url(app, query="", token=TOKEN):
    q = "&".join(p for p in (query, f"token={token}" if token else "") if p)
    return f"{app.url}/v1/listen?{q}"


async def until_closed(ws) -> list[dict]:
    """Every message until the server closes the connection."""
    out = []
    try:
        async for text in ws:
            out.append(json.loads(text))
    except ConnectionClosed:
        pass
    return out


async def run_frames(app, frames, query="vad=false", close=True):
    """Connect, await ready, send frames, (close), return (messages, close code)."""
    async with connect(url(app, query)) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        try:
            for f in frames:
                await ws.send(f)
            if close:
                await ws.send('{"type":"close"}')
        except ConnectionClosed:
            pass   # the server ended the session part way: what it sent is still read below
        messages = await until_closed(ws)
    return messages, ws.close_code


async def refused(app, target, **kw):
    async with connect(target, **kw) as ws:
        messages = await until_closed(ws)
    return messages, ws.close_code


def f32(*values):
    return np.array(values, "<f4").tobytes()


async def case_odd_byte_count(app):
    return await run_frames(app, [b"\x00\x01\x02", to_pcm(noise(0.5))])


async def case_nan_floats(app):
    return await run_frames(app, [f32(0.1, np.nan)], query="vad=false&encoding=pcm_f32le")


async def case_inf_floats(app):
    return await run_frames(app, [f32(np.inf, 0.0)], query="vad=false&encoding=pcm_f32le")


async def case_unknown_type(app):
    return await run_frames(app, ['{"type":"pause"}'])


async def case_malformed_json(app):
    return await run_frames(app, ['{"type":"finalize"'])


async def case_text_where_binary_is_expected(app):
    return await run_frames(app, ["AAECAwQFBgc="])


async def case_bad_control_message(app):
    return await run_frames(app, ['{"type":"configure","keywords":"Kaliko"}'])


async def case_bad_sample_rate(app):
    return await refused(app, url(app, "sample_rate=7000"))


async def case_unsupported_encoding(app):
    return await refused(app, url(app, "encoding=opus"))


async def case_unknown_language(app):
    return await refused(app, url(app, "language=xx"))


async def case_unknown_parameter(app):
    return await refused(app, url(app, "langauge=en"))


async def case_audio_before_ready(app):
    # ready is sent before the server reads anything, so pipelined audio is kept, not rejected
    async with connect(url(app, "vad=false")) as ws:
        await ws.send(to_pcm(noise(1.2)))
        await ws.send('{"type":"close"}')
        messages = await until_closed(ws)
    assert messages[0]["type"] == "ready" and messages[-1]["text"] == " alpha bravo"
    return messages, ws.close_code


async def case_bad_token(app):
    return await refused(app, url(app, "vad=false", token="wrong"))


async def case_missing_token(app):
    return await refused(app, url(app, "vad=false", token=None))


async def case_full_server(app):
    # the healthy session holds one slot; fill the rest, then one more is refused
    extra = [await connect(url(app, "vad=false")) for _ in range(LIMITS["max_sessions"] - len(app.sessions))]
    try:
        for ws in extra:
            assert json.loads(await ws.recv())["type"] == "ready"
        return await refused(app, url(app, "vad=false"))
    finally:
        for ws in extra:
            await ws.close()


async def case_oversize_frame(app):
    return await run_frames(app, [b"\x00" * (LIMITS["max_frame_bytes"] + 2)], close=False)


async def case_rate_limit(app):
    return await run_frames(app, ['{"type":"keepalive"}'] * 40, close=False)


async def case_idle_timeout(app):
    return await run_frames(app, [], close=False)


async def case_session_limit(app):
    return await run_frames(app, [to_pcm(noise(1.0))] * 7, close=False)


async def case_disallowed_origin(app):
    with pytest.raises(InvalidStatus) as info:
        await connect(url(app, "vad=false"), origin="http://evil.example")
    return [], info.value.response.status_code


E = P.ErrorCode
BAD_INPUT = [
    # case, error code sent (None: none), close code or HTTP status, session continued (final "close")
    (case_odd_byte_count, E.BAD_AUDIO, 1000, True),
    (case_nan_floats, E.BAD_AUDIO, 1000, True),
    (case_inf_floats, E.BAD_AUDIO, 1000, True),
    (case_unknown_type, E.UNKNOWN_TYPE, 1000, True),
    (case_malformed_json, E.MALFORMED_JSON, 1000, True),
    (case_text_where_binary_is_expected, E.EXPECTED_BINARY, 1000, True),
    (case_bad_control_message, E.BAD_MESSAGE, 1000, True),
    (case_bad_sample_rate, E.BAD_REQUEST, 1008, False),
    (case_unsupported_encoding, E.UNSUPPORTED_ENCODING, 1008, False),
    (case_unknown_language, E.BAD_REQUEST, 1008, False),
    (case_unknown_parameter, E.BAD_REQUEST, 1008, False),
    (case_audio_before_ready, None, 1000, True),
    (case_bad_token, E.UNAUTHORIZED, 4401, False),
    (case_missing_token, E.UNAUTHORIZED, 4401, False),
    (case_full_server, E.SERVER_FULL, 1013, False),
    (case_oversize_frame, None, 1009, False),
    (case_rate_limit, E.RATE_LIMITED, 1008, False),
    (case_idle_timeout, E.IDLE_TIMEOUT, 1008, False),
    (case_session_limit, E.SESSION_LIMIT, 1008, False),
    (case_disallowed_origin, None, 403, False),
]


@pytest.fixture
async def limited_app():
    a = await start(**LIMITS)
    yield a
    await a.drain()


@pytest.mark.parametrize("case, code, close, continued", BAD_INPUT, ids=[c[0].__name__[5:] for c in BAD_INPUT])
async def test_bad_input_gets_its_documented_code_and_harms_no_one_else(limited_app, case, code, close, continued):
    app = limited_app
    audio = noise(4.0, seed=7)
    healthy = ListenClient(app.url, token=TOKEN, vad=False)
    await healthy.connect()

    async def healthy_stream():
        for i in range(0, len(audio), 3200):     # 0.2 s frames, paced so it overlaps the bad case
            await healthy.send_audio(audio[i:i + 3200])
            await asyncio.sleep(0.02)
        return await healthy.close()

    healthy_task = asyncio.create_task(healthy_stream())
    messages, got_close = await asyncio.wait_for(case(app), 20)
    errors = [m for m in messages if m["type"] == "error"]
    if code is None:
        assert errors == []
    else:
        assert [e["code"] for e in errors] == [code.value] and errors[0]["message"]
    assert got_close == close
    if continued:
        assert messages[-1]["type"] == "final" and messages[-1]["reason"] == "close"
    final = await asyncio.wait_for(healthy_task, 20)
    assert final.text == stream_reference(FakeWhistle(), audio)
    assert (await http_get(app, "/healthz"))[0] == 200
    await eventually(lambda: not app.sessions)


async def test_a_session_the_server_ends_still_gets_its_committed_text_and_final(limited_app):
    messages, close = await run_frames(limited_app, [to_pcm(noise(1.0))] * 7, close=False)
    kinds = [m["type"] for m in messages]
    assert kinds.index("error") < kinds.index("final") and close == 1008
    assert messages[-1]["reason"] == "session_limit" and messages[-1]["text"]


async def test_rejects_are_counted_by_reason(limited_app):
    await case_bad_token(limited_app)
    await case_bad_sample_rate(limited_app)
    _, _, text = await http_get(limited_app, "/metrics")
    assert metric(text, 'whistle_rejects_total{reason="unauthorized"}') == 1
    assert metric(text, 'whistle_rejects_total{reason="bad_request"}') == 1


async def test_an_engine_failure_ends_only_that_session_with_internal():
    from whistle_stream.service.observe import JsonFormatter, log as server_log

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(json.loads(JsonFormatter().format(record)))

    keep = Keep(logging.ERROR)
    server_log.addHandler(keep)
    model = FakeWhistle()
    app = await start(model)
    try:
        healthy = ListenClient(app.url, vad=False)
        await healthy.connect()
        model.fail_after = 1        # every stream's second pass raises from here on
        bad_messages, bad_close = await run_frames(app, [to_pcm(noise(3.0))], close=False)
        model.fail_after = None
        await stream(healthy, noise(2.0))
        final = await healthy.close()
        assert [m["code"] for m in bad_messages if m["type"] == "error"] == ["internal"]
        assert bad_close == 1011 and "fake" not in json.dumps(bad_messages)
        assert final.text == stream_reference(FakeWhistle(), noise(2.0))
        # the server's log line names the cause: the traceback, not a flag
        failed = [line for line in lines if line["event"] == "engine_error"]
        assert len(failed) == 1 and "Traceback" in failed[0]["exc"] and "exc_info" not in failed[0]
    finally:
        server_log.removeHandler(keep)
        await app.drain()


async def test_a_client_that_does_not_read_is_disconnected_without_blocking_others():
    # ~1 MB per pass, so the unread messages fill the socket buffers quickly
    app = await start(FakeWhistle(word_repeat=100_000), send_queue=8, send_timeout=1.0)
    try:
        slow = await connect(app.url + "/v1/listen?vad=false", max_queue=1, max_size=None)
        chunk = to_pcm(noise(1.0))
        healthy = ListenClient(app.url, vad=False)
        await healthy.connect()

        async def flood():
            try:
                for _ in range(60):
                    await slow.send(chunk)
                    await asyncio.sleep(0.01)
            except ConnectionClosed:
                pass

        flood_task = asyncio.create_task(flood())
        await stream(healthy, noise(2.0))
        final = await asyncio.wait_for(healthy.close(), 20)
        assert final.text.startswith(" " + "alpha" * 100_000)
        # Generous: a loaded machine slows the server's close handshake with the unread client.
        await asyncio.wait_for(flood_task, 90)
        await asyncio.wait_for(slow.wait_closed(), 90)
        _, _, text = await http_get(app, "/metrics")
        # Normally the send queue trips first (slow_client); on a starved machine the idle timer can.
        assert metric(text, 'whistle_rejects_total{reason="slow_client"}') + \
            metric(text, 'whistle_rejects_total{reason="idle_timeout"}') >= 1
        assert metric(text, "whistle_sessions_open") == 0
    finally:
        await app.drain()


async def test_random_frames_get_only_documented_errors_and_the_server_stays_up(app):
    rng = np.random.default_rng(1234)
    documented = {c.value for c in P.ErrorCode}
    async with connect(app.url + "/v1/listen?vad=false&encoding=pcm_f32le") as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        for _ in range(60):
            kind = rng.integers(3)
            if kind == 0:
                await ws.send(rng.bytes(int(rng.integers(0, 64))))
            elif kind == 1:
                await ws.send(rng.bytes(int(rng.integers(0, 64))).decode("latin-1"))
            else:
                await ws.send(json.dumps({"type": str(rng.choice(["configure", "x", "finalize"])),
                                          "keywords": [int(rng.integers(9))]}))
        await ws.send('{"type":"close"}')
        messages = await until_closed(ws)
    codes = {m["code"] for m in messages if m["type"] == "error"}
    assert codes and codes <= documented
    assert messages[-1]["type"] == "final" and ws.close_code in (1000, 1008)
    assert (await http_get(app, "/healthz"))[0] == 200


def test_the_captions_script_is_valid_javascript():
    import shutil
    import subprocess
    from pathlib import Path
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = Path(__file__).resolve().parent.parent / "clients" / "web" / "captions.js"
    subprocess.run([node, "--check", str(script)], check=True)


async def test_uploads_in_progress_count_against_capacity_for_live_sessions():
    app = await start(max_sessions=2)
    try:
        app.requests_open = 2          # two transcription uploads on the engine
        with pytest.raises(SessionEnded) as refused:
            await ListenClient(app.url).connect()
        assert refused.value.code == P.CloseCode.TRY_AGAIN
        app.requests_open = 1
        async with ListenClient(app.url) as c:
            assert c.ready is not None
    finally:
        app.requests_open = 0
        await app.drain()


async def test_a_stop_during_start_up_ends_the_warm_up_quietly():
    """SIGTERM or Ctrl-C while the engine still warms up: the drain closes the engine under the
    warm-up, whose failure then ends the start-up without an error (not a traceback and exit 1)."""
    import threading
    release = threading.Event()

    class Stopped(FakeWhistle):
        def warmup(self):
            release.wait(10)
            raise RuntimeError("the engine was closed under the warm-up")

    app = await build_app(Stopped(), ServiceConfig(port=0)).start(warm=False)
    warming = asyncio.ensure_future(app.warm())
    await asyncio.sleep(0.05)
    await app.drain()
    release.set()
    await asyncio.wait_for(warming, 10)   # returns: no exception
    assert not app.ready

    failing = await build_app(Stopped(), ServiceConfig(port=0)).start(warm=False)
    release.set()
    with pytest.raises(RuntimeError, match="closed under the warm-up"):   # not stopping: it is an error
        await failing.warm()
    await failing.drain()


async def test_a_ready_server_runs_a_full_collection_every_interval_until_it_drains(monkeypatch):
    """Closed connections' cycles (their zlib state) wait for a full collection; the server runs
    one every GC_INTERVAL_S instead of leaving them to the collector's own counts, and stops when
    it drains."""
    import gc
    from whistle_stream.service import server as S
    monkeypatch.setattr(S, "GC_INTERVAL_S", 0.05)
    a = await start()
    try:
        full = gc.get_stats()[2]["collections"]
        await asyncio.sleep(0.5)
        assert gc.get_stats()[2]["collections"] - full >= 3
    finally:
        await a.drain()
    await asyncio.sleep(0)
    assert a.collector.done()
