"""The shared span helpers every framework adapter uses (agl.instrumentation.framework)."""

from __future__ import annotations

import json

from agl import semconv
from agl.instrumentation.framework import finish_tool, start_tool_span
from agl.testing.sink import ListSink, tracer_writes_to
from agl.tracing.tracer import get_tracer


def test_tool_arguments_are_what_the_tool_was_called_with_even_if_it_changes_them(rollout) -> None:
    """Arguments were encoded when the span ended: a tool that appended to a list argument (or changed a
    nested dict) changed what was stored as the call's arguments."""
    with tracer_writes_to(ListSink()) as sink:
        with rollout() as scope:
            arguments = {"items": [1, 2], "options": {"deep": True}}
            span = start_tool_span("collect", "test", arguments, call_id="call-1")
            arguments["items"].append(3)  # what the tool does with its input
            arguments["options"]["deep"] = False
            finish_tool(span, "done")
        assert get_tracer().flush(5)
        (tool,) = sink.of(scope.rollout_id, "tool")
    assert json.loads(tool.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"items": [1, 2], "options": {"deep": True}}
    assert tool.attributes[semconv.TOOL_CALL_RESULT] == "done"
