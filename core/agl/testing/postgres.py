"""A throwaway PostgreSQL server for tests and benchmarks: ``initdb`` into a temporary folder, ``postgres``
on a free port of 127.0.0.1, everything removed on exit.

Why it is built this way:
- It runs the distribution's own binaries (found on ``PATH``, through ``pg_config --bindir`` or in
  ``/usr/lib/postgresql/<version>/bin``), so the tests exercise the real server the store will meet.
- PostgreSQL refuses to run as root. Under root (containers, CI) the server runs as the ``postgres``
  system user when there is one, else ``nobody``; its folder is handed to that user.
- Trust authentication on 127.0.0.1 only: the cluster lives for one test session and holds test data.
- ``durable=False`` (the default) turns ``fsync`` off: a test does not care whether its data survives
  a power cut, and fsync dominates the time of small commits. Benchmarks pass ``durable=True``.
- A folder is ~40 MB. One whose owner process was killed before ``stop()`` (a test run interrupted, a
  benchmark killed by a timeout; the server itself dies with its parent) is removed by the next ``start()``
  in the same temporary directory: each folder names its owner's pid in ``owner.pid``.
- :func:`postgres_for_tests` uses ``$AGL_TEST_POSTGRES_DSN`` (an existing server whose user may create
  databases) when set, else starts a ``TemporaryPostgres``; both lend each test an empty store database.

    with TemporaryPostgres() as server:
        with server.open_store() as store:      # a PostgresLightningStore in a database of its own
            ...
        dsn = server.create_database()          # postgresql://agl@127.0.0.1:PORT/agl_<pid>_<n>, empty
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import itertools
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from types import TracebackType
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Tuple, Union
from urllib.parse import urlsplit, urlunsplit

import psycopg

from agl.store.postgres.schema import RESET, SCHEMA_VERSION
from agl.store.postgres.store import PostgresLightningStore, redacted

logger = logging.getLogger("agl.testing.postgres")

#: Environment variable naming an existing server to use instead of starting one.
DSN_ENV = "AGL_TEST_POSTGRES_DSN"

INSTALL_HINT = (
    "install the PostgreSQL server (Debian/Ubuntu: `apt-get install postgresql`; Fedora: `dnf install "
    "postgresql-server`; macOS: `brew install postgresql`), or point AGL_TEST_POSTGRES_DSN at a server whose "
    "user may create databases (e.g. postgresql://postgres@127.0.0.1:5432/postgres)"
)

_STARTUP_TIMEOUT_S = 30.0
_BIN_GLOBS = (
    "/usr/lib/postgresql/*/bin",  # Debian, Ubuntu
    "/usr/pgsql-*/bin",  # PGDG RPMs
    "/usr/local/pgsql/bin",  # built from source
    "/opt/homebrew/opt/postgresql*/bin",
    "/usr/local/opt/postgresql*/bin",
)
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresUnavailableError(RuntimeError):
    """No PostgreSQL server binaries were found, or the server would not start. The message says why."""


def find_bindir() -> str:
    """The folder holding ``initdb`` and ``postgres`` (the newest version when several are installed)."""
    candidates: List[str] = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(os.path.dirname(os.path.realpath(on_path)))
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
            candidates.append(out.stdout.strip())
    for pattern in _BIN_GLOBS:
        candidates.extend(sorted(glob.glob(pattern), key=_version_key, reverse=True))
    for directory in candidates:
        if all(os.access(os.path.join(directory, tool), os.X_OK) for tool in ("initdb", "postgres")):
            return directory
    raise PostgresUnavailableError(f"no PostgreSQL server found (initdb and postgres): {INSTALL_HINT}")


def _version_key(path: str) -> Tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path)) or (0,)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_user() -> Optional[pwd.struct_passwd]:
    """The unprivileged account to run the server as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PostgresUnavailableError(
        "running as root, and PostgreSQL refuses to: create a `postgres` user (useradd postgres) or run the "
        f"tests as another user; or {INSTALL_HINT}"
    )


