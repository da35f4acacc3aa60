"""Layer 8: running agents. ``LitAgent`` and ``@rollout``, the runner and runner pool that take rollouts from
a store, the shared event loops of async agents, task datasets and span retention."""
