"""Agent Lightning's LitAgent async overrides, tracers and LitAgentRunner, run on agl's runner and tracing against
the fake OpenAI server and real stores (in-memory and SQLite)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
from typing import Any, Dict, List

import openai
import pytest

import agl
from agl import semconv
from agl.compat.litagent import llm_rollout
from agl.compat.runner import LitAgentRunner
from agl.compat.tracer import AgentOpsTracer, DummyTracer, OtelTracer, WeaveTracer, get_active_tracer
from agl.store import InMemoryLightningStore, SqliteLightningStore
from agl.types import Hook


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    s = InMemoryLightningStore() if request.param == "memory" else SqliteLightningStore(tmp_path / "s.db")
    yield s
    s.close()


async def ask(llm: agl.LLM, question: str) -> str:
    client = openai.AsyncOpenAI(base_url=llm.get_base_url(), api_key="x")
    reply = await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": question}])
    return reply.choices[0].message.content or ""


class SplitAgent(agl.LitAgent[Dict[str, Any]]):
    """Agent Lightning's style: training and validation as separate async overrides, each calling the model."""

    async def training_rollout_async(self, task: Dict[str, Any], resources: Any, rollout: agl.Rollout) -> float:
        await ask(resources["main_llm"], f"train {task['q']}")
        return 1.0

    async def validation_rollout_async(self, task: Dict[str, Any], resources: Any, rollout: agl.Rollout) -> float:
        await ask(resources["main_llm"], f"val {task['q']}")
        return 0.5


class OneAsyncAgent(agl.LitAgent[Dict[str, Any]]):
    async def rollout_async(self, task: Dict[str, Any], resources: Any, rollout: agl.Rollout) -> None:
        await ask(resources["main_llm"], str(task["q"]))
        agl.emit_reward(0.25)


def test_async_overrides_are_async_and_dispatch_on_the_mode() -> None:
    class Plain(agl.LitAgent[Any]):
        def rollout(self, task: Any, resources: Any, rollout: agl.Rollout) -> float:
            return 1.0

    assert SplitAgent().is_async() and OneAsyncAgent().is_async()
    assert not Plain().is_async()
    assert answer_agent.is_async() and not agl.rollout(lambda task: 1.0).is_async()


def test_async_overrides_run_through_dev_and_fit(tmp_path: Any, fake_openai: Any, fake_trainer: Any) -> None:
    trainer = fake_trainer(SqliteLightningStore(tmp_path / "s.db"), n_runners=2)
    dev_rows = trainer.dev(SplitAgent(), [{"q": 1}], print_table=False)
    assert [(r.status, r.reward, r.llm_calls) for r in dev_rows] == [("succeeded", 1.0, 1)]  # as training
    fitted = trainer.fit(SplitAgent(), [{"q": 2}, {"q": 3}], val_dataset=[{"q": 4}])
    assert [r.final_reward for r in fitted["train"]] == [1.0, 1.0]
    assert [r.final_reward for r in fitted["val"]] == [0.5]
    fitted = trainer.fit(OneAsyncAgent(), [{"q": 5}], val_dataset=[{"q": 6}])
    assert [r.final_reward for r in fitted["train"] + fitted["val"]] == [0.25, 0.25]
    prompts = sorted(r["body"]["messages"][0]["content"] for r in fake_openai.requests)
    assert prompts == ["5", "6", "train 1", "train 2", "train 3", "val 4"]


def test_an_agent_without_any_rollout_method_fails_its_rollout_saying_so(tmp_path: Any, fake_trainer: Any) -> None:
    trainer = fake_trainer(SqliteLightningStore(tmp_path / "s.db"))
    [row] = trainer.dev(agl.LitAgent(), [{"q": 1}], print_table=False)
    assert row.status == "failed" and "LitAgent must implement rollout" in (row.error or "")


@llm_rollout
async def answer_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    reply = await ask(llm, str(task["q"]))
    return 1.0 if reply else 0.0


