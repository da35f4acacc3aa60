"""Stored spans as another server would have left them, for tests of what LightningRL makes of them."""

from __future__ import annotations

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
