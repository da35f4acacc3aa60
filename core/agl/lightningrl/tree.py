"""The trace tree of one attempt: spans linked by parent, repaired where the recorded links are broken.

Spans reach the store out of order, sometimes twice, sometimes without their parent (a span lost with
a crashed exporter), with clocks that disagree by a little, and, from buggy instrumentation, even with
parent links that form a cycle. ``build_tree`` turns any such set into one tree in which every span
(after de-duplication) appears exactly once; llm spans in particular are never dropped, since they are
what LightningRL trains on. What was repaired is counted in ``TraceTree.repairs``.

Repairs, in order:

1. duplicates (same ``span_id``): the copy with the smallest ``sequence_id`` is kept;
2. cycles in parent links: each cycle is cut at its earliest span (by ``sequence_id``), which is then
   placed like an orphan;
3. orphans (``parent_id`` names no span of the attempt): re-parented by time containment, under the
   shortest span whose ``[start, end]`` contains the orphan's (within ``tolerance_ns`` of clock skew)
   and that is not the orphan itself or one of its descendants; with no such span, the orphan becomes a
   root.

The result does not depend on the order of the input. Cost: O(n log n) when every parent is present;
each orphan adds a backward scan over the spans that start before it, which stops once no earlier span
can be a shorter container: usually a few steps, O(orphans x candidates) in the worst case (e.g. a long
run of spans that do not contain the orphan between it and its container).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from agl import semconv
from agl.types import Span, call_order_key

DEFAULT_TOLERANCE_NS = 1_000_000  # 1 ms of clock skew between the spans of one attempt


#: Repair order (which duplicate is kept, where a cycle is cut): sequence id, then start time, then span id.
_order_key: Callable[[Span], Tuple[int, int, str]] = attrgetter("sequence_id", "start_time", "span_id")


@dataclass
class RepairReport:
    """How many repairs ``build_tree`` made. A cut cycle's span is counted in ``cycles_broken`` and then
    once more in ``reparented_by_time`` or ``attached_to_root``, like any orphan."""

    duplicates: int = 0
    reparented_by_time: int = 0
    attached_to_root: int = 0
    cycles_broken: int = 0

    @property
    def total(self) -> int:
        return self.duplicates + self.reparented_by_time + self.attached_to_root + self.cycles_broken

    def __str__(self) -> str:
        if not self.total:
            return "no repairs"
        parts = [
            (self.duplicates, "duplicate span(s) dropped"),
            (self.cycles_broken, "parent cycle(s) broken"),
            (self.reparented_by_time, "orphan(s) re-parented by time"),
            (self.attached_to_root, "orphan(s) attached to the root"),
        ]
        return ", ".join(f"{n} {what}" for n, what in parts if n)


@dataclass(eq=False, slots=True)
class TreeNode:
    """One span in the tree. ``parent_id`` is the parent in the tree, which differs from
    ``span.parent_id`` where the link was repaired."""

    span: Span
    parent_id: Optional[str] = None
    depth: int = 0
    children: List[TreeNode] = field(default_factory=list)

    @property
    def span_id(self) -> str:
        return self.span.span_id

    @property
    def repaired(self) -> bool:
        return self.parent_id != self.span.parent_id


class TraceTree:
    """The spans of one attempt as a tree; build it with ``build_tree``."""

    def __init__(self, nodes: Dict[str, TreeNode], roots: List[TreeNode], repairs: RepairReport):
        self._nodes = nodes
        self.roots = roots
        self.repairs = repairs
        self._walked = _depth_first(roots)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, span_id: object) -> bool:
        return span_id in self._nodes

    def node(self, span_id: str) -> TreeNode:
        """The node of ``span_id``; KeyError if the attempt has no such span."""
        return self._nodes[span_id]

    def span(self, span_id: str) -> Span:
        return self._nodes[span_id].span

    def children(self, span_id: str) -> List[Span]:
        """The children of ``span_id`` in call order."""
        return [c.span for c in self._nodes[span_id].children]

    def parent(self, span_id: str) -> Optional[Span]:
        """The parent of ``span_id`` in the (repaired) tree, or None for a root."""
        parent_id = self._nodes[span_id].parent_id
        return None if parent_id is None else self._nodes[parent_id].span

    def walk(self) -> Iterator[TreeNode]:
        """Every node once, depth-first, children in call order."""
        return iter(self._walked)

    def spans(self) -> List[Span]:
        """Every span in ``walk`` order."""
        return [n.span for n in self._walked]

    def llm_spans(self) -> List[Span]:
        """The llm spans in call order (by start time, then ``sequence_id``: :func:`call_order_key`)."""
        return sorted((n.span for n in self._nodes.values() if n.span.kind == "llm"), key=call_order_key)

    def enclosing_agent(self, span_id: str) -> Optional[Span]:
        """The nearest agent span with a name above ``span_id`` in the tree (itself excluded), or None.

        An agent span without ``gen_ai.agent.name`` (a hand-made or third-party one) is passed over, so that
        it does not hide the named agent around it from ``agent_match``."""
        parent_id = self._nodes[span_id].parent_id
        while parent_id is not None:
            node = self._nodes[parent_id]
            if node.span.kind == "agent" and node.span.attributes.get(semconv.AGENT_NAME):
                return node.span
            parent_id = node.parent_id
        return None


def build_tree(spans: Iterable[Span], *, tolerance_ns: int = DEFAULT_TOLERANCE_NS) -> TraceTree:
    """Build the repaired trace tree of the spans of one attempt (see the module docstring).

    Raises ValueError when the spans belong to more than one attempt.
    """
    ordered = sorted(spans, key=_order_key)
    attempts = sorted({(s.rollout_id, s.attempt_id) for s in ordered})
    if len(attempts) > 1:
        names = ", ".join(f"{rid}/{aid}" for rid, aid in attempts)
        raise ValueError(f"build_tree takes the spans of one attempt, got {len(attempts)}: {names}")
    repairs = RepairReport()
    by_id = _deduplicated(ordered, repairs)
    kept = list(by_id.values())  # still in call order
    parent, orphans = _known_parents(kept, by_id, repairs)
    orphans += _break_cycles(kept, by_id, parent, repairs)
    placed_later = set(orphans)
    children: Dict[Optional[str], List[str]] = {None: []}
    for s in kept:
        if s.span_id not in placed_later:
            children.setdefault(parent[s.span_id], []).append(s.span_id)
    touched = _reparent_by_time(orphans, kept, by_id, parent, children, tolerance_ns, repairs)
    return _assemble(by_id, parent, children, touched, repairs)


def _deduplicated(ordered: List[Span], repairs: RepairReport) -> Dict[str, Span]:
    """1. The spans by id, in call order: the first copy in call order wins."""
    by_id: Dict[str, Span] = {}
    for s in ordered:
        if s.span_id in by_id:
            repairs.duplicates += 1
        else:
            by_id[s.span_id] = s
    return by_id


def _known_parents(
    kept: List[Span], by_id: Dict[str, Span], repairs: RepairReport
) -> Tuple[Dict[str, Optional[str]], List[str]]:
    """Each span's parent where that parent is among the spans; the others (orphans) get None for now."""
    parent: Dict[str, Optional[str]] = {}
    orphans: List[str] = []
    for s in kept:
        if s.parent_id is None:
            parent[s.span_id] = None
        elif s.parent_id in by_id and s.parent_id != s.span_id:
            parent[s.span_id] = s.parent_id
        else:
            parent[s.span_id] = None
            if s.parent_id == s.span_id:  # a span that is its own parent: a cycle of one
                repairs.cycles_broken += 1
            orphans.append(s.span_id)
    return parent, orphans


