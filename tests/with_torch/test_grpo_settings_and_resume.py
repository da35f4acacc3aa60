"""TorchGRPO settings that trained on something other than what they said (a ``sampling`` temperature or
seed, a new ``lr`` on resume), the ``kl_old`` metric's estimator, samples without a prompt, and the random
generators across a resume.

Real parts as in test_grpo_trainer.py: the tiny Llama behind a real PolicyServer, the real ``openai`` client
instrumented by agl, a SQLite store and thread runners. Tiny step counts (two shared cores)."""

from __future__ import annotations

import copy
import logging
import math
import random
import re
import threading
from pathlib import Path
from typing import Any, Dict, List

import openai
import pytest
import torch
from with_torch_helpers import thread_trainer, tiny_grpo, trained_sample

import agl
from agl.algorithm.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from agl.algorithm.grpo_loss import collate, policy_loss
from agl.algorithm.torch_grpo import TorchGRPO
from agl.serving.models import load_policy

pytestmark = pytest.mark.usefixtures("instrumented")  # agl.instrument() around each test: tests/conftest.py

TASKS = [{"task_id": f"t{i}", "question": f"Say something about the number {i}."} for i in range(2)]

ANSWERS: Dict[str, List[str]] = {}  # task id: the answers the server gave its rollouts
_lock = threading.Lock()


@pytest.fixture(autouse=True)
def no_answers_yet() -> None:
    """Each test starts with no recorded answers."""
    ANSWERS.clear()


def _answer(task: Dict[str, Any], llm: agl.LLM, **extra: Any) -> float:
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["question"]}],
            **{**llm.sampling_parameters, **extra},
        )
    text = reply.choices[0].message.content or ""
    with _lock:
        ANSWERS.setdefault(task["task_id"], []).append(text)
    return float(len(text) % 2)  # depends on the answer only


@agl.rollout
def seeded_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """Passes its own fixed seed in every request (the trainer cannot refuse that one)."""
    return _answer(task, llm, seed=7)


@agl.rollout
def alternating_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """The reward alternates over a task's rollouts, so every group trains."""
    _answer(task, llm)
    with _lock:
        return float(len(ANSWERS[task["task_id"]]) % 2)


def _fit(tmp_path: Path, algo: TorchGRPO, agent: Any) -> Any:
    return thread_trainer(tmp_path, algo).fit(agent, TASKS)


# ---------------------------------------------------------------------------------------------------------
# sampling: temperature and seed
# ---------------------------------------------------------------------------------------------------------
def test_a_sampling_temperature_other_than_the_training_temperature_is_refused() -> None:
    """sampling={"temperature": 0.5} sampled the rollouts at 0.5 while every logprob of the loss was computed
    at temperature=1.0 (19% of the tokens clipped before any update)."""
    with pytest.raises(
        ValueError,
        match=r"sampling has temperature=0.5 but TorchGRPO\(temperature=1.0\).*"
        r"temperature=0.5 \(agl train: --temperature 0.5\)",
    ):
        TorchGRPO(model=("m", "t"), temperature=1.0, sampling={"temperature": 0.5})
    # the same value says nothing new; evaluations sample as they like
    algo = TorchGRPO(
        model=("m", "t"),
        temperature=0.7,
        sampling={"temperature": 0.7},
        val_sampling={"temperature": 0.0},
        extra_evals={"hot": {"temperature": 1.5}},
    )
    assert algo._train_sampling()["temperature"] == 0.7


@pytest.mark.parametrize(
    "setting, expected",
    [
        ({"lr": math.inf}, "lr must be a finite number > 0, got inf"),
        ({"lr": 10**400}, "lr must be a finite number > 0, got 1000"),
        ({"clip_eps": math.nan}, "clip_eps must be a finite number > 0, got nan"),
        ({"max_grad_norm": 0.0}, "max_grad_norm must be a finite number > 0, got 0.0"),
        ({"kl_coef": -0.1}, "kl_coef must be a finite number >= 0, got -0.1"),
        ({"temperature": math.nan}, "temperature must be a finite number > 0 for training rollouts"),
        ({"success_threshold": math.nan}, "success_threshold must be a finite number, got nan"),
        ({"time_budget_s": math.nan}, "time_budget_s must be a number of seconds or None"),
    ],
)
def test_non_finite_numeric_settings_are_refused_when_built(setting: Dict[str, Any], expected: str) -> None:
    """TorchGRPO(lr=inf) from Python was built, ran its rollouts, and stopped at the first update with NaN
    weights (TrainingDivergedError); a NaN time budget never ran out."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        TorchGRPO(model=("m", "t"), **setting)


def test_a_fixed_seed_in_training_sampling_is_refused_when_groups_have_several_rollouts() -> None:
    """sampling={"seed": 1} made every rollout of a group identical: equal rewards, no advantage, no training
    for the whole run."""
    with pytest.raises(ValueError, match=r"sampling has seed=1: with group_size=4 .* identical"):
        TorchGRPO(model=("m", "t"), group_size=4, sampling={"seed": 1})
    TorchGRPO(model=("m", "t"), group_size=4, val_sampling={"seed": 1}, extra_evals={"fixed": {"seed": 2}})
    TorchGRPO(model=("m", "t"), group_size=1, sampling={"seed": 1})  # nothing to tell apart within a group
    TorchGRPO(model=("m", "t"), group_size=4, sampling={"seed": None})


def test_the_equal_rewards_warning_names_an_agents_fixed_seed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An agent that passes its own seed cannot be refused up front: the warning says what happened."""
    with caplog.at_level(logging.WARNING, logger="agl"):
        result = _fit(tmp_path, tiny_grpo(tmp_path, group_size=3), seeded_agent)

    assert {task: len(set(answers)) for task, answers in ANSWERS.items()} == {"t0": 1, "t1": 1}
    assert result.rows[0]["live_samples"] == 0
    (warning,) = [r.getMessage() for r in caplog.records if "had equal rewards" in r.getMessage()]
    assert "rollouts of every group were token for token identical: a fixed `seed`" in warning


