"""Agent Lightning's Trainer arguments, algorithms (``@algo``, async ``Algorithm.run``), adapters, hooks and APO
arguments run on agl's machinery: real stores, real runners, the fake OpenAI server."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, List, cast

import pytest
from openai import AsyncOpenAI

import agl
from agl.algorithm import algo
from agl.compat import execution
from agl.compat.adapter import LlmProxyTraceToTriplet, TracerTraceToTriplet
from agl.compat.emitter import find_final_reward
from agl.compat.execution import ClientServerExecutionStrategy, ExecutionStrategy, SharedMemoryExecutionStrategy
from agl.lightningrl import LightningRL
from agl.types import Hook, Rollout


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Agent Lightning argument is named once per process: forget what earlier tests had named."""
    monkeypatch.setattr(execution, "_said", [])


def make_trainer(tmp_path: Any, **options: Any) -> agl.Trainer:
    return agl.Trainer(store=str(tmp_path / "s.db"), progress=False, **options)


def notes(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name == "agl.compat.execution"]


# -- Trainer arguments --------------------------------------------------------------------------------------


def test_arguments_without_a_meaning_in_agl_are_named_once(tmp_path, said, caplog):
    caplog.set_level(logging.INFO, logger="agl.compat.execution")
    tracer, proxy = object(), object()
    options = dict(tracer=tracer, port=4747, llm_proxy=proxy, runner=object(), daemon=False)
    trainer = make_trainer(tmp_path, **options)
    make_trainer(tmp_path, **options)  # a second Trainer: nothing said again
    assert sorted(notes(caplog)) == [
        "Trainer(daemon=...): agl's runner processes always stop with the Trainer",
        "Trainer(llm_proxy=...): given to algorithms (get_llm_proxy()); agl.VERL runs its own",
        "Trainer(port=...): agl's runners use the store directly; `agl store serve` serves it to other machines",
        "Trainer(runner=...): agl's runner pool runs the agent (n_runners=, runner_mode=)",
        "Trainer(tracer=...): agl records with its own instrumentation",
    ]
    assert trainer.tracer is tracer and trainer.llm_proxy is proxy and trainer.port == 4747


@pytest.mark.parametrize(
    "strategy, mode, n_runners",
    [
        ("shm", "thread", 1),
        ("cs", "process", 1),
        ({"type": "cs", "n_runners": 3, "server_port": 9999}, "process", 3),
        (SharedMemoryExecutionStrategy(n_runners=2), "thread", 2),
        (ClientServerExecutionStrategy, "process", 1),
        ("agentlightning.execution.shared_memory.SharedMemoryExecutionStrategy", "thread", 1),
    ],
)
def test_a_strategy_is_a_runner_mode(tmp_path, said, caplog, strategy, mode, n_runners):
    caplog.set_level(logging.INFO, logger="agl.compat.execution")
    trainer = make_trainer(tmp_path, strategy=strategy)
    assert (trainer.runner_mode, trainer.n_runners) == (mode, n_runners)
    kind = "threads" if mode == "thread" else "processes"
    assert f"agl runs {n_runners} runner {kind} against the store" in notes(caplog)[-1]


def test_a_strategy_agl_cannot_run_is_a_one_line_error(tmp_path):
    class OwnStrategy(ExecutionStrategy):
        pass

    with pytest.raises(ValueError, match="^unknown strategy 'ipc': use 'shm'"):
        make_trainer(tmp_path, strategy="ipc")
    with pytest.raises(TypeError, match="execution strategy of one's own.*runner_mode="):
        make_trainer(tmp_path, strategy=OwnStrategy())
    with pytest.raises(ValueError, match="runs runner_mode='thread', not 'process'"):
        make_trainer(tmp_path, strategy="shm", runner_mode="process")
    with pytest.raises(NotImplementedError, match="trainer.fit"):
        ClientServerExecutionStrategy().execute(None, None, None)


def test_deprecated_arguments_warn_and_keep_their_meaning(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"max_tasks=\) is now max_rollouts="):
        assert make_trainer(tmp_path, max_tasks=3).max_rollouts == 3
    with pytest.warns(DeprecationWarning, match=r"triplet_exporter=\) is now adapter="):
        trainer = make_trainer(tmp_path, triplet_exporter={"agent_match": "x"})
    assert trainer.adapter.agent_match == "x"
    with pytest.warns(DeprecationWarning, match=r"trainer.dev\(agent, dataset\)"):
        make_trainer(tmp_path, dev=True)
    with pytest.raises(TypeError, match="hooks must be agl.Hook objects"):
        make_trainer(tmp_path, hooks=[object()])


def test_the_adapter_reads_as_agent_lightning_s(tmp_path):
    assert make_trainer(tmp_path, adapter={"agent_match": "writer"}).adapter.agent_match == "writer"
    al_adapter = TracerTraceToTriplet(agent_match="writer", llm_call_match="chat .*")
    trainer = make_trainer(tmp_path, adapter=al_adapter)
    assert trainer.adapter.agent_match == "writer"
    rl = LightningRL.from_config(trainer.adapter)
    assert (rl.agent_match, rl.llm_call_match) == ("writer", "chat .*")
    assert LightningRL.from_config(LlmProxyTraceToTriplet()).agent_match is None
    assert TracerTraceToTriplet().agent_match is None  # Agent Lightning's default call regex is not agl's
    with pytest.raises(NotImplementedError, match="build_batch"):
        al_adapter.adapt([])


