"""What a generation request asks and gets, torch-free: its sampling parameters, each sampled token, the
finished generation, the events its listener receives, and the engine's counters. The engine that produces
them is :mod:`agl.serving.engine` (its module docs say how logprobs are computed); the API writers
(:mod:`agl.serving.openai_api`, :mod:`~agl.serving.completions_api`, :mod:`~agl.serving.responses_api`)
read them."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

#: finish reasons: the model ended its answer (end-of-sequence token or a stop string), or max_tokens
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` (or below ``GREEDY_BELOW``) is greedy; ``seed=None``
    draws a random seed."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    stop: Tuple[str, ...] = ()
    seed: Optional[int] = None
    top_logprobs: int = 0
    grammar: Optional[str] = None  # the answer must follow it (agl.serving.structured.response_grammar)
    # (open, close) tags of blocks stop strings do not apply inside: tool calls, whose markup a stop such
    # as "\n" or "}" would cut (OpenAI's stop does not cut function arguments either)
    stop_free_blocks: Optional[Tuple[str, str]] = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")


@dataclasses.dataclass
class Token:
    """One sampled token: its id, its logprob (see the module docs) and the top alternatives asked for."""

    token_id: int
    logprob: float
    top_logprobs: List[Tuple[int, float]]


@dataclasses.dataclass
class Generation:
    """A finished request. ``response_ids`` are every sampled token, the end-of-sequence token included.

    ``text`` is the decoded answer without a final end-of-sequence token and cut before a stop string;
    the ids still include the tokens that spelled the stop string, because they were sampled.
    """

    prompt_ids: List[int]
    response_ids: List[int]
    tokens: List[Token]
    text: str
    finish_reason: str
    version: int

    @property
    def logprobs(self) -> List[float]:
        return [t.logprob for t in self.tokens]


# Events a request's listener receives, in order: Started, Step* (one per sampled token), then Finished
# or Failed. The listener runs on the worker thread and must return quickly.
@dataclasses.dataclass
class Started:
    version: int


@dataclasses.dataclass
class Step:
    """A token was sampled; ``text`` is the whole answer so far (cut before a stop string)."""

    token: Token
    text: str


@dataclasses.dataclass
class Finished:
    generation: Generation


@dataclasses.dataclass
class Failed:
    error: BaseException


class ServerStopped(RuntimeError):
    """A request's failure because the server stopped with it queued or running (a Ctrl-C mid-step): each is
    answered 500 without a line of its own; the engine says how many in one line as it closes."""


Event = Any  # Started | Step | Finished | Failed
Listener = Callable[[Event], None]


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started: how much batching actually happened."""

    requests: int = 0
    prefills: int = 0  # forward passes over new prompts (a group of requests admitted together)
    decode_steps: int = 0  # forward passes over the running batch
    row_steps: int = 0  # sum of the batch sizes of those decode steps
    max_batch: int = 0  # most requests in one forward pass
    generated_tokens: int = 0

    @property
    def mean_batch(self) -> float:
        return self.row_steps / self.decode_steps if self.decode_steps else 0.0


class RequestHandle:
    """What :meth:`GenerationEngine.submit` returns: cancel a request the client no longer wants."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
