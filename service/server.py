"""The live transcription service: WebSocket sessions on one shared model, plus HTTP operations.

    app = build_app(model=Whistle(path), config=ServiceConfig(port=0))
    async with app:                      # binds, warms the JIT, then /readyz says 200
        print(app.url)                   # ws://127.0.0.1:PORT
        await app.wait_closed()          # until app.drain() (SIGTERM) has finished the sessions

or `serve(model=..., config=...)` / `main(argv)`, which also install the SIGTERM/SIGINT drain.
The event loop only moves bytes: every engine call runs on a bounded thread pool, one call in
flight per session, and the protocol logic lives in `service.protocol` (Sans-I/O).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable

from websockets.asyncio.server import Server, serve as ws_serve

from whistle_stream import __version__, allocator
from whistle_stream.dims import check_language
from whistle_stream.errors import ExitStatus
from whistle_stream.frontend import warm_signal
from whistle_stream.results import Warmup

from . import protocol as P
from . import wyoming_server
from .config import ServiceConfig, add_serve_arguments, config_from_args
from .core import SessionCore, SessionLimits
from .handshake import open_session
from .http import diverting
from .observe import Metrics, log_event, setup_logging
from .resume import random_secret
from .routes import LISTEN_PATH, Routes
from .runner import SessionRunner


def load_engine(config: ServiceConfig, initializer=None, initargs: tuple = ()):
    """The engine the settings ask for: the model in this process, or served by worker processes
    (each calls initializer(*initargs) first: `workers.ProcessEngine`)."""
    if config.processes > 1:
        from .workers import ProcessEngine
        return ProcessEngine(config.model, processes=config.processes, initializer=initializer, initargs=initargs)
    from whistle_stream import Whistle
    return Whistle(config.model)


def engine_threads(config: ServiceConfig) -> int:
    """Threads that run engine calls. With worker processes a thread mostly waits on a pipe, and
    calls for one process wait their turn: enough threads that every process always has one."""
    return config.workers if config.processes == 1 else max(config.workers, 4 * config.processes)


class App:
    """The service: model, worker pool, metrics, sessions and the WebSocket server."""

    def __init__(self, model=None, config: ServiceConfig | None = None, web_root: Path | None = None):
        self.config = config or ServiceConfig()
        self.limits = limits_of(self.config)
        self.resume_shared = self.config.resume_secret is not None
        secret = self.config.resume_secret
        self.resume_secret = secret.encode() if secret is not None else random_secret()
        self.model = model
        self._owns_model = model is None   # loaded here, so closed here (worker processes)
        self.metrics = Metrics()
        allocator.limit_arenas()   # before the pool's threads allocate: see whistle_stream.allocator
        self.pool = ThreadPoolExecutor(max_workers=engine_threads(self.config), thread_name_prefix="engine")
        self.sessions: set[SessionRunner] = set()
        self.requests_open = 0   # transcription uploads on the engine now
        self.ready = False
        self.collector: asyncio.Task | None = None   # the periodic full collection (`_collect_garbage`)
        self.draining = False
        self.server: Server | None = None
        self.port: int | None = None
        self.wyoming_port: int | None = None
        # HTTP, with the captions page when the caller serves one (the command line passes the clients' folder)
        self.routes = Routes(self, web_root)
        self._closed = asyncio.Event()
        self.wyoming = wyoming_server.WyomingServer(self) if self.config.wyoming_port else None

    # -- engine ------------------------------------------------------------------------------
    async def engine(self, fn, *args):
        """Run a CPU-heavy engine call on the worker pool, never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(fn, *args))

    def _load_and_warm(self) -> Warmup:
        t0 = time.perf_counter()
        done = threading.Event()
        threading.Thread(target=_say_compiling, args=(done,), name="compile-progress", daemon=True).start()
        try:
            if self.model is None:
                self.model = load_engine(self.config)
            try:
                check_language(self.config.language, self.model.dims.languages)
            except ValueError as e:
                raise ValueError(f"--language: {e}") from None
            warmed = self.model.warmup()   # every kernel compiled once (cache=True makes later starts fast)
        finally:
            done.set()
        # The gate, then one short session through the core's whole pass schedule.
        signal_ = warm_signal(self.model.dims.rate)
        self.model.is_speech(signal_)
        # the warm-up's own audio counts against no session's limit (a --max-session-seconds under its
        # 1.5 s stopped the start)
        core = SessionCore(self.model, P.SessionConfig(encoding="pcm_f32le", vad=False),
                           dataclasses.replace(self.limits, max_session_seconds=float("inf")), session_id="warmup")
        core.open()
        core.audio(signal_.tobytes())
        core.finish("close")
        return Warmup(time.perf_counter() - t0, warmed.compiled)

    async def warm(self) -> None:
        """Load the model if none was given and run one short pass so the JIT is compiled."""
        try:
            warmed = await self.engine(self._load_and_warm)
        except Exception as e:
            if not self.draining:
                raise
            # stopped during start-up: the drain closed the engine (its workers) under the warm-up
            log_event("warm_interrupted", detail=f"{type(e).__name__}: {e}"[:300])
            return
        # Everything loaded so far (modules, the model, compiled kernels) lives as long as the
        # process: out of the collector's sight, so that a full collection weighs only what came
        # since and runs as often. Each closed connection leaves a reference cycle (its transport,
        # protocol and compressors: ~30 KB, most of it zlib state); the full collections that free
        # them otherwise wait for a quarter as many new objects as the start-up left. Start-up
        # garbage is collected first (not kept forever); the collection after the freeze sets the
        # collector's count of long-lived objects to those left in its sight, which the freeze
        # alone leaves at the start-up's.
        gc.collect()
        gc.freeze()
        gc.collect()
        self.collector = asyncio.get_running_loop().create_task(self._collect_garbage())
        # Wyoming has no readiness probe of its own: it listens (and is announced) once the model is
        # warm, so that a client never meets a server that cannot transcribe yet
        c = self.config
        if self.wyoming is not None and not self.draining:
            self.wyoming_port = await self.wyoming.start(c.host, c.wyoming_port)
            if c.wyoming_zeroconf:
                await self.wyoming.advertise(c.host)
        self.ready = True
        log_event("ready", model=getattr(self.model, "name", "?"), warm_s=round(warmed.seconds, 3),
                  kernels=str(self.model.kernel_path()), compiled=warmed.compiled,
                  workers=self.config.workers, processes=len(getattr(self.model, "workers", ())) or 1,
                  languages=list(self.model.dims.languages))
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        page = f"http://{host}:{self.port}/" if self.routes.static else "(no page: --web-root not given)"
        log_event("open", page=page, websocket=f"ws://{host}:{self.port}{LISTEN_PATH}")
        note = getattr(self.model, "note", None)
        if note:
            log_event("model_note", note=note)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def version(self) -> str:
        return __version__

    @property
    def demo_model(self) -> bool:
        """The bundled demo model runs (it hears only its own vocabulary in synthetic voices)."""
        return getattr(self.model, "kind", None) == "demo"

    @property
    def url(self) -> str:
        return f"ws://{self.config.host}:{self.port}"

    async def start(self, warm: bool = True) -> "App":
        c = self.config
        self.server = await ws_serve(
            partial(open_session, self), c.host, c.port, process_request=self.routes.get, max_size=c.max_frame_bytes,
            create_connection=diverting(self.routes.post, c.max_upload_bytes + 65536, c.request_timeout),
            max_queue=16, write_limit=2 ** 16, ping_interval=20, ping_timeout=20, close_timeout=5,
            server_header="whistle-stream", logger=logging.getLogger("whistle.websockets"))
        self.port = self.server.sockets[0].getsockname()[1]
        log_event("listening", host=c.host, port=self.port, max_sessions=c.max_sessions)
        if not self.resume_shared:
            log_event("resume_secret", level=logging.WARNING, detail="no --resume-secret: resume tokens are "
                      "signed with a random secret and resume sessions on this process only")
        if warm:
            await self.warm()
        return self

    async def _collect_garbage(self) -> None:
        """A full collection every GC_INTERVAL_S: closed connections' cycles (and their zlib state)
        are freed within a minute instead of when the collector's own counts come round (tens of
        minutes apart under steady load, megabytes of zlib state held meanwhile). With the
        start-up frozen it weighs only the objects made since: a few milliseconds."""
        while True:
            await asyncio.sleep(GC_INTERVAL_S)
            gc.collect()

    async def drain(self) -> None:
        """Stop accepting, finish every open session (committed text, final, close 1001)."""
        if self.draining:
            return
        self.draining = True
        if self.collector is not None:
            self.collector.cancel()
        open_ = list(self.sessions)
        log_event("draining", sessions=len(open_))
        if self.server is not None:
            self.server.server.close()  # the listening socket only; sessions keep running
        if self.wyoming is not None:
            self.wyoming.stop_listening()
        for runner in open_:
            runner.interrupt("shutdown", P.CloseCode.GOING_AWAY)
        tasks = [r.task for r in open_ if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.drain_timeout)
        await self.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close(close_connections=True)
            await self.server.wait_closed()
        if self.wyoming is not None:
            await self.wyoming.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_model and hasattr(self.model, "close"):
            await asyncio.get_running_loop().run_in_executor(None, self.model.close)
        log_event("closed")
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def __aenter__(self) -> "App":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        if not self._closed.is_set():
            await self.drain()

    # -- capacity ----------------------------------------------------------------------------
    @property
    def full(self) -> bool:
        """Live sessions and transcription uploads together are at --max-sessions."""
        return len(self.sessions) + self.requests_open >= self.config.max_sessions

    @property
    def accepting(self) -> bool:
        """Ready for new sessions and requests: the model is warm and no drain has begun."""
        return self.ready and not self.draining

    @property
    def model_name(self) -> str:
        return getattr(self.model, "name", "whistle")

    async def run_session(self, runner: SessionRunner) -> None:
        """Run one live session of any dialect, counted against --max-sessions and drained with
        the service."""
        runner.task = asyncio.current_task()
        self.sessions.add(runner)
        self.metrics.sessions_open.inc()
        try:
            await runner.run()
        finally:
            self.sessions.discard(runner)
            self.metrics.sessions_open.dec()


