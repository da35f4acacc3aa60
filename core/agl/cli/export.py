"""``agl export``: build a LightningRL batch from stored rollouts and write it as JSONL or Parquet."""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Set, Tuple, get_args

from agl.cli.common import FINISHED, STORE_HELP, UNFINISHED, existing_store, json_setting, positive_int
from agl.types import RolloutMode


def add_export_parser(sub: Any) -> None:
    export_ = sub.add_parser("export", help="build a LightningRL batch from stored rollouts; write JSONL or Parquet")
    export_.add_argument("out", nargs="?", help="output file (.jsonl, or .parquet with pyarrow installed)")
    export_.add_argument(
        "--otlp",
        metavar="URL",
        help="instead of a file: send the rollouts' spans to this OTLP/HTTP traces endpoint (docs/otlp.md)",
    )
    export_.add_argument(
        "--rollout",
        dest="rollouts",
        action="append",
        metavar="ID",
        help="with --otlp: send this rollout (repeatable; default: every finished rollout)",
    )
    export_.add_argument("--format", choices=["jsonl", "parquet"], help="default: from the file suffix")
    export_.add_argument("--config", default="{}", help="LightningRL settings as JSON, or @file.json")
    export_.add_argument(
        "--adapter",
        dest="adapter_settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one LightningRL setting, as for agl train (over --config), e.g. --adapter aggregate=true",
    )
    export_.add_argument("--agent-match", help="regex on agent names (overrides the config's agent_match)")
    export_.add_argument(
        "--status",
        action="append",
        choices=["succeeded", "failed", "cancelled"],
        help="rollouts to read (repeatable; default: every finished rollout); a task group with a "
        "rollout still queued or running is left out, and the command says so",
    )
    export_.add_argument(
        "--mode",
        choices=[*get_args(RolloutMode), "all"],
        help="rollouts of this mode (default: train, with --otlp all; val: validation; dev: agl dev's runs; "
        "'all': every mode, grouped apart); each record has its rollout's mode",
    )
    export_.add_argument(
        "--limit",
        type=positive_int,
        metavar="N",
        help="read at most N rollouts, in whole task groups (a GRPO group is never cut)",
    )
    export_.add_argument("--store", default=None, help=STORE_HELP)
    export_.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from agl.cli.train import adapter_settings
    from agl.lightningrl import LightningRL
    from agl.lightningrl.export import check_target, export

    if args.otlp:
        from agl.cli.export_otlp import cmd_export_otlp

        return cmd_export_otlp(args, existing_store(args.store))
    if args.out is None:
        raise SystemExit("agl: export needs an output file (.jsonl or .parquet), or --otlp URL to send spans")
    if args.rollouts:
        raise SystemExit("agl: --rollout chooses rollouts to send with --otlp; a batch file takes whole task groups")
    try:
        fmt = check_target(args.out, args.format)  # before the batch, which may take minutes to build
    except (ImportError, ValueError, OSError) as exc:
        raise SystemExit(f"agl: cannot export to {args.out}: {exc}") from None
    settings = adapter_settings(args.adapter_settings, args.agent_match, json_setting(args.config, "--config"))
    adapter = LightningRL.from_config(settings)
    store = existing_store(args.store)
    mode = None if args.mode == "all" else args.mode or "train"
    rollouts = _finished_groups(
        store.query_rollouts(status=args.status or FINISHED, mode=mode),
        store.query_rollouts(status=UNFINISHED, mode=mode),
    )
    if args.limit is not None:
        rollouts = _whole_groups(rollouts, args.limit)
    batch = adapter.build_batch(store, rollouts)
    print(batch.report)
    if not batch.samples:  # a script that exports then trains must not go on with an empty (or an old) file
        why = "the report above says why" if rollouts else _nothing_read(store, args.status or FINISHED, mode)
        raise SystemExit(f"agl: no samples to export from {len(rollouts)} rollouts; {why} ({args.out} was not written)")
    try:
        n = export(batch, args.out, fmt)
    except OSError as exc:  # a full disk, a lost permission: the previous file, if any, is left as it was
        raise SystemExit(f"agl: cannot write {args.out}: {exc}") from None
    print(f"wrote {n} samples to {args.out}")
    return 0


def _nothing_read(store: Any, statuses: List[str], mode: Optional[str]) -> str:
    """Why no rollout was read, naming the other modes that have some: `agl dev`'s runs (mode dev) are not
    in the default export of training rollouts, and a user who exports after `agl dev` is told how to ask."""
    modes = [m for m in get_args(RolloutMode) if m != mode] if mode is not None else []
    others = [m for m in modes if store.query_rollouts(status=statuses, mode=m, limit=1)]
    if not others:
        return "no finished rollout was read (agl store rollouts lists them)"
    return (
        f"no finished {mode} rollout was read, and the store has {' and '.join(others)} rollouts: --mode "
        f"{others[0]} (or --mode all) exports them"
    )


def _group(rollout: Any) -> Tuple[str, str]:
    """A rollout's GRPO group as `agl export` pools it: its mode and task (every step's rollouts of the task)."""
    return (rollout.mode, rollout.task_id)


def _finished_groups(rollouts: List[Any], unfinished: List[Any]) -> List[Any]:
    """``rollouts`` less the task groups that still have a queued or running rollout: exported now, such a
    group would get advantages over part of it, which change once the rest finishes (as with ``--limit``, a
    group is never cut). Says what it left out."""
    waiting = {_group(r) for r in unfinished}
    kept = [r for r in rollouts if _group(r) not in waiting]
    if unfinished:
        print(
            f"{len(unfinished)} rollouts are still queued or running: their {len(waiting)} task groups are left "
            f"out ({len(rollouts) - len(kept)} finished rollouts of them); export again once they finish"
        )
    return kept


def _whole_groups(rollouts: List[Any], limit: int) -> List[Any]:
    """At most ``limit`` of ``rollouts`` (enqueue order), never part of a GRPO group: the groups (one per
    ``(mode, task_id)``) are taken whole in the order of their first rollout, up to the first that does not fit."""
    if limit < 1:
        raise SystemExit("agl: --limit must be >= 1 (the most rollouts to read, in whole task groups)")
    groups: Dict[Tuple[str, str], List[Any]] = {}
    for r in rollouts:
        groups.setdefault(_group(r), []).append(r)
    kept: Set[Tuple[str, str]] = set()
    n = 0
    for key, group in groups.items():
        if n + len(group) > limit:
            break
        kept.add(key)
        n += len(group)
    if not kept and rollouts:
        (mode, task), first = next(iter(groups.items()))
        raise SystemExit(
            f"agl: --limit {limit} is smaller than the first task group ({len(first)} rollouts of {mode} task "
            f"{task!r}); a group is never cut, so its advantages stay right: raise --limit"
        )
    if n < len(rollouts):
        print(f"--limit {limit}: read {n} rollouts in {len(kept)} whole task groups; {len(rollouts) - n} more left out")
    return [r for r in rollouts if _group(r) in kept]
