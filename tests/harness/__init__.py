"""Shared test harness: the JAX reference (reference.py) and deterministic test audio (audio.py).

reference.py imports jax and needle; import it only from tests that need the reference
(conftest.py's fixtures skip cleanly when it is not installed).
"""
