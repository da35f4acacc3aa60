"""Emitters, the reward rule, @agl.rollout argument matching and the Runner, on a real SQLite store."""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
import threading
import time
from decimal import Decimal
from fractions import Fraction

import pytest
from opentelemetry import trace as otel_trace

import agl
from agl import semconv
from agl.runtime.runner import Runner
from agl.store import SqliteLightningStore


@pytest.fixture()
def store(tmp_path):
    s = SqliteLightningStore(tmp_path / "store.db")
    yield s
    s.close()


def run_one(store, agent, task_input=None, **runner_kwargs):
    store.add_resources({"main_llm": agl.LLM(endpoint="http://127.0.0.1:9/v1", model="m")})
    store.enqueue_rollout(task_input if task_input is not None else {"q": 1})
    runner = Runner(agent, store, **runner_kwargs)
    try:
        claimed = store.dequeue_rollout(runner.runner_id)
        return runner.run_rollout(claimed)
    finally:
        runner.close()


def rewards_of(store, rollout_id):
    return [s for s in store.query_spans(rollout_id) if s.kind == "reward"]


def test_returned_reward_is_the_episode_reward_and_gets_one_span(store):
    done = run_one(store, agl.rollout(lambda task: 0.75))
    assert done.status == "succeeded" and done.final_reward == 0.75
    spans = rewards_of(store, done.rollout_id)
    assert [s.attributes[semconv.REWARD_SOURCE] for s in spans] == ["returned"]


def test_reward_returned_and_emitted_is_counted_once(store):
    def agent(task):
        agl.emit_reward(1.0)
        return 1.0

    done = run_one(store, agl.rollout(agent))
    assert done.final_reward == 1.0
    spans = rewards_of(store, done.rollout_id)
    # only the emitted span: the returned value is the same reward, not a second one
    assert len(spans) == 1
    assert spans[0].attributes[semconv.REWARD_SCOPE] == "episode"


def test_returned_reward_wins_over_a_different_emitted_one(store, caplog):
    def agent(task):
        agl.emit_reward(0.2)
        return 0.9

    done = run_one(store, agl.rollout(agent))
    assert done.final_reward == 0.9
    assert "using the returned value" in caplog.text
    # the spans show both, the one that counts last (agl inspect showed only the emitted 0.2 under 0.9)
    spans = rewards_of(store, done.rollout_id)
    assert [(s.attributes[semconv.REWARD_VALUE], s.attributes.get(semconv.REWARD_SOURCE)) for s in spans][-1] == (
        0.9,
        "returned",
    )
    assert len(spans) == 2


def test_emitted_reward_alone_is_the_episode_reward(store):
    def agent(task):
        agl.emit_reward(0.1)
        agl.emit_reward({"accuracy": 0.5, "format": 1.0}, primary="accuracy")

    done = run_one(store, agl.rollout(agent))
    assert done.final_reward == 0.5
    named = rewards_of(store, done.rollout_id)[-1]
    assert json.loads(named.attributes[semconv.REWARD_DIMENSIONS]) == {"accuracy": 0.5, "format": 1.0}
    assert named.attributes[semconv.REWARD_PRIMARY] == "accuracy"


def test_step_rewards_inside_an_operation_are_not_episode_rewards(store):
    def agent(task):
        with agl.operation("write_query") as op:
            op.set_input(task)
            agl.emit_reward(0.3)
            op.set_output("SELECT 1")

    done = run_one(store, agl.rollout(agent))
    assert done.final_reward is None
    spans = store.query_spans(done.rollout_id)
    (reward,) = [s for s in spans if s.kind == "reward"]
    (op,) = [s for s in spans if s.name == semconv.SPAN_OPERATION]
    assert reward.attributes[semconv.REWARD_SCOPE] == "step"
    assert reward.parent_id == op.span_id
    assert op.attributes[semconv.OPERATION_OUTPUT] == "SELECT 1"  # strings stay strings


class Planner:
    @agl.operation
    def plan(self, goal, *, depth=1):
        agl.emit_reward(0.5)
        return f"plan for {goal} ({depth})"

    @agl.operation("act")
    async def act(self, step):
        await asyncio.sleep(0)
        return step.upper()

    @classmethod
    @agl.operation
    def describe(cls):
        return cls.__name__