def _break_cycles(
    kept: List[Span], by_id: Dict[str, Span], parent: Dict[str, Optional[str]], repairs: RepairReport
) -> List[str]:
    """2. Follow each chain of parents; a chain that runs into itself is a cycle, cut at its first span in call
    order (which becomes an orphan, returned)."""
    cut_loose: List[str] = []
    state: Dict[str, int] = {}  # 1 on the chain being followed, 2 done
    for s in kept:
        up = parent[s.span_id]
        if up is None or state.get(up) == 2:  # the usual case (parents come first): no chain to follow
            state[s.span_id] = 2
            continue
        chain: List[str] = []
        sid: Optional[str] = s.span_id
        while sid is not None and sid not in state:
            state[sid] = 1
            chain.append(sid)
            sid = parent[sid]
        if sid is not None and state[sid] == 1:  # the chain closed on itself at sid
            cycle = chain[chain.index(sid) :]
            cut = min(cycle, key=lambda i: _order_key(by_id[i]))
            parent[cut] = None
            cut_loose.append(cut)
            repairs.cycles_broken += 1
        for i in chain:
            state[i] = 2
    return cut_loose


def _reparent_by_time(
    orphans: List[str],
    kept: List[Span],
    by_id: Dict[str, Span],
    parent: Dict[str, Optional[str]],
    children: Dict[Optional[str], List[str]],
    tolerance_ns: int,
    repairs: RepairReport,
) -> Set[Optional[str]]:
    """3. Re-parent orphans by time containment (orphans in call order, so the result is order-free). Returns
    the parents whose children lists got orphans appended and need sorting again."""
    touched: Set[Optional[str]] = {None}
    if not orphans:
        return touched
    by_start = sorted(kept, key=lambda s: (s.start_time, s.span_id))
    starts = [s.start_time for s in by_start]
    for oid in sorted(orphans, key=lambda i: _order_key(by_id[i])):
        o = by_id[oid]
        own = _subtree(oid, children)
        best: Optional[Span] = None
        # Candidates start at most tolerance_ns after the orphan; scan those, latest start first, and
        # stop once an earlier start could only make a longer container than the best one found.
        for j in range(bisect.bisect_right(starts, o.start_time + tolerance_ns) - 1, -1, -1):
            c = by_start[j]
            if best is not None and o.end_time - tolerance_ns - c.start_time > _length(best):
                break
            if c.span_id in own or c.end_time + tolerance_ns < o.end_time:
                continue
            if best is None or _container_key(c) < _container_key(best):
                best = c
        if best is None:
            repairs.attached_to_root += 1
            children[None].append(oid)
        else:
            repairs.reparented_by_time += 1
            parent[oid] = best.span_id
            children.setdefault(best.span_id, []).append(oid)
            touched.add(best.span_id)
    return touched


