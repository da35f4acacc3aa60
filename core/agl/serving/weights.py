"""Loading new policy weights into a served model, in place.

What :meth:`PolicyServer.load_weights` accepts (and so what a resources version may name, see
docs/serving.md):

- a state dict (``{name: tensor}``) with the served model's parameter names, complete or partial (only the
  parameters a trainer changed); a name the model does not have is an error, nothing is loaded;
- a file: ``*.safetensors``, or a ``torch.save`` state dict (``*.pt``, ``*.pth``, ``*.bin``);
- a folder written by ``save_pretrained``: full weights (``model.safetensors``, sharded or not, or
  ``pytorch_model.bin``), or a peft LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).
  An adapter is merged into the *base* weights (``W = W0 + B @ A * alpha / r``): each new adapter replaces
  the previous one instead of stacking on it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Mapping, Union

import torch

from agl.errors import AglError

logger = logging.getLogger(__name__)

WeightsSource = Union[str, "os.PathLike[str]", Mapping[str, Any]]

_ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


class WeightsError(AglError, ValueError):
    """Weights that cannot be loaded into the served model (nothing was changed)."""


class WeightLoader:
    """Loads weights into one model; remembers the base weights of layers a LoRA adapter changed."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._lora_base: Dict[str, Any] = {}  # parameter name -> its weight before any adapter

    def load(self, source: WeightsSource) -> int:
        """Copy the weights in; returns how many tensors changed. Raises :class:`WeightsError`."""
        if isinstance(source, Mapping):
            return self._load_state_dict(dict(source), "the given state dict")
        path = os.fspath(source)
        if os.path.isdir(path):
            if os.path.exists(os.path.join(path, _ADAPTER_CONFIG)):
                return self._merge_lora(path)
            return self._load_state_dict(_read_folder(path), path)
        if os.path.isfile(path):
            return self._load_state_dict(_read_file(path), path)
        raise WeightsError(f"no weights at {path!r}: give a checkpoint folder, a .safetensors/.pt file or a state dict")

    def _load_state_dict(self, state: Dict[str, Any], where: str) -> int:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        unknown = sorted(set(state) - set(params))
        if unknown:
            hint = ""
            if any(k.startswith(_PEFT_PREFIX) for k in unknown):
                hint = (
                    " (these are a peft model's names: save the adapter with model.save_pretrained(folder), or "
                    "merge it with merge_and_unload() before saving)"
                )
            raise WeightsError(
                f"{where} has {len(unknown)} tensor(s) the served model does not have, e.g. {unknown[:3]}{hint}; "
                "nothing was loaded"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise WeightsError(
                    f"{where}: {name} has shape {tuple(tensor.shape)}, the served model's has "
                    f"{tuple(params[name].shape)} (a checkpoint of another model?); nothing was loaded"
                )
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
        for name in state:
            self._lora_base.pop(name, None)  # full weights are the new base
        return len(state)

    def _merge_lora(self, folder: str) -> int:
        with open(os.path.join(folder, _ADAPTER_CONFIG)) as f:
            config = json.load(f)
        unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern") if config.get(k)]
        if unsupported or config.get("bias", "none") != "none":
            raise WeightsError(
                f"LoRA adapter {folder}: {', '.join(unsupported) or 'trained biases'} cannot be merged by agl's "
                "server; save merged full weights instead (peft: model.merge_and_unload().save_pretrained(dir))"
            )
        rank = int(config["r"])
        scale = float(config.get("lora_alpha", rank)) / (rank**0.5 if config.get("use_rslora") else rank)
        transpose = bool(config.get("fan_in_fan_out"))
        pairs = _lora_pairs(_read_folder(folder, prefix="adapter_model"), folder)
        params = dict(self.model.named_parameters())
        missing = sorted(f"{m}.weight" for m in pairs if f"{m}.weight" not in params)
        if missing:
            raise WeightsError(
                f"LoRA adapter {folder} targets layers the served model does not have, e.g. {missing[:3]}; "
                "was it trained on another model? Nothing was loaded"
            )
        with torch.no_grad():
            for name in set(self._lora_base) - {f"{m}.weight" for m in pairs}:
                params[name].copy_(self._lora_base.pop(name))  # a layer the new adapter leaves alone
            for module, (a, b) in pairs.items():
                name = f"{module}.weight"
                weight = params[name]
                base = self._lora_base.setdefault(name, weight.detach().clone())
                delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
                weight.copy_(base + (delta.T if transpose else delta).to(weight.dtype).to(weight.device))
        return len(pairs)


def _lora_pairs(state: Dict[str, Any], folder: str) -> Dict[str, Any]:
    """``{module name in the served model: (A, B)}`` from peft's saved names."""
    pairs: Dict[str, Dict[str, Any]] = {}
    for key, tensor in state.items():
        stem, _, kind = key.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise WeightsError(
                f"LoRA adapter {folder} has {key!r}: only lora_A/lora_B weights of linear layers can be merged "
                "(no embedding adapters or modules_to_save); save merged full weights instead"
            )
        module = stem[len(_PEFT_PREFIX) :] if stem.startswith(_PEFT_PREFIX) else stem
        pairs.setdefault(module, {})[kind[0]] = tensor
    incomplete = [m for m, p in pairs.items() if set(p) != {"A", "B"}]
    if incomplete:
        raise WeightsError(f"LoRA adapter {folder}: {incomplete[:3]} lack lora_A or lora_B weights")
    return {m: (p["A"], p["B"]) for m, p in pairs.items()}


def _read_folder(folder: str, prefix: str = "") -> Dict[str, Any]:
    """All tensors of a ``save_pretrained`` folder (``prefix`` picks e.g. ``adapter_model`` files only)."""
    names = sorted(os.listdir(folder))
    for ext, start in ((".safetensors", prefix or "model"), (".bin", prefix or "pytorch_model")):
        files = [n for n in names if n.endswith(ext) and n.startswith(start)]
        if files:
            state: Dict[str, Any] = {}
            for name in files:
                state.update(_read_file(os.path.join(folder, name)))
            return state
    raise WeightsError(
        f"{folder} has no weights: expected model*.safetensors or pytorch_model*.bin (save_pretrained), or a peft "
        "adapter (adapter_config.json + adapter_model.safetensors)"
    )


def _read_file(path: str) -> Dict[str, Any]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unreadable file gets the same advice
        raise WeightsError(f"cannot read {path} as a torch state dict: {exc}") from exc
    if not isinstance(state, Mapping):
        raise WeightsError(f"{path} holds a {type(state).__name__}, not a state dict ({{name: tensor}})")
    return dict(state)
