"""Tasks whose values are NumPy arrays (a data set read with NumPy, or a Hugging Face data set in NumPy
format): a repeated id is checked like any other, without NumPy's ambiguous-truth error."""

from __future__ import annotations

import numpy as np
import pytest

from agl.dataset import as_tasks


def test_the_same_array_task_repeated_keeps_its_id() -> None:
    tasks = as_tasks([{"id": 1, "x": np.arange(3)}, {"id": 1, "x": np.arange(3)}])
    assert [t.task_id for t in tasks] == ["1", "1"]


def test_two_different_array_tasks_with_one_id_are_refused() -> None:
    with pytest.raises(ValueError, match="dataset items 0 and 1 have the same id '1' but differ"):
        as_tasks([{"id": 1, "x": np.arange(3)}, {"id": 1, "x": np.arange(4)}])
