"""LightningRL's batch from a real SQLite store, field by field against the formulas computed the plain way.

The fast paths of the tree, links, AIR, credit and advantages (see benchmarks/lightningrl_store.py) must not
change a single sample: this builds a fixed-seed batch of multi-agent rollouts with real-sized token ids and
recomputes every sample straight from the spans (each call's step reward found by its operation's id, the
discounted return, GRPO over the rollouts of each task) without the tree or the links. Also: what the batch
leaves to the garbage collector.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
from typing import Dict, List, Tuple

from agl import semconv
from agl.lightningrl import LightningRL, Sample
from agl.lightningrl.synthetic import TokenShape, synthetic_rollouts
from agl.store import EnqueueRequest, SqliteLightningStore
from agl.types import Rollout, Span, call_order_key

GAMMA = 0.95
TOOL_OK = 0.1
TOOL_ERROR = -0.1  # AIRConfig's default
CONFIG = {"credit": "discounted", "gamma": GAMMA, "air": {"tool_ok": TOOL_OK}}


def stored_rollouts(path: str, n_spans: int) -> Tuple[SqliteLightningStore, List[Rollout]]:
    """Synthetic rollouts written to a SQLite store as a runner writes them; returns the finished rollouts."""
    store = SqliteLightningStore(path)
    pairs = list(
        synthetic_rollouts(n_spans, spans_per_rollout=40, rollouts_per_task=3, seed=7, tokens=TokenShape(60, 20))
    )
    store.enqueue_many([EnqueueRequest(rollout_id=r.rollout_id, task_id=r.task_id) for r, _ in pairs])
    attempts = {r.rollout_id: r.attempt.attempt_id for r in store.dequeue_many("test", len(pairs))}  # type: ignore[union-attr]
    store.add_spans([s.model_copy(update={"attempt_id": attempts[r.rollout_id]}) for r, spans in pairs for s in spans])
    for r, _ in pairs:
        store.complete_attempt(r.rollout_id, attempts[r.rollout_id], "succeeded", reward=r.final_reward)
    return store, store.query_rollouts(status=["succeeded"])


def plain_samples(rollout: Rollout, spans: List[Span]) -> List[Sample]:
    """One rollout's samples from the formulas of docs/lightningrl.md, before advantages."""
    calls = sorted((s for s in spans if s.kind == "llm"), key=call_order_key)
    by_operation = {c.attributes[semconv.OPERATION_SPAN_ID]: c.span_id for c in calls}
    caller_of_call_id = {json_call_id(c): c.span_id for c in calls}
    step: Dict[str, List[float]] = {c.span_id: [] for c in calls}
    for s in spans:
        if s.kind == "reward":
            step[by_operation[s.attributes[semconv.OPERATION_SPAN_ID]]].append(s.attributes[semconv.REWARD_VALUE])
        elif s.kind == "tool":
            air = TOOL_ERROR if s.status == "error" else TOOL_OK
            step[caller_of_call_id[s.attributes[semconv.TOOL_CALL_ID]]].append(air)
    returns: List[float] = []
    future = float(rollout.final_reward)  # type: ignore[arg-type]
    for c in reversed(calls):
        returns.insert(0, math.fsum(step[c.span_id]) + future)
        future = GAMMA * returns[0]
    return [
        Sample(
            rollout_id=rollout.rollout_id,
            task_id=rollout.task_id,
            policy="default",
            prompt_ids=c.attributes[semconv.PROMPT_TOKEN_IDS],
            response_ids=c.attributes[semconv.RESPONSE_TOKEN_IDS],
            response_mask=[1] * len(c.attributes[semconv.RESPONSE_TOKEN_IDS]),
            reward=g,
            response_logprobs=[float(x) for x in c.attributes[semconv.RESPONSE_LOGPROBS]],
            span_ids=[c.span_id],
        )
        for c, g in zip(calls, returns)
    ]


def json_call_id(call: Span) -> str:
    return json.loads(call.attributes[semconv.OUTPUT_MESSAGES])[0]["tool_calls"][0]["id"]


def with_grpo(samples: List[Sample]) -> List[Sample]:
    """GRPO over the rollouts of each task, each rollout by its mean reward, loss weight 1 / its samples."""
    by_task: Dict[str, Dict[str, List[Sample]]] = {}
    for s in samples:
        by_task.setdefault(s.task_id, {}).setdefault(s.rollout_id, []).append(s)
    for rollouts in by_task.values():
        rewards = [[s.reward for s in group] for group in rollouts.values()]
        means = [r[0] if len(set(r)) == 1 else math.fsum(r) / len(r) for r in rewards]
        mean = statistics.mean(means)
        var = math.fsum(math.fsum((x - mean) ** 2 for x in r) / len(r) for r in rewards) / (len(rewards) - 1)
        for group in rollouts.values():
            for s in group:
                s.advantage = (s.reward - mean) / (math.sqrt(var) + 1e-6)
                s.loss_weight = 1.0 / len(group)
    return samples


def test_the_batch_equals_the_plain_computation_field_by_field(tmp_path) -> None:
    store, rollouts = stored_rollouts(str(tmp_path / "store.db"), 3_000)
    batch = LightningRL.from_config(CONFIG).build_batch(store, rollouts, progress=False)

    expected = with_grpo([s for r in rollouts for s in plain_samples(r, store.query_spans(r.rollout_id))])
    assert len(batch.samples) == len(expected) == 7 * len(rollouts)  # 7 turns of 5 spans in 40, with the root
    assert {s.advantage != 0.0 for s in expected} == {True}  # the rewards differ: every field is exercised
    for got, want in zip(batch.samples, expected):
        assert got == want, got.span_ids
    assert batch.report.accounted and batch.report.samples == len(expected)


def test_the_batch_leaves_nothing_for_the_next_collection(tmp_path) -> None:
    """The objects made while the collector was paused go to its oldest generation, not to the youngest
    (where the next collection would walk every one of them); objects someone froze stay frozen."""
    store, rollouts = stored_rollouts(str(tmp_path / "store.db"), 400)
    adapter = LightningRL.from_config(CONFIG)

    batch = adapter.build_batch(store, rollouts, progress=False)
    assert gc.isenabled()
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(batch.samples[0]) in oldest and id(batch.transitions[-1]) in oldest

    frozen_before = gc.get_freeze_count()
    keep = [[1, 2, 3]]
    gc.freeze()
    try:
        batch = adapter.build_batch(store, rollouts, progress=False)
        assert gc.get_freeze_count() > frozen_before and id(keep) not in {id(o) for o in gc.get_objects(generation=2)}
    finally:
        if frozen_before == 0:
            gc.unfreeze()
