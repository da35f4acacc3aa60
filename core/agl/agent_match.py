"""Which agent made each LLM call, and ``agent_match``: the rule that picks the calls to train.

An ``llm`` span belongs to its nearest enclosing ``agent`` span; that agent's ``gen_ai.agent.name`` is
what ``agent_match`` (a regular expression, applied with ``re.search``) is tested against. The runner's
root span is an agent span named after the agent function or class, so plain-Python agents match too.
Which name each framework gives its agents is listed in docs/integrations.md.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Pattern, Sequence, Union

from agl import semconv
from agl.types import Span

AgentMatch = Union[str, Pattern[str], None]


def agent_name_of(span: Span, by_id: Dict[str, Span]) -> Optional[str]:
    """Name of the nearest agent span enclosing ``span`` (itself excluded), or None."""
    seen = set()
    parent_id = span.parent_id
    while parent_id is not None and parent_id in by_id and parent_id not in seen:
        seen.add(parent_id)
        parent = by_id[parent_id]
        if parent.kind == "agent":
            return parent.attributes.get(semconv.AGENT_NAME)
        parent_id = parent.parent_id
    return None


def select_llm_calls(spans: Sequence[Span], agent_match: AgentMatch = None) -> List[Span]:
    """The llm spans whose agent matches ``agent_match`` (all llm spans when it is None), in call order."""
    pattern = re.compile(agent_match) if isinstance(agent_match, str) else agent_match
    by_id = {s.span_id: s for s in spans}
    selected = []
    for span in spans:
        if span.kind != "llm":
            continue
        if pattern is not None:
            name = agent_name_of(span, by_id)
            if name is None or not pattern.search(name):
                continue
        selected.append(span)
    return sorted(selected, key=lambda s: (s.attempt_id, s.sequence_id))
