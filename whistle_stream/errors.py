"""The exception types the engine raises at its boundaries, and the exit status of each command."""

from enum import IntEnum


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


class ExitStatus(IntEnum):
    """What every command (`whistle-stream`, `whistle-listen`, the service) exits with."""

    OK = 0
    FAILED = 1        # something failed at run time (a server error, a download, the port in use)
    USAGE = 2         # a bad argument, or a model or audio file that cannot be used (argparse's own 2)
    UNREACHABLE = 3   # no server at the address given
    AUTH = 4          # the server refused the token
    NO_AUDIO = 5      # no microphone, or an audio file that cannot be read
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)
