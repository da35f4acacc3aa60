"""The recording LLM proxy in front of the real policy server (the tiny model), driven by the ``openai`` client.

tests/test_proxy.py checks the proxy against agl's fake OpenAI server; these are the cases that need a
model server that really generates, and really stops generating.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, List

import openai
import pytest
import test_proxy

from agl import semconv
from agl.instrumentation.proxy import LLMProxy
from agl.lightningrl.transitions import extract_transitions
from agl.lightningrl.tree import build_tree
from agl.serving import PolicyServer
from agl.store import InMemoryLightningStore
from agl.types import Rollout

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


# The fixtures of tests/test_proxy.py: an in-memory store, and a rollout of task-1 that a runner has claimed.
store = test_proxy.store
rollout = test_proxy.rollout


@pytest.fixture
def proxy(server: PolicyServer, store: InMemoryLightningStore) -> Iterator[LLMProxy]:
    with LLMProxy(server.base_url, store) as p:
        yield p


def agent_client(proxy: LLMProxy, rollout: Rollout, **options: Any) -> openai.OpenAI:
    """An agent the proxy alone records (no agl code in it), on its rollout's URL."""
    assert rollout.attempt is not None
    base_url = proxy.as_resource("policy").get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
    return openai.OpenAI(base_url=base_url, api_key="x", **options)


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_call_the_agent_timed_out_on_is_recorded_failed_not_as_the_answer_it_never_saw(
    server: PolicyServer, proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore
) -> None:
    """The agent's client times out while the model server is busy (here: paused), then the agent asks
    again. Its first request must not become a successful call once the server answers it: that answer
    never reached the agent, yet it was trained on with the reward the second answer earned."""
    with agent_client(proxy, rollout, timeout=0.5, max_retries=0) as client:
        with server.paused():
            with pytest.raises(openai.APITimeoutError):
                client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
            wait_until(lambda: proxy.in_flight == 0, timeout=5)  # the proxy noticed (or, before the fix, not)
        assert wait_until(lambda: proxy.in_flight == 0, timeout=30)
        answer = client.with_options(timeout=60).chat.completions.create(
            model="policy", messages=MESSAGES, max_tokens=4
        )

    spans: List[Any] = sorted(
        (s for s in store.query_spans(rollout.rollout_id) if s.kind == "llm"), key=lambda s: s.sequence_id
    )
    assert [(s.status, s.attributes.get(semconv.ERROR_TYPE)) for s in spans] == [
        ("error", "ClientDisconnected"),
        ("ok", None),
    ]
    assert spans[1].attributes[semconv.RESPONSE_ID] == answer.id
    assert proxy.stats.client_disconnects == 1
    transitions = extract_transitions(build_tree(spans), task_id="task-1").transitions
    assert [t.response_ids for t in transitions] == [list(spans[1].attributes[semconv.RESPONSE_TOKEN_IDS])]
