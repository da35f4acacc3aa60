"""``agl train``: train an agent from the command line, with TorchGRPO (CPU or one GPU) or VERL (GPUs).

The same run as a Python script with ``Trainer(algorithm=..., adapter=...).fit(agent, train, val_dataset=val)``;
the command exists so that a user can go from ``agl dev`` (does my agent run?) to training without writing
that script. Everything the algorithms accept stays reachable: the common TorchGRPO settings have flags,
any other keyword goes through ``--set KEY=VALUE`` or ``--config``, and for VERL ``--set`` takes verl's own
dotted overrides. A run's files (store, metrics, checkpoints) live under ``--out``; an ``--out`` that
already holds a run is resumed only with ``--resume``, never silently overwritten or mixed into.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any, Dict, Sequence

_STARTED = time.monotonic()  # --minutes counts the whole command, imports included, as the main job does
_SUMMARY_RESERVE_S = 15.0  # left of --minutes for the summary and shutting down

# TorchGRPO keywords that have their own flag (dest name == keyword)
_GRPO_FLAGS = ("model", "steps", "group_size", "batch_tasks", "lr", "temperature", "max_tokens")


def add_train_parser(sub: Any, store_help: str) -> None:
    """``agl train AGENT --data FILE [--val-data FILE] [--agent-match RE] [--algorithm grpo|verl] ...``."""
    train = sub.add_parser(
        "train",
        help="train an agent with reinforcement learning (TorchGRPO on CPU/one GPU, or VERL on GPUs)",
        description="Train AGENT's LLM calls on the tasks of --data. grpo (default) serves and trains the policy in "
        "this process (CPU or one GPU, extra 'torch'); verl trains on GPUs (extra 'verl'). The run's store, "
        "metrics and checkpoints go under --out.",
        epilog="examples:\n"
        "  agl train examples/main_job/langgraph_math_agent.py:math_agent --data examples/data/main_job_train.jsonl \\\n"
        "      --val-data examples/data/main_job_heldout.jsonl --agent-match '^(solve|answer)$' \\\n"
        "      --group-size 4 --batch-tasks 4 --temperature 0.7 --max-tokens 24 --minutes 10\n"
        "  agl train my_agent.py:agent --data train.jsonl --algorithm verl --config @verl.yaml "
        "--set trainer.total_epochs=1 --check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("agent", help="MODULE:NAME or path/to/file.py:NAME (a LitAgent or a rollout function)")
    train.add_argument("--data", required=True, help="training tasks: .jsonl (one per line) or .json (a list)")
    train.add_argument("--val-data", help="held-out tasks, evaluated before and after training")
    train.add_argument("--agent-match", help="regex on agent names: only their LLM calls are trained (default: all)")
    train.add_argument("--algorithm", choices=["grpo", "verl"], default="grpo")
    train.add_argument("--config", help="algorithm settings: a JSON object or @file (.json; .yaml too for verl); "
                       "grpo: TorchGRPO keywords, verl: verl's config keys")
    train.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                       help="one more setting (repeatable). grpo: a TorchGRPO keyword, the value read as JSON when it "
                       "parses (--set lora=null --set kl_coef=0.01); verl: a verl override (--set trainer.total_epochs=1)")
    grpo = train.add_argument_group("grpo settings (TorchGRPO; see docs/training.md)")
    grpo.add_argument("--model", help="smollm2 (bundled, default), tiny (random, smoke tests), or a HF name/path")
    grpo.add_argument("--steps", type=int, help="most training steps (default: one epoch over --data)")
    grpo.add_argument("--group-size", type=int, help="rollouts per task, the GRPO group (default 4)")
    grpo.add_argument("--batch-tasks", type=int, help="tasks per step (default 8)")
    grpo.add_argument("--lr", type=float, help="AdamW learning rate (default 5e-4, for LoRA)")
    grpo.add_argument("--temperature", type=float, help="sampling temperature during training (default 1.0)")
    grpo.add_argument("--max-tokens", type=int, help="longest response per LLM call (default 256)")
    grpo.add_argument("--minutes", type=float, help="wall-time budget of the whole command; training stops early "
                      "enough for the final evaluation to fit")
    train.add_argument("--out", default=".agl/train", help="the run's folder: store, metrics, checkpoints "
                       "(default .agl/train)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    train.add_argument("--store", default=None, help=store_help.replace("$AGL_STORE or .agl/store.db", "OUT/store.db"))
    train.add_argument("--n-runners", type=int, default=16, help="agents run at once (default 16)")
    train.add_argument("--runner-mode", choices=["thread", "process"], default="thread",
                       help="thread (default: agents mostly wait on the model's HTTP endpoint) or process")
    train.add_argument("--rollout-timeout", type=float, default=600.0, help="seconds before a rollout is retried")
    train.add_argument("--check", action="store_true", help="check the agent, data and settings (and for verl "
                       "whether this machine can train them), then exit without training")
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    import agl
    from agl.cli import json_setting, load_agent, load_tasks

    out = Path(args.out)
    _check_out(out, args.resume, args.check)
    if args.agent_match:
        try:
            re.compile(args.agent_match)
        except re.error as exc:
            raise SystemExit(f"agl: --agent-match {args.agent_match!r} is not a regular expression: {exc}") from None
    if args.n_runners < 0:
        raise SystemExit("agl: --n-runners must be >= 0 (0: only runners on other machines, `agl runner`)")
    agent = load_agent(args.agent)
    train_tasks = load_tasks(args.data)
    val_tasks = load_tasks(args.val_data) if args.val_data else None
    config = json_setting(args.config, "--config", yaml_ok=args.algorithm == "verl") if args.config else {}
    if args.algorithm == "grpo":
        algorithm = _torch_grpo(args, config, out)
    else:
        algorithm = _verl(args, config)
    print(f"agl train: {len(train_tasks)} training tasks, {len(val_tasks or [])} held-out tasks")
    if args.check:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    agl.instrument()
    trainer = agl.Trainer(
        algorithm=algorithm,
        store=args.store or str(out / "store.db"),
        adapter={"agent_match": args.agent_match} if args.agent_match else None,
        n_runners=args.n_runners,
        runner_mode=args.runner_mode,
        rollout_timeout=args.rollout_timeout,
    )
    result = trainer.fit(agent, train_tasks, val_dataset=val_tasks)
    if args.algorithm == "verl":  # TorchGRPO prints its own summary and curve
        for step in result.steps:
            print(json.dumps({"step": step.step, **{k: v for k, v in step.metrics.items() if k.startswith("agl/")}}))
    print(f"agl train: done; the run is in {out}")
    return 0


def _check_out(out: Path, resume: bool, check: bool) -> None:
    """Refuse to start a fresh run in a folder that holds one: its checkpoints would be resumed, its metrics
    and rollouts mixed with the new run's. Nothing is deleted here; the user decides."""
    if check:  # --check writes nothing
        return
    holds_run = out.is_dir() and any((out / name).exists() for name in ("checkpoints", "metrics.csv", "store.db"))
    if resume and not holds_run:
        raise SystemExit(f"agl: --resume: {out} holds no run to continue (no checkpoints, metrics or store there)")
    if holds_run and not resume:
        raise SystemExit(
            f"agl: {out} already holds a training run: pass --resume to continue it, or choose another --out "
            "(or delete the folder)"
        )


