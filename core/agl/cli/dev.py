"""``agl dev``: run an agent once per task with the current model, no training, and print a table.

Its rollouts are stored with mode ``dev``: a look at the agent, not training data. ``agl export`` reads
training rollouts by default and leaves them out; ``agl export --mode dev`` exports them."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Iterator, Optional

from agl.cli.common import (
    STORE_HELP,
    load_agent,
    load_tasks,
    non_negative_int,
    positive_int,
    prompt_setting,
    store_argument,
)


def add_dev_parser(sub: Any) -> None:
    dev = sub.add_parser("dev", help="run an agent on a dataset with the current model, no training")
    dev.add_argument("agent", help="MODULE:NAME or path/to/file.py:NAME (a LitAgent or a rollout function)")
    dev.add_argument("--data", required=True, help="tasks: .jsonl (one per line), .json (a list), .parquet or .csv")
    dev.add_argument(
        "--n-runners",
        type=non_negative_int,
        default=2,
        help="runners to start here (default 2; 0: only runners started elsewhere, by agl runner)",
    )
    dev.add_argument("--runner-mode", choices=["process", "thread"], default="process")
    dev.add_argument("--store", default=None, help=STORE_HELP)
    dev.add_argument("--endpoint", help="OpenAI-compatible base URL the agent should use (main_llm)")
    dev.add_argument("--model", help="model name to ask the endpoint for")
    dev.add_argument("--api-key", default=None)
    dev.add_argument("--fake-model", action="store_true", help="serve agl's scripted fake model locally and use it")
    dev.add_argument("--limit", type=positive_int, metavar="N", help="run only the first N tasks")
    dev.add_argument(
        "--prompt",
        help="a PromptTemplate resource 'prompt' for the agent: TEXT or @FILE (e.g. the "
        "best_prompt.txt of `agl train --algorithm apo`)",
    )
    dev.set_defaults(func=cmd_dev)


@contextlib.contextmanager
def _endpoint(args: argparse.Namespace) -> Iterator[Optional[dict]]:
    """The initial resources for ``dev``: a given endpoint, or agl's built-in scripted fake model."""
    from agl.types import LLM

    if args.fake_model:
        from agl.testing import FakeOpenAIServer

        with FakeOpenAIServer(always_token_ids=True) as server:
            yield {"main_llm": LLM(endpoint=server.base_url, model=args.model or "fake-model")}
    elif args.endpoint:
        yield {"main_llm": LLM(endpoint=args.endpoint, model=args.model or "default", api_key=args.api_key)}
    else:
        yield None


def cmd_dev(args: argparse.Namespace) -> int:
    import agl

    agent = load_agent(args.agent)
    data = load_tasks(args.data)
    if args.limit is not None:
        data = data[: args.limit]
    prompt = prompt_setting(args.prompt) if args.prompt is not None else None
    agl.instrument()
    with _endpoint(args) as resources:
        if prompt is not None:
            resources = {**(resources or {}), "prompt": agl.PromptTemplate(template=prompt)}
        trainer = agl.Trainer(
            n_runners=args.n_runners,
            store=args.store,
            initial_resources=resources,
            runner_mode=args.runner_mode,
        )
        if args.n_runners == 0:
            _say_runners_are_awaited(args, trainer.store)
        rows = trainer.dev(agent, data, mode="dev")  # not training data: `agl export` leaves them out unasked
    where = f" --store {store_argument(args.store)}" if args.store else ""
    print(f"inspect one: agl inspect {rows[0].rollout_id}{where}" if rows else "no tasks")
    return 0 if all(r.status == "succeeded" for r in rows) else 1


def _say_runners_are_awaited(args: argparse.Namespace, store: Any) -> None:
    """``--n-runners 0``: nothing runs the rollouts here, so ``dev`` waits for runners started elsewhere; say so
    at once, with the command that starts one (else the wait is silent for a minute, then only a warning).
    A store in memory can never get such a runner: refused."""
    from agl.store import InMemoryLightningStore

    if isinstance(store, InMemoryLightningStore):
        raise SystemExit(
            "agl: --n-runners 0 waits for runners started elsewhere, which cannot reach a store in "
            "memory: pass --store FILE.db (or a store server's http://...), or --n-runners 1 or more"
        )
    where = store_argument(getattr(store, "path", None) or args.store or os.environ.get("AGL_STORE") or "")
    local = " on this machine (--fake-model's server listens on 127.0.0.1)" if args.fake_model else ""
    print(
        f"agl dev: --n-runners 0: no runner starts here; waiting for runners started elsewhere{local}, e.g. in "
        f"another terminal: agl runner --store {where} --agent {args.agent}",
        file=sys.stderr,
        flush=True,
    )
