"""Which LLM call caused a span: the links step rewards and Automatic Intermediate Rewards follow.

A reward or a tool execution is credited to *the call that caused it*, found from the trace, never to
"the latest call" by time alone:

**Tool span -> call.** (1) The call whose output message requested it: the tool span's
``gen_ai.tool.call.id`` is one of the tool call ids in the call's ``gen_ai.output.messages`` (frameworks
that run the model's tool calls record the id: LangChain/LangGraph, the Agents SDK, AutoGen, AG2); of
several calls with that id (a server that numbers tool calls per answer, ``call_0``), the last one that
started before the tool. (2)
Without an id (``@agl.tool`` in a plain-Python agent): the last llm call *of the same agent* (nearest
enclosing agent span) that started before the tool. With neither, the tool is unattributed.

**Step reward span -> calls.** A step reward (``agl.reward.scope == "step"``) is linked through its
nearest ancestor that is an llm span (emitted while the call was current: that call), a tool span (the
call that caused the tool, as above) or an ``agl.operation`` span (every llm call made in the operation).
If no ancestor is one of these (the operation span was lost), the reward's own
``agl.operation.span_id`` names the operation. The calls *made in an operation* are the llm spans that
carry its span id in ``agl.operation.span_id`` (set when they start, see agl.tracing.emitters), or lie below it in
the tree, including those of operations nested in it. A reward linked to ``k`` calls gives each ``r / k``,
so the step rewards of a rollout add up to what was emitted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from agl import semconv
from agl._util.chat import json_attribute, tool_calls_of
from agl.lightningrl.tree import TraceTree
from agl.types import Span, call_order_key


def is_operation(span: Span) -> bool:
    return span.name == semconv.SPAN_OPERATION and semconv.OPERATION in span.attributes


def output_message(span: Span) -> Dict[str, Any]:
    """The first assistant message of an llm span's ``gen_ai.output.messages`` ({} if none or unreadable)."""
    messages = json_attribute(span.attributes.get(semconv.OUTPUT_MESSAGES))
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        return messages[0]
    return {}