@agl.operation
def check(answer):
    return answer == "OK"


@agl.operation("fetch", source="cache")
async def fetch(key):
    return {"key": key}


def test_operation_decorators_on_functions_methods_and_coroutines(store):
    assert inspect.iscoroutinefunction(Planner.act) and inspect.iscoroutinefunction(fetch)
    assert (check.__name__, Planner.plan.__name__) == ("check", "plan")  # functools.wraps

    def agent(task):
        planner = Planner()
        text = planner.plan("dinner", depth=2)
        done = asyncio.run(planner.act("ok"))
        fetched = asyncio.run(fetch("k"))
        return (
            1.0
            if text.startswith("plan") and check(done) and fetched["key"] == "k" and Planner.describe() == "Planner"
            else 0.0
        )

    done = run_one(store, agl.rollout(agent))
    assert done.status == "succeeded" and done.final_reward == 1.0
    spans = store.query_spans(done.rollout_id)
    ops = {s.attributes[semconv.OPERATION]: s for s in spans if s.name == semconv.SPAN_OPERATION}
    assert sorted(ops) == ["act", "check", "describe", "fetch", "plan"]

    def recorded(name, key):
        value = ops[name].attributes.get(key)
        return json.loads(value) if isinstance(value, str) and value[:1] in "[{" else value

    assert recorded("plan", semconv.OPERATION_INPUT) == {"args": ["dinner"], "depth": 2}  # self is not recorded
    assert recorded("plan", semconv.OPERATION_OUTPUT) == "plan for dinner (2)"
    assert (recorded("act", semconv.OPERATION_INPUT), recorded("act", semconv.OPERATION_OUTPUT)) == ("ok", "OK")
    assert (recorded("check", semconv.OPERATION_INPUT), recorded("check", semconv.OPERATION_OUTPUT)) == ("OK", True)
    assert recorded("fetch", semconv.OPERATION_OUTPUT) == {"key": "k"} and ops["fetch"].attributes["source"] == "cache"
    assert recorded("describe", semconv.OPERATION_OUTPUT) == "Planner"
    (reward,) = [s for s in spans if s.kind == "reward" and s.attributes[semconv.REWARD_SCOPE] == "step"]
    assert reward.parent_id == ops["plan"].span_id  # a reward inside a decorated method is that step's


@pytest.mark.parametrize(
    "value, primary, message",
    [
        ({"a": 1.0, "b": 2.0}, None, "say which one is the primary"),
        ({"a": 1.0}, "b", "not one of the reward dimensions"),
        ("high", None, "must be a number"),
        ({}, None, "empty dict"),
        (float("nan"), None, "must be a finite number, got nan"),
        ({"a": 1.0, "b": float("inf")}, "a", "'b' must be a finite number, got inf"),
    ],
)
def test_bad_rewards_say_what_is_wrong(value, primary, message):
    with pytest.raises((ValueError, TypeError), match=message):
        agl.emit_reward(value, primary=primary)


def test_emitters_record_messages_objects_and_handled_exceptions(store):
    def agent(task):
        agl.emit_message("thinking")
        agl.emit_object({"plan": [1, 2]})
        try:
            raise KeyError("missing")
        except KeyError as exc:
            agl.emit_exception(exc)
        return 1

    done = run_one(store, agl.rollout(agent))
    spans = {s.name: s for s in store.query_spans(done.rollout_id)}
    assert spans[semconv.SPAN_MESSAGE].attributes[semconv.MESSAGE_BODY] == "thinking"
    assert json.loads(spans[semconv.SPAN_OBJECT].attributes[semconv.OBJECT_JSON]) == {"plan": [1, 2]}
    exc_span = spans[semconv.SPAN_EXCEPTION]
    assert exc_span.status == "error" and exc_span.attributes[semconv.ERROR_TYPE] == "KeyError"


def test_tool_decorator_records_arguments_results_and_errors(store):
    @agl.tool
    def divide(a, b):
        return a / b

    def agent(task):
        divide(6, 3)
        with pytest.raises(ZeroDivisionError):
            divide(1, 0)
        return 1

    done = run_one(store, agl.rollout(agent))
    tools = [s for s in store.query_spans(done.rollout_id) if s.kind == "tool"]
    assert [json.loads(t.attributes[semconv.TOOL_CALL_ARGUMENTS]) for t in tools] == [
        {"a": 6, "b": 3},
        {"a": 1, "b": 0},
    ]
    assert tools[0].attributes[semconv.TOOL_CALL_RESULT] == 2.0 and tools[0].status != "error"
    assert tools[1].status == "error" and tools[1].attributes[semconv.ERROR_TYPE] == "ZeroDivisionError"


