"""Checkpoints of the torch trainer: the trained weights (the LoRA adapter only, or the whole model), the
optimizer, the step and the trainer's bookkeeping, so a resumed run continues where it stopped.

Layout under ``checkpoint_dir``::

    step-000012/
        adapter/            peft ``save_pretrained`` (LoRA)   or   model.pt (full fine-tuning state dict)
        optimizer.pt
        rng.pt              the random generators' states (torch CPU and CUDA, Python's ``random``)
        state.json          step, policy version, data cursor (epoch, position), metric rows, evaluations
    latest                  the name of the newest complete checkpoint folder
    published_resources.txt every resources id the run published, one a line (see :func:`record_published`)

A checkpoint is written to a temporary folder and renamed into place, and ``latest`` is replaced
atomically, so a run killed mid-save leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import torch

from agl.errors import AglError

logger = logging.getLogger("agl.train")


class CheckpointError(AglError, ValueError):
    """A checkpoint that cannot be resumed from (missing files, another model or LoRA setting)."""


@dataclass
class TrainerState:
    """The trainer's bookkeeping besides weights and optimizer."""

    step: int = 0
    policy_version: int = 0
    epoch: int = 0
    cursor: int = 0  # position in the current epoch's task order
    rows: List[Dict[str, float]] = field(default_factory=list)
    evaluations: List[Dict[str, Any]] = field(default_factory=list)
    fingerprint: Dict[str, Any] = field(default_factory=dict)  # model + LoRA settings, checked on resume


PUBLISHED_FILE = "published_resources.txt"


def record_published(directory: Optional[Path], resources_id: str) -> None:
    """Note that the run of ``directory`` published ``resources_id`` (before any rollout uses it), so that a
    resumed run can tell the rollouts its killed predecessor left behind from other trainers' in a shared
    store. Appended, not rewritten: a kill between two writes loses at most the id being written."""
    if directory is None:
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / PUBLISHED_FILE, "a", encoding="utf-8") as out:
        out.write(resources_id + "\n")


def published_resources(directory: Optional[Path]) -> Set[str]:
    """The resources ids that earlier runs of ``directory`` published (:func:`record_published`)."""
    path = Path(directory) / PUBLISHED_FILE if directory is not None else None
    if path is None or not path.exists():
        return set()
    return {line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


def save_checkpoint(
    directory: Path, model: Any, optimizer: torch.optim.Optimizer, state: TrainerState, *, lora: bool, keep: int = 2
) -> Path:
    """Write ``step-NNNNNN`` under ``directory``, point ``latest`` at it, keep the newest ``keep`` folders.

    A folder numbered at or above this step belongs to an earlier run that this one replaces (a run started
    with ``resume=False`` in a folder that held one; a resumed run only writes steps after its checkpoint):
    it is deleted, so that the two newest are this run's, never the old run's with this run's deleted.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"step-{state.step:06d}"
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=f".{name}-"))
    try:
        if lora:
            # the embeddings are not trained: peft need not look for the base model's config to decide
            model.save_pretrained(str(staging / "adapter"), save_embedding_layers=False)
        else:
            torch.save(model.state_dict(), staging / "model.pt")
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        torch.save(_rng_state(), staging / "rng.pt")
        (staging / "state.json").write_text(json.dumps(asdict(state)), encoding="utf-8")
        final = directory / name
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    pointer = directory / ".latest.tmp"
    pointer.write_text(name, encoding="utf-8")
    os.replace(pointer, directory / "latest")
    _prune(directory, keep, final)
    return final


def latest_checkpoint(directory: Optional[Path]) -> Optional[Path]:
    """The folder ``latest`` names, or None when there is no checkpoint yet."""
    if directory is None:
        return None
    pointer = Path(directory) / "latest"
    if not pointer.exists():
        return None
    path = Path(directory) / pointer.read_text(encoding="utf-8").strip()
    if not (path / "state.json").exists():
        raise CheckpointError(f"{pointer} names {path.name}, which has no state.json: delete {pointer} to start afresh")
    return path


def load_checkpoint(
    path: Path, model: Any, optimizer: torch.optim.Optimizer, *, lora: bool, fingerprint: Dict[str, Any]
) -> TrainerState:
    """Load weights and optimizer from ``path`` into ``model``/``optimizer``; returns the saved state.

    Refuses a checkpoint made for another model or LoRA setting (its ``fingerprint`` differs): resuming it
    would load mismatched weights or silently train a different configuration.

    The optimizer's moments come from the checkpoint, its learning rate stays the one ``optimizer`` was
    made with (this run's ``lr``): a run resumed with another ``lr`` trains at it, with a warning.
    The random generators continue from where the checkpoint left them (when it saved them: ``rng.pt``).
    """
    state = TrainerState(**json.loads((path / "state.json").read_text(encoding="utf-8")))
    if state.fingerprint != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} was made with {state.fingerprint}, this run uses {fingerprint}: to keep that run, "
            "train in another folder (`agl train`: another --out; Python: another checkpoint_dir and output_dir); "
            "resume=False starts afresh in this one, replacing its checkpoints and its metrics.csv"
        )
    device = next(model.parameters()).device
    if lora:
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        weights = load_peft_weights(str(path / "adapter"), device=str(device))
        result = set_peft_model_state_dict(model, weights)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise CheckpointError(f"checkpoint {path}: adapter weights do not fit this model ({unexpected[:3]} ...)")
    else:
        model.load_state_dict(torch.load(path / "model.pt", map_location=device))
    configured = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device))
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, configured):
        group["lr"] = lr
    if saved != configured:
        logger.warning(
            "resuming %s with lr=%s; the checkpoint was trained with lr=%s: training continues at lr=%s",
            path,
            _one(configured),
            _one(saved),
            _one(configured),
        )
    if (path / "rng.pt").exists():
        _set_rng_state(torch.load(path / "rng.pt"))
    return state


def _one(values: List[float]) -> Any:
    return values[0] if len(set(values)) == 1 else values


def _rng_state() -> Dict[str, Any]:
    """The states of the generators a run samples with: torch's (the policy server's sampling when a request
    has no seed), CUDA's when present, and Python's ``random``."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _step_of(folder: Path) -> int:
    try:
        return int(folder.name[len("step-") :])
    except ValueError:
        return -1


def _prune(directory: Path, keep: int, newest: Path) -> None:
    """Keep ``newest`` (just written) and the highest-numbered folders before it, ``keep`` in all. Folders
    numbered above ``newest`` are an earlier run's (see :func:`save_checkpoint`): deleted too."""
    step = _step_of(newest)
    earlier = sorted((p for p in directory.glob("step-*") if p.is_dir() and p != newest), key=_step_of)
    stale = [p for p in earlier if _step_of(p) > step]
    before = [p for p in earlier if _step_of(p) <= step]
    for old in stale + before[: max(0, len(before) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
