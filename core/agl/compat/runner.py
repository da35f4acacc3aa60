"""Agent Lightning's runners (``agl.runner``): ``Runner`` and ``LitAgentRunner``, on agl's own runner.

``LitAgentRunner(tracer)`` runs an agent in this process: ``await runner.step(task, resources=)`` starts a rollout
in the store and runs it now; ``await runner.iter()`` takes rollouts from the store's queue. Both hand the work to
:class:`agl.runtime.runner.Runner` (agl's recording, heartbeats, timeouts, the reward rule, the completion) on a
worker thread, so the caller's event loop stays free; an async agent runs on agl's agent loop
(:mod:`agl.runtime.agent_loops`). Agent Lightning's hooks run around each rollout
(:class:`agl.compat.execution.HookedAgent`). Where agl differs: the runner waits in the store for work (woken
when it arrives) instead of polling every ``poll_interval`` seconds, and a rollout may not return a list of
spans (agl records them itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from typing import Any, Dict, Generic, Iterator, List, Optional, Sequence, Tuple, TypeVar

from agl.compat.execution import HookedAgent
from agl.compat.tracer import Tracer
from agl.runtime.litagent import LitAgent, as_agent
from agl.runtime.runner import Runner as AglRunner
from agl.runtime.runner import rollout_agent_name
from agl.store.base import LightningStore, PeerMode
from agl.types import NamedResources, Rollout, parse_resources

logger = logging.getLogger("agl.compat.runner")

__all__ = ["LitAgentRunner", "Runner"]

T = TypeVar("T")
STOP_CHECK_S = 0.5  # how often iter() looks at its stop event while the store has no work


class Runner(Generic[T]):
    """Agent Lightning's runner base class: ``init``/``init_worker``, their teardowns, ``run_context``, and
    the ``iter``/``step`` coroutines a subclass implements."""

    def __init__(self) -> None:
        self.worker_id: Optional[int] = None

    def init(self, agent: LitAgent[T], **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement init(agent)")

    def init_worker(self, worker_id: int, store: LightningStore, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement init_worker(worker_id, store)")

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement teardown()")

    def teardown_worker(self, worker_id: int, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement teardown_worker(worker_id)")

    def run(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Runner.run() is not defined: use `await runner.iter()` or `await runner.step(task)`")

    @contextlib.contextmanager
    def run_context(
        self,
        *,
        agent: Any,
        store: LightningStore,
        hooks: Optional[Sequence[Any]] = None,
        worker_id: Optional[int] = None,
    ) -> Iterator[Runner[T]]:
        """Set the runner up for ``agent`` and ``store`` (``init`` and ``init_worker``), and tear it down after."""
        worker = worker_id if worker_id is not None else 0
        self.init(agent, hooks=hooks)
        try:
            self.init_worker(worker, store)
            try:
                yield self
            finally:
                self.teardown_worker(worker)
        finally:
            self.teardown()

    async def iter(self, *, event: Optional[Any] = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement iter()")

    async def step(
        self,
        input: T,
        *,
        resources: Optional[NamedResources] = None,
        mode: PeerMode = None,
        event: Optional[Any] = None,
    ) -> Rollout:
        raise NotImplementedError(f"{type(self).__name__} must implement step(input)")


class LitAgentRunner(Runner[T]):
    """Runs a LitAgent (or an ``@agl.rollout`` function) against a store, one rollout at a time.

    ``heartbeat_interval`` is how often the running attempt tells the store it is alive; ``poll_interval``
    bounds how long ``iter()`` waits in the store for work before it looks at its stop event again;
    ``interval_jitter``, ``heartbeat_launch_mode`` and ``heartbeat_include_gpu`` are accepted (agl's runner
    wakes when work arrives, and beats from a thread of its own)."""

    def __init__(
        self,
        tracer: Any,
        max_rollouts: Optional[int] = None,
        poll_interval: float = 5.0,
        heartbeat_interval: float = 10.0,
        interval_jitter: float = 0.5,
        heartbeat_launch_mode: str = "thread",
        heartbeat_include_gpu: bool = False,
    ) -> None:
        super().__init__()
        self._tracer = tracer
        self._max_rollouts = max_rollouts
        self._poll_interval = poll_interval
        self._heartbeat_interval = heartbeat_interval
        self._user_agent: Optional[LitAgent[Any]] = None
        self._hooks: List[Any] = []
        self._store: Optional[LightningStore] = None
        self._agent: Optional[_RunnerAgent] = None  # what agl's runner runs (set by init_worker)
        self._runner: Optional[AglRunner] = None

    @property
    def tracer(self) -> Any:
        return self._tracer

    def init(self, agent: Any, *, hooks: Optional[Sequence[Any]] = None, **kwargs: Any) -> None:
        """Take the agent (a LitAgent, or a plain rollout function) and the hooks to run around each rollout."""
        self._user_agent = as_agent(agent)
        self._user_agent.set_runner(self)
        self._hooks = list(hooks or [])
        self._tracer.init()

    def init_worker(self, worker_id: int, store: LightningStore, **kwargs: Any) -> None:
        """Connect to ``store``: agl's runner for this worker, and the tracer's ``init_worker``."""
        agent = self.get_agent()
        self.worker_id = worker_id
        self._store = store
        self._tracer.init_worker(worker_id, store)
        self._agent = _RunnerAgent(agent, self._hooks, self, store)
        runner = AglRunner(self._agent, store, heartbeat_interval=self._heartbeat_interval)
        runner.agent_name = rollout_agent_name(agent)  # agent_match sees the user's agent, not the wrapper
        self._runner = runner

    def teardown_worker(self, worker_id: int, *args: Any, **kwargs: Any) -> None:
        if self._runner is not None:
            self._runner.close()
        self._runner = self._agent = None
        self.worker_id = None
        self._tracer.teardown_worker(worker_id)

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        self._user_agent = None
        self._hooks = []
        self._store = None
        self._tracer.teardown()

    def get_agent(self) -> LitAgent[Any]:
        if self._user_agent is None:
            raise ValueError("the runner has no agent: use `with runner.run_context(agent=..., store=...):`")
        return self._user_agent

    def get_store(self) -> LightningStore:
        if self._store is None:
            raise ValueError("the runner has no store: use `with runner.run_context(agent=..., store=...):`")
        return self._store

    def get_worker_id(self) -> str:
        return f"Worker-{self.worker_id}" if self.worker_id is not None else "Worker-Unknown"

    def _set_up(self) -> Tuple[AglRunner, _RunnerAgent]:
        if self._runner is None or self._agent is None:
            raise ValueError("the runner is not set up: use `with runner.run_context(agent=..., store=...):`")
        return self._runner, self._agent

    async def step(
        self,
        input: T,
        *,
        resources: Optional[NamedResources] = None,
        mode: PeerMode = None,
        event: Optional[Any] = None,
    ) -> Rollout:
        """Run ``input`` now as a new rollout (started in the store, skipping its queue) and return it ended,
        with its attempt. ``resources`` are stored as a new version for it (else the latest are used). As in
        Agent Lightning, what the agent raised is raised here, after the rollout was stored as failed."""
        (runner, agent), store = self._set_up(), self.get_store()
        resources_id = store.add_resources(parse_resources(dict(resources))).resources_id if resources else None
        started = store.start_rollout(input, mode=mode, resources_id=resources_id, worker_id=runner.runner_id)
        done = await asyncio.to_thread(runner.run_rollout, started)
        raised = agent.errors.pop(started.rollout_id, None)
        if raised is not None:
            raise raised
        if done.status != "succeeded":
            raise RuntimeError(f"rollout {done.rollout_id} ended {done.status}: {done.error}")
        return done.model_copy(update={"attempt": store.get_latest_attempt(done.rollout_id) or started.attempt})

    async def iter(self, *, event: Optional[Any] = None) -> None:
        """Run rollouts from the store's queue until ``event`` is set (or the task is cancelled), or
        ``max_rollouts`` have run; a rollout that fails is stored as failed and the loop goes on."""
        runner, agent = self._set_up()
        stopped = threading.Event()

        def should_stop() -> bool:
            return stopped.is_set() or (event is not None and bool(event.is_set()))

        wait = min(self._poll_interval, STOP_CHECK_S)
        try:
            done = await asyncio.to_thread(
                runner.run_forever, should_stop, max_rollouts=self._max_rollouts, wait_timeout=wait
            )
        except asyncio.CancelledError:
            stopped.set()  # the thread ends after the rollout it runs, instead of polling for ever
            raise
        finally:
            agent.errors.clear()  # iter() reports failures in the store only
        logger.info("%s ran %d rollouts", self.get_worker_id(), done)


class _RunnerAgent(LitAgent[Any]):
    """What agl's runner runs for a LitAgentRunner: the agent (inside :class:`HookedAgent` when there are hooks),
    first telling the tracer the attempt ``get_last_trace`` reads, and keeping what the agent raised by rollout
    id for ``step()`` to raise again."""

    def __init__(
        self, agent: LitAgent[Any], hooks: Sequence[Any], owner: LitAgentRunner[Any], store: LightningStore
    ) -> None:
        super().__init__(trained_agents=agent.trained_agents)
        self.owner = owner
        self.store = store
        self.inner = HookedAgent(agent, hooks, store, owner.tracer, owner) if hooks else agent
        self.errors: Dict[str, BaseException] = {}

    def run(self, task: Any, resources: NamedResources, rollout: Rollout) -> Any:
        tracer = self.owner.tracer
        if isinstance(tracer, Tracer) and rollout.attempt is not None:
            tracer.attach(self.store, rollout.rollout_id, rollout.attempt.attempt_id)
        try:
            result = self.inner.run(task, resources, rollout)
        except Exception as exc:
            self.errors[rollout.rollout_id] = exc
            raise
        return self._kept(result, rollout.rollout_id) if inspect.isawaitable(result) else result

    async def _kept(self, awaitable: Any, rollout_id: str) -> Any:
        try:
            return await awaitable
        except Exception as exc:
            self.errors[rollout_id] = exc
            raise
