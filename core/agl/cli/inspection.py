"""``agl inspect``: a rollout's spans as a tree, one line per span with what matters for training."""

from __future__ import annotations

import json
from typing import Dict, Iterator, List, Sequence, Tuple

from agl import semconv
from agl.lightningrl.tree import TraceTree, TreeNode, build_tree
from agl.types import Span, call_order_key


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


def render(spans: Sequence[Span]) -> str:
    """The tree, one line per span; a span whose recorded parent link was repaired says so, and a last line
    counts the repairs (the same ones ``agl export`` reports)."""
    lines = []
    for tree in _trees(spans):
        for depth, node in _walk(tree):
            lines.append("  " * depth + describe(node.span) + ("  (parent link repaired)" if node.repaired else ""))
        if tree.repairs.total:
            lines.append(f"tree repairs: {tree.repairs}")
    return "\n".join(lines)
