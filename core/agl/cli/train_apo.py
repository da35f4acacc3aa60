"""``agl train --algorithm apo``: APO optimizes the agent's prompt (the ``prompt`` resource) with an optimizer
model, from the apo flags; its best prompt and every prompt tried are saved under ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

from agl.cli.run_folder import has_rollouts, no_second_interrupt
from agl.cli.train_settings import grpo_flags_given, keyword_sets


def apo_algorithm(args: argparse.Namespace, config: Dict[str, Any]) -> Any:
    """APO and the resources it starts from: the seed prompt and the agent's model, from the apo flags."""
    from agl.algorithm.apo import APO
    from agl.cli.common import prompt_setting
    from agl.types import LLM, PromptTemplate

    if grpo_flags_given(args):
        raise SystemExit(
            f"agl: {', '.join(grpo_flags_given(args))} set TorchGRPO; --algorithm apo changes no weights "
            "(its settings: --set beam_width=N --set rounds=N ...)"
        )
    missing = [
        flag
        for flag in ("prompt", "llm_endpoint", "llm_model", "optimizer_endpoint", "optimizer_model")
        if not getattr(args, flag)
    ]
    if missing:
        raise SystemExit(
            "agl: --algorithm apo needs "
            + ", ".join("--" + m.replace("_", "-") for m in missing)
            + " (the seed prompt, the agent's model, and the model that edits the prompt)"
        )
    prompt = prompt_setting(args.prompt)
    api_key = os.environ.get(args.api_key_env) or None
    optimizer_key = (os.environ.get(args.optimizer_api_key_env) or None) if args.optimizer_api_key_env else api_key
    settings = {**config, **keyword_sets(args.settings)}
    try:
        algorithm: APO[Any] = APO(
            LLM(endpoint=args.optimizer_endpoint, model=args.optimizer_model, api_key=optimizer_key), **settings
        )
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"agl: bad apo settings: {exc} (APO's settings: docs/prompt-optimization.md)") from None
    resources = {
        "main_llm": LLM(endpoint=args.llm_endpoint, model=args.llm_model, api_key=api_key),
        "prompt": PromptTemplate(template=prompt),
    }
    print("agl train: APO(" + ", ".join(f"{k}={v!r}" for k, v in settings.items()) + ")")
    return algorithm, resources


def check_apo_out(out: Path, resume: bool, check: bool) -> None:
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
    if has_rollouts(out / "store.db"):
        raise SystemExit(
            f"agl: {out} already holds an APO run that saved no prompt: choose another --out (or delete the folder)"
        )


def fit_apo(trainer: Any, agent: Any, train_tasks: Any, val_tasks: Any, out: Path) -> int:
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
    history = [
        {"template": c.template, "score": c.score, "round": c.round, "parent": c.parent, "critique": c.critique}
        for c in result.history
    ]
    (out / "apo_history.json").write_text(json.dumps(history, indent=2))
    print(
        f"agl train: best prompt scores {result.best.score:.3f} (seed {result.seed.score:.3f}); "
        f"{len(result.history)} prompts tried; saved to {out / 'best_prompt.txt'}\n{result.best.template}"
    )
    return True
