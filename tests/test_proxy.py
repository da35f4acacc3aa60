"""The recording LLM proxy, driven by the real ``openai`` client against the fake vLLM-style server.

Each test runs a real proxy (uvicorn on 127.0.0.1) in front of ``FakeOpenAIServer`` and writes to a real
in-memory store with a dequeued rollout, so routing, token ids, streaming and pausing are checked end to end.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from agl import semconv
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.instrumentation.proxy import ATTEMPT_HEADER, CLIENT_TRACED_HEADER, ROLLOUT_HEADER, LLMProxy
from agl.store import InMemoryLightningStore
from agl.testing import FakeOpenAIServer, FakeReply, ListSink, tracer_writes_to
from agl.tracing.context import rollout_scope
from agl.types import ProxyLLM, Rollout

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture
def store() -> Iterator[InMemoryLightningStore]:
    with InMemoryLightningStore() as s:
        yield s


@pytest.fixture
def rollout(store: InMemoryLightningStore) -> Rollout:
    store.enqueue_rollout({"question": "3 + 4"}, task_id="task-1")
    claimed = store.dequeue_rollout("runner-1")
    assert claimed is not None and claimed.attempt is not None
    return claimed


@pytest.fixture
def proxy(fake_openai: FakeOpenAIServer, store: InMemoryLightningStore) -> Iterator[LLMProxy]:
    with LLMProxy(fake_openai.base_url, store) as p:
        yield p


def client_for(proxy: LLMProxy, rollout: Rollout, **options: Any) -> openai.OpenAI:
    llm = proxy.as_resource("fake-model")
    assert rollout.attempt is not None
    base_url = llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, **options)


def llm_spans(store: InMemoryLightningStore, rollout: Rollout) -> list:
    return [s for s in store.query_spans(rollout.rollout_id) if s.kind == "llm"]


def extra(model: Any, key: str) -> Any:
    return (model.model_extra or {})[key]


# --- what is sent and what is recorded ------------------------------------------------------------------------


def test_chat_call_asks_for_token_ids_and_logprobs_and_records_them(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore, fake_openai: FakeOpenAIServer
) -> None:
    resp = client_for(proxy, rollout).chat.completions.create(model="fake-model", messages=QUESTION)

    sent = fake_openai.requests[-1]["body"]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    (span,) = llm_spans(store, rollout)
    attrs = span.attributes
    assert span.name == "chat fake-model" and span.status == "ok" and span.sequence_id == 0
    assert attrs[semconv.PROMPT_TOKEN_IDS] == extra(resp, "prompt_token_ids")
    assert attrs[semconv.RESPONSE_TOKEN_IDS] == extra(resp.choices[0], "token_ids")
    assert attrs[semconv.RESPONSE_LOGPROBS] == [t.logprob for t in resp.choices[0].logprobs.content]
    assert len(attrs[semconv.RESPONSE_LOGPROBS]) == len(attrs[semconv.RESPONSE_TOKEN_IDS])
    assert attrs[semconv.TOKEN_IDS_SOURCE] == "server"
    assert attrs[semconv.FRAMEWORK] == "agl.proxy"
    assert attrs[semconv.RESPONSE_ID] == resp.id
    assert attrs[semconv.RESPONSE_FINISH_REASONS] == ["stop"]
    assert '"What is 3 + 4?"' in attrs[semconv.INPUT_MESSAGES]
    assert resp.choices[0].message.content in attrs[semconv.OUTPUT_MESSAGES]
    assert proxy.stats.recorded == 1 and proxy.stats.requests == 1


def test_streamed_chat_reaches_the_client_whole_and_is_recorded_like_a_plain_call(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore
) -> None:
    client = client_for(proxy, rollout)
    plain = client.chat.completions.create(model="fake-model", messages=QUESTION)
    chunks = list(client.chat.completions.create(model="fake-model", messages=QUESTION, stream=True))

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"  # the stream ended normally, [DONE] included
    first, streamed = llm_spans(store, rollout)
    assert streamed.attributes[semconv.LLM_STREAM] is True and streamed.sequence_id == 1
    for key in (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.RESPONSE_LOGPROBS):
        assert streamed.attributes[key] == first.attributes[key]
    streamed_ids = [i for c in chunks if c.choices for i in extra(c.choices[0], "token_ids")]
    assert streamed.attributes[semconv.RESPONSE_TOKEN_IDS] == streamed_ids


def test_streamed_tool_call_is_reassembled(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore, fake_openai: FakeOpenAIServer
) -> None:
    fake_openai.script(FakeReply(tool_calls=[{"name": "add", "arguments": {"a": 3, "b": 4}}]))
    chunks = list(
        client_for(proxy, rollout).chat.completions.create(model="fake-model", messages=QUESTION, stream=True)
    )

    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    (span,) = llm_spans(store, rollout)
    (message,) = json.loads(span.attributes[semconv.OUTPUT_MESSAGES])
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 3, "b": 4}
    assert span.attributes[semconv.RESPONSE_FINISH_REASONS] == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api_is_recorded_with_token_ids(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore, stream: bool
) -> None:
    client = client_for(proxy, rollout)
    if stream:
        with client.responses.stream(model="fake-model", input="hello") as events:
            final = events.get_final_response()
    else:
        final = client.responses.create(model="fake-model", input="hello")

    (span,) = llm_spans(store, rollout)
    assert span.name == "responses fake-model"
    assert span.attributes[semconv.LLM_API] == "responses"
    assert span.attributes[semconv.PROMPT_TOKEN_IDS] == extra(final, "prompt_token_ids")
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == extra(final, "response_token_ids")
    assert final.output_text in span.attributes[semconv.OUTPUT_MESSAGES]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_api_asks_for_ids_and_logprobs_and_is_recorded(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore, fake_openai: FakeOpenAIServer, stream: bool
) -> None:
    client = client_for(proxy, rollout)
    prompt = [60, 124, 105, 109, 95]  # a token-in agent's own template, as ids
    if stream:
        chunks = list(client.completions.create(model="fake-model", prompt=prompt, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        ids = [i for c in chunks if c.choices for i in extra(c.choices[0], "token_ids")]
        logprobs = [p for c in chunks if c.choices for p in c.choices[0].logprobs.token_logprobs]
    else:
        resp = client.completions.create(model="fake-model", prompt=prompt)
        text, ids, logprobs = (
            resp.choices[0].text,
            extra(resp.choices[0], "token_ids"),
            resp.choices[0].logprobs.token_logprobs,
        )

    sent = fake_openai.requests[-1]["body"]
    assert sent["return_token_ids"] is True and sent["logprobs"] == 0
    (span,) = llm_spans(store, rollout)
    attrs = span.attributes
    assert span.name == "text_completion fake-model" and attrs[semconv.LLM_API] == "completions"
    assert attrs[semconv.LLM_PROMPT] == prompt == attrs[semconv.PROMPT_TOKEN_IDS]
    assert attrs[semconv.RESPONSE_TOKEN_IDS] == ids and attrs[semconv.RESPONSE_LOGPROBS] == logprobs
    assert len(ids) == len(logprobs) > 0
    assert json.loads(attrs[semconv.OUTPUT_MESSAGES]) == [{"role": "assistant", "content": text}]
    assert attrs[semconv.RESPONSE_FINISH_REASONS] == ["stop"]


@pytest.fixture
def client_side_tracing() -> Iterator[None]:
    """agl's client-side OpenAI instrumentation on for the test, as in an instrumented agent."""
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument()
    yield
    instrumentor.uninstrument()


