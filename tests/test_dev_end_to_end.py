"""The issue's acceptance run: a plain-Python agent (openai client, one tool) with agl.instrument(),
run by Trainer.dev on 5 tasks with 2 runner processes against the local server, leaves in SQLite one llm
span per request with messages, tool calls and token ids (also for a streamed call), tool spans and
reward spans; `agl inspect` prints the tree."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

import agl
from agl import semconv
from agl.cli import main as agl_main
from agl.store import EnqueueRequest, SqliteLightningStore
from agl.testing import ADD_TOOL

TOOLS = [ADD_TOOL]


@agl.tool
def add(a: float, b: float) -> float:
    return a + b


@agl.rollout
def adder(task, llm):
    client = OpenAI(base_url=llm.get_base_url(), api_key="x")
    messages = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    result = add(**json.loads(call.function.arguments))
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": f"{result:g}"},
    ]
    stream = client.chat.completions.create(model=llm.model, messages=messages, stream=True)
    answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    agl.emit_reward(1.0 if str(task["answer"]) in answer else 0.0)


def test_dev_with_two_runner_processes_leaves_complete_spans_in_sqlite(
    tmp_path, fake_openai, fake_trainer, instrumented, capsys
):
    db = tmp_path / "dev.db"
    tasks = [{"id": f"t{i}", "question": f"What is {i} plus {i + 10}?", "answer": 2 * i + 10} for i in range(5)]
    trainer = fake_trainer(str(db), "fake-model", n_runners=2, runner_mode="process")
    rows = trainer.dev(adder, tasks)
    out = capsys.readouterr().out
    assert "agl dev: rollouts" in out and "No rollout recorded an LLM call" not in out

    assert [r.task_id for r in rows] == [f"t{i}" for i in range(5)]
    assert all(r.status == "succeeded" and r.reward == 1.0 for r in rows)
    chat_requests = [r for r in fake_openai.requests if r["path"].endswith("/chat/completions")]
    assert len(chat_requests) == 10
    # the trainer asked for token ids inside training rollouts
    assert all(r["body"].get("return_token_ids") is True for r in chat_requests)

    store = SqliteLightningStore(db)  # a fresh connection: what is on disk
    runners = set()
    llm_total = 0
    for row in rows:
        spans = store.query_spans(row.rollout_id)
        rollout = store.get_rollout(row.rollout_id)
        runners.add(rollout.attempt.runner_id)
        llm = [s for s in spans if s.kind == "llm"]
        llm_total += len(llm)
        assert len(llm) == 2 and row.llm_calls == 2
        plain, streamed = sorted(llm, key=lambda s: s.sequence_id)
        assert streamed.attributes[semconv.LLM_STREAM] is True
        for span in llm:
            messages = json.loads(span.attributes[semconv.INPUT_MESSAGES])
            assert messages[0]["content"] == tasks[int(row.task_id[1:])]["question"]
            prompt_ids = span.attributes[semconv.PROMPT_TOKEN_IDS]
            response_ids = span.attributes[semconv.RESPONSE_TOKEN_IDS]
            assert prompt_ids and response_ids
        assert json.loads(plain.attributes[semconv.OUTPUT_MESSAGES])[0]["tool_calls"][0]["function"]["name"] == "add"
        assert "add" in fake_openai.tokenizer.decode(plain.attributes[semconv.RESPONSE_TOKEN_IDS])
        assert "The answer is" in fake_openai.tokenizer.decode(streamed.attributes[semconv.RESPONSE_TOKEN_IDS])
        (tool,) = [s for s in spans if s.kind == "tool"]
        assert tool.attributes[semconv.TOOL_NAME] == "add"
        (reward,) = [s for s in spans if s.kind == "reward"]
        assert reward.attributes[semconv.REWARD_VALUE] == 1.0
        root = [s for s in spans if s.parent_id is None]
        assert [s.name for s in root] == ["agl.rollout"]
    assert llm_total == len(chat_requests)  # exactly one llm span per HTTP request
    assert len(runners) >= 1

    assert agl_main(["inspect", rows[0].rollout_id, "--store", str(db)]) == 0
    tree = capsys.readouterr().out
    assert "[agent] agl.rollout" in tree and "[llm] chat fake-model" in tree
    assert "[tool] execute_tool add" in tree and "reward=1" in tree and "tokens=" in tree
    store.close()


def test_dev_says_when_no_rollout_recorded_an_llm_call(tmp_path, capsys):
    """An agent that reaches its model without the openai client: the table's zeros come with what to do."""
    import urllib.request

    def http_agent(task):
        try:  # a model server reached with plain HTTP: nothing agl hooks
            urllib.request.urlopen("http://127.0.0.1:9/v1/models", timeout=0.5)
        except OSError:
            pass
        return 1.0

    trainer = agl.Trainer(store="memory", runner_mode="thread", progress=False)
    rows = trainer.dev(agl.rollout(http_agent), [{"q": 1}, {"q": 2}])
    assert [(r.status, r.llm_calls) for r in rows] == [("succeeded", 0), ("succeeded", 0)]
    out = " ".join(capsys.readouterr().out.split())
    assert "No rollout recorded an LLM call, so there is nothing to train on" in out and "/v1/traces" in out