def _world_traversable(path: str) -> bool:
    """Whether every folder on the way to ``path`` lets other users through (the server user must reach it)."""
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def with_database(dsn: str, dbname: str) -> str:
    """``dsn`` (a ``postgresql://`` URL) pointing at another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + dbname))


class PostgresServer:
    """A server on which tests get databases of their own (the base of the temporary and the external one)."""

    _counter = itertools.count(1)  # database names, unique in this process

    def __init__(self, admin_dsn: str = "") -> None:
        self.admin_dsn = admin_dsn
        self._admin_conn: Optional[psycopg.Connection[Any]] = None
        self._admin_lock = threading.Lock()
        self._store_databases: Optional[_StoreDatabases] = None

    def _databases(self) -> _StoreDatabases:
        if self._store_databases is None:
            self._store_databases = _StoreDatabases(self)
        return self._store_databases

    def create_database(self, name: Optional[str] = None, *, template: Optional[str] = None) -> str:
        """Create a database (a new name unless given; a copy of ``template`` if given); return its DSN."""
        name = name or f"agl_{os.getpid()}_{next(self._counter)}"
        sql = f'CREATE DATABASE "{_checked(name)}"'
        if template is not None:
            sql += f' TEMPLATE "{_checked(template)}"'
        self._admin(sql)
        return with_database(self.admin_dsn, name)

    def drop_database(self, name: str) -> None:
        """Drop a database, ending whatever connections still use it."""
        self._admin(f'DROP DATABASE IF EXISTS "{_checked(name)}" WITH (FORCE)')

    def store_database(self) -> ContextManager[str]:
        """A database holding the store's schema and no data (its DSN) for the duration of the block.

        Every connection to it is ended on exit. See :class:`_StoreDatabases` for how this stays fast.
        """
        return self._databases().borrow()

    def open_store(self, **options: Any) -> BorrowedDatabaseStore:
        """A :class:`PostgresLightningStore` in a database of its own; closing the store gives the database back."""
        databases = self._databases()
        return BorrowedDatabaseStore(databases, databases.take(), **options)

    def terminate_connections(self, dbname: str) -> int:
        """End every session on ``dbname`` (as a crashed server or a network cut would); return how many."""
        row = self._admin(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        )
        return int(row[0]) if row else 0

    def sessions(self, dbname: str) -> int:
        """How many sessions are open on ``dbname`` (ended ones are gone once their backend has exited)."""
        row = self._admin(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,)
        )
        return int(row[0]) if row else 0

    def _admin(self, sql: str, params: Tuple[Any, ...] = ()) -> Optional[Tuple[Any, ...]]:
        """Run one statement on the ``postgres`` database (one connection, kept open); its first row."""
        with self._admin_lock:
            if self._admin_conn is None or self._admin_conn.closed or self._admin_conn.broken:
                self._admin_conn = psycopg.connect(self.admin_dsn, autocommit=True)
            cursor = self._admin_conn.execute(sql, params)  # names were _checked
            return cursor.fetchone() if cursor.description else None

    def _close_admin(self) -> None:
        with self._admin_lock:
            if self._admin_conn is not None:
                self._admin_conn.close()
                self._admin_conn = None

    def _drop_store_databases(self) -> None:
        if self._store_databases is not None:
            self._store_databases.drop_all()
            self._store_databases = None


class _StoreDatabases:
    """Databases with the store's schema, lent out and emptied on return.

    Creating a database (even as a copy of a template that already holds the schema) takes ~0.2 s here,
    emptying one ~0.02 s: a returned database has its connections ended, its tables truncated and its
    sequences restarted, and is lent again. One that cannot be emptied (a test changed its schema) is
    dropped instead.
    """

    def __init__(self, server: PostgresServer) -> None:
        self._server = server
        self._lock = threading.Lock()
        self._free: List[str] = []
        self._all: List[str] = []
        self._template: Optional[str] = None

    def dsn(self, name: str) -> str:
        return with_database(self._server.admin_dsn, name)

    @contextlib.contextmanager
    def borrow(self) -> Iterator[str]:
        name = self.take()
        try:
            yield self.dsn(name)
        finally:
            self.give_back(name)

    def take(self) -> str:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._template is None:
                template = f"agl_template_{os.getpid()}"
                self._server.drop_database(template)  # left by an earlier run that was killed
                PostgresLightningStore(self._server.create_database(template)).close()
                self._template = template
            name = f"agl_{os.getpid()}_{next(self._server._counter)}"
            self._all.append(name)
        self._server.create_database(name, template=self._template)
        return name

    def give_back(self, name: str) -> None:
        try:
            self._server.terminate_connections(name)
            with psycopg.connect(self.dsn(name), autocommit=True) as conn:
                with conn.transaction():
                    conn.execute(RESET)
                    (version,) = conn.execute("SELECT max(version) FROM agl_schema").fetchone() or (None,)
            if version != SCHEMA_VERSION:
                raise psycopg.DataError(f"its schema version was changed to {version}")
        except psycopg.Error as exc:
            logger.info("dropping test database %s instead of reusing it: %s", name, exc)
            self._server.drop_database(name)
            with self._lock:
                self._all.remove(name)
            return
        with self._lock:
            self._free.append(name)

    def drop_all(self) -> None:
        with self._lock:
            names = self._all + ([self._template] if self._template else [])
            self._all, self._free, self._template = [], [], None
        for name in names:
            self._server.drop_database(name)


class BorrowedDatabaseStore(PostgresLightningStore):
    """A store in a database lent by :meth:`PostgresServer.open_store`; closing it gives the database back."""

    def __init__(self, databases: _StoreDatabases, name: str, **options: Any) -> None:
        self._lender: Optional[Tuple[_StoreDatabases, str]] = (databases, name)
        try:
            super().__init__(databases.dsn(name), **options)
        except BaseException:
            databases.give_back(name)
            raise

    def close(self) -> None:
        lender, self._lender = getattr(self, "_lender", None), None  # unpickled copies lent nothing
        super().close()
        if lender is not None and os.getpid() == self._pid:
            lender[0].give_back(lender[1])


def _checked(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"database name {name!r}: use lower-case letters, digits and underscores (at most 63)")
    return name


class ExistingPostgres(PostgresServer):
    """A server someone else runs (``$AGL_TEST_POSTGRES_DSN``); only the databases we create are dropped."""

    def __init__(self, dsn: str) -> None:
        if urlsplit(dsn).scheme not in ("postgresql", "postgres"):
            raise PostgresUnavailableError(
                f"{DSN_ENV}={redacted(dsn)!r}: write it as a URL, postgresql://user:password@host:port/database"
            )
        super().__init__(dsn)

    def __enter__(self) -> ExistingPostgres:
        try:
            with psycopg.connect(self.admin_dsn, connect_timeout=10):
                pass
        except psycopg.Error as exc:
            raise PostgresUnavailableError(
                f"cannot connect to {DSN_ENV}={redacted(self.admin_dsn)!r}: {exc}; fix the URL, or unset it to let "
                "the tests start a throwaway server"
            ) from exc
        return self

    def __exit__(self, *exc: object) -> None:
        self._drop_store_databases()
        self._close_admin()


class TemporaryPostgres(PostgresServer):
    """A PostgreSQL cluster of its own in a temporary folder, stopped and deleted on exit.

    ``settings`` are extra ``postgres -c name=value`` options. Attributes once started: ``port``,
    ``admin_dsn`` (the ``postgres`` database as the superuser ``agl``), ``directory``.
    """

    def __init__(self, *, durable: bool = False, settings: Optional[dict[str, Union[str, int]]] = None) -> None:
        super().__init__()
        self.durable = durable
        self.settings = dict(settings or {})
        self.port = 0
        self.directory = ""
        self._process: Optional[subprocess.Popen[bytes]] = None
        self._argv: List[str] = []  # initdb's and postgres's folder, the data folder: see start()
        self._user: Optional[pwd.struct_passwd] = None

    def __enter__(self) -> TemporaryPostgres:
        self.start()
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.stop()

    @property
    def log_path(self) -> str:
        return os.path.join(self.directory, "server.log")

    def start(self) -> TemporaryPostgres:
        bindir = find_bindir()
        self._user = user = _server_user()
        base = tempfile.gettempdir()
        if user is not None and not _world_traversable(base):
            base = "/tmp"  # the server user must be able to reach its folder
        remove_abandoned_folders(base)
        self.directory = tempfile.mkdtemp(prefix=_FOLDER_PREFIX, dir=base)
        with open(os.path.join(self.directory, _OWNER_FILE), "w") as owner:
            owner.write(str(os.getpid()))
        data = os.path.join(self.directory, "data")
        if user is not None:
            os.chown(self.directory, user.pw_uid, user.pw_gid)
        try:
            self._run_as(
                user,
                [
                    os.path.join(bindir, "initdb"),
                    "-D",
                    data,
                    "-U",
                    "agl",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--no-sync",
                ],
            )
            self._argv = [os.path.join(bindir, "postgres"), "-D", data]
            self._launch()
        except BaseException:
            self.stop()
            raise
        return self

    def _run_as(self, user: Optional[pwd.struct_passwd], argv: List[str]) -> None:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120, **_as_user(user))
        if result.returncode != 0:
            raise PostgresUnavailableError(
                f"{os.path.basename(argv[0])} failed (exit {result.returncode}"
                f"{', as user ' + user.pw_name if user else ''}):\n{result.stdout}{result.stderr}"
            )

    def kill(self) -> None:
        """Stop the server but keep its data, as a crash or maintenance would; :meth:`restart` brings it back."""
        with contextlib.suppress(psycopg.Error):
            self._close_admin()
        self._stop_process()

    def restart(self) -> None:
        """Start the server again on the same port with the same data."""
        if self._process is not None:
            self.kill()
        self._launch(self.port)

    def _launch(self, port: Optional[int] = None) -> None:
        settings: dict[str, Union[str, int]] = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": self._argv[2],
            "max_connections": 300,
        }
        if not self.durable:
            settings.update(fsync="off", full_page_writes="off", synchronous_commit="off")
        settings.update(self.settings)
        for _ in range(1 if port else 3):  # a free port can be taken between our probe and the server's bind
            self.port = port or _free_port()
            argv = self._argv + ["-p", str(self.port)]
            for name, value in settings.items():
                argv += ["-c", f"{name}={value}"]
            with open(self.log_path, "ab") as log:
                self._process = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **_as_user(self._user)
                )
            self.admin_dsn = f"postgresql://agl@127.0.0.1:{self.port}/postgres"
            if self._wait_ready():
                logger.info("PostgreSQL started on port %d (%s)", self.port, self.directory)
                return
        raise PostgresUnavailableError(f"PostgreSQL did not start; its log ({self.log_path}):\n{self._log_tail()}")

    def _wait_ready(self) -> bool:
        """Wait until the server accepts connections (True) or its process exited (False)."""
        assert self._process is not None
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                if "could not bind" in self._log_tail():
                    return False
                raise PostgresUnavailableError(
                    f"PostgreSQL exited with {self._process.returncode} on start; its log:\n{self._log_tail()}"
                )
            try:
                with psycopg.connect(self.admin_dsn, connect_timeout=2):
                    return True
            except psycopg.OperationalError:
                time.sleep(0.05)  # the server is starting; it has no way to tell us when it is ready
        self._stop_process()
        raise PostgresUnavailableError(
            f"PostgreSQL did not accept connections within {_STARTUP_TIMEOUT_S:.0f} s; its log:\n{self._log_tail()}"
        )

    def _log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                return "".join(log.readlines()[-n:])
        return "(no log)"

    def _stop_process(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)  # "fast" shutdown: ends sessions, no checkpoint wait for clients
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def stop(self) -> None:
        """Stop the server and delete its folder. Safe to call twice."""
        self.kill()
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = ""


_FOLDER_PREFIX = "agl-pg-"
_OWNER_FILE = "owner.pid"


def remove_abandoned_folders(base: str) -> List[str]:
    """Delete the ``TemporaryPostgres`` folders under ``base`` whose owner process no longer exists; returns
    them. A folder without a readable ``owner.pid`` (one being created right now, or made by an older agl)
    is left alone."""
    removed = []
    for path in glob.glob(os.path.join(base, _FOLDER_PREFIX + "*")):
        try:
            with open(os.path.join(path, _OWNER_FILE)) as owner:
                pid = int(owner.read())
        except (OSError, ValueError):
            continue
        if not _process_exists(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _as_user(user: Optional[pwd.struct_passwd]) -> dict:
    """``subprocess`` options that run the child as ``user`` (and make the server die with its parent)."""
    options: dict = {"preexec_fn": _die_with_parent}
    if user is not None:
        options.update(user=user.pw_uid, group=user.pw_gid, extra_groups=[], env=_env_for(user))
    return options


def _env_for(user: pwd.struct_passwd) -> dict:
    env = dict(os.environ)
    env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    return env


def _load_prctl() -> Optional[Callable[..., int]]:
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl  # Linux only
    return None


_PRCTL = _load_prctl()  # looked up now: a child between fork and exec must not import or load anything


def _die_with_parent() -> None:
    """In the child: shut down at once when the process that started the server dies, leaving no orphan."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGQUIT))  # PR_SET_PDEATHSIG; SIGQUIT is PostgreSQL's immediate shutdown


@contextlib.contextmanager
def postgres_for_tests() -> Iterator[PostgresServer]:
    """``$AGL_TEST_POSTGRES_DSN``'s server if set, else a :class:`TemporaryPostgres` (started and stopped)."""
    dsn = os.environ.get(DSN_ENV)
    server: Union[ExistingPostgres, TemporaryPostgres] = ExistingPostgres(dsn) if dsn else TemporaryPostgres()
    with server:
        yield server
