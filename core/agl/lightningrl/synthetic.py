"""Synthetic traces for LightningRL's tests and benchmarks: spans shaped like agl's real ones, made fast.

:class:`TraceBuilder` writes one attempt's spans the way agl's tracer does (sequence ids in start order,
parents from what is open, spans listed in end order, attributes under the semconv names), without the
tracer, a store or a model. :func:`synthetic_rollouts` makes many multi-agent rollouts from it for
benchmarks; with a :class:`TokenShape` their calls carry token ids and logprobs of a real model's size.
Real traces from real frameworks are in examples/lightningrl_worked_example.py.
"""

from __future__ import annotations

import contextlib
import json
import random
from array import array
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from agl import semconv
from agl.types import Rollout, Span

_TICK = 10_000_000  # ns between two events: 10 ms, well above the tree builder's 1 ms skew tolerance


class TraceBuilder:
    """Builds the spans of one attempt; nest with ``agent(...)`` / ``operation(...)`` / ``chain(...)``."""

    def __init__(self, rollout_id: str = "ro-1", attempt_id: str = "at-1", *, root_agent: Optional[str] = "agent"):
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.spans: List[Span] = []
        self._open: List[str] = []
        self._seq = 0
        self._clock = 0
        self._root = self._start()
        self._root_args = ("agl.rollout", "agent", {semconv.AGENT_NAME: root_agent} if root_agent else {})
        self._open.append(self._root[0])

    # -- plumbing -----------------------------------------------------------------------------------------
    def _start(self) -> Tuple[str, Optional[str], int, int]:
        self._clock += _TICK
        sequence = self._seq
        self._seq += 1
        span_id = f"{self.rollout_id}-{self.attempt_id}-{sequence:06x}"
        return span_id, (self._open[-1] if self._open else None), sequence, self._clock

    def _end(
        self,
        started: Tuple[str, Optional[str], int, int],
        name: str,
        kind: str,
        attributes: Dict[str, Any],
        status: str = "unset",
    ) -> Span:
        self._clock += _TICK
        span_id, parent_id, sequence, start = started
        span = Span.model_construct(
            rollout_id=self.rollout_id,
            attempt_id=self.attempt_id,
            sequence_id=sequence,
            trace_id="0" * 32,
            span_id=span_id,
            parent_id=parent_id,
            name=name,
            kind=kind,  # type: ignore[arg-type]  # callers pass span kinds
            start_time=start,
            end_time=self._clock,
            status=status,  # type: ignore[arg-type]  # callers pass span statuses
            error="error" if status == "error" else None,
            attributes={semconv.SPAN_KIND: kind, **attributes},
            events=[],
        )
        self.spans.append(span)
        return span

    @contextlib.contextmanager
    def _scope(self, name: str, kind: str, attributes: Dict[str, Any]) -> Iterator[str]:
        started = self._start()
        self._open.append(started[0])
        try:
            yield started[0]
        finally:
            self._open.pop()
            self._end(started, name, kind, attributes)

    # -- spans --------------------------------------------------------------------------------------------
    def agent(self, name: str) -> contextlib.AbstractContextManager[str]:
        """An agent span (``gen_ai.agent.name``); yields its span id."""
        return self._scope(f"invoke_agent {name}", "agent", {semconv.AGENT_NAME: name})

    def operation(self, name: str) -> contextlib.AbstractContextManager[str]:
        """An ``agl.operation`` span; yields its span id (give it to ``llm(operation=...)`` to link calls)."""
        return self._scope(semconv.SPAN_OPERATION, "chain", {semconv.OPERATION: name})

    def chain(self, name: str) -> contextlib.AbstractContextManager[str]:
        return self._scope(name, "chain", {})

    def llm(
        self,
        prompt_ids: Optional[Sequence[int]],
        response_ids: Optional[Sequence[int]],
        *,
        model: str = "m",
        content: Optional[str] = "ok",
        tool_calls: Sequence[Dict[str, Any]] = (),
        logprobs: Optional[Sequence[float]] = None,
        status: str = "unset",
        operation: Optional[str] = None,
        messages: Optional[List[Dict[str, Any]]] = None,
    ) -> Span:
        """An llm span; ``None`` ids record ``token_ids_source = "absent"``. ``tool_calls`` entries are
        ``{"id", "name", "arguments": str}``."""
        attrs: Dict[str, Any] = {semconv.REQUEST_MODEL: model, semconv.OPERATION_NAME: "chat"}
        if prompt_ids is not None and response_ids is not None:
            attrs[semconv.PROMPT_TOKEN_IDS] = list(prompt_ids)
            attrs[semconv.RESPONSE_TOKEN_IDS] = list(response_ids)
            attrs[semconv.TOKEN_IDS_SOURCE] = "server"
        else:
            attrs[semconv.TOKEN_IDS_SOURCE] = "absent"
        if logprobs is not None:
            attrs[semconv.RESPONSE_LOGPROBS] = list(logprobs)
        message: Dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in tool_calls
            ]
        attrs[semconv.OUTPUT_MESSAGES] = json.dumps([message])
        attrs[semconv.INPUT_MESSAGES] = json.dumps(messages or [{"role": "user", "content": "hi"}])
        if operation is not None:
            attrs[semconv.OPERATION_SPAN_ID] = operation
        return self._end(self._start(), f"chat {model}", "llm", attrs, status)

    def tool(
        self,
        name: str = "tool",
        *,
        call_id: Optional[str] = None,
        error: bool = False,
        error_type: str = "ValueError",
        stopped: bool = False,
    ) -> Span:
        attrs: Dict[str, Any] = {semconv.TOOL_NAME: name}
        if call_id is not None:
            attrs[semconv.TOOL_CALL_ID] = call_id
        if error:
            attrs[semconv.ERROR_TYPE] = error_type
        if stopped:
            attrs[semconv.SPAN_STOPPED] = True
        return self._end(self._start(), f"execute_tool {name}", "tool", attrs, "error" if error else "unset")

    def reward(
        self, value: float, *, scope: str = "step", name: str = "primary", operation: Optional[str] = None
    ) -> Span:
        attrs: Dict[str, Any] = {
            semconv.REWARD_VALUE: value,
            semconv.REWARD_PRIMARY: name,
            semconv.REWARD_SOURCE: "emitted",
            semconv.REWARD_SCOPE: scope,
        }
        if operation is not None:
            attrs[semconv.OPERATION_SPAN_ID] = operation
        return self._end(self._start(), semconv.SPAN_REWARD, "reward", attrs)

    def finish(self) -> List[Span]:
        """Close the root agent span and return every span (in end order, as a store receives them)."""
        if self._open and self._open[0] == self._root[0]:
            self._open.pop()
            name, kind, attrs = self._root_args
            self._end(self._root, name, kind, attrs)
        return self.spans