def test_cli_store_listing(tmp_path, fake_openai, fake_trainer, instrumented, capsys):
    db = tmp_path / "dev.db"
    trainer = fake_trainer(str(db), "fake-model")
    rows = trainer.dev(adder, [{"question": "What is 1 plus 2?", "answer": 3}], print_table=False)
    assert agl_main(["store", "rollouts", "--store", str(db)]) == 0
    listing = capsys.readouterr().out
    assert rows[0].rollout_id in listing and "succeeded" in listing
    header, row = listing.splitlines()[:2]
    assert row.index("succeeded") == header.index("status"), "columns line up with 23-character rollout ids"
    more = trainer.store.enqueue_many([EnqueueRequest(input={"n": i}) for i in range(3)])
    assert agl_main(["store", "rollouts", "--limit", "2", "--store", str(db)]) == 0
    listing = capsys.readouterr().out
    assert [r.rollout_id in listing for r in more] == [False, True, True] and rows[0].rollout_id not in listing
    assert "(the latest 2 of 4; --limit 0 lists all)" in listing
    assert agl_main(["inspect", "ro-doesnotexist", "--store", str(db)]) == 2
    assert "unknown rollout id" in capsys.readouterr().err


_KEPT_STREAMS: list = []


def test_a_stream_the_agent_stops_reading_is_stored_with_its_rollout(tmp_path, fake_openai, fake_trainer, instrumented):
    """An agent that breaks out of a model stream and keeps it (frameworks hold such objects): its llm span
    ended when the stream was collected, after the attempt was reported, so a batch built at once missed
    the call, and one collected during a later rollout was refused by the store."""
    from agl.testing import FakeReply

    @agl.rollout
    def peeks(task, llm: agl.LLM):
        client = OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = iter(stream)
        next(chunks), next(chunks)  # the first words are enough for this agent
        _KEPT_STREAMS.append(stream)
        return 1.0

    fake_openai.script(FakeReply(content="a long answer the agent does not wait for"))
    trainer = fake_trainer(str(tmp_path / "s.db"), "fake-model")
    (row,) = trainer.dev(peeks, [{"n": 1}], print_table=False)
    (llm,) = [s for s in trainer.store.query_spans(row.rollout_id) if s.kind == "llm"]  # stored with the attempt
    assert llm.attributes[semconv.STREAM_ABANDONED] is True and llm.attributes[semconv.RESPONSE_TOKEN_IDS]
    _KEPT_STREAMS.clear()


def test_cli_output_piped_into_head_ends_quietly(tmp_path):
    """`agl store rollouts --limit 0 | head` printed a BrokenPipeError traceback once head had its lines."""
    import subprocess
    import sys

    db = tmp_path / "many.db"
    with SqliteLightningStore(db) as store:
        store.enqueue_many([EnqueueRequest(input={"n": i}) for i in range(3000)])  # ~200 KB: past a pipe's buffer
    cmd = [sys.executable, "-m", "agl.cli", "store", "rollouts", "--limit", "0", "--store", str(db)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"rollout")
    proc.stdout.close()  # what head does once it has its lines
    assert proc.wait(60) == 141
    assert proc.stderr.read() == b""


def test_cli_dev_names_a_missing_data_file(tmp_path):
    with pytest.raises(SystemExit, match=r"cannot read tasks from .*nothing\.jsonl: dataset file .* does not exist"):
        agl_main(["dev", "examples/calc_agent.py:calc_agent", "--data", str(tmp_path / "nothing.jsonl")])


@pytest.mark.parametrize(
    "command",
    [
        ["store", "stats"],
        ["store", "rollouts"],
        ["store", "prune", "--keep-last", "0"],
        ["inspect", "ro-1"],
        ["export", "out.jsonl"],
    ],
)
def test_reading_commands_refuse_a_store_that_does_not_exist_and_create_none(tmp_path, command):
    """A mistyped --store must not read as an empty store (and leave a new empty file behind)."""
    missing = tmp_path / "runs" / "typo.db"
    with pytest.raises(SystemExit, match=f"no store at {missing}: the file does not exist"):
        agl_main([*command, "--store", str(missing)])
    assert not missing.exists() and not missing.parent.exists()
    with pytest.raises(SystemExit, match="no store at"):
        agl_main([*command, "--store", f"sqlite:///{missing}"])


