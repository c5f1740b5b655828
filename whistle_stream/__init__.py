"""whistle-stream: live speech-to-text on a Python + Numba engine for Cactus Compute's Whistle model.

    from whistle_stream import Whistle
    model = Whistle()                      # the default model (see whistle_stream.models)
    model.transcribe("clip.wav").text      # a Transcription (whistle_stream.results)
"""

from .errors import AudioError, ModelFormatError, WhistleError

try:   # one definition: the version pyproject.toml gives the installed package
    from importlib.metadata import PackageNotFoundError, version as _version

    __version__ = _version("whistle-stream")
except PackageNotFoundError:   # a source tree that was never installed
    __version__ = "0+unknown"
__all__ = ["Whistle", "WhistleError", "ModelFormatError", "AudioError", "__version__"]


def __getattr__(name):
    # Whistle pulls in the Numba kernels; import it on first use so the container, tokenizer and
    # CLI stay quick to import.
    if name == "Whistle":
        from .whistle import Whistle

        return Whistle
    raise AttributeError(f"module 'whistle_stream' has no attribute {name!r}")
