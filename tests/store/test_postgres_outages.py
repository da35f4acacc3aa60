"""PostgreSQL outages as runners meet them, on a real server: a connection cut while a completion commits (a
real TCP proxy in front of the server cuts it), a silent network, the store server in front of a database
that is down; and the messages of what cannot work (a role without CREATE, a URL parameter libpq lacks, a
password in a runner's log)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Iterator, List, Optional
from urllib.parse import urlsplit

import psycopg
import pytest
from local_tcp_listener import Forwarder

from agl.errors import AglError, StoreUnavailableError
from agl.store import EnqueueRequest
from agl.store.postgres.schema import COMPLETE
from agl.store.postgres.store import PostgresLightningStore
from agl.testing.postgres import PostgresServer, TemporaryPostgres

# A piece of the completion's SQL text, which psycopg sends with each of a connection's first executions.
COMPLETION_MARK = COMPLETE.split("%(")[0][-40:].encode()


class CuttingProxy(Forwarder):
    """A TCP proxy on 127.0.0.1 in front of a PostgreSQL server. ``cut_after(mark)``: the first connection
    whose client sends bytes holding ``mark`` is cut right after they were forwarded, as a network cut or a
    database crash at that moment: the server got the statement, the client never hears back; with
    ``then_down`` the proxy goes down in the same moment. ``down``: new connections are closed at once (the
    database is unreachable)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.mark: Optional[bytes] = None
        self.cut = threading.Event()
        self.down = False
        self._down_at_cut = False
        super().__init__()

    def cut_after(self, mark: bytes, then_down: bool = False) -> None:
        self.mark, self._down_at_cut = mark, then_down

    def _handle(self, client: socket.socket) -> None:
        if self.down:
            client.close()
            return
        super()._handle(client)

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if from_client and self.mark and self.mark in data and not self.cut.is_set():
                    self.down = self.down or self._down_at_cut  # before the cut: no reconnect slips in between
                    self.cut.set()
                    break
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


@pytest.fixture
def proxied(postgres_dsn: str) -> Iterator[tuple]:
    """(the proxy, the store database's URL through it, its direct URL)."""
    parts = urlsplit(postgres_dsn)
    proxy = CuttingProxy(parts.port or 5432)
    yield proxy, parts._replace(netloc=f"{parts.username}@127.0.0.1:{proxy.port}").geturl(), postgres_dsn
    proxy.close()


def _runner(store: PostgresLightningStore, outage_timeout: float) -> Any:
    import agl
    from agl.runtime.runner import Runner

    @agl.rollout
    def agent(task: Any) -> float:
        return 1.0

    return Runner(agent, store, heartbeat_interval=0.5, outage_timeout=outage_timeout)


def test_a_connection_cut_while_a_completion_commits_does_not_stop_the_runner(proxied: tuple) -> None:
    """The completion's connection died with the commit unknown: the StoreUnavailableError escaped the
    runner, and `agl runner` (every runner of it) and a Trainer's run ended at once, blaming the outage
    timeout. The runner now reads the attempt back and completes it if needed: each rollout runs once."""
    proxy, url, direct = proxied
    store = PostgresLightningStore(url, reconnect_timeout=30)
    ids = [r.rollout_id for r in store.enqueue_many([EnqueueRequest(input=i) for i in range(3)])]
    proxy.cut_after(COMPLETION_MARK)
    runner = _runner(store, outage_timeout=60)
    try:
        assert runner.run_forever(threading.Event(), max_rollouts=3) == 3
    finally:
        runner.close()
        store.close()
    assert proxy.cut.is_set(), "the proxy never saw a completion"
    with PostgresLightningStore(direct) as check:
        assert [check.get_rollout(i).status for i in ids] == ["succeeded"] * 3
        assert [len(check.query_attempts(i)) for i in ids] == [1, 1, 1], "a rollout ran twice"


def test_a_completion_unconfirmed_for_the_outage_timeout_ends_the_runner_saying_so(proxied: tuple) -> None:
    """...and only an outage longer than the runner's outage timeout ends it, with a message that is true."""
    from agl.runtime.runner import StoreOutageError

    proxy, url, _ = proxied
    store = PostgresLightningStore(url, reconnect_timeout=0.5)
    store.enqueue_rollout("x")
    proxy.cut_after(COMPLETION_MARK, then_down=True)  # (set by another thread, a loaded CI run reconnected first)
    runner = _runner(store, outage_timeout=2)
    started = time.monotonic()
    try:
        with pytest.raises(StoreOutageError, match=r"past the outage timeout of 2 s \(--outage-timeout\); giving up"):
            runner.run_forever(threading.Event(), max_rollouts=1)
    finally:
        runner.close()
        store.close()
    assert time.monotonic() - started >= 2


