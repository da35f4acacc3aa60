"""``agl inspect`` (a rollout's span tree) and ``agl store rollouts|stats|prune`` (look into a store, delete
old spans); ``agl store serve`` is in :mod:`agl.cli.remote`."""

from __future__ import annotations

import argparse
import re
from typing import Any, List, Optional, Tuple

from agl.cli.common import FINISHED, STORE_HELP, UNFINISHED, existing_store, non_negative_int
from agl.runtime.span_retention import delete_spans_in_batches


def add_inspect_parser(sub: Any) -> None:
    inspect_ = sub.add_parser("inspect", help="print a rollout's span tree")
    inspect_.add_argument("rollout_id")
    inspect_.add_argument("--attempt", default="latest", help="attempt id, 'latest' (default) or 'all'")
    inspect_.add_argument(
        "--text", action="store_true", help="also print each LLM call's prompt and response, each tool call's result"
    )
    inspect_.add_argument(
        "--agent-match", metavar="REGEX", help="mark the LLM calls LightningRL would train with this agent_match"
    )
    inspect_.add_argument("--store", default=None, help=STORE_HELP)
    inspect_.set_defaults(func=cmd_inspect)


def add_store_parser(sub: Any) -> Any:
    """``agl store rollouts|stats|prune``; returns the subparsers, where ``agl store serve`` is added."""
    store = sub.add_parser("store", help="look into a store")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    listing = store_sub.add_parser("rollouts", help="list rollouts")
    listing.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    listing.add_argument("--limit", type=non_negative_int, default=50, help="list the latest N (default 50; 0: all)")
    stats = store_sub.add_parser("stats", help="counts of rollouts, attempts, spans")
    for p in (listing, stats):
        p.add_argument("--store", default=None, help=STORE_HELP)
        p.set_defaults(func=cmd_store)
    prune = store_sub.add_parser(
        "prune",
        help="delete the spans of older finished rollouts (the rollouts and rewards stay)",
        description="Spans (prompts, responses, token ids) are nearly all of a store's volume. This deletes the "
        "spans of every finished rollout but the latest --keep-last, which keep them with the rest of their task "
        "groups (a GRPO group is never cut, so agl export still sees it whole); rollouts, attempts and rewards stay, "
        "and so do the spans of queued and running rollouts and their groups. Export what you want to keep first "
        "(agl export). During "
        "training, Trainer(span_retention_steps=N) / agl train --span-retention-steps N does this step by step.",
    )
    prune.add_argument(
        "--keep-last",
        type=int,
        required=True,
        metavar="N",
        help="how many of the latest finished rollouts keep their spans (with their whole task groups)",
    )
    prune.add_argument("--mode", choices=["train", "val", "dev"], help="only rollouts of this mode (default: all)")
    prune.add_argument(
        "--vacuum",
        action="store_true",
        help="SQLite: give the freed space back to the file system (rewrites the file; without "
        "this the file keeps its size and new spans reuse the space)",
    )
    prune.add_argument("--store", default=None, help=STORE_HELP)
    prune.set_defaults(func=cmd_store_prune)
    return store_sub


def cmd_inspect(args: argparse.Namespace) -> int:
    from agl.cli.inspection import render
    from agl.errors import UnknownAttemptError

    if args.agent_match is not None:
        try:
            re.compile(args.agent_match)
        except re.error as exc:
            raise SystemExit(f"agl: --agent-match {args.agent_match!r} is not a regular expression: {exc}") from None
    store = existing_store(args.store)
    rollout_ = store.get_rollout(args.rollout_id)
    attempt: Optional[str] = None if args.attempt == "all" else args.attempt
    try:
        spans = store.query_spans(args.rollout_id, attempt)
    except UnknownAttemptError:  # its message is advice for the Python API
        ids = [a.attempt_id for a in store.query_attempts(args.rollout_id)]
        raise SystemExit(
            f"agl: rollout {args.rollout_id} has no attempt {args.attempt!r}: pass --attempt latest (the default), "
            f"--attempt all, or one of its attempt ids ({', '.join(ids) if ids else 'none yet: it is queued'})"
        ) from None
    print(
        f"rollout {rollout_.rollout_id}  task={rollout_.task_id}  status={rollout_.status}  "
        f"reward={rollout_.final_reward}  attempts={rollout_.n_attempts}  spans={len(spans)}"
    )
    if rollout_.error:
        print(f"error: {rollout_.error}")
    if spans:
        shown = {"text": args.text, "rollout": rollout_, "agent_match": args.agent_match}
        attempts = store.query_attempts(args.rollout_id) if attempt is None else []
        print(render(spans, **shown) if attempt is not None else _render_attempts(attempts, spans, **shown))
    elif rollout_.is_terminal and rollout_.n_attempts:
        print(
            "(no spans: the agent recorded none, or they were deleted afterwards by span retention, "
            "Trainer(span_retention_steps=...), or by `agl store prune`)"
        )
    else:
        print("(no spans yet)" if rollout_.status in ("queued", "running") else "(no spans)")
    return 0