def _torch_grpo(args: argparse.Namespace, config: Dict[str, Any], out: Path) -> Any:
    try:
        from agl.algorithm.torch_grpo import TorchGRPO
    except ImportError as exc:
        raise SystemExit(f'agl: the grpo trainer needs torch: pip install "agl[torch]" ({exc})') from None

    settings: Dict[str, Any] = {"output_dir": out, "checkpoint_dir": out / "checkpoints", "resume": args.resume}
    settings.update(config)
    settings.update(_grpo_sets(args.settings))
    for name in _GRPO_FLAGS:
        value = getattr(args, name)
        if value is not None:
            settings[name] = value
    if args.minutes is not None:
        if args.minutes <= 0:
            raise SystemExit("agl: --minutes must be positive")
        settings["time_budget_s"] = round(args.minutes * 60 - (time.monotonic() - _STARTED) - _SUMMARY_RESERVE_S, 1)
    try:
        algorithm = TorchGRPO(**settings)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"agl: bad grpo settings: {exc} (TorchGRPO's settings: docs/training.md)") from None
    shown = {k: v for k, v in settings.items() if k not in ("output_dir", "checkpoint_dir", "resume")}
    print("agl train: TorchGRPO(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")")
    return algorithm


def _grpo_sets(settings: Sequence[str]) -> Dict[str, Any]:
    """``--set key=value`` for TorchGRPO: the value as JSON when it parses (numbers, null, lists), else text."""
    result: Dict[str, Any] = {}
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"agl: --set {item!r} must look like KEY=VALUE")
        try:
            result[key.strip()] = json.loads(raw)
        except ValueError:
            result[key.strip()] = raw
    return result


def _verl(args: argparse.Namespace, config: Dict[str, Any]) -> Any:
    grpo_only = [f"--{name.replace('_', '-')}" for name in (*_GRPO_FLAGS, "minutes") if getattr(args, name) is not None]
    if grpo_only:
        raise SystemExit(
            f"agl: {', '.join(grpo_only)} set TorchGRPO; with --algorithm verl use verl's keys instead, e.g. "
            "--set trainer.total_training_steps=N --set actor_rollout_ref.model.path=MODEL"
        )
    from agl.algorithm.verl import VERL, VERLConfig, VERLConfigError

    try:
        verl_config = VERLConfig(config, args.settings)
        algorithm = VERL(verl_config)
    except VERLConfigError as exc:
        raise SystemExit(f"agl: bad verl settings: {exc}") from None
    except ImportError as exc:  # VERLNotInstalledError says how to install it
        raise SystemExit(f"agl: {exc}") from None
    print(verl_config)
    if args.check:
        try:
            verl_config.check_runtime()
        except VERLConfigError as exc:
            raise SystemExit(f"agl: the verl settings are valid, but this machine cannot train them: {exc}") from None
    return algorithm
