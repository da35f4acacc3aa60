"""``agl train``'s checks that run before any trainer exists: each bad input stops the command with a message
that says what is wrong, and nothing on disk is touched. Training itself: tests/with_torch/test_train_cli.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List

import pytest
from test_apo_cli import apo_flags, apo_train_args, run_cli, small_search

from agl.cli import main

AGENT = """
import agl

@agl.rollout
def agent(task, llm: agl.LLM) -> float:
    return 1.0
"""


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"q": i}) + "\n" for i in range(3)))
    return tmp_path


def _fails(args: List[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["train", *args])
    assert isinstance(exc.value.code, str), exc.value.code  # a message, not a bare status
    return exc.value.code


def _base(files: Path) -> List[str]:
    return [f"{files}/agent.py:agent", "--data", str(files / "train.jsonl"), "--out", str(files / "run")]


def test_unreadable_data_says_which_file_and_why(files: Path) -> None:
    message = _fails([f"{files}/agent.py:agent", "--data", str(files / "missing.jsonl")])
    assert "cannot read tasks from" in message and "missing.jsonl" in message
    (files / "bad.jsonl").write_text('{"q": 1}\n{not json\n')
    message = _fails([f"{files}/agent.py:agent", "--data", str(files / "bad.jsonl")])
    assert "bad.jsonl:2" in message
    (files / "empty.jsonl").write_text("\n")
    assert "holds no tasks" in _fails([f"{files}/agent.py:agent", "--data", str(files / "empty.jsonl")])


def test_an_out_folder_holding_a_run_is_neither_overwritten_nor_silently_resumed(files: Path) -> None:
    run = files / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.csv").write_text("step\n1\n")
    message = _fails(_base(files))
    assert "already holds a training run" in message and "--resume" in message
    assert (run / "metrics.csv").read_text() == "step\n1\n" and (run / "checkpoints").is_dir()


def test_duplicate_task_ids_are_found_by_check_and_end_the_run_with_a_message(files: Path) -> None:
    """Two different tasks with one id passed --check, then ended the real run in a traceback (and left its
    store behind, so the folder refused the next try)."""
    (files / "dup.jsonl").write_text('{"id": "a", "q": 1}\n{"id": "a", "q": 2}\n')
    args = [f"{files}/agent.py:agent", "--data", str(files / "dup.jsonl"), "--out", str(files / "run")]
    for extra in (["--check"], []):
        message = _fails([*args, *extra, "--algorithm", "verl"])  # (any algorithm: the tasks are checked first)
        assert "dup.jsonl" in message and "same id 'a'" in message
    assert not (files / "run").exists()


def test_a_start_that_failed_before_its_first_step_does_not_lock_the_folder(files: Path) -> None:
    """A wrong model name (or any failure before the first rollout) left run/store.db, empty: the next try
    with the right name was refused as "already holds a training run"."""
    from agl.store import SqliteLightningStore

    (files / "run").mkdir()
    SqliteLightningStore(files / "run" / "store.db").close()  # what the failed start left
    message = _fails([*_base(files), "--algorithm", "verl", "--steps", "1"])  # fails later, on a TorchGRPO flag
    assert "already holds" not in message and "set TorchGRPO" in message
    with SqliteLightningStore(files / "run" / "store.db") as store:
        store.enqueue_rollout({"q": 1})  # a run that got as far as its first rollouts is one
    assert "already holds a training run" in _fails(_base(files))


def test_resume_needs_a_run_to_continue(files: Path) -> None:
    message = _fails([*_base(files), "--resume"])
    assert "holds no run to continue" in message
    assert not (files / "run").exists()


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--config", "[1, 2]"], "--config must be a JSON object"),
        (["--config", "@nowhere.json"], "cannot read --config"),
        (["--set", "lr"], "must look like KEY=VALUE"),
    ],
)
def test_malformed_settings_are_named(files: Path, extra: List[str], expected: str) -> None:
    assert expected in _fails([*_base(files), *extra])


def test_grpo_without_torch_says_which_extra_to_install(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "agl.algorithm.torch_grpo", None)  # importing it now raises ImportError
    message = _fails(_base(files))
    assert 'pip install "agl[torch]"' in message


def test_grpo_flags_with_verl_point_to_verl_keys(files: Path) -> None:
    message = _fails([*_base(files), "--algorithm", "verl", "--steps", "3", "--group-size", "4"])
    assert "--steps, --group-size set TorchGRPO" in message
    # each flag's own verl key, with its value (it gave the same two generic examples whatever was set)
    assert "--set trainer.total_training_steps=3; --set actor_rollout_ref.rollout.n=4" in message


def test_a_bad_agent_match_regex_is_named_before_anything_runs(files: Path) -> None:
    message = _fails([*_base(files), "--agent-match", "^(solve|answer$"])
    assert "--agent-match '^(solve|answer$' is not a regular expression" in message


APO_AGENT = """
import agl

