"""The VERL backend: ``agl.VERL(config)`` trains on GPUs with verl, agents reaching vLLM through agl's proxy.

``config`` (the verl keys, validated against the installed verl) and ``trainer`` (the loop) import no
verl, torch or ray at import time; ``batch`` (samples to ``DataProto``) and ``ray_backend`` (verl's Ray
workers and vLLM servers) need the ``verl`` extra. See docs/verl.md.
"""

from agl.algorithm.verl.backend import PolicyBackend, Serving
from agl.algorithm.verl.config import VERLConfig, VERLConfigError
from agl.algorithm.verl.trainer import VERL, TrainingSummary

__all__ = ["PolicyBackend", "Serving", "TrainingSummary", "VERL", "VERLConfig", "VERLConfigError"]