class Calculator:
    @agl.tool
    def add(self, a, b):
        return a + b

    @agl.tool(name="multiply")
    async def mul(self, a, b):
        await asyncio.sleep(0)
        return a * b


def test_tool_decorator_on_methods_and_coroutines(store):
    assert inspect.iscoroutinefunction(Calculator.mul) and Calculator.add.__name__ == "add"

    def agent(task):
        calc = Calculator()
        return float(asyncio.run(calc.mul(calc.add(1, b=2), 3)) == 9)

    done = run_one(store, agl.rollout(agent))
    assert done.final_reward == 1.0
    tools = [s for s in store.query_spans(done.rollout_id) if s.kind == "tool"]
    assert [t.attributes[semconv.TOOL_NAME] for t in tools] == ["add", "multiply"]
    # arguments by name, without the method's self
    assert [json.loads(t.attributes[semconv.TOOL_CALL_ARGUMENTS]) for t in tools] == [
        {"a": 1, "b": 2},
        {"a": 3, "b": 3},
    ]
    assert [t.attributes[semconv.TOOL_CALL_RESULT] for t in tools] == [3, 9]


def test_a_reward_inside_a_frameworks_own_span_within_a_tool_is_a_step_reward(store):
    """Frameworks that trace with OpenTelemetry themselves (AutoGen) open their own span inside agl's tool
    span: a no-op one sharing its context (no SDK installed) or a recorded one (the user's SDK)."""
    from opentelemetry.sdk.trace import TracerProvider

    frameworks_tracers = {"no SDK": otel_trace.NoOpTracer(), "the user's SDK": TracerProvider().get_tracer("framework")}

    @agl.tool
    def graded(name):
        with frameworks_tracers[name].start_as_current_span("framework's own tool span"):
            agl.emit_reward(0.5)
        return name

    def agent(task):
        for name in frameworks_tracers:
            graded(name)
        agl.emit_reward(1.0)  # the episode's

    done = run_one(store, agl.rollout(agent))
    assert done.final_reward == 1.0
    rewards = [s for s in store.query_spans(done.rollout_id) if s.kind == "reward"]
    assert [r.attributes[semconv.REWARD_SCOPE] for r in rewards] == ["step", "step", "episode"]


def test_rollout_decorator_supplies_arguments_by_name(store):
    seen = {}

    def agent(task, llm, rollout, resources):
        seen.update(task=task, model=llm.model, rollout_id=rollout.rollout_id, names=sorted(resources))
        return 1

    done = run_one(store, agl.rollout(agent), {"x": 2})
    assert seen == {"task": {"x": 2}, "model": "m", "rollout_id": done.rollout_id, "names": ["main_llm"]}


def test_rollout_decorator_rejects_arguments_it_cannot_supply():
    with pytest.raises(TypeError, match="cannot supply"):
        agl.rollout(lambda task, database: 1)
    with pytest.raises(TypeError, match="must take the task as its first argument"):
        agl.rollout(lambda: 1)


def run_one_rollout(store, agent, resources):
    """Lists ``resources`` as the latest, enqueues a rollout and runs it with a fresh Runner of ``agent``."""
    store.add_resources(resources)
    store.enqueue_rollout({"q": 1})
    runner = Runner(agent, store)
    rollout = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    runner.close()
    return rollout


