"""Tasks whose values are NumPy arrays (a data set read with NumPy, or a Hugging Face data set in NumPy
format): a repeated id is checked like any other, without NumPy's ambiguous-truth error, and every store
keeps NumPy and torch values as the numbers and lists they hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest
import torch

import agl
from agl import semconv
from agl.runtime.dataset import as_tasks
from agl.store import InMemoryLightningStore, LightningStore, SqliteLightningStore
from agl.store.http.client import RemoteLightningStore
from agl.store.http.server import ServerThread, TokenSet, create_app


def test_the_same_array_task_repeated_keeps_its_id() -> None:
    tasks = as_tasks([{"id": 1, "x": np.arange(3)}, {"id": 1, "x": np.arange(3)}])
    assert [t.task_id for t in tasks] == ["1", "1"]


def test_two_different_array_tasks_with_one_id_are_refused() -> None:
    with pytest.raises(ValueError, match="dataset items 0 and 1 have the same id '1' but differ"):
        as_tasks([{"id": 1, "x": np.arange(3)}, {"id": 1, "x": np.arange(4)}])


# --- NumPy and torch values stored (agl.types.array_as_json) ------------------------------------------------


def _backends(tmp_path: Path) -> Dict[str, LightningStore]:
    sqlite = SqliteLightningStore(tmp_path / "served.db")
    server = ServerThread(create_app(sqlite, tokens=TokenSet({"test": "t"}))).start()
    served = RemoteLightningStore(server.url, token="t")
    served.close_server = lambda: (server.stop(wait=False), sqlite.close())  # type: ignore[attr-defined]
    return {"memory": InMemoryLightningStore(), "sqlite": SqliteLightningStore(tmp_path / "store.db"), "http": served}


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Dict[str, LightningStore]]:
    backends = _backends(tmp_path)
    yield backends
    for store in backends.values():
        store.close()
        getattr(store, "close_server", lambda: None)()


ROW = {"id": np.int64(3), "q": np.str_("a"), "x": np.arange(3), "w": np.float32(0.25), "t": torch.tensor([0.5, 1.5])}
PLAIN = {"id": 3, "q": "a", "x": [0, 1, 2], "w": 0.25, "t": [0.5, 1.5]}


def test_a_task_row_of_numpy_and_torch_values_is_stored_as_its_numbers_on_every_backend(stores: Any) -> None:
    # A Hugging Face data set in NumPy format gives such rows: before, every store refused them
    # ("Unable to serialize unknown type: numpy.int64"), after as_tasks had taken them.
    for name, store in stores.items():
        rollout = store.enqueue_rollout(ROW, metadata={"seed": np.int64(7)})
        got = store.get_rollout(rollout.rollout_id)
        assert (got.input, got.metadata) == (PLAIN, {"seed": 7}), name
        assert store.dequeue_rollout("r1").input == PLAIN, name


def test_numpy_sampling_parameters_are_stored_as_numbers_on_every_backend(stores: Any) -> None:
    llm = agl.LLM(
        endpoint="http://127.0.0.1:1/v1",
        model="m",
        sampling_parameters={"temperature": np.float32(0.5), "max_tokens": np.int64(64)},
    )
    for name, store in stores.items():
        update = store.add_resources({"main_llm": llm})
        stored = store.get_resources(update.resources_id).resources["main_llm"]
        assert stored.sampling_parameters == {"temperature": 0.5, "max_tokens": 64}, name


def test_other_unknown_values_are_still_refused_with_what_to_pass(stores: Any) -> None:
    for name, store in stores.items():
        with pytest.raises(TypeError, match="rollout input.* must be JSON-serialisable.*object"):
            store.enqueue_rollout({"q": object()})
        assert store.query_rollouts() == [], name


def test_dev_runs_a_numpy_data_set_and_the_agent_reads_plain_values(tmp_path: Path) -> None:
    seen: List[Any] = []

    @agl.rollout
    def agent(task: Dict[str, Any]) -> float:
        seen.append(task)
        agl.emit_object(np.arange(2) + task["id"])  # stored as JSON numbers, not NumPy's "[3 4]"
        return float(task["x"] == [0, 1, 2])

    store = SqliteLightningStore(tmp_path / "dev.db")
    try:
        rollouts = agl.Trainer(n_runners=1, store=store, runner_mode="thread").dev(
            agent, [ROW, {**ROW, "id": np.int64(4)}]
        )
        assert [r.status for r in rollouts] == ["succeeded", "succeeded"]
        assert [r.reward for r in rollouts] == [1.0, 1.0]
        assert [t["id"] for t in seen] == [3, 4]
        objects = [s for r in rollouts for s in store.query_spans(r.rollout_id) if s.name == semconv.SPAN_OBJECT]
        assert [json.loads(s.attributes[semconv.OBJECT_JSON]) for s in objects] == [[3, 4], [4, 5]]
    finally:
        store.close()


def test_numpy_attribute_values_set_on_a_span_are_stored_as_numbers(tmp_path: Path) -> None:
    @agl.rollout
    def agent(task: Dict[str, Any]) -> float:
        with agl.operation("score", n=np.int64(5), xs=np.arange(3), t=torch.tensor(0.5)) as op:
            op.set_output(np.arange(2))
        return 1.0

    store = SqliteLightningStore(tmp_path / "attrs.db")
    try:
        (done,) = agl.Trainer(n_runners=1, store=store, runner_mode="thread").dev(agent, [{"q": 1}])
        (span,) = [s for s in store.query_spans(done.rollout_id) if s.name == semconv.SPAN_OPERATION]
        assert (span.attributes["n"], span.attributes["xs"], span.attributes["t"]) == (5, [0, 1, 2], 0.5)
        assert json.loads(span.attributes[semconv.OPERATION_OUTPUT]) == [0, 1]
    finally:
        store.close()
