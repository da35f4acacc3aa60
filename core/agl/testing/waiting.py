"""Waiting in tests for what another thread or process does, with a message that says what never came."""

from __future__ import annotations

import time
from typing import Callable


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Return once ``check()`` holds; AssertionError naming ``what`` if it still does not after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
