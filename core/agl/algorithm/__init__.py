"""Training algorithms: prompt optimization (APO) here; the torch GRPO trainer and the VERL bridge load
their heavy dependencies lazily."""

from agl.algorithm.apo import APO, TraceToMessages
from agl.algorithm.base import Algorithm, Baseline

__all__ = ["APO", "Algorithm", "Baseline", "TraceToMessages"]