def test_of_several_llm_resources_the_llm_argument_gets_main_llm_else_the_first_with_one_warning(
    store, caplog, monkeypatch
):
    """``main_llm`` is the resource the trainers update: a judge LLM listed before it must not be the one the
    agent runs (and is trained) through. Without a ``main_llm``, the first, said once, not once per rollout."""
    from agl.runtime import litagent

    monkeypatch.setattr(litagent, "_warned_several", set())
    judge = agl.LLM(endpoint="http://127.0.0.1:9/v1", model="judge")
    policy = agl.LLM(endpoint="http://127.0.0.1:9/v1", model="policy")
    got = []
    agent = agl.rollout(lambda task, llm: got.append(llm.model) or 1.0)
    with caplog.at_level("WARNING", logger="agl.runtime.litagent"):
        for resources in (
            {"judge": judge, "main_llm": policy},
            {"judge": judge, "other": policy},
            {"judge": judge, "other": policy},
        ):
            assert run_one_rollout(store, agent, resources).status == "succeeded"
    assert got == ["policy", "judge", "judge"]
    warnings = [r.getMessage() for r in caplog.records if "several LLM" in r.getMessage()]
    assert warnings == [
        "the resources hold several LLM (judge, other) and none is named 'main_llm': the rollout function's 'llm' "
        "argument gets 'judge'. Name the one to train 'main_llm', or take `resources` and pick"
    ]


def test_of_several_prompt_templates_the_argument_gets_the_one_apo_optimizes(store, monkeypatch):
    """APO's docs and `agl train --algorithm apo` name the optimized template ``prompt``; the
    ``prompt_template`` argument preferred only a resource named ``prompt_template``, so with a second
    template listed first (a tool's prompt) the agent ran with that one, and APO's edits changed nothing."""
    from agl.runtime import litagent

    monkeypatch.setattr(litagent, "_warned_several", set())
    got = []
    agent = agl.rollout(lambda task, prompt_template: got.append(prompt_template.template) or 1.0)
    tool_prompt, optimized = agl.PromptTemplate(template="tool: {x}"), agl.PromptTemplate(template="solve: {x}")
    for resources in (
        {"tool": tool_prompt, "prompt": optimized},
        {"prompt": tool_prompt, "prompt_template": optimized},
    ):
        assert run_one_rollout(store, agent, resources).status == "succeeded"
    assert got == ["solve: {x}", "solve: {x}"]


def test_agents_that_cannot_run_fail_their_rollout_and_say_what_to_do(tmp_path):
    class Unfinished(agl.LitAgent):
        pass

    store = SqliteLightningStore(tmp_path / "s.db")
    store.add_resources({"prompt": agl.PromptTemplate(template="{q}")})  # no LLM among the resources
    failures = []
    for agent in (agl.rollout(lambda task, llm: 1.0), Unfinished()):
        store.enqueue_rollout({"q": 1})
        runner = Runner(agent, store)
        failures.append(runner.run_rollout(store.dequeue_rollout(runner.runner_id)))
        runner.close()
    store.close()
    assert [f.status for f in failures] == ["failed", "failed"]
    assert "takes 'llm' but the resources hold no LLM (have: ['prompt'])" in failures[0].error
    assert "initial_resources={'main_llm': agl.LLM(...)}" in failures[0].error
    assert "Unfinished must implement rollout(self, task, resources, rollout)" in failures[1].error


def test_class_agent_validation_rollout_and_async(store):
    class Agent(agl.LitAgent[dict]):
        async def rollout(self, task, resources, rollout):
            await asyncio.sleep(0)
            return 0.25

        def validation_rollout(self, task, resources, rollout):
            return 0.5

    assert run_one(store, Agent()).final_reward == 0.25
    rollout = store.enqueue_rollout({"q": 2}, mode="val")
    runner = Runner(Agent(), store)
    done = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    runner.close()
    assert done.rollout_id == rollout.rollout_id and done.final_reward == 0.5


def test_agent_exception_fails_the_rollout_with_the_error(store):
    def agent(task):
        raise RuntimeError("tool server is down")

    done = run_one(store, agl.rollout(agent))
    assert done.status == "failed"
    assert "RuntimeError: tool server is down" in done.error
    root = [s for s in store.query_spans(done.rollout_id) if s.name == "agl.rollout"][0]
    assert root.status == "error"


def test_a_nan_reward_fails_the_rollout_and_says_so(store):
    # a NaN must not reach the store (SQLite keeps it as "no reward") nor the advantages
    done = run_one(store, agl.rollout(lambda task: float("nan")))
    assert done.status == "failed" and done.final_reward is None
    assert "the reward rollout() returned must be a finite number, got nan" in done.error


def test_a_returned_dict_without_a_reward_key_fails_the_rollout_and_says_so(store):
    # {"accuracy": ...} is not the episode reward: counting it as "no reward" would lose it without a word
    done = run_one(store, agl.rollout(lambda task: {"accuracy": 0.5}))
    assert done.status == "failed" and done.final_reward is None
    assert "returned a dict without a 'reward' key (keys: ['accuracy'])" in done.error


