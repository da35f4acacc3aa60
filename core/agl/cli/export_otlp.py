"""``agl export --otlp URL``: send stored rollouts' spans to an OTLP/HTTP traces endpoint after the fact, with the
attributes the live export sends (:mod:`agl.tracing.otlp`). The store is only read: a failed send loses nothing."""

from __future__ import annotations

import argparse
from typing import Any, List, Sequence

from agl.cli.common import FINISHED
from agl.tracing.otlp import OtlpError, OtlpSender

BATCH_SPANS = 512  # spans per request: a long rollout goes in several


def cmd_export_otlp(args: argparse.Namespace, store: Any) -> int:
    """Send every attempt's spans of the chosen rollouts (``--rollout``, else every finished one of ``--mode``);
    one line per rollout sent, then a summary. An endpoint that fails: one error line, exit 1."""
    if args.out is not None:
        raise SystemExit(f"agl: export writes a file or sends to --otlp, not both: drop {args.out} or --otlp")
    try:
        sender = OtlpSender(args.otlp)
    except (ImportError, ValueError) as exc:
        raise SystemExit(f"agl: cannot export to {args.otlp}: {exc}") from None
    rollouts = _chosen(store, args)
    if not rollouts:
        raise SystemExit("agl: no rollout to send (agl store rollouts lists them; --mode all for every mode)")
    sent = spans_sent = 0
    try:
        for rollout in rollouts:
            spans = store.query_spans(rollout.rollout_id, None)
            try:
                for start in range(0, len(spans), BATCH_SPANS):
                    sender.send(spans[start : start + BATCH_SPANS])
            except OtlpError as exc:
                raise SystemExit(
                    f"agl: cannot send rollout {rollout.rollout_id} to {sender.endpoint}: {exc}; {sent} rollouts "
                    f"were sent before it, and the store still holds every span: run again once the endpoint is up"
                ) from None
            sent += 1
            spans_sent += len(spans)
            print(f"sent rollout {rollout.rollout_id} ({rollout.status}, task {rollout.task_id}): {len(spans)} spans")
    finally:
        sender.close()
    print(f"sent {spans_sent} spans of {sent} rollouts to {sender.endpoint}")
    return 0


def _chosen(store: Any, args: argparse.Namespace) -> Sequence[Any]:
    """The rollouts named by ``--rollout`` (in that order; an unknown id is the store's one-line error), else the
    finished ones of ``--status`` and ``--mode`` (default: every mode), at most ``--limit``."""
    if args.rollouts:
        return [store.get_rollout(rollout_id) for rollout_id in args.rollouts]
    mode = None if args.mode in (None, "all") else args.mode
    rollouts: List[Any] = store.query_rollouts(status=args.status or FINISHED, mode=mode, limit=args.limit)
    return rollouts