@agl.rollout
def agent(task, prompt_template: agl.PromptTemplate, llm: agl.LLM) -> float:
    return 1.0 if "concise" in prompt_template.format(q=task["q"]) else 0.5
"""


def test_apo_needs_its_prompt_and_models_and_refuses_grpo_flags(files: Path) -> None:
    message = _fails([*_base(files), "--algorithm", "apo", "--prompt", "Answer {q}"])
    assert "--algorithm apo needs --llm-endpoint, --llm-model, --optimizer-endpoint, --optimizer-model" in message
    message = _fails([*_base(files), "--algorithm", "apo", "--steps", "3"])
    assert "--steps set TorchGRPO" in message and "--set beam_width=N" in message
    message = _fails([*_base(files), *apo_flags("@" + str(files / "nope.txt"), "http://x/v1", "http://x/v1", "m", "o")])
    assert "cannot read --prompt" in message and "nope.txt" in message
    message = _fails(
        [*_base(files), *apo_flags("Answer {q}", "http://x/v1", "http://x/v1", "m", "o"), "--set", "beam_width=0"]
    )
    assert "bad apo settings: beam_width must be at least 1" in message
    assert not (files / "run").exists()


def test_apo_from_the_command_line_saves_the_best_prompt(files: Path, fake_openai) -> None:
    import agl
    from agl.testing.fake_openai import FakeOpenAIServer
    from agl.testing.fake_policy import FakeReply

    (files / "apo_agent.py").write_text(APO_AGENT)
    (files / "prompt.txt").write_text("Answer {q}")
    with FakeOpenAIServer() as optimizer:
        optimizer.script(FakeReply(content="Ask for brevity."), FakeReply(content="<prompt>Be concise: {q}</prompt>"))
        apo = apo_flags("@" + str(files / "prompt.txt"), fake_openai.base_url, optimizer.base_url)
        search = small_search(rounds=1, gradient_batch_size=2)
        code = run_cli(apo_train_args(files, *apo, *search, "--span-retention-steps", "0"))
    assert code == 0
    assert (files / "run" / "best_prompt.txt").read_text() == "Be concise: {q}"
    history = json.loads((files / "run" / "apo_history.json").read_text())
    assert [(h["template"], h["score"], h["critique"]) for h in history] == [
        ("Answer {q}", 0.5, None),
        ("Be concise: {q}", 1.0, "Ask for brevity."),
    ]
    store = agl.open_store(str(files / "run" / "store.db"))
    critiqued = store.query_rollouts(mode="train")  # --span-retention-steps 0: spans deleted once critiqued
    assert len(critiqued) == 2 and all(store.query_spans(r.rollout_id) == [] for r in critiqued)
    assert all(store.query_spans(r.rollout_id) for r in store.query_rollouts(mode="val"))


def test_apo_whose_optimizer_fails_mid_search_still_saves_the_best_prompt_so_far(
    files: Path, fake_openai, capsys: pytest.CaptureFixture[str]
) -> None:
    """The search so far was lost: no best_prompt.txt, and the --out folder refused a rerun."""
    from agl.testing.fake_openai import FakeOpenAIServer
    from agl.testing.fake_policy import FakeReply

    (files / "apo_agent.py").write_text(APO_AGENT)
    failure = FakeReply(status_code=500, error_message="overloaded")
    with FakeOpenAIServer() as optimizer:
        optimizer.script(
            FakeReply(content="Ask for brevity."),
            FakeReply(content="<prompt>Be concise: {q}</prompt>"),
            failure,
            failure,
            failure,
        )  # round 2's critique, and the client's two retries
        apo = apo_flags("Answer {q}", fake_openai.base_url, optimizer.base_url)
        code = run_cli(apo_train_args(files, *apo, *small_search()))
    assert code == 1
    assert (files / "run" / "best_prompt.txt").read_text() == "Be concise: {q}"
    assert len(json.loads((files / "run" / "apo_history.json").read_text())) == 2
    err = capsys.readouterr().err
    assert "APO stopped early" in err and "optimizer-model" in err and "best prompt so far is saved" in err


@pytest.mark.parametrize(
    "setting, expected",
    [
        ("checkpoint_every=0", "checkpoint_every=0: expected a whole number >= 1"),
        ("on_step=print", "on_step='print': a Python callable: only the Python API sets it"),
        ("eval_every=two", "eval_every='two': expected a whole number >= 0"),
        ("eval_every=-1", "eval_every=-1: expected a whole number >= 0"),
        ("lr=fast", "lr='fast': expected a finite number > 0"),
        ('success_threshold="high"', "success_threshold='high': expected a finite number"),
        ('steps="3"', "steps='3': expected a whole number >= 0 or null"),
        ('lora={"r": "eight"}', "lora={'r': 'eight'}: r 'eight': expected a whole number >= 1"),
        ("lora=8", "lora=8: expected a JSON object"),
        ("micro_batch_size=true", "micro_batch_size=True: expected a whole number >= 1"),
        ("clip_eps=[1]", "clip_eps=[1]: expected a finite number > 0"),
        ("max_grad_norm=1e999", "max_grad_norm=inf: expected a finite number > 0"),
        ("kl_coef=-1e999", "kl_coef=-inf: expected a finite number >= 0"),
        (f"lr={10**400}", f"lr={10**400}: expected a finite number > 0"),  # was OverflowError
        ("old_logprobs=new", "old_logprobs='new': expected one of 'sample', 'recompute'"),
        ("colour=1", "colour=1: TorchGRPO has no setting 'colour'"),
    ],
)
def test_check_names_each_wrong_set_value_without_importing_torch(
    files: Path, monkeypatch: pytest.MonkeyPatch, setting: str, expected: str
) -> None:
    """These passed --check, then crashed the run with a traceback (checkpoint_every=0, on_step=print: after
    step 1 had trained). They are found before torch is imported: here importing the trainer would fail."""
    monkeypatch.setitem(sys.modules, "agl.algorithm.torch_grpo", None)
    message = _fails([*_base(files), "--set", setting, "--check"])
    assert message.startswith("agl: bad grpo settings: ") and expected in message
    assert 'pip install "agl[torch]"' not in message


def test_check_lists_every_wrong_setting_one_line_each(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "agl.algorithm.torch_grpo", None)
    message = _fails([*_base(files), "--set", "lr=fast", "--config", '{"eval_every": "two"}', "--steps", "-1"])
    lines = message.splitlines()
    assert all(line.startswith("agl: bad grpo settings: ") for line in lines[:3])
    names = [line[len("agl: bad grpo settings: ") :].split("=")[0] for line in lines[:3]]
    assert names == ["eval_every", "lr", "steps"]
    assert not (files / "run").exists()


@pytest.mark.parametrize("key", ["output_dir", "checkpoint_dir", "resume"])
def test_settings_of_the_run_folder_come_from_out_and_resume_only(files: Path, key: str) -> None:
    """--set output_dir=X sent metrics and train.log to X while checkpoints and store stayed in --out (and the
    command then named --out as the run); --set resume=false got past the check that --out is not overwritten."""
    message = _fails([*_base(files), "--set", f"{key}={json.dumps(str(files / 'elsewhere'))}", "--check"])
    assert message.startswith(f"agl: --set {key}: ") and "--out" in message
    assert not (files / "elsewhere").exists()


def test_serving_a_checkpoint_pointer_or_adapter_says_what_to_export(files: Path) -> None:
    """`agl serve --model RUN/checkpoints/latest` said the config file was "not a valid JSON file"; the
    adapter folder gave a tokenizer-conversion error."""
    run = files / "run"
    step = run / "checkpoints" / "step-000002"
    (step / "adapter").mkdir(parents=True)
    (step / "adapter" / "adapter_config.json").write_text("{}")
    (step / "state.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step-000002")
    cases = {
        run / "checkpoints" / "latest": (
            "pointer to a training run's newest checkpoint",
            run / "checkpoints",
            run / "model",
        ),
        step / "adapter": ("LoRA adapter of a training checkpoint", step, run / "model-step-000002"),
        step: ("an agl training run or checkpoint", step, run / "model-step-000002"),
        run / "checkpoints": ("an agl training run or checkpoint", run / "checkpoints", run / "model"),
    }
    for path, (what, source, target) in cases.items():
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--model", str(path), "--port", "0"])
        assert what in str(exc.value.code)
        assert f"agl export-model {source} --out {target}), then agl serve --model {target}" in str(exc.value.code)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--lr", "inf"], "lr=inf: expected a finite number > 0"),
        (["--temperature", "inf"], "temperature=inf: expected a finite number > 0"),
        (["--minutes", "nan"], "--minutes must be a positive, finite number of minutes, got nan"),
        (["--minutes", "inf"], "--minutes must be a positive, finite number of minutes, got inf"),
    ],
)
def test_check_refuses_infinite_and_nan_numbers(
    files: Path, monkeypatch: pytest.MonkeyPatch, flags: List[str], expected: str
) -> None:
    """--lr inf passed --check, and its run made every weight NaN after step 1 and still ended "done"; --minutes
    nan was silently no budget."""
    monkeypatch.setitem(sys.modules, "agl.algorithm.torch_grpo", None)
    assert expected in _fails([*_base(files), *flags, "--check"])


def test_ctrl_c_before_the_first_checkpoint_does_not_offer_to_continue_one(files: Path) -> None:
    """The run had written metrics.csv (before step 1) and its published resources, but no checkpoint: the line
    said "continue it from its last checkpoint"."""
    from agl.cli.train import _interrupted

    out = files / "run"
    args = argparse.Namespace(algorithm="grpo", store=None)
    assert _interrupted(args, out).endswith(f"nothing to resume in {out}: run the command again")
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "published_resources.txt").write_text("rs-1\n")
    (out / "metrics.csv").write_text("\r\n")  # what a run before step 1 left
    message = _interrupted(args, out)
    assert "last checkpoint" not in message and "interrupted before the first checkpoint" in message
    assert message.endswith("start it again from the untrained model with: the same agl train command with --resume")
    (out / "checkpoints" / "latest").write_text("step-000001")
    assert "continue it from its last checkpoint with: " in _interrupted(args, out)


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--rollout-timeout", "-1", "--rollout-timeout must be a positive, finite number of seconds, got -1.0"),
        ("--rollout-timeout", "nan", "--rollout-timeout must be a positive, finite number of seconds, got nan"),
        ("--span-retention-steps", "-1", "--span-retention-steps must be >= 0 (the training steps whose spans"),
    ],
)
def test_check_refuses_run_settings_the_run_would_trip_over(files: Path, flag: str, value: str, expected: str) -> None:
    """--check passed these; the run then failed with a traceback after making OUT/store.db
    (--span-retention-steps -1), or ran with a timeout that never fires (nan)."""
    message = _fails([*_base(files), flag, value, "--check"])
    assert message == f"agl: {expected}" or message.startswith(f"agl: {expected}")
    assert not (files / "run").exists()
