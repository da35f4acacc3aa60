"""What a TorchGRPO run keeps of an older run in its folder, and what ``agl train`` says when it stops early:
``resume=False`` over an older run's checkpoints (Python) and ``--set resume=false`` (CLI); every ``--set`` value
checked against TorchGRPO's settings before training; Ctrl-C; warnings and the final error in ``train.log``.
Model "tiny", 1-3 steps."""

from __future__ import annotations

import csv
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest
import torch
from with_torch_helpers import CHAT_CALL_REWARDED_BY_LENGTH, tiny_train_args, write_train_files

import agl
from agl.algorithm.checkpoint import TrainerState, latest_checkpoint, save_checkpoint
from agl.cli import main
from agl.testing.interrupts import default_sigint

AGENT = (
    """
import os, signal
import openai
import agl

@agl.rollout
def agent(task, llm: agl.LLM) -> float:
    run = os.environ.get("AGL_TEST_INTERRUPT_RUN")
    if run and os.path.exists(os.path.join(run, "checkpoints", "latest")):
        try:  # Ctrl-C, once, after step 1 is checkpointed
            os.close(os.open(os.path.join(run, "interrupted"), os.O_CREAT | os.O_EXCL))
            os.kill(os.getpid(), signal.SIGINT)
        except FileExistsError:
            pass
"""
    + CHAT_CALL_REWARDED_BY_LENGTH
)


@pytest.fixture()
def files(tmp_path: Path):
    yield write_train_files(tmp_path, AGENT)
    agl.uninstrument()


def _train(files: Path, *extra: str) -> List[str]:
    return tiny_train_args(
        f"{files}/agent.py:agent", files / "train.jsonl", files / "run", "--set", 'lora={"r": 4}', *extra
    )


def _rows(run: Path) -> List[str]:
    with open(run / "metrics.csv", newline="") as f:
        return [row["step"] for row in csv.DictReader(f) if row.get("samples")]


# ---------------------------------------------------------------------------------------------------------
# resume=False over an older run
# ---------------------------------------------------------------------------------------------------------
def _save(directory: Path, step: int, fingerprint: Any) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(directory, model, optimizer, TrainerState(step=step, fingerprint=fingerprint), lora=False)


def test_a_fresh_run_over_an_older_runs_checkpoints_keeps_its_own(tmp_path: Path) -> None:
    """The older run's step-2 and step-3 were "the two newest" by name, so the new run's step-1 was deleted
    as soon as it was written, and `latest` named a folder that did not exist."""
    ckpt = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save(ckpt, step, {"run": "old"})
    _save(ckpt, 1, {"run": "new"})  # TorchGRPO(resume=False): its first checkpoint
    latest = latest_checkpoint(ckpt)
    assert latest is not None and latest.name == "step-000001"
    assert json.loads((latest / "state.json").read_text())["fingerprint"] == {"run": "new"}
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000001"]  # no old step-3 left beside it
    _save(ckpt, 2, {"run": "new"})
    _save(ckpt, 3, {"run": "new"})
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000002", "step-000003"]
    assert all(json.loads((p / "state.json").read_text())["fingerprint"] == {"run": "new"} for p in ckpt.glob("step-*"))


