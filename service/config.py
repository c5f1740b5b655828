"""`whistle-stream serve` settings: one dataclass, every field a flag and a WHISTLE_* env variable.

Precedence: command-line flag > environment variable > default. The table of flags, variables and
defaults is in docs/protocol.md ("Limits").
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
from dataclasses import dataclass, field, fields

from whistle_stream.rules import BEAMS, MAX_BEAMS
from whistle_stream.streaming import MAX_STEP_S, MIN_STEP_S

from .params import FALSE, TRUE, parse_bool


def _cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's
    CPU limit: "200000 100000" is 2 CPUs) where there is one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open(cpu_max).read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def setting(default=None, help: str = "", factory=None):
    """A ServiceConfig field with its --help text beside it."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServiceConfig:
    host: str = setting("127.0.0.1", "interface to listen on")
    port: int = setting(8000, "TCP port (0: any free port)")
    model: str | None = setting(None, "model file (.cact); default: WHISTLE_MODEL, cached full model, bundled demo")
    max_sessions: int = setting(32, "concurrent sessions; more are refused with close code 1013")
    # engine threads (kernels release the GIL)
    workers: int = setting(factory=_cores, help="engine worker threads (default: the cores available)")
    processes: int = setting(factory=_cores, help="engine worker processes, each with its own interpreter; 1: the "
                                                  "engine runs in the server (default: the cores available, a "
                                                  "container's CPU limit included)")
    token: str | None = setting(None, "require this token (Authorization: Bearer or ?token=)")
    allowed_origins: tuple[str, ...] = setting((), "allowed Origin headers, comma-separated (default: any)")
    # 1 MiB: ~16 s of 16 kHz s16le audio in one frame
    max_frame_bytes: int = setting(1 << 20, "largest binary frame; larger ones close the session with 1009")
    max_session_seconds: float = setting(4 * 3600.0, "audio seconds per session before it is ended")
    idle_timeout: float = setting(30.0, "seconds without a frame before a session is ended")
    # control messages per second (token bucket refill)
    control_rate: float = setting(10.0, "control messages per second per session")
    control_burst: int = setting(20, "control message burst per session")
    # webrtcvad 0..3; 2 keeps soft speech, drops most hum
    vad_aggressiveness: int = setting(2, "webrtcvad aggressiveness 0..3")
    end_of_speech_ms: int = setting(600, "silence after speech that finalizes the utterance")
    # engine step (streaming re-transcribes once per step)
    step_s: float = setting(1.0, "engine step in seconds")
    language: str | None = setting(None, "language of sessions that name none, one of the model's (default: detected)")
    keywords: tuple[str, ...] = setting((), "keyword phrases, comma-separated, for sessions that name none")
    beams: int = setting(BEAMS, "beam width of the passes that commit words (1: greedy, fastest)")
    send_queue: int = setting(256, "messages queued per client before it is disconnected as slow")
    send_timeout: float = setting(10.0, "seconds a send may block before the client is disconnected as slow")
    drain_timeout: float = setting(30.0, "seconds SIGTERM waits for open sessions to finish")
    # POST /v1/audio/transcriptions: largest file (OpenAI's limit)
    max_upload_bytes: int = setting(25 << 20, "largest file POST /v1/audio/transcriptions accepts, bytes")
    max_upload_seconds: float = setting(3600.0, "most audio seconds in one uploaded file")
    request_timeout: float = setting(60.0, "seconds a POST request may take to arrive")
    resume_secret: str | None = setting(None, "secret that signs resume tokens; give every replica the same (default: "
                                              "random, this process only)")
    resume_ttl: float = setting(600.0, "seconds a resume token stays valid")
    log_level: str = setting("info", "debug, info, warning or error")
    log_format: str = setting("auto", "text (for a person), json (one object a line), or auto: text on a terminal, json "
                                      "elsewhere")
    wyoming_port: int = setting(0, "TCP port of the Wyoming server for Home Assistant (10300 by convention; 0: off)")
    wyoming_zeroconf: bool = setting(False, "advertise the Wyoming server over zeroconf/mDNS (_wyoming._tcp.local.)")
    wyoming_allow: tuple[str, ...] = setting((), "client networks (CIDRs) the Wyoming port admits, the only ones; "
                                                 "needed with --token on an address other than loopback (default: any)")
    wyoming_end_of_turn: bool = setting(True, "end a Wyoming transcription when the command ends, without waiting for "
                                              "audio-stop (Home Assistant then runs no VAD of its own); false: at "
                                              "audio-stop only")

    def __post_init__(self):
        checks = [
            (0 <= self.port <= 65535, "port must be 0..65535"),
            (self.log_format in ("auto", "text", "json"), "log_format must be auto, text or json"),
            (0 <= self.wyoming_port <= 65535, "wyoming_port must be 0..65535 (0: no Wyoming server)"),
            (self.max_sessions >= 1, "max_sessions must be at least 1"),
            (self.workers >= 1, "workers must be at least 1"),
            (self.processes >= 1, "processes must be at least 1"),
            (self.max_frame_bytes >= 1024, "max_frame_bytes must be at least 1024"),
            (self.max_session_seconds > 0, "max_session_seconds must be positive"),
            (self.idle_timeout > 0, "idle_timeout must be positive"),
            (self.control_rate > 0 and self.control_burst >= 1, "control_rate/control_burst must be positive"),
            (0 <= self.vad_aggressiveness <= 3, "vad_aggressiveness must be 0..3"),
            (self.end_of_speech_ms >= 30, "end_of_speech_ms must be at least 30 (one VAD frame)"),
            (MIN_STEP_S <= self.step_s <= MAX_STEP_S, f"step_s must be {MIN_STEP_S:g}..{MAX_STEP_S:g} seconds"),
            (1 <= self.beams <= MAX_BEAMS, f"beams must be 1..{MAX_BEAMS}"),
            (self.send_queue >= 1 and self.send_timeout > 0, "send_queue/send_timeout must be positive"),
            (self.drain_timeout >= 0, "drain_timeout must be non-negative"),
            (self.resume_ttl > 0, "resume_ttl must be positive"),
            (self.resume_secret is None or len(self.resume_secret) >= 16,
             "resume_secret must be at least 16 characters"),
            (self.max_upload_bytes >= 1024 and self.max_upload_seconds > 0 and self.request_timeout > 0,
             "max_upload_bytes must be at least 1024, max_upload_seconds and request_timeout positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid service setting: {message}")
        networks(self.wyoming_allow)
        if self.token and self.wyoming_port and not self.wyoming_allow and not is_loopback(self.host):
            raise ValueError(
                f"invalid service setting: the Wyoming protocol has no authentication, so with --token set a "
                f"Wyoming port on {self.host} needs --wyoming-allow listing the client networks that may use it "
                "(CIDRs, e.g. 192.168.1.0/24 for a home network), or --host 127.0.0.1")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(entries: tuple[str, ...]) -> tuple[Network, ...]:
    """--wyoming-allow's networks; refuses an entry that is not an address or CIDR by name."""
    out = []
    for entry in entries:
        try:
            out.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"invalid service setting: wyoming_allow entry {entry!r} is not a network; accepted: "
                             "addresses or CIDRs, comma-separated (192.168.1.0/24,172.30.32.0/23,::1)") from None
    return tuple(out)


