"""Cross-process wake-ups for the SQLite store, without polling.

SQLite cannot notify other processes of a commit, so waiters ring-fence themselves with a doorbell:

1. A waiter binds a Unix datagram socket in a directory shared by everyone using the same database and
   channel (``/tmp/agl-bell-<uid>/<sha1(realpath(db))[:16]>/<channel>/<pid>-<n>``).
2. It then checks the database, and only if there is nothing for it, blocks on its socket.
3. A writer that made something a waiter wants (work enqueued or requeued, a rollout finished) sends one
   byte, non-blocking, to every socket in the directory after its commit.

Because the waiter binds before it checks, a commit it did not see rings a socket that already exists,
so no wake-up is lost. Ringing with nobody waiting costs one ``listdir`` of an empty directory. A socket
file whose owner is gone (killed with -9) refuses the datagram and the writer unlinks it.

Where Unix sockets are unavailable (or the directory is not safely ours) waiters fall back to polling
every :data:`POLL_INTERVAL` seconds and say so in the debug log.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import socket
import stat
import time
from typing import Iterator, Optional

logger = logging.getLogger("agl.store.doorbell")

#: Seconds between checks when no socket could be bound.
POLL_INTERVAL = 0.05

_ROOT = "/tmp"  # not tempfile.gettempdir(): macOS's is too long for a socket path (~104 bytes)
_counter = itertools.count()
_UID = os.getuid() if hasattr(os, "getuid") else 0
_BELLS = os.path.join(_ROOT, f"agl-bell-{_UID}")


def _check_private_root() -> None:
    """Create ``/tmp/agl-bell-<uid>`` 0700, and refuse one that another user planted there."""
    os.makedirs(_BELLS, mode=0o700, exist_ok=True)
    info = os.lstat(_BELLS)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != _UID:
        raise PermissionError(f"{_BELLS} is not a directory owned by this user")


class Listener:
    """One waiter's bound socket (or the polling fallback)."""

    def __init__(self, sock: Optional[socket.socket]) -> None:
        self._sock = sock

    def wait(self, timeout: Optional[float]) -> bool:
        """Block until rung or ``timeout`` seconds passed (None: until rung); True if rung.

        Rings that arrived meanwhile are drained too: one wake-up per check of the database is enough.
        When polling, every return counts as a ring (the caller checks the database either way).
        """
        if self._sock is None:
            time.sleep(POLL_INTERVAL if timeout is None else min(timeout, POLL_INTERVAL))
            return True
        self._sock.settimeout(timeout if timeout is None else max(0.0, timeout))
        try:
            self._sock.recv(64)
        except (TimeoutError, BlockingIOError):  # a timeout of 0 makes the socket non-blocking: BlockingIOError
            return False
        self._sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while self._sock.recv(64):
                pass
        return True


class Doorbell:
    """The doorbell of one database and one channel (e.g. ``queue`` for runners, ``done`` for trainers)."""

    def __init__(self, db_path: str, channel: str) -> None:
        db_key = hashlib.sha1(os.path.realpath(db_path).encode()).hexdigest()[:16]
        self.directory = os.path.join(_BELLS, db_key, channel)

    def ring(self) -> None:
        """Wake every waiter of this channel; cheap when there is none. Never raises."""
        directory = self.directory
        try:
            names = os.listdir(directory)
        except OSError:
            return  # nobody ever waited here
        if not names:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.setblocking(False)
            for name in names:
                path = os.path.join(directory, name)
                try:
                    sender.sendto(b"\x01", path)
                except (ConnectionRefusedError, FileNotFoundError):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)  # its waiter died without cleaning up
                except BlockingIOError:
                    pass  # its queue is full: a wake-up is already pending there
                except OSError as exc:
                    logger.debug("could not ring %s: %s", path, exc)

    @contextlib.contextmanager
    def listen(self) -> Iterator[Listener]:
        """Bind this waiter's socket for the duration of the block (then close and unlink it)."""
        sock: Optional[socket.socket] = None
        path = ""
        try:
            _check_private_root()
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            path = os.path.join(self.directory, f"{os.getpid()}-{next(_counter)}")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # left by a killed process that had our pid
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(path)
        except (OSError, AttributeError) as exc:  # AttributeError: no AF_UNIX on this platform
            if sock is not None:
                sock.close()
            sock, path = None, ""
            level = logging.WARNING if isinstance(exc, PermissionError) else logging.DEBUG
            logger.log(level, "no doorbell socket (%s); polling every %s s instead", exc, POLL_INTERVAL)
        try:
            yield Listener(sock)
        finally:
            if sock is not None:
                sock.close()
                with contextlib.suppress(OSError):
                    os.unlink(path)
