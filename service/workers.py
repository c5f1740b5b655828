"""`ProcessEngine`: one model served by engine worker processes, with `Whistle`'s surface.

    engine = ProcessEngine(path, processes=2)
    stream = engine.open_stream(language="en")   # lives in one worker process for its whole life
    stream.feed(audio)                            # runs there; the calling thread waits on a pipe
    engine.close()

A pass is Numba kernels (which release the GIL) between Python bookkeeping (which holds it), so
two engine threads in one process share the second core with the interpreter's lock. Worker
processes do not: each holds its own `Whistle` over the same memory-mapped weights and runs the
streams pinned to it one call at a time. A stream's state stays in its process; only audio in and
result dicts out cross the pipe (a large array, an upload's samples, as raw bytes: `BULK_BYTES`). A
worker that dies fails the calls of its own streams (with `WorkerDied`) and is started again for
new ones; other workers' streams never notice.

The silence gate (`is_speech`, `models.ModelFile`'s) needs only the front end and runs in the
calling process.
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import signal
import threading
import traceback
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from whistle_stream import allocator
from whistle_stream.errors import WhistleError
from whistle_stream.models import ModelFile
from whistle_stream.results import KernelPath, StreamUpdate, Warmup
from whistle_stream.streaming import StreamSession


class WorkerDied(WhistleError, RuntimeError):
    """The engine worker process holding a stream has exited; the stream is gone."""


# An array argument this large (an uploaded file's samples: an hour is 230 MB of float32) crosses
# the pipe as its raw bytes after the call instead of inside its pickle: no pickled copy on
# either side, and the worker receives it straight into its own array.
BULK_BYTES = 1 << 20


class _Bulk:
    """Where a large array goes in a call's arguments: it follows the call as raw bytes."""

    def __init__(self, array: np.ndarray):
        self.shape, self.dtype = array.shape, array.dtype.str

    def receive(self, conn) -> np.ndarray:
        array = np.empty(self.shape, np.dtype(self.dtype))
        if array.nbytes:
            conn.recv_bytes_into(_raw(array))
        return array


def _send_call(conn, op: str, sid: int, args: tuple, kwargs: dict, dropped: list) -> None:
    """A call to a worker: each large array of args goes as a `_Bulk`, its bytes after the call."""
    bulk = [np.ascontiguousarray(a) if isinstance(a, np.ndarray) and a.nbytes >= BULK_BYTES and not a.dtype.hasobject
            else None for a in args]
    conn.send((op, sid, tuple(a if b is None else _Bulk(b) for a, b in zip(args, bulk)), kwargs, dropped))
    for b in bulk:
        if b is not None and b.nbytes:
            conn.send_bytes(_raw(b))


