"""Training algorithms: prompt optimization (APO) here; the torch GRPO trainer and the VERL bridge load
their heavy dependencies lazily. ``@algo`` makes an algorithm of a function (Agent Lightning's decorator)."""

from agl.algorithm.apo import APO, TraceToMessages
from agl.algorithm.base import Algorithm, Baseline, FastAlgorithm, FunctionalAlgorithm, algo


def __getattr__(name: str) -> object:
    """``agl.algorithm.VERL`` and ``agl.algorithm.TorchGRPO`` (Agent Lightning's paths too) on first use: only
    training needs verl or torch."""
    if name == "VERL":
        from agl.algorithm.verl import VERL

        return VERL
    if name == "TorchGRPO":
        from agl.algorithm.torch_grpo import TorchGRPO

        return TorchGRPO
    raise AttributeError(f"module 'agl.algorithm' has no attribute {name!r}")


__all__ = ["APO", "Algorithm", "Baseline", "FastAlgorithm", "FunctionalAlgorithm", "TraceToMessages", "algo"]
