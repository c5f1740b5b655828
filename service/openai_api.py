"""The OpenAI-compatible transcription API, Sans-I/O: a request's form in, the response body out.

    POST /v1/audio/transcriptions   multipart: file, model, language, prompt, response_format,
                                    timestamp_granularities[]   (docs/compatibility.md)
    GET  /v1/models                 the one model this server runs

`parse_form` turns the request's multipart body into a `TranscriptionRequest` or raises `ApiError`
(OpenAI's error shape and HTTP status); `render` turns the engine's result into the body of the
chosen `response_format`. The transport (`service.http`, `service.server`) moves the bytes and runs
the engine on its worker pool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from whistle_stream.subtitles import make_cues, srt, vtt

from .params import group, model_language, parse_bool
from .protocol import MAX_KEYWORDS, ProtocolError, check_keywords, prompt_phrases

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("word", "segment")
FIELDS = ("file", "model", "language", "prompt", "response_format", "timestamp_granularities[]",
          "temperature", "stream", "chunking_strategy", "include[]")
MAX_FIELD_CHARS = 4096
LANGUAGE_NAMES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian",
                  "nl": "dutch", "pl": "polish"}


class ApiError(Exception):
    """An error as OpenAI's API reports one: HTTP status and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                     "code": self.code}}).encode()


@dataclass(frozen=True)
class TranscriptionRequest:
    audio: bytes
    filename: str
    model: str
    language: str | None = None
    keywords: tuple[str, ...] = ()
    response_format: str = "json"
    granularities: tuple[str, ...] = ("segment",)

    @property
    def word_times(self) -> bool:
        return self.response_format in ("srt", "vtt", "verbose_json")


def prompt_keywords(prompt: str) -> tuple[str, ...]:
    """`prompt` -> checked keyword phrases (`protocol.prompt_phrases`), at most MAX_KEYWORDS."""
    try:
        return check_keywords(prompt_phrases(prompt), "prompt")
    except ProtocolError as e:
        raise ApiError(400, e.message + f" (the prompt is read as keyword phrases, at most {MAX_KEYWORDS})",
                       param="prompt") from e


def parse_form(content_type: str, body: bytes, languages: Sequence[str] = ()) -> TranscriptionRequest:
    """A multipart/form-data body -> TranscriptionRequest. Raises ApiError (400) naming the field."""
    from python_multipart import FormParser

    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(400, f"send the audio as multipart/form-data (got Content-Type {content_type[:80]!r})")
    pairs: list[tuple[str, str]] = []
    files: dict[str, tuple[str, bytes]] = {}

    def on_field(field) -> None:
        name = (field.field_name or b"").decode("utf-8", "replace")
        value = (field.value or b"").decode("utf-8", "replace")
        if len(value) > MAX_FIELD_CHARS:
            raise ApiError(400, f"field {name!r} is longer than {MAX_FIELD_CHARS} characters", param=name)
        pairs.append((name, value))

    def on_file(file) -> None:
        name = (file.field_name or b"").decode("utf-8", "replace")
        file.file_object.seek(0)
        files[name] = ((file.file_name or b"").decode("utf-8", "replace"), file.file_object.read())

    boundary = None
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key.lower() == "boundary":
            boundary = value.strip('"')
    if not boundary:
        raise ApiError(400, "multipart/form-data without a boundary")
    try:
        parser = FormParser("multipart/form-data", on_field, on_file, boundary=boundary,
                            config={"MAX_MEMORY_FILE_SIZE": len(body) + 1})
        parser.write(body)
        parser.finalize()
    except ApiError:
        raise
    except Exception as e:   # python-multipart raises several types for malformed bodies
        raise ApiError(400, f"the multipart body does not parse: {e}") from e

    unknown = sorted({k for k, _ in pairs} - set(FIELDS))
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}; accepted: {', '.join(FIELDS)}", param=unknown[0])
    try:
        one, many = group(pairs, repeatable=("timestamp_granularities[]",))
    except ValueError as e:
        raise ApiError(400, f"form {e}") from e
    if "file" not in files:
        raise ApiError(400, "the form needs a 'file' part with the audio", param="file")
    if not one.get("model"):
        raise ApiError(400, "the form needs a 'model' field (any model name is served by this server's model)",
                       param="model")
    response_format = one.get("response_format", "json") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format {response_format[:30]!r} is not supported; accepted: "
                       f"{', '.join(RESPONSE_FORMATS)}", param="response_format")
    granularities = tuple(many.get("timestamp_granularities[]", ["segment"]))
    for g in granularities:
        if g not in GRANULARITIES:
            raise ApiError(400, f"timestamp_granularities[] {g[:30]!r} is not supported; accepted: word, segment",
                           param="timestamp_granularities[]")
    try:
        stream = parse_bool("stream", one.get("stream", "false"))
    except ValueError as e:
        raise ApiError(400, str(e), param="stream") from e
    if stream:
        raise ApiError(400, "stream=true is not supported here; use the WebSocket /v1/listen for live text",
                       param="stream")
    try:
        language = model_language(one.get("language"), languages)
    except ValueError as e:
        raise ApiError(400, str(e), param="language") from None
    filename, audio = files["file"]
    if not audio:
        raise ApiError(400, "the 'file' part is empty", param="file")
    return TranscriptionRequest(audio=audio, filename=filename, model=one["model"], language=language,
                                keywords=prompt_keywords(one.get("prompt", "")), response_format=response_format,
                                granularities=granularities or ("segment",))


