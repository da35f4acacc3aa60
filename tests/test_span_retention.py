"""Trainer(span_retention_steps=N): the spans of training steps older than the last N are deleted once an
algorithm has learnt from them; rollouts, rewards and validation spans stay. Real thread runners on a real
SQLite file (and the in-memory store, whose growth is what ran Agent Lightning out of memory)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest

import agl
from agl.errors import StoreUnavailableError
from agl.store import SqliteLightningStore
from agl.store.http.server import ServerThread, TokenSet, create_app
from agl.testing.spans import incompressible_text
from agl.types import Rollout, Span


@agl.rollout
def noted_agent(task: Dict[str, Any]) -> None:
    with agl.operation("think", step=task["n"]):
        agl.emit_message(f"task {task['n']}")
    agl.emit_reward(float(task["n"] % 2))


class Steps(agl.Algorithm):
    """A training loop's shape without a model: ``steps`` batches of training rollouts, each reported as
    learnt from (as TorchGRPO, VERL and APO do after their update), then one validation run."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.batches: List[List[Rollout]] = []

    def run(self, train_dataset: Optional[Sequence[Any]], val_dataset: Optional[Sequence[Any]]) -> Any:
        assert train_dataset is not None
        for _ in range(self.steps):
            rollouts = self.trainer.run_tasks(train_dataset, mode="train", n_per_task=2, description="step")
            self.batches.append(rollouts)
            self.trainer.learned_from(rollouts)
        return self.trainer.run_tasks(val_dataset or [], mode="val", description="val")


TASKS = [{"n": i} for i in range(3)]


def _fit(store: Any, steps: int, retention: Optional[int]) -> Steps:
    algorithm = Steps(steps)
    trainer = agl.Trainer(
        algorithm=algorithm,
        store=store,
        n_runners=2,
        runner_mode="thread",
        progress=False,
        span_retention_steps=retention,
    )
    trainer.fit(noted_agent, TASKS, val_dataset=[{"n": 9}])
    return algorithm


def _span_counts(store: Any, algorithm: Steps) -> List[List[int]]:
    return [[len(store.query_spans(r.rollout_id)) for r in batch] for batch in algorithm.batches]


@pytest.mark.parametrize("backend", ["sqlite", "memory"])
def test_only_the_last_steps_keep_their_spans(tmp_path: Path, backend: str) -> None:
    store = SqliteLightningStore(tmp_path / "s.db") if backend == "sqlite" else agl.InMemoryLightningStore()
    algorithm = _fit(store, steps=4, retention=2)
    counts = _span_counts(store, algorithm)
    assert counts[0] == counts[1] == [0] * 6
    assert all(n >= 3 for batch in counts[2:] for n in batch), counts  # operation, message, reward at least
    assert store.stats().spans == sum(map(sum, counts)) + len(
        store.query_spans(store.query_rollouts(mode="val")[0].rollout_id)
    )
    rewards = [r.final_reward for r in store.query_rollouts(mode="train")]
    assert rewards == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0] * 4, "rollouts and rewards of every step stay"
    (val,) = store.query_rollouts(mode="val")
    assert store.query_spans(val.rollout_id), "validation spans are not a training step's"


def test_without_the_setting_every_span_stays_and_zero_keeps_none(tmp_path: Path) -> None:
    kept_all = _fit(SqliteLightningStore(tmp_path / "all.db"), steps=3, retention=None)
    store = SqliteLightningStore(tmp_path / "all.db")
    assert all(n >= 3 for batch in _span_counts(store, kept_all) for n in batch)

    store_none = SqliteLightningStore(tmp_path / "none.db")
    kept_none = _fit(store_none, steps=3, retention=0)
    assert _span_counts(store_none, kept_none) == [[0] * 6] * 3


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_a_retention_that_is_not_a_step_count_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="span_retention_steps must be None .* or a whole number >= 0"):
        agl.Trainer(store="memory", span_retention_steps=bad)


