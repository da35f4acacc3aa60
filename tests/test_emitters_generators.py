"""Recording never consumes the agent's iterators; generator operations and tools; one operation object used
several times at once; emitter argument checks. Real rollouts in a real SQLite store through the Runner."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from openai import OpenAI

import agl
from agl import semconv
from agl.runtime.runner import Runner
from agl.store import SqliteLightningStore
from agl.tracing.encoding import ITERATOR_MARK


@pytest.fixture()
def store(tmp_path):
    s = SqliteLightningStore(tmp_path / "store.db")
    yield s
    s.close()


def run_one(store, agent, endpoint="http://127.0.0.1:9/v1"):
    store.add_resources({"main_llm": agl.LLM(endpoint=endpoint, model="m")})
    store.enqueue_rollout({"q": 1})
    runner = Runner(agl.rollout(agent), store)
    try:
        return runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    finally:
        runner.close()


def operations(spans):
    return {s.attributes[semconv.OPERATION]: s for s in spans if s.name == semconv.SPAN_OPERATION}


def tools(spans):
    return {s.attributes[semconv.TOOL_NAME]: s for s in spans if s.kind == "tool"}


def rewards(spans):
    return [s for s in spans if s.kind == "reward" and s.attributes.get(semconv.REWARD_SOURCE) == "emitted"]


# -- 1. generator functions decorated with @agl.operation / @agl.tool ---------------------------------------


@agl.operation("numbers")
def numbers(n):
    for i in range(n):
        agl.emit_reward(0.1)  # inside the operation's span: a step reward
        yield i
    return "done"


@agl.tool
def stream_rows(n: int):
    """Yield rows."""
    for i in range(n):
        yield {"row": i}


@agl.operation("echo")
def echo():
    received = []
    while True:
        value = yield len(received)
        if value is None:
            return received
        received.append(value)


def test_a_decorated_generator_yields_to_its_caller_and_its_span_covers_the_iteration(store):
    got = {}

    def agent(task):
        got["operation"] = list(numbers(3))
        got["tool"] = list(stream_rows(2))
        gen = echo()
        got["sent"] = [next(gen), gen.send("a"), gen.send("b")]
        try:
            gen.send(None)
        except StopIteration as stop:
            got["returned"] = stop.value
        rows = stream_rows(5)
        got["first"] = next(rows)
        agl.emit_reward(0.7)  # the caller's code between items: not inside the tool, an episode reward
        rows.close()  # closed early: the span ends, not as an error

    done = run_one(store, agent)
    assert done.status == "succeeded", done.error
    assert got == {
        "operation": [0, 1, 2],
        "tool": [{"row": 0}, {"row": 1}],
        "sent": [0, 1, 2],
        "returned": ["a", "b"],
        "first": {"row": 0},
    }
    spans = store.query_spans(done.rollout_id)
    ops = operations(spans)
    assert ops["numbers"].attributes[semconv.OPERATION_INPUT] == 3
    assert ops["numbers"].attributes[semconv.OPERATION_OUTPUT] == "done"  # the generator's return value
    assert json.loads(ops["echo"].attributes[semconv.OPERATION_OUTPUT]) == ["a", "b"]
    # rule 4: the rewards emitted in the generator's body are step rewards of its span, and the span stayed
    # open until the generator was exhausted
    step = [r for r in rewards(spans) if r.attributes[semconv.REWARD_SCOPE] == "step"]
    assert len(step) == 3 and {r.parent_id for r in step} == {ops["numbers"].span_id}
    assert all(r.attributes[semconv.OPERATION_SPAN_ID] == ops["numbers"].span_id for r in step)
    assert max(r.end_time for r in step) <= ops["numbers"].end_time
    assert done.final_reward == 0.7  # the caller's reward, emitted with the tool suspended
    (episode,) = [r for r in rewards(spans) if r.attributes[semconv.REWARD_SCOPE] == "episode"]
    root = [s for s in spans if s.parent_id is None][0]
    assert episode.parent_id == root.span_id
    tool_spans = [s for s in spans if s.kind == "tool"]
    assert len(tool_spans) == 2 and {s.status for s in tool_spans} == {"unset"}
    assert json.loads(tool_spans[0].attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"n": 2}


@agl.operation("astream")
async def astream(n):
    for i in range(n):
        await asyncio.sleep(0)
        agl.emit_reward(0.2)
        yield i


@agl.tool(name="search")
async def asearch(query: str):
    yield f"{query}-1"
    raise LookupError("index gone")


def test_a_decorated_async_generator_yields_and_its_rewards_are_step_rewards(store):
    got = {}

    def agent(task):
        async def main():
            got["items"] = [i async for i in astream(2)]
            found = []
            try:
                async for hit in asearch("q"):
                    found.append(hit)
            except LookupError as exc:
                got["error"] = str(exc)
            got["found"] = found

        asyncio.run(main())
        return 1.0

    done = run_one(store, agent)
    assert done.status == "succeeded" and done.final_reward == 1.0, done.error  # not replaced by a 0.2
    assert got == {"items": [0, 1], "error": "index gone", "found": ["q-1"]}
    spans = store.query_spans(done.rollout_id)
    op = operations(spans)["astream"]
    step = rewards(spans)
    assert len(step) == 2 and all(
        r.attributes[semconv.REWARD_SCOPE] == "step" and r.parent_id == op.span_id for r in step
    )
    assert semconv.OPERATION_OUTPUT not in op.attributes  # not the repr of an async generator
    search = tools(spans)["search"]
    assert search.status == "error" and "index gone" in search.error


def test_an_llm_call_inside_a_generator_operation_carries_the_operations_span_id(store, fake_openai):
    agl.instrument()
    try:

        @agl.operation("ask")
        def ask(client, questions):
            for question in questions:
                reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}])
                agl.emit_reward(1.0)
                yield reply.choices[0].message.content

        def agent(task, llm):
            client = OpenAI(base_url=llm.endpoint, api_key="x")
            answers = list(ask(client, iter(["a?", "b?"])))
            return float(len(answers))

        done = run_one(store, agent, endpoint=fake_openai.base_url)
    finally:
        agl.uninstrument()
    assert done.status == "succeeded" and done.final_reward == 2.0, done.error
    spans = store.query_spans(done.rollout_id)
    op = operations(spans)["ask"]
    calls = [s for s in spans if s.kind == "llm"]
    assert len(calls) == 2 and all(c.attributes[semconv.OPERATION_SPAN_ID] == op.span_id for c in calls)
    assert all(c.parent_id == op.span_id for c in calls)
    assert op.attributes[semconv.OPERATION_INPUT].count(ITERATOR_MARK) == 1  # the questions were not drained


# -- 1. iterators, generators and files given to agl are recorded without being iterated -------------------


@agl.operation
def take_first(it):
    return next(it)


@agl.tool
def read_header(f):
    return f.readline().strip()


@agl.tool
def lazy_upper(words):
    return map(str.upper, words)


@agl.operation
def first_of_each(groups):
    return [next(g) for g in groups["iters"]]


def test_iterators_and_files_passed_returned_or_emitted_are_not_consumed(store, tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n1,2\n3,4\n")
    got = {}

    def agent(task):
        it = iter([1, 2, 3, 4])
        got["first"] = take_first(it)
        got["rest"] = list(it)
        with open(path) as f:
            got["header"] = read_header(f)
            got["rows"] = f.read().splitlines()
        got["upper"] = list(lazy_upper(["x", "y"]))
        groups = {"iters": [iter("abc"), iter("de")]}
        got["firsts"] = first_of_each(groups)
        got["left"] = ["".join(g) for g in groups["iters"]]
        pending = (n * n for n in range(3))
        agl.emit_object(pending)
        agl.emit_object({"pending": [iter([5, 6])], "plain": [1, 2]})
        got["pending"] = list(pending)
        return 1.0

    done = run_one(store, agent)
    assert done.status == "succeeded", done.error
    assert got == {
        "first": 1,
        "rest": [2, 3, 4],
        "header": "a,b",
        "rows": ["1,2", "3,4"],
        "upper": ["X", "Y"],
        "firsts": ["a", "d"],
        "left": ["bc", "e"],
        "pending": [0, 1, 4],
    }
    spans = store.query_spans(done.rollout_id)
    ops, tls = operations(spans), tools(spans)
    assert ops["take_first"].attributes[semconv.OPERATION_INPUT].startswith(ITERATOR_MARK + "<list_iterator")
    assert "TextIOWrapper" in json.loads(tls["read_header"].attributes[semconv.TOOL_CALL_ARGUMENTS])["f"]
    assert tls["lazy_upper"].attributes[semconv.TOOL_CALL_RESULT].startswith(ITERATOR_MARK + "<map")
    recorded_groups = json.loads(ops["first_of_each"].attributes[semconv.OPERATION_INPUT])
    assert [v.startswith(ITERATOR_MARK) for v in recorded_groups["iters"]] == [True, True]
    objects = [s.attributes[semconv.OBJECT_JSON] for s in spans if s.name == semconv.SPAN_OBJECT]
    assert objects[0].startswith(ITERATOR_MARK + "<generator")
    second = json.loads(objects[1])
    assert second["plain"] == [1, 2] and second["pending"][0].startswith(ITERATOR_MARK)


# -- 5. one agl.operation object used several times at once ----------------------------------------------


step = agl.operation("step")


def test_one_operation_object_nested_and_in_concurrent_tasks_and_threads(store):
    def recurse(depth):
        with step as op:
            op.set_input(depth)
            if depth:
                recurse(depth - 1)
            agl.emit_reward(0.1)
            op.set_output(depth * 10)

    def agent(task):
        recurse(2)

        async def one(i):
            with step as op:
                op.set_input({"task": i})
                await asyncio.sleep(0.01 * (3 - i))
                agl.emit_reward(0.2)
                op.set_output(i)

        async def main():
            await asyncio.gather(*(one(i) for i in range(3)))

        asyncio.run(main())
        barrier = threading.Barrier(2)

        def in_thread():
            with step:
                barrier.wait(timeout=5)
                agl.emit_reward(0.3)

        threads = [threading.Thread(target=agl.propagate(in_thread)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return 1.0

    done = run_one(store, agent)
    assert done.status == "succeeded" and done.final_reward == 1.0, done.error
    spans = store.query_spans(done.rollout_id)
    ops = [s for s in spans if s.name == semconv.SPAN_OPERATION]
    assert len(ops) == 3 + 3 + 2
    by_id = {s.span_id: s for s in ops}
    nested = sorted(
        (s for s in ops if s.attributes.get(semconv.OPERATION_INPUT) in (0, 1, 2)),
        key=lambda s: s.attributes[semconv.OPERATION_INPUT],
    )
    # each entry its own span, nested in the one it was entered in, its own input and output
    assert [s.attributes[semconv.OPERATION_OUTPUT] for s in nested] == [0, 10, 20]
    assert nested[0].parent_id == nested[1].span_id and nested[1].parent_id == nested[2].span_id
    concurrent = {
        json.loads(s.attributes[semconv.OPERATION_INPUT])["task"]: s
        for s in ops
        if isinstance(s.attributes.get(semconv.OPERATION_INPUT), str)
    }
    assert {i: s.attributes[semconv.OPERATION_OUTPUT] for i, s in concurrent.items()} == {0: 0, 1: 1, 2: 2}
    for reward in rewards(spans):
        assert reward.attributes[semconv.REWARD_SCOPE] == "step" and reward.parent_id in by_id
        assert reward.attributes[semconv.OPERATION_SPAN_ID] == reward.parent_id
    assert sorted(len([r for r in rewards(spans) if r.parent_id == s.span_id]) for s in ops) == [1] * 8


# -- 8a, 8b, 8i, 8k ----------------------------------------------------------------------------------------


def test_emit_reward_refuses_attributes_that_would_overwrite_its_own(store):
    with pytest.raises(ValueError, match="agl.reward.scope, agl.reward.value"):
        agl.emit_reward(0.5, attributes={"agl.reward.value": 99, "agl.reward.scope": "episode", "judge": "x"})

    def agent(task):
        agl.emit_reward(0.5, attributes={"judge": "gpt"})  # other keys are kept
        agl.emit_reward(0.5, attributes={semconv.REWARD_VALUE: 99})

    done = run_one(store, agent)
    assert done.status == "failed" and "may not set agl.reward.value" in done.error
    (reward,) = rewards(store.query_spans(done.rollout_id))
    assert reward.attributes["judge"] == "gpt" and reward.attributes[semconv.REWARD_VALUE] == 0.5


def test_emit_exception_with_a_string_says_to_pass_the_exception():
    with pytest.raises(TypeError, match="takes the exception object.*got str 'boom'.*emit_message"):
        agl.emit_exception("boom")


def test_a_reward_too_large_for_a_float_says_it_is_out_of_range():
    with pytest.raises(ValueError, match="a reward is out of range: 1000000.*does not fit in a float"):
        agl.emit_reward(10**400)
    with pytest.raises(ValueError, match="reward 'acc' is out of range"):
        agl.emit_reward({"acc": 10**400})


@agl.operation()
def named_after_the_function():
    return 1


@agl.operation(source="cache")
def also_named_after_the_function():
    return 2


def test_operation_with_empty_parentheses_is_named_after_the_function(store):
    done = run_one(store, lambda task: float(named_after_the_function() + also_named_after_the_function()))
    assert done.final_reward == 3.0
    ops = operations(store.query_spans(done.rollout_id))
    assert sorted(ops) == ["also_named_after_the_function", "named_after_the_function"]
    assert ops["also_named_after_the_function"].attributes["source"] == "cache"
