"""TorchGRPO end to end with real parts: the tiny Llama behind a real PolicyServer on 127.0.0.1, the real
``openai`` client instrumented by agl, a real SQLite store, thread runners, LightningRL, checkpoints."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import openai
import pytest
import torch
from with_torch_helpers import thread_trainer, tiny_grpo

import agl
from agl.algorithm.checkpoint import CheckpointError, latest_checkpoint
from agl.algorithm.grpo_loss import collate
from agl.algorithm.torch_grpo import TorchGRPO
from agl.serving.models import load_policy
from agl.store.base import EnqueueRequest

pytestmark = pytest.mark.usefixtures("instrumented")  # agl.instrument() around each test: tests/conftest.py

TASKS = [{"task_id": f"t{i}", "question": f"Say something about the number {i}."} for i in range(6)]
VAL = [{"task_id": f"v{i}", "question": f"Count to {i}."} for i in range(3)]

SERVED: List[Dict[str, Any]] = []  # what the server sent back, recorded by the agent itself
RUNS: Dict[str, int] = {}  # rollouts run per task so far
_lock = threading.Lock()


@agl.rollout
def chat_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """One chat call. The reward alternates over a task's rollouts (0, 1, 0, ...), so every GRPO group has
    different rewards and every step trains (a random model's answers give no reliable signal)."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task["question"]}]
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        completion = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
    choice = completion.choices[0]
    ids = {"prompt_token_ids": completion.model_extra["prompt_token_ids"], "token_ids": choice.model_extra["token_ids"]}
    return _served(task, {"messages": messages, **ids, "logprobs": [t.logprob for t in choice.logprobs.content]})


def _served(task: Dict[str, Any], served: Dict[str, Any]) -> float:
    """Keep what the server sent; the reward alternates over the task's rollouts (0, 1, 0, ...)."""
    with _lock:
        SERVED.append(served)
        RUNS[task["task_id"]] = RUNS.get(task["task_id"], 0) + 1
        return float(RUNS[task["task_id"]] % 2 == 0)


@pytest.fixture(autouse=True)
def nothing_served_yet() -> None:
    """Each test starts with no recorded answers and no rollouts counted."""
    SERVED.clear()
    RUNS.clear()


def _algo(tmp_path: Path, **overrides: Any) -> TorchGRPO:
    return tiny_grpo(tmp_path, **{"group_size": 3, "steps": 2, **overrides})


def _record_updates(algo: TorchGRPO) -> List[Any]:
    """The samples every update of ``algo`` is fed, in order (the update itself runs as usual)."""
    fed: List[Any] = []
    update = algo.update

    def recording_update(samples: Any) -> Dict[str, float]:
        fed.extend(samples)
        return update(samples)

    algo.update = recording_update  # type: ignore[method-assign]
    return fed


def test_fit_trains_evaluates_and_writes_metrics(tmp_path: Path) -> None:
    seen: List[Dict[str, Any]] = []
    algo = _algo(tmp_path, on_step=seen.append)
    result = thread_trainer(tmp_path, algo).fit(chat_agent, TASKS, val_dataset=VAL)

    assert result.steps == 2
    assert result.before is not None and result.after is not None
    assert result.before.n == result.after.n == len(VAL)
    rows = result.rows
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollouts"] == 6 and r["failed_rollouts"] == 0 for r in rows)
    assert all(r["samples"] == 6 for r in rows)  # one chat call per rollout, all selected
    assert all(r["live_samples"] == 6 and r["optimizer_steps"] == 1 for r in rows)
    # The server answered every request of step 2 with the policy of step 1's update.
    assert rows[1]["policy_version"] > rows[0]["policy_version"] > 0
    assert seen == rows  # on_step got every row as logged (a tracker such as wandb.log can take it)
    assert algo.server.version == rows[1]["policy_version"]
    csv_lines = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("step,") and len(csv_lines) == 4  # step 0: the untrained policy's evaluation
    header = csv_lines[0].split(",")
    untrained = dict(zip(header, csv_lines[1].split(",")))
    assert untrained["step"] == "0" and untrained["val_success"] != "" and untrained["samples"] == ""
    first = dict(zip(header, csv_lines[2].split(",")))
    assert first["samples"] == "6" and first["optimizer_steps"] == "1"  # counts as counts, not "6.0"
    assert all(len(v.replace("-", "").replace(".", "").lstrip("0")) <= 10 for k, v in first.items() if "e" not in v)
    assert result.curve_png is not None and result.curve_png.stat().st_size > 1000
    log = (tmp_path / "run" / "train.log").read_text()
    assert "eval at step 0" in log and "eval at step 2" in log and "step 2/2" in log


def test_served_token_ids_are_the_ids_the_trainer_feeds_the_model(tmp_path: Path) -> None:
    """No retokenization drift: prompt ids = the chat template of the messages the agent sent, response ids
    = the ids the server sampled, and those exact ids are what the loss's forward pass sees."""
    model, tokenizer = load_policy("tiny", device="cpu", seed=0)
    algo = _algo(tmp_path, model=(model, tokenizer), steps=1)
    fed = _record_updates(algo)
    thread_trainer(tmp_path, algo).fit(chat_agent, TASKS[:2])

    assert len(fed) == 6 and len(SERVED) == 6
    by_response = {tuple(s["token_ids"]): s for s in SERVED}
    for sample in fed:
        served = by_response[tuple(sample.response_ids)]
        template = tokenizer.apply_chat_template(served["messages"], tokenize=False, add_generation_prompt=True)
        assert sample.prompt_ids == served["prompt_token_ids"]
        assert sample.prompt_ids == tokenizer(template, add_special_tokens=False)["input_ids"]
        assert sample.response_logprobs == pytest.approx(served["logprobs"])
        # the row the trainer's forward pass gets, padding removed
        batch = collate([sample], tokenizer.pad_token_id)
        assert batch.input_ids[0].tolist() == served["prompt_token_ids"] + served["token_ids"]
    # The server's logprobs are the trainer's: same ids, same distribution (log_softmax(logits / T)).
    assert algo.state.rows[0]["logprob_drift"] < 1e-4


@agl.rollout
def token_in_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """Applies the chat template itself and sends the prompt as token ids to the legacy Completions API (as
    rLLM- and verl-style agent loops do), with the trainer's sampling parameters as published."""
    tokenizer = TOKENIZER["tokenizer"]
    messages = [{"role": "user", "content": task["question"]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        completion = client.completions.create(model=llm.model, prompt=prompt, **llm.sampling_parameters)
    choice = completion.choices[0]
    ids = {"prompt_token_ids": choice.model_extra["prompt_token_ids"], "token_ids": choice.model_extra["token_ids"]}
    return _served(task, {"prompt": prompt, **ids, "logprobs": choice.logprobs.token_logprobs})


TOKENIZER: Dict[str, Any] = {}


def test_a_token_in_agent_on_the_completions_api_trains_on_its_own_ids(tmp_path: Path) -> None:
    model, tokenizer = load_policy("tiny", device="cpu", seed=0)
    TOKENIZER["tokenizer"] = tokenizer
    algo = _algo(tmp_path, model=(model, tokenizer), steps=1)
    fed = _record_updates(algo)
    thread_trainer(tmp_path, algo).fit(token_in_agent, TASKS[:2])

    assert len(fed) == len(SERVED) == 6 and algo.state.rows[0]["optimizer_steps"] == 1
    by_response = {tuple(s["token_ids"]): s for s in SERVED}
    for sample in fed:
        served = by_response[tuple(sample.response_ids)]
        assert sample.prompt_ids == served["prompt"] == served["prompt_token_ids"]  # the agent's own ids
        assert sample.response_logprobs == pytest.approx(served["logprobs"])
    assert algo.state.rows[0]["logprob_drift"] < 1e-4  # the served logprobs are the trainer's


VERDICT_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "schema": {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
            "required": ["answer", "sure"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("old_logprobs", ["sample", "recompute"])
def test_a_structured_output_agent_trains_and_restricted_logprobs_are_explained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, old_logprobs: str
) -> None:
    """The agent asks for a JSON schema: the server draws from the tokens the grammar allows and reports
    those logprobs, which the trainer's unrestricted forward pass cannot match. "sample" says so once and
    names the fix; "recompute" takes the old logprobs from the trainer and says nothing."""
    algo = _algo(
        tmp_path, steps=1, max_tokens=32, sampling={"response_format": VERDICT_FORMAT}, old_logprobs=old_logprobs
    )
    with caplog.at_level("WARNING", logger="agl.algorithm.torch_grpo"):
        thread_trainer(tmp_path, algo).fit(chat_agent, TASKS[:2])
    row = algo.state.rows[0]
    assert row["samples"] == 6 and row["optimizer_steps"] == 1
    tokenizer = algo.tokenizer
    for served in SERVED:
        answer = json.loads(tokenizer.decode(served["token_ids"][:-1]))
        assert answer["answer"] in ("yes", "no") and isinstance(answer["sure"], bool)
    assert row["logprob_drift"] > TorchGRPO.DRIFT_WARNING
    warnings = [r.getMessage() for r in caplog.records if "served logprobs differ" in r.getMessage()]
    if old_logprobs == "sample":
        assert len(warnings) == 1 and 'old_logprobs="recompute"' in warnings[0]
    else:
        assert warnings == []


def test_resume_continues_from_the_checkpoint(tmp_path: Path) -> None:
    first = _algo(tmp_path, steps=2)
    thread_trainer(tmp_path, first).fit(chat_agent, TASKS)
    saved = latest_checkpoint(tmp_path / "ckpt")
    assert saved is not None and saved.name == "step-000002"
    trained = {k: v.clone() for k, v in first.policy.module.state_dict().items() if "lora_" in k}  # type: ignore[union-attr]
    state = json.loads((saved / "state.json").read_text())
    assert state["step"] == 2 and state["cursor"] == 4

    second = _algo(tmp_path, steps=3)
    seen_at_start: Dict[str, torch.Tensor] = {}
    update = second.update

    def first_update_sees_the_checkpoint(samples: Any) -> Dict[str, float]:
        if not seen_at_start:
            seen_at_start.update({k: v.clone() for k, v in second.policy.module.state_dict().items() if "lora_" in k})  # type: ignore[union-attr]
            assert second.optimizer.state  # AdamW moments came back too  # type: ignore[union-attr]
        return update(samples)

    second.update = first_update_sees_the_checkpoint  # type: ignore[method-assign]
    result = thread_trainer(tmp_path, second).fit(chat_agent, TASKS)

    assert result.steps == 3
    assert [r["step"] for r in result.rows] == [1, 2, 3]  # the earlier rows came back with the checkpoint
    assert trained.keys() == seen_at_start.keys() and len(trained) > 0
    assert all(torch.equal(trained[k], seen_at_start[k]) for k in trained)
    assert latest_checkpoint(tmp_path / "ckpt").name == "step-000003"  # type: ignore[union-attr]


def test_a_resumed_run_cancels_the_rollouts_its_killed_predecessor_left_behind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run killed mid-step leaves that step's rollouts queued or running, bound to resources whose policy
    server died with it: the resumed run's runners took them first and failed them against a dead address.
    Rollouts of another trainer sharing the store are left alone."""
    first = _algo(tmp_path, steps=1, eval_every=0)
    thread_trainer(tmp_path, first).fit(chat_agent, TASKS)
    store = first.store
    step_2 = store.get_resources().resources_id  # published after step 1, for step 2's rollouts
    # what a SIGKILL during step 2 leaves: the step's rollouts, queued, one of them running
    left = store.enqueue_many([EnqueueRequest(input=TASKS[0], task_id="t0", mode="train", resources_id=step_2)] * 3)
    running = store.dequeue_rollout("killed-runner")
    assert running is not None and running.rollout_id == left[0].rollout_id
    dead = agl.LLM(endpoint="http://127.0.0.1:9/v1", model="policy")
    theirs = store.enqueue_rollout(
        input=TASKS[1], mode="train", resources_id=store.add_resources({"main_llm": dead}).resources_id
    )

    resumed = _algo(tmp_path, steps=2, eval_every=0)
    with caplog.at_level("WARNING", logger="agl.train"):
        result = thread_trainer(tmp_path, resumed).fit(chat_agent, TASKS)
    assert result.steps == 2
    assert [store.get_rollout(r.rollout_id).status for r in left] == ["cancelled"] * 3
    assert store.get_rollout(theirs.rollout_id).status != "cancelled", "another trainer's rollout was cancelled"
    assert "cancelled 3 rollouts that an earlier run" in caplog.text


def test_sampling_settings_the_policy_server_cannot_apply_fail_at_once() -> None:
    """sampling={"min_p": 0.1} (a vLLM setting) loaded the model, then every rollout failed with a 400."""
    with pytest.raises(ValueError, match=r"sampling has 'min_p', which agl's policy server does not support"):
        TorchGRPO(model=("m", "t"), sampling={"min_p": 0.1})
    with pytest.raises(ValueError, match=r"extra_evals\['greedy'\] has 'min_p'"):
        TorchGRPO(model=("m", "t"), extra_evals={"greedy": {"temperature": 0.0, "min_p": 0.1}})
    TorchGRPO(model=("m", "t"), sampling={"top_p": 0.9, "top_k": 50, "stop": ["\n"]}, val_sampling={"temperature": 0.0})


def test_a_policy_server_on_all_interfaces_is_published_at_an_address_other_machines_reach(tmp_path: Path) -> None:
    """The server always listened on 127.0.0.1 and was published so: `agl runner`s on other machines (the
    store server's layout: trainer on the GPU box, n_runners=0) were sent to their own loopback."""
    from agl._util.http_thread import outbound_ip

    algo = _algo(tmp_path, steps=1, eval_every=0, server_host="0.0.0.0")
    trainer = thread_trainer(tmp_path, algo)
    assert trainer.fit(chat_agent, TASKS).steps == 1
    endpoint = trainer.store.get_resources().resources["main_llm"].endpoint
    assert endpoint.startswith(f"http://{outbound_ip()}:") and not endpoint.startswith("http://127.0.0.1")
    train = trainer.store.query_rollouts(mode="train")
    assert train and all(r.status == "succeeded" for r in train)  # the agents reached it at that address


def test_runners_only_elsewhere_and_a_loopback_policy_server_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def session_of(algo: TorchGRPO) -> str:
        algo.bind(agl.Trainer(algorithm=algo, store=str(tmp_path / "store.db"), n_runners=0, progress=False))
        with algo._session():
            return algo._endpoint()

    with caplog.at_level("WARNING", logger="agl.train"):
        assert session_of(_algo(tmp_path)).startswith("http://127.0.0.1:")
    assert "n_runners=0" in caplog.text and "server_host='0.0.0.0'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="agl.train"):
        assert session_of(_algo(tmp_path, server_url="http://gpu-box:8123/v1/")) == "http://gpu-box:8123/v1"
    assert "n_runners=0" not in caplog.text


def test_resume_refuses_a_checkpoint_of_another_configuration(tmp_path: Path) -> None:
    thread_trainer(tmp_path, _algo(tmp_path, steps=1)).fit(chat_agent, TASKS)
    other = _algo(tmp_path, steps=2, lora={"r": 4})
    with pytest.raises(CheckpointError, match="resume=False"):
        thread_trainer(tmp_path, other).fit(chat_agent, TASKS)


def test_an_on_step_callback_that_raises_stops_training(tmp_path: Path) -> None:
    def broken_tracker(row: Dict[str, Any]) -> None:
        raise ValueError(f"tracker down at step {row['step']}")

    algo = _algo(tmp_path, on_step=broken_tracker)
    with pytest.raises(ValueError, match="tracker down at step 1"):
        thread_trainer(tmp_path, algo).fit(chat_agent, TASKS)
    assert algo.state.step == 1  # the step was done and logged; no second one started
    assert len((tmp_path / "run" / "metrics.csv").read_text().splitlines()) == 2
    checkpoint = latest_checkpoint(tmp_path / "ckpt")  # and saved: a resume starts at step 2
    assert checkpoint is not None and json.loads((checkpoint / "state.json").read_text())["step"] == 1


@agl.rollout
def plain_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """The README's agent: it does not pass llm.sampling_parameters on."""
    messages = [{"role": "user", "content": task["question"]}]
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        completion = client.chat.completions.create(model=llm.model, messages=messages)
    choice = completion.choices[0]
    return _served(task, {"token_ids": choice.model_extra["token_ids"], "logprobs": choice.logprobs})


def test_an_agent_that_does_not_pass_the_sampling_parameters_is_sampled_as_the_trainer_says(tmp_path: Path) -> None:
    """max_tokens and temperature went unapplied (512-token answers at temperature 1 whatever TorchGRPO was
    told) and no logprobs were recorded, silently: the loss was computed for another distribution."""
    algo = _algo(tmp_path, steps=1, max_tokens=4, eval_every=0, checkpoint_dir=None)
    thread_trainer(tmp_path, algo).fit(plain_agent, TASKS[:2])
    assert SERVED and all(len(s["token_ids"]) <= 4 and s["logprobs"] is not None for s in SERVED)


def _checkpointed_step(directory: Path) -> Optional[int]:
    checkpoint = latest_checkpoint(directory)
    return None if checkpoint is None else json.loads((checkpoint / "state.json").read_text())["step"]


def test_a_run_that_stops_between_checkpoints_still_saves_its_last_step(tmp_path: Path) -> None:
    """checkpoint_every=5 and a time budget (the README's main job) or a failing tracker stopping the run
    earlier: the steps since the last checkpoint were lost, and `agl export-model` found nothing to export."""

    def budget_runs_out(row: Dict[str, Any]) -> None:
        algo.time_budget_s = 0.0  # as if the budget ran out during step 1

    algo = _algo(tmp_path, steps=4, checkpoint_every=5, eval_every=0, on_step=budget_runs_out)
    thread_trainer(tmp_path, algo).fit(chat_agent, TASKS)
    assert algo.state.step == 1 and _checkpointed_step(tmp_path / "ckpt") == 1

    def broken_tracker(row: Dict[str, Any]) -> None:
        if row["step"] == 2:
            raise ValueError("tracker down")

    resumed = _algo(tmp_path, steps=4, checkpoint_every=5, eval_every=0, on_step=broken_tracker)
    with pytest.raises(ValueError, match="tracker down"):
        thread_trainer(tmp_path, resumed).fit(chat_agent, TASKS)
    assert resumed.state.step == 2 and _checkpointed_step(tmp_path / "ckpt") == 2


def test_steps_with_nothing_to_train_stop_the_run_and_say_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A typo in agent_match left every call out: training ran to the end, training nothing, without a word."""
    algo = _algo(tmp_path, steps=5, eval_every=0)
    trainer = thread_trainer(tmp_path, algo, adapter={"agent_match": "^chat$"})
    with pytest.raises(agl.errors.NoTrainableSamples, match="3 steps in a row had nothing to train on") as error:
        trainer.fit(chat_agent, TASKS)
    assert "agent_match '^chat$' left out every LLM call; the calls' agents: 'chat_agent' (6)" in str(error.value)
    assert algo.state.step == 2  # steps 1 and 2 were logged and skipped, step 3 stopped the run
    skipped = [r.getMessage() for r in caplog.records if "trains nothing and is skipped" in r.getMessage()]
    assert [m.split(" trains")[0] for m in skipped] == ["step 1", "step 2", "step 3"]


def test_span_retention_keeps_the_last_steps_spans_and_every_rollout(tmp_path: Path) -> None:
    """Spans are nearly all of a store's volume; a long run keeps only its last steps' (Trainer setting)."""
    algo = _algo(tmp_path, steps=3, checkpoint_dir=None)
    trainer = thread_trainer(tmp_path, algo, span_retention_steps=1)
    result = trainer.fit(chat_agent, TASKS, val_dataset=VAL)
    assert [r["samples"] for r in result.rows] == [6, 6, 6], "each step learnt from its spans before they went"

    store = trainer.store
    train = store.query_rollouts(mode="train")
    assert len(train) == 18 and all(r.status == "succeeded" and r.final_reward is not None for r in train)
    spans = [len(store.query_spans(r.rollout_id)) for r in train]
    assert spans[:12] == [0] * 12, "steps 1 and 2 are out of the window of 1 step"
    assert all(n >= 2 for n in spans[12:]), "the last step keeps its spans (agent and llm spans at least)"
    val = store.query_rollouts(mode="val")
    assert len(val) == 6 and all(store.query_spans(r.rollout_id) for r in val), "validation spans stay"


def test_a_resumed_run_with_span_retention_deletes_the_earlier_runs_spans_in_turn(tmp_path: Path) -> None:
    """The retention window lived in the process: after a crash and --resume, the spans of the steps before
    the crash (up to the whole window) stayed in the store for good. Only this run's: the resumed run deleted
    the spans of every finished training rollout in the store, another experiment's too."""

    def crash_after_step_2(row: Dict[str, Any]) -> None:
        if row["step"] == 2:
            raise RuntimeError("the machine went down")

    def trainer_of(algo: TorchGRPO) -> agl.Trainer:
        return thread_trainer(tmp_path, algo, span_retention_steps=1)

    other = thread_trainer(tmp_path, _algo(tmp_path, steps=1, output_dir=tmp_path / "other", checkpoint_dir=None))
    other.fit(chat_agent, TASKS)  # another experiment in the same store, keeping every span
    others = {r.rollout_id for r in other.store.query_rollouts(mode="train")}
    assert len(others) == 6 and all(other.store.query_spans(i) for i in others)
    first = trainer_of(_algo(tmp_path, steps=4, eval_every=0, on_step=crash_after_step_2))
    with pytest.raises(RuntimeError, match="went down"):
        first.fit(chat_agent, TASKS)
    store = first.store
    ours = [r for r in store.query_rollouts(mode="train") if r.rollout_id not in others]
    with_spans = [r for r in ours if store.query_spans(r.rollout_id)]
    assert len(with_spans) == 6, "the crashed run kept its last step's spans"
    resumed = trainer_of(_algo(tmp_path, steps=4, eval_every=0))
    resumed.fit(chat_agent, TASKS)
    assert all(resumed.store.query_spans(i) for i in others), "the other experiment's spans were deleted"
    train = [r for r in resumed.store.query_rollouts(mode="train") if r.rollout_id not in others]
    assert len(train) == 24
    spans = [len(resumed.store.query_spans(r.rollout_id)) for r in train]
    assert spans[:18] == [0] * 18 and all(n >= 2 for n in spans[18:]), "only the last step's spans are left"


def test_a_budget_that_ends_before_the_first_step_says_so_and_does_not_evaluate_again(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The README's main job on a slow machine: the first evaluations used the budget up, no step ran, and the
    run evaluated the same weights again as "after training" (+0.0 points), with one INFO line in train.log.
    Once the first evaluation has used the budget up, the extra (greedy) one is skipped: it ran, and only then
    did the run find that no step fits (4 more minutes of the main job on a busy machine)."""
    algo = _algo(tmp_path, steps=3, time_budget_s=0.0, extra_evals={"greedy": {"temperature": 0.0}})
    trainer = thread_trainer(tmp_path, algo)
    result = trainer.fit(chat_agent, TASKS, val_dataset=VAL)
    assert result.steps == 0 and result.before is not None and result.after is None and result.extra == {}
    assert result.improvement is None
    assert [(e["name"], e["step"]) for e in algo.state.evaluations] == [("val", 0)]
    assert len(trainer.store.query_rollouts(mode="val")) == len(VAL)  # the first evaluation once, no other
    log = (tmp_path / "run" / "train.log").read_text()
    assert "skipping the untrained policy's greedy evaluation: after the val one" in log
    assert "no training step ran" in log
    assert "after training" not in capfd.readouterr().out


def test_an_update_that_makes_the_weights_non_finite_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path: Path,
) -> None:
    """lr=inf turned the weights into NaN after step 1; every later rollout failed to sample, the NaN weights
    replaced the good checkpoints, and the run still ended "done"."""
    from agl.algorithm.torch_grpo import TrainingDivergedError

    algo = _algo(tmp_path, steps=3, checkpoint_every=1)
    algo.on_step = lambda row: algo.optimizer.param_groups[0].update(lr=float("inf"))  # step 2 diverges
    with pytest.raises(TrainingDivergedError, match="step 2's update made trainable weights NaN or infinite"):
        thread_trainer(tmp_path, algo).fit(chat_agent, TASKS)
    path = latest_checkpoint(tmp_path / "ckpt")
    assert path is not None and path.name == "step-000001"
    adapter = path / "adapter" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(str(adapter)).values())


def test_the_requests_a_stopping_policy_server_drops_are_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """Ctrl-C of the main job stopped the policy server with its agents' requests in flight: 21 bare lines of
    "answered 500: generation failed", one per request. The server says them once as it stops."""
    from agl.serving import PolicyServer

    model, tokenizer = load_policy("tiny", device="cpu", seed=0)
    server = PolicyServer(model, tokenizer, model_name="policy")
    server.start()
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    failed: List[Exception] = []

    def ask() -> None:
        try:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        except openai.APIError as exc:
            failed.append(exc)

    with caplog.at_level(logging.WARNING, logger="agl"):
        with server.paused():  # the requests wait, as a step's do while the trainer updates
            askers = [threading.Thread(target=ask) for _ in range(3)]
            for asker in askers:
                asker.start()
            while server.engine.waiting < 3:
                time.sleep(0.01)
            server.stop()
        for asker in askers:
            asker.join()
    assert len(failed) == 3  # each request was still answered 500, its agent told
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "answered 500: generation failed" in m], messages
    assert [m for m in messages if "unanswered" in m] == [
        "the policy server stopped with 3 requests of running agents unanswered (each answered 500)"
    ]
