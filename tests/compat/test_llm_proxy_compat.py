"""Agent Lightning's LLMProxy API (agl.llm_proxy) on agl's recording proxy, in front of the fake OpenAI
server on 127.0.0.1, recording into real stores."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, Iterator, List

import httpx
import openai
import pytest

import agl
from agl import semconv
from agl.llm_proxy import LLMProxy
from agl.store import SqliteLightningStore
from agl.testing import FakeOpenAIServer
from agl.types import Rollout

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def model_list(api_base: str, name: str = "my-model", served: str = "hosted_vllm/fake-model") -> List[Any]:
    return [{"model_name": name, "litellm_params": {"model": served, "api_base": api_base}}]


@pytest.fixture()
def store(tmp_path) -> Iterator[SqliteLightningStore]:
    s = SqliteLightningStore(tmp_path / "store.db")
    yield s
    s.close()


@pytest.fixture()
def rollout(store: SqliteLightningStore) -> Rollout:
    store.enqueue_rollout({"question": "3 + 4"})
    claimed = store.dequeue_rollout("runner-1")
    assert claimed is not None and claimed.attempt is not None
    return claimed


@pytest.fixture()
def proxy(fake_openai: FakeOpenAIServer, store: SqliteLightningStore) -> Iterator[LLMProxy]:
    p = agl.LLMProxy(model_list=model_list(fake_openai.base_url), store=store)
    asyncio.run(p.start())
    yield p
    asyncio.run(p.stop())


def root_of(proxy: LLMProxy) -> str:
    return proxy.base_url[: -len("/v1")]


def llm_spans(store: SqliteLightningStore, rollout_id: str) -> list:
    return [s for s in store.query_spans(rollout_id) if s.kind == "llm"]


def test_a_rollout_route_request_lands_as_an_llm_span_with_token_ids(proxy, rollout, store, fake_openai):
    assert rollout.attempt is not None
    url = f"{root_of(proxy)}/rollout/{rollout.rollout_id}/attempt/{rollout.attempt.attempt_id}/v1/chat/completions"
    body: Dict[str, Any] = httpx.post(url, json={"model": "my-model", "messages": QUESTION}, timeout=30).json()
    sent = fake_openai.requests[-1]["body"]
    assert sent["model"] == "fake-model" and sent["return_token_ids"] is True  # hosted_vllm/ prefix removed
    (span,) = llm_spans(store, rollout.rollout_id)
    assert span.attempt_id == rollout.attempt.attempt_id
    assert span.attributes[semconv.PROMPT_TOKEN_IDS] == body["prompt_token_ids"]
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == body["choices"][0]["token_ids"]


def test_as_resource_gives_agents_their_rollout_route(proxy, rollout, store):
    assert rollout.attempt is not None
    llm = proxy.as_resource(sampling_parameters={"temperature": 0.5})
    assert isinstance(llm, agl.ProxyLLM) and llm.model == "my-model" and llm.sampling_parameters == {"temperature": 0.5}
    fixed = proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id)
    assert type(fixed) is agl.LLM
    for base_url in (llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id), fixed.endpoint):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        client.chat.completions.create(model=llm.model, messages=QUESTION)
    assert len(llm_spans(store, rollout.rollout_id)) == 2


def test_restart_keeps_the_address_agents_were_given(proxy):
    before = proxy.base_url
    asyncio.run(proxy.restart())
    assert proxy.is_running() and proxy.base_url == before
    assert httpx.get(f"{before}/models", timeout=30).status_code == 200


def test_a_proxy_made_empty_is_configured_later(fake_openai, store, rollout):
    """Agent Lightning's unsloth recipe: LLMProxy(port=, store=), then update_model_list() and restart()."""
    assert rollout.attempt is not None
    p = agl.LLMProxy(store=None)
    with pytest.raises(ValueError, match=r"LLMProxy has no store to record into: pass store= or call set_store"):
        asyncio.run(p.start())
    p.set_store(store)
    with pytest.raises(ValueError, match=r"LLMProxy has no model: pass model_list= or call update_model_list"):
        asyncio.run(p.start())
    p.update_model_list(model_list(fake_openai.base_url, served="openai/fake-model"))
    asyncio.run(p.restart())
    try:
        llm = p.as_resource()
        client = openai.OpenAI(base_url=llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id), api_key="x")
        client.chat.completions.create(model="my-model", messages=QUESTION)
    finally:
        asyncio.run(p.stop())
    assert len(llm_spans(store, rollout.rollout_id)) == 1


@pytest.mark.parametrize(
    "entries, expected",
    [
        (
            model_list("http://127.0.0.1:1/v1", "a") + model_list("http://127.0.0.1:1/v1", "b"),
            r"agl's LLMProxy serves one model, the model_list names \['a', 'b'\].*run one LLMProxy per model",
        ),
        (
            [{"model_name": "c", "litellm_params": {"model": "anthropic/claude"}}],
            r"LiteLLM model 'anthropic/claude': agl's LLMProxy forwards to OpenAI-compatible servers only",
        ),
        ([{"model": "x"}], r"a model_list entry is \{'model_name': NAME, 'litellm_params'"),
    ],
)
def test_a_model_list_agl_cannot_serve_says_why_in_one_line(entries, expected):
    with pytest.raises(ValueError, match=expected) as raised:
        agl.LLMProxy(model_list=entries)
    assert "\n" not in str(raised.value)


def test_unused_litellm_settings_are_logged_once(caplog, fake_openai):
    entries = model_list(fake_openai.base_url)
    entries[0]["litellm_params"]["rpm_limit_for_test"] = 10
    with caplog.at_level(logging.INFO, logger="agl.compat"):
        for _ in range(2):
            agl.LLMProxy(model_list=entries, num_retries=3, callbacks=["return_token_ids"], launch_mode="thread")
    lines = [r.getMessage() for r in caplog.records]
    for needle in ("'rpm_limit_for_test'", "num_retries", "callbacks", "launch_mode"):
        assert sum(needle in line for line in lines) == 1, (needle, lines)


def test_the_examples_proxy_behind_a_store_server(fake_openai):
    """examples/minimal/llm_proxy.py: the proxy records through agl.LightningStoreServer; a client reads back."""

    async def main() -> List[Any]:
        store_server = agl.LightningStoreServer(agl.InMemoryLightningStore(), "127.0.0.1", 0)
        await store_server.start()
        llm_proxy = agl.LLMProxy(model_list=model_list(fake_openai.base_url), store=store_server)
        await llm_proxy.start()
        client = agl.LightningStoreClient(store_server.url)
        try:
            started = await client.start_rollout(input={"origin": "test_llm_proxy"})
            url = (
                f"{root_of(llm_proxy)}/rollout/{started.rollout_id}/attempt/{started.attempt.attempt_id}"
                "/v1/chat/completions"
            )
            async with httpx.AsyncClient() as http:
                answer = await http.post(url, json={"model": "my-model", "messages": QUESTION}, timeout=30)
            assert answer.status_code == 200, answer.text
            return list(await client.query_spans(rollout_id=started.rollout_id))
        finally:
            await client.close()
            await llm_proxy.stop()
            await store_server.stop()

    spans = asyncio.run(main())
    assert [s.kind for s in spans] == ["llm"] and spans[0].attributes[semconv.RESPONSE_TOKEN_IDS]
