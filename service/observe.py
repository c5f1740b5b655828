"""What the service tells its operator: structured log lines and the /metrics families.

    log_event("session_open", session="ab12", sample_rate=16000)
    metrics = Metrics(); metrics.text()   # Prometheus exposition
"""

from __future__ import annotations

import json
import logging
import sys

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector,
                               generate_latest)

log = logging.getLogger("whistle.service")


def log_event(event: str, level: int = logging.INFO, exc_info: bool = False, **fields) -> None:
    """One structured log line: {"ts", "level", "event", **fields} (see JsonFormatter); exc_info
    (inside an except block): the exception's traceback as "exc"."""
    log.log(level, event, exc_info=exc_info, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(),
               "event": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


# How the text format (a person at a terminal) says the events worth a sentence; other events
# show as their name and fields.
_SENTENCES = {
    "listening": lambda f: f"listening on {f['host']}:{f['port']} (at most {f['max_sessions']} sessions)",
    "wyoming_listening": lambda f: (f"Wyoming (Home Assistant) on tcp://{f['host']}:{f['port']}"
                                    + (f", for {', '.join(f['allow'])} only" if f.get("allow") else "")),
    "wyoming_open": lambda f: (f"the Wyoming port {f['port']} has no authentication: anyone who reaches "
                               "it can transcribe; --wyoming-allow admits only the networks it lists"),
    "compiling": lambda f: (f"still warming up: {f['elapsed_s']} s" if "elapsed_s" in f else
                            "still warming up: a first start compiles the engine's kernels for this CPU (about a "
                            f"minute), later starts load them from {f.get('cache', 'the cache')} and take seconds"),
    "ready": lambda f: (f"ready in {f['warm_s']:.1f} s: model {f['model']} ({', '.join(f['languages'])}); "
                        f"kernels: {f.get('kernels', '?')}, "
                        + (f"{f['compiled']} compiled" if f.get("compiled") else "loaded from the cache")),
    "open": lambda f: f"open {f['page']} for live captions; WebSocket {f['websocket']}",
    "model_note": lambda f: f"note: {f['note']}",
    "signal": lambda f: f"{f['signal']}: finishing open sessions, then exiting",
}


class TextFormatter(logging.Formatter):
    """Log lines for a person at a terminal: the time, then a sentence (or the event and its
    fields), then a traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        event = record.getMessage()
        try:
            text = _SENTENCES[event](fields)
        except (KeyError, TypeError, ValueError):
            text = " ".join([event] + [f"{k}={v}" for k, v in fields.items()])
        line = f"{self.formatTime(record, '%H:%M:%S')}  {record.levelname.lower():7s}  {text}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


LOG_FORMATS = ("auto", "text", "json")


class Metrics:
    """The /metrics families, in a registry of their own (one per app)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.sessions_open = Gauge("whistle_sessions_open", "Open WebSocket sessions", registry=r)
        self.passes = Counter("whistle_passes", "Engine streaming passes", registry=r)
        self.pass_seconds = Histogram(
            "whistle_pass_seconds", "Wall time of one engine pass", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0))
        self.audio_seconds = Counter("whistle_audio_seconds", "Audio received, seconds", registry=r)
        self.commit_latency = Histogram(
            "whistle_commit_latency_seconds",
            "From receiving a word's last audio to sending it committed", registry=r,
            buckets=(0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0))
        self.rejects = Counter("whistle_rejects", "Refused requests and errors sent, by reason",
                               ["reason"], registry=r)
        self.resumes = Counter("whistle_resumes", "Sessions resumed from a token, by outcome",
                               ["outcome"], registry=r)
        self.catch_ups = Counter("whistle_catch_ups", "Engine calls that skipped passes of a live session's "
                                 "backlog: the session had fallen behind real time", registry=r)
        self.replayed = Counter("whistle_replayed_audio_seconds", "Audio replayed by resuming clients, seconds",
                                registry=r)
        self.wyoming_refused = Counter("whistle_wyoming_refused_connections", "Wyoming connections closed "
                                       "unread: the client's address is outside --wyoming-allow", registry=r)
        self.sessions = Counter("whistle_sessions", "Live sessions opened, by dialect (native, deepgram, "
                                "wyoming, realtime)", ["dialect"], registry=r)
        # the process's memory, descriptors and CPU (process_*), and the garbage collector's runs
        # by generation (python_gc_*), as prometheus_client's default registry would have them
        ProcessCollector(registry=r)
        GCCollector(registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class MetricsObserver:
    """The session core's measurements into the app's metrics (`core.Observer`)."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def audio(self, seconds: float) -> None:
        self.m.audio_seconds.inc(seconds)

    def passes(self, count: int, seconds_each: float) -> None:
        self.m.passes.inc(count)
        for _ in range(count):
            self.m.pass_seconds.observe(seconds_each)

    def commit_latency(self, seconds: float) -> None:
        self.m.commit_latency.observe(seconds)

    def replayed(self, seconds: float) -> None:
        self.m.replayed.inc(seconds)

    def caught_up(self) -> None:
        self.m.catch_ups.inc()


def setup_logging(level: str = "info", fmt: str = "auto") -> None:
    """Log to stderr: `text` for a person, `json` (one object a line) for a log collector; `auto`
    is text on a terminal and JSON anywhere else."""
    handler = logging.StreamHandler(sys.stderr)
    text = fmt == "text" or fmt == "auto" and sys.stderr.isatty()
    handler.setFormatter(TextFormatter() if text else JsonFormatter())
    root = logging.getLogger("whistle")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # websockets logs every HTTP request (each health probe) and connection at info; our own events
    # say what matters. Its lines show at debug.
    logging.getLogger("whistle.websockets").setLevel(
        logging.DEBUG if level.lower() == "debug" else logging.WARNING)
