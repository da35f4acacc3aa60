"""Datasets are plain sequences (a list of dicts works) or task files; this turns their items into Tasks."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from agl.types import RolloutMode, Task

FORMATS = ".jsonl (one JSON value per line), .json (a list), .parquet (needs pyarrow) or .csv (values as text)"
_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


#: The id prefix of tasks without an id, per dataset mode: ``task-<index>`` for training, ``val-<index>``
#: for validation, so that a validation task never shares an id with a training task; ``agl dev``'s runs
#: (mode ``dev``) number their tasks as training does, so a task keeps its id from dev run to training.
ID_PREFIXES: Dict[str, str] = {"train": "task", "val": "val", "dev": "task"}


def as_tasks(dataset: Iterable[Any], *, mode: RolloutMode = "train", prefix: Optional[str] = None) -> List[Task]:
    """Items keep their ``task_id``/``id`` when they have one, so GRPO groups stay stable across epochs;
    otherwise the position in the dataset names the task: ``task-<index>`` in a training dataset,
    ``val-<index>`` in a validation one (``mode="val"``; :data:`ID_PREFIXES`), so the two never collide.
    ``prefix`` overrides the mode's prefix.

    Rollouts are grouped by task id for the advantages, so one id must name one task: two different items
    with the same id raise (the same item repeated is fine: it is the same task).

    A string or path names a task file (:func:`load_dataset`): iterated, a string would give one task per
    character. A dict is refused (iterated, it would give its keys as tasks): pass a list of dicts.
    """
    if prefix is None:
        if mode not in ID_PREFIXES:
            raise ValueError(f"mode must be one of {sorted(ID_PREFIXES)}, got {mode!r}")
        prefix = ID_PREFIXES[mode]
    if isinstance(dataset, (str, os.PathLike)):
        dataset = _load_named(dataset)
    if hasattr(dataset, "columns") and not isinstance(dataset, (list, tuple)):  # pandas, pyarrow, polars tables
        raise TypeError(
            f"a {type(dataset).__name__} is not a list of tasks (iterating it gives its columns): pass its rows, "
            "e.g. pandas df.to_dict(orient='records'), pyarrow table.to_pylist(), polars df.to_dicts()"
        )
    if isinstance(dataset, Mapping):
        columns = all(isinstance(v, (list, tuple)) for v in dataset.values()) and len(dataset) > 0
        example = (
            "; for columns {name: [values]} (pandas' df.to_dict(), a Hugging Face dataset[:] slice) that is "
            "[dict(zip(d, row)) for row in zip(*d.values())]"
            if columns
            else "; for one task, [d]"
        )
        raise TypeError(
            f"a {type(dataset).__name__} is not a list of tasks (iterating it gives its keys, "
            f"{list(dataset)[:3]!r}{'...' if len(dataset) > 3 else ''}, as tasks): pass a list of dicts, one per "
            f"task{example}"
        )
    tasks: List[Task] = []
    first: Dict[str, Tuple[int, Any]] = {}
    for index, item in enumerate(dataset):
        if isinstance(item, Task):
            tasks.append(item)
            continue
        task_id = None
        if isinstance(item, dict):
            task_id = item.get("task_id", item.get("id"))
        if task_id is None:
            tasks.append(Task(task_id=f"{prefix}-{index}", input=item))
            continue
        task_id = str(task_id)
        seen = first.setdefault(task_id, (index, item))
        if seen[1] is not item and not _same_task(seen[1], item):
            raise ValueError(
                f"dataset items {seen[0]} and {index} have the same id {task_id!r} but differ: rollouts are "
                "grouped by task id for the advantages, so each id must name one task (make the ids unique, "
                "or drop them to number the tasks by position)"
            )
        tasks.append(Task(task_id=task_id, input=item))
    return tasks


def _same_task(a: Any, b: Any) -> bool:
    """``a == b``; for rows whose values compare element-wise (NumPy arrays), their reprs."""
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # "the truth value of an array ... is ambiguous"
        return repr(a) == repr(b)


def _load_named(name: Union[str, os.PathLike[str]]) -> List[Any]:
    path = Path(name)
    if not path.exists() and path.suffix.lower() not in _SUFFIXES:
        raise ValueError(
            f"the dataset {str(name)!r} is a string, not a list of tasks, and no such task file exists: pass a list "
            f"(e.g. of dicts), or the path of a task file: {FORMATS}"
        )
    return load_dataset(path)


def load_dataset(path: Union[str, Path]) -> List[Any]:
    """Read a dataset file; the format comes from the suffix (see :data:`FORMATS`)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of tasks (or use .jsonl, one task per line)")
        return data
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8-sig") as f:
            return list(csv.DictReader(f))
    raise ValueError(f"unknown dataset format {path.suffix or '(no suffix)'!r}: use {FORMATS}")


def _read_jsonl(path: Path) -> List[Any]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if line.strip():
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}:{number}: not valid JSON ({exc.msg}); each line must be one JSON value"
                ) from None
    return items


def _read_parquet(path: Path) -> List[Any]:
    """A Parquet file's rows as dicts (the format VERL's data sets come in)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f'reading {path} needs pyarrow, which is not installed: pip install "agl[parquet]" (or pyarrow), '
            "or convert the file to .jsonl"
        ) from None
    return pq.read_table(str(path)).to_pylist()