@pytest.mark.parametrize("output", [{"output": "SELECT 1", "intermediate_steps": []}, "SELECT 1", ["a", "b"]])
def test_a_rollout_that_emitted_its_reward_may_return_the_agents_output(store, output):
    """The seeds' SQL agent: ``agl.emit_reward(reward); return result`` (the LangChain executor's dict)."""

    def agent(task):
        agl.emit_reward(0.75)
        return output

    done = run_one(store, agl.rollout(agent))
    assert done.status == "succeeded" and done.final_reward == 0.75
    rewards = [s for s in store.query_spans(done.rollout_id) if s.kind == "reward"]
    assert len(rewards) == 1  # the emitted one; the output adds none


@pytest.mark.parametrize("returned", [Fraction(1, 4), Decimal("0.25"), {"reward": Fraction(1, 4), "answer": "x"}])
def test_any_real_number_is_a_reward(store, returned):
    done = run_one(store, agl.rollout(lambda task: returned))
    assert done.status == "succeeded" and done.final_reward == 0.25


def test_a_string_reward_fails_the_rollout_and_says_so(store):
    done = run_one(store, agl.rollout(lambda task: "0.5"))
    assert done.status == "failed"
    assert (
        "the reward rollout() returned must be a number, None, or a dict with a 'reward' key, got str '0.5'"
        in done.error
    )


def test_a_hung_agent_times_out_and_the_runner_moves_on(store):
    release = threading.Event()

    def agent(task):
        if task["q"] == "hang":
            release.wait(10)
        return 1

    store.add_resources({})
    store.enqueue_rollout({"q": "hang"})
    store.enqueue_rollout({"q": "fine"})
    runner = Runner(agl.rollout(agent), store, rollout_timeout=0.2)
    first = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    second = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    release.set()
    runner.close()
    assert first.status == "failed" and "timeout" in first.error
    assert runner.stuck
    assert second.status == "succeeded"


def test_a_hung_async_agent_is_cancelled_and_its_thread_goes_on(store):
    """A coroutine past its timeout is cancelled: its spans end and are kept, and the runner is not stuck
    (no abandoned thread, no process restart); the next rollout runs on the same agent thread."""
    threads = []

    async def agent(task):
        threads.append(threading.get_ident())
        if task["q"] == "hang":
            with agl.operation("waiting"):
                await asyncio.sleep(60)
        return 1

    store.add_resources({})
    store.enqueue_rollout({"q": "hang"})
    store.enqueue_rollout({"q": "fine"})
    runner = Runner(agl.rollout(agent), store, rollout_timeout=0.3)
    try:
        first = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
        second = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    finally:
        runner.close()
    assert first.status == "failed" and "ran past its timeout of 0.3 s" in first.error
    assert not runner.stuck and second.status == "succeeded" and threads[0] == threads[1]
    spans = {s.name: s for s in store.query_spans(first.rollout_id)}
    assert spans["agl.operation"].status == "error" and spans["agl.rollout"].status == "error"
    assert spans["agl.operation"].attributes[semconv.ERROR_TYPE] == "CancelledError"


def test_an_async_agent_that_ignores_its_cancellation_is_abandoned(store, monkeypatch):
    monkeypatch.setattr(agl.runtime.runner, "CANCEL_GRACE_S", 0.2)
    release = threading.Event()

    async def agent(task):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            release.wait(10)  # blocks its event loop: cancellation cannot get through
        return 1

    store.add_resources({})
    store.enqueue_rollout({"q": "hang"})
    runner = Runner(agl.rollout(agent), store, rollout_timeout=0.2)
    try:
        first = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
        assert runner.stuck and first.status == "failed" and "timeout" in first.error
    finally:
        release.set()
        runner.close()


