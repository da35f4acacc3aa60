"""Synthetic llm calls that answer with tool calls only, for the AIR tests of this folder."""

from __future__ import annotations

from typing import Sequence, Tuple

from agl.lightningrl.synthetic import TraceBuilder
from agl.types import Span


def tool_calling(b: TraceBuilder, *calls: Tuple[str, str, str], response: Sequence[int] = (2,)) -> Span:
    """An llm call of ``b`` (prompt ids [1]) answering ``response`` with no text, only ``calls``: each an
    (id, name, arguments) triple."""
    tool_calls = [{"id": call_id, "name": name, "arguments": arguments} for call_id, name, arguments in calls]
    return b.llm([1], list(response), content=None, tool_calls=tool_calls)
