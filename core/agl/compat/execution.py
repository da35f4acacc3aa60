"""Agent Lightning's execution side (``agl.execution``): its strategies as agl runner modes, and its hooks.

Agent Lightning's Trainer runs the algorithm and the runners through an execution strategy: ``"shm"``
(runner threads beside the algorithm, one in-memory store) or ``"cs"`` (runner processes talking to a store
server the algorithm's process starts). agl's Trainer runs a pool of runners against its store itself:
threads (``runner_mode="thread"``) or processes (``"process"``, the default), so a strategy only chooses
that mode and the number of runners. :class:`HookedAgent` calls Agent Lightning's ``Hook`` callbacks around
each rollout, inside the runner, as Agent Lightning's runner does.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import threading
from types import SimpleNamespace
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type

from agl.runtime.litagent import LitAgent
from agl.runtime.runner import rollout_agent_name
from agl.runtime.runner_pool import RunnerMode
from agl.store.base import LightningStore
from agl.tracing.tracer import get_tracer
from agl.types import Hook, NamedResources, Rollout, Span

logger = logging.getLogger("agl.compat.execution")
_said: List[str] = []


def say_once(key: str, message: str, *args: Any) -> None:
    """Log ``message`` at INFO the first time ``key`` comes up in this process: an Agent Lightning argument
    that agl takes without its meaning is named once, not at every use."""
    if key not in _said:
        _said.append(key)
        logger.info(message, *args)


# -- strategies ------------------------------------------------------------------------------------------------


class ExecutionStrategy:
    """How the Trainer runs its runners: ``runner_mode`` and ``n_runners``, nothing else in agl."""

    runner_mode: ClassVar[Optional[RunnerMode]] = None

    def __init__(self, n_runners: Optional[int] = None, **options: Any) -> None:
        self.n_runners = n_runners
        self.options = options

    def execute(self, algorithm: Any, runner: Any, store: Any) -> None:
        raise NotImplementedError(
            "agl's Trainer runs the algorithm and its runner pool itself: call trainer.fit(agent, ...) or "
            "trainer.dev(agent, ...)"
        )


class ClientServerExecutionStrategy(ExecutionStrategy):
    """Runner processes (agl's ``runner_mode="process"``); they share agl's store file or server directly, so
    there is no store server to start here (for remote runners: ``agl store serve`` and ``agl runner``)."""

    runner_mode = "process"

    def __init__(
        self,
        role: Optional[str] = None,
        server_host: Optional[str] = None,
        server_port: Optional[int] = None,
        n_runners: Optional[int] = None,
        **options: Any,
    ) -> None:
        super().__init__(n_runners, **options)
        self.role = role
        self.server_host = server_host
        self.server_port = server_port


class SharedMemoryExecutionStrategy(ExecutionStrategy):
    """Runner threads in the Trainer's process (agl's ``runner_mode="thread"``)."""

    runner_mode = "thread"

    def __init__(self, n_runners: Optional[int] = None, main_thread: str = "runner", **options: Any) -> None:
        super().__init__(n_runners, **options)
        self.main_thread = main_thread


STRATEGIES: Dict[str, Type[ExecutionStrategy]] = {
    "shm": SharedMemoryExecutionStrategy,
    "cs": ClientServerExecutionStrategy,
    "SharedMemoryExecutionStrategy": SharedMemoryExecutionStrategy,
    "ClientServerExecutionStrategy": ClientServerExecutionStrategy,
}


def build_strategy(spec: Any) -> ExecutionStrategy:
    """A strategy from what Agent Lightning's Trainer takes: an instance, a class, ``"shm"``/``"cs"`` (or a class
    path ending in a strategy's name), or a dict with ``"type"`` and the constructor's arguments."""
    if isinstance(spec, ExecutionStrategy):
        built = spec
    elif isinstance(spec, type) and issubclass(spec, ExecutionStrategy):
        built = spec()
    elif isinstance(spec, str):
        built = _strategy_class(spec)()
    elif isinstance(spec, dict) and "type" in spec:
        options = {k: v for k, v in spec.items() if k != "type"}
        built = _strategy_class(str(spec["type"]))(**options)
    else:
        raise TypeError(
            f"strategy={spec!r} is not a strategy: give 'shm' (runner threads), 'cs' (runner processes), a dict with "
            "'type', or agl's own Trainer(runner_mode='thread'|'process', n_runners=N)"
        )
    if built.runner_mode is None:
        raise TypeError(
            f"strategy {type(built).__name__} is an execution strategy of one's own, which agl's Trainer cannot run: "
            "agl runs its runner pool itself; choose Trainer(runner_mode='thread'|'process', n_runners=N)"
        )
    return built


def _strategy_class(name: str) -> Type[ExecutionStrategy]:
    cls = STRATEGIES.get(name) or STRATEGIES.get(name.rpartition(".")[2])
    if cls is None:
        raise ValueError(
            f"unknown strategy {name!r}: use 'shm' (runner threads) or 'cs' (runner processes), or agl's "
            "Trainer(runner_mode='thread'|'process')"
        )
    return cls


# -- events ----------------------------------------------------------------------------------------------------


class ExecutionEvent(threading.Event):
    """A stop flag (set, is_set, clear, wait); agl's Trainer stops its runners itself."""