def _render_attempts(attempts: List[Any], spans: List[Any], **shown: Any) -> str:
    """``--attempt all``: each attempt's tree under a header of its own (id, number, status, error), so that
    a retried rollout's attempts are not read as one tree."""
    from agl.cli.inspection import one_line, render

    lines = []
    for attempt in attempts:
        own = [s for s in spans if s.attempt_id == attempt.attempt_id]
        error = f": {one_line(attempt.error)}" if attempt.error else ""
        lines.append(
            f"attempt {attempt.attempt_id} ({attempt.sequence} of {len(attempts)}) {attempt.status}{error}"
            f"  spans={len(own)}"
        )
        lines.append(render(own, **shown) if own else "(no spans)")
    return "\n".join(lines)


def cmd_store(args: argparse.Namespace) -> int:
    store = existing_store(args.store)
    if args.store_command == "stats":
        print(store.stats().model_dump_json(indent=2))
        return 0
    counts = store.stats().rollouts
    total = counts.get(args.status, 0) if args.status else sum(counts.values())
    limit = args.limit if args.limit > 0 else None
    offset = max(total - limit, 0) if limit else 0  # the latest, in enqueue order
    rollouts = store.query_rollouts(status=[args.status] if args.status else None, limit=limit, offset=offset)
    print(f"{'rollout':24} {'task':16} {'mode':5} {'status':10} {'attempts':8} reward")
    for r in rollouts:
        reward = "-" if r.final_reward is None else f"{r.final_reward:g}"
        print(f"{r.rollout_id:24} {r.task_id[:16]:16} {r.mode:5} {r.status:10} {r.n_attempts:<8} {reward}")
    if offset:
        print(f"(the latest {len(rollouts)} of {total}; --limit 0 lists all)")
    return 0


def cmd_store_prune(args: argparse.Namespace) -> int:
    """Delete the spans of all finished rollouts but the last ``--keep-last`` (in enqueue order)."""
    from agl.store import SqliteLightningStore

    if args.keep_last < 0:
        raise SystemExit("agl: --keep-last must be >= 0 (the number of latest finished rollouts whose spans stay)")
    store = existing_store(args.store)
    if args.vacuum and not isinstance(store, SqliteLightningStore):  # checked before anything is deleted
        raise SystemExit(
            f"agl: --vacuum is for a SQLite store file opened directly, not {store!r}: run `agl store prune "
            "--vacuum --store FILE.db` on the server's machine (PostgreSQL: VACUUM FULL on the database)"
        )
    finished = store.query_rollouts(status=FINISHED, mode=args.mode)
    latest = finished[max(len(finished) - args.keep_last, 0) :]
    kept = {_step_group(r) for r in latest + store.query_rollouts(status=UNFINISHED, mode=args.mode)}
    doomed = [r.rollout_id for r in finished if _step_group(r) not in kept]
    deleted = delete_spans_in_batches(store, doomed)
    print(
        f"deleted {deleted} spans of {len(doomed)} finished rollouts; the rollouts and their rewards stay, and "
        f"so do the spans of {len(finished) - len(doomed)} finished rollouts (the task groups of the last "
        f"{len(latest)}, whole) and of every unfinished rollout and its task group"
    )
    if isinstance(store, SqliteLightningStore) and args.vacuum:
        _vacuum(store)
    return 0


def _vacuum(store: Any) -> None:
    before = store.file_size()
    if store.vacuum():
        print(f"vacuumed {store.path}: {before / 1e6:.1f} MB -> {store.file_size() / 1e6:.1f} MB")
    else:  # the new file is still in the WAL, beside the old one: the size now would read as vacuum's fault
        print(
            f"vacuumed {store.path}, but another process is reading the store: the space returns to the file "
            "system at a later checkpoint, once that reader is done (until then the file is larger, not smaller)"
        )


def _step_group(rollout: Any) -> Tuple[str, str, Optional[str]]:
    """The GRPO group a trainer made: the rollouts of one task run with one resources version (one step). Prune
    keeps these whole; pooled by task alone, the latest rollouts of a multi-epoch run would keep every earlier
    epoch's spans of their tasks, and prune would free almost nothing."""
    return (rollout.mode, rollout.task_id, rollout.resources_id)
