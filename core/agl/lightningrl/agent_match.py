"""Which agent made each LLM call, and ``agent_match``: the rule that picks the calls to train.

An ``llm`` span belongs to its nearest enclosing ``agent`` span; that agent's ``gen_ai.agent.name`` is
what ``agent_match`` is tested against, with ``re.search`` (anchor a pattern, ``"^write$"``, when one name
contains another). The runner's root span is an agent span named after the agent function or class, so
plain-Python agents match too. Which name each framework gives its agents is listed in
docs/integrations.md.

``agent_match`` takes three forms:

- ``None``: every llm call, all trained as one policy (``"default"``);
- a regular expression (string or compiled): the calls of matching agents, one policy (``"default"``);
- a mapping ``{regex: policy_name}``: several policies from one agent. The patterns are tried in the
  mapping's order and the **first** that matches names the call's policy; a call no pattern matches is
  not trained. Two patterns may name the same policy.

A call outside any agent span has no agent name; only ``agent_match=None`` selects it.
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional, Pattern, Sequence, Tuple, Union

from agl import semconv
from agl.types import Span, call_order_key

AgentMatch = Union[None, str, Pattern[str], Mapping[str, str]]

DEFAULT_POLICY = "default"


class PolicyMatcher:
    """A compiled ``agent_match``: ``policy_for(agent_name)`` is the call's policy, or None (not trained)."""

    def __init__(self, agent_match: AgentMatch = None) -> None:
        self.agent_match = agent_match
        self._rules: Optional[List[Tuple[Pattern[str], str]]]
        if agent_match is None:
            self._rules = None
        elif isinstance(agent_match, Mapping):
            if not agent_match:
                raise ValueError(
                    "agent_match is an empty mapping: give {regex: policy_name} pairs, or None for all calls"
                )
            self._rules = []
            for pattern, policy in agent_match.items():
                if not isinstance(policy, str) or not policy:
                    raise ValueError(
                        f"agent_match maps {pattern!r} to {policy!r}: policy names must be non-empty strings"
                    )
                self._rules.append((_compile(pattern), policy))
        else:
            self._rules = [(_compile(agent_match), DEFAULT_POLICY)]
        self._cache: Dict[Optional[str], Optional[str]] = {}

    @property
    def policies(self) -> List[str]:
        """The policy names this matcher can produce, in first-seen order."""
        if self._rules is None:
            return [DEFAULT_POLICY]
        return list(dict.fromkeys(policy for _, policy in self._rules))

    def policy_for(self, agent_name: Optional[str]) -> Optional[str]:
        """The policy of a call made by ``agent_name`` (None: a call outside any agent), or None to skip it."""
        try:
            return self._cache[agent_name]
        except KeyError:
            pass
        policy: Optional[str]
        if self._rules is None:
            policy = DEFAULT_POLICY
        elif agent_name is None:
            policy = None
        else:
            policy = next((p for pattern, p in self._rules if pattern.search(agent_name)), None)
        self._cache[agent_name] = policy
        return policy


def _compile(pattern: Union[str, Pattern[str]]) -> Pattern[str]:
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(
            f"agent_match must be None, a regex string or a {{regex: policy_name}} mapping, got "
            f"{type(pattern).__name__}"
        )
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"agent_match pattern {pattern!r} is not a valid regular expression: {exc}") from None


def agent_name_of(span: Span, by_id: Dict[str, Span]) -> Optional[str]:
    """Name of the nearest named agent span enclosing ``span`` (itself excluded), or None. An agent span
    without a name is passed over (as in LightningRL's ``TraceTree.enclosing_agent``)."""
    seen = set()
    parent_id = span.parent_id
    while parent_id is not None and parent_id in by_id and parent_id not in seen:
        seen.add(parent_id)
        parent = by_id[parent_id]
        name = parent.attributes.get(semconv.AGENT_NAME) if parent.kind == "agent" else None
        if name:
            return name
        parent_id = parent.parent_id
    return None


def select_llm_calls(spans: Sequence[Span], agent_match: AgentMatch = None) -> List[Span]:
    """The llm spans whose agent matches ``agent_match`` (all llm spans when it is None), in call order.

    Follows the recorded parent links as they are; LightningRL builds the repaired tree instead
    (``agl.lightningrl.tree``) and also tells which policy each call trains.
    """
    matcher = PolicyMatcher(agent_match)
    by_id = {s.span_id: s for s in spans}
    selected = [
        span for span in spans if span.kind == "llm" and matcher.policy_for(agent_name_of(span, by_id)) is not None
    ]
    return sorted(selected, key=lambda s: (s.attempt_id, call_order_key(s)))
