"""Server-side warnings for the spans ``/v1/traces`` refused or stored with a note, bounded: OpenTelemetry
exporters do not show the partial-success message, so the server's log is where an operator sees it."""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Tuple

from agl.store.http import otlp

logger = logging.getLogger("agl.store.http.server")  # the server's one logger, whichever module logs


class RefusalLog:
    """Server-side warnings for spans /v1/traces refused or stored with a note (OpenTelemetry exporters do not
    show the partial-success message, so the server's log is where an operator sees it). Bounded: each (reason,
    rollout id) is logged the first time, then again with its running count at 10, 100, 1000, ... spans; at
    most ``per_minute`` lines a minute, then one line counting what was left out."""

    def __init__(self, per_minute: int = 30, max_keys: int = 10_000) -> None:
        self._counts: Dict[Tuple[str, str, bool], int] = {}
        self._per_minute = per_minute
        self._max_keys = max_keys
        self._window = 0.0
        self._lines = 0
        self._left_out = 0
        self._lock = threading.Lock()

    def log(self, refusals: otlp.Refusals) -> None:
        if not refusals:
            return
        for reason, rollout_id, refused, n in refusals.entries():
            with self._lock:
                key = (reason, rollout_id, refused)
                before = self._counts.get(key, 0)
                if len(self._counts) >= self._max_keys and key not in self._counts:
                    self._counts.clear()
                after = self._counts[key] = before + n
                if before and len(str(after)) == len(str(before)):  # log again only at 10, 100, 1000, ...
                    continue
                now = time.monotonic()
                if now - self._window >= 60.0:
                    if self._left_out:
                        logger.warning(
                            "OTLP /v1/traces: %d more refusal warning(s) left out in the last minute", self._left_out
                        )
                    self._window, self._lines, self._left_out = now, 0, 0
                if self._lines >= self._per_minute:
                    self._left_out += 1
                    continue
                self._lines += 1
            where = f" for rollout {rollout_id}" if rollout_id else ""
            what = "refused" if refused else "stored with a note"
            total = "" if not before else f" ({after} so far)"
            logger.warning("OTLP /v1/traces: %d span(s)%s %s%s: %s", n, where, what, total, reason)
