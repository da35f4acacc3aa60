"""The ``agl.VERL`` loop on CPU: real Trainer, runners, store, proxy and fake vLLM-style server, real verl
DataProto; only the GPU update is replaced, by a backend that records what it was handed.

Agents here are not instrumented (``Trainer(instrument=False)``): every llm span and token id comes from the
proxy, as with an agent that knows nothing about agl except its base URL.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import httpx
import pytest
import torch
from openai import OpenAI

import agl
from agl import semconv
from agl.algorithm.verl import VERL, Serving
from agl.lightningrl.advantages import grpo_advantages
from agl.lightningrl.types import Sample
from agl.testing import FakeOpenAIServer
from agl.types import ProxyLLM, Rollout

TASKS = [{"id": f"q{i}", "question": f"what is {i} + {i}?", "slow": False} for i in range(4)]


def config(**changes: Any) -> List[str]:
    base = {
        "algorithm.adv_estimator": "grpo",
        "data.train_batch_size": 2,
        "data.max_prompt_length": 256,
        "data.max_response_length": 64,
        "data.shuffle": "false",
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
        "actor_rollout_ref.actor.optim.lr": "1e-6",
        "actor_rollout_ref.model.path": "Qwen/Qwen2.5-0.5B-Instruct",
        "trainer.n_gpus_per_node": 1,
        "trainer.val_before_train": "true",
        "trainer.test_freq": 2,
        "trainer.save_freq": 3,
        "trainer.total_epochs": 2,
    }
    base.update(changes)
    return [f"{k}={v}" for k, v in base.items()]


@agl.rollout
def qa_agent(task: Dict[str, Any], llm: agl.LLM, rollout: Rollout) -> float:
    """One LLM call through ``llm.get_base_url()``; the reward varies by rollout so groups have advantages."""
    if task.get("slow"):
        time.sleep(1.5)
    client = OpenAI(base_url=llm.get_base_url(), api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}], **llm.sampling_parameters
    )
    assert answer.choices[0].message.content
    return float(int(rollout.rollout_id[-1], 16) % 3) / 2


class RecordingBackend:
    """Stands in for the GPUs: serves through the fake server and records every update."""

    def __init__(self, fake: FakeOpenAIServer, dp: int = 2) -> None:
        self.fake = fake
        self.dp = dp
        self.algorithm: VERL
        self.updates: List[Dict[str, Any]] = []
        self.saved: List[int] = []
        self.calls: List[str] = []

    def start(self, total_steps: int) -> Serving:
        self.calls.append(f"start {total_steps}")
        return Serving(upstreams=[self.fake.base_url], model="fake-model", pad_token_id=0)

    def data_parallel_size(self) -> int:
        return self.dp

    def update(self, batch: Any, step: int, mini_batches: int) -> Dict[str, float]:
        proxy = self.algorithm.proxy
        self.updates.append(
            {
                "batch": batch,
                "step": step,
                "mini_batches": mini_batches,
                "paused": proxy.paused,
                "in_flight": proxy.in_flight,
            }
        )
        return {"actor/pg_loss": float(step)}

    def save_checkpoint(self, step: int) -> None:
        self.saved.append(step)

    def stop(self) -> None:
        self.calls.append("stop")


def train(
    fake: FakeOpenAIServer,
    tasks: List[Dict[str, Any]],
    overrides: List[str],
    span_retention_steps: Optional[int] = None,
    **options: Any,
):
    backend = RecordingBackend(fake)
    algorithm = VERL(overrides, backend=backend, wait_timeout=60, **options)
    backend.algorithm = algorithm
    trainer = agl.Trainer(
        algorithm=algorithm,
        store="memory",
        n_runners=4,
        runner_mode="thread",
        progress=False,
        instrument=False,
        span_retention_steps=span_retention_steps,
    )
    summary = trainer.fit(qa_agent, train_dataset=tasks, val_dataset=tasks[:2])
    return trainer, algorithm, backend, summary


def test_synchronous_steps_hand_verl_exactly_the_recorded_calls(fake_openai: FakeOpenAIServer) -> None:
    trainer, algorithm, backend, summary = train(fake_openai, TASKS, config())
    store = trainer.store

    # 4 tasks, batches of 2, 2 epochs; validation before training and every 2 steps; checkpoints at 3 and the end
    assert [u["step"] for u in backend.updates] == [1, 2, 3, 4]
    assert backend.calls == ["start 4", "stop"] and backend.saved == [3, 4]
    assert [v["step"] for v in summary.validations] == [0.0, 2.0, 4.0]
    assert all(u["paused"] and u["in_flight"] == 0 for u in backend.updates)  # weights change with no call running
    assert not algorithm.proxy.paused

    for update in backend.updates:
        data = update["batch"]
        real = ~torch.from_numpy(data.non_tensor_batch["agl_padding"].astype(bool))
        assert len(data) % (backend.dp * update["mini_batches"]) == 0
        assert int(real.sum()) == 4  # 2 tasks x n=2 rollouts x 1 call each
        uids = list(data.non_tensor_batch["uid"][real.numpy()])
        assert sorted(uids.count(u) for u in set(uids)) == [2, 2]  # two GRPO groups of n=2
        rollout_ids = list(data.non_tensor_batch["rollout_id"][real.numpy()])
        rollouts = {r: store.get_rollout(r) for r in rollout_ids}
        assert all(r.status == "succeeded" and r.mode == "train" for r in rollouts.values())
        # the token ids verl trains on are the ones the proxy recorded from the server
        for row, rollout_id in zip(real.nonzero().flatten().tolist(), rollout_ids):
            (span,) = [s for s in store.query_spans(rollout_id) if s.kind == "llm"]
            assert span.attributes[semconv.FRAMEWORK] == "agl.proxy"
            prompt = span.attributes[semconv.PROMPT_TOKEN_IDS]
            response = span.attributes[semconv.RESPONSE_TOKEN_IDS]
            mask = data.batch["attention_mask"][row]
            assert data.batch["prompts"][row][mask[:256].bool()].tolist() == prompt
            assert data.batch["responses"][row][: len(response)].tolist() == response
        # the advantages are LightningRL's rollout-level GRPO over these rollouts' rewards
        expected = grpo_advantages(
            [
                Sample(rid, rollouts[rid].task_id, "default", [1], [1], [1], reward=rollouts[rid].final_reward)
                for rid in dict.fromkeys(rollout_ids)
            ]
        )
        by_rollout = {s.rollout_id: s.advantage for s in expected}
        got = data.batch["advantages"][real][:, 0].tolist()
        assert got == pytest.approx([by_rollout[r] for r in rollout_ids], abs=1e-5)

    step_metrics = summary.steps[0].metrics
    assert step_metrics["agl/batch/samples_out"] == 4 and step_metrics["actor/pg_loss"] == 1.0
    assert step_metrics["agl/async/max_staleness"] == 0 and step_metrics["agl/async/carried_over_groups"] == 0

    # agents got the proxy through a resources version; validation used rollout.val_kwargs (temperature 0)
    llm = store.get_resources().resources["main_llm"]
    assert isinstance(llm, ProxyLLM) and llm.endpoint.startswith("http://127.0.0.1:") and llm.model == "fake-model"
    assert llm.sampling_parameters == {"temperature": 1.0, "max_tokens": 64}
    val = [r for r in store.query_rollouts(mode="val")]
    assert len(val) == 6
    val_llm = store.get_resources(val[0].resources_id).resources["main_llm"]
    assert val_llm.sampling_parameters == {"temperature": 0.0, "max_tokens": 64}
    sent = [r["body"] for r in fake_openai.requests if r["path"].endswith("/chat/completions")]
    assert all(body["return_token_ids"] and body["logprobs"] for body in sent)


def test_total_training_steps_sets_the_run_length_and_the_schedule_as_in_verl(fake_openai: FakeOpenAIServer) -> None:
    """verl's RayPPOTrainer: trainer.total_training_steps replaces the epochs' count (4 here) for the run
    and for the LR schedule; the data still ends a run that asks for more than total_epochs give."""
    quiet = {"trainer.val_before_train": "false", "trainer.save_freq": -1}
    _, _, backend, _ = train(fake_openai, TASKS, config(**quiet, **{"trainer.total_training_steps": 1}))
    assert backend.calls == ["start 1", "stop"] and [u["step"] for u in backend.updates] == [1]

    _, _, backend, _ = train(fake_openai, TASKS, config(**quiet, **{"trainer.total_training_steps": 6}))
    assert backend.calls == ["start 6", "stop"] and [u["step"] for u in backend.updates] == [1, 2, 3, 4]

    with pytest.raises(agl.algorithm.verl.VERLConfigError, match="total_training_steps must be a positive integer"):
        VERL(config(**{"trainer.total_training_steps": 0}))


@agl.rollout
def own_sampling_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """Two calls: one passes ``llm.sampling_parameters`` on, one samples its own way (temperature 0.2,
    1000 tokens) and sends no top_k."""
    client = OpenAI(base_url=llm.get_base_url(), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
    client.chat.completions.create(model=llm.model, messages=messages, temperature=0.2, max_tokens=1000)
    return 1.0


def test_requests_are_sampled_as_verls_agent_loop_samples(fake_openai: FakeOpenAIServer, caplog) -> None:
    """verl's agent loop samples at rollout.temperature / top_p / top_k and caps each response at
    data.max_response_length: the published resource says so, and the proxy holds agents to it (a larger
    max_tokens is lowered, top_k filled in); an agent at its own temperature is warned about, once."""
    backend = RecordingBackend(fake_openai)
    overrides = config(
        **{
            "trainer.val_before_train": "false",
            "trainer.total_training_steps": 1,
            "actor_rollout_ref.rollout.top_k": 20,
        }
    )
    algorithm = VERL(overrides, backend=backend, wait_timeout=60)
    backend.algorithm = algorithm
    trainer = agl.Trainer(
        algorithm=algorithm, store="memory", n_runners=4, runner_mode="thread", progress=False, instrument=False
    )
    with caplog.at_level("WARNING"):
        trainer.fit(own_sampling_agent, train_dataset=TASKS)

    llm = trainer.store.get_resources().resources["main_llm"]
    assert llm.sampling_parameters == {"temperature": 1.0, "max_tokens": 64}  # top_k: no OpenAI SDK argument
    sent = [r["body"] for r in fake_openai.requests if r["path"].endswith("/chat/completions")]
    assert len(sent) == 8  # 2 tasks x n=2 x 2 calls
    assert all(body["top_k"] == 20 and body["max_tokens"] == 64 for body in sent)
    assert sorted(body["temperature"] for body in sent) == [0.2] * 4 + [1.0] * 4  # warned, not overridden
    warnings = [r.getMessage() for r in caplog.records if "temperature=0.2" in r.getMessage()]
    assert len(warnings) == 1 and "actor_rollout_ref.rollout.temperature=1.0" in warnings[0], warnings


def test_the_proxy_caps_a_token_limit_of_any_name(fake_openai: FakeOpenAIServer) -> None:
    from agl.instrumentation.proxy import LLMProxy

    with LLMProxy(fake_openai.base_url) as proxy:
        proxy.set_sampling({"temperature": 1.0, "max_tokens": 64})
        for path, body in [
            ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100}),
            ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
            ("responses", {"input": "hi", "max_output_tokens": 500}),
            ("completions", {"prompt": "hi"}),
        ]:
            httpx.post(f"{proxy.base_url}/{path}", json={"model": "m", **body}, timeout=30).raise_for_status()
    sent = [r["body"] for r in fake_openai.requests]
    assert [
        sent[0]["max_completion_tokens"],
        sent[1]["max_tokens"],
        sent[2]["max_output_tokens"],
        sent[3]["max_tokens"],
    ] == [64, 8, 64, 64]
    assert "max_tokens" not in sent[0] and "max_tokens" not in sent[2] and all(b["temperature"] == 1.0 for b in sent)


def test_span_retention_deletes_the_spans_of_steps_verl_has_learnt_from(fake_openai: FakeOpenAIServer) -> None:
    trainer, _, backend, _ = train(fake_openai, TASKS, config(), span_retention_steps=1)
    store = trainer.store
    trained = []
    for update in backend.updates:
        data = update["batch"]
        real = ~data.non_tensor_batch["agl_padding"].astype(bool)
        trained.append(sorted(set(data.non_tensor_batch["rollout_id"][real])))
    assert [len(ids) for ids in trained] == [4, 4, 4, 4], "every step trained on its recorded calls"
    spans = [[len(store.query_spans(r)) for r in ids] for ids in trained]
    assert spans[:3] == [[0] * 4] * 3 and all(n >= 1 for n in spans[3]), spans
    assert all(store.query_spans(r.rollout_id) for r in store.query_rollouts(mode="val")), "validation spans stay"
    assert all(store.get_rollout(r).final_reward is not None for ids in trained for r in ids)


def test_async_groups_carry_unfinished_groups_over_to_the_next_step(fake_openai: FakeOpenAIServer) -> None:
    tasks = [dict(TASKS[0], slow=True)] + TASKS[1:]
    _, _, backend, summary = train(
        fake_openai, tasks, config(**{"trainer.total_epochs": 1, "trainer.val_before_train": "false"}), async_groups=1
    )
    first, second = backend.updates
    assert set(
        first["batch"].non_tensor_batch["uid"][~first["batch"].non_tensor_batch["agl_padding"].astype(bool)]
    ) == {"q1", "q2"}
    assert "q0" in set(second["batch"].non_tensor_batch["uid"])  # the slow group, trained one step later
    m1, m2 = (s.metrics for s in summary.steps)
    assert m1["agl/async/carried_over_groups"] == 1 and m1["agl/async/max_staleness"] == 0
    assert m2["agl/async/max_staleness"] == 1  # generated (at least partly) before the first update


def test_verl_advantage_mode_leaves_advantages_to_verl(fake_openai: FakeOpenAIServer) -> None:
    _, _, backend, _ = train(
        fake_openai,
        TASKS,
        config(**{"trainer.total_epochs": 1, "trainer.val_before_train": "false"}),
        advantages="verl",
    )
    data = backend.updates[0]["batch"]
    assert "advantages" not in data.batch.keys() and data.batch["token_level_rewards"].sum() >= 0


def test_too_few_tasks_for_a_batch_is_refused_before_anything_starts(fake_openai: FakeOpenAIServer) -> None:
    backend = RecordingBackend(fake_openai)
    algorithm = VERL(
        config(**{"data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8}), backend=backend
    )
    trainer = agl.Trainer(
        algorithm=algorithm, store="memory", n_runners=1, runner_mode="thread", progress=False, instrument=False
    )
    with pytest.raises(agl.algorithm.verl.VERLConfigError, match="fewer than data.train_batch_size=8"):
        trainer.fit(qa_agent, train_dataset=TASKS)
    assert backend.calls == []


def test_without_a_backend_a_cpu_machine_gets_the_gpu_error(fake_openai: FakeOpenAIServer) -> None:
    trainer = agl.Trainer(
        algorithm=VERL(config()), store="memory", n_runners=1, runner_mode="thread", progress=False, instrument=False
    )
    with pytest.raises(agl.algorithm.verl.VERLConfigError, match="cannot run here"):
        trainer.fit(qa_agent, train_dataset=TASKS)


@agl.rollout
def failing_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    raise RuntimeError("the environment is down")


def test_steps_with_nothing_to_train_are_skipped_then_training_stops(fake_openai: FakeOpenAIServer) -> None:
    from agl.algorithm.verl.batch import NoTrainableSamples

    backend = RecordingBackend(fake_openai)
    algorithm = VERL(config(**{"trainer.val_before_train": "false"}), backend=backend, wait_timeout=60)
    backend.algorithm = algorithm
    trainer = agl.Trainer(
        algorithm=algorithm, store="memory", n_runners=4, runner_mode="thread", progress=False, instrument=False
    )
    with pytest.raises(NoTrainableSamples, match="3 steps in a row had nothing to train on"):
        trainer.fit(failing_agent, train_dataset=TASKS)
    assert backend.updates == [] and backend.calls == ["start 4", "stop"]
    assert [s.metrics["agl/step_skipped"] for s in algorithm.summary.steps] == [1.0, 1.0]
    assert not algorithm.proxy.paused