ThreadingEvent = ExecutionEvent


class MultiprocessingEvent:
    """A stop flag shared with child processes."""

    def __init__(self) -> None:
        self._event = multiprocessing.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._event.wait(timeout)


# -- hooks -----------------------------------------------------------------------------------------------------


class HookedAgent(LitAgent[Any]):
    """``agent`` with Agent Lightning ``Hook`` callbacks around each of its rollouts, called in the runner on
    the rollout's thread (an async agent's end hooks on its event loop). ``runner`` is None (agl's runner is
    internal), ``tracer`` the Trainer's ``tracer=`` argument or agl's tracer. A hook's exception is logged and
    the rollout goes on, as in Agent Lightning."""

    def __init__(
        self, agent: LitAgent[Any], hooks: Sequence[Hook], store: LightningStore, tracer: Any, runner: Any = None
    ) -> None:
        super().__init__(trained_agents=agent.trained_agents)
        self.agent = agent
        self.hook_runner = runner  # the hooks' ``runner``: an agl.LitAgentRunner that runs the agent, else None
        self.hooks = tuple(hooks)
        self.store = store
        self.hook_tracer = tracer
        self.fn = SimpleNamespace(__name__=rollout_agent_name(agent))  # agent_match sees the agent's own name

    def run(self, task: Any, resources: NamedResources, rollout: Rollout) -> Any:
        for name, extra in self._starts():
            _run_now(self._call(name, rollout, extra))
        try:
            result = self.agent.run(task, resources, rollout)
        except BaseException:
            _run_now(self._end(rollout))
            raise
        if inspect.isawaitable(result):
            return self._finish(result, rollout)
        _run_now(self._end(rollout))
        return result

    def _starts(self) -> Tuple[Tuple[str, Dict[str, Any]], ...]:
        return (("on_rollout_start", {}), ("on_trace_start", {"tracer": self._tracer()}))

    async def _finish(self, result: Any, rollout: Rollout) -> Any:
        try:
            return await result
        finally:
            await self._end(rollout)

    async def _end(self, rollout: Rollout) -> None:
        await self._call("on_trace_end", rollout, {"tracer": self._tracer()})
        await self._call("on_rollout_end", rollout, {"spans": self._spans(rollout)})

    async def _call(self, name: str, rollout: Rollout, extra: Dict[str, Any]) -> None:
        for hook in self.hooks:
            try:
                outcome = getattr(hook, name)(agent=self.agent, runner=self.hook_runner, rollout=rollout, **extra)
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception:  # a hook's failure must not fail the rollout
                logger.exception("rollout %s: hook %s.%s raised", rollout.rollout_id, type(hook).__name__, name)

    def _tracer(self) -> Any:
        return self.hook_tracer if self.hook_tracer is not None else get_tracer()

    def _spans(self, rollout: Rollout) -> List[Span]:
        """The attempt's spans stored so far (the rollout's own root span ends after the hooks)."""
        if rollout.attempt is None:
            return []
        get_tracer().flush(10.0)
        return self.store.query_spans(rollout.rollout_id, rollout.attempt.attempt_id)


def _run_now(coroutine: Any) -> None:
    """Run a hook coroutine to its end on the agent's thread, which runs no event loop of its own."""
    asyncio.run(coroutine)


__all__ = [
    "ClientServerExecutionStrategy",
    "ExecutionEvent",
    "ExecutionStrategy",
    "MultiprocessingEvent",
    "SharedMemoryExecutionStrategy",
    "ThreadingEvent",
]