def test_torchgrpo_resume_false_in_a_folder_with_an_older_run_ends_with_its_own_checkpoint(tmp_path: Path) -> None:
    """The Python path end to end: a 2-step run, then a 1-step run with resume=False and another LoRA rank
    (what the CheckpointError advised); the new run's weights are exported, not a missing folder."""
    from agl.algorithm.model_export import export_model
    from agl.algorithm.torch_grpo import TorchGRPO

    @agl.rollout
    def agent(task: Any, llm: agl.LLM) -> float:
        import openai

        with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
            reply = client.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task["q"]}], **llm.sampling_parameters
            )
        return float(len(reply.choices[0].message.content or "") % 2)

    tasks = [{"id": f"t{i}", "q": f"Say {i}."} for i in range(2)]

    def run(steps: int, resume: bool, r: int) -> None:
        algorithm = TorchGRPO(
            model="tiny",
            steps=steps,
            group_size=2,
            batch_tasks=2,
            max_tokens=4,
            seed=1,
            checkpoint_dir=tmp_path / "ckpt",
            resume=resume,
            lora={"r": r},
            output_dir=tmp_path / "m",
        )
        agl.Trainer(algorithm=algorithm, store="memory", n_runners=2, runner_mode="thread").fit(agent, tasks)

    run(2, True, 4)
    run(1, False, 2)
    latest = latest_checkpoint(tmp_path / "ckpt")
    assert latest is not None and latest.name == "step-000001"
    assert json.loads((latest / "state.json").read_text())["fingerprint"]["lora"]["r"] == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-000001"]
    out = export_model(tmp_path / "ckpt", tmp_path / "export")
    assert json.loads((out / "agl_export.json").read_text())["step"] == 1


