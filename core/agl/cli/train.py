"""``agl train``: train an agent from the command line, with TorchGRPO (CPU or one GPU), VERL (GPUs), or
optimize its prompt with APO (any OpenAI-compatible models).

The same run as a Python script with ``Trainer(algorithm=..., adapter=...).fit(agent, train, val_dataset=val)``;
the command exists so that a user can go from ``agl dev`` (does my agent run?) to training without writing
that script. Everything the algorithms accept stays reachable: the common TorchGRPO settings have flags,
any other keyword goes through ``--set KEY=VALUE`` or ``--config``, and for VERL ``--set`` takes verl's own
dotted overrides; for APO, ``--set`` takes APO's keywords. A run's files (store, metrics, checkpoints) live under ``--out``; an ``--out`` that
already holds a run is resumed only with ``--resume``, never silently overwritten or mixed into.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from agl.checks import is_finite_number

_STARTED = time.monotonic()  # --minutes counts the whole command, imports included, as the main job does
_SUMMARY_RESERVE_S = 15.0  # left of --minutes for the summary and shutting down

# TorchGRPO keywords that have their own flag (dest name == keyword)
_GRPO_FLAGS = ("model", "steps", "group_size", "batch_tasks", "lr", "temperature", "max_tokens")
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
        "  agl train examples/main_job/langgraph_math_agent.py:math_agent --data examples/data/main_job_train.jsonl \\\n"
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
    train.add_argument("--data", required=True, help="training tasks: .jsonl (one per line), .json (a list), .parquet or .csv")
    train.add_argument("--val-data", help="held-out tasks, evaluated before and after training")
    train.add_argument("--agent-match", help="regex on agent names: only their LLM calls are trained (default: all)")
    train.add_argument("--adapter", dest="adapter_settings", action="append", default=[], metavar="KEY=VALUE",
                       help="a LightningRL setting (repeatable; docs/lightningrl.md), the value read as JSON when it "
                       "parses: --adapter credit=discounted --adapter gamma=0.9 --adapter aggregate=true "
                       "--adapter 'air={\"tool_error\": -0.5}'")
    train.add_argument("--algorithm", choices=["grpo", "verl", "apo"], default="grpo")
    train.add_argument("--config", help="algorithm settings: a JSON object or @file (.json; .yaml too for verl); "
                       "grpo: TorchGRPO keywords, verl: verl's config keys, apo: APO keywords")
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
    apo = train.add_argument_group("apo settings (agl.APO; see docs/prompt-optimization.md)")
    apo.add_argument("--prompt", help="the seed prompt (TEXT or @FILE), given to the agent as the PromptTemplate "
                     "resource 'prompt'; str.format placeholders such as {question} are kept by every edit")
    apo.add_argument("--llm-endpoint", help="the agent's model: an OpenAI-compatible base URL (resource 'main_llm')")
    apo.add_argument("--llm-model", help="the agent's model name at --llm-endpoint")
    apo.add_argument("--optimizer-endpoint", help="the model that critiques and edits the prompt: a base URL")
    apo.add_argument("--optimizer-model", help="the optimizer's model name")
    apo.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key "
                     "sent to both endpoints, when set (default OPENAI_API_KEY); the agent's is stored with its "
                     "resource 'main_llm' in the run's store")
    apo.add_argument("--optimizer-api-key-env", metavar="VAR", help="environment variable holding the optimizer's "
                     "own API key (default: --api-key-env's): it is neither sent to the agent's endpoint nor stored")
    train.add_argument("--out", default=".agl/train", help="the run's folder: store, metrics, checkpoints "
                       "(default .agl/train)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    train.add_argument("--store", default=None, help=store_help.replace("$AGL_STORE or .agl/store.db", "OUT/store.db"))
    train.add_argument("--n-runners", type=int, default=16, help="agents run at once (default 16)")
    train.add_argument("--runner-mode", choices=["thread", "process"], default="thread",
                       help="thread (default: agents mostly wait on the model's HTTP endpoint) or process")
    train.add_argument("--rollout-timeout", type=float, default=600.0, help="seconds before a rollout is retried")
    train.add_argument("--span-retention-steps", type=int, default=None, metavar="N",
                       help="keep the spans of the last N training steps only, deleting older ones (rollouts "
                       "and rewards stay): bounds a long run's store (default: keep every span)")
    train.add_argument("--check", action="store_true", help="check the agent, data and settings (and for verl "
                       "whether this machine can train them), then exit without training")
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    import agl
    from agl.cli.common import json_setting, load_agent, load_tasks

    out = Path(args.out)
    if args.algorithm == "apo":
        _check_apo_out(out, args.resume, args.check)
    check_out(out, args.resume, args.check)
    if args.agent_match:
        try:
            re.compile(args.agent_match)
        except re.error as exc:
            raise SystemExit(f"agl: --agent-match {args.agent_match!r} is not a regular expression: {exc}") from None
    if args.n_runners < 0:
        raise SystemExit("agl: --n-runners must be >= 0 (0: only runners on other machines, `agl runner`)")
    if not (is_finite_number(args.rollout_timeout) and args.rollout_timeout > 0):
        raise SystemExit(f"agl: --rollout-timeout must be a positive, finite number of seconds, got {args.rollout_timeout}")
    if args.span_retention_steps is not None and args.span_retention_steps < 0:
        raise SystemExit(f"agl: --span-retention-steps must be >= 0 (the training steps whose spans are kept), got "
                         f"{args.span_retention_steps}")
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
        algorithm, resources = _apo(args, config)
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
        return _fit_apo(trainer, agent, train_tasks, val_tasks, out)
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


@contextlib.contextmanager
def no_second_interrupt() -> Iterator[None]:
    """A Ctrl-C pressed again while the message is written does not turn it into a traceback."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(args: argparse.Namespace, out: Path) -> str:
    if args.algorithm != "grpo":
        return f"agl train: interrupted; the run's store is {args.store or out / 'store.db'}"
    resume = with_resume(["agl", *sys.argv[1:]]) if sys.argv[1:2] == ["train"] \
        else "the same agl train command with --resume"
    return interrupted_message("agl train", out, resume)


