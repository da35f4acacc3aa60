"""Code written for Agent Lightning (the seeds' snippets) runs with `import agl` in its place."""

from __future__ import annotations

import pytest
from openai import OpenAI

import agl


class LitQAAgent(agl.LitAgent[dict]):
    """Shaped like the seeds' LitSQLAgent: resources["main_llm"], get_base_url(rollout, attempt)."""

    def __init__(self, max_turns: int):
        super().__init__()
        self.max_turns = max_turns

    def rollout(self, task: dict, resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        llm: agl.LLM = resources["main_llm"]
        client = OpenAI(base_url=llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id), api_key="x")
        reply = client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["question"]}], **llm.sampling_parameters
        )
        return 1.0 if task["question"] in reply.choices[0].message.content else 0.0


def seed_trainer(endpoint: str, tmp_path, **options) -> agl.Trainer:
    """A Trainer as the seeds build one: gpt-4.1-nano at temperature 0.7 on ``endpoint``, process runners."""
    llm = agl.LLM(endpoint=endpoint, model="gpt-4.1-nano", sampling_parameters={"temperature": 0.7})
    return agl.Trainer(store=str(tmp_path / "s.db"), initial_resources={"main_llm": llm}, progress=False, **options)


def test_seed_style_dev_run(tmp_path, fake_openai, instrumented):
    trainer = seed_trainer(fake_openai.base_url, tmp_path, n_runners=1)
    rows = trainer.dev(LitQAAgent(max_turns=3), dev_dataset=[{"question": "q1"}, {"question": "q2"}], print_table=False)
    assert [r.reward for r in rows] == [1.0, 1.0]
    assert all(r["body"]["temperature"] == 0.7 for r in fake_openai.requests)
    # stored apart from training data, as `agl dev` stores its runs
    assert [r.mode for r in trainer.store.query_rollouts()] == ["dev", "dev"]


def test_seed_style_fit_with_the_deprecated_n_workers(tmp_path, fake_openai, instrumented):
    with pytest.warns(DeprecationWarning, match="n_runners"):
        trainer = agl.Trainer(
            n_workers=2,
            store=str(tmp_path / "s.db"),
            adapter={"agent_match": "write|rewrite"},
            initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="m")},
            progress=False,
        )
    assert trainer.n_runners == 2 and trainer.adapter == {"agent_match": "write|rewrite"}
    result = trainer.fit(LitQAAgent(max_turns=1), train_dataset=[{"question": "a"}], val_dataset=[{"question": "b"}])
    assert [r.mode for r in result["train"]] == ["train"] and [r.mode for r in result["val"]] == ["val"]
    assert all(r.status == "succeeded" for r in result["train"] + result["val"])


@pytest.mark.parametrize("runner_mode", ["process", "thread"])
def test_agent_lightning_code_needs_no_instrument_line(tmp_path, fake_trainer, runner_mode):
    """Agent Lightning's Trainer sets up tracing itself, so its users' code never calls agl.instrument():
    the Trainer instruments for the run (and only for it) when nothing else did."""
    agl.uninstrument()
    assert agl.instrumentation.instrumented() is None
    store = agl.SqliteLightningStore(tmp_path / "s.db")
    trainer = fake_trainer(store, n_runners=2, runner_mode=runner_mode)
    rows = trainer.dev(LitQAAgent(max_turns=1), dev_dataset=[{"question": "q1"}, {"question": "q2"}], print_table=False)
    assert [(r.status, r.llm_calls) for r in rows] == [("succeeded", 1), ("succeeded", 1)]
    for row in rows:
        (llm,) = [s for s in store.query_spans(row.rollout_id) if s.kind == "llm"]
        assert llm.attributes[agl.semconv.TOKEN_IDS_SOURCE] == "server"  # asked for, as in training
    assert agl.instrumentation.instrumented() is None  # the hooks were the run's only


def test_an_instrumentor_of_ones_own_is_not_doubled(tmp_path, fake_openai, fake_trainer):
    from agl.instrumentation.openai_client import OpenAIInstrumentor

    agl.uninstrument()
    mine = OpenAIInstrumentor()
    assert mine.instrument()
    try:
        store = agl.SqliteLightningStore(tmp_path / "s.db")
        trainer = fake_trainer(store)
        (row,) = trainer.dev(LitQAAgent(max_turns=1), dev_dataset=[{"question": "q1"}], print_table=False)
        assert row.llm_calls == 1 and len(fake_openai.requests) == 1
        assert mine.is_instrumented and agl.instrumentation.instrumented() is None
    finally:
        mine.uninstrument()


def test_the_seeds_dry_run_against_a_hosted_api(tmp_path, instrumented):
    """The seeds' dry run: trainer.dev with main_llm on api.openai.com (gpt-4.1-nano). Inside a rollout agl
    asks every call for token ids, which that API refuses with a 400: every rollout failed before."""
    from agl.instrumentation import token_id_refusals
    from agl.testing import FakeOpenAIServer

    token_id_refusals.forget_all()
    try:
        with FakeOpenAIServer(reject_token_ids=True) as hosted:  # answers as api.openai.com does
            with pytest.warns(DeprecationWarning, match="n_runners"):
                trainer = seed_trainer(hosted.base_url, tmp_path, n_workers=1)
            rows = trainer.dev(LitQAAgent(max_turns=3), dev_dataset=[{"question": "q1"}, {"question": "q2"}])
        assert [(r.status, r.reward, r.llm_calls) for r in rows] == [("succeeded", 1.0, 1), ("succeeded", 1.0, 1)]
        for row in rows:
            (llm,) = [s for s in trainer.store.query_spans(row.rollout_id) if s.kind == "llm"]
            assert llm.attributes[agl.semconv.TOKEN_IDS_SOURCE] == "refused"
    finally:
        token_id_refusals.forget_all()