def test_a_result_that_comes_after_the_store_gave_up_on_the_attempt_is_ignored_and_said_so(store, caplog):
    """A runner presumed dead (no heartbeat within heartbeat_timeout: a paused process, a partition) comes
    back with its result: the store's verdict and the retry stand, the late result changes nothing, the
    spans the attempt made are kept, and the runner says why its result was not recorded."""
    started, release = threading.Event(), threading.Event()

    def agent(task):
        agl.emit_reward(0.5)
        started.set()
        release.wait(10)
        return 0.5

    store.add_resources({})
    store.enqueue_rollout({"q": 1}, config=agl.RolloutConfig(heartbeat_timeout_seconds=0.2, max_attempts=2))
    runner = Runner(agl.rollout(agent), store, heartbeat_interval=30)  # no heartbeat in time
    claimed = store.dequeue_rollout(runner.runner_id)
    result = {}
    worker = threading.Thread(target=lambda: result.update(done=runner.run_rollout(claimed)))
    with caplog.at_level("WARNING", logger="agl.runtime.runner"):
        worker.start()
        assert started.wait(10)
        assert runner.tracer.flush(10)  # the reward span is stored (a span batch counts as a heartbeat) ...
        time.sleep(0.3)  # ... then nothing for longer than the attempt's heartbeat timeout
        assert [r.status for r in store.reap_expired()] == ["queued"]  # the store's retry
        release.set()
        worker.join(10)
    runner.close()
    done = result["done"]
    assert (done.status, done.final_reward, done.attempt.status) == ("queued", None, "unresponsive")
    assert any(
        "result not recorded" in r.getMessage() and "stop working on it" in r.getMessage() for r in caplog.records
    )
    assert [s.kind for s in store.query_spans(done.rollout_id, claimed.attempt.attempt_id)].count("reward") == 1
    retry = store.dequeue_rollout("another-runner")
    assert retry.rollout_id == done.rollout_id and retry.attempt.sequence == 2


def _run_in_thread(runner, claimed):
    result = {}
    worker = threading.Thread(target=lambda: result.update(done=runner.run_rollout(claimed)))
    worker.start()
    return worker, result


def test_the_runner_heartbeats_a_long_quiet_rollout_so_the_store_keeps_it(store):
    """An agent that makes no span for longer than the attempt's heartbeat timeout (a long tool, a slow model)
    is kept alive by the runner's own heartbeats: the store never takes it for a dead runner."""
    store.enqueue_rollout({"q": 1}, config=agl.RolloutConfig(heartbeat_timeout_seconds=0.5))
    runner = Runner(agl.rollout(lambda task: time.sleep(1.2) or 1.0), store, heartbeat_interval=0.05)
    claimed = store.dequeue_rollout(runner.runner_id)
    worker, result = _run_in_thread(runner, claimed)
    reaped = []
    while worker.is_alive():
        reaped += store.reap_expired()
        time.sleep(0.05)
    runner.close()
    assert reaped == []
    assert (result["done"].status, result["done"].final_reward) == ("succeeded", 1.0)
    assert store.query_attempts(claimed.rollout_id)[0].last_heartbeat > claimed.attempt.start_time + 0.6


class FlakyHeartbeats(SqliteLightningStore):
    """A real SQLite store whose heartbeat calls fail for a while (a store server restarting)."""

    failures = 2
    calls = 0

    def heartbeat(self, rollout_id, attempt_id):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("store server restarting")
        return super().heartbeat(rollout_id, attempt_id)


def test_failing_heartbeats_are_logged_and_retried_without_failing_the_rollout(tmp_path, caplog):
    store = FlakyHeartbeats(tmp_path / "flaky.db")
    store.enqueue_rollout({"q": 1})
    runner = Runner(agl.rollout(lambda task: time.sleep(0.5) or 1.0), store, heartbeat_interval=0.05)
    try:
        with caplog.at_level("WARNING", logger="agl.runtime.runner"):
            done = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    finally:
        runner.close()
        store.close()
    assert (done.status, done.final_reward) == ("succeeded", 1.0)
    failed = [r.getMessage() for r in caplog.records if "heartbeat for" in r.getMessage()]
    assert len(failed) == 2 and "store server restarting" in failed[0]
    assert store.calls > 3  # it went on heartbeating after the failures


