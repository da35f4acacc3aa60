"""``agl train``: train an agent from the command line, with TorchGRPO (CPU or one GPU), VERL (GPUs), or
optimize its prompt with APO (any OpenAI-compatible models).

The same run as a Python script with ``Trainer(algorithm=..., adapter=...).fit(agent, train, val_dataset=val)``;
the command exists so that a user can go from ``agl dev`` (does my agent run?) to training without writing
that script. Everything the algorithms accept stays reachable: the common TorchGRPO settings have flags,
any other keyword goes through ``--set KEY=VALUE`` or ``--config``, and for VERL ``--set`` takes verl's own
dotted overrides; for APO, ``--set`` takes APO's keywords. A run's files (store, metrics, checkpoints) live under
``--out``; an ``--out`` that already holds a run is resumed only with ``--resume``, never silently overwritten or
mixed into.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from agl.algorithm.torch_grpo_config import json_problems
from agl.checks import is_finite_number
from agl.cli.run_folder import check_out, interrupted_message, no_second_interrupt, with_resume
from agl.cli.train_apo import apo_algorithm, check_apo_out, fit_apo
from agl.cli.train_settings import GRPO_FLAGS, adapter_settings, grpo_flags_given, keyword_sets

_STARTED = time.monotonic()  # --minutes counts the whole command, imports included, as the main job does
_SUMMARY_RESERVE_S = 15.0  # left of --minutes for the summary and shutting down

#: the verl key each TorchGRPO flag corresponds to (``--minutes`` has none: verl counts steps or epochs)
_VERL_KEYS = {
    "model": "actor_rollout_ref.model.path",
    "steps": "trainer.total_training_steps",
    "group_size": "actor_rollout_ref.rollout.n",
    "batch_tasks": "data.train_batch_size",
    "lr": "actor_rollout_ref.actor.optim.lr",
    "temperature": "actor_rollout_ref.rollout.temperature",
    "max_tokens": "data.max_response_length",
}


def add_train_parser(sub: Any, store_help: str) -> None:
    """``agl train AGENT --data FILE [--val-data FILE] [--agent-match RE] [--algorithm grpo|verl|apo] ...``."""
    train = sub.add_parser(
        "train",
        help="train an agent with reinforcement learning (TorchGRPO on CPU/one GPU, or VERL on GPUs), or "
        "optimize its prompt (APO)",
        description="Train AGENT's LLM calls on the tasks of --data. grpo (default) serves and trains the policy in "
        "this process (CPU or one GPU, extra 'torch'); verl trains on GPUs (extra 'verl'). The run's store, "
        "metrics and checkpoints go under --out. apo optimizes the agent's prompt instead of weights (no GPU).",
        epilog="examples:\n"
        "  agl train examples/main_job/langgraph_math_agent.py:math_agent --data examples/data/main_job_train.jsonl "
        "\\\n"
        "      --val-data examples/data/main_job_heldout.jsonl --agent-match '^(solve|answer)$' \\\n"
        "      --group-size 4 --batch-tasks 4 --temperature 0.7 --max-tokens 24 --minutes 10\n"
        "  agl train my_agent.py:agent --data train.jsonl --algorithm verl --config @verl.yaml "
        "--set trainer.total_epochs=1 --check\n"
        "  agl train my_agent.py:agent --data train.jsonl --algorithm apo --prompt @prompt.txt \\\n"
        "      --llm-endpoint http://127.0.0.1:8000/v1 --llm-model my-model \\\n"
        "      --optimizer-endpoint https://api.openai.com/v1 --optimizer-model gpt-4.1-mini --set rounds=3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("agent", help="MODULE:NAME or path/to/file.py:NAME (a LitAgent or a rollout function)")
    train.add_argument(
        "--data", required=True, help="training tasks: .jsonl (one per line), .json (a list), .parquet or .csv"
    )
    train.add_argument("--val-data", help="held-out tasks, evaluated before and after training")
    train.add_argument("--agent-match", help="regex on agent names: only their LLM calls are trained (default: all)")
    train.add_argument(
        "--adapter",
        dest="adapter_settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a LightningRL setting (repeatable; docs/lightningrl.md), the value read as JSON when it "
        "parses: --adapter credit=discounted --adapter gamma=0.9 --adapter aggregate=true "
        "--adapter 'air={\"tool_error\": -0.5}'",
    )
    train.add_argument("--algorithm", choices=["grpo", "verl", "apo"], default="grpo")
    train.add_argument(
        "--config",
        help="algorithm settings: a JSON object or @file (.json; .yaml too for verl); "
        "grpo: TorchGRPO keywords, verl: verl's config keys, apo: APO keywords",
    )
    train.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more setting (repeatable). grpo: a TorchGRPO keyword, the value read as JSON when it "
        "parses (--set lora=null --set kl_coef=0.01); verl: a verl override (--set trainer.total_epochs=1)",
    )
    _add_grpo_options(train)
    _add_apo_options(train)
    _add_run_options(train, store_help)
    train.set_defaults(func=cmd_train)


def _add_grpo_options(train: Any) -> None:
    """TorchGRPO's common settings as flags (the rest through --set)."""
    grpo = train.add_argument_group("grpo settings (TorchGRPO; see docs/training.md)")
    grpo.add_argument("--model", help="smollm2 (bundled, default), tiny (random, smoke tests), or a HF name/path")
    grpo.add_argument("--steps", type=int, help="most training steps (default: one epoch over --data)")
    grpo.add_argument("--group-size", type=int, help="rollouts per task, the GRPO group (default 4)")
    grpo.add_argument("--batch-tasks", type=int, help="tasks per step (default 8)")
    grpo.add_argument("--lr", type=float, help="AdamW learning rate (default 5e-4, for LoRA)")
    grpo.add_argument("--temperature", type=float, help="sampling temperature during training (default 1.0)")
    grpo.add_argument("--max-tokens", type=int, help="longest response per LLM call (default 256)")
    grpo.add_argument(
        "--minutes",
        type=float,
        help="wall-time budget of the whole command; training stops early enough for the final evaluation to fit",
    )