def with_resume(command: Sequence[str]) -> str:
    """``command`` (the words the user ran) as one shell line that continues its run: with ``--resume`` once."""
    return shlex.join([*(word for word in command if word != "--resume"), "--resume"])


def interrupted_message(prog: str, out: Path, resume: str) -> str:
    """The line a Ctrl-C'd TorchGRPO run in ``out`` ends with (``agl train``, the main job): where the run is
    and how to go on (``resume``: the command with ``--resume``). Only a checkpoint can be continued; a run
    stopped before its first one but after its start wrote into ``out`` is refused a plain rerun
    (:func:`check_out`), so it is started afresh there with ``--resume``, which finds no checkpoint."""
    if (out / "checkpoints" / "latest").exists():
        return (f"{prog}: interrupted; the run so far is in {out} (checkpoints in {out / 'checkpoints'}, metrics "
                f"in {out / 'metrics.csv'}); continue it from its last checkpoint with: {resume}")
    if holds_run(out):
        return (f"{prog}: interrupted before the first checkpoint, so no training is kept; {out} holds the run's "
                f"start (store, log): start it again from the untrained model with: {resume}")
    return f"{prog}: interrupted before the first step; nothing to resume in {out}: run the command again"


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


def check_out(out: Path, resume: bool, check: bool, prog: str = "agl") -> None:
    """Refuse to start a fresh run in a folder that holds one: its checkpoints would be resumed, its metrics
    and rollouts mixed with the new run's. Nothing is deleted here; the user decides. ``agl train`` and the
    main job (``prog`` starts the message) both call it."""
    if check:  # --check writes nothing
        return
    held = holds_run(out)
    if resume and not held:
        raise SystemExit(f"{prog}: --resume: {out} holds no run to continue (no checkpoints, metrics or store there)")
    if held and not resume:
        raise SystemExit(
            f"{prog}: {out} already holds a training run: pass --resume to continue it, or choose another --out "
            "(or delete the folder)"
        )


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds a training run. A store with no rollout is none (a start that failed before its
    first step, e.g. on a model name that does not exist)."""
    return out.is_dir() and (
        any((out / name).exists() for name in ("checkpoints", "metrics.csv")) or _has_rollouts(out / "store.db")
    )


def _has_rollouts(db: Path) -> bool:
    if not db.exists():
        return False
    from agl.store import SqliteLightningStore

    with SqliteLightningStore(db) as store:
        return sum(store.stats().rollouts.values()) > 0


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
    if not isinstance(lora, dict) or any(p.startswith("lora=") for p in grpo_setting_problems({"lora": lora})):
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
    sets = _keyword_sets(args.settings)  # a malformed flag is named before torch is even imported
    user = {**config, **sets}
    owned = [f"agl: {'--set' if key in sets else '--config'} {key}: {_OUT_OWNED[key]}" for key in _OUT_OWNED
             if key in user]
    if owned:
        raise SystemExit("\n".join(owned))
    for name in _GRPO_FLAGS:
        value = getattr(args, name)
        if value is not None:
            user[name] = value
    problems = grpo_setting_problems(user)
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
        raise SystemExit(f"{prog}: --minutes must be a positive, finite number of minutes, got {minutes} (leave it "
                         "out for no time budget)")


# What each TorchGRPO keyword takes from --set / --config (JSON values), checked before torch is imported and
# before any training, so that --check finds a wrong type or range. tests/with_torch/test_train_cli_checks.py
# keeps this table equal to TorchGRPO's signature.
_INT, _NUM, _STR, _OBJ = "int", "number", "str", "object"
_GRPO_SPEC: Dict[str, Any] = {
    # name: (kind, lowest allowed or None, lowest exclusive?, None allowed?, note)
    "model": (_STR, None, False, False, "smollm2, tiny, or a Hugging Face name or path"),
    "lora": (_OBJ, None, False, True, 'LoraConfig fields such as {"r": 8}, or null for full fine-tuning'),
    "lr": (_NUM, 0, True, False, ""),
    "group_size": (_INT, 1, False, False, ""),
    "batch_tasks": (_INT, 1, False, False, ""),
    "steps": (_INT, 0, False, True, "null: as many as `epochs` passes over --data take"),
    "epochs": (_INT, 1, False, False, ""),
    "ppo_epochs": (_INT, 1, False, False, ""),
    "micro_batch_size": (_INT, 1, False, False, ""),
    "grad_accum": (_INT, 1, False, True, ""),
    "clip_eps": (_NUM, 0, True, False, ""),
    "kl_coef": (_NUM, 0, False, False, ""),
    "max_grad_norm": (_NUM, 0, True, False, ""),
    "old_logprobs": (("sample", "recompute"), None, False, False, ""),
    "temperature": (_NUM, 0, True, False, ""),
    "max_tokens": (_INT, 1, False, False, ""),
    "sampling": (_OBJ, None, False, True, 'e.g. {"top_p": 0.9}'),
    "val_sampling": (_OBJ, None, False, True, 'e.g. {"temperature": 0.0}'),
    "extra_evals": (_OBJ, None, False, True, 'names to sampling settings, e.g. {"greedy": {"temperature": 0.0}}'),
    "success_threshold": (_NUM, None, False, False, "the reward that counts as a success"),
    "eval_every": (_INT, 0, False, False, "0: evaluate only before and after training"),
    "time_budget_s": (_NUM, 0, True, True, "or --minutes"),
    "checkpoint_every": (_INT, 1, False, False, ""),
    "seed": (_INT, None, False, False, ""),
    "device": (_STR, None, False, True, "cpu, cuda, cuda:1 ..."),
    "dtype": (_STR, None, False, True, "float32, bfloat16 or float16"),
    "torch_threads": (_INT, 1, False, True, ""),
    "server_batch_size": (_INT, 1, False, False, ""),
    "server_host": (_STR, None, False, False, ""),
    "server_port": (_INT, 0, False, False, "0 picks a free port"),
    "server_url": (_STR, None, False, True, ""),
    "model_name": (_STR, None, False, False, ""),
    "resource_name": (_STR, None, False, False, ""),
}
#: TorchGRPO keywords that only the Python API can set
_PYTHON_ONLY = {"on_step": "a Python callable: only the Python API sets it, TorchGRPO(on_step=...)"}
#: LoraConfig fields whose type is checked before peft (and torch) is imported
_LORA_SPEC = {
    "r": (_INT, 1, False, False, ""),
    "lora_alpha": (_NUM, 0, True, False, ""),
    "lora_dropout": (_NUM, 0, False, False, "a fraction below 1"),
}


def grpo_setting_problems(settings: Mapping[str, Any]) -> List[str]:
    """One line per TorchGRPO setting whose name, type or range is wrong (name, value, what it takes),
    without importing torch; empty when all are fine."""
    problems = []
    for key, value in settings.items():
        if key in _PYTHON_ONLY:
            problems.append(f"{key}={value!r}: {_PYTHON_ONLY[key]}")
        elif key not in _GRPO_SPEC:
            problems.append(f"{key}={value!r}: TorchGRPO has no setting {key!r}")
        else:
            wrong = _wrong(value, *_GRPO_SPEC[key])
            if wrong:
                problems.append(f"{key}={value!r}: {wrong}")
            elif key == "lora" and value is not None:
                problems.extend(f"lora={value!r}: {field} {wrong}" for field, wrong in _lora_problems(value))
            elif key == "extra_evals" and value is not None:
                problems.extend(
                    f"extra_evals={value!r}: {name!r} must map to an object of sampling settings"
                    for name, inner in value.items() if not isinstance(inner, dict)
                )
    return problems


def _lora_problems(lora: Mapping[str, Any]) -> List[Tuple[str, str]]:
    out = []
    for field, spec in _LORA_SPEC.items():
        if field in lora:
            wrong = _wrong(lora[field], *spec)
            if wrong:
                out.append((field, f"{lora[field]!r}: {wrong}"))
    if isinstance(lora.get("lora_dropout"), (int, float)) and not isinstance(lora["lora_dropout"], bool) \
            and lora["lora_dropout"] >= 1:
        out.append(("lora_dropout", f"{lora['lora_dropout']!r}: expected a fraction below 1"))
    target = lora.get("target_modules")
    if "target_modules" in lora and target is not None and not isinstance(target, str) and not (
        isinstance(target, list) and all(isinstance(t, str) for t in target)
    ):
        out.append(("target_modules", f"{target!r}: expected a module name, a list of names, or \"all-linear\""))
    return out


def _wrong(value: Any, kind: Any, low: Optional[float], exclusive: bool, nullable: bool, note: str) -> str:
    """What ``value`` should be instead, or "" when it fits."""
    if isinstance(kind, tuple):
        expected = "one of " + ", ".join(map(repr, kind))
    else:
        expected = {_INT: "a whole number", _NUM: "a finite number", _STR: "text", _OBJ: "a JSON object"}[kind]
    if low is not None:
        expected += f" {'>' if exclusive else '>='} {low}"
    if nullable:
        expected += " or null"
    if note:
        expected += f" ({note})"
    if value is None:
        return "" if nullable else f"expected {expected}"
    if isinstance(kind, tuple):
        ok = value in kind
    elif kind == _INT:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == _NUM:
        ok = is_finite_number(value)
    elif kind == _STR:
        ok = isinstance(value, str) and bool(value.strip())
    else:
        ok = isinstance(value, dict)
    if ok and low is not None:
        ok = value > low if exclusive else value >= low
    return "" if ok else f"expected {expected}"


def _adapter(args: argparse.Namespace) -> Any:
    """The Trainer's adapter settings from ``--agent-match`` and ``--adapter``, checked now (so ``--check``
    catches a bad one) but handed over as a dict: the verl algorithm fills in its own estimator where the
    settings name none. None for the defaults."""
    return adapter_settings(args.adapter_settings, args.agent_match) or None


def adapter_settings(
    items: Sequence[str], agent_match: Optional[str], base: Optional[Mapping[str, Any]] = None
) -> Dict[str, Any]:
    """LightningRL settings as ``agl train`` and ``agl export`` take them: ``base`` (``--config``), then each
    ``--adapter KEY=VALUE``, then ``--agent-match``; checked by ``LightningRL.from_config``, a bad one exits
    with its name."""
    from agl.lightningrl import LightningRL

    settings = {**(base or {}), **_keyword_sets(items, "--adapter")}
    if agent_match:
        settings["agent_match"] = agent_match
    if settings:
        try:
            LightningRL.from_config(settings)
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"agl: bad LightningRL settings: {exc} (see docs/lightningrl.md)") from None
    return settings


def _keyword_sets(settings: Sequence[str], flag: str = "--set") -> Dict[str, Any]:
    """``--set key=value`` for TorchGRPO or APO (and ``--adapter`` for LightningRL): the value as JSON when it
    parses (numbers, null, lists), else text."""
    result: Dict[str, Any] = {}
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"agl: {flag} {item!r} must look like KEY=VALUE")
        try:
            result[key.strip()] = json.loads(raw)
        except ValueError:
            result[key.strip()] = raw
    return result


def _grpo_only(args: argparse.Namespace) -> Sequence[str]:
    return [f"--{name.replace('_', '-')}" for name in (*_GRPO_FLAGS, "minutes") if getattr(args, name) is not None]


def _apo(args: argparse.Namespace, config: Dict[str, Any]) -> Any:
    """APO and the resources it starts from: the seed prompt and the agent's model, from the apo flags."""
    from agl.algorithm.apo import APO
    from agl.cli.common import prompt_setting
    from agl.types import LLM, PromptTemplate

    if _grpo_only(args):
        raise SystemExit(f"agl: {', '.join(_grpo_only(args))} set TorchGRPO; --algorithm apo changes no weights "
                         "(its settings: --set beam_width=N --set rounds=N ...)")
    missing = [flag for flag in ("prompt", "llm_endpoint", "llm_model", "optimizer_endpoint", "optimizer_model")
               if not getattr(args, flag)]
    if missing:
        raise SystemExit("agl: --algorithm apo needs " + ", ".join("--" + m.replace("_", "-") for m in missing)
                         + " (the seed prompt, the agent's model, and the model that edits the prompt)")
    prompt = prompt_setting(args.prompt)
    api_key = os.environ.get(args.api_key_env) or None
    optimizer_key = (os.environ.get(args.optimizer_api_key_env) or None) if args.optimizer_api_key_env else api_key
    settings = {**config, **_keyword_sets(args.settings)}
    try:
        algorithm = APO(LLM(endpoint=args.optimizer_endpoint, model=args.optimizer_model, api_key=optimizer_key),
                        **settings)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"agl: bad apo settings: {exc} (APO's settings: docs/prompt-optimization.md)") from None
    resources = {
        "main_llm": LLM(endpoint=args.llm_endpoint, model=args.llm_model, api_key=api_key),
        "prompt": PromptTemplate(template=prompt),
    }
    print("agl train: APO(" + ", ".join(f"{k}={v!r}" for k, v in settings.items()) + ")")
    return algorithm, resources