def _assemble(
    by_id: Dict[str, Span],
    parent: Dict[str, Optional[str]],
    children: Dict[Optional[str], List[str]],
    touched: Set[Optional[str]],
    repairs: RepairReport,
) -> TraceTree:
    """4. Nodes, children in call order (built from the kept spans, so only lists with orphans need a sort)."""
    nodes = {sid: TreeNode(s, parent[sid]) for sid, s in by_id.items()}
    rank: Dict[str, int] = {}
    for pid, kids in children.items():
        if pid in touched and len(kids) > 1:
            rank = rank or {sid: i for i, sid in enumerate(by_id)}
            kids.sort(key=rank.__getitem__)
        if pid is not None:
            nodes[pid].children = [nodes[k] for k in kids]
    return TraceTree(nodes, [nodes[k] for k in children[None]], repairs)


def _depth_first(roots: List[TreeNode]) -> List[TreeNode]:
    """Every node once, depth-first, children in call order, each node's depth set on the way (iterative:
    deep trees are fine). Computed once per tree: LightningRL walks each tree several times."""
    order: List[TreeNode] = []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        order.append(node)
        depth = node.depth + 1
        for child in node.children:
            child.depth = depth
        stack.extend(reversed(node.children))
    return order


def _length(span: Span) -> int:
    return span.end_time - span.start_time


def _container_key(span: Span) -> Tuple[int, int, int, str]:
    """Shortest first; among equal lengths the later-sequenced one (likely the inner one)."""
    return (_length(span), -span.sequence_id, -span.start_time, span.span_id)


def _subtree(root: str, children: Dict[Optional[str], List[str]]) -> set:
    out = {root}
    stack = [root]
    while stack:
        for k in children.get(stack.pop(), ()):
            if k not in out:
                out.add(k)
                stack.append(k)
    return out