# A start still warming up after this long is likely compiling the kernels (a first start): say
# so, then how long it has taken every COMPILE_TICK_S. The ready line says what it compiled.
COMPILE_NOTICE_S = 3.0
COMPILE_TICK_S = 10.0
GC_INTERVAL_S = 60.0   # between full garbage collections once ready (`App._collect_garbage`)


def _say_compiling(done: threading.Event) -> None:
    t0 = time.perf_counter()
    if done.wait(COMPILE_NOTICE_S):
        return
    # the folder the kernels compile into (the image's NUMBA_CACHE_DIR: a volume keeps them)
    cache = os.environ.get("NUMBA_CACHE_DIR") or "the package's __pycache__"
    log_event("compiling", cache=cache)
    while not done.wait(COMPILE_TICK_S):
        log_event("compiling", elapsed_s=round(time.perf_counter() - t0))


def limits_of(config: ServiceConfig) -> SessionLimits:
    """The per-session settings of the service's settings."""
    return SessionLimits(**{f.name: getattr(config, f.name) for f in dataclasses.fields(SessionLimits)})


def build_app(model=None, config: ServiceConfig | None = None, web_root: Path | None = None) -> App:
    """An App around `model` (None: load the configured model at start). Not started yet."""
    return App(model=model, config=config, web_root=web_root)


async def serve(model=None, config: ServiceConfig | None = None, web_root: Path | None = None) -> None:
    """Run the service until SIGTERM/SIGINT, then drain and return."""
    app = build_app(model, config, web_root)
    loop = asyncio.get_running_loop()
    await app.start(warm=False)
    def on_signal(sig: signal.Signals) -> None:
        log_event("signal", signal=sig.name)
        asyncio.ensure_future(app.drain())

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError):
            pass
    await app.warm()
    await app.wait_closed()


def main(argv=None, *, model=None, web_root: Path | None = None) -> int:
    """`whistle-stream serve ...`: parse flags (+ WHISTLE_* env), serve until SIGTERM, exit 0."""
    parser = add_serve_arguments(argparse.ArgumentParser(
        prog="whistle-stream serve", description="Serve live transcription over WebSockets."))
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    setup_logging(config.log_level, config.log_format)
    try:
        import uvloop
        run: Callable = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve(model=model, config=config, web_root=web_root))
    except (OSError, ValueError) as e:   # port in use, no model, a model file that does not parse
        log_event("startup_failed", logging.ERROR, detail=str(e))
        return ExitStatus.FAILED
    return ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main())
