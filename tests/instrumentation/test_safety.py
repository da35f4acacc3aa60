"""agl's own errors are counted, logged once per site, and never raised into the user's code."""

from __future__ import annotations

import logging

from agl._util.safety import guard, guarded, internal_error_count, report_internal_error


def test_errors_are_counted_per_site_and_logged_once(caplog):
    site = "test.safety.once"
    total = internal_error_count()
    with caplog.at_level(logging.DEBUG, logger="agl.instrumentation"):
        for _ in range(3):
            report_internal_error(site, ValueError("boom"))
    assert internal_error_count(site) == 3 and internal_error_count() == total + 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and site in warnings[0].getMessage() and "boom" in warnings[0].getMessage()
    tracebacks = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert len(tracebacks) == 1


def test_guard_and_guarded_swallow_and_count():
    @guarded("test.safety.decorated", default="fallback")
    def broken() -> str:
        raise KeyError("x")

    assert broken() == "fallback"
    with guard("test.safety.block"):
        raise RuntimeError("inside a guarded block")
    assert internal_error_count("test.safety.decorated") == 1
    assert internal_error_count("test.safety.block") == 1


def test_guard_lets_base_exceptions_through():
    try:
        with guard("test.safety.interrupt"):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    else:  # pragma: no cover
        raise AssertionError("KeyboardInterrupt must not be swallowed")
    assert internal_error_count("test.safety.interrupt") == 0
