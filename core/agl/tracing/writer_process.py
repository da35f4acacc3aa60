"""The tracer's optional writer *process*: converts and stores spans on another core, outside the agent's GIL.

Why: in a CPU-bound agent (no waits on a model server) the writer thread competes with the agent for the
GIL, so every span's encoding and store insert (tens of microseconds) lands on the agent, and CPython
starves the thread until the end-of-rollout flush. With ``AGL_SPAN_WRITER=process`` (or
``get_tracer().set_writer("process")``) the tracer pickles batches of queued spans into a pipe (a few
microseconds a span: on the writer thread, or on the agent's thread once several batches wait because the
thread is starved); a child process (:func:`main` of this module) converts and writes them to its own copy
of the store and acknowledges each batch. The store must be one that several processes can share
(``multiprocess_safe``: SQLite, PostgreSQL, the HTTP client).

Nothing is lost if the child dies: the parent keeps every shipped batch until it is acknowledged and, on
the child's exit, puts the unacknowledged ones back at the head of its queue and goes on with its writer
thread (stores ignore a span they already hold, so a batch the child had half written is not doubled).

Wire format, both directions: frames of an 8-byte big-endian length and a pickle. Parent -> child: the store
object, then lists of :data:`agl.tracing.encoding.Finished`. Child -> parent: per batch, ``(spans, exported,
rejected, export_errors)``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from typing import IO, Any, Callable, Optional, Tuple

from agl._util.fork_safety import keep_unused

logger = logging.getLogger("agl.tracing.tracer")

_HEADER = struct.Struct("!Q")
_PIPE_BYTES = 1 << 20  # room for a couple of batches of heavy spans, so the agent's thread never waits

Ack = Tuple[int, int, int, int]  # spans in the batch, exported, rejected, export errors


class WriterProcess:
    """Parent side: the child, the pipe the spans go down, and a thread that reads the acknowledgements.

    ``send`` is not thread-safe: the tracer calls it under its shipping lock.
    """

    def __init__(self, sink: Any, on_ack: Callable[[Ack], None], on_exit: Callable[[bool], None]) -> None:
        self.sink = sink
        self._on_ack = on_ack
        self._on_exit = on_exit
        self._closing = False
        self._rest: Optional[memoryview] = None  # the unwritten end of a frame a non-blocking send left
        store_frame = _frame(pickle.dumps(sink))  # fails here, in the caller, if the store does not pickle
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from agl.tracing.writer_process import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._fd = self._proc.stdin.fileno()
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except (AttributeError, OSError):  # not Linux, or above the system's pipe-max-size: a smaller pipe works
            pass
        os.set_blocking(self._fd, False)
        self._reader = threading.Thread(
            target=self._read_acks, args=(self._proc.stdout,), name="agl-span-writer-acks", daemon=True
        )
        self._reader.start()
        self._write_all(store_frame)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def busy(self) -> bool:
        """A frame is half written: a non-blocking sender must leave its batch in the queue."""
        return self._rest is not None

    def send(self, payload: bytes, block: bool) -> None:
        """Send one batch. ``block=False`` (the agent's thread) writes what the pipe takes and leaves the rest
        to the next blocking send. Raises ``OSError`` if the child is gone (its exit handler recovers)."""
        if self._rest is not None:
            self._write_all(self._rest)
            self._rest = None
        frame = _frame(payload)
        if block:
            self._write_all(memoryview(frame))
            return
        try:
            written = os.write(self._fd, frame)
        except BlockingIOError:
            written = 0
        if written < len(frame):
            self._rest = memoryview(frame)[written:]

    def flush_pending(self) -> None:
        """Finish a half-written frame (blocking)."""
        if self._rest is not None:
            self._write_all(self._rest)
            self._rest = None

    def _write_all(self, data: Any) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except BlockingIOError:
                select.select([], [self._fd], [])

    def _read_acks(self, stream: IO[bytes]) -> None:
        try:
            while True:
                payload = _read_frame(stream)
                if payload is None:
                    break
                self._on_ack(pickle.loads(payload))
        finally:
            code = self._proc.wait()
            if not self._closing:
                logger.warning(
                    "agl's span writer process %d exited with code %s; its unwritten spans go back to the writer "
                    "thread, nothing is lost (see its error above)",
                    self._proc.pid,
                    code,
                )
            self._on_exit(self._closing)

    def close(self, timeout: float = 30.0) -> None:
        """Let the child finish what it was sent, then wait for its exit (its last acknowledgements included)."""
        self._closing = True
        try:
            self.flush_pending()
        except OSError:
            pass
        _close_quietly(self._proc.stdin)
        self._reader.join(timeout)
        if self._reader.is_alive():
            self._proc.kill()
            self._reader.join(5)

    def abandon(self) -> None:
        """In a forked child: close the parent's pipe ends here, so the parent's writer sees its end of input
        when the parent closes it, whatever this child does.

        The file objects are not closed but kept forever (``agl._util.fork_safety``): the parent's reader thread, which
        does not exist in the child, may have held their locks at the fork, and closing or freeing them would
        block or close a reused descriptor."""
        self._closing = True
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                try:
                    os.close(stream.fileno())
                except (OSError, ValueError):
                    pass
        keep_unused([self])


def _close_quietly(stream: Optional[IO[bytes]]) -> None:
    if stream is not None:
        try:
            stream.close()
        except OSError:
            pass


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


def _read_frame(stream: IO[bytes]) -> Optional[bytes]:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    return payload if len(payload) == size else None


def main() -> None:
    """The child: read the store, then batches; write each (retrying passing errors), acknowledge it."""
    from agl.tracing.export import SpanExporter, TracerStats

    logging.basicConfig(level=logging.WARNING, format="agl span writer process: %(levelname)s %(message)s")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    parent = os.getppid()
    first = _read_frame(stdin)
    if first is None:
        return
    stats = TracerStats()
    exporter = SpanExporter(pickle.loads(first), stats)
    while (payload := _read_frame(stdin)) is not None:
        batch = pickle.loads(payload)
        before = (stats.exported, stats.rejected, stats.export_errors)
        spans = exporter.convert(batch)
        if spans and not exporter.write_until_done(spans, give_up=lambda: os.getppid() != parent):
            return  # the parent is gone: nobody waits for these spans
        ack = (len(batch), stats.exported - before[0], stats.rejected - before[1], stats.export_errors - before[2])
        stdout.write(_frame(pickle.dumps(ack)))
        stdout.flush()
