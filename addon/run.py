"""The add-on's entry point: Home Assistant's options (/data/options.json) as `whistle-stream serve`
settings, the Wyoming server started on the add-on network, and Home Assistant told where it is
(the Supervisor's discovery), in plain log lines.

    whistle-stream-addon          # run (the image's CMD)
    whistle-stream-addon health   # exit 0 once the Wyoming server answers `describe`
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from whistle_stream.models import MODEL_FILENAME, cached_model_path, download
from whistle_stream.service.wyoming import SENSITIVITY_MS

OPTIONS = Path(os.environ.get("ADDON_OPTIONS", "/data/options.json"))
SHARED_MODEL = Path("/share/whistle-stream") / MODEL_FILENAME
SUPERVISOR_NETWORK = "172.30.32.0/23"   # the Supervisor's own network, where Home Assistant is
WYOMING_PORT = int(os.environ.get("WHISTLE_WYOMING_PORT") or 10300)


def say(line: str) -> None:
    print(f"whistle-stream add-on: {line}", flush=True)


def model_path(options: dict) -> str | None:
    """The model file the options name (None: the bundled demo model); the full model from /share,
    else downloaded once into /data."""
    if options["model"] == "demo":
        return None
    if SHARED_MODEL.is_file():
        return str(SHARED_MODEL)
    cached = cached_model_path()
    if not cached.is_file():
        say(f"downloading {MODEL_FILENAME} from Hugging Face into {cached.parent} (once; or put it in "
            f"{SHARED_MODEL.parent})")
    return str(download(progress=False))


def serve_args(options: dict, model: str | None) -> list[str]:
    """`whistle-stream serve` flags for the options: Wyoming on the add-on network, open to Home
    Assistant's network, loopback (the health check) and the networks the user listed."""
    args = ["--host", "0.0.0.0", "--wyoming-port", str(WYOMING_PORT),
            "--wyoming-allow", ",".join([SUPERVISOR_NETWORK, "127.0.0.0/8", "::1", *options["allow"]]),
            "--max-sessions", str(options["max_sessions"]), "--beams", str(options["beam_size"]),
            "--end-of-speech-ms", str(SENSITIVITY_MS[options["end_of_speech"]]),
            # Wyoming resumes nothing: a secret of this process's own, without the warning for replicas
            "--resume-secret", secrets.token_hex(16)]
    if options["language"] != "auto":
        args += ["--language", options["language"]]
    if options["keywords"]:
        args += ["--keywords", ",".join(k.replace(",", " ") for k in options["keywords"])]
    if model is not None:
        args += ["--model", model]
    return args


def describe(timeout: float = 3.0) -> bool:
    """Whether the Wyoming server on loopback answers `describe` with our program."""
    try:
        with socket.create_connection(("127.0.0.1", WYOMING_PORT), timeout) as s:
            s.sendall(b'{"type": "describe"}\n')
            got, deadline = b"", time.monotonic() + timeout
            while b"whistle-stream" not in got and time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
            return b"whistle-stream" in got
    except OSError:
        return False


def announce(server: subprocess.Popen) -> None:
    """Once Wyoming answers, tell Home Assistant where it is (the Supervisor's discovery API), as
    Home Assistant's own Wyoming add-ons do; it then offers the Wyoming integration by itself."""
    while server.poll() is None and not describe():
        time.sleep(0.5)
    token = os.environ.get("SUPERVISOR_TOKEN")
    if server.poll() is not None or not token:
        return
    body = json.dumps({"service": "wyoming", "config": {"uri": f"tcp://{socket.gethostname()}:{WYOMING_PORT}"}})
    request = urllib.request.Request("http://supervisor/discovery", data=body.encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10):
            say("Home Assistant was told where the Wyoming server is: it offers the integration now")
    except OSError as e:
        say(f"could not tell Home Assistant where the Wyoming server is ({e}); add the Wyoming "
            f"integration by hand: host {socket.gethostname()}, port {WYOMING_PORT}")


def main() -> int:
    if sys.argv[1:] == ["health"]:
        return 0 if describe() else 1
    try:
        options = json.loads(OPTIONS.read_text())
    except (OSError, ValueError) as e:
        say(f"cannot read the add-on options {OPTIONS}: {e}")
        return 1
    say(f"model {options['model']}, language {options['language']}, beam size {options['beam_size']}, "
        f"{options['max_sessions']} sessions, end of speech {options['end_of_speech']}, "
        f"{len(options['keywords'])} keywords")
    try:
        model = model_path(options)
    except Exception as e:   # a download that failed: say what to do instead
        say(f"no {MODEL_FILENAME}: {e}; put it in {SHARED_MODEL.parent} or choose the demo model")
        return 1
    server = subprocess.Popen(["whistle-stream", "serve", *serve_args(options, model)])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _: server.send_signal(s))
    announce(server)
    return server.wait()


if __name__ == "__main__":
    sys.exit(main())
