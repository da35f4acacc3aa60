"""The pages' shared HTML: escaping, the page frame with its stylesheet, and small building blocks.

Every value read from a store (task inputs, prompts, responses, tool results, errors, ids) goes through
:func:`esc` before it reaches a page: a stored ``<script>`` is shown as text, never run. Markup is built from
literal strings here and in :mod:`agl.ui.pages` and :mod:`agl.ui.training` only."""

from __future__ import annotations

import html
import json
import math
from typing import Any, Iterable, Mapping, Optional, Sequence
from urllib.parse import urlencode

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:8px 16px;display:flex;gap:18px;align-items:baseline}
header a{color:#cfe0ff;text-decoration:none}header b{font-size:16px}
main{padding:12px 16px;max-width:1400px}
table{border-collapse:collapse;background:#fff;width:100%}
th,td{border-bottom:1px solid #e2e5ea;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef0f4;font-weight:600}
.num{text-align:right;font-variant-numeric:tabular-nums}
.succeeded{color:#137333}.failed{color:#b3261e}.cancelled{color:#666}.running{color:#1a56db}.queued{color:#8a6d00}
form.filters{display:flex;gap:10px;align-items:end;margin:8px 0;flex-wrap:wrap}
label{display:flex;flex-direction:column;font-size:12px;color:#555}
.pager{margin:8px 0;display:flex;gap:12px}
.note{color:#555;margin:6px 0}.error-box{background:#fde8e7;border:1px solid #f3b5b0;padding:8px;margin:8px 0}
.span{background:#fff;border:1px solid #e2e5ea;border-left:4px solid #c9ced6;margin:4px 0;padding:6px 8px}
.span.llm{border-left-color:#7a8cff}.span.tool{border-left-color:#f0a23b}.span.reward{border-left-color:#2fa862}
.span.agent{border-left-color:#555}.span.error{background:#fff4f3}
.span.sample{border:2px solid #137333;border-left:6px solid #137333;background:#f0fbf3}
.badge{display:inline-block;border-radius:3px;padding:0 6px;font-size:12px;background:#eef0f4;margin-left:4px}
.badge.sample{background:#137333;color:#fff}.badge.skip{background:#f3e5b5}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;background:#f9fafb;padding:6px;max-height:24em;
overflow:auto;border:1px solid #eceef2}
.msg{margin:2px 0}.role{font-weight:600;color:#444}
svg.chart{background:#fff;border:1px solid #e2e5ea}svg.chart text{font-size:11px;fill:#444}
.legend span{margin-right:14px}
"""


def esc(value: Any) -> str:
    """Any value as HTML text (quotes too, so it is safe inside attribute values)."""
    return html.escape("" if value is None else str(value), quote=True)


def page(title: str, body: str, *, root: str, refresh_s: Optional[int] = None) -> str:
    """A whole page: ``root`` is where the pages are mounted ("" for ``agl ui``, "/ui" under the store server);
    ``refresh_s`` reloads it every that many seconds (the training view while a run trains)."""
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)} - agl</title>{refresh}<style>{STYLE}</style></head><body>"
        f'<header><b>agl</b><a href="{esc(root)}/">Rollouts</a><a href="{esc(root)}/training">Training</a></header>'
        f"<main>{body}</main></body></html>"
    )


def link(root: str, path: str, text: str, params: Optional[Mapping[str, Any]] = None) -> str:
    """An ``<a>`` to ``root + path`` with the non-empty ``params`` as its query string."""
    return f'<a href="{esc(url(root, path, params))}">{esc(text)}</a>'


def url(root: str, path: str, params: Optional[Mapping[str, Any]] = None) -> str:
    kept = {k: v for k, v in (params or {}).items() if v not in (None, "")}
    return f"{root}{path}" + (f"?{urlencode(kept)}" if kept else "")


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: Sequence[int] = ()) -> str:
    """A table of cells that are already HTML (no header row when every header is ""); columns whose index is
    in ``numeric`` align right."""
    head = "".join(
        f'<th class="num">{esc(h)}</th>' if i in numeric else f"<th>{esc(h)}</th>" for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    thead = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def select(name: str, options: Sequence[str], chosen: Optional[str], label: str) -> str:
    """A ``<select>`` whose first option, "all", sends an empty value."""
    items = ['<option value="">all</option>'] + [
        f'<option value="{esc(o)}"{" selected" if o == chosen else ""}>{esc(o)}</option>' for o in options
    ]
    return f'<label>{esc(label)}<select name="{esc(name)}">{"".join(items)}</select></label>'


def number(value: Optional[float], digits: int = 3) -> str:
    """A reward or rate as a short text; "" for none, and NaN or infinities as they are."""
    if value is None:
        return ""
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def pretty(value: Any, limit: int = 20_000) -> str:
    """A stored value as indented JSON text (JSON held in a string is decoded first), cut at ``limit`` chars."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value[:limit]
    text = value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} more characters)"
