"""Trainer: wires the store, the runner pool, the adapter and the algorithm together.

``Trainer(algorithm=..., n_runners=..., adapter={"agent_match": ...}, initial_resources=...)`` with
``fit(agent, train_dataset, val_dataset=)`` and ``dev(agent, dev_dataset)`` — the Agent Lightning API. Its
other arguments (``tracer``, ``strategy``, ``hooks``, ``max_rollouts``, ...) are taken as
:meth:`Trainer._take_peer_arguments` says: with their meaning where agl has one, else named in one log line.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Set, Tuple, Union

from agl.algorithm.base import Algorithm, Baseline, FastAlgorithm, run_algorithm
from agl.checks import check_count
from agl.errors import IllegalTransitionError
from agl.instrumentation import instrument, instrumented, uninstrument
from agl.instrumentation.base import any_instrumented, is_hooked
from agl.runtime.dataset import as_tasks
from agl.runtime.litagent import LitAgent, as_agent
from agl.runtime.ray_runners import RayRunnerPool, store_address
from agl.runtime.runner_pool import RunnerMode, RunnerPool
from agl.runtime.span_retention import SpanRetention
from agl.store import LightningStore, open_store
from agl.store.base import EnqueueRequest
from agl.types import Hook, Resource, Rollout, RolloutConfig, RolloutMode, parse_resources

logger = logging.getLogger("agl.trainer")

# Hooks a Trainer set up for a run and kept past it (Trainer._unhook_after_run); the next run that hooks for
# itself takes them over, so that it hooks the rest as if nothing were hooked and unhooks them all after.
_kept_hooks: List[str] = []

HOOK_METHODS = ("on_rollout_start", "on_trace_start", "on_trace_end", "on_rollout_end")
QUIET_WAIT_S = 60.0  # a wait in which no rollout finished for this long says what it waits for

AgentLike = Union[
    LitAgent[Any], Callable[..., Any]
]  # a plain rollout function is wrapped (agl.runtime.litagent.as_agent)


@dataclass
class RolloutSummary:
    """One row of ``dev``'s table."""

    task_id: str
    rollout_id: str
    status: str
    reward: Optional[float]
    llm_calls: int
    spans: int
    error: Optional[str]


