"""The rollouts list and the rollout page as HTML (every stored value through :func:`agl.ui.html.esc`)."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

from agl import semconv
from agl.lightningrl.links import json_attribute, tool_calls_of
from agl.lightningrl.tree import TreeNode
from agl.types import Span
from agl.ui.html import esc, link, number, pretty, select, table, url
from agl.ui.queries import MODES, STATUSES, RolloutDetail, RolloutPage, Selection

_TOKEN_IDS = (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.RESPONSE_LOGPROBS)


def when(seconds: Optional[float]) -> str:
    return "" if seconds is None else datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def duration(start: Optional[float], end: Optional[float]) -> str:
    """Seconds from start to end (to now while it runs)."""
    if start is None:
        return ""
    return f"{(end if end is not None else time.time()) - start:.2f} s"


def render_list(data: RolloutPage, *, root: str, status: Optional[str], mode: Optional[str]) -> str:
    filters = (
        f'<form class="filters" method="get" action="{esc(root)}/">'
        + select("status", STATUSES, status, "status")
        + select("mode", MODES, mode, "mode")
        + f'<label>per page<input name="limit" value="{data.limit}" size="4"></label><button>Filter</button></form>'
    )
    rows = [
        [
            link(root, f"/rollouts/{r.rollout_id}", r.rollout_id),
            f'<span class="{esc(r.status)}">{esc(r.status)}</span>',
            number(r.final_reward),
            str(r.n_attempts),
            duration(r.start_time, r.end_time),
            esc(r.mode),
            esc(r.task_id),
            esc(data.versions.get(r.resources_id or "", "")),
            when(r.create_time),
        ]
        for r in data.rollouts
    ]
    headers = [
        "rollout",
        "status",
        "reward",
        "attempts",
        "duration",
        "mode",
        "task",
        "policy version",
        "enqueued (UTC)",
    ]
    return "<h1>Rollouts</h1>" + filters + _pager(data, root, status, mode) + table(headers, rows, numeric=(2, 3, 4, 7))


def _pager(data: RolloutPage, root: str, status: Optional[str], mode: Optional[str]) -> str:
    def at(offset: int, text: str) -> str:
        return link(root, "/", text, {"status": status, "mode": mode, "limit": data.limit, "offset": offset})

    first, last = data.offset + 1, data.offset + len(data.rollouts)
    of = f" of {data.total}" if data.total is not None else ""
    parts = [
        f"<span>rollouts {first}&ndash;{last}{of} (in enqueue order)</span>"
        if data.rollouts
        else "<span>no rollouts</span>"
    ]
    if data.offset > 0:
        parts += [at(0, "first"), at(max(0, data.offset - data.limit), "previous")]
    if data.has_next:
        parts.append(at(data.offset + data.limit, "next"))
        if data.total is not None:
            parts.append(at(max(0, data.total - data.limit), "last (newest)"))
    return f'<div class="pager">{"".join(parts)}</div>'


def render_rollout(detail: RolloutDetail, *, root: str) -> str:
    r = detail.rollout
    facts = [
        ("status", f'<span class="{esc(r.status)}">{esc(r.status)}</span>'),
        ("reward", number(r.final_reward)),
        ("mode", esc(r.mode)),
        ("task", esc(r.task_id)),
        ("policy version", esc(detail.versions.get(r.resources_id or "", ""))),
        ("attempts", str(r.n_attempts)),
        ("duration", duration(r.start_time, r.end_time)),
        ("enqueued (UTC)", when(r.create_time)),
    ]
    if r.error:
        facts.append(("error", f"<pre>{esc(r.error)}</pre>"))
    head = table(["", ""], [[esc(k), v] for k, v in facts])
    return (
        f"<h1>Rollout {esc(r.rollout_id)}</h1>{head}<h2>Input</h2><pre>{esc(pretty(r.input))}</pre>"
        + _attempts(detail, root)
        + _selection_form(detail, root)
        + "<h2>Spans</h2>"
        + ("".join(_span(node, detail.selection) for node in detail.tree) or '<p class="note">No spans.</p>')
    )


def _attempts(detail: RolloutDetail, root: str) -> str:
    rows = [
        [
            link(root, f"/rollouts/{a.rollout_id}", f"#{a.sequence}", {"attempt": a.attempt_id})
            + (" (shown)" if a.attempt_id == detail.attempt_id else ""),
            f'<span class="{esc(a.status)}">{esc(a.status)}</span>',
            esc(a.runner_id),
            when(a.start_time),
            duration(a.start_time, a.end_time),
            esc(a.error),
        ]
        for a in detail.attempts
    ]
    return "<h2>Attempts</h2>" + table(["attempt", "status", "runner", "started (UTC)", "duration", "error"], rows)


def _selection_form(detail: RolloutDetail, root: str) -> str:
    s = detail.selection
    action = url(root, f"/rollouts/{detail.rollout.rollout_id}")
    keep = f'<input type="hidden" name="attempt" value="{esc(detail.attempt_id)}">' if detail.attempt_id else ""
    form = (
        f'<form class="filters" method="get" action="{esc(action)}">{keep}'
        f'<label>agent_match (a regex on the agent name; empty: every call)<input name="agent_match" '
        f'value="{esc(s.agent_match or "")}" size="40"></label><button>Show samples</button></form>'
    )
    if s.error:
        return f'<h2>Training samples</h2>{form}<div class="error-box">{esc(s.error)}</div>'
    lines = [f"{len(s.samples)} of {s.llm_calls} LLM calls become training samples (highlighted)."]
    lines += [f"{n} left out: {reason}." for reason, n in s.left_out.items()]
    if s.advantages.note:
        lines.append(s.advantages.note)
    return f"<h2>Training samples</h2>{form}" + "".join(f'<p class="note">{esc(line)}</p>' for line in lines)


def _span(node: TreeNode, selection: Selection) -> str:
    span = node.span
    sample = selection.samples.get(span.span_id)
    classes = ["span", esc(span.kind)] + (["error"] if span.status == "error" else []) + (["sample"] if sample else [])
    a = span.attributes
    title = [f"<b>{esc(span.kind)}</b> {esc(span.name)}"]
    if a.get(semconv.AGENT_NAME):
        title.append(f"agent <b>{esc(a[semconv.AGENT_NAME])}</b>")
    title.append(f"{(span.end_time - span.start_time) / 1e6:.1f} ms")
    if sample is not None:
        title.append(
            f'<span class="badge sample">training sample: policy {esc(sample.policy)}, call {sample.step}, '
            f"reward {esc(number(sample.reward))}{_advantage(selection, span.span_id)}</span>"
        )
    elif span.kind == "llm" and not selection.error:
        title.append('<span class="badge skip">not trained</span>')
    body = (
        _llm(a)
        if span.kind == "llm"
        else _tool(a)
        if span.kind == "tool"
        else _reward(a)
        if span.kind == "reward"
        else ""
    )
    if span.status == "error":
        body += f'<div class="error-box">{esc(span.error or a.get(semconv.ERROR_TYPE) or "error")}</div>'
    body += _attributes(span)
    return (
        f'<div class="{" ".join(classes)}" id="span-{esc(span.span_id)}" style="margin-left:{node.depth * 22}px">'
        f"<div>{' &middot; '.join(title)}</div>{body}</div>"
    )


def _advantage(selection: Selection, span_id: str) -> str:
    """ ", advantage A" when the sample's group gave it one (the page's note says why not otherwise)."""
    value = selection.advantages.by_span.get(span_id)
    return "" if value is None else f', advantage <b class="advantage">{esc(number(value))}</b>'


def _llm(a: Dict[str, Any]) -> str:
    tokens = [
        f"prompt {_count(a.get(semconv.PROMPT_TOKEN_IDS))} tokens",
        f"response {_count(a.get(semconv.RESPONSE_TOKEN_IDS))} tokens",
    ]
    if semconv.USAGE_INPUT_TOKENS in a or semconv.USAGE_OUTPUT_TOKENS in a:
        tokens.append(
            f"usage {esc(a.get(semconv.USAGE_INPUT_TOKENS))} in / {esc(a.get(semconv.USAGE_OUTPUT_TOKENS))} out"
        )
    if semconv.REQUEST_MODEL in a:
        tokens.append(f"model {esc(a[semconv.REQUEST_MODEL])}")
    prompt = _messages(a.get(semconv.INPUT_MESSAGES)) or _text(a.get(semconv.LLM_PROMPT))
    response = _messages(a.get(semconv.OUTPUT_MESSAGES))
    return (
        f'<div class="note">{" &middot; ".join(tokens)}</div>'
        f'<div class="prompt"><div class="role">Prompt</div>{prompt}</div>'
        f'<div class="response"><div class="role">Response</div>{response or "<i>none</i>"}</div>'
    )


def _count(ids: Any) -> str:
    ids = json_attribute(ids)
    return str(len(ids)) if isinstance(ids, list) else "no"


def _messages(raw: Any) -> str:
    """Chat messages (a JSON list) as role and text, tool calls as ``name(arguments)``."""
    messages = json_attribute(raw)
    if not isinstance(messages, list):
        return _text(raw)
    out: List[str] = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(_text(message))
            continue
        content = message.get("content")
        text = content if isinstance(content, str) else pretty(content) if content else ""
        call_text = "".join(_tool_call(c) for c in tool_calls_of(message))
        body = f"<pre>{esc(text)}</pre>" if text else ""
        out.append(f'<div class="msg"><span class="role">{esc(message.get("role", "?"))}</span>{body}{call_text}</div>')
    return "".join(out)


def _tool_call(call: Dict[str, Any]) -> str:
    function = call.get("function")
    if not isinstance(function, dict):
        function = {}
    return f"<pre>tool call {esc(function.get('name'))}({esc(function.get('arguments'))})</pre>"


def _text(value: Any) -> str:
    return "" if value is None else f"<pre>{esc(pretty(value))}</pre>"


def _tool(a: Dict[str, Any]) -> str:
    return (
        f"<div>tool <b>{esc(a.get(semconv.TOOL_NAME))}</b></div>"
        f'<div class="role">Arguments</div>{_text(a.get(semconv.TOOL_CALL_ARGUMENTS))}'
        f'<div class="role">Result</div>{_text(a.get(semconv.TOOL_CALL_RESULT))}'
    )


def _reward(a: Dict[str, Any]) -> str:
    parts = [f"reward <b>{esc(a.get(semconv.REWARD_VALUE))}</b> ({esc(a.get(semconv.REWARD_SCOPE, '?'))})"]
    if semconv.REWARD_DIMENSIONS in a:
        parts.append(_text(a[semconv.REWARD_DIMENSIONS]))
    return f"<div>{''.join(parts)}</div>"


def _attributes(span: Span) -> str:
    """Every attribute but the token id lists (their counts are shown), folded."""
    shown = {k: v for k, v in span.attributes.items() if k not in _TOKEN_IDS}
    rows = [[esc(k), f"<pre>{esc(pretty(v, limit=4000))}</pre>"] for k, v in sorted(shown.items())]
    return f"<details><summary>attributes</summary>{table(['name', 'value'], rows)}</details>"
