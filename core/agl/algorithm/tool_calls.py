"""How rollouts used the LLM and its tools, read from their spans: LLM calls per rollout and tool-call validity.

A multi-turn agent learns through several LLM calls per rollout, and one that cannot write a tool call that
runs never gets a tool result to read; these two figures show both, per training step and per evaluation.

- ``llm_calls_per_rollout``: the ``llm`` spans of the rollouts' latest attempts, per rollout.
- ``tool_call_validity``: of the tool calls the model tried, the share that ran without error. Tried: every
  tool call in an LLM call's output message, plus every ``<tool_call>`` block the server could not parse (it
  returns those as text: :mod:`agl.openai_wire.chat_format`). Ran: a ``tool`` span that ended without error
  (one recorded twice, under a tool span of the same name, counts once; one cut short with its run counts as
  neither). None when no tool call was tried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

from agl import semconv
from agl.lightningrl.links import output_message, tool_calls_of
from agl.openai_wire.chat_format import TOOL_CALL_OPEN
from agl.types import Span


@dataclass
class ToolCallStats:
    """Counts over rollouts; :meth:`columns` gives the metric columns."""

    rollouts: int = 0
    llm_calls: int = 0
    tool_calls: int = 0  # tried (parsed or not)
    tool_calls_ran: int = 0  # ran without error

    @classmethod
    def of(cls, spans_per_rollout: Iterable[Sequence[Span]]) -> ToolCallStats:
        stats = cls()
        for spans in spans_per_rollout:
            stats.add(spans)
        return stats

    def add(self, spans: Sequence[Span]) -> None:
        """Count one rollout attempt's spans."""
        self.rollouts += 1
        by_id: Dict[str, Span] = {s.span_id: s for s in spans}
        for span in spans:
            if span.kind == "llm":
                self.llm_calls += 1
                self.tool_calls += _tried(span)
            elif span.kind == "tool" and span.status != "error" and not _inner_or_stopped(span, by_id):
                self.tool_calls_ran += 1

    @property
    def llm_calls_per_rollout(self) -> Optional[float]:
        return self.llm_calls / self.rollouts if self.rollouts else None

    @property
    def validity(self) -> Optional[float]:
        """Ran over tried (at most 1: a tool an agent runs by itself, not at the model's request, is no call)."""
        return min(1.0, self.tool_calls_ran / self.tool_calls) if self.tool_calls else None

    def columns(self) -> Dict[str, float]:
        """The metric columns that have a value: ``llm_calls_per_rollout``, ``tool_call_validity``."""
        values = {"llm_calls_per_rollout": self.llm_calls_per_rollout, "tool_call_validity": self.validity}
        return {name: value for name, value in values.items() if value is not None}


def _tried(llm: Span) -> int:
    """Tool calls one LLM call tried: those parsed into its output message, else the unparsed blocks in its text."""
    message = output_message(llm)
    parsed = len(tool_calls_of(message))
    if parsed:
        return parsed
    text = message.get("content")
    return text.count(TOOL_CALL_OPEN) if isinstance(text, str) else 0


def _inner_or_stopped(tool: Span, by_id: Dict[str, Span]) -> bool:
    """A second record of its parent's call (``@agl.tool`` under ``@function_tool``), or cut short by its run."""
    parent = by_id.get(tool.parent_id or "")
    attributes = tool.attributes
    inner = (
        parent is not None
        and parent.kind == "tool"
        and parent.attributes.get(semconv.TOOL_NAME) == attributes.get(semconv.TOOL_NAME)
    )
    stopped = bool(attributes.get(semconv.SPAN_STOPPED)) or attributes.get(semconv.ERROR_TYPE) == "CancelledError"
    return inner or stopped
