"""TorchGRPO: which sampling settings the server applies to training and validation rollouts, the warning for
a step whose groups all agreed, and what the metrics rows, the console line and the reward curve say.

Real parts as in test_grpo_trainer.py: the tiny Llama behind a real PolicyServer, the real ``openai`` client
instrumented by agl, a SQLite store and thread runners. Tiny step counts (two shared cores)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Dict, List

import openai
import pytest
from with_torch_helpers import thread_trainer, tiny_grpo

import agl
from agl.algorithm.metrics import format_line, plot_reward_curve

pytestmark = pytest.mark.usefixtures("instrumented")  # agl.instrument() around each test: tests/conftest.py

TASKS = [{"task_id": f"t{i}", "question": f"Say something about the number {i}."} for i in range(2)]
VAL = [{"task_id": f"v{i}", "question": f"Count to {i}."} for i in range(2)]

TRAIN_MAX_TOKENS = 5
VAL_SAMPLING = {"temperature": 0.0, "max_tokens": 1, "logprobs": False}

SAMPLED: List[Dict[str, Any]] = []  # what the server sampled for each request, as the agent saw it
_lock = threading.Lock()


def _ask(task: Dict[str, Any], llm: agl.LLM, **sampling: Any) -> Any:
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        return client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["question"]}], **sampling
        )


@agl.rollout
def server_sampled_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """Leaves sampling to the server (does not pass ``llm.sampling_parameters``, like the README's agent).
    Reward 1 when the server sampled it as training does (logprobs on), 0 as the validation here (off)."""
    completion = _ask(task, llm)
    choice = completion.choices[0]
    with _lock:
        SAMPLED.append(
            {
                "task_id": task["task_id"],
                "logprobs": choice.logprobs is not None and bool(choice.logprobs.content),
                "tokens": completion.usage.completion_tokens,
            }
        )
    return 1.0 if choice.logprobs is not None else 0.0


@agl.rollout
def constant_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    _ask(task, llm, **llm.sampling_parameters)
    return 0.5


@agl.rollout
def half_failing_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """The task about 0 fails (after its call), the other gets reward 1."""
    _ask(task, llm, **llm.sampling_parameters)
    if task["question"].endswith("0."):
        raise RuntimeError("boom")
    return 1.0


@pytest.fixture(autouse=True)
def nothing_sampled_yet() -> None:
    """Each test starts with no recorded samples."""
    SAMPLED.clear()


def _fit(tmp_path: Path, agent: Any, val: Any = None, **overrides: Any) -> Any:
    settings = {"steps": 2, "max_tokens": TRAIN_MAX_TOKENS, "checkpoint_dir": None, **overrides}
    algo = tiny_grpo(tmp_path, **settings)
    return algo, thread_trainer(tmp_path, algo).fit(agent, TASKS, val_dataset=val)


def test_training_rollouts_are_sampled_with_training_settings_after_mid_training_evaluations(tmp_path: Path) -> None:
    """eval_every=1 publishes validation settings between training steps: every training rollout is still
    sampled with the training settings, every validation rollout with val_sampling."""
    algo, result = _fit(tmp_path, server_sampled_agent, VAL, eval_every=1, val_sampling=VAL_SAMPLING)

    assert result.steps == 2
    train = [s for s in SAMPLED if s["task_id"].startswith("t")]
    val = [s for s in SAMPLED if s["task_id"].startswith("v")]
    assert len(train) == 2 * 2 * 2 and len(val) == 3 * 2  # evaluations at steps 0, 1 and 2
    assert all(s["logprobs"] and 1 <= s["tokens"] <= TRAIN_MAX_TOKENS for s in train), train
    assert all(not s["logprobs"] and s["tokens"] == 1 for s in val), val
    # the rewards say so too: each training step's rollouts got training sampling, the evaluations val's
    assert [r["reward_mean"] for r in result.rows] == [1.0, 1.0]
    assert [e["reward_mean"] for e in algo.state.evaluations] == [0.0, 0.0, 0.0]
    assert algo.server.request_defaults["logprobs"] is True  # the server is left with the training settings

    # rollouts_version: the resources version the step's rollouts ran with (as the store has it);
    # policy_version: the one published after the step's update.
    store = algo.store
    versions = sorted({store.get_resources(r.resources_id).version for r in store.query_rollouts(mode="train")})
    assert [r["rollouts_version"] for r in result.rows] == versions
    assert all(r["policy_version"] > r["rollouts_version"] for r in result.rows)
    assert result.rows[1]["rollouts_version"] == result.rows[0]["policy_version"]  # not the step-1 evaluation's


def test_a_step_whose_groups_all_agree_is_warned_about_and_does_not_stop_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="agl"):
        _, result = _fit(tmp_path, constant_agent, steps=3, max_tokens=3)

    assert result.steps == 3  # not stopped by the "3 steps in a row had nothing to train on" rule
    assert all(r["optimizer_steps"] == 0 and r["samples"] == 4 for r in result.rows)
    warnings = [r.getMessage() for r in caplog.records if "had equal rewards" in r.getMessage()]
    assert len(warnings) == 3
    assert warnings[0].startswith("step 1: all 2 groups had equal rewards: nothing to learn from this step")
    assert "3 such steps in a row" in warnings[2] and "rewards seen: 0.5" in warnings[2]
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("had equal rewards: nothing to learn from this step") == 3
    assert "step 3/3 [####################] reward 0.500 ±0.000 success 0% no update" in log


def test_failed_rollouts_count_as_reward_zero_in_training_as_in_evaluation(tmp_path: Path) -> None:
    algo, result = _fit(tmp_path, half_failing_agent, TASKS, steps=1, max_tokens=3)

    (row,) = result.rows
    assert row["rollouts"] == 4 and row["failed_rollouts"] == 2
    assert row["reward_mean"] == 0.5 and row["success_rate"] == 0.5 and row["reward_std"] == 0.5
    assert result.before is not None and result.before.reward_mean == row["reward_mean"]  # same tasks, same rule
    assert "reward 0.500 ±0.500 success 50% failed 2" in (tmp_path / "run" / "train.log").read_text()


def test_console_line_shows_failed_rollouts_and_steps_without_update() -> None:
    line = format_line(
        {
            "step": 1,
            "reward_mean": 0.5,
            "reward_std": 0.0,
            "success_rate": 0.5,
            "failed_rollouts": 2,
            "samples": 4,
            "optimizer_steps": 0,
            "step_time_s": 3.0,
        },
        2,
    )
    assert line == "step 1/2 [##########----------] reward 0.500 ±0.000 success 50% failed 2 no update 3s"
    line = format_line(
        {
            "step": 1,
            "reward_mean": 0.5,
            "reward_std": 0.0,
            "success_rate": 0.5,
            "failed_rollouts": 0,
            "samples": 4,
            "optimizer_steps": 1,
            "loss": -1.2e-7,
            "grad_norm": 0.5,
            "clip_frac": 0.02,
            "kl_old": 1e-4,
        },
        2,
    )
    assert "failed" not in line and "no update" not in line
    # the loss is ~0 on every on-policy step (it looked broken): the line shows what moves instead
    assert "loss" not in line and "grad 0.500 clip 2.0% kl_old 1.0e-04" in line


@pytest.mark.parametrize(
    ("rewards", "low", "high"),
    [([0.0, 0.5, 1.0], -0.02, 1.02), ([8.0, 2.0], -0.16, 8.16), ([-1.0, 0.5], -1.04, 1.04)],
)
def test_reward_curve_y_axis_covers_rewards_outside_0_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rewards: List[float], low: float, high: float
) -> None:
    from matplotlib.axes import Axes

    axes: List[Any] = []
    set_ylim = Axes.set_ylim

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        axes.append(self)
        return set_ylim(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "set_ylim", recording)
    rows = [{"step": i + 1, "reward_mean": r, "success_rate": 0.5} for i, r in enumerate(rewards)]
    assert plot_reward_curve(rows, tmp_path / "curve.png", evaluations=[{"step": 0, "success": 0.5}]) is not None
    assert axes and axes[-1].get_ylim() == (pytest.approx(low), pytest.approx(high))  # as drawn


def test_reward_curve_shows_the_reward_beside_the_success_and_what_the_updates_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 0/1 rewards the success line was drawn over the reward line, hiding it; and nothing showed that the
    updates did anything (the loss is ~0 on-policy)."""
    from matplotlib.axes import Axes

    drawn: List[Any] = []
    plot = Axes.plot

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        lines = plot(self, *args, **kwargs)
        drawn.extend((self, line) for line in lines)
        return lines

    monkeypatch.setattr(Axes, "plot", recording)
    rows = [
        {"step": i, "reward_mean": r, "success_rate": r, "grad_norm": 0.3, "clip_frac": 0.01, "kl_old": 1e-4}
        for i, r in enumerate([0.25, 0.5, 1.0], start=1)
    ]
    assert plot_reward_curve(rows, tmp_path / "curve.png") is not None
    width = {line.get_label(): line.get_linewidth() for _, line in drawn}
    assert width["train success"] > width["train reward (mean)"]  # the success wide underneath, the reward on top
    top, bottom = drawn[0][0], drawn[-1][0]
    assert top is not bottom and bottom.get_yscale() == "log"
    assert [line.get_label() for ax, line in drawn if ax is bottom] == [
        "grad norm",
        "clipped tokens (share)",
        "KL(sampling || updated)",
    ]
