"""The exception types the engine raises at its boundaries."""


class WhistleError(Exception):
    """Base class of every error whistle-stream raises on purpose."""


class ModelFormatError(WhistleError, ValueError):
    """A model file is not a valid Whistle .cact (truncated, wrong tag, wrong order, ...)."""


class AudioError(WhistleError, ValueError):
    """Audio input that cannot be read or has the wrong type, shape or rate."""


class ModelNotFoundError(WhistleError, FileNotFoundError):
    """No model file where one was asked for, or none at all to fall back on."""


class DownloadError(WhistleError, OSError):
    """The full model could not be fetched or did not verify (size, SHA-256)."""