def _check_apo_out(out: Path, resume: bool, check: bool) -> None:
    """APO keeps no checkpoints: ``--resume`` would search again from ``--prompt`` and replace the saved
    results, maybe with worse ones. The way to go on is a new run seeded with the best prompt. A folder that
    holds APO results (its store may be elsewhere, ``--store``) or rollouts is not written into either."""
    go_on = f"start a new --out seeded with the best prompt so far: --prompt @{out / 'best_prompt.txt'}"
    if resume:
        raise SystemExit(f"agl: --resume: an APO run keeps no checkpoints and cannot be continued; {go_on}")
    if check:  # --check writes nothing
        return
    saved = [name for name in ("best_prompt.txt", "apo_history.json") if (out / name).exists()]
    if saved:
        raise SystemExit(f"agl: {out} already holds the results of an APO run ({', '.join(saved)}); {go_on}")
    if _has_rollouts(out / "store.db"):
        raise SystemExit(f"agl: {out} already holds an APO run that saved no prompt: choose another --out (or "
                         "delete the folder)")


def _fit_apo(trainer: Any, agent: Any, train_tasks: Any, val_tasks: Any, out: Path) -> int:
    """Run APO and save its prompts; whatever stops it early (the optimizer failing, Ctrl-C) still leaves the
    best so far in ``out``."""
    from agl.algorithm.apo import APOError

    go_on = f"run again with a new --out and --prompt @{out / 'best_prompt.txt'} to search further"
    try:
        result = trainer.fit(agent, train_tasks, val_dataset=val_tasks)
    except KeyboardInterrupt:  # Ctrl-C: save what was scored, one line, no traceback
        with no_second_interrupt():
            if _save_apo(trainer.algorithm.result, out):
                print(f"agl train: interrupted; the best prompt so far is saved; {go_on}", file=sys.stderr)
            else:
                print("agl train: interrupted before the seed prompt was scored; nothing to save", file=sys.stderr)
        return 130
    except Exception as exc:
        saved = _save_apo(trainer.algorithm.result, out)
        if not (saved and isinstance(exc, APOError)):
            raise
        print(f"agl train: APO stopped early: {exc}. The best prompt so far is saved; {go_on}", file=sys.stderr)
        return 1
    _save_apo(result, out)
    print(f"agl train: done; the run is in {out}")
    return 0


