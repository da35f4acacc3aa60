"""Agent Lightning's small modules on agl: setup_logging, @reward and the reward readers on recorded spans,
the environment variables, and the span-attribute helpers of agl.utils.otel."""

from __future__ import annotations

import asyncio
import logging

import pytest

import agl
from agl import semconv
from agl.compat.env_var import LightningEnvVar, resolve_bool_env_var, resolve_int_env_var, resolve_str_env_var
from agl.emitter import find_final_reward, find_reward_spans, get_message_value, get_object_value, get_reward_value
from agl.reward import reward
from agl.runtime.runner import Runner
from agl.store import SqliteLightningStore
from agl.utils.otel import (
    extract_links_from_attributes,
    extract_tags_from_attributes,
    filter_and_unflatten_attributes,
    make_link_attributes,
    make_tag_attributes,
    query_linked_spans,
)

# -- setup_logging ---------------------------------------------------------------------------------------------


@pytest.fixture()
def restored_loggers():
    """setup_logging changes process-wide loggers: put them back for the other tests."""
    names = ["agl", "agl.tracing.emitters", "compat_test_lib"]
    saved = {
        n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level, logging.getLogger(n).propagate)
        for n in names
    }
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers, logger.level, logger.propagate = handlers, level, propagate


def test_setup_logging_twice_prints_each_line_once(restored_loggers, capsys):
    agl.setup_logging("INFO", color=False)
    agl.setup_logging("debug", color=False, apply_to=["compat_test_lib"])
    logging.getLogger("agl.some.module").debug("agl line")
    logging.getLogger("compat_test_lib").info("library line")
    err = capsys.readouterr().err
    assert err.count("agl line") == 1 and err.count("library line") == 1
    assert logging.getLogger("agl").level == logging.DEBUG
    assert logging.getLogger("compat_test_lib").propagate is False


def test_setup_logging_level_below_is_not_printed(restored_loggers, capsys):
    agl.setup_logging(logging.WARNING, color=False)
    logging.getLogger("agl.x").info("quiet line")
    logging.getLogger("agl.x").warning("loud line")
    err = capsys.readouterr().err
    assert "quiet line" not in err and "loud line" in err


def test_setup_logging_bad_level_says_what_to_use(restored_loggers):
    with pytest.raises(ValueError, match=r"unknown log level 'LOUD': use DEBUG, INFO"):
        agl.setup_logging("LOUD")


def test_emitter_debug_variable_sets_the_emitter_logger(restored_loggers, monkeypatch):
    monkeypatch.setenv("AGL_EMITTER_DEBUG", "yes")
    agl.setup_logging("WARNING", color=False)
    assert logging.getLogger("agl.tracing.emitters").level == logging.DEBUG


# -- @reward and the readers on real recorded spans --------------------------------------------------------------


@pytest.fixture()
def store(tmp_path):
    s = SqliteLightningStore(tmp_path / "store.db")
    yield s
    s.close()


def run_one(store, agent):
    store.enqueue_rollout({"q": 1})
    runner = Runner(agent, store)
    try:
        done = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    finally:
        runner.close()
    assert done.status == "succeeded", done
    return store.query_spans(done.rollout_id)


@reward
def score(answer: str) -> float:
    return 0.25 if answer == "a" else 0.0


@reward
async def score_async(answer: str) -> float:
    await asyncio.sleep(0)
    return 0.5 if answer == "a" else 0.0


def test_reward_decorator_emits_what_the_function_returns(store):
    returned = []

    def agent(task):
        returned.append(score("a"))

    spans = run_one(store, agl.rollout(agent))
    assert returned == [0.25]
    assert find_final_reward(spans) == 0.25
    assert [get_reward_value(s) for s in find_reward_spans(spans)] == [0.25]


def test_reward_decorator_on_an_async_function(store):
    async def agent(task):
        await score_async("a")

    assert find_final_reward(run_one(store, agl.rollout(agent))) == 0.5


def test_reward_decorator_refuses_a_non_number(store):
    @reward
    def bad() -> str:
        return "0.5"

    with pytest.raises(TypeError, match=r"the result of @reward function bad\(\) must be a number or None"):
        bad()


def test_final_reward_is_the_episode_reward_not_a_later_step_reward(store):
    def agent(task):
        agl.emit_reward(0.75)
        with agl.operation("grade"):
            agl.emit_reward(0.1)

    spans = run_one(store, agl.rollout(agent))
    assert sorted(get_reward_value(s) for s in find_reward_spans(spans)) == [0.1, 0.75]
    assert find_final_reward(spans) == 0.75


def test_returned_reward_is_the_final_reward(store):
    assert find_final_reward(run_one(store, agl.rollout(lambda task: 0.9))) == 0.9


def test_no_reward_is_none(store):
    assert find_final_reward(run_one(store, agl.rollout(lambda task: None))) is None


