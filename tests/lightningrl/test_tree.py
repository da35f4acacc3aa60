"""build_tree: hand-written repair cases and hypothesis properties over damaged random span trees."""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl.lightningrl.tree import RepairReport, TraceTree, build_tree
from agl.types import Span

MS = 1_000_000
KINDS = ["agent", "llm", "tool", "chain", "reward", "annotation"]


def mk(sid: str, parent: Optional[str], start: int, end: int, seq: int, kind: str = "chain", **kw) -> Span:
    fields = dict(rollout_id="ro-1", attempt_id="at-1", trace_id="tr-1", name=f"{kind}:{sid}")
    fields.update(kw)
    return Span(
        sequence_id=seq, span_id=sid, parent_id=parent, kind=kind, start_time=start * MS, end_time=end * MS, **fields
    )


def shape(tree: TraceTree) -> List[Tuple[int, str, Optional[str]]]:
    return [(n.depth, n.span_id, n.parent_id) for n in tree.walk()]


def check_invariants(tree: TraceTree, expected_ids: set) -> None:
    walked = [n.span_id for n in tree.walk()]
    assert len(walked) == len(set(walked)) == len(tree)
    assert set(walked) == expected_ids
    for n in tree.walk():
        if n.parent_id is None:
            assert n in tree.roots and n.depth == 0
        else:
            assert n.parent_id in tree
            assert n in tree.node(n.parent_id).children
            assert n.depth == tree.node(n.parent_id).depth + 1


# ---------------------------------------------------------------------------------------------------------
# Hand-written cases
# ---------------------------------------------------------------------------------------------------------


def sample_spans() -> List[Span]:
    return [
        mk("root", None, 0, 100, 0, "agent", attributes={"gen_ai.agent.name": "main"}),
        mk("sub", "root", 10, 60, 1, "agent", attributes={"gen_ai.agent.name": "sub"}),
        mk("llm1", "sub", 20, 30, 2, "llm"),
        mk("tool1", "sub", 35, 50, 3, "tool"),
        mk("llm2", "root", 70, 80, 4, "llm"),
        mk("rw", "root", 90, 95, 5, "reward"),
    ]


def test_clean_tree_and_accessors():
    tree = build_tree(sample_spans())
    assert [n.span_id for n in tree.roots] == ["root"]
    assert shape(tree) == [
        (0, "root", None),
        (1, "sub", "root"),
        (2, "llm1", "sub"),
        (2, "tool1", "sub"),
        (1, "llm2", "root"),
        (1, "rw", "root"),
    ]
    assert [s.span_id for s in tree.children("root")] == ["sub", "llm2", "rw"]
    assert tree.parent("llm1").span_id == "sub"
    assert tree.parent("root") is None
    assert [s.span_id for s in tree.llm_spans()] == ["llm1", "llm2"]
    assert tree.repairs == RepairReport() and str(tree.repairs) == "no repairs"
    assert not any(n.repaired for n in tree.walk())


def test_enclosing_agent():
    tree = build_tree(sample_spans())
    assert tree.enclosing_agent("llm1").span_id == "sub"
    assert tree.enclosing_agent("llm2").span_id == "root"
    assert tree.enclosing_agent("sub").span_id == "root"  # itself excluded
    assert tree.enclosing_agent("root") is None


def test_out_of_order_input_gives_same_tree():
    spans = sample_spans()
    expected = shape(build_tree(spans))
    rng = random.Random(0)
    for _ in range(10):
        rng.shuffle(spans)
        assert shape(build_tree(spans)) == expected


def test_duplicates_keep_first_by_sequence_id():
    spans = sample_spans()
    late_copy = spans[2].model_copy(update={"sequence_id": 9, "name": "late"})
    tree = build_tree([late_copy, *spans, spans[3]])
    assert tree.repairs.duplicates == 2
    assert tree.node("llm1").span.name == "llm:llm1"
    assert len(tree) == len(spans)
    assert "2 duplicate span(s) dropped" in str(tree.repairs)


def test_missing_parent_reparented_by_time_containment():
    spans = [s for s in sample_spans() if s.span_id != "sub"]  # llm1 and tool1 lose their parent
    tree = build_tree(spans)
    assert tree.parent("llm1").span_id == "root"
    assert tree.parent("tool1").span_id == "root"
    assert tree.repairs.reparented_by_time == 2
    assert tree.node("llm1").repaired
    assert [s.span_id for s in tree.children("root")] == ["llm1", "tool1", "llm2", "rw"]
    assert tree.enclosing_agent("llm1").span_id == "root"


