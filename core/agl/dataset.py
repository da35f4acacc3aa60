"""Datasets are plain sequences (a list of dicts works); this turns their items into Tasks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, List, Union

from agl.types import Task


def as_tasks(dataset: Iterable[Any], *, prefix: str = "task") -> List[Task]:
    """Items keep their ``task_id``/``id`` when they have one, so GRPO groups stay stable across epochs;
    otherwise the position in the dataset names the task."""
    tasks: List[Task] = []
    for index, item in enumerate(dataset):
        if isinstance(item, Task):
            tasks.append(item)
            continue
        task_id = None
        if isinstance(item, dict):
            task_id = item.get("task_id", item.get("id"))
        tasks.append(Task(task_id=str(task_id) if task_id is not None else f"{prefix}-{index}", input=item))
    return tasks


def load_dataset(path: Union[str, Path]) -> List[Any]:
    """Read a ``.jsonl`` (one JSON value per line) or ``.json`` (a list) file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        items = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg}); each line must be one JSON value") from None
        return items
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list of tasks (or use .jsonl, one task per line)")
    return data