def test_a_heartbeat_the_store_refuses_as_stale_stops_the_heartbeats_and_says_why(store, caplog):
    """The store gave the attempt up (here: no heartbeat within 0.1 s); the next heartbeat is refused, and the
    runner says so once and stops heartbeating, instead of warning every interval until the agent ends."""
    store.enqueue_rollout({"q": 1}, config=agl.RolloutConfig(heartbeat_timeout_seconds=0.1, max_attempts=2))
    runner = Runner(agl.rollout(lambda task: time.sleep(1.2) or 1.0), store, heartbeat_interval=0.6)
    claimed = store.dequeue_rollout(runner.runner_id)
    with caplog.at_level("WARNING", logger="agl.runtime.runner"):
        worker, result = _run_in_thread(runner, claimed)
        time.sleep(0.2)
        assert [r.status for r in store.reap_expired()] == ["queued"]
        worker.join(10)
    runner.close()
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "was ended by the store" in m] == [
        f"attempt {claimed.attempt.attempt_id} of {claimed.rollout_id} was ended by the store (timed out?)"
    ]
    assert not any("heartbeat for" in m for m in messages)
    assert result["done"].attempt.status == "unresponsive"


def test_agent_sees_the_same_result_when_the_store_refuses_spans(store):
    """A broken store must never change what the agent's own code sees or returns."""

    class ClosedSink:
        def add_spans(self, spans):
            raise ConnectionError("store is down")

    results = []

    def agent(task):
        with agl.operation("step"):
            results.append(sum(range(10)))
        return 1.0

    runner = Runner(agl.rollout(agent), store, flush_timeout=0.3)
    runner.tracer.set_store(ClosedSink())
    try:
        store.add_resources({})
        store.enqueue_rollout({"q": 1})
        done = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    finally:
        runner.tracer.set_store(store)
        runner.close()
    assert results == [45]
    assert done.status == "succeeded" and done.final_reward == 1.0
    assert runner.tracer.flush(5)  # the spans were kept and reach the store once it is back


def test_spans_from_thread_pools_stay_in_their_rollout(store):
    from concurrent.futures import ThreadPoolExecutor

    def agent(task):
        with ThreadPoolExecutor(2) as pool:
            futures = [agl.submit(pool, agl.emit_message, f"m{i}") for i in range(4)]
            [f.result() for f in futures]
        return 1

    done = run_one(store, agl.rollout(agent))
    spans = store.query_spans(done.rollout_id)
    root = [s for s in spans if s.name == "agl.rollout"][0]
    messages = [s for s in spans if s.name == semconv.SPAN_MESSAGE]
    assert len(messages) == 4
    assert all(m.parent_id == root.span_id for m in messages)
    assert sorted(s.sequence_id for s in spans) == list(range(len(spans)))


class CountingStore(SqliteLightningStore):
    """Counts the runner's store calls that claim or complete."""

    def __init__(self, path):
        super().__init__(path)
        self.calls = {"dequeue_many": 0, "complete_attempt": 0, "complete_and_dequeue": 0}

    def dequeue_many(self, *args, **kwargs):
        self.calls["dequeue_many"] += 1
        return super().dequeue_many(*args, **kwargs)

    def complete_attempt(self, *args, **kwargs):
        self.calls["complete_attempt"] += 1
        return super().complete_attempt(*args, **kwargs)

    def complete_and_dequeue(self, *args, **kwargs):
        self.calls["complete_and_dequeue"] += 1
        return super().complete_and_dequeue(*args, **kwargs)


def test_runner_claims_the_next_rollout_with_each_completion_never_past_max_rollouts(tmp_path):
    store = CountingStore(tmp_path / "counting.db")
    store.enqueue_many([agl.store.EnqueueRequest(input={"i": i}) for i in range(5)])
    runner = Runner(agl.rollout(lambda task: 1.0), store)
    try:
        assert runner.run_forever(threading.Event(), max_rollouts=3) == 3
    finally:
        runner.close()
    assert [r.status for r in store.query_rollouts()] == ["succeeded"] * 3 + ["queued"] * 2  # none left claimed
    # one dequeue to start; the first two completions claimed the next rollout, the third only completed
    # (SQLite's complete_and_dequeue is LightningStore's: complete_attempt, then dequeue_many)
    assert store.calls == {"complete_and_dequeue": 2, "complete_attempt": 2 + 1, "dequeue_many": 1 + 2}
    store.close()


