"""Resume tokens, Sans-I/O: a session's state sealed so that any replica sharing the secret can
continue it (docs/protocol.md, "Resuming a session").

A token is `base64url(zlib(JSON)) "." base64url(HMAC-SHA256(secret, first part))`: the state is
signed, not encrypted (it holds the session's settings, its last seq, the engine stream's
checkpoint and the audio path's; never audio). `seal` makes one; `unseal` checks it and raises
ProtocolError(bad_resume) naming what was wrong: malformed, too long, signed with another secret or
tampered with, expired, or of another token version.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import zlib

from .config import DEFAULTS
from .protocol import MAX_RESUME_CHARS, ErrorCode, ProtocolError

VERSION = 1
DEFAULT_TTL_S = DEFAULTS.resume_ttl   # --resume-ttl's default


def random_secret() -> bytes:
    """A per-process secret: its tokens resume sessions on this process only."""
    return os.urandom(32)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, body: str) -> str:
    return _b64(hmac.new(secret, body.encode("ascii"), hashlib.sha256).digest())


def seal(state: dict, secret: bytes, now: float, ttl_s: float = DEFAULT_TTL_S) -> str | None:
    """The token for `state` (JSON-able), valid for `ttl_s` seconds from `now`; None when it would
    be longer than MAX_RESUME_CHARS (the caller drops detail and tries again)."""
    payload = json.dumps({"v": VERSION, "exp": round(now + ttl_s, 3), "s": state}, separators=(",", ":"),
                         allow_nan=False)
    body = _b64(zlib.compress(payload.encode(), 9))
    token = body + "." + _mac(secret, body)
    return token if len(token) <= MAX_RESUME_CHARS else None


def unseal(token: str, secret: bytes, now: float) -> dict:
    """The state sealed in `token`. Raises ProtocolError(bad_resume)."""
    def refuse(why: str) -> ProtocolError:
        return ProtocolError(ErrorCode.BAD_RESUME, f"resume token refused: {why}; start a new session")

    if not isinstance(token, str) or len(token) > MAX_RESUME_CHARS:
        raise refuse(f"longer than {MAX_RESUME_CHARS} characters")
    body, dot, mac = token.partition(".")
    if not dot or not body or not mac or not body.isascii() or not mac.isascii():
        raise refuse("malformed (expected two base64url parts)")
    if not hmac.compare_digest(_mac(secret, body).encode(), mac.encode()):
        raise refuse("bad signature (tampered with, truncated, or issued by a server with another secret)")
    try:
        payload = json.loads(zlib.decompress(_unb64(body), bufsize=1 << 16))
    except (ValueError, zlib.error, binascii.Error) as e:
        raise refuse("malformed payload") from e
    if not isinstance(payload, dict) or payload.get("v") != VERSION or not isinstance(payload.get("s"), dict):
        raise refuse(f"not a version {VERSION} token")
    if not isinstance(payload.get("exp"), (int, float)) or payload["exp"] < now:
        raise refuse("expired")
    return payload["s"]