class CallLinks:
    """The links of one attempt's trace tree; what costs more than one pass is computed on first use."""

    def __init__(self, tree: TraceTree) -> None:
        self.tree = tree
        self.ordered: List[Span] = sorted(tree.spans(), key=call_order_key)
        self._agent_of: Dict[str, Optional[str]] = {}
        self._anchor_of: Dict[str, Optional[str]] = {}
        self._operations_above: Dict[str, Tuple[str, ...]] = {}
        self._scan()
        self._fallback_caller: Dict[str, Optional[str]] = {}
        last_call_of_agent: Dict[Optional[str], str] = {}
        for span in self.ordered:
            if span.kind == "llm":
                last_call_of_agent[self._agent_of[span.span_id]] = span.span_id
            elif span.kind == "tool":
                self._fallback_caller[span.span_id] = last_call_of_agent.get(self._agent_of[span.span_id])
        self._caller_by_call_id: Optional[Dict[str, str]] = None
        self._calls_of_operation: Optional[Dict[str, List[str]]] = None
        self._messages: Dict[str, Dict[str, Any]] = {}
        self._callers: Dict[str, Optional[str]] = {}

    def _scan(self) -> None:
        """One pass down the tree, parents before children, for what each span inherits from the spans above
        it: its nearest agent span (``_agent_of``), its nearest llm, tool or operation span, the one a step
        reward under it is linked through (``_anchor_of``), and every operation span above it
        (``_operations_above``, nearest last). None or () at the roots. Each span hands its values down to its
        children."""
        agent_of, anchor_of, operations_above = self._agent_of, self._anchor_of, self._operations_above
        for root in self.tree.roots:
            agent_of[root.span_id] = anchor_of[root.span_id] = None
            operations_above[root.span_id] = ()
        for node in self.tree.walk():
            if not node.children:
                continue
            span = node.span
            span_id = span.span_id
            operation = is_operation(span)
            agent = span_id if span.kind == "agent" else agent_of[span_id]
            anchor = span_id if operation or span.kind in ("llm", "tool") else anchor_of[span_id]
            above = operations_above[span_id] + (span_id,) if operation else operations_above[span_id]
            for child in node.children:
                child_id = child.span.span_id
                agent_of[child_id], anchor_of[child_id], operations_above[child_id] = agent, anchor, above

    def message(self, call: Span) -> Dict[str, Any]:
        """:func:`output_message` of an llm span, decoded once however often the links and AIR ask for it."""
        found = self._messages.get(call.span_id)
        if found is None:
            found = self._messages[call.span_id] = output_message(call)
        return found

    # -- tools --------------------------------------------------------------------------------------------
    def caller_of_tool(self, tool: Span) -> Optional[str]:
        """The llm call that caused the tool span (by tool call id, else the agent's previous call)."""
        if tool.span_id in self._callers:
            return self._callers[tool.span_id]
        caller = None
        if tool.attributes.get(semconv.TOOL_CALL_ID):
            if self._caller_by_call_id is None:
                self._caller_by_call_id = self._callers_by_call_id()
            caller = self._caller_by_call_id.get(tool.span_id)
        if caller is None:
            caller = self._fallback_caller.get(tool.span_id)
        self._callers[tool.span_id] = caller
        return caller

    def _callers_by_call_id(self) -> Dict[str, str]:
        """{tool span id: llm span id} for tool spans whose call id an llm call that started before them
        requested (the latest such call, in call order)."""
        latest: Dict[str, str] = {}  # tool call id -> llm span id
        callers: Dict[str, str] = {}
        for span in self.ordered:
            if span.kind == "llm":
                for call in tool_calls_of(self.message(span)):
                    if isinstance(call.get("id"), str):
                        latest[call["id"]] = span.span_id
            elif span.kind == "tool":
                call_id = span.attributes.get(semconv.TOOL_CALL_ID)
                if isinstance(call_id, str) and call_id in latest:
                    callers[span.span_id] = latest[call_id]
        return callers

    # -- operations and step rewards ------------------------------------------------------------------------
    def calls_of_operation(self, operation_id: str) -> List[str]:
        """The llm calls made in the operation (see the module docstring), in call order."""
        if self._calls_of_operation is None:
            self._calls_of_operation = self._operation_calls()
        return self._calls_of_operation.get(operation_id, [])

    def _operation_calls(self) -> Dict[str, List[str]]:
        calls: Dict[str, List[str]] = defaultdict(list)
        for span in self.ordered:
            if span.kind != "llm":
                continue
            operations: Set[str] = set(self._operations_above[span.span_id])
            linked = span.attributes.get(semconv.OPERATION_SPAN_ID)
            if isinstance(linked, str) and linked in self.tree:
                operations.add(linked)
                operations.update(self._operations_above[linked])
            for operation_id in operations:
                calls[operation_id].append(span.span_id)
        return calls

    def calls_for_reward(self, reward: Span) -> List[str]:
        """The llm calls a step reward span belongs to (empty: unattributed)."""
        anchor_id = self._anchor_of[reward.span_id]
        if anchor_id is not None:
            anchor = self.tree.span(anchor_id)
            if anchor.kind == "llm":
                return [anchor_id]
            if anchor.kind == "tool":
                caller = self.caller_of_tool(anchor)
                return [caller] if caller is not None else []
            return self.calls_of_operation(anchor_id)
        linked = reward.attributes.get(semconv.OPERATION_SPAN_ID)
        return self.calls_of_operation(linked) if isinstance(linked, str) and linked in self.tree else []

    def step_rewards(self) -> StepRewards:
        """Every step reward span of the attempt, split over the calls it belongs to."""
        out = StepRewards()
        for span in self.ordered:
            if span.kind != "reward" or span.attributes.get(semconv.REWARD_SCOPE) != "step":
                continue
            value = span.attributes.get(semconv.REWARD_VALUE)
            if not isinstance(value, (int, float)):
                continue
            name = str(span.attributes.get(semconv.REWARD_PRIMARY, "primary"))
            calls = self.calls_for_reward(span)
            if not calls:
                out.unattributed += 1
                continue
            for call in calls:
                named = out.by_call.setdefault(call, {})
                named[name] = named.get(name, 0.0) + float(value) / len(calls)
        return out


@dataclass
class StepRewards:
    """Emitted step rewards per llm span id (``{call: {name: value}}``) and how many had no call."""

    by_call: Dict[str, Dict[str, float]] = field(default_factory=dict)
    unattributed: int = 0
