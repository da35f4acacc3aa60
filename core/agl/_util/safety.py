"""Instrumentation must never break the program it observes.

Every integration runs its own code (building spans, reading responses, reassembling streams) inside the
user's calls. A bug there, or an SDK shape we did not foresee, must cost a span attribute, never the
user's request. These helpers catch such errors, count them (tests and ``agl`` diagnostics read
:func:`internal_error_count`) and log each failing site once, so a per-call bug does not flood the log.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Callable, Dict, Iterator, Optional, TypeVar

logger = logging.getLogger("agl.instrumentation")

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_counts: Dict[str, int] = {}


def report_internal_error(site: str, exc: BaseException) -> None:
    """Count an error raised by agl's own code at ``site``; log it the first time that site fails."""
    with _lock:
        seen = _counts.get(site, 0)
        _counts[site] = seen + 1
    if not seen:
        logger.warning(
            "agl instrumentation error in %s (ignored, the instrumented call goes on; "
            "further errors here are only counted): %s: %s",
            site,
            type(exc).__name__,
            exc,
        )
        logger.debug("traceback of the agl instrumentation error in %s", site, exc_info=exc)


def internal_error_count(site: Optional[str] = None) -> int:
    """How many internal errors were reported, at ``site`` or in total."""
    with _lock:
        return _counts.get(site, 0) if site is not None else sum(_counts.values())


@contextlib.contextmanager
def guard(site: str) -> Iterator[None]:
    """Run a block of agl code; an ``Exception`` inside is reported and swallowed."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the point: nothing of ours reaches the user
        report_internal_error(site, exc)


def guarded(site: str, default: Any = None) -> Callable[[F], F]:
    """Decorator form of :func:`guard`: the function returns ``default`` instead of raising."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - see guard()
                report_internal_error(site, exc)
                return default

        return wrapper  # type: ignore[return-value]  # the wrapper has the signature of the function it wraps

    return decorate
