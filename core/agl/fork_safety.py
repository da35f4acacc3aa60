"""What a forked child inherits from its parent and must leave alone.

A child made by ``os.fork`` starts with copies of the parent's database connections, pipes and file
objects. Using them would corrupt the parent's state (a SQLite or PostgreSQL session, a pipe the parent's
writer reads), and so can closing or freeing them: closing a SQLite connection checkpoints the parent's
file, ending a PostgreSQL connection ends the parent's session, and freeing a file object whose lock a
parent's thread held at the fork blocks. agl's stores and span writers hand such objects here in the child,
where they stay referenced, never used, until the child exits.
"""

from __future__ import annotations

from typing import Any, Iterable, List

_KEPT: List[Any] = []


def keep_unused(objects: Iterable[Any]) -> None:
    """Keep ``objects`` (a parent's, seen in a forked child) referenced and untouched for the process's life."""
    _KEPT.extend(objects)
