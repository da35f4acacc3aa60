"""``agl inspect``: a rollout's spans as a tree, one line per span with what matters for training."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

from agl import semconv
from agl._util.chat import call_function, json_attribute, message_text, tool_calls_of
from agl.lightningrl.tree import TraceTree, TreeNode, build_tree
from agl.types import Rollout, Span, call_order_key

if TYPE_CHECKING:
    from agl.ui.queries import Selection


def span_tree(spans: Sequence[Span]) -> List[Tuple[int, Span]]:
    """(depth, span) in depth-first order, children in call order (start time, then sequence id, as
    LightningRL orders calls), one tree per attempt."""
    return [(depth, node.span) for tree in _trees(spans) for depth, node in _walk(tree)]


def _trees(spans: Sequence[Span]) -> List[TraceTree]:
    """The trace tree of each attempt among ``spans``, repaired as LightningRL repairs it (``build_tree``): a
    span whose parent is missing, or whose parent links form a cycle, is placed where training sees it, never
    left out of what ``agl inspect`` shows."""
    by_attempt: Dict[str, List[Span]] = {}
    for span in spans:
        by_attempt.setdefault(span.attempt_id, []).append(span)
    return [build_tree(attempt_spans) for attempt_spans in by_attempt.values()]


def _walk(tree: TraceTree) -> Iterator[Tuple[int, TreeNode]]:
    stack = [(0, node) for node in sorted(tree.roots, key=_call_order, reverse=True)]
    while stack:
        depth, node = stack.pop()
        yield depth, node
        stack.extend((depth + 1, child) for child in sorted(node.children, key=_call_order, reverse=True))


def _call_order(node: TreeNode) -> Tuple[int, int, str]:
    return call_order_key(node.span)


def describe(span: Span) -> str:
    """The one-line summary of a span: kind, name, agent, tokens, tool, reward, error."""
    a = span.attributes
    parts = [f"[{span.kind}] {span.name}"]
    if semconv.AGENT_NAME in a:
        parts.append(f"agent={a[semconv.AGENT_NAME]}")
    if span.kind == "llm":
        prompt = a.get(semconv.PROMPT_TOKEN_IDS)
        response = a.get(semconv.RESPONSE_TOKEN_IDS)
        if prompt is not None or response is not None:
            parts.append(f"tokens={_count(prompt)}+{_count(response)}")
        else:  # "absent", or "refused": the server rejects the request for token ids (an LLM judge's)
            parts.append(f"tokens={'refused' if a.get(semconv.TOKEN_IDS_SOURCE) == 'refused' else 'absent'}")
        if a.get(semconv.LLM_STREAM):
            parts.append("stream (abandoned)" if a.get(semconv.STREAM_ABANDONED) else "stream")
        if semconv.PARSE_ERROR in a:
            parts.append(f"parse error: {one_line(str(a[semconv.PARSE_ERROR]))}")
    if semconv.TOOL_NAME in a:
        parts.append(f"tool={a[semconv.TOOL_NAME]}")
    if semconv.REWARD_VALUE in a:
        parts.append(f"reward={_number(a[semconv.REWARD_VALUE])} ({a.get(semconv.REWARD_SCOPE, '?')})")
    if semconv.MESSAGE_BODY in a:
        parts.append(json.dumps(a[semconv.MESSAGE_BODY], default=repr)[:80])
    duration_ms = (span.end_time - span.start_time) / 1e6
    parts.append(f"{duration_ms:.1f}ms")
    if span.status == "error":
        parts.append(f"ERROR {one_line(span.error or '')}".rstrip())
    return "  ".join(parts)


def _count(ids: object) -> str:
    """How many token ids a span holds; a value that is not a list (spans from other tools may hold anything)
    is shown as it is, marked."""
    if ids is None:
        return "0"
    if isinstance(ids, (list, tuple)):
        return str(len(ids))
    return _unexpected(ids, "a list of token ids")


def _number(value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    return _unexpected(value, "a number")


def _unexpected(value: object, expected: str) -> str:
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text}(?{type(value).__name__}, expected {expected})"


def one_line(text: str, width: int = 160) -> str:
    """An error as one line of the tree: a traceback's last line (the exception), else the first line, cut
    at ``width``; the full text is the rollout's error (printed once above the tree) or the span's own."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1] if lines[0].startswith("Traceback") else lines[0]
    if len(line) > width:
        line = line[: width - 3] + "..."
    return line + (f" (+{len(lines) - 1} lines)" if len(lines) > 1 else "")