class _UnreachableForDeletes(SqliteLightningStore):
    def delete_spans(self, rollout_ids: Sequence[str]) -> int:
        raise StoreUnavailableError("store server at http://10.0.0.7:4747 is not answering")


def test_a_failed_deletion_is_logged_and_training_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = _UnreachableForDeletes(tmp_path / "s.db")
    with caplog.at_level(logging.WARNING, logger="agl.trainer"):
        algorithm = _fit(store, steps=3, retention=1)
    assert len(algorithm.batches) == 3, "housekeeping does not end a run"
    warnings = [r.getMessage() for r in caplog.records if "could not delete the spans" in r.getMessage()]
    assert (
        warnings
        == [
            "could not delete the spans of 6 rollouts of an old step (they stay): store server at "
            "http://10.0.0.7:4747 is not answering"
        ]
        * 2
    )
    assert all(n >= 3 for batch in _span_counts(store, algorithm) for n in batch)


@agl.rollout
def wordy_agent(task: Dict[str, Any]) -> None:
    agl.emit_message(incompressible_text(20_000, seed=task["n"]))  # a long prompt's worth of text per rollout
    agl.emit_reward(1.0)


def test_cli_prune_deletes_older_spans_and_vacuum_shrinks_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agl.cli import main as agl_main

    db = tmp_path / "s.db"
    trainer = agl.Trainer(store=str(db), n_runners=2, runner_mode="thread", progress=False)
    trainer.dev(wordy_agent, [{"n": i} for i in range(40)], print_table=False)
    trainer.store.close()
    with SqliteLightningStore(db) as store:
        store.enqueue_rollout({"n": "later"}, mode="train")  # queued: its spans (none yet) are not touched
        ids = [r.rollout_id for r in store.query_rollouts(status=["succeeded"])]
        counts = [len(store.query_spans(i)) for i in ids]
        size_before = store.file_size()
    assert min(counts) >= 2  # the message and the reward at least

    assert agl_main(["store", "prune", "--keep-last", "5", "--vacuum", "--store", str(db)]) == 0
    out = capsys.readouterr().out
    assert (
        f"deleted {sum(counts[:35])} spans of 35 finished rollouts" in out
        and "(the task groups of the last 5, whole)" in out
    )
    store = SqliteLightningStore(db)
    assert [len(store.query_spans(i)) for i in ids] == [0] * 35 + counts[35:]
    assert store.stats().rollouts["succeeded"] == 40 and store.stats().rollouts["queued"] == 1
    assert store.file_size() < size_before / 3, (size_before, store.file_size())
    store.close()

    assert agl_main(["inspect", ids[0], "--store", str(db)]) == 0
    assert "no spans: the agent recorded none, or they were deleted afterwards" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--keep-last must be >= 0"):
        agl_main(["store", "prune", "--keep-last", "-1", "--store", str(db)])

    served = SqliteLightningStore(tmp_path / "served.db")
    served.enqueue_rollout({"n": 1})
    (claimed,) = served.dequeue_many("r", 1)
    served.add_spans(
        [
            Span(
                rollout_id=claimed.rollout_id,
                attempt_id=claimed.attempt.attempt_id,
                sequence_id=0,
                trace_id="t" * 32,
                span_id="s" * 16,
                name="x",
                kind="annotation",
                start_time=0,
                end_time=1,
            )
        ]
    )
    served.complete_attempt(claimed.rollout_id, claimed.attempt.attempt_id, "succeeded")
    server = ServerThread(create_app(served, tokens=TokenSet({"t": "tok"}))).start()
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("AGL_STORE_TOKEN", "tok")
            with pytest.raises(
                SystemExit, match="--vacuum is for a SQLite store file opened directly, not RemoteLightningStore"
            ):
                agl_main(["store", "prune", "--keep-last", "0", "--vacuum", "--store", server.url])
            assert served.stats().spans == 1, "refused before anything was deleted"
            assert agl_main(["store", "prune", "--keep-last", "0", "--store", server.url]) == 0
        assert served.stats().spans == 0 and served.stats().rollouts["succeeded"] == 1
    finally:
        server.stop()
        served.close()