def test_proxy_span_matches_the_client_side_instrumentation_of_the_same_call(
    fake_openai: FakeOpenAIServer, store: InMemoryLightningStore, rollout: Rollout, client_side_tracing: None
) -> None:
    """One span format: the proxy and agl's client-side tracer record the same attributes for a call."""
    assert rollout.attempt is not None
    with LLMProxy(fake_openai.base_url, store) as proxy, tracer_writes_to(ListSink()) as sink:
        client = client_for(proxy, rollout)
        with rollout_scope(rollout.rollout_id, rollout.attempt.attempt_id):
            # An empty header overrides the client's mark, so that both sides record this one call.
            client.chat.completions.create(
                model="fake-model", messages=QUESTION, logprobs=True, extra_headers={CLIENT_TRACED_HEADER: ""}
            )
        (client_span,) = sink.of(rollout.rollout_id, "llm")
    (proxy_span,) = llm_spans(store, rollout)
    same = set(client_span.attributes) & set(proxy_span.attributes)
    for key in (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.RESPONSE_LOGPROBS, semconv.RESPONSE_ID):
        assert proxy_span.attributes[key] == client_span.attributes[key]
    assert set(client_span.attributes) - same <= {semconv.SPAN_KIND}  # nothing the client has is missing
    assert set(proxy_span.attributes) - set(client_span.attributes) <= {semconv.FRAMEWORK, semconv.SPAN_KIND}


