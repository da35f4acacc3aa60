"""TorchGRPO keeps to its time budget during the evaluations too, and says what an evaluation could not measure:
with real parts (the tiny Llama behind its PolicyServer, thread runners, a SQLite store, LightningRL).

The main job on a machine at load 8-10 ran 15 minutes of a 10-minute budget and trained nothing: its held-out
evaluation ran to the end whatever it cost, and the rollouts that hit their timeout were counted as wrong
answers ("0% before")."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Dict

import openai
import pytest
from with_torch_helpers import thread_trainer, tiny_grpo

import agl

pytestmark = pytest.mark.usefixtures("instrumented")

TASKS = [{"task_id": f"t{i}", "question": f"Say something about the number {i}."} for i in range(4)]


def _chat(task: Dict[str, Any], llm: agl.LLM) -> str:
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        messages: Any = [{"role": "user", "content": task["question"]}]
        completion = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
    return completion.choices[0].message.content or ""


@agl.rollout
def slow_to_evaluate(task: Dict[str, Any], llm: agl.LLM) -> float:
    """A held-out task takes 2 s (a busy machine's model); a training one calls the policy (reward: the parity
    of the answer's length, so the groups differ)."""
    if "seconds" in task:
        time.sleep(task["seconds"])
        return float(int(task["task_id"][1:]) % 2)
    return float(len(_chat(task, llm)) % 2)


def test_an_evaluation_longer_than_its_share_of_the_budget_is_cut_and_the_later_ones_run_its_tasks(
    tmp_path: Path,
) -> None:
    """40 held-out tasks of 2 s on 4 runners take 20 s; the evaluations before training may take a third of the
    36 s budget: the queued rollouts are cancelled at that deadline, and the evaluation after training runs the
    tasks that the first one ran, so that both compare the same tasks."""
    val = [{"task_id": f"v{i}", "question": f"Count to {i}.", "seconds": 2.0} for i in range(40)]
    algo = tiny_grpo(tmp_path, steps=50, time_budget_s=36.0)
    trainer = thread_trainer(tmp_path, algo)
    result = trainer.fit(slow_to_evaluate, TASKS, val_dataset=val)

    before, after = result.before, result.after
    assert before is not None and after is not None and result.steps >= 1
    assert before.cut > 0 and before.n + before.cut == 40 and before.task_ids is not None
    assert len(before.task_ids) == before.n and after.n == before.n and after.cut == 0
    first, last = (
        {
            r.task_id
            for r in trainer.store.query_rollouts(mode="val")
            if r.resources_id == rid and r.status != "cancelled"
        }
        for rid in sorted({r.resources_id for r in trainer.store.query_rollouts(mode="val")}, key=_version(trainer))
    )
    assert first == last == set(before.task_ids)
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"{before.cut} of 40 tasks cut to fit the time budget" in log
    assert "(time budget; at most 50)" in log  # the step lines count to the budget's estimate, not to 50


def _version(trainer: agl.Trainer) -> Any:
    """The resources version of a resources id: the order they were published in."""

    def version(resources_id: str) -> int:
        resources = trainer.store.get_resources(resources_id)
        assert resources is not None
        return resources.version

    return version


@agl.rollout
async def sometimes_too_slow(task: Dict[str, Any], llm: agl.LLM) -> float:
    """Held-out tasks v0 and v1 run past the rollout timeout; the others answer right."""
    if task["task_id"] in ("v0", "v1"):
        await asyncio.sleep(30)
    return 1.0


def test_timed_out_evaluation_rollouts_are_counted_apart_from_wrong_answers(tmp_path: Path) -> None:
    """Two of four held-out rollouts hit their timeout: the evaluation said 50% success, as if they had been
    answered wrong; it is 2/2 of those answered, with 2 timed out."""
    val = [{"task_id": f"v{i}", "question": f"Count to {i}."} for i in range(4)]
    trainer = thread_trainer(tmp_path, tiny_grpo(tmp_path, steps=0), rollout_timeout=1.0)
    result = trainer.fit(sometimes_too_slow, TASKS, val_dataset=val)

    before = result.before
    assert before is not None and (before.n, before.timed_out, before.failed) == (4, 2, 0)
    assert before.success == 1.0 and before.answered == 2
    assert "held-out success 100.0% (2/2)" in str(before) and "2 timed out (no answer: not counted)" in str(before)


@agl.rollout
def always_right(task: Dict[str, Any], llm: agl.LLM) -> float:
    _chat(task, llm)
    return 1.0


def test_a_step_where_every_rollout_succeeded_is_not_called_a_possible_bug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At 100% training success the main job warned "all groups had equal rewards ... a constant, a bug" at
    every step: nothing is wrong there, the policy solves these tasks."""
    with caplog.at_level(logging.INFO, logger="agl"):
        result = thread_trainer(tmp_path, tiny_grpo(tmp_path, steps=1)).fit(always_right, TASKS)
    assert result.steps == 1 and result.rows[0]["success_rate"] == 1.0
    assert not [r for r in caplog.records if "had equal rewards" in r.getMessage()]
    assert any("every rollout succeeded" in r.getMessage() for r in caplog.records)


def test_an_evaluation_starting_past_its_deadline_runs_what_the_runners_took_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At load 8-10 the main job loaded its model past the share of the budget its first evaluation had: the
    deadline was gone before the rollouts were enqueued, nothing was cancelled, and the evaluation ran all 50
    tasks (each to its 300 s timeout). Now it keeps the rollouts the runners took first and cuts the rest, and
    the run ends with one line saying that no step fits."""
    val = [{"task_id": f"v{i}", "question": f"Count to {i}.", "seconds": 1.0} for i in range(20)]
    with caplog.at_level(logging.WARNING, logger="agl"):
        result = thread_trainer(tmp_path, tiny_grpo(tmp_path, steps=3, time_budget_s=0.01)).fit(
            slow_to_evaluate, TASKS, val_dataset=val
        )
    before = result.before
    assert before is not None and before.n >= 1 and before.cut > 0 and before.n + before.cut == 20
    assert result.steps == 0 and result.after is None
    (why,) = [r.getMessage() for r in caplog.records if "no training step ran" in r.getMessage()]
    assert "\n" not in why and "this machine is too busy or too slow for the time budget" in why