def test_a_stop_during_a_rollout_claims_nothing_more(tmp_path):
    store = SqliteLightningStore(tmp_path / "stop.db")
    store.enqueue_many([agl.store.EnqueueRequest(input={"i": i}) for i in range(4)])
    stop = threading.Event()

    def agent(task):
        if task["i"] == 1:
            stop.set()
        return 1.0

    runner = Runner(agl.rollout(agent), store)
    try:
        assert runner.run_forever(stop) == 2
    finally:
        runner.close()
    assert [r.status for r in store.query_rollouts()] == ["succeeded"] * 2 + ["queued"] * 2
    store.close()


def test_emitting_outside_a_rollout_stores_nothing_and_says_so_once(monkeypatch, caplog):
    """An agent tried in a plain script (no Trainer, no Runner): its emits neither raise nor go anywhere,
    and one warning says how to run it so that they are stored."""
    from agl.tracing import emitters

    monkeypatch.setattr(emitters, "_warned_outside", False)
    before = agl.get_tracer().stats().enqueued
    with caplog.at_level("WARNING", logger="agl.tracing.emitters"):
        agl.emit_reward(1.0)
        agl.emit_message("hi")
        agl.emit_object({"a": 1})
        agl.emit_exception(ValueError("x"))
    warnings = [r.getMessage() for r in caplog.records if "outside a rollout" in r.getMessage()]
    assert warnings == [
        "agl.emit_reward was called outside a rollout: nothing is stored. Run the agent through Trainer.dev/fit "
        "or a Runner, or wrap the call in agl.rollout_scope(...)."
    ]
    assert agl.get_tracer().stats().enqueued == before


FORKED_EMIT = """
import concurrent.futures, logging, multiprocessing
import agl

logging.basicConfig(level=logging.WARNING, format="%(message)s")


def worker():
    agl.emit_reward(1.0)
    return 1.0


with agl.rollout_scope("ro-forked", "at-1"):
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        print("worker returned", pool.submit(worker).result())
"""


def test_a_reward_emitted_in_a_forked_worker_says_it_is_lost(tmp_path):
    """A ProcessPoolExecutor worker forked inside a rollout inherits its scope, so no "outside a rollout"
    warning fired, and what it emitted went nowhere without a word."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED_EMIT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "worker returned 1.0" in done.stdout
    assert "agl.emit_reward was called in a process forked from the rollout's" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "result, stored",
    [([1, 2, 3], "[1,2,3]"), ((0.5,), "[0.5]"), ([], "[]"), ([1, "x", 2], '[1,"x",2]'), ([True, 1], "[true,1]")],
)
def test_a_tool_result_that_is_a_list_is_stored_as_json_text_even_of_numbers(store, result, stored):
    # semconv: results are strings and numbers as they are, anything else JSON. Lists of numbers used to stay
    # lists (the token-id rule), and a mixed list with numbers at both ends got the whole span refused.
    @agl.tool
    def lookup(key):
        return result

    done = run_one(store, agl.rollout(lambda task: float(lookup(key=[7, 8]) == result)))
    assert done.final_reward == 1.0
    (tool,) = [s for s in store.query_spans(done.rollout_id) if s.kind == "tool"]
    assert tool.attributes[semconv.TOOL_CALL_RESULT] == stored
    assert json.loads(tool.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"key": [7, 8]}


def test_agent_lightnings_primary_key_is_accepted_for_primary(store):
    """Agent Lightning code emits named rewards with primary_key=: a bare TypeError with agl."""

    def agent(task):
        with pytest.warns(DeprecationWarning, match="primary="):
            assert agl.emit_reward({"accuracy": 0.5, "length": 1.0}, primary_key="accuracy") == 0.5
        with pytest.raises(ValueError, match="pass primary= only"):
            agl.emit_reward({"accuracy": 0.5}, primary="length", primary_key="accuracy")

    done = run_one(store, agl.rollout(agent))
    assert done.status == "succeeded" and done.final_reward == 0.5
    (span,) = rewards_of(store, done.rollout_id)
    assert span.attributes[semconv.REWARD_PRIMARY] == "accuracy"


def test_the_root_span_names_the_task_and_mode_as_docs_semconv_says(store):
    done = run_one(store, agl.rollout(lambda task: 1.0), {"task_id": "t-7", "q": 1})
    (root,) = [s for s in store.query_spans(done.rollout_id) if s.name == "agl.rollout"]
    assert root.kind == "agent" and root.attributes[semconv.ROLLOUT_MODE] == "train"
    assert root.attributes[semconv.ROLLOUT_TASK_ID] == done.task_id
