"""The clients: `client` (Python), `listen` (`whistle-listen`) and `web/` (the captions page)."""

from pathlib import Path

WEB_ROOT = Path(__file__).resolve().parent / "web"   # what `whistle-stream serve` serves at /