def _add_apo_options(train: Any) -> None:
    """APO's seed prompt, the two models and their keys."""
    apo = train.add_argument_group("apo settings (agl.APO; see docs/prompt-optimization.md)")
    apo.add_argument(
        "--prompt",
        help="the seed prompt (TEXT or @FILE), given to the agent as the PromptTemplate "
        "resource 'prompt'; str.format placeholders such as {question} are kept by every edit",
    )
    apo.add_argument("--llm-endpoint", help="the agent's model: an OpenAI-compatible base URL (resource 'main_llm')")
    apo.add_argument("--llm-model", help="the agent's model name at --llm-endpoint")
    apo.add_argument("--optimizer-endpoint", help="the model that critiques and edits the prompt: a base URL")
    apo.add_argument("--optimizer-model", help="the optimizer's model name")
    apo.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the API key "
        "sent to both endpoints, when set (default OPENAI_API_KEY); the agent's is stored with its "
        "resource 'main_llm' in the run's store",
    )
    apo.add_argument(
        "--optimizer-api-key-env",
        metavar="VAR",
        help="environment variable holding the optimizer's "
        "own API key (default: --api-key-env's): it is neither sent to the agent's endpoint nor stored",
    )


def _add_run_options(train: Any, store_help: str) -> None:
    """Where the run lives and how its rollouts run (every algorithm)."""
    train.add_argument(
        "--out", default=".agl/train", help="the run's folder: store, metrics, checkpoints (default .agl/train)"
    )
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    train.add_argument("--store", default=None, help=store_help.replace("$AGL_STORE or .agl/store.db", "OUT/store.db"))
    train.add_argument("--n-runners", type=int, default=16, help="agents run at once (default 16)")
    train.add_argument(
        "--runner-mode",
        choices=["thread", "process"],
        default="thread",
        help="thread (default: agents mostly wait on the model's HTTP endpoint) or process",
    )
    train.add_argument("--rollout-timeout", type=float, default=600.0, help="seconds before a rollout is retried")
    train.add_argument(
        "--span-retention-steps",
        type=int,
        default=None,
        metavar="N",
        help="keep the spans of the last N training steps only, deleting older ones (rollouts "
        "and rewards stay): bounds a long run's store (default: keep every span)",
    )
    train.add_argument(
        "--check",
        action="store_true",
        help="check the agent, data and settings (and for verl "
        "whether this machine can train them), then exit without training",
    )


