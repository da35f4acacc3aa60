"""LightningRL: from a rollout's spans to single-turn training samples with credit assigned.

spans --tree--> trace tree (repaired) --transitions--> one Transition per selected llm call
      --credit--> rewards per transition --advantages--> per-sample advantages and loss weights
      --aggregate--> (optionally) merged samples with a response mask --> trainer batch / export
"""