# --- routing ----------------------------------------------------------------------------------------------------


def test_headers_route_plain_v1_requests_and_unrouted_ones_are_forwarded_only(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore
) -> None:
    assert rollout.attempt is not None
    headers = {ROLLOUT_HEADER: rollout.rollout_id, ATTEMPT_HEADER: rollout.attempt.attempt_id}
    routed = openai.OpenAI(base_url=proxy.base_url, api_key="x", max_retries=0, default_headers=headers)
    routed.chat.completions.create(model="fake-model", messages=QUESTION)
    unrouted = openai.OpenAI(base_url=proxy.base_url, api_key="x", max_retries=0)
    answer = unrouted.chat.completions.create(model="fake-model", messages=QUESTION)
    models = unrouted.models.list()

    assert answer.choices[0].message.content
    assert [m.id for m in models.data] == ["fake-model"]
    assert len(llm_spans(store, rollout)) == 1
    assert proxy.stats.unrouted == 1 and proxy.stats.recorded == 1


def test_runner_scope_gives_the_rollout_url_to_agent_code_that_passes_no_ids(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore
) -> None:
    llm = ProxyLLM(endpoint=proxy.base_url, model="fake-model")
    assert rollout.attempt is not None
    with rollout_scope(rollout.rollout_id, rollout.attempt.attempt_id):
        base_url = llm.get_base_url()  # what examples/calc_agent.py does
    openai.OpenAI(base_url=base_url, api_key="x").chat.completions.create(model="fake-model", messages=QUESTION)
    assert len(llm_spans(store, rollout)) == 1
    assert llm.get_base_url() == proxy.base_url  # outside a rollout: the plain endpoint


def test_client_traced_calls_are_forwarded_but_not_recorded_twice(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore
) -> None:
    client = client_for(proxy, rollout, default_headers={CLIENT_TRACED_HEADER: "1"})
    resp = client.chat.completions.create(model="fake-model", messages=QUESTION)
    assert extra(resp, "prompt_token_ids")  # the client still gets the ids to record itself
    assert llm_spans(store, rollout) == [] and proxy.stats.client_traced == 1


def test_an_instrumented_agent_behind_the_proxy_is_recorded_once_by_its_own_tracer(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore, client_side_tracing: None
) -> None:
    assert rollout.attempt is not None
    with tracer_writes_to(ListSink()) as sink, rollout_scope(rollout.rollout_id, rollout.attempt.attempt_id):
        client_for(proxy, rollout).chat.completions.create(model="fake-model", messages=QUESTION)
    assert [s.kind for s in sink.spans] == ["llm"]  # the agent's own record, with its token ids
    assert sink.spans[0].attributes[semconv.PROMPT_TOKEN_IDS]
    # and with the logprobs the proxy asked for (the agent did not): verl's rollout_log_probs
    logprobs = sink.spans[0].attributes[semconv.RESPONSE_LOGPROBS]
    assert len(logprobs) == len(sink.spans[0].attributes[semconv.RESPONSE_TOKEN_IDS]) > 0
    assert llm_spans(store, rollout) == [] and proxy.stats.client_traced == 1