def cmd_train(args: argparse.Namespace) -> int:
    import agl
    from agl.cli.common import json_setting, load_agent, load_tasks

    out = Path(args.out)
    if args.algorithm == "apo":
        check_apo_out(out, args.resume, args.check)
    check_out(out, args.resume, args.check)
    if args.agent_match:
        try:
            re.compile(args.agent_match)
        except re.error as exc:
            raise SystemExit(f"agl: --agent-match {args.agent_match!r} is not a regular expression: {exc}") from None
    if args.n_runners < 0:
        raise SystemExit("agl: --n-runners must be >= 0 (0: only runners on other machines, `agl runner`)")
    if not (is_finite_number(args.rollout_timeout) and args.rollout_timeout > 0):
        raise SystemExit(
            f"agl: --rollout-timeout must be a positive, finite number of seconds, got {args.rollout_timeout}"
        )
    if args.span_retention_steps is not None and args.span_retention_steps < 0:
        raise SystemExit(
            f"agl: --span-retention-steps must be >= 0 (the training steps whose spans are kept), got "
            f"{args.span_retention_steps}"
        )
    adapter = _adapter(args)
    agent = load_agent(args.agent)
    train_tasks = load_tasks(args.data)
    val_tasks = load_tasks(args.val_data) if args.val_data else None
    _check_task_ids(args.data, train_tasks)
    if args.val_data and val_tasks:
        _check_task_ids(args.val_data, val_tasks)
    config = json_setting(args.config, "--config", yaml_ok=args.algorithm == "verl") if args.config else {}
    resources = None
    if args.algorithm == "grpo":
        algorithm = _torch_grpo(args, config, out)
    elif args.algorithm == "verl":
        algorithm = _verl(args, config)
    else:
        algorithm, resources = apo_algorithm(args, config)
    print(f"agl train: {len(train_tasks)} training tasks, {len(val_tasks or [])} held-out tasks")
    if args.check:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    agl.instrument()
    trainer = agl.Trainer(
        algorithm=algorithm,
        store=args.store or str(out / "store.db"),
        adapter=adapter,
        n_runners=args.n_runners,
        runner_mode=args.runner_mode,
        rollout_timeout=args.rollout_timeout,
        initial_resources=resources,
        span_retention_steps=args.span_retention_steps,
    )
    if args.algorithm == "apo":
        return fit_apo(trainer, agent, train_tasks, val_tasks, out)
    with _train_log(out if args.algorithm == "grpo" else None) as log:
        try:
            result = trainer.fit(agent, train_tasks, val_dataset=val_tasks)
        except KeyboardInterrupt:  # Ctrl-C: one line that says what is left, not a traceback
            with no_second_interrupt():
                message = _interrupted(args, out)
                log(logging.WARNING, message)
                print(message, file=sys.stderr)
            return 130
        except Exception as exc:
            log(logging.ERROR, f"agl train: stopped: {exc}")
            raise
    if args.algorithm == "verl":  # TorchGRPO prints its own summary and curve
        for step in result.steps:
            print(json.dumps({"step": step.step, **{k: v for k, v in step.metrics.items() if k.startswith("agl/")}}))
    print(f"agl train: done; the run is in {out}")
    if args.algorithm == "grpo":
        print(f"agl train: the trained model as a Hugging Face folder: agl export-model {out} --out {out / 'model'}")
    return 0


def _interrupted(args: argparse.Namespace, out: Path) -> str:
    if args.algorithm != "grpo":
        return f"agl train: interrupted; the run's store is {args.store or out / 'store.db'}"
    resume = (
        with_resume(["agl", *sys.argv[1:]])
        if sys.argv[1:2] == ["train"]
        else "the same agl train command with --resume"
    )
    return interrupted_message("agl train", out, resume)


@contextlib.contextmanager
def _train_log(out: Optional[Path]) -> Iterator[Callable[[int, str], None]]:
    """Append agl's warnings to ``OUT/train.log`` for the whole run: the trainer's own log handler covers only
    its steps, not its start (a resume's "cancelled N rollouts") nor the error that ends it. Yields a function
    that writes one more line there (the interruption, the error that stopped the run)."""
    if out is None:
        yield lambda level, message: None
        return
    path = out / "train.log"
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("agl")

    def not_twice(record: logging.LogRecord) -> bool:  # the trainer's handler writes to the same file meanwhile
        return not any(
            h is not handler and os.path.abspath(getattr(h, "baseFilename", "")) == handler.baseFilename
            for h in root.handlers
        )

    handler.addFilter(not_twice)
    root.addHandler(handler)

    def write(level: int, message: str) -> None:
        handler.handle(logging.LogRecord("agl.train", level, __file__, 0, message, None, None))

    try:
        yield write
    finally:
        root.removeHandler(handler)
        handler.close()


def _check_task_ids(path: str, tasks: Sequence[Any]) -> None:
    """What the trainer checks of the tasks before its first step (one id, one task), checked here too, so
    that --check finds it and the run does not end in a traceback after its setup."""
    from agl.runtime.dataset import as_tasks

    try:
        as_tasks(tasks)
    except ValueError as exc:
        raise SystemExit(f"agl: {path}: {exc}") from None


