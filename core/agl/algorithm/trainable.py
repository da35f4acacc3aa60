"""The model the torch trainer updates: LoRA (peft) or full fine-tuning, and the reference policy for KL.

With LoRA the adapter is injected into the loaded model's own modules, so the object the policy server
holds generates with the adapter too: one copy of the weights serves and trains. The reference policy is
the same model with the adapter disabled (no second copy). Full fine-tuning keeps a frozen copy as the
reference, and only when a KL term asks for one.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch

from agl.algorithm.torch_grpo_config import DEFAULT_LORA, LoraSpec


def lora_config(spec: LoraSpec) -> Any:
    """A peft ``LoraConfig`` from a dict (missing fields from :data:`DEFAULT_LORA`) or a LoraConfig; None
    stays None (full fine-tuning)."""
    if spec is None:
        return None
    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise ImportError("LoRA training needs peft: pip install 'agl[torch]' (or pass lora=None)") from exc
    if isinstance(spec, LoraConfig):
        return spec
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"lora must be None (full fine-tuning), a dict of LoraConfig fields or a LoraConfig, got {spec!r}"
        )
    fields = {**DEFAULT_LORA, **spec, "task_type": "CAUSAL_LM"}
    try:
        return LoraConfig(**fields)
    except TypeError as exc:
        raise ValueError(f"lora={dict(spec)!r} is not a valid LoraConfig: {exc}") from None


class TrainablePolicy:
    """``model`` (the object the server shares) wrapped for training.

    ``module`` is what the optimizer and the forward passes use: the peft model with LoRA, the model itself
    with full fine-tuning.
    """

    def __init__(self, model: Any, lora: LoraSpec, *, need_reference: bool) -> None:
        self.base = model
        self.lora = lora_config(lora)
        if self.lora is not None:
            from peft import get_peft_model

            self.module = get_peft_model(model, self.lora)
            self._reference: Optional[Any] = None
        else:
            self.module = model
            self._reference = copy.deepcopy(model).eval().requires_grad_(False) if need_reference else None
            model.requires_grad_(True)

    @property
    def is_lora(self) -> bool:
        return self.lora is not None

    def parameters(self) -> List[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def n_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        """The reference policy as a module to run forward passes on (no gradients)."""
        if self.is_lora:
            with self.module.disable_adapter(), torch.no_grad():
                yield self.module
        elif self._reference is not None:
            with torch.no_grad():
                yield self._reference
        else:
            raise RuntimeError("no reference model: full fine-tuning keeps one only when kl_coef > 0")

    def fingerprint(self, model_name: str) -> Dict[str, Any]:
        """What a checkpoint must match to be resumed into this policy."""
        lora: Any = None
        if self.lora is not None:
            raw = self.lora.to_dict()
            lora = {k: _plain(raw.get(k)) for k in ("r", "lora_alpha", "target_modules", "layers_to_transform")}
        return {"model": model_name, "lora": lora}


def _plain(value: Any) -> Any:
    """JSON-comparable form of a LoraConfig field (sets become sorted lists)."""
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return value
