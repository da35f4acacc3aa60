"""Training and validation rollouts in one store (as every algorithm leaves it) stay apart: validation tasks
without ids are named ``val-<i>`` (never a training task's ``task-<i>``), GRPO groups are per
``(mode, task_id)``, and ``agl export`` writes training rollouts only unless asked, each record with its mode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Tuple

import pytest
from openai import OpenAI

import agl
from agl.cli import main as agl_main
from agl.lightningrl import LightningRL
from agl.lightningrl.export import read_jsonl
from agl.store import SqliteLightningStore
from agl.types import Rollout


@agl.rollout
def answerer(task, llm):
    """One LLM call, then the reward the task names."""
    client = OpenAI(base_url=llm.get_base_url(), api_key="x")
    client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    return task["r"]


def train_and_validate(
    db: Path, fake_trainer, train: list, val: list, n_per_task: int = 2
) -> Tuple[List[Rollout], List[Rollout]]:
    trainer = fake_trainer(str(db))
    with trainer.runners(answerer):
        train_rollouts = trainer.run_tasks(train, n_per_task=n_per_task)
        val_rollouts = trainer.run_tasks(val, mode="val")
    trainer.store.close()
    return train_rollouts, val_rollouts


# Two training rollouts of one question, both rewarded 1 (their GRPO advantages must be exactly 0), and a
# validation rollout of another question rewarded 0.
TRAIN = [{"q": "train question 1+1", "r": 1.0}]
VAL = [{"q": "VAL question: the capital of France", "r": 0.0}]


def test_validation_tasks_without_ids_never_share_a_training_task_id(tmp_path, fake_trainer, instrumented) -> None:
    train, val = train_and_validate(tmp_path / "s.db", fake_trainer, TRAIN, VAL)
    assert [r.task_id for r in train] == ["task-0", "task-0"]
    assert [(r.mode, r.task_id) for r in val] == [("val", "val-0")]


def test_baseline_names_validation_tasks_apart(tmp_path) -> None:
    """``Baseline`` (and VERL's validation) go through ``Trainer.run_tasks(..., mode="val")``."""
    trainer = agl.Trainer(store=str(tmp_path / "s.db"), runner_mode="thread", n_runners=1, progress=False)
    results = trainer.fit(agl.rollout(lambda task: 1.0), [{"q": "a"}, {"q": "b"}], val_dataset=[{"q": "c"}])
    assert [r.task_id for r in results["train"]] == ["task-0", "task-1"]
    assert [r.task_id for r in results["val"]] == ["val-0"]


def test_grpo_groups_never_mix_train_and_val_rollouts_even_under_one_id(tmp_path, fake_trainer, instrumented) -> None:
    """Ids the user gives can collide across the two datasets; the groups still do not."""
    train, val = train_and_validate(
        tmp_path / "s.db", fake_trainer, [{"id": "q1", **TRAIN[0]}], [{"id": "q1", **VAL[0]}]
    )
    assert {r.task_id for r in train + val} == {"q1"}
    store = SqliteLightningStore(tmp_path / "s.db")
    batch = LightningRL().build_batch(store, train + val, progress=False)
    by_rollout = {s.rollout_id: s for s in batch.samples}
    # each group alone: two equal rewards, and a group of one -> advantages exactly 0
    assert [by_rollout[r.rollout_id].advantage for r in train + val] == [0.0, 0.0, 0.0]
    assert [by_rollout[r.rollout_id].mode for r in train + val] == ["train", "train", "val"]
    assert {t.mode for t in batch.transitions} == {"train", "val"}
    merged = LightningRL(aggregate=True).build_batch(store, train + val, progress=False)  # merged samples too
    assert [(s.mode, s.advantage) for s in merged.samples] == [("train", 0.0), ("train", 0.0), ("val", 0.0)]


def export(db: Path, out: Path, *args: str) -> List[dict]:
    assert agl_main(["export", str(out), "--store", str(db), *args]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_agl_export_writes_training_rollouts_by_default_each_with_its_mode(
    tmp_path, fake_trainer, instrumented
) -> None:
    db = tmp_path / "s.db"
    train, val = train_and_validate(db, fake_trainer, TRAIN, VAL)
    out = tmp_path / "b.jsonl"

    records = export(db, out)  # the default: training rollouts only
    assert sorted(r["rollout_id"] for r in records) == sorted(r.rollout_id for r in train)
    assert [r["mode"] for r in records] == ["train", "train"]
    assert [r["advantage"] for r in records] == [0.0, 0.0]
    assert [s.mode for s in read_jsonl(out)] == ["train", "train"]

    records = export(db, out, "--mode", "val")
    assert [(r["rollout_id"], r["task_id"], r["mode"]) for r in records] == [(val[0].rollout_id, "val-0", "val")]

    records = export(db, out, "--mode", "all")
    assert sorted((r["mode"], r["rollout_id"]) for r in records) == sorted((r.mode, r.rollout_id) for r in train + val)
    assert [r["advantage"] for r in records] == [0.0, 0.0, 0.0]  # val is a group of its own

    import pyarrow.parquet as pq

    assert agl_main(["export", str(tmp_path / "c.parquet"), "--store", str(db), "--mode", "all"]) == 0
    assert sorted(pq.read_table(str(tmp_path / "c.parquet")).column("mode").to_pylist()) == ["train", "train", "val"]


def test_agl_export_limit_never_cuts_a_group(tmp_path, fake_trainer, instrumented, capsys) -> None:
    """``--limit N`` reads whole task groups only: a group cut in half would get different advantages."""
    db = tmp_path / "s.db"
    train, _ = train_and_validate(db, fake_trainer, [{"q": "a", "r": 1.0}, {"q": "b", "r": 0.0}], VAL, n_per_task=2)
    out = tmp_path / "b.jsonl"
    capsys.readouterr()

    records = export(db, out, "--limit", "3")  # task-0 (2 rollouts) fits, task-1 (2 more) does not
    assert sorted(r["rollout_id"] for r in records) == sorted(r.rollout_id for r in train[:2])
    assert "--limit 3: read 2 rollouts in 1 whole task groups; 2 more left out" in capsys.readouterr().out

    records = export(db, out, "--limit", "4")
    assert sorted(r["rollout_id"] for r in records) == sorted(r.rollout_id for r in train)
    assert "left out" not in capsys.readouterr().out

    smaller = r"--limit 1 is smaller than the first task group \(2 rollouts of train task 'task-0'\)"
    with pytest.raises(SystemExit, match=smaller):
        agl_main(["export", str(out), "--store", str(db), "--limit", "1"])
