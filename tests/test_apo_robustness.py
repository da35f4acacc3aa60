"""APO when things go wrong: malformed optimizer replies, Ctrl-C, every rollout failing, reasoning chatter
around the edited prompt, bad settings. Real runner threads, a real SQLite store, the agent's model and the
optimizer real HTTP servers on 127.0.0.1 (the optimizer's replies scripted, malformed ones by a plain
``http.server`` that answers whatever body it is given)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import openai
import pytest

import agl
from agl.algorithm.apo import APO, APOError, transcript
from agl.testing.fake_openai import FakeOpenAIServer
from agl.testing.fake_policy import FakeReply
from agl.testing.interrupts import sigint_interrupts
from agl.types import Span

TASKS = [{"task_id": f"t{i}", "question": f"What is {i} plus {i}?"} for i in range(6)]
SEED = "Answer the question: {question}"
GOOD = "Be concise. Answer the question: {question}"
STOP = "Stop now. Be concise: {question}"  # the agent sends Ctrl-C to its own process when it sees this prompt
_interrupt_sent = threading.Event()
pytestmark = pytest.mark.usefixtures("instrumented")  # agl.instrument() around each test: tests/conftest.py


@agl.rollout
def agent(task: Dict[str, Any], prompt_template: agl.PromptTemplate, llm: agl.LLM) -> float:
    """Reward 1.0 for a prompt asking for concision; one model call so that transcripts are not empty."""
    system = prompt_template.format(question=task["question"])
    if system.startswith("Stop now.") and not _interrupt_sent.is_set():
        _interrupt_sent.set()
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would: a KeyboardInterrupt in the main thread
    if system.startswith("Fail."):
        raise RuntimeError("the agent broke on this prompt")
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        client.chat.completions.create(model=llm.model, messages=[{"role": "system", "content": system}])
    return 1.0 if "concise" in system else 0.25


class BodyServer:
    """An "OpenAI-compatible" server that answers each POST with the next scripted (status, type, body),
    the last one again once the script is used up: a proxy's HTML page, ``{"choices": []}``..."""

    def __init__(self, *bodies: Tuple[int, str, str]) -> None:
        self.bodies = list(bodies)
        self.requests: List[Dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                server.requests.append(json.loads(self.rfile.read(length)))
                status, ctype, body = server.bodies.pop(0) if len(server.bodies) > 1 else server.bodies[0]
                data = body.encode()
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> BodyServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def chat(content: Any) -> Tuple[int, str, str]:
    completion = {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
    }
    return 200, "application/json", json.dumps(completion)


MALFORMED = {
    "empty_choices": (
        200,
        "application/json",
        '{"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": []}',
    ),
    "html_page": (200, "text/html", "<html><body>Please log in to the proxy</body></html>"),
    "error_object": (200, "application/json", '{"error": {"message": "quota exceeded", "type": "billing"}}'),
    "choices_null": (
        200,
        "application/json",
        '{"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": null}',
    ),
}


@pytest.fixture
def optimizer() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


def apo_trainer(tmp_path: Path, agent_url: str, algorithm: Any, prompt: str = SEED, **options: Any) -> agl.Trainer:
    """A Trainer of ``algorithm``: 3 thread runners, the store tmp_path/store.db, the agent's model at
    ``agent_url`` and the prompt template ``prompt``; ``options`` add Trainer settings."""
    return agl.Trainer(
        **options,
        algorithm=algorithm,
        store=str(tmp_path / "store.db"),
        n_runners=3,
        runner_mode="thread",
        progress=False,
        initial_resources={
            "main_llm": agl.LLM(endpoint=agent_url, model="agent-model"),
            "prompt": agl.PromptTemplate(template=prompt),
        },
    )


def transcript_span(seq: int, kind: str, **attributes: Any) -> Span:
    """Span ``seq`` of rollout "r" (a ``kind`` span, named so too) with ``attributes``, as transcript() reads it."""
    ids = dict(rollout_id="r", attempt_id="a", sequence_id=seq, trace_id="t", span_id=f"s{seq}")
    return Span(**ids, name=kind, kind=kind, start_time=seq, end_time=seq, attributes=attributes)


def _small(url: str, **settings: Any) -> APO:
    options = dict(beam_width=1, branch_factor=1, rounds=2, gradient_batch_size=1, val_batch_size=2)
    options.update(settings)
    return APO(agl.LLM(endpoint=url, model="optimizer-model"), **options)


def _published(trainer: agl.Trainer) -> str:
    return trainer.store.get_resources(trainer.resources_id).resources["prompt"].template


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_optimizer_reply_is_an_apo_error_and_keeps_the_best_so_far(tmp_path, fake_openai, kind) -> None:
    """Each raised an IndexError, AttributeError or TypeError, and the best prompt found was not published."""
    with BodyServer(chat("Ask for concision."), chat(f"<prompt>{GOOD}</prompt>"), MALFORMED[kind]) as junk:
        algorithm = _small(junk.base_url)
        trainer = apo_trainer(tmp_path, fake_openai.base_url, algorithm)
        with pytest.raises(APOError, match=r"optimizer model 'optimizer-model' at .* returned no completion") as caught:
            trainer.fit(agent, TASKS)
    assert caught.value.result is not None and [c.template for c in caught.value.result.history] == [SEED, GOOD]
    assert _published(trainer) == GOOD and algorithm.result is caught.value.result


def test_ctrl_c_publishes_the_best_so_far_and_keeps_the_result(tmp_path, fake_openai, optimizer) -> None:
    """Only an APOError published the best prompt; after Ctrl-C the trainer kept the seed."""
    _interrupt_sent.clear()
    optimizer.script(
        FakeReply(content="Ask for concision."),
        FakeReply(content=f"<prompt>{GOOD}</prompt>"),
        FakeReply(content="Say stop."),
        FakeReply(content=f"<prompt>{STOP}</prompt>"),
    )
    algorithm = _small(optimizer.base_url)
    trainer = apo_trainer(tmp_path, fake_openai.base_url, algorithm)
    with sigint_interrupts(), pytest.raises(KeyboardInterrupt):  # also where this test run ignores SIGINT
        trainer.fit(agent, TASKS)
    assert _interrupt_sent.is_set() and _published(trainer) == GOOD
    assert algorithm.result is not None and [c.template for c in algorithm.result.history] == [SEED, GOOD]


def test_a_seed_whose_every_rollout_fails_stops_before_any_optimizer_call(tmp_path, optimizer) -> None:
    """With the agent's endpoint down every prompt scored 0 and the optimizer critiqued connection errors."""
    algorithm = _small(optimizer.base_url)
    trainer = apo_trainer(tmp_path, "http://127.0.0.1:9/v1", algorithm)
    with pytest.raises(APOError, match=r"every rollout of the seed prompt failed.*first error: .*Connection") as caught:
        trainer.fit(agent, TASKS)
    assert caught.value.result is None
    assert optimizer.requests == []


def test_a_round_whose_every_rollout_fails_is_warned_about(tmp_path, fake_openai, optimizer, caplog) -> None:
    optimizer.script(FakeReply(content="Say fail."), FakeReply(content="<prompt>Fail. {question}</prompt>"))
    with caplog.at_level(logging.WARNING, logger="agl.apo"):
        result = apo_trainer(tmp_path, fake_openai.base_url, _small(optimizer.base_url, rounds=1)).fit(agent, TASKS)
    assert [c.score for c in result.history] == [0.25, 0.0]
    warned = [r.getMessage() for r in caplog.records if r.name == "agl.apo" and r.levelno == logging.WARNING]
    assert any("every rollout scoring a prompt failed" in m and "the agent broke on this prompt" in m for m in warned)


def test_reasoning_and_quoted_prompts_do_not_become_the_prompt(tmp_path, fake_openai, optimizer) -> None:
    """The first <prompt> tag was taken: a reasoning model's thinking ("between <prompt> tags") or a quote of
    the current prompt became the edit, and the reasoning garbage could win."""
    thinking = (
        "<think>The user wants the new prompt between <prompt> tags. I should keep {question}.</think>\n"
        f"<prompt>{GOOD}</prompt>"
    )
    quoting = (
        f"The current prompt was: <prompt>{SEED}</prompt> Improved: <prompt>Think, then answer: {{question}}</prompt>"
    )
    optimizer.script(
        FakeReply(content="Ask for concision."),
        FakeReply(content=thinking),
        FakeReply(content=quoting),
        FakeReply(content="<think>I will write <prompt>Be concise: {question}</prompt> but"),
    )
    algorithm = _small(optimizer.base_url, rounds=1, branch_factor=3)
    result = apo_trainer(tmp_path, fake_openai.base_url, algorithm).fit(agent, TASKS)
    assert [c.template for c in result.history] == [SEED, GOOD, "Think, then answer: {question}"]
    assert result.refused == 1  # the reply cut off in its reasoning holds no answer


def test_a_seed_with_trailing_whitespace_is_not_scored_again(tmp_path, fake_openai, optimizer) -> None:
    optimizer.script(FakeReply(content="Fine."), FakeReply(content=f"<prompt>{SEED}</prompt>"))
    algorithm = _small(optimizer.base_url, rounds=1)
    trainer = apo_trainer(tmp_path, fake_openai.base_url, algorithm, prompt=SEED + "\n")
    result = trainer.fit(agent, TASKS)
    assert [c.template for c in result.history] == [SEED + "\n"]
    assert len(trainer.store.query_rollouts(mode="val")) == 2


def test_an_empty_critique_asks_for_no_edits(tmp_path, fake_openai, optimizer, caplog) -> None:
    optimizer.script(FakeReply(content=""), FakeReply(content=f"<prompt>{GOOD}</prompt>"))
    with caplog.at_level(logging.WARNING, logger="agl.apo"):
        result = apo_trainer(tmp_path, fake_openai.base_url, _small(optimizer.base_url, rounds=1)).fit(agent, TASKS)
    assert [c.template for c in result.history] == [SEED] and result.refused == 1
    assert len([r for r in optimizer.requests if r["path"].endswith("/chat/completions")]) == 1
    assert any("critique is empty" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rounds": 2.0}, "rounds must be a whole number, got 2.0"),
        ({"rounds": float("inf")}, "rounds must be a whole number"),
        ({"rounds": "3"}, "rounds must be a whole number, got '3'"),
        ({"beam_width": 1.5}, "beam_width must be a whole number"),
        ({"branch_factor": True}, "branch_factor must be a whole number"),
        ({"gradient_batch_size": 2.5}, "gradient_batch_size must be a whole number"),
        ({"val_batch_size": 0}, "val_batch_size must be at least 1"),
        ({"max_transcripts": 1.0}, "max_transcripts must be a whole number"),
        ({"request_timeout": -1}, "request_timeout must be a finite number > 0"),
        ({"request_timeout": 0}, "request_timeout must be a finite number > 0"),
        ({"diversity_temperature": -0.5}, "diversity_temperature must be a finite number >= 0"),
        ({"rounds": 2, "beam_rounds": 3}, "rounds=2 and beam_rounds=3 disagree"),
    ],
)
def test_bad_settings_are_refused_when_apo_is_built(settings, message) -> None:
    """Each passed and crashed mid-run (after rollouts and optimizer calls) with a TypeError or ValueError;
    rounds=2 (the default's value) with beam_rounds=3 silently ran 3 rounds."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        APO({"endpoint": "http://x/v1", "model": "m"}, **settings)


def test_rounds_and_beam_rounds_alone_or_agreeing() -> None:
    llm = {"endpoint": "http://x/v1", "model": "m"}
    assert [
        APO(llm).rounds,
        APO(llm, rounds=3).rounds,
        APO(llm, beam_rounds=4).rounds,
        APO(llm, rounds=5, beam_rounds=5).rounds,
    ] == [2, 3, 4, 5]


def test_apo_takes_a_task_type_as_agent_lightning_writes_it() -> None:
    """Agent Lightning's example, ``APO[RoomSelectionTask](client, ...)``: TypeError: 'APO' is not subscriptable."""
    algorithm = agl.APO[Dict[str, Any]](
        openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k"), beam_rounds=1
    )
    assert isinstance(algorithm, APO) and algorithm.rounds == 1