def test_orphan_goes_under_smallest_container_and_tolerates_skew():
    spans = sample_spans() + [mk("lost", "gone", 21, 29, 6, "llm")]
    tree = build_tree(spans)
    assert tree.parent("lost").span_id == "llm1"  # smallest span containing [21, 29]
    # Starts 0.5 ms before tool1 (clock skew): still inside tool1 with the default 1 ms tolerance ...
    skewed = mk("skewed", "gone", 35, 40, 7, "llm").model_copy(update={"start_time": 35 * MS - MS // 2})
    tree = build_tree(sample_spans() + [skewed])
    assert tree.parent("skewed").span_id == "tool1"
    # ... but not with no tolerance: then the next container out is sub.
    assert build_tree(sample_spans() + [skewed], tolerance_ns=0).parent("skewed").span_id == "sub"


def test_orphan_with_no_container_attached_to_root():
    spans = sample_spans() + [mk("late", "gone", 200, 210, 6, "llm")]
    tree = build_tree(spans)
    assert tree.parent("late") is None
    assert [n.span_id for n in tree.roots] == ["root", "late"]
    assert tree.repairs.attached_to_root == 1
    assert "1 orphan(s) attached to the root" in str(tree.repairs)


def test_orphan_never_placed_under_its_own_descendant():
    # The orphan's child has the same interval, so it "contains" the orphan; it must not become its parent.
    spans = [
        mk("a", None, 0, 100, 0, "agent"),
        mk("o", "gone", 10, 20, 1, "chain"),
        mk("c", "o", 10, 20, 2, "llm"),
    ]
    tree = build_tree(spans)
    assert tree.parent("o").span_id == "a"
    assert tree.parent("c").span_id == "o"


def test_cycles_are_broken():
    spans = [
        mk("root", None, 0, 100, 0, "agent"),
        mk("x", "z", 10, 50, 1, "chain"),
        mk("y", "x", 20, 40, 2, "chain"),
        mk("z", "y", 25, 30, 3, "llm"),
        mk("self", "self", 60, 70, 4, "llm"),
    ]
    tree = build_tree(spans)
    check_invariants(tree, {s.span_id for s in spans})
    assert tree.repairs.cycles_broken == 2
    assert tree.parent("x").span_id == "root"  # cut at the earliest span, which is placed by time
    assert tree.parent("y").span_id == "x" and tree.parent("z").span_id == "y"
    assert tree.parent("self").span_id == "root"
    assert tree.repairs.reparented_by_time == 2
    assert "2 parent cycle(s) broken" in str(tree.repairs)


def test_mixed_attempts_raise_with_ids():
    spans = sample_spans()
    spans.append(mk("other", None, 0, 1, 0, attempt_id="at-2"))
    with pytest.raises(ValueError, match="ro-1/at-1.*ro-1/at-2"):
        build_tree(spans)


def test_empty_input():
    tree = build_tree([])
    assert tree.roots == [] and list(tree.walk()) == [] and tree.llm_spans() == []


# ---------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------

GAP = 10 * MS  # every start/end is at least this far from the next one; skew stays well below tolerance


@st.composite
def span_trees(draw) -> List[Span]:
    """A well-formed tree: random shape and kinds, nested intervals, sequence ids in start order."""
    n = draw(st.integers(1, 40))
    parents: List[Optional[int]] = [None]
    for i in range(1, n):
        # Mostly one root, sometimes several; bias towards recent nodes for depth.
        if draw(st.integers(0, 9)) == 0:
            parents.append(None)
        else:
            parents.append(draw(st.integers(max(0, i - 6), i - 1)))
    kids: Dict[Optional[int], List[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    kinds = [draw(st.sampled_from(KINDS)) for _ in range(n)]
    gaps = draw(st.lists(st.integers(1, 5), min_size=2 * n, max_size=2 * n))
    start: Dict[int, int] = {}
    end: Dict[int, int] = {}
    t = 0
    # Bracket order: open, children, close (children are opened in index order, i.e. call order).
    stack: List[Tuple[int, bool]] = [(r, False) for r in reversed(kids[None])]
    k = 0
    while stack:
        i, closing = stack.pop()
        t += gaps[k] * GAP
        k += 1
        if closing:
            end[i] = t
        else:
            start[i] = t
            stack.append((i, True))
            stack.extend((c, False) for c in reversed(kids.get(i, [])))
    by_start = sorted(range(n), key=lambda i: start[i])
    seq = {i: rank for rank, i in enumerate(by_start)}
    return [
        Span(
            rollout_id="ro-1",
            attempt_id="at-1",
            trace_id="tr-1",
            sequence_id=seq[i],
            span_id=f"s{i}",
            parent_id=None if parents[i] is None else f"s{parents[i]}",
            name=kinds[i],
            kind=kinds[i],
            start_time=start[i],
            end_time=end[i],
        )
        for i in range(n)
    ]


def nearest_surviving_ancestor(span: Span, by_id: Dict[str, Span], alive: set) -> Optional[str]:
    pid = span.parent_id
    while pid is not None and pid not in alive:
        pid = by_id[pid].parent_id
    return pid


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spans=span_trees(), data=st.data())
def test_damaged_trees_are_repaired(spans: List[Span], data):
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    by_id = {s.span_id: s for s in spans}
    delete = data.draw(st.booleans())
    # Delete some non-llm spans (their children become orphans).
    deleted = {s.span_id for s in spans if delete and s.kind != "llm" and rng.random() < 0.3}
    alive = {s.span_id for s in spans} - deleted
    # Skew each span's clock by up to 0.4 ms either way (both ends, as a skewed clock would).
    damaged = []
    for s in spans:
        if s.span_id in deleted:
            continue
        skew = rng.randint(-4, 4) * MS // 10
        damaged.append(s.model_copy(update={"start_time": s.start_time + skew, "end_time": s.end_time + skew}))
    # Duplicate some, then shuffle.
    damaged += [s for s in damaged if rng.random() < 0.2]
    rng.shuffle(damaged)

    tree = build_tree(damaged)
    check_invariants(tree, alive)
    assert tree.repairs.duplicates == len(damaged) - len(alive)
    assert tree.repairs.cycles_broken == 0
    llm_ids = [s.span_id for s in sorted(spans, key=lambda s: s.sequence_id) if s.kind == "llm"]
    assert [s.span_id for s in tree.llm_spans()] == llm_ids  # every llm span kept, in call order

    # Each span hangs under its nearest surviving ancestor (orphans found it by time containment).
    for sid in alive:
        assert tree.node(sid).parent_id == nearest_surviving_ancestor(by_id[sid], by_id, alive)
    if not deleted:  # nothing lost: exactly the original structure, nothing repaired but duplicates
        assert all(tree.node(s.span_id).parent_id == s.parent_id for s in spans)
        assert tree.repairs.reparented_by_time == tree.repairs.attached_to_root == 0

    # Independent of input order.
    rng.shuffle(damaged)
    assert shape(build_tree(damaged)) == shape(tree)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_arbitrary_parent_links_never_lose_a_span(data):
    """Garbage links (cycles, self-loops, missing ids) and random intervals: still one tree of all spans."""
    n = data.draw(st.integers(1, 30))
    ids = [f"s{i}" for i in range(n)]
    spans = []
    for i in range(n):
        parent = data.draw(st.one_of(st.none(), st.sampled_from(ids), st.just("missing")))
        start = data.draw(st.integers(0, 50)) * MS
        end = start + data.draw(st.integers(0, 50)) * MS
        kind = data.draw(st.sampled_from(KINDS))
        spans.append(
            mk(ids[i], parent, 0, 0, data.draw(st.integers(0, 5)), kind).model_copy(
                update={"start_time": start, "end_time": end}
            )
        )
    tree = build_tree(spans)
    check_invariants(tree, set(ids))
    assert len(tree.llm_spans()) == sum(s.kind == "llm" for s in spans)
    for s in spans:  # only broken links are changed: missing parents and links cut out of a cycle
        if tree.node(s.span_id).repaired:
            assert s.parent_id is not None
            assert s.parent_id == "missing" or tree.repairs.cycles_broken > 0
    shuffled = list(spans)
    random.Random(data.draw(st.integers(0, 1000))).shuffle(shuffled)
    assert shape(build_tree(shuffled)) == shape(tree)
