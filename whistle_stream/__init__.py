"""whistle-stream: live speech-to-text on a Python + Numba engine for Cactus Compute's Whistle model.

    from whistle_stream import Whistle
    model = Whistle()                      # the default model (see whistle_stream.models)
    model.transcribe("clip.wav")           # {"text", "language", "ttft_ms", "decode_tps"}
"""

from .errors import AudioError, ModelFormatError, WhistleError

__version__ = "0.1.0"
__all__ = ["Whistle", "WhistleError", "ModelFormatError", "AudioError", "__version__"]


def __getattr__(name):
    # Whistle pulls in the Numba kernels; import it on first use so the container, tokenizer and
    # CLI stay quick to import.
    if name == "Whistle":
        from .model import Whistle

        return Whistle
    raise AttributeError(f"module 'whistle_stream' has no attribute {name!r}")
