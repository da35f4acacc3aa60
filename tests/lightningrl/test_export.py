"""Export: JSONL and Parquet round trips, Parquet's clear error without pyarrow, and `agl export`."""

from __future__ import annotations

import json
import sys

import pytest

from agl.cli import main as agl_main
from agl.lightningrl import LightningRL
from agl.lightningrl.export import FIELDS, columns, export, read_jsonl, record, write_parquet
from agl.lightningrl.synthetic import synthetic_rollouts
from agl.store import SqliteLightningStore


@pytest.fixture
def batch():
    pairs = list(synthetic_rollouts(400, spans_per_rollout=50, rollouts_per_task=2))
    return LightningRL(air={}).batch_from_spans([r for r, _ in pairs], pairs)


def test_jsonl_round_trip(tmp_path, batch) -> None:
    path = tmp_path / "batch.jsonl"
    assert export(batch, path) == len(batch.samples) > 0
    lines = path.read_text().splitlines()
    assert list(json.loads(lines[0])) == FIELDS  # documented field order
    assert read_jsonl(path) == batch.samples


def test_parquet_columns_are_the_records(batch) -> None:
    cols = columns(batch.samples)
    assert list(cols) == FIELDS
    assert [dict(zip(FIELDS, row)) for row in zip(*cols.values())] == [record(s) for s in batch.samples]


def test_parquet_round_trip(tmp_path, batch) -> None:
    import pyarrow.parquet as pq

    path = tmp_path / "batch.parquet"
    assert export(batch, path) == len(batch.samples) > 0
    table = pq.read_table(str(path))
    assert table.column_names == FIELDS  # documented column order
    assert table.to_pylist() == [record(s) for s in batch.samples]


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, batch, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError, as when not installed
    with pytest.raises(ImportError, match=r'pip install "agl\[parquet\]".*JSONL'):
        write_parquet(batch, tmp_path / "b.parquet")
    assert not (tmp_path / "b.parquet").exists()


def test_unknown_format(tmp_path, batch) -> None:
    with pytest.raises(ValueError, match="unknown export format 'csv'"):
        export(batch, tmp_path / "b.csv")


def test_agl_export_cli(tmp_path, capsys) -> None:
    db = tmp_path / "s.db"
    store = SqliteLightningStore(db)
    pairs = list(synthetic_rollouts(200, spans_per_rollout=50, rollouts_per_task=2))
    for rollout, spans in pairs:  # store them the way runners do: enqueue, dequeue, spans, complete
        stored = store.enqueue_rollout(task_id=rollout.task_id)
        running = store.dequeue_rollout("runner")
        assert running.rollout_id == stored.rollout_id
        attempt = running.attempt.attempt_id
        store.add_spans([s.model_copy(update={"rollout_id": stored.rollout_id, "attempt_id": attempt}) for s in spans])
        store.complete_attempt(stored.rollout_id, attempt, "succeeded", reward=rollout.final_reward)
    store.close()

    out = tmp_path / "b.jsonl"

    def export_cli(*options: str) -> int:
        """``agl export OUT --store DB OPTIONS...``."""
        return agl_main(["export", str(out), "--store", str(db), *options])

    config = json.dumps({"agent_match": {"writer": "author"}, "credit": "discounted", "gamma": 0.9})
    assert export_cli("--config", config) == 0
    printed = capsys.readouterr().out
    assert "4 rollouts (4 used" in printed and f"to {out}" in printed
    samples = read_jsonl(out)
    assert samples and {s.policy for s in samples} == {"author"}

    (tmp_path / "c.json").write_text(json.dumps({"credit": "step"}))
    assert export_cli("--config", f"@{tmp_path / 'c.json'}", "--agent-match", "^checker$") == 0
    assert {s.policy for s in read_jsonl(out)} == {"default"}

    # --adapter KEY=VALUE, as agl train takes it, goes over --config; --agent-match over both
    assert export_cli("--config", config, "--adapter", 'agent_match={"checker": "critic"}') == 0
    assert {s.policy for s in read_jsonl(out)} == {"critic"}
    assert export_cli("--adapter", "credit=step", "--agent-match", "^writer$") == 0
    assert {s.policy for s in read_jsonl(out)} == {"default"}
    with pytest.raises(SystemExit, match="bad LightningRL settings: .*gama"):
        export_cli("--adapter", "gama=0.9")
    capsys.readouterr()
    with pytest.raises(SystemExit, match="no samples to export from 4 rollouts; the report above says why"):
        export_cli("--agent-match", "^writr$")  # a typo selects nothing
    assert "filtered" in capsys.readouterr().out  # the report names the agents agent_match left out

    with pytest.raises(SystemExit, match="bad LightningRL settings: unknown LightningRL setting"):
        export_cli("--config", '{"gama": 1}')
    with pytest.raises(SystemExit, match="cannot read --config"):
        export_cli("--config", "{nope")