def my_sql_agent(task_input):
    """The seeds' (003) plain function: emits its reward, returns the agent's result, no @agl.rollout."""
    result = {"output": "SELECT 1", "output_is_correct": task_input["question"] == "q1"}
    agl.emit_reward(1.0 if result["output_is_correct"] else 0.0)
    return result


def test_a_plain_function_is_an_agent_as_on_the_command_line(tmp_path):
    trainer = agl.Trainer(store=str(tmp_path / "s.db"), n_runners=2, progress=False)  # process runners
    rows = trainer.dev(my_sql_agent, [{"question": "q1"}, {"question": "q2"}], print_table=False)
    assert [(r.status, r.reward) for r in rows] == [("succeeded", 1.0), ("succeeded", 0.0)]
    result = trainer.fit(my_sql_agent, [{"question": "q1"}])
    assert [(r.status, r.final_reward) for r in result["train"]] == [("succeeded", 1.0)]
    with pytest.raises(TypeError, match="the agent is a str, not a LitAgent or a rollout function"):
        trainer.dev("my_sql_agent", [{"question": "q1"}])


def test_proxy_llm_routes_by_rollout_and_plain_llm_does_not():
    proxy = agl.ProxyLLM(endpoint="http://host:9999/v1", model="m")
    assert proxy.get_base_url("ro-1", "at-1") == "http://host:9999/rollout/ro-1/attempt/at-1/v1"
    assert proxy.get_base_url() == "http://host:9999/v1"
    assert agl.LLM(endpoint="http://host/v1/", model="m").get_base_url("ro-1", "at-1") == "http://host/v1"


def test_decorated_function_with_llm_argument(tmp_path, fake_openai, instrumented):
    @agl.rollout
    def agent(task, llm: agl.LLM):
        client = OpenAI(base_url=llm.get_base_url(), api_key="x")
        client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task}])
        agl.emit_reward(0.5)

    trainer = agl.Trainer(
        store="memory",
        runner_mode="thread",
        initial_resources={"main_llm": {"endpoint": fake_openai.base_url, "model": "m"}},
        progress=False,
    )
    (row,) = trainer.dev(agent, ["hello"], print_table=False)
    assert row.reward == 0.5 and row.llm_calls == 1


def test_in_memory_store_refuses_process_runners():
    trainer = agl.Trainer(store="memory", progress=False)
    with pytest.raises(ValueError, match="runner_mode='thread'"):
        trainer.dev(agl.rollout(lambda task: 1), [1])


class BatchOfTrainingRollouts(agl.Algorithm):
    """Runs the training tasks and builds one LightningRL batch with the adapter the Trainer hands over."""

    def run(self, train_dataset, val_dataset):
        from agl.lightningrl import LightningRL

        rollouts = self.trainer.run_tasks(train_dataset, mode="train")
        return LightningRL.from_config(self.adapter).build_batch(self.store, rollouts, progress=False).report


@pytest.mark.parametrize(
    "adapter, trained_agents, transitions",
    [
        (None, "^LitQAAgent$", 1),  # trained_agents stands for the missing agent_match
        (None, "^writer$", 0),
        ({"credit": "broadcast"}, "^writer$", 0),  # added to settings that name no agent_match
        ({"agent_match": "LitQA"}, "^writer$", 1),  # the adapter's own agent_match wins (warned)
        ("instance", "^writer$", 0),  # a LightningRL object without agent_match gets it too
        (None, None, 1),
    ],
)
def test_trained_agents_is_the_agent_match_when_the_adapter_names_none(
    tmp_path, fake_openai, instrumented, caplog, adapter, trained_agents, transitions
):
    from agl.lightningrl import LightningRL

    agent = LitQAAgent(max_turns=1)
    agl.LitAgent.__init__(agent, trained_agents=trained_agents)
    given = LightningRL(credit="broadcast") if adapter == "instance" else adapter
    trainer = agl.Trainer(
        algorithm=BatchOfTrainingRollouts(),
        n_runners=1,
        runner_mode="thread",
        store=str(tmp_path / "s.db"),
        adapter=given,
        initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="m")},
        progress=False,
    )
    before = trainer.adapter  # a dict of settings is kept as one whose settings read as attributes too
    with caplog.at_level("WARNING", logger="agl.trainer"):
        report = trainer.fit(agent, train_dataset=[{"question": "a"}])
    assert report.llm_spans == 1 and report.transitions == transitions
    assert trainer.adapter is before and before == given  # the Trainer's own setting is left as it was
    ignored = [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]
    assert ignored == (
        ["the agent's trained_agents='^writer$' is ignored: the Trainer's adapter selects agent_match='LitQA'"]
        if adapter == {"agent_match": "LitQA"}
        else []
    )