def render(
    spans: Sequence[Span], *, text: bool = False, rollout: Optional[Rollout] = None, agent_match: Optional[str] = None
) -> str:
    """The tree, one line per span; a span whose recorded parent link was repaired says so, and a last line
    counts the repairs (the same ones ``agl export`` reports). ``text``: then each LLM call's prompt and response
    and each tool call's arguments and result. ``agent_match`` (with the ``rollout``): each LLM call marked with
    whether LightningRL's selection under that regex trains on it, and a line that counts them."""
    lines = []
    for tree in _trees(spans):
        selection = _selection(rollout, tree, agent_match)
        for depth, node in _walk(tree):
            repaired = "  (parent link repaired)" if node.repaired else ""
            lines.append("  " * depth + describe(node.span) + _mark(node.span, selection) + repaired)
        if tree.repairs.total:
            lines.append(f"tree repairs: {tree.repairs}")
        if selection is not None:
            lines.append(_selection_summary(selection))
        if text:
            lines.extend(_texts(tree, selection))
    return "\n".join(lines)


def _selection(rollout: Optional[Rollout], tree: TraceTree, agent_match: Optional[str]) -> Optional[Selection]:
    """LightningRL's selection in this attempt (the web view's entry point, :func:`agl.ui.queries.select_samples`)."""
    if agent_match is None or rollout is None:
        return None
    from agl.ui.queries import select_samples

    return select_samples(rollout, list(tree.spans()), agent_match)


def _mark(span: Span, selection: Optional[Selection]) -> str:
    if selection is None or span.kind != "llm" or selection.error:
        return ""
    sample = selection.samples.get(span.span_id)
    return f"  << TRAINS (reward {sample.reward:g})" if sample is not None else "  (not trained)"


def _selection_summary(selection: Selection) -> str:
    head = f"agent_match {selection.agent_match!r}"
    if selection.error:
        return f"{head}: no calls selected: {one_line(selection.error)}"
    left = "; ".join(f"{reason}: {n}" for reason, n in selection.left_out.items())
    counted = f"{head}: {len(selection.samples)} of {selection.llm_calls} LLM calls become samples"
    return counted + (f" ({left})" if left else "")


def _texts(tree: TraceTree, selection: Optional[Selection]) -> List[str]:
    """Each LLM call's prompt and response and each tool call's arguments and result, in tree order."""
    lines: List[str] = []
    for _, node in _walk(tree):
        span, a = node.span, node.span.attributes
        if span.kind == "llm":
            lines += ["", describe(span) + _mark(span, selection), "  prompt:"]
            lines += _messages(a.get(semconv.INPUT_MESSAGES, a.get(semconv.LLM_PROMPT)))
            lines += ["  response:", *_messages(a.get(semconv.OUTPUT_MESSAGES))]
        elif span.kind == "tool":
            lines += ["", describe(span), "  arguments:", *_indented(_value_text(a.get(semconv.TOOL_CALL_ARGUMENTS)))]
            lines += ["  result:", *_indented(_value_text(a.get(semconv.TOOL_CALL_RESULT)))]
    return lines


def _messages(raw: object) -> List[str]:
    """Chat messages as ``role: text`` lines, tool calls as ``tool call name(arguments)``; other values as text."""
    messages = json_attribute(raw)
    if not isinstance(messages, list):
        return _indented(_value_text(raw))
    lines: List[str] = []
    for message in messages:
        if not isinstance(message, dict):
            lines += _indented(_value_text(message))
            continue
        role = str(message.get("role", "?"))
        content = message_text(message.get("content"))
        lines += _indented(f"{role}: {content}" if content else f"{role}:")
        for call in tool_calls_of(message):
            function = call_function(call)
            lines += _indented(f"  tool call {function.get('name')}({function.get('arguments')})")
    return lines


def _value_text(value: object) -> str:
    if value is None:
        return "(none recorded)"
    return value if isinstance(value, str) else json.dumps(value, default=repr)


def _indented(text: str) -> List[str]:
    return ["    " + line for line in text.splitlines() or [""]]
