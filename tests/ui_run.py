"""What the web view's tests look at: a SQLite store filled by a real ``agl.Trainer`` against the fake OpenAI
server. ``Trainer.dev`` runs every task once; then three training steps and a held-out evaluation run the
way TorchGRPO runs them (each publishes its resources version, then ``run_tasks`` in train or val mode).

The agent asks a ``planner`` agent for a plan (one call, no tool), then answers as ``solver`` with the ``add``
tool (two calls), so ``agent_match="^solver$"`` trains two of its three calls. One task's question holds a
``<script>`` tag that must reach the pages escaped. The grader halves the reward of every second run of a task,
so that the two rollouts of a task in one training step differ and their samples get advantages other than 0."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Union

from openai import OpenAI

import agl
from agl import semconv
from agl.testing import ADD_TOOL

SCRIPT = "<script>alert(1)</script>"
TOOLS = [ADD_TOOL]
# The fake model always adds right: a task whose expected answer is off gets reward 0 (a wrong answer).
TASKS: List[Dict[str, Any]] = [
    {"id": f"t{i}", "question": f"What is {i} plus {i + 10}?", "answer": 2 * i + 10 + (i % 3 == 2)} for i in range(6)
]
TASKS[0]["question"] += f" {SCRIPT}"


RUNS: Counter[str] = Counter()  # task id -> rollouts graded so far
_GRADING = threading.Lock()


@agl.tool
def add(a: float, b: float) -> float:
    return a + b


@agl.rollout
def solver(task: Dict[str, Any], llm: Any) -> None:
    client = OpenAI(base_url=llm.get_base_url(), api_key="x")
    with agl.get_tracer().span("planner", "agent", {semconv.AGENT_NAME: "planner"}):
        client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "Plan the steps."}])
    messages: List[Any] = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    result = add(**json.loads(call.function.arguments))  # type: ignore[union-attr]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": f"{result:g}"},
    ]
    answer = client.chat.completions.create(model=llm.model, messages=messages).choices[0].message.content or ""
    agl.emit_reward(grade(task, answer))


def grade(task: Dict[str, Any], answer: str) -> float:
    """1 for the right answer, 0 for a wrong one; halved on every second run of the task (the first, Trainer.dev's,
    is not)."""
    with _GRADING:
        RUNS[task["id"]] += 1
        factor = 0.5 if RUNS[task["id"]] % 2 == 0 else 1.0
    return factor * (1.0 if str(task["answer"]) in answer else 0.0)


def fill(trainer: agl.Trainer, llm: agl.LLM, steps: int = 3) -> None:
    """``trainer.dev`` over :data:`TASKS`, then ``steps`` training steps of four tasks (two rollouts each, each
    step with its own resources version, as TorchGRPO publishes one per step) and one held-out evaluation."""
    RUNS.clear()
    trainer.dev(solver, TASKS, print_table=False)
    with trainer.runners(solver):
        for step in range(steps):
            version = trainer.store.add_resources({"main_llm": llm}).resources_id
            trainer.run_tasks(TASKS[step : step + 4], mode="train", n_per_task=2, resources_id=version)
        version = trainer.store.add_resources({"main_llm": llm}).resources_id
        trainer.run_tasks(TASKS[:3], mode="val", resources_id=version)


def fill_store(path: Union[Path, str], base_url: str) -> None:
    """The new store at ``path`` (a SQLite file, or a PostgreSQL address) filled by :func:`fill` through a real
    Trainer (thread runners) whose LLM is ``fake-model`` at ``base_url`` (the fake OpenAI server); instrumented
    only while it runs."""
    llm = agl.LLM(endpoint=base_url, model="fake-model")
    agl.instrument()
    try:
        trainer = agl.Trainer(
            store=str(path), runner_mode="thread", n_runners=2, initial_resources={"main_llm": llm}, progress=False
        )
        fill(trainer, llm)
        trainer.store.close()
    finally:
        agl.uninstrument()
