"""A training run's folder (``--out``) as ``agl train`` and the main job see it: whether it holds a run, whether a
new run may start there, and the line a run stopped with Ctrl-C ends with."""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path
from typing import Iterator, Sequence


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


def with_resume(command: Sequence[str]) -> str:
    """``command`` (the words the user ran) as one shell line that continues its run: with ``--resume`` once."""
    return shlex.join([*(word for word in command if word != "--resume"), "--resume"])


def interrupted_message(prog: str, out: Path, resume: str) -> str:
    """The line a Ctrl-C'd TorchGRPO run in ``out`` ends with (``agl train``, the main job): where the run is
    and how to go on (``resume``: the command with ``--resume``). Only a checkpoint can be continued; a run
    stopped before its first one but after its start wrote into ``out`` is refused a plain rerun
    (:func:`check_out`), so it is started afresh there with ``--resume``, which finds no checkpoint."""
    if (out / "checkpoints" / "latest").exists():
        return (
            f"{prog}: interrupted; the run so far is in {out} (checkpoints in {out / 'checkpoints'}, metrics "
            f"in {out / 'metrics.csv'}); continue it from its last checkpoint with: {resume}"
        )
    if holds_run(out):
        return (
            f"{prog}: interrupted before the first checkpoint, so no training is kept; {out} holds the run's "
            f"start (store, log): start it again from the untrained model with: {resume}"
        )
    return f"{prog}: interrupted before the first step; nothing to resume in {out}: run the command again"


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
        any((out / name).exists() for name in ("checkpoints", "metrics.csv")) or has_rollouts(out / "store.db")
    )


def has_rollouts(db: Path) -> bool:
    """Whether the SQLite store ``db`` exists and holds a rollout."""
    if not db.exists():
        return False
    from agl.store import SqliteLightningStore

    with SqliteLightningStore(db) as store:
        return sum(store.stats().rollouts.values()) > 0
