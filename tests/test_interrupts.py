"""agl.testing.interrupts: the Ctrl-C tests pass however the suite was started. Here the suite is made to
ignore SIGINT, as a background job started by a script does, and the helpers must still give a Ctrl-C that
interrupts: in a real child process and in this one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from agl.testing.interrupts import default_sigint, sigint_interrupts

# A child that waits argv[1] seconds for its Ctrl-C: exit 130 on KeyboardInterrupt, 0 if none came.
CHILD = """
import sys, time
try:
    print("ready", flush=True)
    time.sleep(float(sys.argv[1]))
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.fixture
def suite_ignores_sigint() -> Iterator[None]:
    """This process ignores SIGINT for the test, as one started with ``cmd &`` by a script does."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_child(wait: float, **popen: Any) -> int:
    """Start CHILD, send it SIGINT once it runs, and return its exit status."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(wait)], stdout=subprocess.PIPE, text=True, **popen)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=60)
    finally:
        proc.kill()


@pytest.mark.usefixtures("suite_ignores_sigint")
def test_a_child_started_with_default_sigint_is_interrupted_by_ctrl_c() -> None:
    assert _interrupted_child(60, preexec_fn=default_sigint) == 130


@pytest.mark.usefixtures("suite_ignores_sigint")
def test_a_child_started_plainly_ignores_ctrl_c_as_its_parent_does() -> None:
    """Why the helper is needed: the ignored SIGINT is inherited, and Python keeps it ignored."""
    assert _interrupted_child(2) == 0


@pytest.mark.usefixtures("suite_ignores_sigint")
def test_sigint_interrupts_this_process_inside_the_block_and_is_ignored_again_after() -> None:
    with sigint_interrupts(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
