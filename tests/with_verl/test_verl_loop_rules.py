"""Rules of the ``agl.VERL`` loop that a stand-in config can check: per-rollout sampling in async mode with
validation, refused combinations, the metrics of a skipped step, the GPU example's smoke run length, how a
batch is padded for verl's mini and micro batches.

The config is :class:`StandInConfig`, verl's defaults for the keys the loop reads as a flat dict, so these
tests need no Hydra composition; the batch is still verl's DataProto (real GPU updates are replaced by a
backend that records what it was handed, as in test_verl_loop.py).
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

import httpx
import pytest
from openai import OpenAI

import agl
from agl.algorithm.verl import VERL, Serving, VERLConfig, VERLConfigError
from agl.testing import FakeOpenAIServer
from agl.types import Rollout

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl_gpu_train.py"

# verl 0.9's ppo_trainer.yaml values of the keys the loop reads, with the small sizes of test_verl_loop.py.
DEFAULTS: Dict[str, Any] = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "data.train_batch_size": 2,
    "data.max_prompt_length": 256,
    "data.max_response_length": 64,
    "data.shuffle": False,
    "actor_rollout_ref.rollout.n": 2,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 1.0,
    "actor_rollout_ref.rollout.val_kwargs.top_k": -1,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,  # agl's defaults (verl's are unset)
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4,
    "trainer.val_before_train": False,
    "trainer.test_freq": -1,
    "trainer.save_freq": -1,
    "trainer.total_epochs": 1,
    "trainer.total_training_steps": None,
}


class StandInConfig(VERLConfig):
    """A VERLConfig read from a flat dict of ``DEFAULTS`` plus ``changes`` (no Hydra, no verl defaults): its
    properties read through ``get``."""

    def __init__(self, **changes: Any) -> None:  # VERLConfig.__init__ composes verl's yaml: not here
        self.values = {**DEFAULTS, **changes}

    def get(self, path: str, default: Any = None) -> Any:
        return self.values.get(path, default)


class RecordingBackend:
    """Serves through the fake server and records every update."""

    def __init__(self, fake: FakeOpenAIServer) -> None:
        self.fake = fake
        self.updates: List[Any] = []
        self.started = False

    def start(self, total_steps: int) -> Serving:
        self.started = True
        return Serving(upstreams=[self.fake.base_url], model="fake-model", pad_token_id=0)

    def data_parallel_size(self) -> int:
        return 1

    def update(self, batch: Any, step: int, mini_batches: int) -> Dict[str, float]:
        self.updates.append(batch)
        return {}

    def save_checkpoint(self, step: int) -> None:
        pass

    def stop(self) -> None:
        pass


def fit(
    agent: Any,
    fake: FakeOpenAIServer,
    config: StandInConfig,
    tasks: List[Dict[str, Any]],
    *,
    val: Optional[List[Dict[str, Any]]] = None,
    adapter: Any = None,
    n_runners: int = 4,
    **options: Any,
):
    backend = RecordingBackend(fake)
    algorithm = VERL(config, backend=backend, wait_timeout=60, **options)
    trainer = agl.Trainer(
        algorithm=algorithm,
        store="memory",
        n_runners=n_runners,
        runner_mode="thread",
        progress=False,
        instrument=False,
        adapter=adapter,
    )
    summary = trainer.fit(agent, train_dataset=tasks, val_dataset=val)
    return trainer, backend, summary


def ask(llm: agl.LLM, rollout: Rollout) -> None:
    """One call that sends no sampling arguments (the proxy fills them in) and names its rollout."""
    client = OpenAI(base_url=llm.get_base_url(), api_key="unused", max_retries=0)
    client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": f"RID={rollout.rollout_id}"}])


class Overlap:
    """Makes the async groups' calls happen while validation runs: they wait for validation to start, and
    validation waits (in its agents) until they made them. Timeouts only keep a broken run from hanging."""

    def __init__(self, late_calls: int) -> None:
        self.validating = threading.Event()
        self.made = threading.Event()
        self.late_calls = late_calls
        self.lock = threading.Lock()

    def agent(self) -> Any:
        @agl.rollout
        def agent(task: Dict[str, Any], llm: agl.LLM, rollout: Rollout) -> float:
            if rollout.mode == "val":
                self.validating.set()
                self.made.wait(timeout=20)
            elif task.get("late"):
                self.validating.wait(timeout=20)
            ask(llm, rollout)
            if rollout.mode == "train" and task.get("late"):
                with self.lock:
                    self.late_calls -= 1
                    if self.late_calls == 0:
                        self.made.set()
            return float(int(rollout.rollout_id[-1], 16) % 3) / 2

        return agent


def test_async_training_rollouts_keep_their_sampling_while_validation_runs(fake_openai: FakeOpenAIServer) -> None:
    """Two async groups (q2, q3) make their calls during step 1's validation: the proxy still samples them
    at rollout.temperature (the old log-probs' temperature), validation's own calls at val_kwargs."""
    tasks = [{"id": "q0"}, {"id": "q1"}, {"id": "q2", "late": True}, {"id": "q3", "late": True}]
    overlap = Overlap(late_calls=4)  # q2 and q3, n=2 each
    trainer, backend, summary = fit(
        overlap.agent(),
        fake_openai,
        StandInConfig(**{"trainer.test_freq": 1}),
        tasks,
        val=[{"id": "v0"}, {"id": "v1"}],
        async_groups=2,
        n_runners=10,
    )
    store = trainer.store
    sent = {
        r["body"]["messages"][-1]["content"].removeprefix("RID="): r["body"]
        for r in fake_openai.requests
        if r["path"].endswith("/chat/completions")
    }
    train = store.query_rollouts(mode="train")
    val = store.query_rollouts(mode="val")
    assert len(train) == 8 and len(val) == 4 and len(backend.updates) == 2
    assert summary.steps[0].metrics["agl/async/carried_over_groups"] == 2  # q2, q3 ran on during validation
    assert {r.rollout_id: sent[r.rollout_id]["temperature"] for r in train} == {r.rollout_id: 1.0 for r in train}
    assert all(sent[r.rollout_id]["temperature"] == 0.0 for r in val)
    # each training rollout was started with a training resources version, not the latest (validation's)
    for rollout in train:
        assert rollout.resources_id is not None
        llm = store.get_resources(rollout.resources_id).resources["main_llm"]
        assert llm.sampling_parameters == {"temperature": 1.0, "max_tokens": 64}


def test_the_proxy_holds_each_sampling_profile_to_its_own_url(fake_openai: FakeOpenAIServer) -> None:
    from agl.instrumentation.proxy import LLMProxy

    with LLMProxy(fake_openai.base_url, model="m") as proxy:
        proxy.set_sampling({"temperature": 1.0, "max_tokens": 64}, "rollout.temperature")
        proxy.set_sampling({"temperature": 0.0, "max_tokens": 32}, profile="val")
        llm = proxy.as_resource()
        val_llm = agl.ProxyLLM(endpoint=proxy.profile_url("val"), model="m")
        for base in (llm.get_base_url("r1", "a1"), val_llm.get_base_url("r2", "a1"), proxy.profile_url("val")):
            httpx.post(
                f"{base}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30
            ).raise_for_status()
        unknown = httpx.post(f"{proxy.profile_url('nope')}/chat/completions", json={"messages": []}, timeout=30)
        assert unknown.status_code == 404 and "set_sampling(..., profile='nope')" in unknown.json()["error"]["message"]
        with pytest.raises(ValueError, match="sampling profile name"):
            proxy.set_sampling({}, profile="a/b")
    assert [(b["temperature"], b["max_tokens"]) for b in (r["body"] for r in fake_openai.requests)] == [
        (1.0, 64),
        (0.0, 32),
        (0.0, 32),
    ]


def test_in_reward_kl_is_refused_where_it_would_change_nothing() -> None:
    """verl applies the in-reward KL to token_level_rewards after LightningRL computed the advantages."""
    with pytest.raises(VERLConfigError, match="use_kl_in_reward=true has no effect with advantages='lightningrl'"):
        VERL(StandInConfig(**{"algorithm.use_kl_in_reward": True}))
    VERL(StandInConfig(**{"algorithm.use_kl_in_reward": True}), advantages="verl")  # verl computes them after it


@agl.rollout
def one_call_agent(task: Dict[str, Any], llm: agl.LLM, rollout: Rollout) -> float:
    ask(llm, rollout)
    return 1.0


def test_an_adapter_with_several_policies_is_refused_before_the_gpus_start(fake_openai: FakeOpenAIServer) -> None:
    backend = RecordingBackend(fake_openai)
    algorithm = VERL(StandInConfig(), backend=backend)
    trainer = agl.Trainer(
        algorithm=algorithm,
        store="memory",
        n_runners=1,
        runner_mode="thread",
        progress=False,
        instrument=False,
        adapter={"agent_match": {"writer": "author", "checker": "critic"}},
    )
    with pytest.raises(VERLConfigError, match=r"trains one policy.*names 2 \(author, critic\)"):
        trainer.fit(one_call_agent, train_dataset=[{"id": "q0"}, {"id": "q1"}])
    assert not backend.started
    trainer.adapter = {"agent_match": {"writer": "author", "checker": "author"}}  # one policy: accepted
    assert algorithm.lightningrl().agent_match == {"writer": "author", "checker": "author"}


def test_a_step_with_every_sample_dropped_still_reports_its_counts(fake_openai: FakeOpenAIServer) -> None:
    tasks = [{"id": f"q{i}"} for i in range(4)]
    _, backend, summary = fit(one_call_agent, fake_openai, StandInConfig(**{"data.max_prompt_length": 2}), tasks)
    assert backend.updates == [] and len(summary.steps) == 2
    for step in summary.steps:
        metrics = step.metrics
        assert metrics["agl/step_skipped"] == 1.0
        assert metrics["agl/rollouts"] == 4 and metrics["agl/rollouts_failed"] == 0 and metrics["agl/reward_mean"] == 1
        assert metrics["agl/lightningrl/samples"] == 4 and metrics["agl/batch/samples_in"] == 4
        assert metrics["agl/batch/dropped_prompt_too_long"] == 4 and metrics["agl/batch/samples_out"] == 0


class Ranks:
    def __init__(self, ranks: int) -> None:
        self.ranks = ranks

    def data_parallel_size(self) -> int:
        return self.ranks


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("update_micro,infer_micro,ref_micro", [(4, 4, 4), (2, 3, 5), (1, 6, 4)])
def test_every_batch_size_is_padded_to_whole_micro_batches_on_every_rank(
    ranks: int, update_micro: int, infer_micro: int, ref_micro: int
) -> None:
    # LightningRL's sample count varies per step (a group may be dropped); verl's workers assert that each
    # rank's share splits into whole micro batches (seen with the real verl on a step of 2 samples)
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    for kl in (False, True):
        config = StandInConfig(
            **{
                "actor_rollout_ref.rollout.n": 4,
                f"{actor}.ppo_mini_batch_size": 2,
                f"{actor}.ppo_micro_batch_size_per_gpu": update_micro,
                f"{rollout}.log_prob_micro_batch_size_per_gpu": infer_micro,
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ref_micro,
                f"{actor}.use_kl_loss": kl,
            }
        )
        algorithm = VERL(config, backend=Ranks(ranks))  # type: ignore[arg-type]  # only data_parallel_size is read
        for rows in range(1, 70):
            count, divisor = algorithm.mini_batches(rows)
            padded = -(-rows // divisor) * divisor
            assert padded - rows < divisor and count == max(1, round(rows / 8))
            share = padded // ranks
            assert share * ranks == padded and share % count == 0
            assert (share // count) % update_micro == 0  # the update's micro batches, per mini batch
            assert share % infer_micro == 0 and (not kl or share % ref_micro == 0)  # the log-prob passes
    dynamic = StandInConfig(**{f"{actor}.use_dynamic_bsz": True, f"{rollout}.log_prob_use_dynamic_bsz": True})
    # 5 rows in mini batches of 2 rows, no micro batch sizes
    assert VERL(dynamic, backend=Ranks(ranks)).mini_batches(5) == (2, 2 * ranks)  # type: ignore[arg-type]


def test_the_gpu_examples_smoke_run_is_two_steps() -> None:
    """docs/verl.md and the example's --help promise 2 steps: the first verl GPU check of a setup."""
    spec = importlib.util.spec_from_file_location("verl_gpu_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    smoke = dict(override.split("=", 1) for override in example.SMOKE)
    config = StandInConfig(**smoke)
    train, _ = example.datasets(config.train_batch_size, smoke=True)
    assert VERL(config).step_counts(len(train)) == (2, 2)