class Trainer:
    """Runs an agent on datasets through a store and a pool of runners, and trains it with an algorithm."""

    def __init__(
        self,
        *,
        algorithm: Optional[Algorithm] = None,
        n_runners: int = 1,
        store: Union[LightningStore, str, None] = None,
        adapter: Any = None,
        initial_resources: Optional[Dict[str, Union[Resource, Dict[str, Any]]]] = None,
        runner_mode: Union[RunnerMode, Literal["ray"], None] = None,
        runner_resources: Optional[Mapping[str, Any]] = None,
        max_attempts: int = 1,
        rollout_timeout: Optional[float] = None,
        heartbeat_timeout: Optional[float] = 120.0,
        heartbeat_interval: float = 5.0,
        progress: bool = True,
        instrument: bool = True,
        span_retention_steps: Optional[int] = None,
        store_outage_timeout: float = 600.0,
        n_workers: Optional[int] = None,
        max_rollouts: Optional[int] = None,
        hooks: Any = None,
        tracer: Any = None,
        strategy: Any = None,
        port: Optional[int] = None,
        llm_proxy: Any = None,
        runner: Any = None,
        max_tasks: Optional[int] = None,
        dev: bool = False,
        daemon: bool = True,
        triplet_exporter: Any = None,
    ) -> None:
        """``span_retention_steps``: keep the spans of the last N training steps and delete older ones (their
        rollouts and rewards stay, validation spans stay); None keeps every span. See agl.runtime.span_retention.

        ``store_outage_timeout``: with a store server (``store="http://..."``) or PostgreSQL, how long each
        store call of the trainer and its runners keeps trying through an outage (a server restart) before the
        run fails; a store passed in with its own setting (``outage_timeout``, ``reconnect_timeout``) keeps it.

        ``runner_mode="ray"``: the runners are Ray actors (``pip install "agl[ray]"``; it joins the Ray cluster of
        this process, ``$RAY_ADDRESS``'s, or starts a local one), placed by ``runner_resources`` (``num_cpus``,
        ``num_gpus``, ``memory``, ``resources``; default one CPU each) and opening ``store`` in their own
        processes: a store server's URL or PostgreSQL (a SQLite file when the cluster is this machine). See
        :mod:`agl.runtime.ray_runners`.

        ``max_rollouts``: each runner stops after that many rollouts (a short smoke test); rollouts left queued
        once every runner stopped are cancelled. ``hooks``: Agent Lightning ``Hook`` objects, called around each
        rollout in the runner (:class:`agl.compat.execution.HookedAgent`). The rest of Agent Lightning's
        arguments: :meth:`_take_peer_arguments`."""
        if n_workers is not None:
            warnings.warn("Trainer(n_workers=) is now n_runners=", DeprecationWarning, stacklevel=2)
            n_runners = n_workers
        runner_mode, n_runners = self._take_peer_arguments(
            runner_mode,
            n_runners,
            tracer=tracer,
            strategy=strategy,
            port=port,
            llm_proxy=llm_proxy,
            runner=runner,
            daemon=daemon,
        )
        max_rollouts = _renamed("max_tasks", max_tasks, "max_rollouts", max_rollouts)
        adapter = _renamed("triplet_exporter", triplet_exporter, "adapter", adapter)
        if dev:
            warnings.warn(
                "Trainer(dev=True) is Agent Lightning's old switch: call trainer.dev(agent, dataset)",
                DeprecationWarning,
                stacklevel=2,
            )
        if max_rollouts is not None:
            check_count("max_rollouts", max_rollouts)
        self.max_rollouts = max_rollouts
        self.hooks = _as_hooks(hooks)
        if n_runners < 0:
            raise ValueError(f"n_runners must be >= 0 (0: only runners on other machines), got {n_runners}")
        if algorithm is not None and not callable(getattr(algorithm, "run", None)):
            raise TypeError(
                f"algorithm must be an algorithm object, got {algorithm!r}: agl.TorchGRPO(...) (CPU or one GPU), "
                "agl.VERL(config) (VERL's GRPO on GPUs), agl.APO(...) (prompt optimization), or a subclass of "
                "agl.Algorithm"
            )
        if n_runners and heartbeat_timeout is not None and heartbeat_timeout <= heartbeat_interval:
            # the first beat comes one interval after the rollout starts: every rollout longer than the timeout
            # that emits no span would end as "unresponsive ... presumed dead", from runners that are fine
            raise ValueError(
                f"heartbeat_timeout={heartbeat_timeout:g} s is not longer than "
                f"heartbeat_interval={heartbeat_interval:g} s "
                "(how often the runners send a heartbeat), so the store would declare healthy runners dead: make "
                "heartbeat_timeout several times heartbeat_interval (raise the one, or lower the other)"
            )
        if runner_mode not in ("process", "thread", "ray"):
            raise ValueError(f"runner_mode must be 'process', 'thread' or 'ray', got {runner_mode!r}")
        if runner_resources is not None and runner_mode != "ray":
            raise ValueError("runner_resources places Ray actors: it needs runner_mode='ray'")
        if runner_mode == "ray" and (max_rollouts is not None or self.hooks):
            raise ValueError("max_rollouts and hooks are for runner_mode='process' or 'thread', not Ray actors")
        self.algorithm = algorithm
        self.n_runners = n_runners
        self.store = store if isinstance(store, LightningStore) else open_store(store)
        if runner_mode == "ray" and n_runners:
            store_address(self.store)  # an in-memory store fails here, before any work

        self.store.ride_out_outages(store_outage_timeout)
        self.adapter = _settings_object(adapter)
        self.runner_mode = runner_mode
        self.runner_resources = dict(runner_resources or {})
        self.rollout_config = RolloutConfig(
            max_attempts=max_attempts, timeout_seconds=rollout_timeout, heartbeat_timeout_seconds=heartbeat_timeout
        )
        self.runner_kwargs = {"heartbeat_interval": heartbeat_interval, "rollout_timeout": rollout_timeout}
        self.progress = progress
        self.instrument = instrument
        self.span_retention = SpanRetention(self.store, span_retention_steps)
        self.resources_id: Optional[str] = None
        self.initial_resources = parse_resources(dict(initial_resources)) if initial_resources else None
        if self.initial_resources:
            self.resources_id = self.store.add_resources(self.initial_resources).resources_id
        self._pool: Optional[Union[RunnerPool, RayRunnerPool]] = None
        self._remote_runners_only = False

    def _take_peer_arguments(
        self,
        runner_mode: Union[RunnerMode, Literal["ray"], None],
        n_runners: int,
        *,
        tracer: Any,
        strategy: Any,
        port: Optional[int],
        llm_proxy: Any,
        runner: Any,
        daemon: bool,
    ) -> Tuple[Union[RunnerMode, Literal["ray"]], int]:
        """Agent Lightning's Trainer arguments that agl has no own use for; returns the runner mode and count.

        ``strategy``: ``"shm"`` is agl's ``runner_mode="thread"``, ``"cs"`` its ``"process"`` (its ``n_runners``
        wins, as there). ``tracer`` and ``llm_proxy`` are kept (``trainer.tracer`` goes to hooks,
        ``get_llm_proxy()`` gives the proxy to algorithms): agl records with its own instrumentation and
        agl.VERL runs its own proxy. ``port``, ``runner`` and ``daemon=False`` have no use. Each argument agl
        takes without its meaning is named in one log line."""
        from agl.compat.execution import build_strategy, say_once

        self.tracer, self.llm_proxy, self.port = tracer, llm_proxy, port
        self.strategy = build_strategy(strategy) if strategy is not None else None
        notes = {
            "tracer": (tracer is not None, "agl records with its own instrumentation"),
            "llm_proxy": (llm_proxy is not None, "given to algorithms (get_llm_proxy()); agl.VERL runs its own"),
            "runner": (runner is not None, "agl's runner pool runs the agent (n_runners=, runner_mode=)"),
            "port": (
                port is not None or getattr(self.strategy, "server_port", None) is not None,
                "agl's runners use the store directly; `agl store serve` serves it to other machines",
            ),
            "daemon": (not daemon, "agl's runner processes always stop with the Trainer"),
        }
        for name, (given, note) in notes.items():
            if given:
                say_once(name, "Trainer(%s=...): %s", name, note)
        if self.strategy is None:
            return runner_mode or "process", n_runners
        chosen: RunnerMode = self.strategy.runner_mode or "process"
        if runner_mode is not None and runner_mode != chosen:
            raise ValueError(
                f"strategy={strategy!r} runs runner_mode={chosen!r}, not {runner_mode!r}: give one of them"
            )
        n_runners = self.strategy.n_runners or n_runners
        kind = "threads" if chosen == "thread" else "processes"
        say_once("strategy", "Trainer(strategy=%r): agl runs %d runner %s against the store", strategy, n_runners, kind)
        return chosen, n_runners

    # -- running tasks (used by dev and by algorithms) -----------------------------------------------------
    def run_tasks(
        self,
        dataset: Sequence[Any],
        *,
        mode: RolloutMode = "train",
        n_per_task: int = 1,
        resources_id: Optional[str] = None,
        description: str = "rollouts",
        timeout: Optional[float] = None,
    ) -> List[Rollout]:
        """Enqueue ``n_per_task`` rollouts per task and wait for all of them; returns them in task order.

        Items without an id are named by position and mode (:func:`agl.runtime.dataset.as_tasks`): ``task-<i>`` for
        ``mode="train"``, ``val-<i>`` for ``mode="val"``, so validation and training tasks never share an id.

        Needs runners: this trainer's pool (inside ``fit``/``dev``, or ``with trainer.runners(agent):``), or
        with ``n_runners=0`` runners started elsewhere against the same store (``agl runner --store URL``).
        """
        if self._pool is None and not self._remote_runners_only:
            raise RuntimeError(
                "run_tasks needs running runners: call it from an algorithm inside fit(), or "
                "inside `with trainer.runners(agent):` (or use n_runners=0 with remote runners)"
            )
        tasks = as_tasks(dataset, mode=mode)  # tasks without ids: task-<i> for train, val-<i> for val
        requests = [
            EnqueueRequest(
                input=task.input,
                task_id=task.task_id,
                mode=mode,
                resources_id=resources_id or self.resources_id,
                config=self.rollout_config,
                metadata=task.metadata,
            )
            for task in tasks
            for _ in range(n_per_task)
        ]
        rollouts = self.store.enqueue_many(requests)
        return self._wait(rollouts, description, timeout)

    def _wait(self, rollouts: List[Rollout], description: str, timeout: Optional[float]) -> List[Rollout]:
        from agl._util.progress import progress_bar

        ids = [r.rollout_id for r in rollouts]
        pending = set(ids)
        finished: Dict[str, Rollout] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        quiet_since = time.monotonic()
        with progress_bar(description, total=len(ids), enabled=self.progress) as advance:
            while pending:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} of {len(ids)} rollouts did not finish within {timeout} s")
                for rollout in self.store.wait_for_rollouts(sorted(pending), timeout=0.5):
                    if rollout.rollout_id in pending:
                        pending.discard(rollout.rollout_id)
                        finished[rollout.rollout_id] = rollout
                        advance(1)
                        quiet_since = time.monotonic()
                if self._pool is not None:
                    self._pool.check()
                    if isinstance(self._pool, RunnerPool) and self._pool.finished:
                        self._cancel_unrun(pending)
                if pending and time.monotonic() - quiet_since >= QUIET_WAIT_S:
                    self._say_what_is_waited_for(len(pending), description)
                    quiet_since = time.monotonic()
        return [finished[i] for i in ids]

    def _cancel_unrun(self, pending: Set[str]) -> None:
        """Every runner ran its ``max_rollouts`` and stopped: the queued ones of ``pending`` will never run, so
        they are cancelled (said once per wait), and the wait ends with them."""
        queued = [r.rollout_id for r in self.store.query_rollouts(rollout_ids=pending, status=["queued"])]
        for rollout_id in queued:
            with contextlib.suppress(IllegalTransitionError):  # claimed meanwhile by a runner elsewhere
                self.store.cancel_rollout(rollout_id)
        if queued:
            logger.warning(
                "every runner ran its max_rollouts=%d and stopped: %d queued rollouts cancelled",
                self.max_rollouts,
                len(queued),
            )

    def _say_what_is_waited_for(self, n_pending: int, description: str) -> None:
        """No rollout finished for a while: say where the waited-for ones are (a trainer with ``n_runners=0``
        and no runner anywhere would otherwise wait forever without a word)."""
        counts = self.store.stats().rollouts
        where = f"{counts.get('queued', 0)} queued, {counts.get('running', 0)} running in the store"
        if self._remote_runners_only and not counts.get("running"):
            where += (
                "; this Trainer has n_runners=0: are runners started against this store (agl runner "
                "--store URL --agent MODULE:AGENT)?"
            )
        logger.warning(
            "%s: no rollout finished in the last %.0f s; waiting for %d (%s)",
            description,
            QUIET_WAIT_S,
            n_pending,
            where,
        )

    def learned_from(self, rollouts: Sequence[Rollout]) -> None:
        """Algorithms call this once a training step's update has learnt from ``rollouts``: the spans of steps
        older than ``span_retention_steps`` are deleted then (nothing happens without that setting)."""
        self.span_retention.learned_from(rollouts)

    @contextlib.contextmanager
    def runners(self, agent: AgentLike) -> Iterator[Optional[Union[RunnerPool, RayRunnerPool]]]:
        """The runner pool for ``agent``: started on enter, stopped on exit (also on errors and Ctrl-C).

        With ``n_runners=0`` there is no local pool (None): rollouts wait for remote runners.

        If nothing is instrumented in this process (no ``agl.instrument()``, no instrumentor of one's own),
        the pool's runs are instrumented (and the hooks removed after) unless ``Trainer(instrument=False)``:
        code written for Agent Lightning, whose Trainer sets up tracing itself, has no such line, and its LLM
        calls would otherwise go unrecorded (the ``agl`` CLI instruments too). If only a framework adapter is
        hooked, the OpenAI-client layer (which records the LLM calls) is hooked for the run.
        ``instrument=False`` leaves the recording to agl's LLM proxy (VERL) or to spans the agent sends itself
        (OTLP).
        """
        if self.n_runners == 0:  # the work is done by runners elsewhere (agl runner --store URL)
            self._remote_runners_only = True
            try:
                yield None
            finally:
                self._remote_runners_only = False
            return
        agent = self._with_hooks(as_agent(agent))
        hooked_here = self._hook_for_run()
        left_running = False
        try:
            pool: Union[RunnerPool, RayRunnerPool]
            if self.runner_mode == "ray":
                if self.algorithm is not None:
                    self.algorithm.start_ray()  # first: the runners join the cluster its workers need
                pool = RayRunnerPool(
                    agent, self.store, self.n_runners, resources=self.runner_resources, runner_kwargs=self.runner_kwargs
                )
            else:
                pool = RunnerPool(
                    agent,
                    self.store,
                    self.n_runners,
                    mode=self.runner_mode,
                    runner_kwargs=self.runner_kwargs,
                    max_rollouts=self.max_rollouts,
                )
            self._pool = pool.start()
            try:
                yield pool
            finally:
                self._pool = None
                pool.stop()
                left_running = pool.left_agents_running
        finally:
            if hooked_here:
                self._unhook_after_run(hooked_here, left_running)

    def _with_hooks(self, agent: LitAgent[Any]) -> LitAgent[Any]:
        """``agent`` with this Trainer's Agent Lightning hooks called around each rollout, if it has any."""
        if not self.hooks:
            return agent
        from agl.compat.execution import HookedAgent

        return HookedAgent(agent, self.hooks, self.store, self.tracer)

    @staticmethod
    def _unhook_after_run(hooked_here: List[str], left_running: bool) -> None:
        """Unhook what :meth:`_hook_for_run` hooked, but keep the OpenAI client hooked while an agent the runners
        gave up on at its timeout still runs: the hook is what refuses its calls (RolloutTimedOutError), and
        without it they would reach the model server, unrecorded, beside whatever runs next. The next run that
        hooks for itself takes the kept hook over (:meth:`_hook_for_run`): it would otherwise see the OpenAI
        client hooked, hook nothing else (no thread pools, no framework adapter) and leave it hooked for good."""
        keep = ["openai"] if left_running and "openai" in hooked_here else []
        if keep:
            logger.info(
                "the OpenAI client stays instrumented after this run: an agent past its rollout's timeout "
                "still runs, and its model calls are refused"
            )
            _kept_hooks[:] = keep
        uninstrument([name for name in hooked_here if name not in keep])

    def _hook_for_run(self) -> List[str]:
        """Hook what recording this run needs and nothing hooks yet; returns the names to unhook after it.

        Nothing hooked (no ``agl.instrument()``): everything ``instrument()`` finds. A framework adapter hooked
        on its own (``OpenAIAgentsInstrumentor().instrument()``, OpenInference-style) but not the OpenAI-client
        layer, which is what records LLM calls and their token ids: that layer, else the run would record
        agent and tool spans and no LLM call, so nothing to train on."""
        if not self.instrument:
            return []
        kept = [name for name in _kept_hooks if is_hooked(name)]
        _kept_hooks.clear()
        state = instrumented()
        if kept and state is not None and not state["frameworks"] and not is_hooked("thread_pools"):  # only those
            hooked = kept + instrument()
            logger.info(
                "instrumenting %s for this run (the OpenAI client was still hooked by an earlier one)",
                ", ".join(hooked),
            )
            return hooked
        if not any_instrumented():
            hooked = instrument()
            logger.info("agl.instrument() was not called: instrumenting %s for this run", ", ".join(hooked))
            return hooked
        if is_hooked("openai"):
            return []
        before = {name for name in ("openai", "thread_pools") if is_hooked(name)}
        hooked = [name for name in instrument(frameworks=[]) if name not in before]
        logger.info(
            "the OpenAI client is not instrumented (only a framework adapter is): instrumenting %s for "
            "this run, which records the LLM calls",
            ", ".join(hooked),
        )
        return hooked

    # -- public entry points -------------------------------------------------------------------------------
    def dev(
        self,
        agent: AgentLike,
        dev_dataset: Optional[Sequence[Any]] = None,
        *,
        train_dataset: Optional[Sequence[Any]] = None,
        val_dataset: Optional[Sequence[Any]] = None,
        mode: RolloutMode = "dev",
        print_table: bool = True,
    ) -> List[RolloutSummary]:
        """Run every task once with the current resources and no training; print a table of the results. The
        rollouts are stored as ``mode="dev"``, which training exports leave out unless asked (``agl export --mode
        dev``), as ``agl dev`` does.

        Agent Lightning's spelling, ``dev(agent, train_dataset, val_dataset=...)``, runs its training tasks so
        (``dev_dataset`` is that same first argument), then its validation tasks as ``mode="val"`` (the agent's
        ``validation_rollout``), as its ``Baseline`` does. A Trainer whose algorithm is an ``agl.FastAlgorithm``
        of one's own runs that algorithm on them instead, as Agent Lightning's ``dev`` does (returning no
        table)."""
        if dev_dataset is not None and train_dataset is not None:
            raise ValueError("dev() takes the tasks once: as dev_dataset (the first argument) or as train_dataset=")
        first = dev_dataset if dev_dataset is not None else train_dataset
        if isinstance(self.algorithm, FastAlgorithm) and not isinstance(self.algorithm, Baseline):
            self.fit(agent, first, val_dataset=val_dataset)
            return []
        if first is None and val_dataset is None:
            raise ValueError("dev() needs a dataset: trainer.dev(agent, dev_dataset=[...])")
        with self.runners(agent):
            rollouts = self.run_tasks(first, mode=mode, description="dev") if first is not None else []
            if val_dataset is not None:
                rollouts += self.run_tasks(val_dataset, mode="val", description="dev val")
        summaries = [self.summarize(r) for r in rollouts]
        if print_table:
            from agl._util.progress import print_rollout_table

            print_rollout_table(summaries)
        return summaries

    def fit(
        self,
        agent: AgentLike,
        train_dataset: Optional[Sequence[Any]] = None,
        *,
        val_dataset: Optional[Sequence[Any]] = None,
    ) -> Any:
        """Train ``agent`` with the algorithm (``Baseline`` if none was given: runs the data, learns nothing).

        An ``async def run`` (Agent Lightning's algorithms, ``@agl.algo`` functions) runs to its end on an event
        loop here while the runners work; its store calls are awaited (``await store.enqueue_rollout(...)``).
        An agent made with Agent Lightning's ``LitAgent(trained_agents=REGEX)`` trains those agents' calls
        when the adapter names no ``agent_match`` (the adapter's own wins)."""
        agent = as_agent(agent)
        algorithm = self.algorithm or Baseline()
        algorithm.bind(self)
        adapter = self.adapter
        self.adapter = _with_trained_agents(adapter, getattr(agent, "trained_agents", None))
        try:
            with self.runners(agent) as pool:
                return run_algorithm(algorithm, train_dataset, val_dataset, watch=pool.check if pool else None)
        finally:
            self.adapter = adapter

    def summarize(self, rollout: Rollout) -> RolloutSummary:
        spans = self.store.query_spans(rollout.rollout_id, "latest") if rollout.n_attempts else []
        return RolloutSummary(
            task_id=rollout.task_id,
            rollout_id=rollout.rollout_id,
            status=rollout.status,
            reward=rollout.final_reward,
            llm_calls=sum(1 for s in spans if s.kind == "llm"),
            spans=len(spans),
            error=rollout.error,
        )


