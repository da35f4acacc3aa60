"""The data model shared by every part of agl: tasks, rollouts, attempts, spans and resources.

Everything that crosses a process or machine boundary (store, HTTP, runner) is one of these pydantic
models, so there is exactly one span format and one rollout format in the system.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any, Callable, Dict, List, Literal, Optional, Protocol, Tuple, Type, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field


def _no_rollout() -> Optional[Tuple[str, str]]:
    return None


# ``(rollout_id, attempt_id)`` of the rollout the caller runs in. The rollout context (agl.tracing.context)
# sits above these types and sets this when imported: before that, no rollout can be running.
current_rollout_ids: Callable[[], Optional[Tuple[str, str]]] = _no_rollout

RolloutStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
AttemptStatus = Literal["running", "succeeded", "failed", "timeout", "unresponsive", "cancelled"]
# A rollout's mode: "train" (an algorithm's training rollouts), "val" (its validation ones) or "dev" (`agl dev`'s
# runs, with no training: `agl export` leaves them out unless asked, --mode dev or all).
RolloutMode = Literal["train", "val", "dev"]
SpanKind = Literal["agent", "llm", "tool", "chain", "reward", "annotation"]

TERMINAL_ROLLOUT_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
TERMINAL_ATTEMPT_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "timeout", "unresponsive", "cancelled"})


# Ids (and span ids, see agl.tracing.spans) come from a generator of agl's own, seeded from os.urandom and
# reseeded in forked children: agents often call random.seed(...) (per task, for reproducibility), which
# would make ids repeat; and uuid4 costs a system call per id (three per rollout on the store's hot path).
_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)
random_bits = _rng.getrandbits


def new_id(prefix: str) -> str:
    """A unique id such as ``ro-6b06f9b4bac46e164512``: the second it was made (8 hex digits), 48 random bits.

    Ids made later sort later (to the second), so the stores' indexes over ids take new entries at their right
    edge. With random ids every insert lands on a random index page: a SQLite rollout cycle on a store holding
    100,000 rollouts cost a quarter more than on an empty one (a few percent with these ids).
    """
    return f"{prefix}-{int(time.time()):08x}{random_bits(48):012x}"


Model = TypeVar("Model", bound=BaseModel)


def trusted(model: Type[Model], fields: Dict[str, Any]) -> Model:
    """A ``model`` instance from values agl itself produced (its tracer's spans, its own store's rows), without
    validation: pydantic's costs microseconds per object on the hot paths (and ``model_construct`` more).

    ``fields`` must give every field, already of its type, and becomes the instance's own dict; tests compare
    such instances with validated ones (tests/test_tracer.py, tests/store/test_sqlite_store.py).
    """
    instance = model.__new__(model)
    object.__setattr__(instance, "__dict__", fields)
    object.__setattr__(instance, "__pydantic_fields_set__", set(fields))
    object.__setattr__(instance, "__pydantic_extra__", None)
    object.__setattr__(instance, "__pydantic_private__", None)
    return instance


def now() -> float:
    return time.time()


class Task(BaseModel):
    """One item of a dataset. Rollouts of the same task form a GRPO group."""

    task_id: str = Field(default_factory=lambda: new_id("task"))
    input: Any = None
    metadata: Dict[str, Any] = Field(default_factory=dict)


class RolloutConfig(BaseModel):
    """Retry and timeout policy of one rollout.

    ``max_attempts`` counts every attempt, the first included. ``timeout_seconds`` bounds one attempt's
    wall time; ``heartbeat_timeout_seconds`` bounds the silence between heartbeats (or spans) of a runner.
    ``None`` disables the bound.
    """

    max_attempts: int = Field(default=1, ge=1)
    timeout_seconds: Optional[float] = Field(default=None, gt=0)
    heartbeat_timeout_seconds: Optional[float] = Field(default=None, gt=0)


class Attempt(BaseModel):
    """One try at running a rollout, owned by one runner."""

    rollout_id: str
    attempt_id: str
    sequence: int = Field(description="1 for the first attempt of the rollout, 2 for the first retry, ...")
    runner_id: Optional[str] = None
    status: AttemptStatus = "running"
    start_time: float = Field(default_factory=now)
    end_time: Optional[float] = None
    last_heartbeat: float = Field(default_factory=now)
    error: Optional[str] = None


class Rollout(BaseModel):
    """A task being (or having been) run by the agent, possibly over several attempts."""

    rollout_id: str = Field(default_factory=lambda: new_id("ro"))
    task_id: str = Field(default_factory=lambda: new_id("task"))
    input: Any = None
    mode: RolloutMode = "train"
    status: RolloutStatus = "queued"
    resources_id: Optional[str] = Field(
        default=None, description="Resources version to run with; None means the latest at dequeue time."
    )
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: Dict[str, Any] = Field(default_factory=dict)
    n_attempts: int = 0
    final_reward: Optional[float] = None
    error: Optional[str] = None
    create_time: float = Field(default_factory=now)
    start_time: Optional[float] = None
    end_time: Optional[float] = None
    attempt: Optional[Attempt] = Field(
        default=None, description="The attempt a runner is working on; set on dequeued rollouts only."
    )

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_ROLLOUT_STATUSES


# Agent Lightning's name for a dequeued rollout with its attempt: agl's Rollout carries it in ``attempt``.
AttemptedRollout = Rollout


# Attribute values are kept as they were made, non-finite floats included (a -inf logprob is data): their JSON
# uses the constants NaN/Infinity that Python and pydantic read back, as the SQLite and PostgreSQL stores'
# encoding always did, so that every backend and the HTTP wire return the same span. A model that holds
# spans takes this config too: pydantic serializes nested values by the outermost model's setting.
SPAN_JSON = ConfigDict(ser_json_inf_nan="constants")


def array_as_json(value: Any) -> Any:
    """The JSON fallback for values JSON does not know: NumPy and torch values (``np.int64``, arrays,
    tensors) become the plain numbers and lists they hold (``.tolist()``); anything else is refused.

    Task rows are often NumPy (a Hugging Face data set in NumPy format, a Parquet list column read with
    pandas), as are computed sampling parameters and logged objects: they are stored as their values, the
    same on every backend, and an agent reads them back as lists.
    """
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and not isinstance(value, (str, bytes)):
        return tolist()
    raise TypeError(f"Unable to serialize unknown type: {type(value)}")


class SpanEvent(BaseModel):
    model_config = SPAN_JSON

    name: str
    timestamp: int
    attributes: Dict[str, Any] = Field(default_factory=dict)


class Span(BaseModel):
    """The unified span: one LLM call, tool call, agent step, reward or annotation.

    A plain-data copy of an OpenTelemetry span plus the rollout bookkeeping. ``sequence_id`` numbers agl's
    own spans of one attempt by their start; calls are put in order by :func:`call_order_key`.
    """

    model_config = ConfigDict(extra="forbid", **SPAN_JSON)

    rollout_id: str
    attempt_id: str
    sequence_id: int = Field(ge=0)
    trace_id: str
    span_id: str
    parent_id: Optional[str] = None
    name: str
    kind: SpanKind = "chain"
    start_time: int = Field(description="Unix time in nanoseconds.")
    end_time: int = Field(description="Unix time in nanoseconds.")
    status: Literal["unset", "ok", "error"] = "unset"
    error: Optional[str] = None
    attributes: Dict[str, Any] = Field(default_factory=dict)
    events: List[SpanEvent] = Field(default_factory=list)


def call_order_key(span: Span) -> Tuple[int, int, str]:
    """The order of an attempt's calls: start time, then sequence id, then span id (so ties break the same
    way every time).

    Start time first because it is what orders calls from different sources: agl numbers its own spans
    1, 2, 3 per attempt, while spans sent over OTLP without ``agl.sequence.id`` get their start time in ns
    as sequence id; for agl's own spans both orders agree (the sequence id is taken when a span starts).
    """
    return (span.start_time, span.sequence_id, span.span_id)


# ---------------------------------------------------------------------------------------------------------
# Resources: what a rollout runs with (the model endpoint, a prompt template), versioned by the store.
# ---------------------------------------------------------------------------------------------------------


class LLM(BaseModel):
    """An OpenAI-compatible endpoint and the model and sampling parameters to use there."""

    resource_type: Literal["llm"] = "llm"
    endpoint: str
    model: str
    api_key: Optional[str] = None
    sampling_parameters: Dict[str, Any] = Field(default_factory=dict)

    def get_base_url(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> str:
        """The base URL for the agent's OpenAI client.

        With a rollout and attempt id, the URL routes through ``/rollout/{rid}/attempt/{aid}`` when the
        endpoint is an agl proxy (``ProxyLLM``); a plain LLM endpoint is returned unchanged, because the
        client-side tracer already knows which rollout a call belongs to.
        """
        return self.endpoint.rstrip("/")


class ProxyLLM(LLM):
    """An LLM served through an agl proxy that attributes requests to rollouts by URL."""

    resource_type: Literal["proxy_llm"] = "proxy_llm"  # type: ignore[assignment]  # the subclass narrows the literal on purpose

    def get_base_url(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> str:
        """Without ids, those of the rollout the caller runs in (the runner's scope), so agent code that
        calls ``llm.get_base_url()`` reaches the proxy under its own rollout unchanged."""
        base = self.endpoint.rstrip("/")
        if rollout_id is None and attempt_id is None:
            ids = current_rollout_ids()
            if ids is not None:
                rollout_id, attempt_id = ids
        if rollout_id is None or attempt_id is None:
            return base
        prefix, sep, suffix = base.rpartition("/v1")
        if not sep:
            return f"{base}/rollout/{rollout_id}/attempt/{attempt_id}"
        return f"{prefix}/rollout/{rollout_id}/attempt/{attempt_id}/v1{suffix}"


class PromptTemplate(BaseModel):
    """A prompt the algorithm may optimise; ``format`` fills it with str.format fields."""

    resource_type: Literal["prompt_template"] = "prompt_template"
    template: str
    engine: Literal["f-string"] = "f-string"

    def format(self, **kwargs: Any) -> str:
        return self.template.format(**kwargs)


Resource = Union[LLM, ProxyLLM, PromptTemplate]
NamedResources = Dict[str, Resource]


class ResourcesUpdate(BaseModel):
    """A versioned snapshot of named resources. ``version`` increases by one per new snapshot."""

    resources_id: str
    version: int
    resources: Dict[str, Resource] = Field(default_factory=dict)
    create_time: float = Field(default_factory=now)

    @property
    def update_time(self) -> float:
        """Agent Lightning's field: a snapshot in agl is never changed after it was stored."""
        return self.create_time


def parse_resources(raw: Dict[str, Any]) -> Dict[str, Resource]:
    """Turn ``{name: dict|model}`` into typed resources (dicts are told apart by ``resource_type``)."""
    out: Dict[str, Resource] = {}
    for name, value in raw.items():
        if isinstance(value, (LLM, PromptTemplate)):
            out[name] = value
            continue
        if not isinstance(value, dict):
            raise TypeError(f"resource {name!r} must be an LLM, ProxyLLM, PromptTemplate or dict, got {type(value)}")
        kind = value.get("resource_type", "llm")
        cls = {"llm": LLM, "proxy_llm": ProxyLLM, "prompt_template": PromptTemplate}.get(kind)
        if cls is None:
            raise ValueError(f"resource {name!r} has unknown resource_type {kind!r}")
        out[name] = cls.model_validate(value)  # type: ignore[attr-defined]  # mypy sees the classes as their metaclass
    return out


# ---------------------------------------------------------------------------------------------------------
# Agent Lightning's names for types its code annotates with (``agl.Dataset[str]``, ``agl.Triplet``, ``agl.Hook``).
# ---------------------------------------------------------------------------------------------------------

T_co = TypeVar("T_co", covariant=True)
TaskInput = Any  # what a task holds: any JSON-able value
RolloutRawResult = Union[None, float, int, bool, Dict[str, Any]]  # what rollout() may return (docs/rewards.md)


class Dataset(Protocol[T_co]):
    """A dataset is anything indexable with a length: a list, a Hugging Face dataset."""

    def __getitem__(self, index: int) -> T_co: ...

    def __len__(self) -> int: ...


class Triplet(BaseModel):
    """One LLM call as Agent Lightning's adapters give it: prompt, response, the reward credited to it."""

    prompt: Any = None
    response: Any = None
    reward: Optional[float] = None
    metadata: Dict[str, Any] = Field(default_factory=dict)


class Hook:
    """Callbacks around each rollout (``Trainer(hooks=[...])``); override the ones needed. They run in the
    runner, on the rollout's thread: ``runner`` is None in agl (its runner is internal), ``tracer`` the
    Trainer's ``tracer=`` argument or agl's tracer, and ``spans`` the attempt's stored spans. An exception in a
    hook is logged and the rollout goes on, as in Agent Lightning."""

    async def on_rollout_start(self, *, agent: Any, runner: Any, rollout: Rollout) -> None:
        """Before the agent runs."""

    async def on_trace_start(self, *, agent: Any, runner: Any, tracer: Any, rollout: Rollout) -> None:
        """Inside the rollout's trace, before the agent runs."""

    async def on_trace_end(self, *, agent: Any, runner: Any, tracer: Any, rollout: Rollout) -> None:
        """Inside the rollout's trace, after the agent returned."""

    async def on_rollout_end(self, *, agent: Any, runner: Any, rollout: Rollout, spans: List[Span]) -> None:
        """After the agent returned (or raised), with the spans stored so far."""