@agl.rollout
def echo(task: Any) -> float:
    return float(task)


@pytest.mark.parametrize("runner_mode", ["thread", "process"])
def test_max_rollouts_stops_each_runner_and_cancels_what_is_left(tmp_path, runner_mode):
    trainer = make_trainer(tmp_path, n_runners=1, runner_mode=runner_mode, max_rollouts=2)
    rows = trainer.dev(echo, [1, 2, 3, 4], print_table=False)
    assert [r.status for r in rows] == ["succeeded", "succeeded", "cancelled", "cancelled"]


class Recorder(Hook):
    def __init__(self) -> None:
        self.calls: List[Any] = []

    async def on_rollout_start(self, *, agent: Any, runner: Any, rollout: Rollout) -> None:
        self.calls.append(("on_rollout_start", rollout.input, runner))

    async def on_trace_start(self, *, agent: Any, runner: Any, tracer: Any, rollout: Rollout) -> None:
        self.calls.append(("on_trace_start", rollout.input, tracer))

    async def on_trace_end(self, *, agent: Any, runner: Any, tracer: Any, rollout: Rollout) -> None:
        raise RuntimeError("a broken hook")  # logged; the rollout goes on

    async def on_rollout_end(self, *, agent: Any, runner: Any, rollout: Rollout, spans: List[agl.Span]) -> None:
        self.calls.append(("on_rollout_end", rollout.input, sorted(s.kind for s in spans)))


@agl.rollout
async def ask(task: str, llm: agl.LLM) -> float:
    client = AsyncOpenAI(base_url=llm.get_base_url(), api_key="x")
    await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task}])
    return 1.0


def test_hooks_run_around_each_rollout(tmp_path, fake_trainer, caplog):
    hook, tracer = Recorder(), object()
    trainer = fake_trainer(str(tmp_path / "s.db"), hooks=hook, tracer=tracer)
    rows = trainer.dev(ask, ["q"], print_table=False)
    assert [(r.status, r.reward, r.llm_calls) for r in rows] == [("succeeded", 1.0, 1)]
    assert hook.calls == [
        ("on_rollout_start", "q", None),
        ("on_trace_start", "q", tracer),
        ("on_rollout_end", "q", ["llm"]),  # stored before the end hook; the rollout's root span ends after it
    ]
    assert any("Recorder.on_trace_end raised" in r.getMessage() for r in caplog.records)


class ModeAgent(agl.LitAgent[str]):
    def rollout(self, task: str, resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        return {"dev": 0.0, "val": 1.0}[rollout.mode]


def test_dev_with_agent_lightning_s_datasets(tmp_path):
    trainer = make_trainer(tmp_path, runner_mode="thread")
    rows = trainer.dev(ModeAgent(), train_dataset=["a", "b"], val_dataset=["c"], print_table=False)
    assert [r.reward for r in rows] == [0.0, 0.0, 1.0]
    assert [r.mode for r in trainer.store.query_rollouts()] == ["dev", "dev", "val"]
    assert [r.reward for r in trainer.dev(ModeAgent(), val_dataset=["d"], print_table=False)] == [1.0]
    with pytest.raises(ValueError, match="once"):
        trainer.dev(ModeAgent(), ["a"], train_dataset=["b"])


# -- algorithms -----------------------------------------------------------------------------------------------


@agl.rollout
async def prompted(task: str, prompt_template: agl.PromptTemplate, llm: agl.LLM) -> float:
    client = AsyncOpenAI(base_url=llm.get_base_url(), api_key="x")
    await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": prompt_template.format(q=task)}]
    )
    return len(prompt_template.template) / 100


@algo
async def try_prompts(*, store: Any, initial_resources: Any, train_dataset: Any) -> Any:
    """Agent Lightning's custom algorithm: publish resources, enqueue, wait, read spans and the final reward."""
    results = []
    for template in ("short {q}", "a longer prompt {q}"):
        await store.add_resources({**initial_resources, "prompt": agl.PromptTemplate(template=template)})
        rollout = await store.enqueue_rollout(input=train_dataset[0], mode="train")
        for _ in range(60):
            finished = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=0.01)
            if finished:
                break
            await asyncio.sleep(0.5)
        spans = await store.query_spans(rollout.rollout_id)
        results.append((template, finished[0].status, find_final_reward(spans), sorted(s.kind for s in spans)))
    return results


