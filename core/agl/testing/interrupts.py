"""Ctrl-C in tests, however the test run was started.

A process started in the background by a shell without job control (``cmd &`` in a script, CI runners)
inherits SIGINT ignored, and Python then keeps it ignored: it installs its ``KeyboardInterrupt`` handler only
over the default disposition. A test that sends SIGINT to a child process, or to its own process, would then
see nothing happen. These helpers give the test back a Ctrl-C that interrupts; agl itself leaves an ignored
SIGINT ignored, as whoever started it asked.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator


def default_sigint() -> None:
    """``preexec_fn`` of a child process a test interrupts: SIGINT back to its default disposition, so that
    Python in the child raises ``KeyboardInterrupt`` on it (an ignored SIGINT stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def sigint_interrupts() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` in this process's main thread inside the block (Python's own
    handler), whatever handler was there before; that handler is put back after. Main thread only."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