#: settings of the run's files and resuming: ``agl train`` decides them from --out and --resume
_OUT_OWNED = {
    "output_dir": "everything the run writes (metrics.csv, train.log, checkpoints, store) goes under --out: "
    "choose --out instead",
    "checkpoint_dir": "the checkpoints go to OUT/checkpoints: choose --out instead",
    "resume": "pass --resume to continue the run in --out; to start afresh, choose another --out (or delete "
    "the folder): a run's checkpoints and metrics are never overwritten",
}


def _lora_fields_problem(user: Mapping[str, Any]) -> List[str]:
    """peft's own objection to a ``lora`` dict whose values looked fine (an unknown field such as ``rr``), on
    the way out with other bad settings: otherwise it would come only once those are fixed. Imports peft (and
    torch), which a run with good settings does anyway."""
    lora = user.get("lora")
    if not isinstance(lora, dict) or any(p.startswith("lora=") for p in json_problems({"lora": lora})):
        return []
    try:
        from agl.algorithm.trainable import lora_config

        lora_config(lora)
    except ImportError:
        return []  # said when the run loads the trainer
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    return []


def _torch_grpo(args: argparse.Namespace, config: Dict[str, Any], out: Path) -> Any:
    sets = keyword_sets(args.settings)  # a malformed flag is named before torch is even imported
    user = {**config, **sets}
    owned = [
        f"agl: {'--set' if key in sets else '--config'} {key}: {_OUT_OWNED[key]}" for key in _OUT_OWNED if key in user
    ]
    if owned:
        raise SystemExit("\n".join(owned))
    for name in GRPO_FLAGS:
        value = getattr(args, name)
        if value is not None:
            user[name] = value
    problems = json_problems(user)
    if problems:
        problems += _lora_fields_problem(user)  # every bad setting at once, also the LoRA fields only peft knows
        problems[-1] += " (TorchGRPO's settings: docs/training.md)"
        raise SystemExit("\n".join(f"agl: bad grpo settings: {p}" for p in problems))
    settings: Dict[str, Any] = {"output_dir": out, "checkpoint_dir": out / "checkpoints", "resume": args.resume}
    settings.update(user)
    if args.minutes is not None:
        check_minutes(args.minutes)
        settings["time_budget_s"] = round(args.minutes * 60 - (time.monotonic() - _STARTED) - _SUMMARY_RESERVE_S, 1)
    try:
        from agl.algorithm.torch_grpo import TorchGRPO
    except ImportError as exc:
        raise SystemExit(f'agl: the grpo trainer needs torch: pip install "agl[torch]" ({exc})') from None
    try:
        if user.get("lora") is not None:  # peft's own check of the fields, which the run would make after loading
            from agl.algorithm.trainable import lora_config

            lora_config(user["lora"])
        algorithm = TorchGRPO(**settings)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"agl: bad grpo settings: {exc} (TorchGRPO's settings: docs/training.md)") from None
    shown = {k: v for k, v in settings.items() if k not in _OUT_OWNED}
    print("agl train: TorchGRPO(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")")
    return algorithm


def check_minutes(minutes: float, prog: str = "agl") -> None:
    """``--minutes`` (``agl train``, the main job) must be a positive, finite number: NaN would be no budget at
    all (every comparison with it is false), and infinity is better said by leaving the flag out."""
    if not (math.isfinite(minutes) and minutes > 0):
        raise SystemExit(
            f"{prog}: --minutes must be a positive, finite number of minutes, got {minutes} (leave it "
            "out for no time budget)"
        )


def _adapter(args: argparse.Namespace) -> Any:
    """The Trainer's adapter settings from ``--agent-match`` and ``--adapter``, checked now (so ``--check``
    catches a bad one) but handed over as a dict: the verl algorithm fills in its own estimator where the
    settings name none. None for the defaults."""
    return adapter_settings(args.adapter_settings, args.agent_match) or None


def _verl(args: argparse.Namespace, config: Dict[str, Any]) -> Any:
    grpo_only = grpo_flags_given(args)
    if grpo_only:
        instead = [
            f"--set {_VERL_KEYS[name]}={getattr(args, name)}"
            if name in _VERL_KEYS
            else "trainer.total_epochs or trainer.total_training_steps instead of --minutes"
            for name in (*GRPO_FLAGS, "minutes")
            if getattr(args, name) is not None
        ]
        raise SystemExit(
            f"agl: {', '.join(grpo_only)} set TorchGRPO; with --algorithm verl use verl's keys instead: "
            + "; ".join(instead)
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
