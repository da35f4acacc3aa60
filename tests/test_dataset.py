"""Task files and datasets: every format `--data` reads, and the mistakes that would train on the wrong
groups (one id for two different tasks, a table iterated as its columns) refused with what to do."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import agl
from agl.runtime.dataset import as_tasks, load_dataset

ROWS = [{"id": "a", "question": "1+1", "answer": 2}, {"id": "b", "question": "2+3", "answer": 5}]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".JSONL"])
def test_every_format_reads_the_same_tasks(tmp_path, suffix):
    path = tmp_path / f"tasks{suffix}"
    if suffix.lower() == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    else:
        pq.write_table(pa.Table.from_pylist(ROWS), str(path))
    assert load_dataset(path) == ROWS
    assert [(t.task_id, t.input) for t in as_tasks(load_dataset(path))] == [("a", ROWS[0]), ("b", ROWS[1])]


def test_a_task_file_path_is_a_dataset_and_any_other_string_is_refused(tmp_path):
    """``trainer.dev(agent, "tasks.jsonl")`` reads the file; iterated, the string gave one task per character."""
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    assert [t.task_id for t in as_tasks(str(path))] == [t.task_id for t in as_tasks(path)] == ["a", "b"]
    trainer = agl.Trainer(store="memory", runner_mode="thread", progress=False)
    summaries = trainer.dev(agl.rollout(lambda task: float(task["answer"])), str(path))
    assert [(s.task_id, s.reward) for s in summaries] == [("a", 2.0), ("b", 5.0)]
    with pytest.raises(ValueError, match="the dataset 'spider_sql_tasks' is a string, not a list of tasks"):
        trainer.dev(agl.rollout(lambda task: 1.0), "spider_sql_tasks")
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        as_tasks(tmp_path / "missing.jsonl")


def test_an_algorithm_given_by_name_is_refused_with_what_to_pass():
    with pytest.raises(TypeError, match="algorithm must be an algorithm object, got 'verl_grpo': agl.TorchGRPO"):
        agl.Trainer(algorithm="verl_grpo", store="memory")


def test_csv_rows_are_tasks_with_text_values(tmp_path):
    path = tmp_path / "tasks.csv"
    path.write_text('id,question,answer\na,1+1,2\nb,"2, plus 3",5\n')
    assert load_dataset(path) == [
        {"id": "a", "question": "1+1", "answer": "2"},
        {"id": "b", "question": "2, plus 3", "answer": "5"},
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_byte_order_mark_is_not_part_of_the_first_task(tmp_path, suffix):
    # Excel and Windows editors start UTF-8 files with one: it must neither break JSON nor rename a column
    path = tmp_path / f"tasks{suffix}"
    body = {".jsonl": '{"id": "a", "q": "1"}\n', ".json": '[{"id": "a", "q": "1"}]', ".csv": "id,q\na,1\n"}[suffix]
    path.write_text(body, encoding="utf-8-sig")
    assert load_dataset(path) == [{"id": "a", "q": "1"}]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("tasks.txt", "[]", r"unknown dataset format '\.txt': use \.jsonl"),
        ("tasks", "[]", r"unknown dataset format '\(no suffix\)'"),
        ("tasks.json", '[{"id": 1},\n {"id": }]', r"tasks\.json:2: not valid JSON"),
        ("tasks.json", '{"id": 1}', "must hold a JSON list of tasks"),
        ("tasks.jsonl", '{"id": 1}\n{"id": \n', r"tasks\.jsonl:2: not valid JSON"),
    ],
)
def test_bad_files_say_what_is_wrong(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_dataset(path)


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    path = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), str(path))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import -> ImportError, as when not installed
    with pytest.raises(ValueError, match=r'needs pyarrow.*pip install "agl\[parquet\]"'):
        load_dataset(path)


def test_agl_dev_reads_a_parquet_task_file(tmp_path, capsys):
    from agl.cli import main

    path = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), str(path))
    agent = tmp_path / "echo_agent.py"
    agent.write_text("import agl\n\n@agl.rollout\ndef echo(task):\n    return float(task['answer'])\n")
    assert (
        main(
            ["dev", f"{agent}:echo", "--data", str(path), "--store", str(tmp_path / "s.db"), "--runner-mode", "thread"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "succeeded" in out and "5" in out


def test_one_id_for_two_different_tasks_is_refused():
    # rollouts are grouped by task id for the advantages: two prompts in one group would be compared
    with pytest.raises(ValueError, match=r"dataset items 0 and 2 have the same id '7' but differ"):
        as_tasks([{"id": 7, "q": "a"}, {"id": 8, "q": "b"}, {"id": "7", "q": "c"}])


def test_the_same_task_repeated_keeps_its_id():
    tasks = as_tasks([{"id": 1, "q": "a"}, {"id": 1, "q": "a"}, {"q": "x"}])
    assert [t.task_id for t in tasks] == ["1", "1", "task-2"]


def test_a_table_is_refused_with_how_to_pass_its_rows():
    table = pa.Table.from_pylist(ROWS)
    with pytest.raises(TypeError, match=r"Table is not a list of tasks .*table\.to_pylist\(\)"):
        as_tasks(table)
    with pytest.raises(TypeError, match="not a list of tasks"):
        agl.Trainer(store="memory", runner_mode="thread", progress=False).dev(agl.rollout(lambda task: 1.0), table)


def test_a_dict_is_refused_with_how_to_pass_a_list_of_tasks():
    """Iterated, a dict gave its keys: the agent ran on the tasks 'question' and 'answer', stored and trained on."""
    with pytest.raises(
        TypeError,
        match=r"a dict is not a list of tasks \(iterating it gives its keys, \['question', "
        r"'answer'\], as tasks\): pass a list of dicts, one per task; for one task, \[d\]",
    ):
        as_tasks({"question": "2+2?", "answer": "4"})
    columns = {"question": ["2+2?", "3+3?"], "answer": ["4", "6"]}
    with pytest.raises(TypeError, match=r"for columns .*\[dict\(zip\(d, row\)\) for row in zip\(\*d\.values\(\)\)\]"):
        as_tasks(columns)
    rows = [dict(zip(columns, row)) for row in zip(*columns.values())]  # the advice works
    assert [t.input for t in as_tasks(rows)] == [
        {"question": "2+2?", "answer": "4"},
        {"question": "3+3?", "answer": "6"},
    ]
    got = []
    with pytest.raises(TypeError, match="not a list of tasks"):
        agl.Trainer(store="memory", runner_mode="thread", progress=False).dev(agl.rollout(got.append), columns)
    assert got == []


def test_validation_tasks_without_ids_are_named_apart_from_training_ones():
    """Train item 0 and val item 0 would otherwise both be ``task-0``: one GRPO group for two questions."""
    rows = [{"q": "a"}, {"id": "given", "q": "b"}]
    assert [t.task_id for t in as_tasks(rows)] == ["task-0", "given"]
    assert [t.task_id for t in as_tasks(rows, mode="train")] == ["task-0", "given"]
    assert [t.task_id for t in as_tasks(rows, mode="val")] == ["val-0", "given"]  # ids given are kept
    assert [t.task_id for t in as_tasks(rows, mode="val", prefix="eval")] == ["eval-0", "given"]
    with pytest.raises(ValueError, match="mode must be one of"):
        as_tasks(rows, mode="test")  # type: ignore[arg-type]
    # Trainer.dev / run_tasks name them by the mode they run in
    trainer = agl.Trainer(store="memory", runner_mode="thread", progress=False)
    summaries = trainer.dev(agl.rollout(lambda task: 1.0), rows, mode="val", print_table=False)
    assert [s.task_id for s in summaries] == ["val-0", "given"]