async def test_runner_step_stores_the_llm_call_with_token_ids_and_the_reward(store: Any, fake_openai: Any) -> None:
    runner = LitAgentRunner[Dict[str, Any]](AgentOpsTracer())
    llm = agl.LLM(endpoint=fake_openai.base_url, model="m")
    with runner.run_context(agent=answer_agent, store=store):
        rollout = await runner.step({"q": "hello"}, resources={"main_llm": llm})
    assert rollout.status == "succeeded" and rollout.final_reward == 1.0
    assert rollout.attempt is not None and rollout.attempt.status == "succeeded"
    spans = await store.query_spans(rollout.rollout_id)  # Agent Lightning's store calls are awaited
    [call] = [s for s in spans if s.kind == "llm"]
    assert call.attributes[semconv.PROMPT_TOKEN_IDS] and call.attributes[semconv.RESPONSE_TOKEN_IDS]
    assert [s.attributes[semconv.REWARD_VALUE] for s in spans if s.kind == "reward"] == [1.0]


async def test_runner_step_raises_what_the_agent_raised_after_storing_the_failure(store: Any) -> None:
    class Broken(agl.LitAgent[Any]):
        async def rollout_async(self, task: Any, resources: Any, rollout: agl.Rollout) -> None:
            raise KeyError("no such tool")

    runner = LitAgentRunner[Any](OtelTracer())
    with runner.run_context(agent=Broken(), store=store):
        with pytest.raises(KeyError, match="no such tool"):
            await runner.step({"q": 1})
    [failed] = await store.query_rollouts()
    assert failed.status == "failed" and "KeyError" in (failed.error or "")


