"""Helpers for tests of stored spans: spans as another server would have left them, and the credit a reward
emitted in a framework's tool must get (every adapter's suite checks the same contract)."""

from __future__ import annotations

import base64
import random
from typing import Any, List, Sequence, Tuple

from agl import semconv
from agl.types import Rollout, Span

_IDS = (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS)


def without_token_ids(store: Any, rollouts: Sequence[Rollout]) -> List[Tuple[Rollout, List[Span]]]:
    """Each rollout with its latest attempt's spans, token ids removed and the llm spans' source ``absent``,
    as from a server that returns no ids: input for ``LightningRL(tokenizer=...).batch_from_spans``."""
    stripped = []
    for rollout in rollouts:
        spans = []
        for span in store.query_spans(rollout.rollout_id):
            attributes = {k: v for k, v in span.attributes.items() if k not in _IDS}
            if span.kind == "llm":
                attributes[semconv.TOKEN_IDS_SOURCE] = "absent"
            spans.append(span.model_copy(update={"attributes": attributes}))
        stripped.append((rollout, spans))
    return stripped


def assert_tool_reward_credited(spans: Sequence[Span], value: float) -> None:
    """The reward ``value`` emitted inside the rollout's one tool is a step reward under that tool's span,
    credited to the first LLM call (the call that asked for the tool) alone."""
    from agl.lightningrl.links import CallLinks
    from agl.lightningrl.tree import build_tree

    (tool,) = [s for s in spans if s.kind == "tool"]
    (reward,) = [s for s in spans if s.kind == "reward" and s.attributes.get(semconv.REWARD_SOURCE) == "emitted"]
    assert reward.parent_id == tool.span_id, "the reward is not under the tool's span"
    assert reward.attributes[semconv.REWARD_SCOPE] == "step", reward.attributes[semconv.REWARD_SCOPE]
    first_call = min((s for s in spans if s.kind == "llm"), key=lambda s: s.sequence_id)
    step = CallLinks(build_tree(spans)).step_rewards()
    assert step.by_call == {first_call.span_id: {"primary": value}} and step.unattributed == 0, step


def incompressible_text(n_bytes: int, seed: int = 0) -> str:
    """Text whose stored size is about ``n_bytes`` however it is compressed (random bytes as base64): for tests
    about large rows and bodies, which spans' compression would otherwise shrink to nothing."""
    return base64.b64encode(random.Random(seed).randbytes(n_bytes)).decode()
