"""What the VERL loop needs from the GPU side (:class:`PolicyBackend`) and where that side serves the policy
(:class:`Serving`): the seam between :mod:`agl.algorithm.verl.trainer` and its Ray backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Protocol


@dataclass
class Serving:
    """Where the backend serves the policy: OpenAI-compatible base URLs and the served model name."""

    upstreams: List[str]
    model: str
    pad_token_id: int = 0


class PolicyBackend(Protocol):
    """What the loop needs from the GPU side."""

    def start(self, total_steps: int) -> Serving:
        """Start workers and inference servers (``total_steps`` sizes the LR schedule); the servers answer
        with the initial weights on return."""

    def data_parallel_size(self) -> int:
        """Rows of a batch must be a multiple of this (and of the number of mini batches times it)."""

    def update(self, batch: Any, step: int, mini_batches: int) -> Dict[str, float]:
        """Train on ``batch`` (a verl DataProto) in ``mini_batches`` mini batches, push the new weights to
        the servers; they serve again when this returns. Returns metrics."""

    def save_checkpoint(self, step: int) -> None: ...

    def stop(self) -> None: ...