# -- a silent network --------------------------------------------------------------------------------------


def _socket_options(conn: Any) -> List[int]:
    sock = socket.socket(fileno=conn.fileno())  # the connection's own socket, as the kernel has it
    try:
        return [
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        ]
    finally:
        sock.detach()


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
def test_connections_end_within_a_bounded_time_on_a_silent_network(postgres_dsn: str) -> None:
    """A partition (packets dropped, no reset) left a store call waiting on its open connection for the kernel's
    ~15 minutes: no keepalive, no TCP user timeout. agl's connections now carry both (a URL's own values win)."""
    with PostgresLightningStore(postgres_dsn) as store:
        assert store._run(_socket_options, write=False) == [1, 10, 5, 3, 30_000]
    with PostgresLightningStore(postgres_dsn + "?tcp_user_timeout=5000&keepalives_idle=3") as store:
        assert store._run(_socket_options, write=False) == [1, 3, 5, 3, 5_000]


# -- messages ----------------------------------------------------------------------------------------------


def test_a_runner_waiting_for_its_database_does_not_log_its_password(caplog: pytest.LogCaptureFixture) -> None:
    """`agl runner --wait-for-store` printed postgresql://agl:secret@... every 10 s and in its last error."""
    from agl.cli.remote import first_contact

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"postgresql://agl:s3cr3t@127.0.0.1:{probe.getsockname()[1]}/nowhere"  # nobody listens there
    caplog.set_level(logging.WARNING)
    with pytest.raises(StoreUnavailableError) as gave_up:
        first_contact(url, None, 1.0)
    assert "did not answer within 1 s (--wait-for-store)" in str(gave_up.value)
    assert "does not answer yet" in caplog.text
    assert "s3cr3t" not in str(gave_up.value) and "s3cr3t" not in caplog.text
    assert "user=agl dbname=nowhere host=127.0.0.1" in str(gave_up.value)


def test_an_unknown_url_parameter_is_a_clear_error(postgres_dsn: str) -> None:
    with pytest.raises(
        AglError, match=r'PostgreSQL URL given for the store is not valid: invalid URI query parameter: "bogus"'
    ):
        PostgresLightningStore(postgres_dsn + "?bogus=1")


def test_a_role_that_may_not_create_the_tables_is_told_what_it_needs(postgres_server: PostgresServer) -> None:
    """PostgreSQL 15+ lets only the owner create tables in ``public``: opening an empty database as another role
    raised psycopg's bare "permission denied for schema public", naming neither agl's tables nor a way out."""
    dsn = postgres_server.create_database()
    role = f"agl_nocreate_{int(time.time() * 1000) % 10**9}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {role}")
    parts = urlsplit(dsn)
    as_role = parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}").geturl()
    try:
        with pytest.raises(AglError, match="has no agl tables yet, and creating them was refused") as refused:
            PostgresLightningStore(as_role)
        assert "GRANT CREATE ON SCHEMA public TO" in str(refused.value)
        assert "open the store once as the database's owner" in str(refused.value)
    finally:
        postgres_server.drop_database(parts.path.lstrip("/"))
        with psycopg.connect(postgres_server.admin_dsn, autocommit=True) as admin:
            admin.execute(f"DROP ROLE IF EXISTS {role}")


# -- the store server in front of a database that is down --------------------------------------------------


def test_the_store_server_answers_503_while_its_database_is_down_and_clients_ride_it_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`agl store serve` answered a database outage with 500 "the store server failed" and a traceback per
    call, as for a bug. It is a 503 now, logged in one line; clients retry it until the database is back."""
    from agl.store.http.client import RemoteLightningStore
    from agl.store.http.server import ServerThread, create_app

    with TemporaryPostgres() as database:
        backing = PostgresLightningStore(database.create_database(), reconnect_timeout=0.3)
        server = ServerThread(create_app(backing, allow_anonymous=True)).start()
        quick = RemoteLightningStore(server.url, retries=0)
        patient = RemoteLightningStore(server.url, retries=30)
        try:
            rollout_id = patient.enqueue_rollout("x").rollout_id
            database.kill()
            caplog.set_level(logging.WARNING)
            with pytest.raises(StoreUnavailableError, match="HTTP 503"):
                quick.get_rollout(rollout_id)
            assert "store unavailable, answered 503 (clients retry)" in caplog.text
            assert "store server error" not in caplog.text and "Traceback" not in caplog.text
            got: List[Any] = []
            asking = threading.Thread(target=lambda: got.append(patient.get_rollout(rollout_id).status))
            asking.start()
            time.sleep(1.0)
            database.restart()  # here: the server dies with the thread that started it
            asking.join(60)
            assert got == ["queued"]  # the client retried its 503s through the outage
        finally:
            quick.close()
            patient.close()
            server.stop()
            backing.close()