def test_cli_loads_agents_in_every_form_and_names_what_is_wrong(tmp_path, monkeypatch):
    from agl.cli.common import load_agent

    (tmp_path / "agl_cli_test_file_agents.py").write_text(
        "import agl\n"
        "class Agent(agl.LitAgent):\n"
        "    def rollout(self, task, resources, rollout):\n"
        "        return 1.0\n"
        "instance = Agent()\n"
        "def plain(task):\n"
        "    return 1.0\n"
        "NUMBER = 3\n"
        "def needs_a_database(task, database):\n"
        "    return 1.0\n"
    )
    (tmp_path / "agl_cli_test_agents.py").write_text("def agent(task):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = str(tmp_path / "agl_cli_test_file_agents.py")
    assert type(load_agent(f"{module}:Agent")).__name__ == "Agent"  # a class, built with no arguments
    assert load_agent(f"{module}:instance").__class__.__name__ == "Agent"
    assert isinstance(load_agent(f"{module}:plain"), agl.FunctionalLitAgent)
    assert isinstance(load_agent("agl_cli_test_agents:agent"), agl.FunctionalLitAgent)  # MODULE:NAME, imported
    for target, message in (
        (module, "must look like MODULE:NAME"),
        (f"{module}:missing", "has no attribute 'missing'"),
        (f"{module}:NUMBER", "is a int, not a LitAgent or a rollout function"),
        (f"{tmp_path / 'absent.py'}:agent", "does not exist"),
        (
            f"{module}:needs_a_database",
            r"needs_a_database: @agl.rollout function .* \['database'\] that agl cannot supply",
        ),
    ):
        with pytest.raises(SystemExit, match=message):
            load_agent(target)


def test_agent_match_selects_the_calls_of_the_named_agent(tmp_path, fake_trainer, instrumented):
    """Plain Python: the runner's root agent span is named after the function; nested agent spans
    (here made with the adapter kit, as framework adapters do) take over inside."""
    from agl.instrumentation.framework import agent_span
    from agl.lightningrl.agent_match import select_llm_calls

    @agl.rollout
    def pipeline(task, llm):
        client = OpenAI(base_url=llm.get_base_url(), api_key="x")
        ask = lambda text: client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": text}])  # noqa: E731 - a one-line helper
        ask("plan")
        with agent_span("write_query", "test"):
            ask("write")
        with agent_span("check_query", "test"):
            ask("check")
        with agent_span("rewrite_query", "test"):
            ask("rewrite")
        return 1.0

    store = SqliteLightningStore(tmp_path / "m.db")
    trainer = fake_trainer(store)
    (row,) = trainer.dev(pipeline, [{"q": 1}], print_table=False)
    spans = store.query_spans(row.rollout_id)

    def asked(selected):
        return [json.loads(s.attributes[semconv.INPUT_MESSAGES])[0]["content"] for s in selected]

    assert asked(select_llm_calls(spans, None)) == ["plan", "write", "check", "rewrite"]
    assert asked(select_llm_calls(spans, "write|rewrite")) == ["write", "rewrite"]
    assert asked(select_llm_calls(spans, "^check")) == ["check"]
    assert asked(select_llm_calls(spans, "^pipeline$")) == ["plan"]


PROMPT_AGENT = """
import agl

@agl.rollout
def agent(task, prompt_template: agl.PromptTemplate) -> float:
    return float(prompt_template.format(**task) == "Be concise: 2+2")
"""


def test_cli_dev_gives_the_agent_a_prompt_from_a_file(tmp_path, fake_openai, instrumented, capsys):
    (tmp_path / "agent.py").write_text(PROMPT_AGENT)
    (tmp_path / "tasks.jsonl").write_text('{"q": "2+2"}\n')
    (tmp_path / "best_prompt.txt").write_text("Be concise: {q}")
    base = [
        "dev",
        f"{tmp_path}/agent.py:agent",
        "--data",
        str(tmp_path / "tasks.jsonl"),
        "--runner-mode",
        "thread",
        "--n-runners",
        "1",
        "--endpoint",
        fake_openai.base_url,
        "--store",
        str(tmp_path / "dev.db"),
    ]
    assert agl_main([*base, "--prompt", "@" + str(tmp_path / "best_prompt.txt")]) == 0
    store = agl.SqliteLightningStore(tmp_path / "dev.db")
    (rollout,) = store.query_rollouts()
    assert rollout.final_reward == 1.0
    assert store.get_resources(rollout.resources_id).resources["prompt"].template == "Be concise: {q}"
    store.close()
    with pytest.raises(SystemExit, match=r"cannot read --prompt .*missing\.txt"):
        agl_main([*base, "--prompt", "@" + str(tmp_path / "missing.txt")])


def test_version_is_the_installed_distributions(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exit_:
        agl_main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"agl {metadata.version('agl')}" == f"agl {agl.__version__}"


def test_a_trainer_waiting_on_runners_that_do_not_exist_says_so(monkeypatch, caplog):
    """n_runners=0 (runners elsewhere) and none started: the wait went on forever without a word."""
    from agl import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "QUIET_WAIT_S", 0.3)
    trainer = agl.Trainer(n_runners=0, store="memory", progress=False)
    with trainer.runners(agl.rollout(lambda task: 1.0)):
        with pytest.raises(TimeoutError, match="2 of 2 rollouts did not finish within 1.5 s"):
            trainer.run_tasks([{"n": 1}, {"n": 2}], description="dev", timeout=1.5)
    said = [r.getMessage() for r in caplog.records if "no rollout finished" in r.getMessage()]
    assert said and said[0].startswith("dev: no rollout finished in the last 0 s; waiting for 2 (2 queued, 0 running")
    assert "n_runners=0: are runners started against this store (agl runner --store URL" in said[0]


def test_inspect_shows_an_error_as_one_line_of_the_tree():
    """A failed AutoGen team put its whole traceback (~40 lines) on the rollout, team and agent lines of the
    tree, three times over; and the marks of abandoned streams and unparsed answers were not shown."""
    from agl.cli.inspection import describe
    from agl.types import Span

    traceback_text = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\nValueError: boom'

    def span(kind, error=None, **attributes):
        return Span(
            rollout_id="ro-1",
            attempt_id="at-1",
            sequence_id=0,
            trace_id="0" * 32,
            span_id="1" * 16,
            name="s",
            kind=kind,
            start_time=0,
            end_time=1_000_000,
            status="error" if error else "ok",
            error=error,
            attributes=attributes,
        )

    assert describe(span("agent", traceback_text)).endswith("ERROR ValueError: boom (+3 lines)")
    assert describe(span("chain", "first line\nsecond")).endswith("ERROR first line (+1 lines)")
    assert describe(span("chain", "x" * 500)).endswith("ERROR " + "x" * 157 + "...")
    line = describe(
        span(
            "llm",
            **{
                semconv.LLM_STREAM: True,
                semconv.STREAM_ABANDONED: True,
                semconv.PARSE_ERROR: "ValidationError: 1 validation error\n  Invalid JSON",
            },
        )
    )
    assert "stream (abandoned)" in line and "parse error: ValidationError: 1 validation error (+1 lines)" in line
    assert "\n" not in line


def test_inspect_shows_mistyped_agl_attributes_as_they_are_and_does_not_crash(tmp_path, capsys):
    """Spans from other tools (OTLP, older servers) may hold agl.* attributes of any type: a reward as the string
    "1.0" raised ValueError ("Unknown format code 'g'") and token ids as one int TypeError (len), so the whole
    rollout could not be inspected."""
    from agl.types import Span

    db = tmp_path / "odd.db"
    store = SqliteLightningStore(db)
    store.enqueue_rollout({"q": 1})
    rollout = store.dequeue_rollout("runner")

    def span(n, kind, **attributes):
        return Span(
            rollout_id=rollout.rollout_id,
            attempt_id=rollout.attempt.attempt_id,
            sequence_id=n,
            trace_id="0" * 32,
            span_id=f"{n:016x}",
            name=f"s{n}",
            kind=kind,
            start_time=n,
            end_time=n + 1,
            attributes=attributes,
        )

    store.add_spans(
        [
            span(1, "reward", **{semconv.REWARD_VALUE: "1.0"}),
            span(2, "llm", **{semconv.PROMPT_TOKEN_IDS: 5, semconv.RESPONSE_TOKEN_IDS: {"ids": [1]}}),
            span(3, "reward", **{semconv.REWARD_VALUE: None, semconv.MESSAGE_BODY: ["a"]}),
            span(4, "llm", **{semconv.PROMPT_TOKEN_IDS: [1, 2], semconv.RESPONSE_TOKEN_IDS: [3]}),
        ]
    )
    store.close()
    assert agl_main(["inspect", rollout.rollout_id, "--store", str(db)]) == 0
    tree = capsys.readouterr().out
    assert "reward='1.0'(?str, expected a number)" in tree
    assert "tokens=5(?int, expected a list of token ids)+{'ids': [1]}(?dict, expected a list of token ids)" in tree
    assert "reward=None(?NoneType, expected a number)" in tree and "tokens=2+1" in tree
