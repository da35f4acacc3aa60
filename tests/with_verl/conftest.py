"""A test that hangs (a Ray cluster waiting on workers that never start) ends the run with every thread's
stack instead of holding CI until its time limit."""

from __future__ import annotations

import faulthandler
import sys
from typing import Iterator

import pytest

#: Far above the slowest test here (two real verl steps: about a minute on 2 cores).
HANG_S = 600


@pytest.fixture(autouse=True)
def _end_the_run_if_a_test_hangs() -> Iterator[None]:
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()