def test_messages_objects_and_annotations_read_back(store):
    def agent(task):
        agl.emit_message("thinking")
        agl.emit_object({"plan": [1, 2]})
        agl.emit_annotation(make_tag_attributes(["fast", "good"]))
        return 1.0

    spans = run_one(store, agl.rollout(agent))
    assert [get_message_value(s) for s in spans if get_message_value(s) is not None] == ["thinking"]
    assert [get_object_value(s) for s in spans if s.name == semconv.SPAN_OBJECT] == [{"plan": [1, 2]}]
    (annotation,) = [s for s in spans if s.name == "agl.annotation"]
    assert extract_tags_from_attributes(annotation.attributes) == ["fast", "good"]


def test_reward_links_find_the_operation_they_judge(store):
    def agent(task):
        with agl.operation("answer", conversation_id="c-1"):
            pass
        with agl.operation("answer", conversation_id="c-2"):
            pass
        agl.emit_reward(
            0.9, attributes={**make_link_attributes({"conversation_id": "c-2"}), **make_tag_attributes(["t"])}
        )

    spans = run_one(store, agl.rollout(agent))
    (reward_span,) = find_reward_spans(spans)
    assert filter_and_unflatten_attributes(reward_span.attributes, "agl.reward")["value"] == 0.9
    operations = [s for s in spans if s.name == semconv.SPAN_OPERATION]
    (linked,) = query_linked_spans(operations, extract_links_from_attributes(reward_span.attributes))
    assert linked.attributes["conversation_id"] == "c-2"
    assert query_linked_spans(spans, [{"key_match": "span_id", "value_match": linked.span_id}]) == [linked]


def test_agent_lightning_s_semconv_names_find_agl_s_spans(store):
    """Agent Lightning code reads spans with its semconv names (minimal/write_traces.py): they hold agl's."""
    from agl.semconv import AGL_ANNOTATION, AGL_OPERATION, LightningSpanAttributes

    def agent(task):
        with agl.operation(conversation_id="c-1"):
            pass
        agl.emit_annotation(make_tag_attributes(["t"]))
        agl.emit_reward(0.9)

    spans = run_one(store, agl.rollout(agent))
    assert [s.attributes["conversation_id"] for s in spans if s.name == AGL_OPERATION] == ["c-1"]
    assert len([s for s in spans if s.name == AGL_ANNOTATION]) == 1
    (reward_span,) = find_reward_spans(spans)
    assert filter_and_unflatten_attributes(reward_span.attributes, LightningSpanAttributes.REWARD.value)["value"] == 0.9


def test_trace_to_messages_adapt_gives_each_llm_call_as_chat_messages(store):
    """Agent Lightning code reads a rollout's LLM calls with TraceToMessages().adapt(spans) (apo/room_selector.py)."""
    from openai import OpenAI

    from agl.adapter import TraceToMessages
    from agl.testing.fake_openai import FakeOpenAIServer

    with FakeOpenAIServer() as server:

        def agent(task):
            client = OpenAI(base_url=server.base_url, api_key="k")
            for question in ("first 1", "second 2"):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}])

        agl.instrument(frameworks=[])
        try:
            spans = run_one(store, agl.rollout(agent))
        finally:
            agl.uninstrument()
    payloads = TraceToMessages().adapt(spans)
    assert [[m["content"] for m in p["messages"]] for p in payloads] == [
        ["first 1", "FAKE: first 1"],
        ["second 2", "FAKE: second 2"],
    ]
    assert [p["tools"] for p in payloads] == [None, None]


# -- environment variables -------------------------------------------------------------------------------------


def test_env_vars_resolve_override_then_environment_then_fallback(monkeypatch):
    monkeypatch.delenv("AGL_SERVER_PORT", raising=False)
    assert resolve_int_env_var(LightningEnvVar.AGL_SERVER_PORT, fallback=4747) == 4747
    monkeypatch.setenv("AGL_SERVER_PORT", "9999")
    assert resolve_int_env_var(LightningEnvVar.AGL_SERVER_PORT, fallback=4747) == 9999
    assert resolve_int_env_var(LightningEnvVar.AGL_SERVER_PORT, 1234, 4747) == 1234
    monkeypatch.setenv("AGL_MANAGED_STORE", "Off")
    assert resolve_bool_env_var(LightningEnvVar.AGL_MANAGED_STORE, fallback=True) is False
    monkeypatch.setenv("AGL_CURRENT_ROLE", "runner")
    assert resolve_str_env_var(LightningEnvVar.AGL_CURRENT_ROLE) == "runner"


@pytest.mark.parametrize(
    "variable, value, resolve, expected",
    [
        ("AGL_SERVER_PORT", "http", resolve_int_env_var, r"AGL_SERVER_PORT='http' is not an integer"),
        ("AGL_MANAGED_STORE", "maybe", resolve_bool_env_var, r"AGL_MANAGED_STORE='maybe' is not a yes/no value"),
    ],
)
def test_a_bad_env_value_says_what_was_wrong(monkeypatch, variable, value, resolve, expected):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=expected):
        resolve(LightningEnvVar[variable])