async def test_runner_iter_takes_rollouts_from_the_queue_up_to_max_rollouts(store: Any, fake_openai: Any) -> None:
    await store.add_resources({"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="m")})
    queued = [await store.enqueue_rollout({"q": i}) for i in range(3)]
    runner = LitAgentRunner[Dict[str, Any]](OtelTracer(), max_rollouts=2, poll_interval=0.1)
    with runner.run_context(agent=answer_agent, store=store):
        await runner.iter()
        statuses = [(await store.get_rollout(r.rollout_id)).status for r in queued]
        assert statuses == ["succeeded", "succeeded", "queued"]  # FIFO, and it stopped at max_rollouts
        stop = threading.Event()
        stop.set()
        await runner.iter(event=stop)  # a stop event already set: nothing more is taken
        assert (await store.get_rollout(queued[2].rollout_id)).status == "queued"
    runner = LitAgentRunner[Dict[str, Any]](OtelTracer(), poll_interval=0.1)
    with runner.run_context(agent=answer_agent, store=store):
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        task = loop.create_task(runner.iter(event=stop))
        done = await store.wait_for_rollouts([queued[2].rollout_id], 30)
        stop.set()
        await task
    assert [r.status for r in done] == ["succeeded"]


async def test_hooks_run_around_each_rollout_and_see_its_trace(store: Any, fake_openai: Any) -> None:
    seen: List[str] = []

    class Recorder(Hook):
        async def on_rollout_start(self, *, agent: Any, runner: Any, rollout: agl.Rollout) -> None:
            seen.append(f"rollout start {agent is answer_agent} {runner is lit_runner}")

        async def on_trace_end(self, *, agent: Any, runner: Any, tracer: Any, rollout: agl.Rollout) -> None:
            seen.append("trace end " + ",".join(s.kind for s in tracer.get_last_trace() if s.kind == "llm"))

        async def on_rollout_end(self, *, agent: Any, runner: Any, rollout: agl.Rollout, spans: Any) -> None:
            seen.append(f"rollout end {len(spans) > 0}")

    lit_runner = LitAgentRunner[Dict[str, Any]](OtelTracer())
    llm = agl.LLM(endpoint=fake_openai.base_url, model="m")
    with lit_runner.run_context(agent=answer_agent, store=store, hooks=[Recorder()]):
        await lit_runner.step({"q": "hi"}, resources={"main_llm": llm})
    assert seen == ["rollout start True True", "trace end llm", "rollout end True"]


_SEEN: List[Any] = []


class LinkedAgent(agl.LitAgent[Any]):
    async def rollout_async(self, task: Any, resources: Any, rollout: agl.Rollout) -> float:
        _SEEN.extend([self.runner, self.tracer])
        return 1.0


async def test_the_agent_sees_its_runner_and_tracer_and_still_pickles(store: Any) -> None:
    agent, tracer = LinkedAgent(), OtelTracer()
    with pytest.raises(ValueError, match="the agent's runner is not set: only agl.LitAgentRunner"):
        agent.get_runner()
    runner = LitAgentRunner[Any](tracer)
    _SEEN.clear()
    with runner.run_context(agent=agent, store=store):
        await runner.step({"q": 1})
    assert _SEEN == [runner, tracer]
    assert pickle.loads(pickle.dumps(agent)).get_tracer() is agl.get_tracer()  # the link stays in this process


async def test_otel_tracer_trace_context_records_spans_and_reward_into_the_rollout(store: Any) -> None:
    tracer = OtelTracer()
    started = await store.start_rollout(input={"origin": "test"})
    with tracer.lifespan(store):
        async with tracer.trace_context(
            "manual", store=store, rollout_id=started.rollout_id, attempt_id=started.attempt.attempt_id
        ) as otel_tracer:
            assert get_active_tracer() is tracer
            with otel_tracer.start_as_current_span("outer", attributes={"step": 1}):
                with otel_tracer.start_as_current_span("inner"):
                    pass
            agl.emit_reward(1.0)
    assert get_active_tracer() is None
    spans = await store.query_spans(started.rollout_id)
    by_name = {s.name: s for s in spans}
    assert by_name["inner"].parent_id == by_name["outer"].span_id and by_name["outer"].attributes["step"] == 1
    assert [s.attributes[semconv.REWARD_VALUE] for s in spans if s.kind == "reward"] == [1.0]
    assert [s.name for s in tracer.get_last_trace()] == [s.name for s in spans]


async def test_trace_context_without_ids_records_into_a_rollout_of_its_own(store: Any) -> None:
    tracer = OtelTracer()
    with tracer.lifespan(store):
        async with tracer.trace_context("standalone") as otel_tracer:
            with otel_tracer.start_as_current_span("work"):
                agl.emit_reward(0.5)
    [rollout] = await store.query_rollouts()
    assert rollout.input == "standalone" and rollout.status == "succeeded" and rollout.final_reward == 0.5
    assert "work" in [s.name for s in tracer.get_last_trace()]


async def test_trace_context_needs_a_store() -> None:
    with pytest.raises(ValueError, match="needs a store: use `with tracer.lifespan"):
        async with OtelTracer().trace_context("x"):
            pass


def test_agentops_tracer_says_once_that_agl_records_without_agentops(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agl.compat.tracer")
    import agl.compat.tracer as tracer_module

    tracer_module._said.discard("agentops")
    AgentOpsTracer()
    AgentOpsTracer(instrument_managed=False)
    lines = [r.getMessage() for r in caplog.records if "AgentOps" in r.getMessage()]
    assert len(lines) == 1 and "agl records with its own instrumentation" in lines[0]


def test_tracers_instrument_the_process_for_their_life_unless_told_not_to(tmp_path: Any) -> None:
    from agl.instrumentation.base import is_hooked

    assert not is_hooked("openai")
    for tracer, hooks in ((AgentOpsTracer(), True), (OtelTracer(), True), (DummyTracer(), False)):
        with tracer.lifespan(InMemoryLightningStore()):
            assert is_hooked("openai") is hooks
        assert not is_hooked("openai")
    with AgentOpsTracer(instrument_managed=False).lifespan():
        assert not is_hooked("openai")


def test_weave_tracer_says_what_to_use_instead() -> None:
    with pytest.raises(NotImplementedError, match=r"use agl.OtelTracer\(\)"):
        WeaveTracer()