def admitted(address: str, allow: tuple[Network, ...]) -> bool:
    """Whether a client `address` (a socket's peer: IPv6 with its zone, or IPv4-mapped, as well)
    lies in one of the `allow` networks. The list is the whole list: loopback too must be in it."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in allow)


def is_loopback(host: str) -> bool:
    """Whether `host` (an interface to listen on) is loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


DEFAULTS = ServiceConfig()   # every setting's default, typed: the one place other modules read them




def env_name(name: str) -> str:
    return "WHISTLE_" + name.upper()


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ServiceConfig field as --flag (default from WHISTLE_FLAG). Returns the parser."""
    defaults = DEFAULTS
    for f in fields(ServiceConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, tuple):
            default = ",".join(default)
        if isinstance(default, bool):   # a switch: --flag alone is true, --flag=false turns it off
            parser.add_argument(flag, dest=f.name, default=None, nargs="?", const="true", metavar="BOOL",
                                help=f"{f.metadata['help']} [env {env_name(f.name)}, default {str(default).lower()}]")
            continue
        parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(),
                            help=f"{f.metadata['help']} [env {env_name(f.name)}, default {default}]")
    return parser


_OPTIONAL_TEXT = ("token", "model", "resume_secret", "language")
_COMMAS_ONLY = ("keywords",)   # list settings whose entries may hold spaces; the others split on spaces too   # text settings that may be unset (None)


def config_from_args(args: argparse.Namespace | None = None, environ=None) -> ServiceConfig:
    """Flags (strings or None) > WHISTLE_* environment > defaults -> a checked ServiceConfig."""
    environ = os.environ if environ is None else environ
    defaults = DEFAULTS
    values = {}
    for f in fields(ServiceConfig):
        raw = getattr(args, f.name, None) if args is not None else None
        if raw is None:
            raw = environ.get(env_name(f.name))
        if raw is None or raw == "" and f.name not in _OPTIONAL_TEXT:
            continue
        kind = type(getattr(defaults, f.name))
        try:
            if f.name in _OPTIONAL_TEXT:
                values[f.name] = raw or None
            elif kind is tuple:
                separators = "," if f.name in _COMMAS_ONLY else r"[,\s]+"
                values[f.name] = tuple(o.strip() for o in re.split(separators, str(raw)) if o.strip())
            elif kind is bool:
                values[f.name] = parse_bool(f.name, str(raw))
            else:
                values[f.name] = kind(raw)
        except ValueError as e:
            expected = f"true or false ({', '.join(TRUE + FALSE)})" if kind is bool else kind.__name__
            raise ValueError(f"invalid value {raw!r} for --{f.name.replace('_', '-')} / "
                             f"{env_name(f.name)}: expected {expected}") from e
    return ServiceConfig(**values)  # type: ignore[arg-type]  # each value parsed to its field's type above
