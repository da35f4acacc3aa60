"""`agl export-model`: a TorchGRPO checkpoint becomes a plain Hugging Face folder that loads (transformers,
`agl serve --model DIR`) as exactly the trained policy. Checkpoints are written with the trainer's own
save_checkpoint around real peft adapters whose weights are made non-zero (as training leaves them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Tuple

import pytest
import torch
from peft import LoraConfig, get_peft_model

from agl.algorithm.checkpoint import CheckpointError, TrainerState, save_checkpoint
from agl.algorithm.model_export import MANIFEST, export_model
from agl.cli import main as agl_main
from agl.serving.models import load_policy

PROBE = "What is 2 + 3? Answer:"


def trained_lora(name: str, tmp_path: Path, seed: int = 0) -> Tuple[Any, Any, Path]:
    """A LoRA policy on ``name`` with random adapter weights, checkpointed at step 7 under tmp_path/ckpt."""
    model, tokenizer = load_policy(name, device="cpu")
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in policy.named_parameters():
            if "lora_" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    state = TrainerState(step=7, policy_version=8, fingerprint={"model": name, "lora": {"r": 4}})
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    save_checkpoint(tmp_path / "ckpt", policy, optimizer, state, lora=True)
    return policy, tokenizer, tmp_path / "ckpt"


def logits(model: Any, tokenizer: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokenizer(PROBE, return_tensors="pt")["input_ids"]).logits[0].float()


def test_a_lora_checkpoint_exports_as_the_trained_policy(tmp_path):
    policy, tokenizer, checkpoints = trained_lora("tiny", tmp_path)
    out = export_model(checkpoints, tmp_path / "export")  # the checkpoint_dir: its latest step
    assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST} <= {p.name for p in out.iterdir()}
    assert not any("adapter" in p.name for p in out.iterdir())  # merged: a plain model folder
    exported, exported_tokenizer = load_policy(str(out), device="cpu")
    assert torch.allclose(logits(exported, exported_tokenizer), logits(policy, tokenizer), atol=1e-4)
    base, _ = load_policy("tiny", device="cpu")
    assert not torch.allclose(logits(base, tokenizer), logits(policy, tokenizer), atol=1e-2)  # training mattered
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["base_model"] == "tiny" and manifest["step"] == 7 and manifest["policy_version"] == 8
    assert manifest["checkpoint"].endswith("step-000007")


def test_a_full_fine_tuning_checkpoint_exports_in_the_asked_dtype(tmp_path):
    model, tokenizer = load_policy("tiny", device="cpu", seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # "training" changed the weights
    state = TrainerState(step=2, fingerprint={"model": "tiny", "lora": None})
    save_checkpoint(tmp_path / "run" / "checkpoints", model, torch.optim.AdamW(model.parameters()), state, lora=False)
    out = export_model(tmp_path / "run", tmp_path / "export", dtype="bfloat16")  # an `agl train --out` folder
    exported, _ = load_policy(str(out), device="cpu", dtype="bfloat16")
    assert next(exported.parameters()).dtype == torch.bfloat16
    assert torch.allclose(logits(exported, tokenizer), logits(model.to(torch.bfloat16), tokenizer), atol=0.05)


def test_the_bundled_gguf_model_exports_with_its_adapter_merged(tmp_path):
    """SmolLM2 is loaded from a GGUF file, which transformers marks as quantized and refuses to save."""
    policy, tokenizer, checkpoints = trained_lora("smollm2", tmp_path)
    out = export_model(checkpoints / "step-000007", tmp_path / "export")
    exported, exported_tokenizer = load_policy(str(out), device="cpu")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert exported_tokenizer("hello")["input_ids"] == tokenizer("hello")["input_ids"]
    assert torch.allclose(logits(exported, exported_tokenizer), logits(policy, tokenizer), atol=1e-3)


def test_bad_exports_say_what_to_do(tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        export_model(tmp_path, tmp_path / "export")
    _, _, checkpoints = trained_lora("tiny", tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        export_model(checkpoints, tmp_path / "full")
    with pytest.raises(CheckpointError, match="pass the model it was trained from"):
        export_model(checkpoints, tmp_path / "export", model=str(tmp_path / "no-such-model"))
    with pytest.raises(CheckpointError, match="unknown dtype"):
        export_model(checkpoints, tmp_path / "export", dtype="float7")


def test_cli_exports_and_reports_errors(tmp_path, capsys):
    _, _, checkpoints = trained_lora("tiny", tmp_path)
    assert agl_main(["export-model", str(checkpoints), "--out", str(tmp_path / "export")]) == 0
    assert f"agl serve --model {tmp_path / 'export'}" in capsys.readouterr().out
    assert agl_main(["export-model", str(tmp_path / "nothing"), "--out", str(tmp_path / "e2")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_agl_serve_of_a_training_folder_says_to_export_it_first(tmp_path: Path) -> None:
    """`agl serve --model RUN_DIR` ended in a transformers traceback about converting a slow tokenizer."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.csv").write_text("step\n")
    with pytest.raises(SystemExit, match=r"is an agl training run or checkpoint.*agl export-model"):
        agl_main(["serve", "--model", str(run)])
