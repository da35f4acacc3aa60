"""The trained policy as a plain Hugging Face model folder: base weights + the checkpoint's training, merged.

A TorchGRPO checkpoint holds what training changed (a LoRA adapter, or a full state dict) and the name of the
model it was trained from (``state.json``'s fingerprint). Serving it anywhere else (vLLM, transformers,
``agl serve --model DIR``, a hub upload) wants one ordinary folder instead: ``config.json``, safetensors
weights with the adapter merged in, the tokenizer. :func:`export_model` writes that folder; ``agl
export-model`` is its CLI.

The merge is checked before anything is written: the merged model's logits on a probe prompt must equal the
adapter model's (LoRA merging is exact up to float rounding), so a folder that exists is the trained policy.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from agl.algorithm.checkpoint import CheckpointError, TrainerState, latest_checkpoint
from agl.errors import AglError
from agl.serving.models import load_policy

logger = logging.getLogger(__name__)

#: written next to the weights: where they came from
MANIFEST = "agl_export.json"
_PROBE = "The trained policy answers:"


def resolve_checkpoint(path: Union[str, Path]) -> Path:
    """A ``step-NNNNNN`` folder, or the newest one of a ``checkpoint_dir`` / a run's ``--out`` folder."""
    path = Path(path)
    if (path / "state.json").exists():
        return path
    for directory in (path, path / "checkpoints"):
        found = latest_checkpoint(directory)
        if found is not None:
            return found
    raise CheckpointError(
        f"{path} holds no checkpoint: give a step-NNNNNN folder, a checkpoint_dir with a 'latest' file, or an "
        "`agl train --out` folder"
    )


def export_model(
    checkpoint: Union[str, Path],
    out: Union[str, Path],
    *,
    model: Optional[str] = None,
    dtype: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write the checkpoint's trained policy to ``out`` as a Hugging Face folder; returns ``out``.

    ``model``: the base model to load (``smollm2``, ``tiny`` or an HF path/name); default the one the
    checkpoint was trained from. ``dtype``: the saved weights' dtype (default float32, as trained on CPU).
    Raises :class:`CheckpointError` with what to do when the checkpoint, the base model or ``out`` does not fit.
    """
    source = resolve_checkpoint(checkpoint)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out} is not empty: choose a new folder, or pass overwrite=True (--overwrite)")
    state = TrainerState(**json.loads((source / "state.json").read_text(encoding="utf-8")))
    base = model or state.fingerprint.get("model")
    if not isinstance(base, str) or not base:
        raise CheckpointError(f"{source} does not say which model it was trained from: pass model= (--model)")
    logger.info("loading base model %r", base)
    save_dtype = _dtype(dtype)
    try:
        policy, tokenizer = load_policy(base, device="cpu", dtype=torch.float32)  # merged and checked in float32
    except (AglError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot load the base model {base!r} named by {source}/state.json ({exc}): pass the model it was "
            "trained from with model= (--model)"
        ) from exc
    merged = _plain_weights(_apply_training(policy, source, tokenizer)).to(save_dtype)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    manifest: Dict[str, Any] = {
        "base_model": base,
        "checkpoint": str(source.resolve()),
        "step": state.step,
        "policy_version": state.policy_version,
        "lora": state.fingerprint.get("lora"),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    logger.info("exported step %d of %s to %s", state.step, source, out)
    return out


def _plain_weights(model: Any) -> Any:
    """Drop the GGUF marker of a model loaded from a GGUF file (bundled SmolLM2): transformers dequantizes
    GGUF weights on load, so what is in memory are plain float weights, but it refuses to save a model so
    marked. Other quantizations keep quantized weights in memory: those cannot be exported merged."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return model
    method = str(getattr(getattr(quantizer, "quantization_config", None), "quant_method", "")).lower()
    if "gguf" not in method:
        raise CheckpointError(
            f"the base model is quantized ({method}): load a full-precision base with model= (--model) to export"
        )
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def _dtype(dtype: Any) -> Any:
    if dtype is None:
        return torch.float32
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise CheckpointError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    return resolved


def _apply_training(policy: Any, source: Path, tokenizer: Any) -> Any:
    """The base ``policy`` with the checkpoint's adapter merged in, or its full state dict loaded."""
    adapter, full = source / "adapter", source / "model.pt"
    if full.exists():
        try:
            policy.load_state_dict(torch.load(full, map_location="cpu"))
        except RuntimeError as exc:
            raise CheckpointError(f"{full} does not fit the base model: {exc}") from exc
        return policy
    if not adapter.exists():
        raise CheckpointError(f"{source} has neither adapter/ (LoRA) nor model.pt (full fine-tuning)")
    from peft import PeftModel

    try:
        with_adapter = PeftModel.from_pretrained(policy, str(adapter))
    except (ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"the adapter in {adapter} does not fit the base model: {exc}") from exc
    probe = tokenizer(_PROBE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = with_adapter(input_ids=probe).logits
        merged = with_adapter.merge_and_unload()
        got = merged(input_ids=probe).logits
    if not torch.allclose(got, expected, atol=1e-3, rtol=1e-3):
        gap = float((got - expected).abs().max())
        raise CheckpointError(f"merging {adapter} changed the model's logits by up to {gap:.3g}: not exported")
    return merged