def test_an_async_algo_function_runs_with_process_runners(tmp_path, fake_openai):
    llm = agl.LLM(endpoint=fake_openai.base_url, model="m")
    trainer = make_trainer(tmp_path, algorithm=try_prompts, n_runners=2, initial_resources={"main_llm": llm})
    results = trainer.fit(prompted, ["why is the sky blue"])
    assert results == [
        ("short {q}", "succeeded", 0.09, ["agent", "llm", "reward"]),
        ("a longer prompt {q}", "succeeded", 0.19, ["agent", "llm", "reward"]),
    ]
    assert [r["body"]["messages"][0]["content"] for r in fake_openai.requests] == [
        "short why is the sky blue",
        "a longer prompt why is the sky blue",
    ]


def test_an_algo_function_given_a_dataset_it_does_not_take(tmp_path):
    @algo
    def only_store(*, store: Any) -> None:
        return None

    trainer = make_trainer(tmp_path, algorithm=only_store, runner_mode="thread")
    with pytest.raises(TypeError, match="has no train_dataset parameter.*train_dataset=None"):
        trainer.fit(echo, [1])


class AsyncAlgorithm(agl.Algorithm):
    """Agent Lightning's Algorithm subclass: an async run reaching its surroundings through get_*()."""

    async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> Any:
        store = cast(Any, self.get_store())  # awaited: agl store methods called from a coroutine
        assert self.get_trainer().store is store and self.get_llm_proxy() == "proxy"
        rollouts = [await store.enqueue_rollout(input=x, mode="train") for x in train_dataset]
        ids = [r.rollout_id for r in rollouts]
        while len(await store.wait_for_rollouts(rollout_ids=ids, timeout=0.01)) < len(ids):
            await asyncio.sleep(0.1)
        done = await store.query_rollouts(rollout_ids=ids)
        return self.get_adapter().agent_match, sorted(self.get_initial_resources()), [r.final_reward for r in done]


def test_an_agent_lightning_algorithm_subclass_with_async_run(tmp_path):
    trainer = make_trainer(
        tmp_path,
        algorithm=AsyncAlgorithm(),
        runner_mode="thread",
        llm_proxy="proxy",
        adapter={"agent_match": "echo"},
        initial_resources={"prompt": agl.PromptTemplate(template="{x}")},
    )
    assert trainer.algorithm.is_async()
    assert trainer.fit(echo, [1, 2]) == ("echo", ["prompt"], [1.0, 2.0])
    with pytest.raises(NotImplementedError, match="get_store"):
        trainer.algorithm.get_client()
    with pytest.raises(RuntimeError, match="not bound to a Trainer"):
        AsyncAlgorithm().get_store()


def test_baseline_takes_agent_lightning_s_options(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="agl.algorithm")
    trainer = make_trainer(tmp_path, algorithm=agl.Baseline(n_epochs=2, span_verbosity="keys"), runner_mode="thread")
    result = trainer.fit(echo, [1], val_dataset=[2])
    assert [r.final_reward for r in result["train"]] == [1.0, 1.0] and len(result["val"]) == 2
    assert any("Baseline(span_verbosity): unused in agl" in r.getMessage() for r in caplog.records)


# -- APO, VERL, types ---------------------------------------------------------------------------------------


def test_apo_takes_agent_lightning_s_arguments(tmp_path, fake_openai, caplog):
    caplog.set_level(logging.INFO, logger="agl.apo")
    peer = logging.getLogger("agentlightning.algorithm.apo")
    records: List[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    peer.addHandler(handler)
    try:
        apo = agl.APO(
            AsyncOpenAI(base_url=fake_openai.base_url, api_key="x"),
            rollout_batch_timeout=0.5,
            run_initial_validation=False,
            _poml_trace=True,
        )

        @agl.rollout
        def slow(task: Any, prompt_template: agl.PromptTemplate) -> float:
            time.sleep(2.0)
            return 1.0

        trainer = make_trainer(
            tmp_path, algorithm=apo, runner_mode="thread", initial_resources={"p": agl.PromptTemplate(template="x")}
        )
        with pytest.raises(agl.algorithm.apo.APOError, match=r"within 0.5 s \(rollout_batch_timeout\)"):
            trainer.fit(slow, ["t"])
    finally:
        peer.removeHandler(handler)
    said = [r.getMessage() for r in caplog.records if r.name == "agl.apo"]
    assert "APO(run_initial_validation=False): agl's APO scores the seed prompt once, as every candidate" in said
    assert any(m.startswith("APO(_poml_trace=True)") for m in said)
    assert [r.getMessage() for r in records] == said  # Agent Lightning's APO logger got the same lines


def test_verl_without_the_extra_says_how_to_install_it():
    with pytest.raises(ImportError, match=r"agl\.VERL needs the verl package: pip install .*'agl\[verl\]'"):
        agl.VERL({"data": {"train_batch_size": 4}})


def test_agent_lightning_s_type_names():
    assert agl.InMemoryLightningStore().enqueue_rollout("task", mode="test").mode == "val"  # its evaluation mode
    assert agl.types.AttemptedRollout is agl.Rollout
    update = agl.ResourcesUpdate(resources_id="r", version=1)
    assert update.update_time == update.create_time
    assert agl.types.Triplet(prompt={"token_ids": [1]}, response="b", reward=1.0).reward == 1.0
    dataset: agl.types.Dataset[str] = ["a"]
    assert len(dataset) == 1