def _save_apo(result: Any, out: Path) -> bool:
    """The best prompt as text, and every prompt tried with its score, under ``out``; False when no prompt
    was scored (``result`` None or empty), and nothing is written."""
    if result is None or not result.history:
        return False
    (out / "best_prompt.txt").write_text(result.best.template)
    history = [{"template": c.template, "score": c.score, "round": c.round, "parent": c.parent,
                "critique": c.critique} for c in result.history]
    (out / "apo_history.json").write_text(json.dumps(history, indent=2))
    print(f"agl train: best prompt scores {result.best.score:.3f} (seed {result.seed.score:.3f}); "
          f"{len(result.history)} prompts tried; saved to {out / 'best_prompt.txt'}\n{result.best.template}")
    return True


def _verl(args: argparse.Namespace, config: Dict[str, Any]) -> Any:
    grpo_only = _grpo_only(args)
    if grpo_only:
        instead = [
            f"--set {_VERL_KEYS[name]}={getattr(args, name)}" if name in _VERL_KEYS else "trainer.total_epochs or "
            "trainer.total_training_steps instead of --minutes"
            for name in (*_GRPO_FLAGS, "minutes") if getattr(args, name) is not None
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


def add_export_model_parser(sub: Any) -> None:
    """``agl export-model RUN|CHECKPOINT --out DIR [--model M]``: the trained policy as an HF model folder."""
    export = sub.add_parser(
        "export-model",
        help="write a TorchGRPO checkpoint's trained policy as a Hugging Face model folder (LoRA merged)",
        description="Merge a checkpoint's training (LoRA adapter or full weights) into its base model and save "
        "config, safetensors weights and tokenizer to --out, for vLLM, transformers or `agl serve --model DIR`.",
    )
    export.add_argument("checkpoint", help="an `agl train --out` folder, a checkpoint_dir, or one step-NNNNNN folder")
    export.add_argument("--out", required=True, help="the folder to write (must be new or empty)")
    export.add_argument("--model", help="the base model (default: the one the checkpoint was trained from)")
    export.add_argument("--dtype", default=None, help="float32 (default), bfloat16 or float16")
    export.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")
    export.set_defaults(func=cmd_export_model)


def cmd_export_model(args: argparse.Namespace) -> int:
    from agl.algorithm.model_export import MANIFEST, export_model

    out = export_model(args.checkpoint, args.out, model=args.model, dtype=args.dtype, overwrite=args.overwrite)
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    print(f"agl export-model: step {manifest['step']} of {manifest['checkpoint']} ({manifest['base_model']}) -> {out}")
    print(f"serve it with: agl serve --model {out}")
    return 0