def segments(words: Sequence[dict]) -> list[dict]:
    """OpenAI's `segments`: one per subtitle cue (sentence or pause), with its text and times."""
    out = []
    for i, cue in enumerate(make_cues(words, max_lines=1000, max_line_chars=10_000, max_cue_s=30.0)):
        out.append({"id": i, "seek": 0, "start": round(cue.start, 3), "end": round(cue.end, 3),
                    "text": " " + " ".join(cue.lines), "tokens": [], "temperature": 0.0,
                    "avg_logprob": 0.0, "compression_ratio": 1.0, "no_speech_prob": 0.0})
    return out


def render(result: dict, request: TranscriptionRequest, duration: float) -> tuple[str, bytes]:
    """The engine's result -> (Content-Type, body) in the request's response_format."""
    fmt = request.response_format
    words = result.get("words") or []
    if fmt == "text":
        return "text/plain; charset=utf-8", (result["text"] + "\n").encode()
    if fmt in ("srt", "vtt"):
        cues = make_cues(words)
        return "text/plain; charset=utf-8", (srt(cues) if fmt == "srt" else vtt(cues)).encode()
    if fmt == "json":
        return "application/json", json.dumps({"text": result["text"]}, ensure_ascii=False).encode()
    body = {"task": "transcribe", "language": LANGUAGE_NAMES.get(result.get("language", ""), result.get("language", "")),
            "duration": round(duration, 3), "text": result["text"]}
    if "word" in request.granularities:
        body["words"] = [{"word": w["word"], "start": round(w["start"], 3), "end": round(w["end"], 3)}
                         for w in words]
    if "segment" in request.granularities:
        body["segments"] = segments(words)
    return "application/json", json.dumps(body, ensure_ascii=False).encode()


def models_body(model: str, created: int = 0) -> bytes:
    """GET /v1/models: the list with this server's one model."""
    return json.dumps({"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                                   "owned_by": "whistle-stream"}]}).encode()


def decode_audio(request: TranscriptionRequest):
    """The uploaded file's audio as 16 kHz float32 (the engine's loader: WAV, FLAC, OGG, MP3)."""
    from whistle_stream.errors import AudioError
    from whistle_stream.frontend import load_audio

    try:
        return load_audio(request.audio)
    except AudioError as e:
        raise ApiError(400, f"{request.filename or 'file'}: {str(e).partition(': ')[2] or e}", param="file") from e