# ---------------------------------------------------------------------------------------------------------
# resume with another lr
# ---------------------------------------------------------------------------------------------------------
def test_a_resumed_run_trains_at_the_lr_it_is_given(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """load_checkpoint restored the optimizer's param groups, lr included: a run resumed with a lower lr (the
    usual reaction to a diverging run) trained at the checkpoint's, and metrics.csv did not show it."""
    first = tiny_grpo(tmp_path, lr=5e-3)
    assert _fit(tmp_path, first, alternating_agent).rows[0]["lr"] == 5e-3

    second = tiny_grpo(tmp_path, lr=1e-4, steps=2)
    with caplog.at_level(logging.WARNING, logger="agl.train"):
        result = _fit(tmp_path, second, alternating_agent)

    assert [r["step"] for r in result.rows] == [1, 2]
    assert [r["lr"] for r in result.rows] == [5e-3, 1e-4]
    assert all(group["lr"] == 1e-4 for group in second.optimizer.param_groups)  # type: ignore[union-attr]
    assert second.optimizer.state  # the moments came back  # type: ignore[union-attr]
    assert "with lr=0.0001; the checkpoint was trained with lr=0.005" in caplog.text
    assert "lr" in (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].split(",")


def test_resuming_with_the_same_lr_says_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    base, tokenizer = load_policy("tiny", device="cpu", seed=0)
    saved = TorchGRPO(model=(base, tokenizer), lora={"r": 4}, lr=5e-4)
    saved.attach(copy.deepcopy(base), tokenizer)
    assert saved.policy is not None and saved.optimizer is not None
    fingerprint = saved.policy.fingerprint("tiny")
    state = TrainerState(step=1, fingerprint=fingerprint)
    path = save_checkpoint(tmp_path, saved.policy.module, saved.optimizer, state, lora=True)
    resumed = TorchGRPO(model=(base, tokenizer), lora={"r": 4}, lr=5e-4)
    resumed.attach(copy.deepcopy(base), tokenizer)
    assert resumed.policy is not None and resumed.optimizer is not None
    with caplog.at_level(logging.WARNING, logger="agl.train"):
        load_checkpoint(path, resumed.policy.module, resumed.optimizer, lora=True, fingerprint=fingerprint)
    assert resumed.optimizer.param_groups[0]["lr"] == 5e-4
    assert "lr=" not in caplog.text


# ---------------------------------------------------------------------------------------------------------
# random generators across a resume
# ---------------------------------------------------------------------------------------------------------
def test_a_checkpoint_restores_the_random_generators(tmp_path: Path) -> None:
    """A resumed run re-seeded with the run's seed and replayed the first steps' random stream."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.manual_seed(123)
    random.seed(123)
    torch.rand(5)
    path = save_checkpoint(tmp_path, model, optimizer, TrainerState(step=1), lora=False)
    expected_torch, expected_python = torch.rand(4), random.random()

    torch.manual_seed(0)  # what a resumed run's start does
    random.seed(0)
    load_checkpoint(path, model, optimizer, lora=False, fingerprint={})
    assert torch.equal(torch.rand(4), expected_torch)
    assert random.random() == expected_python


# ---------------------------------------------------------------------------------------------------------
# the kl_old metric, samples without a prompt
# ---------------------------------------------------------------------------------------------------------
def test_kl_old_is_an_unbiased_k3_estimate_of_kl_old_new() -> None:
    """Tokens are drawn from the old policy: the mean of the metric under it must be KL(old || new). The old
    formula (exp(-log_ratio) + log_ratio - 1) averages E_old[old / new] - 1 - KL instead: 2.95 here, for a
    KL of 1.17."""
    old = torch.tensor([0.7, 0.2, 0.05, 0.05])
    new = torch.tensor([0.1, 0.2, 0.3, 0.4])
    exact = float((old * (old / new).log()).sum())
    expected = 0.0
    for k in range(4):  # one token of outcome k, weighted by its probability under old
        batch = collate([trained_sample("r", [1], [2], reward=0.0, advantage=1.0)], pad_id=0)
        parts = policy_loss(new[k].log().view(1, 1), old[k].log().view(1, 1), batch, clip_eps=0.2, weight_total=1.0)
        expected += float(old[k]) * parts.stats["kl_old_sum"]
    assert expected == pytest.approx(exact, rel=1e-5)
    # no drift: 0
    batch = collate([trained_sample("r", [1], [2, 3], reward=0.0, advantage=1.0)], pad_id=0)
    same = torch.tensor([[-1.0, -2.0]])
    assert policy_loss(same, same, batch, clip_eps=0.2, weight_total=1.0).stats["kl_old_sum"] == 0.0
    assert math.isfinite(expected)


def test_a_sample_without_prompt_tokens_is_refused_with_its_rollout_named() -> None:
    """Its first response token has nothing to be predicted from: alone it crashed with a size mismatch, in
    a batch it was scored from a padding column."""
    empty = trained_sample("ro-empty", [], [5, 6, 7], reward=1.0, advantage=1.0)
    other = trained_sample("ro-ok", [1, 2, 3, 4], [5], reward=0.0, advantage=-1.0)
    for samples in ([empty], [other, empty]):
        with pytest.raises(ValueError, match="rollout ro-empty has no prompt tokens"):
            collate(samples, pad_id=0)