@dataclass(frozen=True)
class TokenShape:
    """Token ids of a real model's size for synthetic calls: each prompt about ``prompt`` ids and each response
    about ``response`` ids (within 25%), random from a ``vocab``-token vocabulary, with a logprob per response
    token. Without one, calls carry a few small ids that grow turn by turn (quick to make, for tests)."""

    prompt: int = 600
    response: int = 200
    vocab: int = 50_000

    def ids(self, rng: random.Random, size: int) -> List[int]:
        return rng.choices(range(self.vocab), k=rng.randint(size * 3 // 4, size * 5 // 4))

    def logprobs(self, rng: random.Random, n: int) -> List[float]:
        """Float32 values, as a server computes them."""
        return array("f", [-rng.expovariate(4.0) for _ in range(n)]).tolist()


def synthetic_attempt(
    rollout_id: str,
    n_spans: int,
    rng: random.Random,
    agents: Sequence[str] = ("writer", "checker", "rewriter"),
    tokens: Optional[TokenShape] = None,
) -> List[Span]:
    """About ``n_spans`` spans of a multi-agent attempt: turns of ``agent > operation > llm call (tool
    call) > tool > step reward``, 5 spans a turn; each prompt extends the previous call's context, or with
    ``tokens`` is a fresh prompt of that shape."""
    builder = TraceBuilder(rollout_id, "at-1", root_agent="team")
    context: List[int] = [rng.randrange(256) for _ in range(16)]
    turn = 0
    while len(builder.spans) + 6 <= n_spans:  # 5 spans a turn, 1 for the root
        call_id = f"call-{rollout_id}-{turn}"
        if tokens is None:
            prompt = list(context)
            response = [rng.randrange(256) for _ in range(rng.randint(4, 24))]
            logprobs = [-0.1] * len(response)
        else:
            prompt, response = tokens.ids(rng, tokens.prompt), tokens.ids(rng, tokens.response)
            logprobs = tokens.logprobs(rng, len(response))
        with builder.agent(agents[turn % len(agents)]):
            with builder.operation("turn") as operation:
                builder.llm(
                    prompt,
                    response,
                    logprobs=logprobs,
                    tool_calls=[{"id": call_id, "name": "search", "arguments": '{"q": "x"}'}],
                    operation=operation,
                )
                builder.tool("search", call_id=call_id, error=rng.random() < 0.1)
                builder.reward(rng.random(), operation=operation)
        if tokens is None:
            context += response + [rng.randrange(256) for _ in range(8)]
        turn += 1
    return builder.finish()


def synthetic_rollouts(
    n_spans: int,
    *,
    spans_per_rollout: int = 100,
    rollouts_per_task: int = 4,
    seed: int = 0,
    tokens: Optional[TokenShape] = None,
) -> Iterator[Tuple[Rollout, List[Span]]]:
    """``(succeeded rollout, its spans)`` pairs adding up to about ``n_spans`` spans, made lazily."""
    rng = random.Random(seed)
    for i in range(max(1, n_spans // spans_per_rollout)):
        rollout = Rollout(
            rollout_id=f"ro-{i}",
            task_id=f"task-{i // rollouts_per_task}",
            status="succeeded",
            final_reward=float(rng.random() < 0.5),
        )
        yield rollout, synthetic_attempt(rollout.rollout_id, spans_per_rollout, rng, tokens=tokens)
