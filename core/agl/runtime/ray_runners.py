"""Runners as Ray actors: one actor per runner, placed by Ray on any node of its cluster.

Each actor opens the store from its address (a store server, ``http://host:port``, or a database every node
reaches; address and token travel in the actor's environment as ``$AGL_STORE`` and ``$AGL_STORE_TOKEN``,
never in its arguments or logs) and runs :meth:`agl.runtime.runner.Runner.run_forever` on a thread, so that
the actor still answers the pool while it works. Heartbeats, timeouts and retries stay the store's, as with any runner.

Ray restarts a dead actor (``max_restarts``); its rollout is then retried at once: the pool asks each actor
what it works on (:meth:`RayRunnerPool.check`), and an actor that answers from a new process, or not at all,
has its last known attempt ended as failed. The agent travels pickled, and the actor unpickles it after
taking the driver's ``sys.path``, so that an agent defined in the driver's modules is found there as in a
spawned runner process.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from agl.instrumentation import instrumented
from agl.runtime.litagent import LitAgent
from agl.runtime.runner import check_runner_settings
from agl.runtime.runner_pool import end_attempt
from agl.store import open_store
from agl.store.base import LightningStore
from agl.store.http.wire import TOKEN_ENV

logger = logging.getLogger("agl.runtime.ray_runners")

#: The ``.options()`` of a Ray actor that place it; ``runner_resources`` takes these.
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")
#: Where :func:`agl.store.open_store` finds the store's address when it is given none.
STORE_ENV = "AGL_STORE"
#: How long the pool waits for an actor to answer what it works on before it counts it as gone.
ASK_TIMEOUT_S = 10.0


class RunnerActor:
    """The body of one Ray actor: a runner on a thread. Built again by Ray on each restart."""

    def __init__(
        self,
        agent: bytes,
        runner_id: str,
        kwargs: Dict[str, Any],
        sys_path: List[str],
        instrumentation: Optional[Dict[str, Any]] = None,
    ) -> None:
        from agl.runtime.runner import Runner

        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        if instrumentation is not None:  # hook what the driver hooked, as a spawned runner process does
            from agl.instrumentation import instrument

            instrument(**instrumentation)
        self.incarnation = f"{os.getpid()}-{time.monotonic_ns()}"
        store = open_store(None, create=False)  # $AGL_STORE, set in this actor's environment by the pool
        self.runner = Runner(pickle.loads(agent), store, runner_id=runner_id, **kwargs)
        self.current: Optional[Tuple[str, str]] = None
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agl-ray-runner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        def on_busy(rollout: Any) -> None:
            attempt = getattr(rollout, "attempt", None) if rollout is not None else None
            self.current = (rollout.rollout_id, attempt.attempt_id) if attempt is not None else None

        try:
            self.done = self.runner.run_forever(self._stop, on_busy=on_busy)
        except Exception:  # said in the actor's log, which Ray forwards to the driver
            logger.exception("runner %s stopped on an error", self.runner.runner_id)

    def status(self) -> Tuple[str, Optional[Tuple[str, str]], bool]:
        """(this process's incarnation, the (rollout id, attempt id) it works on, whether its loop runs)."""
        return self.incarnation, self.current, self._thread.is_alive()

    def stop(self, timeout: float) -> Optional[Tuple[str, str]]:
        """Stop after the current rollout, waiting up to ``timeout``; what it still works on then, if anything."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.runner.abandon("its Ray runner pool stopped")
            return self.current
        self.runner.close()
        self.runner.tracer.flush(5.0)
        return None


class RayRunnerPool:
    """``n_runners`` runners as Ray actors against ``store`` (an address, or a store object whose address every
    actor can open: a store server's client, PostgreSQL, or a SQLite file when the cluster is this machine);
    ``start`` / ``check`` / ``stop`` as :class:`agl.runtime.runner_pool.RunnerPool`."""

    left_agents_running = False  # an actor still busy at stop is killed, its agent with it

    def __init__(
        self,
        agent: LitAgent[Any],
        store: Union[str, LightningStore],
        n_runners: int = 1,
        *,
        token: Optional[str] = None,
        resources: Optional[Mapping[str, Any]] = None,
        max_restarts: int = 3,
        runner_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        if n_runners < 1:
            raise ValueError(f"n_runners must be at least 1, got {n_runners}")
        unknown = sorted(set(resources or {}) - set(RESOURCE_KEYS))
        if unknown:
            raise ValueError(f"runner_resources has {unknown}: Ray places an actor by {', '.join(RESOURCE_KEYS)}")
        if max_restarts < 0:
            raise ValueError(
                f"max_restarts must be 0 or more (-1 is not taken: a crash loop would never end), got {max_restarts}"
            )
        check_runner_settings(**(runner_kwargs or {}))
        self.agent = agent
        self.store_url, store_token = store_address(store)
        self.n_runners = n_runners
        self.token = token or store_token or os.environ.get(TOKEN_ENV)
        self.resources = {"num_cpus": 1, **(resources or {})}
        self.max_restarts = max_restarts
        self.runner_kwargs = runner_kwargs or {}
        self.respawned = 0  # actor restarts seen by check() (RunnerPool's name)
        self._actors: List[Any] = []
        self._known: List[Tuple[Optional[str], Optional[Tuple[str, str]]]] = []  # per actor: incarnation, attempt
        self._store: Any = None  # the pool's own client, to end the attempts of dead actors
        self._unplaced_warned = False

    def start(self) -> RayRunnerPool:
        import ray

        if not ray.is_initialized():
            ray.init()  # $RAY_ADDRESS or a new local cluster; `agl runner --ray ADDRESS` connects first
        env = {STORE_ENV: self.store_url, **({TOKEN_ENV: self.token} if self.token else {})}
        actor_class = ray.remote(RunnerActor)
        agent = pickle.dumps(self.agent)
        hooks = instrumented()
        self._store = _open(self.store_url, self.token)
        for i in range(self.n_runners):
            options = dict(self.resources, max_restarts=self.max_restarts, max_task_retries=0)
            options["runtime_env"] = {"env_vars": env}
            actor = actor_class.options(**options).remote(
                agent, f"ray-runner-{i}-{os.getpid()}", self.runner_kwargs, list(sys.path), hooks
            )
            self._actors.append(actor)
            self._known.append((None, None))
        return self

    def check(self) -> int:
        """Ask every actor what it works on; end the last known attempt of one that restarted or does not
        answer (so the store retries it now). Returns how many restarted since the last check."""
        import ray

        restarted = 0
        asks = [actor.status.remote() for actor in self._actors]
        for i, ask in enumerate(asks):
            incarnation, attempt = self._known[i]
            try:
                now, current, running = ray.get(ask, timeout=ASK_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                if incarnation is None and not self._unplaced_warned:  # never answered: not placed yet?
                    self._unplaced_warned = True
                    logger.warning(
                        "Ray runner actor %d has not started yet: does a node have what it asks for (%s)? "
                        "`ray status` shows what is free",
                        i,
                        self.resources,
                    )
                self._end(i, f"Ray runner actor {i} died or stopped answering ({type(exc).__name__})")
                continue
            if incarnation is not None and now != incarnation:
                restarted += 1
                self._end(i, f"Ray runner actor {i} died while running this rollout; Ray restarted it")
            elif not running:
                logger.error("Ray runner actor %d: its runner loop ended (see its log above)", i)
            self._known[i] = (now, current)
        self.respawned += restarted
        return restarted

    def stop(self, timeout: float = 10.0, *, reason: Optional[str] = None) -> None:
        """Stop every actor: idle ones at once, busy ones after their rollout, up to ``timeout`` in all; the
        attempt of one still busy then is ended as failed, naming ``reason``, and the actors are killed."""
        import ray

        if not ray.is_initialized():  # the cluster went first (an algorithm that started it shut it down)
            self._actors.clear()
            self._known.clear()
            if self._store is not None:
                self._store.close()
            return
        stops = [actor.stop.remote(timeout) for actor in self._actors]
        ready, _ = ray.wait(stops, num_returns=len(stops), timeout=timeout + ASK_TIMEOUT_S)
        why = reason or f"its Ray runner pool stopped and gave busy runners {timeout:g} s"
        for i, stop in enumerate(stops):
            try:
                busy = ray.get(stop, timeout=0) if stop in ready else self._known[i][1]
            except ray.exceptions.RayError:
                busy = self._known[i][1]
            if busy is not None:
                rollout_id, attempt_id = busy
                error = f"Ray runner actor {i} was stopped before this rollout ended: {why}"
                end_attempt(self._store, rollout_id, attempt_id, error, dead=False)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        self._known.clear()
        if self._store is not None:
            self._store.close()

    def _end(self, index: int, error: str) -> None:
        incarnation, attempt = self._known[index]
        if attempt is not None:
            end_attempt(self._store, attempt[0], attempt[1], error)
        self._known[index] = (incarnation, None)

    def __enter__(self) -> RayRunnerPool:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def store_address(store: Union[str, LightningStore]) -> Tuple[str, Optional[str]]:
    """``(address, token)`` that reopen ``store`` in another process: a store server's URL and token, a
    PostgreSQL DSN, a SQLite file's path. An in-memory store lives in this process only: a ValueError."""
    from agl.store.http.client import RemoteLightningStore
    from agl.store.sqlite.store import SqliteLightningStore

    if isinstance(store, str):
        return store, None
    if isinstance(store, RemoteLightningStore):
        return store.url, store.token
    if isinstance(store, SqliteLightningStore):
        return str(store.path), None
    dsn = getattr(store, "dsn", None)  # PostgreSQL (its driver is an extra: no import here)
    if isinstance(dsn, str):
        return dsn, None
    raise ValueError(
        f"Ray runners open the store in their own processes, and a {type(store).__name__} lives in this one: use a "
        "store server (agl store serve; store='http://host:port') or PostgreSQL (a SQLite file works when the "
        "Ray cluster is this machine)"
    )


def _open(url: str, token: Optional[str]) -> Any:
    """The pool's own store: the actors' URL, with the token given to the pool (not only ``$AGL_STORE_TOKEN``)."""
    if url.split("://", 1)[0].lower() in ("http", "https"):
        from agl.store.http.client import RemoteLightningStore

        return RemoteLightningStore(url, token=token)
    return open_store(url, create=False)


__all__ = ["RESOURCE_KEYS", "RayRunnerPool", "RunnerActor", "store_address"]