def test_traceparent_nests_the_span_under_the_callers_span(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore
) -> None:
    trace_id, parent_id = "ab" * 16, "cd" * 8
    client = client_for(proxy, rollout, default_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    client.chat.completions.create(model="fake-model", messages=QUESTION)
    (span,) = llm_spans(store, rollout)
    assert (span.trace_id, span.parent_id) == (trace_id, parent_id)


def test_model_override_replaces_the_requested_name(
    fake_openai: FakeOpenAIServer, store: InMemoryLightningStore, rollout: Rollout
) -> None:
    with LLMProxy(fake_openai.base_url, store, model="/models/qwen") as proxy:
        client_for(proxy, rollout).chat.completions.create(model="whatever", messages=QUESTION)
    assert fake_openai.requests[-1]["body"]["model"] == "/models/qwen"
    assert llm_spans(store, rollout)[0].name == "chat /models/qwen"


# --- failures ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_error_reaches_the_client_and_is_recorded_as_a_failed_call(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore, fake_openai: FakeOpenAIServer, stream: bool
) -> None:
    fake_openai.script(FakeReply(status_code=429, error_message="slow down"))
    with pytest.raises(openai.RateLimitError, match="slow down"):
        client_for(proxy, rollout).chat.completions.create(model="fake-model", messages=QUESTION, stream=stream)
    assert proxy.in_flight == 0 and proxy.stats.upstream_errors == 1
    (span,) = llm_spans(store, rollout)
    assert span.status == "error" and span.error == "slow down"
    assert span.attributes[semconv.ERROR_TYPE] == "HTTP 429"
    assert span.attributes[semconv.TOKEN_IDS_SOURCE] == "absent"


@pytest.mark.parametrize("stream", [False, True])
def test_unreachable_upstream_is_a_clear_502(store: InMemoryLightningStore, rollout: Rollout, stream: bool) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    with LLMProxy(dead, store) as proxy:
        with pytest.raises(openai.InternalServerError, match="could not reach the model server"):
            client_for(proxy, rollout).chat.completions.create(model="fake-model", messages=QUESTION, stream=stream)
        assert proxy.stats.upstream_errors == 1 and proxy.in_flight == 0
    (span,) = llm_spans(store, rollout)
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == "UpstreamUnreachable"


def test_a_span_the_store_refuses_loses_the_agent_nothing(proxy: LLMProxy, store: InMemoryLightningStore) -> None:
    url = ProxyLLM(endpoint=proxy.base_url, model="m").get_base_url("ro-unknown", "at-unknown")
    resp = openai.OpenAI(base_url=url, api_key="x").chat.completions.create(model="m", messages=QUESTION)
    assert resp.choices[0].message.content
    assert proxy.stats.store_errors == 1 and proxy.stats.recorded == 0


def test_broken_upstream_stream_is_recorded_as_an_error(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore, fake_openai: FakeOpenAIServer
) -> None:
    fake_openai.script(FakeReply(break_stream_after=3))
    with pytest.raises((openai.APIConnectionError, httpx.TransportError)):
        list(client_for(proxy, rollout).chat.completions.create(model="fake-model", messages=QUESTION, stream=True))
    deadline = time.monotonic() + 5
    while not llm_spans(store, rollout) and time.monotonic() < deadline:
        time.sleep(0.02)
    (span,) = llm_spans(store, rollout)
    assert span.status == "error" and "ended early" in (span.error or "")
    assert proxy.in_flight == 0


