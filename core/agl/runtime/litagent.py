"""LitAgent: the user's agent as the runner sees it, in class form or as a decorated function.

Same shape as Agent Lightning's ``LitAgent[T].rollout(task, resources, rollout)`` so existing code runs
with ``import agl``. A rollout may be sync or async (``async def rollout``, or Agent Lightning's
``rollout_async`` and its training/validation variants); it returns the episode reward (a number), None
(reward emitted with ``agl.emit_reward`` or none at all), or a dict with a ``"reward"`` key.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import weakref
from typing import Any, Callable, Dict, Generic, Optional, Set, TypeVar, Union

from agl.types import LLM, NamedResources, PromptTemplate, Rollout

logger = logging.getLogger("agl.runtime.litagent")
T = TypeVar("T")
RolloutResult = Union[None, float, int, bool, Dict[str, Any]]


class LitAgent(Generic[T]):
    """Subclass and implement ``rollout`` (sync or ``async def``), or Agent Lightning's ``rollout_async``;
    override ``validation_rollout`` (``validation_rollout_async``) to behave differently on validation
    rollouts (``rollout.mode == "val"``), ``training_rollout`` (``training_rollout_async``) on the others."""

    def __init__(self, *, trained_agents: Optional[str] = None) -> None:
        # ``trained_agents``: Agent Lightning's regex of the agents to train; ``Trainer.fit`` uses it as the
        # adapter's agent_match when the adapter names none.
        self.trained_agents = trained_agents
        self._runner_ref: Optional[weakref.ReferenceType[Any]] = None
        self._trainer_ref: Optional[weakref.ReferenceType[Any]] = None

    def rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must implement rollout(self, task, resources, rollout) "
            "(or use the @agl.rollout decorator on a function)"
        )

    def validation_rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        return self.rollout(task, resources, rollout)

    def training_rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        return self.rollout(task, resources, rollout)

    async def rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must implement rollout_async(self, task, resources, rollout) "
            "(or rollout, sync or async def)"
        )

    async def training_rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        return await self.rollout_async(task, resources, rollout)

    async def validation_rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        return await self.rollout_async(task, resources, rollout)

    def _overrides_async(self) -> bool:
        """Whether the subclass overrides one of Agent Lightning's ``*_async`` methods: then the runner calls
        those, as Agent Lightning's does."""
        return any(getattr(type(self), name) is not getattr(LitAgent, name) for name in _ASYNC_METHODS)

    def is_async(self) -> bool:
        """True when the rollout runs as a coroutine: an ``*_async`` method is overridden, or a rollout method
        is an ``async def``."""
        return self._overrides_async() or any(
            inspect.iscoroutinefunction(getattr(self, name)) for name in _SYNC_METHODS
        )

    def run(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        """What the runner calls: the validation method when ``rollout.mode`` is ``"val"``, the training one
        otherwise (``"dev"`` runs try the agent as training would run it, as Agent Lightning's ``dev`` does), async
        ones if overridden. May return an awaitable."""
        training = rollout.mode != "val"
        if self._overrides_async():
            return (self.training_rollout_async if training else self.validation_rollout_async)(
                task, resources, rollout
            )
        return (self.training_rollout if training else self.validation_rollout)(task, resources, rollout)

    # -- Agent Lightning's links from the agent to what runs it ---------------------------------------------
    def set_runner(self, runner: Any) -> None:
        self._runner_ref = weakref.ref(runner)

    def get_runner(self) -> Any:
        return _referent(
            getattr(self, "_runner_ref", None), "runner", "only agl.LitAgentRunner (runner.run_context) sets it"
        )

    @property
    def runner(self) -> Any:
        return self.get_runner()

    def set_trainer(self, trainer: Any) -> None:
        self._trainer_ref = weakref.ref(trainer)

    def get_trainer(self) -> Any:
        return _referent(
            getattr(self, "_trainer_ref", None),
            "trainer",
            "agl's Trainer does not hand itself to the agent (its runners may be other processes); call "
            "agent.set_trainer(trainer) where the agent needs it",
        )

    @property
    def trainer(self) -> Any:
        return self.get_trainer()

    def get_tracer(self) -> Any:
        """The tracer of the runner that runs this agent (an Agent Lightning tracer given to
        ``agl.LitAgentRunner``), else agl's own: both have ``get_langchain_handler()``."""
        ref = getattr(self, "_runner_ref", None)
        runner = ref() if ref is not None else None
        if runner is not None and getattr(runner, "tracer", None) is not None:
            return runner.tracer
        from agl.tracing.tracer import get_tracer

        return get_tracer()

    @property
    def tracer(self) -> Any:
        return self.get_tracer()

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled without the runner and trainer links (weak references cannot be pickled): a runner process
        gets the agent, not the objects of the process that sent it."""
        state = dict(self.__dict__)
        state.pop("_runner_ref", None)
        state.pop("_trainer_ref", None)
        return state


_SYNC_METHODS = ("rollout", "training_rollout", "validation_rollout")
_ASYNC_METHODS = ("rollout_async", "training_rollout_async", "validation_rollout_async")


def _referent(ref: Optional[weakref.ReferenceType[Any]], what: str, how: str) -> Any:
    """The object a link of the agent points to, or a ValueError that says why there is none."""
    target = ref() if ref is not None else None
    if target is None:
        state = "is gone (it was garbage-collected)" if ref is not None else "is not set"
        raise ValueError(f"the agent's {what} {state}: {how}")
    return target


# The resource an ``llm`` / ``prompt_template`` argument gets when there are several of its kind: the names the
# trainers publish and update (``main_llm``; the prompt APO optimizes, ``prompt`` in agl's docs and `agl train
# --algorithm apo`, or ``prompt_template``), so a second one listed first (a judge's model, a tool's prompt) is
# not the one the agent is trained through.
_PREFERRED_RESOURCE = {"llm": ("main_llm",), "prompt_template": ("prompt_template", "prompt")}
_warned_several: Set[str] = set()
# How to give the agent that resource, for both ways of running it (the message cannot tell which one is in use).
_HOW_TO_GIVE = {
    "llm": "with `agl dev`, pass --endpoint URL --model NAME (or --fake-model for agl's scripted fake model); in "
    "Python, pass initial_resources={'main_llm': agl.LLM(...)} to the Trainer",
    "prompt_template": "with `agl dev`, pass --prompt TEXT (or @FILE); in Python, pass "
    "initial_resources={'prompt': agl.PromptTemplate(...)} to the Trainer",
}


def _resource_for(resources: NamedResources, kind: type, what: str) -> Any:
    found = {name: r for name, r in resources.items() if isinstance(r, kind)}
    if not found:
        raise ValueError(
            f"this rollout function takes {what!r} but the resources hold no {kind.__name__} "
            f"(have: {sorted(resources)}); {_HOW_TO_GIVE[what]}"
        )
    for preferred in _PREFERRED_RESOURCE[what]:
        if preferred in found:
            return found[preferred]
    preferred = " or ".join(repr(p) for p in _PREFERRED_RESOURCE[what])
    name = next(iter(found))
    if len(found) > 1 and what not in _warned_several:  # once per process, not once per rollout
        _warned_several.add(what)
        logger.warning(
            "the resources hold several %s (%s) and none is named %s: the rollout function's %r argument gets %r. "
            "Name the one to train %s, or take `resources` and pick",
            kind.__name__,
            ", ".join(found),
            preferred,
            what,
            name,
            preferred,
        )
    return found[name]


def _name_of(fn: Any) -> str:
    """A callable's name for a message: functools.partial objects and callable instances have no ``__name__``."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({_name_of(fn.func)}, ...)"
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else f"{type(fn).__name__} object"


class FunctionalLitAgent(LitAgent[Any]):
    """A LitAgent built from a plain function by ``@agl.rollout``; its arguments are matched by name:
    ``task`` (first), ``resources``, ``rollout``, ``llm`` and ``prompt_template`` (the resource of that kind:
    of several, the one named ``main_llm`` / ``prompt_template`` or ``prompt``, else the first, with a warning)."""

    _SUPPLIERS: Dict[str, Callable[[NamedResources, Rollout], Any]] = {
        "resources": lambda res, ro: res,
        "rollout": lambda res, ro: ro,
        "llm": lambda res, ro: _resource_for(res, LLM, "llm"),
        "prompt_template": lambda res, ro: _resource_for(res, PromptTemplate, "prompt_template"),
    }

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn
        params = list(inspect.signature(fn).parameters)
        if not params:
            raise TypeError(f"@agl.rollout function {_name_of(fn)} must take the task as its first argument")
        unknown = [p for p in params[1:] if p not in self._SUPPLIERS]
        if unknown:
            raise TypeError(
                f"@agl.rollout function {_name_of(fn)} has arguments {unknown} that agl cannot supply; "
                f"use any of {sorted(self._SUPPLIERS)} after the task"
            )
        self._extra = params[1:]
        self.__name__ = getattr(fn, "__name__", "rollout")
        self.__doc__ = fn.__doc__

    def rollout(self, task: Any, resources: NamedResources, rollout: Rollout) -> Any:
        kwargs = {name: self._SUPPLIERS[name](resources, rollout) for name in self._extra}
        return self.fn(task, **kwargs)

    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling the decorated function directly still runs the plain function."""
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> Any:
        """Pickled by name where ``@agl.rollout`` decorated a module-level function, as runner processes that
        are spawned, not forked, need: the module's attribute is then this agent, so pickle cannot find the
        plain function under its own name."""
        module, name = getattr(self.fn, "__module__", None), getattr(self.fn, "__qualname__", "")
        if module and _module_attribute(module, name, load=False) is self:
            return (_module_attribute, (module, name))
        return (_rebuilt, (self.fn, self.trained_agents))


def _module_attribute(module: str, qualname: str, load: bool = True) -> Any:
    target: Any = importlib.import_module(module) if load else sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target


def _rebuilt(fn: Callable[..., Any], trained_agents: Optional[str]) -> FunctionalLitAgent:
    agent = FunctionalLitAgent(fn)
    agent.trained_agents = trained_agents
    return agent


def rollout(fn: Callable[..., Any]) -> FunctionalLitAgent:
    """Turn ``def agent(task, llm)`` (or any of task/resources/rollout/llm/prompt_template) into a LitAgent."""
    return FunctionalLitAgent(fn)


def as_agent(obj: Any) -> LitAgent[Any]:
    """What the Trainer and the CLI run: a LitAgent as it is, a LitAgent subclass built with no arguments, or
    a plain rollout function wrapped as ``@agl.rollout`` would (a TypeError names arguments agl cannot
    supply). Anything else is a TypeError that says what an agent is."""
    if isinstance(obj, LitAgent):
        return obj
    if isinstance(obj, type) and issubclass(obj, LitAgent):
        return obj()
    if callable(obj):
        return rollout(obj)
    raise TypeError(f"the agent is a {type(obj).__name__}, not a LitAgent or a rollout function (def agent(task, llm))")
