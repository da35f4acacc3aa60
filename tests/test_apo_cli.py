"""``agl train --algorithm apo`` when a run stops early or meets an earlier one: the best prompt so far is
saved, Ctrl-C ends with status 130, ``--resume`` is refused, and saved results are never replaced. The
agent's model and the optimizer are real HTTP servers on 127.0.0.1; Ctrl-C is a real SIGINT to a real
``agl`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest
from test_apo_robustness import MALFORMED, BodyServer, chat

import agl
from agl.cli import main
from agl.testing.fake_openai import FakeOpenAIServer
from agl.testing.fake_policy import FakeReply
from agl.testing.interrupts import default_sigint

AGENT = """
import os, signal
import agl

@agl.rollout
def agent(task, prompt_template: agl.PromptTemplate, llm: agl.LLM) -> float:
    text = prompt_template.format(q=task["q"])
    if text.startswith("Stop now.") and os.environ.get("AGL_TEST_MARK"):
        try:  # once: as Ctrl-C in the terminal would
            os.close(os.open(os.environ["AGL_TEST_MARK"], os.O_CREAT | os.O_EXCL))
            os.kill(os.getpid(), signal.SIGINT)
        except FileExistsError:
            pass
    return 1.0 if "concise" in text else 0.5
"""


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    (tmp_path / "apo_agent.py").write_text(AGENT)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"q": i}) + "\n" for i in range(3)))
    return tmp_path


def apo_flags(
    prompt: str,
    agent_url: str,
    optimizer_url: str,
    agent_model: str = "agent-model",
    optimizer_model: str = "optimizer-model",
) -> List[str]:
    """The flags ``--algorithm apo`` needs: the seed prompt, and the agent's and the optimizer's endpoint and model."""
    endpoints = ["--llm-endpoint", agent_url, "--optimizer-endpoint", optimizer_url]
    models = ["--llm-model", agent_model, "--optimizer-model", optimizer_model]
    return ["--algorithm", "apo", "--prompt", prompt, *endpoints, *models]


def small_search(rounds: int = 2, gradient_batch_size: int = 1) -> List[str]:
    """``--set`` flags of a small APO search (beam 1, branch 1, 3 validation tasks), and two runners."""
    settings = ["beam_width=1", "branch_factor=1", f"gradient_batch_size={gradient_batch_size}", "val_batch_size=3"]
    sets = [arg for setting in [f"rounds={rounds}", *settings] for arg in ("--set", setting)]
    return [*sets, "--n-runners", "2"]


def apo_train_args(files: Path, *flags: str) -> List[str]:
    """``agl train`` of files/apo_agent.py on files/train.jsonl, its run in files/run, with ``flags``."""
    agent = f"{files}/apo_agent.py:agent"
    return ["train", agent, "--data", str(files / "train.jsonl"), "--out", str(files / "run"), *flags]


def _args(files: Path, agent_url: str, optimizer_url: str, *extra: str) -> List[str]:
    return apo_train_args(files, *apo_flags("Answer {q}", agent_url, optimizer_url), *small_search(), *extra)


def run_cli(args: List[str]) -> Any:
    """``agl ARGS`` in this process; the instrumentation it turns on is turned off after."""
    try:
        return main(args)
    finally:
        agl.uninstrument()


def _fails(args: List[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert isinstance(exc.value.code, str), exc.value.code
    return exc.value.code


def test_a_malformed_optimizer_reply_still_saves_the_best_prompt(files, fake_openai, capsys) -> None:
    """``{"choices": []}`` in round 2: a traceback, exit 1, and neither best_prompt.txt nor apo_history.json."""
    with BodyServer(
        chat("Ask for brevity."), chat("<prompt>Be concise: {q}</prompt>"), MALFORMED["empty_choices"]
    ) as junk:
        code = run_cli(_args(files, fake_openai.base_url, junk.base_url))
    assert code == 1
    assert (files / "run" / "best_prompt.txt").read_text() == "Be concise: {q}"
    assert len(json.loads((files / "run" / "apo_history.json").read_text())) == 2
    err = capsys.readouterr().err
    assert "APO stopped early" in err and "returned no completion" in err


def test_ctrl_c_saves_the_best_prompt_so_far_and_exits_130(files, fake_openai) -> None:
    """A traceback and nothing saved; the folder then refused a fresh run."""
    with FakeOpenAIServer() as optimizer:
        optimizer.script(
            FakeReply(content="Ask for brevity."),
            FakeReply(content="<prompt>Be concise: {q}</prompt>"),
            FakeReply(content="Say stop."),
            FakeReply(content="<prompt>Stop now. Be concise: {q}</prompt>"),
        )
        agl_command = Path(sys.executable).with_name("agl")
        done = subprocess.run(
            [str(agl_command), *_args(files, fake_openai.base_url, optimizer.base_url)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "AGL_TEST_MARK": str(files / "interrupted")},
            preexec_fn=default_sigint,  # its Ctrl-C interrupts even where this test run ignores SIGINT
        )
    assert (files / "interrupted").exists(), done.stderr
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert "agl train: interrupted; the best prompt so far is saved" in done.stderr
    assert (files / "run" / "best_prompt.txt").read_text() == "Be concise: {q}"
    assert [h["template"] for h in json.loads((files / "run" / "apo_history.json").read_text())] == [
        "Answer {q}",
        "Be concise: {q}",
    ]


def test_resume_is_refused_and_saved_results_are_never_replaced(files, fake_openai) -> None:
    """--resume searched again from --prompt and overwrote best_prompt.txt (1.0) with the seed (0.5)."""
    optimizer_down = "http://127.0.0.1:9/v1"
    run = files / "run"
    run.mkdir()
    (run / "best_prompt.txt").write_text("Be concise: {q}")
    (run / "apo_history.json").write_text("[]")
    message = _fails(_args(files, fake_openai.base_url, optimizer_down, "--resume"))
    assert "APO run keeps no checkpoints and cannot be continued" in message
    assert f"--prompt @{run / 'best_prompt.txt'}" in message
    message = _fails(_args(files, fake_openai.base_url, optimizer_down, "--store", str(files / "elsewhere.db")))
    assert "already holds the results of an APO run" in message
    assert (run / "best_prompt.txt").read_text() == "Be concise: {q}" and (run / "apo_history.json").read_text() == "[]"


def test_check_finds_a_setting_that_is_no_whole_number(files) -> None:
    message = _fails(_args(files, "http://x/v1", "http://x/v1", "--set", "rounds=2.0", "--check"))
    assert "bad apo settings: rounds must be a whole number, got 2.0" in message


def test_a_seed_whose_every_rollout_fails_is_no_success(files, capsys) -> None:
    """The agent's prompt names a field the tasks lack: every rollout failed, yet the run said "done", exit 0."""
    with FakeOpenAIServer() as optimizer:
        args = _args(files, "http://127.0.0.1:9/v1", optimizer.base_url)
        args[args.index("--prompt") + 1] = "Answer {question}"
        code = run_cli(args)
        assert optimizer.requests == []
    captured = capsys.readouterr()
    assert code != 0 and "done" not in captured.out
    assert "every rollout of the seed prompt failed" in captured.err and "KeyError" in captured.err
    assert not (files / "run" / "best_prompt.txt").exists()


def test_the_optimizer_key_goes_only_to_the_optimizer_and_is_not_stored(files, fake_openai, monkeypatch) -> None:
    """One key went to both endpoints and was stored in plain text with every resources version."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-agent-key")
    monkeypatch.setenv("OPTIMIZER_KEY", "sk-optimizer-secret")
    with FakeOpenAIServer() as optimizer:
        optimizer.script(FakeReply(content="Ask for brevity."), FakeReply(content="<prompt>Be concise: {q}</prompt>"))
        code = run_cli(
            _args(
                files,
                fake_openai.base_url,
                optimizer.base_url,
                "--set",
                "rounds=1",
                "--optimizer-api-key-env",
                "OPTIMIZER_KEY",
            )
        )
        asked = [r for r in optimizer.requests if r["path"].endswith("/chat/completions")]
    assert code == 0 and len(asked) == 2
    assert all(r["headers"]["authorization"] == "Bearer sk-optimizer-secret" for r in asked)
    stored = b"".join(p.read_bytes() for p in (files / "run").glob("store.db*"))
    assert b"sk-optimizer-secret" not in stored
