"""LightningRL: from a rollout's spans to single-turn training samples with credit assigned.

spans --tree--> trace tree (repaired) --transitions--> one Transition per selected llm call
      --links/air--> step rewards per call --credit--> reward per transition
      --aggregate--> samples (optionally merged, with a response mask) --advantages--> trainer batch / export

``LightningRL`` (adapter.py) runs the whole chain; docs/lightningrl.md has the formulas.
"""

from agl.lightningrl.adapter import Batch, BatchReport, LightningRL
from agl.lightningrl.air import AIRConfig
from agl.lightningrl.credit import Broadcast, CreditRule, Discounted, StepOnly
from agl.lightningrl.types import Sample, Transition

__all__ = [
    "AIRConfig",
    "Batch",
    "BatchReport",
    "Broadcast",
    "CreditRule",
    "Discounted",
    "LightningRL",
    "Sample",
    "StepOnly",
    "Transition",
]
