"""``agl train --algorithm verl``: the verl config from a YAML file plus ``--set`` overrides, validated against
the installed verl; ``--check`` says whether this machine can train it (this CPU machine cannot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl.cli import main

SEED_YAML = """
algorithm: {adv_estimator: grpo}
data: {train_batch_size: 32, max_prompt_length: 4096, max_response_length: 2048}
actor_rollout_ref:
  rollout: {name: vllm, n: 4}
  actor: {ppo_mini_batch_size: 32}
  model: {path: Qwen/Qwen2.5-0.5B-Instruct}
trainer: {n_gpus_per_node: 1, total_epochs: 2}
"""


@pytest.fixture()
def args(tmp_path: Path) -> list:
    (tmp_path / "agent.py").write_text(
        "import agl\n\n@agl.rollout\ndef agent(task, llm: agl.LLM) -> float:\n    return 1.0\n"
    )
    (tmp_path / "train.jsonl").write_text('{"q": 1}\n')
    (tmp_path / "verl.yaml").write_text(SEED_YAML)
    return [
        "train",
        f"{tmp_path}/agent.py:agent",
        "--data",
        str(tmp_path / "train.jsonl"),
        "--algorithm",
        "verl",
        "--config",
        f"@{tmp_path / 'verl.yaml'}",
        "--out",
        str(tmp_path / "run"),
        "--check",
    ]


def test_check_validates_the_yaml_and_overrides_then_names_what_the_machine_lacks(args, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*args, "--set", "data.train_batch_size=8", "--set", "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    message = str(exc.value.code)
    assert message.startswith("agl: the verl settings are valid, but this machine cannot train them")
    assert "0 CUDA GPU(s)" in message
    printed = capsys.readouterr().out
    assert "train_batch_size=8" in printed and "Qwen/Qwen2.5-0.5B-Instruct" in printed  # yaml + overrides merged


def test_a_misspelt_verl_key_is_named_with_the_right_one(args) -> None:
    with pytest.raises(
        SystemExit,
        match=r"bad verl settings: unknown verl config key 'trainer\.total_epoch'; "
        r"did you mean trainer\.total_epochs",
    ):
        main([*args, "--set", "trainer.total_epoch=1"])
