"""How ``agl train`` reads an algorithm's settings from its command line: ``--set KEY=VALUE`` (and ``--adapter``
for LightningRL), and which of the TorchGRPO flags were given (an error with the other algorithms)."""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, Mapping, Optional, Sequence

# TorchGRPO keywords that have their own flag (dest name == keyword)
GRPO_FLAGS = ("model", "steps", "group_size", "batch_tasks", "lr", "temperature", "max_tokens")


def adapter_settings(
    items: Sequence[str], agent_match: Optional[str], base: Optional[Mapping[str, Any]] = None
) -> Dict[str, Any]:
    """LightningRL settings as ``agl train`` and ``agl export`` take them: ``base`` (``--config``), then each
    ``--adapter KEY=VALUE``, then ``--agent-match``; checked by ``LightningRL.from_config``, a bad one exits
    with its name."""
    from agl.lightningrl import LightningRL

    settings = {**(base or {}), **keyword_sets(items, "--adapter")}
    if agent_match:
        settings["agent_match"] = agent_match
    if settings:
        try:
            LightningRL.from_config(settings)
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"agl: bad LightningRL settings: {exc} (see docs/lightningrl.md)") from None
    return settings


def keyword_sets(settings: Sequence[str], flag: str = "--set") -> Dict[str, Any]:
    """``--set key=value`` for TorchGRPO or APO (and ``--adapter`` for LightningRL): the value as JSON when it
    parses (numbers, null, lists), else text."""
    result: Dict[str, Any] = {}
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"agl: {flag} {item!r} must look like KEY=VALUE")
        try:
            result[key.strip()] = json.loads(raw)
        except ValueError:
            result[key.strip()] = raw
    return result


def grpo_flags_given(args: argparse.Namespace) -> Sequence[str]:
    """The TorchGRPO flags on the command line (``--minutes`` too), as the user typed them."""
    return [f"--{name.replace('_', '-')}" for name in (*GRPO_FLAGS, "minutes") if getattr(args, name) is not None]
