"""Agent Lightning's span-attribute helpers (``agentlightning.utils.otel``) on agl's spans.

Agent Lightning code tags spans and links a reward to the operation it judges with flat attributes
(``make_tag_attributes``, ``make_link_attributes``) passed to ``emit_reward(attributes=...)`` or
``emit_annotation``, then finds them again in the stored spans (``extract_*``, ``query_linked_spans``).
agl stores such attributes as given; tags are ``agl.tag.N`` and links ``agl.link.N.{key_match,value_match}``.
agl's own step-reward linkage (docs/rewards.md) needs none of this: these are for code that reads them itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, TypeVar, Union

from opentelemetry import trace

from agl.semconv import LINK, TAG

KEY_MATCH = "key_match"
VALUE_MATCH = "value_match"

logger = logging.getLogger("agl.compat.utils")
S = TypeVar("S")
Nested = Union[Dict[str, Any], List[Any]]


def flatten_attributes(nested: Nested, *, expand_leaf_lists: bool = False) -> Dict[str, Any]:
    """``{"a": {"b": 1, "c": [2, 3]}}`` as ``{"a.b": 1, "a.c": [2, 3]}`` (``a.c.0``, ``a.c.1`` with
    ``expand_leaf_lists``; lists of dicts are always expanded)."""
    flat: Dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ValueError(f"attribute keys must be strings, got {key!r} under {prefix or 'the top'}")
                walk(item, f"{prefix}.{key}" if prefix else key)
        elif isinstance(value, list) and (expand_leaf_lists or not prefix or not _is_leaf_list(value)):
            for index, item in enumerate(value):
                walk(item, f"{prefix}.{index}" if prefix else str(index))
        else:
            flat[prefix] = value

    walk(nested, "")
    return flat


def _is_leaf_list(values: List[Any]) -> bool:
    """A non-empty list of primitives of one type: an OpenTelemetry attribute value as it is."""
    return bool(values) and len({type(v) for v in values}) == 1 and isinstance(values[0], (str, int, float, bool))


def unflatten_attributes(flat: Mapping[str, Any]) -> Nested:
    """The inverse of :func:`flatten_attributes`: dotted keys become nested dicts, and a dict whose keys are
    exactly ``0..n-1`` becomes a list."""
    root: Dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        *parents, last = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    converted = {key: _lists(value) for key, value in node.items()}
    if converted and sorted(converted) == sorted(str(i) for i in range(len(converted))):
        return [converted[str(i)] for i in range(len(converted))]
    return converted


def filter_attributes(attributes: Mapping[str, Any], prefix: str) -> Dict[str, Any]:
    """The attributes named ``prefix`` or ``prefix.*``."""
    return {k: v for k, v in attributes.items() if k == prefix or k.startswith(prefix + ".")}


def filter_and_unflatten_attributes(attributes: Mapping[str, Any], prefix: str) -> Nested:
    """The ``prefix.*`` attributes, the prefix removed, nested (``{}`` if there are none)."""
    if prefix in attributes:
        raise ValueError(f"attribute {prefix!r} has a value of its own: only {prefix}.* attributes can be nested")
    return unflatten_attributes({k[len(prefix) + 1 :]: v for k, v in filter_attributes(attributes, prefix).items()})


def make_tag_attributes(tags: Sequence[str]) -> Dict[str, Any]:
    """Span attributes that tag a span: ``{"agl.tag.0": tags[0], ...}``."""
    return flatten_attributes({TAG: list(tags)}, expand_leaf_lists=True)


def extract_tags_from_attributes(attributes: Mapping[str, Any]) -> List[str]:
    """The tags :func:`make_tag_attributes` put in ``attributes`` ([] for none)."""
    tags = filter_and_unflatten_attributes(attributes, TAG)
    return [str(tag) for tag in tags] if isinstance(tags, list) else []


def make_link_attributes(links: Mapping[str, str]) -> Dict[str, Any]:
    """Span attributes that link a span to the spans whose attribute ``key`` equals ``value`` (``trace_id``
    and ``span_id`` match those fields)."""
    for key, value in links.items():
        if not isinstance(value, str):
            raise ValueError(f"link {key!r} must be a string, got {type(value).__name__} {value!r:.60}")
    return flatten_attributes(
        {LINK: [{KEY_MATCH: key, VALUE_MATCH: value} for key, value in links.items()]}, expand_leaf_lists=True
    )


def extract_links_from_attributes(attributes: Mapping[str, Any]) -> List[Dict[str, str]]:
    """The links :func:`make_link_attributes` put in ``attributes``, as ``{"key_match", "value_match"}``."""
    links = filter_and_unflatten_attributes(attributes, LINK)
    return [dict(link) for link in links] if isinstance(links, list) else []


def _field(link: Any, name: str) -> Any:
    return link.get(name) if isinstance(link, Mapping) else getattr(link, name)


def query_linked_spans(spans: Sequence[S], links: Sequence[Any]) -> List[S]:
    """The spans that match every link: ``trace_id`` and ``span_id`` against those fields, any other key
    against the span's attribute of that name."""

    def matches(span: Any, link: Any) -> bool:
        key, value = _field(link, KEY_MATCH), _field(link, VALUE_MATCH)
        if key in ("trace_id", "span_id"):
            return getattr(span, key, None) == value
        return (getattr(span, "attributes", None) or {}).get(key) == value

    return [span for span in spans if all(matches(span, link) for link in links)]


def get_tracer_provider(inspect: bool = True) -> Any:
    """The process's OpenTelemetry tracer provider (``inspect``: log what it is). agl's own tracer does not
    depend on it: agl records spans through its tracer (``agl.get_tracer()``) whatever is installed here."""
    provider = trace.get_tracer_provider()
    if inspect:
        logger.info("OpenTelemetry tracer provider: %s", type(provider).__name__)
    return provider


@dataclass
class PythonServerLauncherArgs:
    """Agent Lightning's server launch settings. agl's servers run in a thread of their process, so of these
    ``host`` and ``port`` are used (``LLMProxy(launcher_args=...)``); the others are kept and have no effect."""

    port: Optional[int] = None
    host: Optional[str] = None
    access_host: Optional[str] = None
    launch_mode: str = "asyncio"
    n_workers: int = 1
    healthcheck_url: Optional[str] = None
    log_level: int = logging.INFO
    access_log: bool = False
    startup_timeout: float = 60.0
    kill_unhealthy_server: bool = True
    thread_join_timeout: float = 10.0
    process_join_timeout: float = 10.0
    timeout_keep_alive: int = 30


__all__ = [
    "PythonServerLauncherArgs",
    "extract_links_from_attributes",
    "extract_tags_from_attributes",
    "filter_and_unflatten_attributes",
    "filter_attributes",
    "flatten_attributes",
    "get_tracer_provider",
    "make_link_attributes",
    "make_tag_attributes",
    "query_linked_spans",
    "unflatten_attributes",
]
