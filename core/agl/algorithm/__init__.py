"""Training algorithms. The torch GRPO trainer and the VERL bridge load their heavy dependencies lazily."""

from agl.algorithm.base import Algorithm, Baseline

__all__ = ["Algorithm", "Baseline"]