def _raw(array: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat uint8 view (the pipe measures a buffer by its first axis)."""
    return array.reshape(-1).view(np.uint8)


# ---------------------------------------------------------------------------------------------
# The worker process

# Stream calls whose reply carries the stream's checkpoint when they committed text: the session
# seals a resume token into every committed and final message (service/core.py), and a second call
# for it would queue behind the other streams' passes on this worker.
_SEALED = ("feed", "finalize", "finish")


def _serve(conn, path: str, audio_depth: int | None, initializer, initargs) -> None:
    """A worker's loop: (op, stream id, args, kwargs, dropped ids) in, (ok, value, passes,
    checkpoint) out; checkpoint: the stream's after a call that committed text (`_SEALED`), else
    None."""
    from whistle_stream.whistle import Whistle

    # Ctrl-C in a terminal reaches the whole process group: the server drains its sessions then,
    # through this worker, which must go on until the server stops it (or its pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    allocator.limit_arenas()
    if initializer is not None:
        initializer(*initargs)
    model = Whistle(path, audio_depth=audio_depth)
    streams: dict[int, StreamSession] = {}
    while True:
        try:
            op, sid, args, kwargs, dropped = conn.recv()
            args = tuple(a.receive(conn) if isinstance(a, _Bulk) else a for a in args)
        except (EOFError, OSError):
            return
        for gone in dropped:
            streams.pop(gone, None)
        if dropped:
            allocator.release()   # a closed stream's buffers and scratch go back to the system
        checkpoint = None
        try:
            if op == "open":
                streams[sid] = model.open_stream(*args, **kwargs)
                value = None
            elif op == "restore":
                streams[sid] = model.restore_stream(*args, **kwargs)
                value = None
            elif op == "stream":
                method, *rest = args
                value = getattr(streams[sid], method)(*rest, **kwargs)
                if method in _SEALED and (method != "feed" or value.words):
                    checkpoint = streams[sid].checkpoint()
            elif op == "streams":
                value = len(streams)
            elif op in ("transcribe", "warmup", "kernel_path"):
                value = getattr(model, op)(*args, **kwargs)
            elif op == "stop":
                conn.send((True, None, 0, None))
                return
            else:
                raise ValueError(f"unknown worker op {op!r}")
            reply = (True, value, getattr(streams.get(sid), "passes", 0), checkpoint)
        except Exception as e:  # the caller re-raises it; the worker and its other streams go on
            reply = (False, _portable(e), getattr(streams.get(sid), "passes", 0), None)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as e:  # a value or exception that does not pickle
            conn.send((False, RuntimeError(f"worker reply for {op!r} failed to pickle: {e}"), 0, None))


def _portable(error: Exception) -> Exception:
    """The exception itself when it survives pickling, else a RuntimeError that names it; either
    carries the worker's traceback as a note (the caller's traceback ends at the pipe)."""
    error.add_note("in the engine worker process:\n" + "".join(traceback.format_exception(error)))
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        portable = RuntimeError(f"{type(error).__name__}: {error}")
        portable.__notes__ = list(getattr(error, "__notes__", []))
        return portable


# ---------------------------------------------------------------------------------------------
# The calling side

class _Worker:
    """One worker process, its pipe, and the streams pinned to it. Calls are serialised."""

    def __init__(self, context, index: int, *serve_args):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, *serve_args),
                                       name=f"whistle-engine-{index}", daemon=True)
        self.process.start()
        child.close()
        self.lock = threading.Lock()
        self.streams = 0        # open streams pinned here
        self.busy = 0           # calls waiting or running here
        self.dropped: deque[int] = deque()   # streams to forget, sent with the next call
        self.dead = False

    def call(self, op: str, sid: int, args=(), kwargs=None):
        self.busy += 1
        try:
            with self.lock:
                if self.dead:
                    raise WorkerDied(f"engine worker {self.process.name} has exited")
                dropped = [self.dropped.popleft() for _ in range(len(self.dropped))]
                try:
                    _send_call(self.conn, op, sid, args, kwargs or {}, dropped)
                    ok, value, passes, checkpoint = self.conn.recv()
                except (EOFError, OSError) as e:
                    self.dead = True
                    raise WorkerDied(f"engine worker {self.process.name} exited "
                                     f"(exit code {self.process.exitcode})") from e
                except (TypeError, ValueError) as e:
                    # stop() closed the pipe under a call still sending (a long upload's bytes):
                    # multiprocessing then fails on its closed handle with these, not OSError.
                    if not self.dead:
                        raise
                    raise WorkerDied(f"engine worker {self.process.name} was stopped") from e
        finally:
            self.busy -= 1
        if not ok:
            raise value
        return value, passes, checkpoint

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit; one still busy after `timeout` (a first start compiling the
        kernels, say) is killed instead of waited for."""
        asked = not self.dead and self.lock.acquire(timeout=timeout)
        if asked:
            try:
                self.conn.send(("stop", 0, (), {}, []))
                self.conn.recv()
            except (EOFError, OSError):
                pass
            finally:
                self.lock.release()
        self.dead = True
        if asked:
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        # A caller still writing to the killed worker gets its broken pipe and lets go of the
        # lock; closing the pipe under that write would fail it with a TypeError instead.
        if not asked and self.lock.acquire(timeout=timeout):
            self.lock.release()
        self.conn.close()


class RemoteStream:
    """A `StreamSession` living in a worker process: the same calls, run there."""

    def __init__(self, worker: _Worker, sid: int):
        self._worker, self._sid, self.passes = worker, sid, 0
        self._checkpoint: dict | None = None   # the stream's state after the last call, when it came back
        worker.streams += 1
        weakref.finalize(self, _forget, worker, sid)

    def _call(self, method: str, *args, **kwargs):
        self._checkpoint = None
        value, self.passes, self._checkpoint = self._worker.call("stream", self._sid, (method, *args), kwargs)
        return value

    def feed(self, audio: np.ndarray, catch_up: bool = False) -> StreamUpdate:
        return self._call("feed", _samples(audio), catch_up=catch_up)

    def finalize(self, audio: np.ndarray | None = None, keep_context: bool = False) -> StreamUpdate:
        return self._call("finalize", _samples(audio), keep_context=keep_context)

    def finish(self, audio: np.ndarray | None = None) -> StreamUpdate:
        return self._call("finish", _samples(audio))

    def checkpoint(self, compact: bool = False) -> dict:
        """The stream's checkpoint: the one the last call brought back when it committed text (the
        session seals it into a resume token right away; asking again would wait behind the
        worker's other streams' passes), else asked of the worker. Not to be modified."""
        if not compact and self._checkpoint is not None:
            return self._checkpoint
        return self._call("checkpoint", compact=compact)

    def configure(self, keywords=None) -> None:
        return self._call("configure", keywords=keywords)


