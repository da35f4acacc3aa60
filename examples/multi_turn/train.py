"""The multi-turn job: train an OpenAI Agents SDK agent that needs two tool calls per task, with GRPO on a CPU.

    python examples/multi_turn/train.py

The agent of ``calculator_agent.py`` solves two-step arithmetic requests with an ``add`` and a ``multiply``
tool, each tool result read back in its next LLM call; every LLM call of a rollout (about three) is a sample
credited with the episode reward. It runs on agl's embedded defaults in this one process, as the main job does
(``examples/cpu_job.py``: the same command line, time budget, run folder and Ctrl-C), and prints held-out
success, LLM calls per rollout and tool-call validity before and after training, and the reward curve; per
step, ``metrics.csv`` has ``llm_calls_per_rollout`` and ``tool_call_validity``. Output: ``.agl/multi_turn``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

STARTED = time.monotonic()

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from calculator_agent import AGENT_MATCH, calculator_agent
from cpu_job import DATA, Job, run

JOB = Job(
    name="multi-turn job",
    description=__doc__.split("\n\n")[0],
    script=Path(__file__),
    agent=calculator_agent,
    agent_match=AGENT_MATCH,
    train_file=DATA / "multi_turn_train.jsonl",
    heldout_file=DATA / "multi_turn_heldout.jsonl",
    out=".agl/multi_turn",
    # a tool call is about 30 tokens ({"name": "multiply", "arguments": {"a": 63, "b": 4}} in its tags)
    # The server samples from the grammar-restricted distribution and reports those logprobs (0.39 per token
    # from the trainer's in a run that used them): the PPO ratio's old logprobs come from the trainer's own pass.
    grpo={"max_tokens": 48, "old_logprobs": "recompute"},
    rollout_timeout=600,  # LLM calls in turn, on a busy CPU
    tool_calls=True,
)


def main(argv: Optional[List[str]] = None) -> int:
    return run(JOB, argv, STARTED)


if __name__ == "__main__":
    sys.exit(main())
