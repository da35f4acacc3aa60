"""Rewards computed with NumPy or torch count as numbers (docs/rewards.md): their scalars, 0-d arrays and
one-element tensors, returned by a rollout or emitted; an array of several values says to reduce it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import agl
from agl import semconv
from agl.runtime.runner import Runner
from agl.store import SqliteLightningStore

ONE_VALUE = [
    np.float32(0.25),
    np.float16(0.25),
    np.array(0.25),
    np.array([0.25]),
    torch.tensor(0.25),
    torch.tensor([0.25]),
    torch.tensor(0.25, requires_grad=True) * 1,
    torch.tensor(0.25, dtype=torch.bfloat16),
]


@pytest.fixture
def store(tmp_path: Any) -> Any:
    s = SqliteLightningStore(tmp_path / "store.db")
    yield s
    s.close()


def run_one(store: Any, agent: Any) -> Any:
    store.enqueue_rollout({"q": 1})
    runner = Runner(agent, store)
    try:
        return runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    finally:
        runner.close()


@pytest.mark.parametrize("value", ONE_VALUE + [np.int64(1), np.bool_(True)], ids=repr)
def test_a_returned_numpy_or_torch_number_is_the_episode_reward(store: Any, value: Any) -> None:
    done = run_one(store, agl.rollout(lambda task: value))
    assert done.status == "succeeded", done.error
    assert done.final_reward == value.item() and type(done.final_reward) is float


@pytest.mark.parametrize("value", ONE_VALUE, ids=repr)
def test_an_emitted_numpy_or_torch_number_is_stored_as_a_float(store: Any, value: Any) -> None:
    def agent(task: Any) -> None:
        agl.emit_reward({"accuracy": value, "format": np.float64(1.0)}, primary="accuracy")

    done = run_one(store, agl.rollout(agent))
    assert done.status == "succeeded" and done.final_reward == 0.25
    (reward,) = [s for s in store.query_spans(done.rollout_id) if s.kind == "reward"]
    assert reward.attributes[semconv.REWARD_VALUE] == 0.25


@pytest.mark.parametrize("value", [np.array([0.5, 1.0]), torch.tensor([0.5, 1.0])], ids=type)
def test_several_values_fail_the_rollout_and_say_to_reduce_them(store: Any, value: Any) -> None:
    done = run_one(store, agl.rollout(lambda task: value))
    assert done.status == "failed"
    assert "the reward rollout() returned must be one number" in done.error and "e.g. .mean()" in done.error
    with pytest.raises(TypeError, match="a reward must be one number"):
        agl.emit_reward(value)