def _samples(audio: np.ndarray | None) -> np.ndarray | None:
    return None if audio is None else np.ascontiguousarray(audio, dtype=np.float32)


def _forget(worker: _Worker, sid: int) -> None:
    """A stream proxy was collected: its worker drops the stream with its next call (no I/O here:
    a finalizer may run on any thread, even one holding the worker's lock)."""
    worker.streams -= 1
    worker.dropped.append(sid)


class ProcessEngine(ModelFile):
    """A model served by `processes` worker processes; `Whistle`'s surface for the service.

    ProcessEngine(path=None, processes=2, audio_depth=None, initializer=None, initargs=()): path
    resolves as `Whistle`'s does; each worker calls initializer(*initargs) (a module-level function)
    before it loads the model. Streams are pinned to the worker with the fewest open streams;
    uploads go to the least busy."""

    def __init__(self, path: str | Path | None = None, processes: int = 2, audio_depth: int | None = None,
                 initializer=None, initargs: tuple = ()):
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        super().__init__(path)   # here: the name, dims and silence gate, not the encoder or decoder
        self._serve_args = (str(self.path), audio_depth, initializer, tuple(initargs))
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._sids = itertools.count(1)
        self.workers = [self._start(i) for i in range(processes)]

    def _start(self, index: int) -> _Worker:
        return _Worker(self._context, index, *self._serve_args)

    def _pick(self, key) -> _Worker:
        """A live worker with the least `key`; a dead one is started again in its place."""
        with self._lock:
            for i, w in enumerate(self.workers):
                if w.dead or not w.process.is_alive():
                    w.dead = True
                    self.workers[i] = self._start(i)
            return min(self.workers, key=key)

    def _new_stream(self, op: str, args, kwargs) -> RemoteStream:
        worker, sid = self._pick(lambda w: (w.streams, w.busy)), next(self._sids)
        worker.call(op, sid, args, kwargs)
        return RemoteStream(worker, sid)

    def open_stream(self, language: str | None = None, keywords=None, step_s: float = 1.0,
                    beams: int | None = None) -> RemoteStream:
        return self._new_stream("open", (), {"language": language, "keywords": keywords, "step_s": step_s,
                                             "beams": beams})

    def restore_stream(self, state: dict, keywords=None, beams: int | None = None) -> RemoteStream:
        return self._new_stream("restore", (state,), {"keywords": keywords, "beams": beams})

    def transcribe(self, audio, **kwargs) -> dict:
        """`Whistle.transcribe` on the least busy worker (no `progress` callback across processes)."""
        if kwargs.get("progress") is not None:
            raise ValueError("progress callbacks do not cross to a worker process")
        audio = audio if isinstance(audio, (str, Path, bytes)) else np.asarray(audio)
        return self._pick(lambda w: (w.busy, w.streams)).call("transcribe", 0, (audio,), kwargs)[0]

    def open_streams(self) -> list[int]:
        """The streams each worker holds now (after dropping those let go here)."""
        return [w.call("streams", 0)[0] for w in self.workers]

    def kernel_path(self) -> KernelPath:
        """The kernels' path in the workers (one asked: they share the host and the environment)."""
        return self.workers[0].call("kernel_path", 0)[0]

    def warmup(self) -> Warmup:
        """Every worker loads and compiles at once: the slowest one's seconds, all they compiled."""
        with ThreadPoolExecutor(len(self.workers)) as pool:
            done = list(pool.map(lambda w: w.call("warmup", 0)[0], list(self.workers)))
        return Warmup(max(w.seconds for w in done), sum(w.compiled for w in done))

    def close(self) -> None:
        for w in self.workers:
            w.stop()

    def __enter__(self) -> "ProcessEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
