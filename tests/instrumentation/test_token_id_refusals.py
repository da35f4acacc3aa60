"""A server that rejects ``return_token_ids`` (api.openai.com, an LLM judge's): the agent's call still works.

The judge is a second real fake server that answers a request carrying the flag with api.openai.com's 400.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, List

import openai
import pytest

import agl
from agl import semconv
from agl.cli.inspection import describe
from agl.instrumentation import token_id_refusals
from agl.lightningrl import LightningRL
from agl.store import SqliteLightningStore
from agl.testing import FakeOpenAIServer, FakeReply

MESSAGES = [{"role": "user", "content": "Is 5 the sum of 2 and 3? Answer yes or no."}]


@pytest.fixture(scope="module")
def _judge_server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(reject_token_ids=True) as server:
        yield server


@pytest.fixture
def judge(_judge_server: FakeOpenAIServer) -> Iterator[FakeOpenAIServer]:
    _judge_server.reset()
    token_id_refusals.forget_all()
    yield _judge_server
    token_id_refusals.forget_all()


def flags(server: FakeOpenAIServer) -> List[Any]:
    return [r["body"].get("return_token_ids") for r in server.requests]


def test_the_fake_judge_rejects_the_flag_as_api_openai_com_does(judge) -> None:
    raw = openai.OpenAI(base_url=judge.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as chat_error:
        raw.chat.completions.create(model="judge", messages=MESSAGES, extra_body={"return_token_ids": True})
    assert "Unrecognized request argument supplied: return_token_ids" in str(chat_error.value)
    with pytest.raises(openai.BadRequestError) as responses_error:
        raw.responses.create(model="judge", input="hi", extra_body={"return_token_ids": True})
    assert responses_error.value.body["param"] == "return_token_ids"
    assert raw.chat.completions.create(model="judge", messages=MESSAGES).choices[0].message.content


def test_a_judge_that_refuses_token_ids_answers_inside_a_rollout(
    client, fake_openai, judge, sink, rollout, caplog
) -> None:
    judge_client = openai.OpenAI(base_url=judge.base_url, api_key="x", max_retries=0)
    judge.script(FakeReply(content="yes"), FakeReply(content="no"))
    with caplog.at_level(logging.WARNING, logger="agl.instrumentation"), rollout() as scope:
        client.chat.completions.create(model="fake-model", messages=MESSAGES)  # the policy
        first = judge_client.chat.completions.create(model="judge", messages=MESSAGES)
        second = judge_client.chat.completions.create(model="judge", messages=MESSAGES)
    assert (first.choices[0].message.content, second.choices[0].message.content) == ("yes", "no")
    # the first call was refused and sent again as written; the server is not asked again
    assert flags(judge) == [True, None, None]
    assert flags(fake_openai) == [True]  # the policy's server is still asked
    refusals = [r for r in caplog.records if "refused return_token_ids" in r.getMessage()]
    assert len(refusals) == 1 and judge.base_url in refusals[0].getMessage()
    policy, judged, judged_again = sink.of(scope.rollout_id)
    assert policy.attributes[semconv.TOKEN_IDS_SOURCE] == "server"
    for span in (judged, judged_again):
        assert span.status != "error" and span.attributes[semconv.TOKEN_IDS_SOURCE] == "refused"
        assert span.attributes[semconv.REQUEST_MODEL] == "judge"
    assert '"yes"' in judged.attributes[semconv.OUTPUT_MESSAGES]
    assert "tokens=refused" in describe(judged) and "tokens=refused" not in describe(policy)


def test_streams_and_the_responses_api_are_sent_again_too(client, judge, sink, rollout) -> None:
    judge_client = openai.OpenAI(base_url=judge.base_url, api_key="x", max_retries=0)
    judge.script(FakeReply(content="streamed"))
    with rollout() as scope:
        chunks = judge_client.chat.completions.create(model="judge", messages=MESSAGES, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "streamed" and flags(judge) == [True, None]
    token_id_refusals.forget_all()
    judge.reset()
    judge.script(FakeReply(content="via responses"))
    with rollout():
        answer = judge_client.responses.create(model="judge", input="Is 5 the sum of 2 and 3?")
    assert answer.output_text == "via responses" and flags(judge) == [True, None]
    token_id_refusals.forget_all()
    judge.reset()
    judge.script(FakeReply(content=" yes"))
    with rollout():
        text_answer = judge_client.completions.create(model="judge", prompt="Is 5 the sum of 2 and 3?")
    assert text_answer.choices[0].text == " yes" and flags(judge) == [True, None]
    spans = sink.of(scope.rollout_id)
    assert [s.attributes[semconv.TOKEN_IDS_SOURCE] for s in spans] == ["refused"]


async def test_async_calls_are_sent_again(aclient, judge, sink, rollout) -> None:
    async with openai.AsyncOpenAI(base_url=judge.base_url, api_key="x", max_retries=0) as judge_client:
        judge.script(FakeReply(content="async yes"), FakeReply(content="async stream"))
        with rollout() as scope:
            reply = await judge_client.chat.completions.create(model="judge", messages=MESSAGES)
            token_id_refusals.forget_all()  # the streamed call is refused afresh
            stream = await judge_client.chat.completions.create(model="judge", messages=MESSAGES, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert (reply.choices[0].message.content, text) == ("async yes", "async stream")
    assert flags(judge) == [True, None, True, None]
    assert [s.attributes[semconv.TOKEN_IDS_SOURCE] for s in sink.of(scope.rollout_id)] == ["refused", "refused"]


def test_other_errors_and_the_users_own_flag_are_not_sent_again(client, fake_openai, judge, sink, rollout) -> None:
    judge_client = openai.OpenAI(base_url=judge.base_url, api_key="x", max_retries=0)
    fake_openai.script(FakeReply(status_code=400, error_message="messages must not be empty"))
    with rollout() as scope:
        with pytest.raises(openai.BadRequestError, match="messages must not be empty"):
            client.chat.completions.create(model="fake-model", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError, match="return_token_ids"):  # the user asked: their error
            judge_client.chat.completions.create(
                model="judge", messages=MESSAGES, extra_body={"return_token_ids": True}
            )
    # one request each: a 400 about something else is the agent's own error, and so is the user's own flag
    assert flags(fake_openai) == [True] and flags(judge) == [True]
    assert not token_id_refusals.refuses(judge_client.chat.completions) and not token_id_refusals.refuses(
        client.chat.completions
    )
    assert [s.status for s in sink.of(scope.rollout_id)] == ["error", "error"]


def test_lightningrl_leaves_the_judges_calls_out(tmp_path, judge, instrumented, fake_trainer) -> None:
    """The episode reward comes from an LLM judge on a server without token ids: the policy's call trains,
    the judge's is skipped and counted, and no MissingTokenIdsError stops the batch."""
    judge_url = judge.base_url

    @agl.rollout
    def judged_agent(task: dict, llm: agl.LLM) -> float:
        with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as policy:
            answer = policy.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
        with openai.OpenAI(base_url=judge_url, api_key="x", max_retries=0) as grader:
            verdict = grader.chat.completions.create(
                model="judge", messages=[{"role": "user", "content": f"Grade: {answer.choices[0].message.content}"}]
            )
        return 1.0 if verdict.choices[0].message.content == "good" else 0.0

    judge.script(FakeReply(content="good"), FakeReply(content="bad"))
    store = SqliteLightningStore(tmp_path / "judge.db")
    trainer = fake_trainer(store, n_runners=1)
    with trainer.runners(judged_agent):
        rollouts = trainer.run_tasks([{"q": "What is 2 plus 3?"}], n_per_task=2)
    assert sorted(r.final_reward for r in rollouts) == [0.0, 1.0] and all(r.status == "succeeded" for r in rollouts)
    batch = LightningRL.from_config(None).build_batch(store, rollouts, progress=False)
    report = batch.report
    assert (report.llm_spans, report.transitions, report.skipped) == (4, 2, {"server refuses token ids": 2})
    assert report.accounted
    assert {t.span_id for t in batch.transitions} == {
        s.span_id
        for r in rollouts
        for s in store.query_spans(r.rollout_id)
        if s.attributes.get(semconv.REQUEST_MODEL) == "m"
    }
