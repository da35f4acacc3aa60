"""Algorithm: the training side. It reads rollouts and spans from the store and publishes resources.

An algorithm is bound to a Trainer, which owns the store, the runner pool and the adapter; the algorithm
only decides what to run and what to learn from it (``self.trainer.run_tasks`` does the running).

Agent Lightning's algorithms run unchanged on this base: ``run`` may be ``async def`` (the Trainer runs it
to its end on an event loop, :func:`run_algorithm`), they reach their surroundings through ``get_store()``,
``get_adapter()``, ``get_initial_resources()``, ``get_llm_proxy()`` and ``get_trainer()``, and a plain
function becomes one with ``@algo``.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

from agl.checks import check_count
from agl.errors import NoTrainableSamples

if TYPE_CHECKING:
    from agl.store.base import LightningStore
    from agl.trainer import Trainer

logger = logging.getLogger("agl.algorithm")
_UNSET: Any = object()  # an accessor not set on the algorithm itself: read from its trainer


class Algorithm(abc.ABC):
    """Subclass and implement ``run``; the Trainer calls ``bind`` before ``run``."""

    trainer: Trainer
    _store: Optional[LightningStore] = None
    _adapter: Any = _UNSET
    _initial_resources: Any = _UNSET
    _llm_proxy: Any = _UNSET

    def start_ray(self) -> None:
        """Start the Ray cluster this algorithm's own workers need (verl's, with their settings), so that runners
        on Ray (``Trainer(runner_mode="ray")``) join it rather than start one without them. None here."""
        return None

    def bind(self, trainer: Trainer) -> None:
        self.trainer = trainer

    set_trainer = bind  # Agent Lightning's name

    def get_trainer(self) -> Trainer:
        trainer = self.__dict__.get("trainer")
        if trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} is not bound to a Trainer: pass it as Trainer(algorithm=...) and call fit()"
            )
        return trainer

    @property
    def store(self) -> LightningStore:
        return self._store if self._store is not None else self.get_trainer().store

    def get_store(self) -> LightningStore:
        """The store the runners work from (Agent Lightning's accessor of :attr:`store`)."""
        return self.store

    def set_store(self, store: LightningStore) -> None:
        """Use ``store`` rather than the Trainer's: for an algorithm run on its own, without a Trainer."""
        self._store = store

    @property
    def adapter(self) -> Any:
        return self._from_trainer(self._adapter, "adapter")

    def get_adapter(self) -> Any:
        """The Trainer's ``adapter`` (its settings for agl's LightningRL, or an Agent Lightning adapter object)."""
        return self.adapter

    def set_adapter(self, adapter: Any) -> None:
        self._adapter = adapter

    def get_initial_resources(self) -> Any:
        """The Trainer's ``initial_resources`` (already stored as the first resources version), or None."""
        return self._from_trainer(self._initial_resources, "initial_resources")

    def set_initial_resources(self, resources: Any) -> None:
        self._initial_resources = resources

    def get_llm_proxy(self) -> Any:
        """The Trainer's ``llm_proxy`` argument, or None (agl.VERL runs agl's own proxy: ``VERL(proxy_port=)``)."""
        return self._from_trainer(self._llm_proxy, "llm_proxy")

    def set_llm_proxy(self, llm_proxy: Any) -> None:
        self._llm_proxy = llm_proxy

    def get_client(self) -> Any:
        raise NotImplementedError(
            "get_client() is Agent Lightning's v0.1 client/server API, which agl does not have: use get_store() "
            "(enqueue_rollout, wait_for_rollouts, query_spans, add_resources)"
        )

    def _from_trainer(self, own: Any, name: str) -> Any:
        if own is not _UNSET:
            return own
        trainer = self.__dict__.get("trainer")
        return getattr(trainer, name, None) if trainer is not None else None

    def is_async(self) -> bool:
        """Whether ``run`` is a coroutine function (Agent Lightning's algorithms usually are)."""
        return inspect.iscoroutinefunction(self.run)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    @abc.abstractmethod
    def run(self, train_dataset: Optional[Sequence[Any]], val_dataset: Optional[Sequence[Any]]) -> Any:
        """Train (or evaluate); may run for a long time. Return whatever summary is useful (or a coroutine)."""


class FastAlgorithm(Algorithm, abc.ABC):
    """An algorithm quick enough for ``Trainer.dev``: ``dev`` runs one given as the Trainer's algorithm (as
    Agent Lightning's does) instead of only running the tasks."""


def run_algorithm(
    algorithm: Algorithm,
    train_dataset: Optional[Sequence[Any]],
    val_dataset: Optional[Sequence[Any]],
    watch: Optional[Callable[[], Any]] = None,
) -> Any:
    """``algorithm.run(...)``; an ``async def`` run is run to its end on an event loop of its own, ``watch``
    called every second meanwhile (the Trainer replaces dead runners there): an exception from ``watch``
    cancels the run and is raised."""
    result = algorithm.run(train_dataset, val_dataset)
    if not inspect.isawaitable(result):
        return result
    return run_coroutine(result, watch)


def run_coroutine(awaitable: Any, watch: Optional[Callable[[], Any]] = None, every: float = 1.0) -> Any:
    """Run ``awaitable`` to its end from synchronous code; on a thread of its own if this thread already runs
    an event loop (a notebook), where ``asyncio.run`` would refuse."""

    async def main() -> Any:
        task = asyncio.ensure_future(awaitable)
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            if watch is not None:
                try:
                    watch()
                except BaseException:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    raise

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agl-algorithm") as pool:
        return pool.submit(asyncio.run, main()).result()


class FunctionalAlgorithm(Algorithm):
    """An algorithm made from a function by ``@algo``: its keyword parameters among ``store``,
    ``train_dataset``, ``val_dataset``, ``llm_proxy``, ``adapter`` and ``initial_resources`` are given the
    Trainer's; the function may be ``async def``."""

    _SUPPLIED: Dict[str, Callable[[Algorithm], Any]] = {
        "store": Algorithm.get_store,
        "adapter": Algorithm.get_adapter,
        "llm_proxy": Algorithm.get_llm_proxy,
        "initial_resources": Algorithm.get_initial_resources,
    }

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._params = inspect.signature(fn).parameters
        functools.update_wrapper(self, fn)  # the name and doc of the function

    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self._fn)

    def run(self, train_dataset: Optional[Sequence[Any]] = None, val_dataset: Optional[Sequence[Any]] = None) -> Any:
        kwargs = {name: supply(self) for name, supply in self._SUPPLIED.items() if name in self._params}
        for name, value in (("train_dataset", train_dataset), ("val_dataset", val_dataset)):
            if name in self._params:
                kwargs[name] = value
            elif value is not None:
                raise TypeError(
                    f"the @algo function {getattr(self._fn, '__name__', self._fn)!r} has no {name} parameter but was "
                    f"given a {name}: add `{name}=None` to its keyword parameters, or do not pass one"
                )
        return self._fn(**kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling the decorated function directly still runs the plain function."""
        return self._fn(*args, **kwargs)


def algo(fn: Callable[..., Any]) -> FunctionalAlgorithm:
    """Make an algorithm of a function (sync or ``async def``): ``Trainer(algorithm=my_algorithm)``."""
    return FunctionalAlgorithm(fn)


class EmptySteps:
    """Training steps in a row that had nothing to train on: each is logged and skipped, and ``limit`` in a
    row stop training with :class:`~agl.errors.NoTrainableSamples`. A mistake in the setup (an agent_match
    that selects no call, an agent that records none) would otherwise run to the last step training nothing,
    while a step or two emptied by chance (every rollout of a batch failed) does not end a run."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self.in_a_row = 0

    def trained(self) -> None:
        self.in_a_row = 0

    def nothing(self, step: int, why: str) -> None:
        """Step ``step`` had nothing to train on, because ``why``; raises on the ``limit``-th in a row."""
        self.in_a_row += 1
        logger.error("step %d trains nothing and is skipped: %s", step, why)
        if self.in_a_row >= self.limit:
            raise NoTrainableSamples(f"{self.in_a_row} steps in a row had nothing to train on; last: {why}")


class Baseline(FastAlgorithm):
    """No learning: runs the training tasks then the validation tasks ``n_epochs`` times and returns their
    rollouts.

    Useful to check the whole pipeline (agent, tracing, rewards) before spending GPU hours. Agent Lightning's
    ``train_split``, ``polling_interval``, ``max_queue_length`` and ``span_verbosity`` are accepted and unused:
    agl's runners take the tasks as fast as they free up, and ``agl inspect`` shows the spans.
    """

    def __init__(
        self,
        *,
        n_epochs: int = 1,
        train_split: Optional[float] = None,
        polling_interval: Optional[float] = None,
        max_queue_length: Optional[int] = None,
        span_verbosity: Optional[str] = None,
    ) -> None:
        unused = {
            "train_split": train_split,
            "polling_interval": polling_interval,
            "max_queue_length": max_queue_length,
            "span_verbosity": span_verbosity,
        }
        given = sorted(name for name, value in unused.items() if value is not None)
        if given:
            logger.info(
                "Baseline(%s): unused in agl, whose runners take the tasks as they free up (`agl inspect` shows spans)",
                ", ".join(given),
            )
        check_count("n_epochs", n_epochs)
        self.n_epochs = n_epochs

    def run(self, train_dataset: Optional[Sequence[Any]], val_dataset: Optional[Sequence[Any]]) -> Any:
        results: Dict[str, List[Any]] = {}
        for _ in range(self.n_epochs):
            if train_dataset:
                rollouts = self.trainer.run_tasks(train_dataset, mode="train", description="baseline train")
                results.setdefault("train", []).extend(rollouts)
            if val_dataset:
                rollouts = self.trainer.run_tasks(val_dataset, mode="val", description="baseline val")
                results.setdefault("val", []).extend(rollouts)
        return results