class _GarbageUpstream:
    """A real HTTP server on 127.0.0.1 that answers every POST 200 with a body that is not a completion (a
    misconfigured gateway's page, a stream of unreadable events): what the proxy must relay untouched."""

    def __init__(self, content_type: str, body: bytes) -> None:
        import http.server

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.send_header("content-type", outer.content_type)
                self.send_header("content-length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, *args: Any) -> None:
                pass

        self.content_type, self.body = content_type, body
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    "stream, content_type, body, error_type",
    [
        (False, "text/html", b"<html>502 from the gateway</html>", "UnreadableResponse"),
        (True, "text/event-stream", b"data: {not json\n\ndata: [DONE]\n\n", "UnreadableStream"),
    ],
    ids=["plain", "stream"],
)
def test_a_reply_the_proxy_cannot_read_reaches_the_agent_untouched_and_is_recorded_as_such(
    store: InMemoryLightningStore, rollout: Rollout, stream: bool, content_type: str, body: bytes, error_type: str
) -> None:
    upstream = _GarbageUpstream(content_type, body)
    try:
        with LLMProxy(upstream.base_url, store) as proxy:
            assert rollout.attempt is not None
            url = proxy.as_resource("m").get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
            request = {"model": "m", "messages": QUESTION, "stream": stream}
            reply = httpx.post(
                f"{url}/chat/completions", json=request, headers={"traceparent": "00-not-a-valid-header-01"}, timeout=10
            )
            assert (reply.status_code, reply.content) == (200, body)  # what the agent gets: the model server's
            deadline = time.monotonic() + 5
            while not llm_spans(store, rollout) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert proxy.in_flight == 0
    finally:
        upstream.close()
    (span,) = llm_spans(store, rollout)
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == error_type
    assert span.attributes[semconv.TOKEN_IDS_SOURCE] == "absent"
    assert span.parent_id is None  # a malformed traceparent is ignored, not half-read


def test_bad_json_body_is_a_400(proxy: LLMProxy) -> None:
    reply = httpx.post(f"{proxy.base_url}/chat/completions", content=b"not json")
    assert reply.status_code == 400 and "JSON object" in reply.json()["error"]["message"]


# --- pause for weight updates -------------------------------------------------------------------------------------


def test_pause_drains_in_flight_requests_and_holds_new_ones_until_resume(
    proxy: LLMProxy, rollout: Rollout, store: InMemoryLightningStore, fake_openai: FakeOpenAIServer
) -> None:
    client = client_for(proxy, rollout)
    fake_openai.script(FakeReply(content="slow", delay=0.5), FakeReply(content="after resume"))
    events: list = []

    def call(label: str) -> str:
        resp = client.chat.completions.create(model="fake-model", messages=QUESTION)
        events.append((label, time.monotonic()))
        return resp.choices[0].message.content or ""

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        slow = pool.submit(call, "slow")
        deadline = time.monotonic() + 5
        while proxy.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        proxy.pause()  # returns only once the slow request has been answered (the model takes 0.5 s)
        paused_at = time.monotonic()
        assert paused_at - started >= 0.45 and proxy.in_flight == 0 and proxy.paused
        assert slow.result(timeout=5) == "slow"
        held = pool.submit(call, "held")
        time.sleep(0.3)
        assert not held.done()  # waiting at the proxy, not refused
        proxy.resume()
        assert held.result(timeout=5) == "after resume"
    assert [label for label, _ in events] == ["slow", "held"]
    assert events[1][1] - paused_at >= 0.3
    assert proxy.stats.waited_on_pause == 1 and len(llm_spans(store, rollout)) == 2


def test_pause_times_out_with_the_count_of_requests_still_running(
    proxy: LLMProxy, rollout: Rollout, fake_openai: FakeOpenAIServer
) -> None:
    fake_openai.script(FakeReply(delay=1.0))
    thread = threading.Thread(
        target=lambda: client_for(proxy, rollout).chat.completions.create(model="fake-model", messages=QUESTION)
    )
    thread.start()
    deadline = time.monotonic() + 5
    while proxy.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(TimeoutError, match="1 request"):
        proxy.pause(timeout=0.1)
    assert proxy.paused
    proxy.resume()
    thread.join(5)
    assert not proxy.paused


def test_upstreams_must_be_http_urls(store: InMemoryLightningStore) -> None:
    with pytest.raises(ValueError, match="http"):
        LLMProxy("127.0.0.1:8000", store)
