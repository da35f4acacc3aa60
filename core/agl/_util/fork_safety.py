"""What a forked child inherits from its parent: what it must leave alone, and what the fork must wait for.

A child made by ``os.fork`` starts with copies of the parent's database connections, pipes and file
objects. Using them would corrupt the parent's state (a SQLite or PostgreSQL session, a pipe the parent's
writer reads), and so can closing or freeing them: closing a SQLite connection checkpoints the parent's
file, ending a PostgreSQL connection ends the parent's session, and freeing a file object whose lock a
parent's thread held at the fork blocks. agl's stores and span writers hand such objects here in the child
(:func:`keep_unused`), where they stay referenced, never used, until the child exits.

The child also inherits every mutex in the state it had at the fork, and only the forking thread. A mutex
that another thread held inside SQLite at that instant (SQLite's memory allocator and file-open mutexes are
process-wide) stays locked in the child forever, and the child's first SQLite call blocks: measured with a
store busy in two threads, 7 of 100 forked runners hung in their first store call, could not be stopped by
SIGTERM (the signal waits for the blocked call) and were killed 10 s later. Objects that call into such a
library register with :func:`hold_across_fork`; before each fork their ``_before_fork`` holds new calls and
waits for those in flight, and ``_after_fork`` lets calls go on, in the parent and in the child.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Iterable, List

_KEPT: List[Any] = []
_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()
_HELD: List[Any] = []  # the holders whose _before_fork ran for the fork under way


def keep_unused(objects: Iterable[Any]) -> None:
    """Keep ``objects`` (a parent's, seen in a forked child) referenced and untouched for the process's life."""
    _KEPT.extend(objects)


def hold_across_fork(holder: Any) -> None:
    """Call ``holder._before_fork()`` in the forking thread before every ``os.fork`` of this process, and
    ``holder._after_fork()`` after it in the parent and in the child (in the reverse order). Held weakly."""
    _HOLDERS.add(holder)


def _before_fork() -> None:
    for holder in list(_HOLDERS):
        holder._before_fork()
        _HELD.append(holder)


def _after_fork() -> None:
    while _HELD:
        _HELD.pop()._after_fork()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)