def test_the_cli_never_lets_resume_false_overwrite_a_run(files: Path) -> None:
    """`--resume --set resume=false` got past the "never overwritten" check, rewrote metrics.csv (the old rows
    lost) and left `latest` naming a deleted folder."""
    run = files / "run"
    assert main(_train(files, "--steps", "2")) == 0
    metrics = (run / "metrics.csv").read_text()
    for extra in (
        ["--resume", "--set", "resume=false"],
        ["--resume", "--config", '{"resume": false}'],
        ["--resume", "--set", "resume=true"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(_train(files, "--steps", "1", *extra))
        assert "resume: pass --resume to continue" in str(exc.value.code)
        assert "another --out" in str(exc.value.code)
    assert (run / "metrics.csv").read_text() == metrics and _rows(run) == ["1", "2"]
    assert latest_checkpoint(run / "checkpoints").name == "step-000002"


def test_the_checkpoint_error_points_to_what_works(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = files / "run"
    assert main(_train(files, "--steps", "1")) == 0
    args = _train(files, "--steps", "2", "--resume")
    args[args.index('lora={"r": 4}')] = 'lora={"r": 2}'
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "another --out" in err and "another checkpoint_dir" in err
    assert _rows(run) == ["1"]


# ---------------------------------------------------------------------------------------------------------
# --set values
# ---------------------------------------------------------------------------------------------------------
def test_the_settings_table_covers_torchgrpo_exactly() -> None:
    """--set values are checked from a table in train_cli (no torch import); it must follow TorchGRPO's
    signature: a new keyword needs its entry, a removed one must go."""
    from agl.algorithm.torch_grpo import TorchGRPO
    from agl.algorithm.torch_grpo_config import JSON_SETTINGS as _GRPO_SPEC
    from agl.algorithm.torch_grpo_config import PYTHON_ONLY as _PYTHON_ONLY
    from agl.cli.train import _OUT_OWNED

    assert set(_GRPO_SPEC) | set(_PYTHON_ONLY) | set(_OUT_OWNED) == set(inspect.signature(TorchGRPO).parameters)


def test_lora_fields_peft_does_not_know_are_found_by_check(files: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(_train(files, "--set", 'lora={"rr": 8}', "--check"))
    assert "bad grpo settings" in str(exc.value.code) and "rr" in str(exc.value.code)
    assert not (files / "run").exists()


def test_check_names_an_unknown_lora_field_beside_other_bad_settings(files: Path) -> None:
    """docs/training.md: every bad setting gets its line; peft's objection to `rr` came only once the others
    were fixed."""
    with pytest.raises(SystemExit) as exc:
        main(
            _train(
                files, "--set", "eval_every=two", "--set", "checkpoint_every=0", "--set", 'lora={"rr": 8}', "--check"
            )
        )
    lines = str(exc.value.code).splitlines()
    assert [line.split(": ", 2)[2].split("=")[0] for line in lines] == ["eval_every", "checkpoint_every", "lora"]
    assert "rr" in lines[-1] and lines[-1].endswith("(TorchGRPO's settings: docs/training.md)")


def test_check_refuses_training_sampling_that_would_not_train_what_it_samples(files: Path) -> None:
    """--set sampling={"temperature": ...} sampled at one temperature and trained at --temperature's;
    --set sampling={"seed": ...} made every rollout of a group the same. --check says so, before any run."""
    with pytest.raises(SystemExit) as exc:
        main(_train(files, "--temperature", "0.7", "--set", 'sampling={"temperature": 0.5}', "--check"))
    assert "bad grpo settings: sampling has temperature=0.5 but TorchGRPO(temperature=0.7)" in str(exc.value.code)
    assert "--temperature 0.5" in str(exc.value.code)
    with pytest.raises(SystemExit) as exc:
        main(_train(files, "--set", 'sampling={"seed": 3}', "--check"))
    assert "bad grpo settings: sampling has seed=3: with group_size=2" in str(exc.value.code)
    assert not (files / "run").exists()
    # the same temperature twice, a seed for the evaluations only: fine
    main(
        _train(
            files,
            "--temperature",
            "0.7",
            "--set",
            'sampling={"temperature": 0.7}',
            "--set",
            'val_sampling={"seed": 3}',
            "--check",
        )
    )


def test_a_wrong_set_value_stops_the_run_before_any_step(files: Path) -> None:
    """checkpoint_every=0 passed --check, trained step 1, then crashed with ZeroDivisionError."""
    with pytest.raises(SystemExit, match="checkpoint_every=0: expected a whole number >= 1"):
        main(_train(files, "--steps", "1", "--set", "checkpoint_every=0"))
    assert not (files / "run").exists()


# ---------------------------------------------------------------------------------------------------------
# Ctrl-C, train.log
# ---------------------------------------------------------------------------------------------------------
def test_ctrl_c_ends_with_one_line_saying_how_to_resume(files: Path) -> None:
    run = files / "run"
    env = {**os.environ, "AGL_TEST_INTERRUPT_RUN": str(run)}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from agl.cli import main; sys.argv[0] = 'agl'; sys.exit(main())",
            *_train(files, "--steps", "3"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=default_sigint,  # its Ctrl-C interrupts even where this test run ignores SIGINT
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    assert "agl train: interrupted; the run so far is in" in proc.stderr and str(run / "checkpoints") in proc.stderr
    assert "--resume" in proc.stderr.splitlines()[-1]
    assert "interrupted" in (run / "train.log").read_text()
    assert latest_checkpoint(run / "checkpoints") is not None


def test_train_log_has_the_resumes_warning_and_the_error_that_stopped_the_run(files: Path) -> None:
    run = files / "run"
    assert main(_train(files, "--steps", "1")) == 0
    # what a run killed mid-step leaves: a queued rollout of a resources id it published
    published = (run / "checkpoints" / "published_resources.txt").read_text().split()
    store = agl.open_store(str(run / "store.db"))
    store.enqueue_rollout({"question": "Say 9."}, mode="train", resources_id=published[-1])
    store.close()
    # then the resumed run trains nothing (agent_match matches no call): it stops after 3 such steps
    assert main(_train(files, "--steps", "4", "--resume", "--agent-match", "^nobody$")) == 2
    log = (run / "train.log").read_text()
    assert "cancelled 1 rollouts that an earlier run" in log
    assert "3 steps in a row had nothing to train on" in log
    assert log.count("cancelled 1 rollouts") == 1


def test_greedy_training_sampling_points_to_greedy_evaluation(files: Path) -> None:
    """sampling={"temperature": 0} was told to use --temperature 0, which is refused in turn."""
    with pytest.raises(SystemExit) as exc:
        main(_train(files, "--temperature", "0.7", "--set", 'sampling={"temperature": 0}', "--check"))
    message = str(exc.value.code)
    assert "--temperature 0" not in message and "temperature=0 (" not in message
    assert "extra_evals={'greedy': {'temperature': 0.0}}" in message and "val_sampling" in message
