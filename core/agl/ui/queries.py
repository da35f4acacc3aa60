"""What the pages read from a store, through the store's own query API only (any backend: SQLite,
PostgreSQL, the HTTP client): a page of rollouts, one rollout with its attempts and spans, and which of its
LLM calls an ``agent_match`` turns into training samples (LightningRL's own selection, not a copy of it), with
their advantages (:mod:`agl.ui.advantages`)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

from agl.errors import AglError
from agl.lightningrl import LightningRL
from agl.lightningrl.tree import TreeNode, build_tree
from agl.lightningrl.types import Transition
from agl.store.base import LightningStore
from agl.types import Attempt, Rollout, Span
from agl.ui.advantages import Advantages, group_advantages

STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"]
MODES = ["train", "val", "dev"]
PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


class Counts:
    """The store's rollouts per status, at most ``ttl`` seconds old: ``stats()`` counts every row (70-170 ms
    on a store of 100k rollouts), and each load of the list and training pages needs the total."""

    def __init__(self, ttl: float = 5.0) -> None:
        self.ttl = ttl
        self._counts: Dict[str, int] = {}
        self._at = -math.inf
        self._lock = threading.Lock()

    def of(self, store: LightningStore) -> Dict[str, int]:
        with self._lock:
            if time.monotonic() - self._at > self.ttl:
                self._counts, self._at = store.stats().rollouts, time.monotonic()
            return self._counts


@dataclass
class RolloutPage:
    """One page of the rollouts list. ``total`` is None with a mode filter: the store counts by status only."""

    rollouts: List[Rollout]
    offset: int
    limit: int
    has_next: bool
    total: Optional[int]
    versions: Dict[str, int]  # resources id -> its version (the policy version a rollout ran with)


class ResourceVersions:
    """Resources ids -> versions, remembered (a version never changes), so each page asks only for new ids."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._known: Dict[str, int] = {}
        self._lock = threading.Lock()

    def of(self, store: LightningStore, ids: Iterable[Optional[str]]) -> Dict[str, int]:
        wanted = {i for i in ids if i}
        with self._lock:
            missing = wanted - self._known.keys()
        found: Dict[str, int] = {}
        for resources_id in missing:
            try:
                update = store.get_resources(resources_id)
            except AglError:  # deleted, or never stored: the rollout shows no version
                continue
            if update is not None:
                found[resources_id] = update.version
        with self._lock:
            if len(self._known) + len(found) > self.LIMIT:
                self._known.clear()
            self._known.update(found)
            return {i: self._known[i] for i in wanted if i in self._known}


def rollout_page(
    store: LightningStore,
    versions: ResourceVersions,
    counts: Counts,
    *,
    status: Optional[str],
    mode: Optional[str],
    offset: int,
    limit: int,
) -> RolloutPage:
    """Rollouts ``offset`` to ``offset + limit`` in enqueue order: LIMIT/OFFSET through ``query_rollouts``, one
    more row than shown to know whether a next page exists."""
    statuses = [status] if status else None
    rows = store.query_rollouts(status=statuses, mode=mode, limit=limit + 1, offset=offset)  # type: ignore[arg-type]  # checked against STATUSES/MODES by the route
    total = None
    if mode is None:
        by_status = counts.of(store)
        total = sum(by_status.get(s, 0) for s in (statuses or STATUSES))
    shown = rows[:limit]
    return RolloutPage(
        rollouts=shown,
        offset=offset,
        limit=limit,
        has_next=len(rows) > limit,
        total=total,
        versions=versions.of(store, (r.resources_id for r in shown)),
    )


@dataclass
class Selection:
    """Which llm spans of one attempt become samples under ``agent_match``, and why the others do not."""

    agent_match: Optional[str]
    samples: Dict[str, Transition] = field(default_factory=dict)  # span id -> its transition
    llm_calls: int = 0
    left_out: Dict[str, int] = field(default_factory=dict)  # reason -> calls
    error: Optional[str] = None  # a bad pattern, or why LightningRL refuses this attempt
    advantages: Advantages = field(default_factory=Advantages)  # of the samples, in their group's batch


@dataclass
class RolloutDetail:
    rollout: Rollout
    attempts: List[Attempt]
    attempt_id: Optional[str]  # the attempt shown (None: never dequeued)
    tree: List[TreeNode]  # depth-first, children in call order, as LightningRL repairs the tree
    selection: Selection
    versions: Dict[str, int]


def rollout_detail(
    store: LightningStore,
    versions: ResourceVersions,
    rollout_id: str,
    attempt_id: Optional[str],
    agent_match: Optional[str],
) -> RolloutDetail:
    """One rollout: its attempts, the spans of ``attempt_id`` (default: the latest) as a tree, and the samples
    ``agent_match`` selects there with their advantages. Unknown ids raise the store's Unknown*Error (a 404 page)."""
    rollout = store.get_rollout(rollout_id)
    attempts = store.query_attempts(rollout_id)
    shown = attempt_id or (attempts[-1].attempt_id if attempts else None)
    spans = store.query_spans(rollout_id, shown) if shown else []
    nodes = list(build_tree(spans).walk()) if spans else []
    selection = select_samples(rollout, spans, agent_match)
    if selection.samples:
        adapter = LightningRL(agent_match=selection.agent_match)
        selection.advantages = group_advantages(store, rollout, shown, attempts[-1].attempt_id, adapter)
    return RolloutDetail(
        rollout=rollout,
        attempts=attempts,
        attempt_id=shown,
        tree=nodes,
        selection=selection,
        versions=versions.of(store, [rollout.resources_id]),
    )


def select_samples(rollout: Rollout, spans: Sequence[Span], agent_match: Optional[str]) -> Selection:
    """LightningRL's transitions of this attempt (``attempt_transitions``: the repaired tree, ``agent_match``,
    the calls it skips), with the rollout's reward as the episode reward (0 when it has none)."""
    selection = Selection(agent_match=agent_match or None)
    if not spans:
        return selection
    try:
        adapter = LightningRL(agent_match=selection.agent_match)
        extraction, _, _ = adapter.attempt_transitions(rollout, spans, rollout.final_reward or 0.0)
    except (ValueError, AglError) as exc:  # a bad regex, or a call without token ids LightningRL refuses
        selection.error = str(exc)
        return selection
    selection.samples = {t.span_id: t for t in extraction.transitions}
    selection.llm_calls = extraction.llm_spans
    if extraction.filtered_by_agent:
        agents = ", ".join(f"{name} ({n})" for name, n in sorted(extraction.filtered_agents.items()))
        selection.left_out[f"agent_match leaves out their agent: {agents}"] = extraction.filtered_by_agent
    if extraction.filtered_by_call:
        selection.left_out["llm_call_match leaves them out"] = extraction.filtered_by_call
    for reason, n in sorted(extraction.skipped.items()):
        selection.left_out[f"skipped: {reason}"] = n
    return selection