def _with_trained_agents(adapter: Any, trained_agents: Optional[str]) -> Any:
    """The adapter settings with ``trained_agents`` as their ``agent_match`` where they name none."""
    if trained_agents is None:
        return adapter
    if adapter is None:
        return {"agent_match": trained_agents}
    current = adapter.get("agent_match") if isinstance(adapter, Mapping) else getattr(adapter, "agent_match", None)
    if current is not None:
        if current != trained_agents:
            logger.warning(
                "the agent's trained_agents=%r is ignored: the Trainer's adapter selects agent_match=%r",
                trained_agents,
                current,
            )
        return adapter
    if isinstance(adapter, Mapping):
        return _settings_object({**adapter, "agent_match": trained_agents})
    return adapter.with_agent_match(trained_agents)


def _settings_object(adapter: Any) -> Any:
    """A plain dict of adapter settings as one whose settings read as attributes too (Agent Lightning's code
    reads ``trainer.adapter.agent_match``); still a dict to every agl algorithm."""
    if type(adapter) is not dict:
        return adapter
    from agl.compat.adapter import AdapterSettings

    return AdapterSettings(adapter)


def _renamed(old_name: str, old: Any, name: str, value: Any) -> Any:
    """Agent Lightning's deprecated argument ``old_name`` as ``name`` (a DeprecationWarning); both given: ``name``."""
    if old is None:
        return value
    warnings.warn(f"Trainer({old_name}=) is now {name}=", DeprecationWarning, stacklevel=3)
    return value if value is not None else old


def _as_hooks(hooks: Any) -> Tuple[Hook, ...]:
    """``Trainer(hooks=)``: one ``agl.Hook`` or a sequence of them (anything with the hook methods works)."""
    if hooks is None:
        return ()
    many = tuple(hooks) if isinstance(hooks, (list, tuple)) else (hooks,)
    for hook in many:
        if not any(callable(getattr(hook, name, None)) for name in HOOK_METHODS):
            raise TypeError(f"hooks must be agl.Hook objects (with {', '.join(HOOK_METHODS)}), got {hook!r}")
    return many
