"""Token ids the prompts of one trajectory share, stored once.

Why: turn k+1 of a multi-turn agent sends the whole conversation again, so its prompt ids begin with turn k's
prompt and response. Stored in full, a 10-turn rollout whose context grows to 4k tokens keeps ~22k prompt ids;
stored once, ~4k. Each store instance remembers, per attempt it is writing, the last LLM span's ids
(:class:`PrefixCache`); a new span whose prompt begins with at least ``MIN_SHARED`` of them stores a reference
to that span and the rest (:func:`agl.store.span_codec.encode_attributes`). Reads put the ids back
(:func:`spans_with_prefixes`): a store reads an attempt's spans together, and the span referred to is one of
them. The cache learns a span only once its batch is committed, so a reference never names a span that was
not stored.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agl import semconv
from agl.store.span_codec import PrefixRef
from agl.store.sqlite.schema import Row, span_from_row, storable_row
from agl.types import Span

logger = logging.getLogger("agl.store")

#: Fewer shared ids than this are stored in full (a reference costs ~30 bytes).
MIN_SHARED = 32
#: Attempts remembered per store instance, the least recently written forgotten first. Each keeps a copy of its
#: last call's ids (~36 bytes an id as Python ints: ~150 KB at a 4k context), so this bounds it at ~150 MB.
MAX_ATTEMPTS = 1024
_PROMPT, _RESPONSE = semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS
Key = Tuple[str, str]  # (rollout_id, attempt_id)
Last = Tuple[str, List[int]]  # (span id, its prompt ids followed by its response ids)


def shared_length(ids: List[int], earlier: List[int]) -> int:
    """How many ids at the start of ``ids`` equal ``earlier``'s (list comparisons run in C: a binary search
    over slices costs ~20 us for 4k ids, where a Python loop costs ~150)."""
    n = min(len(ids), len(earlier))
    if ids[:n] == earlier[:n]:
        return n
    low, high = 0, n - 1  # ids[:low] is shared, ids[:high + 1] is not
    while low < high:
        middle = (low + high + 1) // 2
        if ids[:middle] == earlier[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _token_ids(span: Span, key: str) -> Optional[List[int]]:
    value = span.attributes.get(key)
    return value if type(value) is list and value and type(value[0]) is int else None


class PrefixCache:
    """The last LLM span's ids of each attempt a store instance writes (thread-safe)."""

    def __init__(self) -> None:
        self._last: OrderedDict[Key, Last] = OrderedDict()
        self._lock = threading.Lock()

    def rows(self, spans: Sequence[Any]) -> Tuple[List[Row], Dict[Key, Last]]:
        """The rows to store for ``spans`` (prompts that begin with an earlier span's ids as references), and what
        to :meth:`learn` once they are committed. Raises InvalidSpanError as ``storable_row`` does."""
        rows: List[Row] = []
        learnt: Dict[Key, Last] = {}
        for span in spans:
            prompt = _token_ids(span, _PROMPT) if isinstance(span, Span) else None
            if prompt is None:
                rows.append(storable_row(span))
                continue
            key = (span.rollout_id, span.attempt_id)
            with self._lock:
                last = learnt.get(key) or self._last.get(key)
            prefix = None
            if last is not None and prompt[:MIN_SHARED] == last[1][:MIN_SHARED]:  # most unrelated prompts end here
                prefix = (last[0], shared_length(prompt, last[1]))
            rows.append(storable_row(span, prefix))
            learnt[key] = (span.span_id, prompt + (_token_ids(span, _RESPONSE) or []))
        return rows, learnt

    def learn(self, learnt: Dict[Key, Last]) -> None:
        """Remember spans of a committed batch."""
        if not learnt:
            return
        with self._lock:
            for key, last in learnt.items():
                self._last[key] = last
                self._last.move_to_end(key)
            while len(self._last) > MAX_ATTEMPTS:
                self._last.popitem(last=False)

    def forget(self, rollout_ids: Sequence[str]) -> None:
        """Forget the attempts of rollouts whose spans were deleted: nothing may refer to those spans again."""
        gone = set(rollout_ids)
        with self._lock:
            for key in [key for key in self._last if key[0] in gone]:
                del self._last[key]


class SharedPrefixes:
    """What a store backend mixes in: its :class:`PrefixCache`, made on first use (a second one made by a race
    only loses what it learnt: later prompts are then stored in full)."""

    @functools.cached_property
    def _prefixes(self) -> PrefixCache:
        return PrefixCache()


def spans_with_prefixes(rows: Sequence[Row]) -> List[Span]:
    """Spans from rows a store read together (an attempt's, or a rollout's attempts), shared ids put back."""
    refs: List[PrefixRef] = []
    spans = [span_from_row(row, refs) for row in rows]
    if refs:
        _resolve(spans, refs)
    return spans


def _resolve(spans: List[Span], refs: List[PrefixRef]) -> None:
    """Prepend to each referring prompt the ids it shares, following chains (turn 3 refers to turn 2, which
    refers to turn 1) from their far end, without recursion."""
    owner = {id(span.attributes): span for span in spans}
    by_id = {(span.attempt_id, span.span_id): span.attributes for span in spans}
    waiting = {id(ref.attributes): ref for ref in refs}
    for ref in refs:
        chain: List[PrefixRef] = []
        attributes = ref.attributes
        while id(attributes) in waiting:  # follow the chain to a span that is whole (or gone)
            link = waiting.pop(id(attributes))
            chain.append(link)
            earlier = by_id.get((owner[id(attributes)].attempt_id, link.span_id))
            if earlier is None:
                break
            attributes = earlier
        for link in reversed(chain):
            earlier = by_id.get((owner[id(link.attributes)].attempt_id, link.span_id))
            if earlier is None:  # deleted while a writer still remembered it: say so rather than guess
                link.attributes[semconv.PROMPT_PREFIX_MISSING] = link.shared
                logger.warning(
                    "span %s: its first %d prompt ids were stored as span %s's, which is gone; they are missing",
                    owner[id(link.attributes)].span_id,
                    link.shared,
                    link.span_id,
                )
                continue
            before = (earlier.get(_PROMPT) or []) + (earlier.get(_RESPONSE) or [])
            link.attributes[_PROMPT] = before[: link.shared] + link.attributes[_PROMPT]