def test_transcript_shows_a_call_that_starts_a_new_conversation() -> None:
    """A pipeline: a planner's call, then a writer's call in a fresh conversation whose system message is the
    prompt being optimized. Only the writer's reply was shown, not its input."""
    from agl import semconv

    def llm(seq: int, inputs: List[Dict[str, str]], output: str) -> Span:
        outputs = [{"role": "assistant", "content": output}]
        return transcript_span(seq, "llm", **{semconv.INPUT_MESSAGES: inputs, semconv.OUTPUT_MESSAGES: outputs})

    planner = [
        {"role": "system", "content": "Plan."},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "earlier"},
        {"role": "user", "content": "again"},
    ]
    writer = [{"role": "system", "content": "Write concisely: Q"}, {"role": "user", "content": "the plan"}]
    text = transcript(
        [
            llm(0, planner, "a plan"),
            llm(1, writer, "the answer"),
            llm(
                2,
                writer + [{"role": "assistant", "content": "the answer"}, {"role": "user", "content": "shorter"}],
                "short",
            ),
        ]
    )
    assert text.splitlines() == [
        "[system] Plan.",
        "[user] Q",
        "[assistant] earlier",
        "[user] again",
        "[assistant] a plan",
        "[new conversation]",
        "[system] Write concisely: Q",
        "[user] the plan",
        "[assistant] the answer",
        "[user] shorter",
        "[assistant] short",
    ]
