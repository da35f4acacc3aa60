"""``agl train`` end to end with real parts: an agent file calling the policy through the real ``openai``
client, the tiny random Llama served by agl's policy server on 127.0.0.1, thread runners, a SQLite store
under ``--out``, TorchGRPO's checkpoints, and ``--resume`` continuing a run."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Dict, List

import pytest
from with_torch_helpers import CHAT_CALL_REWARDED_BY_LENGTH, tiny_train_args, write_train_files

import agl
from agl import semconv
from agl.cli import main
from agl.store import open_store

AGENT = (
    '''
import openai
import agl

@agl.rollout
def agent(task, llm: agl.LLM) -> float:
    """One call; the agent's name is the function's, "agent". The reward (length parity) varies."""
'''
    + CHAT_CALL_REWARDED_BY_LENGTH
)


@pytest.fixture()
def files(tmp_path: Path):
    write_train_files(tmp_path, AGENT)
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"question": f"Count to {i}."}) + "\n" for i in range(2)))
    yield tmp_path
    agl.uninstrument()  # `agl train` instruments the process, as a user's run would


def _train(files: Path, *extra: str) -> List[str]:
    val = ["--val-data", str(files / "val.jsonl")]
    settings = ["--set", "lr=0.001", "--set", 'lora={"r": 4}']
    return tiny_train_args(f"{files}/agent.py:agent", files / "train.jsonl", files / "run", *val, *settings, *extra)


def _rows(run: Path) -> List[Dict[str, str]]:
    """metrics.csv's training-step rows."""
    with open(run / "metrics.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("samples")]


def _steps(run: Path) -> List[int]:
    return [int(float(row["step"])) for row in _rows(run)]


def test_train_runs_steps_stores_rollouts_and_resumes(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = files / "run"
    assert main(_train(files, "--steps", "1")) == 0
    out = capsys.readouterr().out
    assert "4 training tasks, 2 held-out tasks" in out and "lora={'r': 4}" in out and f"the run is in {run}" in out
    assert f"agl export-model {run} --out {run / 'model'}" in out
    assert _steps(run) == [1]
    store = open_store(str(run / "store.db"))
    train = store.query_rollouts(mode="train")
    assert len(train) == 4 and all(r.status == "succeeded" for r in train)  # 2 tasks x 2 rollouts
    assert len(store.query_rollouts(mode="val")) == 4  # 2 held-out tasks, before and after
    assert any((run / "checkpoints").iterdir())
    spans = store.query_spans(train[0].rollout_id, "latest")
    assert any(s.kind == "llm" for s in spans)
    store.close()

    with pytest.raises(SystemExit, match="already holds a training run"):
        main(_train(files, "--steps", "2"))
    assert main(_train(files, "--steps", "2", "--resume")) == 0
    assert _steps(run) == [1, 2]  # step 1 came from the checkpoint, only step 2 ran
    # the hint printed at the end: the run's trained model as a Hugging Face folder
    assert main(["export-model", str(run), "--out", str(run / "model")]) == 0
    assert json.loads((run / "model" / "agl_export.json").read_text())["step"] == 2


@pytest.mark.parametrize("agent_match, samples", [("^agent$", 4), ("^nobody$", 0)])
def test_agent_match_picks_the_calls_that_become_samples(files: Path, agent_match: str, samples: int) -> None:
    assert main(_train(files, "--steps", "1", "--agent-match", agent_match)) == 0
    assert [float(row["samples"]) for row in _rows(files / "run")] == [samples]  # one llm call per rollout


def test_the_token_in_example_trains_its_turns_as_one_trajectory(tmp_path: Path) -> None:
    """examples/token_in_agent.py: two Completions API calls a rollout, the second prompt extending the first
    prompt and its sampled ids; ``--adapter aggregate=true`` merges them into one sample per rollout."""
    example = Path(__file__).resolve().parents[2] / "examples"
    run = tmp_path / "run"
    try:
        agent, data = f"{example}/token_in_agent.py:token_in_agent", example / "data" / "calc_tasks.jsonl"
        assert main(tiny_train_args(agent, data, run, "--steps", "1", "--adapter", "aggregate=true")) == 0
    finally:
        agl.uninstrument()
    assert [float(row["samples"]) for row in _rows(run)] == [4.0]  # 2 tasks x 2 rollouts, each 2 calls merged
    store = open_store(str(run / "store.db"))
    for rollout in store.query_rollouts(mode="train"):
        first, second = [s.attributes for s in store.query_spans(rollout.rollout_id, "latest") if s.kind == "llm"]
        assert first[semconv.LLM_API] == second[semconv.LLM_API] == "completions"
        assert first[semconv.PROMPT_TOKEN_IDS] == first[semconv.LLM_PROMPT]  # the ids the agent sent
        start = first[semconv.PROMPT_TOKEN_IDS] + first[semconv.RESPONSE_TOKEN_IDS]
        assert second[semconv.PROMPT_TOKEN_IDS][: len(start)] == start
    store.close()


def test_bad_adapter_settings_are_named(files: Path) -> None:
    with pytest.raises(SystemExit, match="bad LightningRL settings: .*colour"):
        main(_train(files, "--adapter", "colour=1", "--check"))
    with pytest.raises(SystemExit, match="--adapter 'aggregate' must look like KEY=VALUE"):
        main(_train(files, "--adapter", "aggregate", "--check"))
    assert main(_train(files, "--adapter", "credit=discounted", "--adapter", "gamma=0.9", "--check")) == 0


def test_unknown_grpo_setting_is_named(files: Path) -> None:
    with pytest.raises(SystemExit, match="bad grpo settings: .*colour"):
        main(_train(files, "--set", "colour=1", "--check"))
