"""`agl inspect`, `agl store` and `agl export` on real SQLite files, as a user runs them (the `agl` console script
in a subprocess where a lock or a second process matters)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from agl import semconv
from agl.cli import main as agl_main
from agl.lightningrl.export import read_jsonl
from agl.store import SqliteLightningStore
from agl.testing.waiting import eventually
from agl.types import Rollout, RolloutConfig, RolloutMode, Span

AGL = Path(sys.executable).with_name("agl")
TRACE = "0" * 32


def agl_cli(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(AGL), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def spans_of(rollout: Rollout, parent_of_llm: Optional[str] = None, root_parent: Optional[str] = None) -> List[Span]:
    """An agent span "solver" with one llm call under it (``parent_of_llm`` overrides the call's parent link)."""
    assert rollout.attempt is not None
    rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
    root, llm = hashlib.sha1(aid.encode()).hexdigest()[:16], hashlib.sha1(rid.encode() + aid.encode()).hexdigest()[:16]
    return [
        Span(
            rollout_id=rid,
            attempt_id=aid,
            sequence_id=1,
            trace_id=TRACE,
            span_id=root,
            parent_id=root_parent,
            name="agent",
            kind="agent",
            start_time=0,
            end_time=10_000_000,
            attributes={semconv.AGENT_NAME: "solver"},
        ),
        Span(
            rollout_id=rid,
            attempt_id=aid,
            sequence_id=2,
            trace_id=TRACE,
            span_id=llm,
            parent_id=parent_of_llm or root,
            name="chat",
            kind="llm",
            start_time=1_000_000,
            end_time=2_000_000,
            attributes={semconv.PROMPT_TOKEN_IDS: [1, 2, 3], semconv.RESPONSE_TOKEN_IDS: [4, 5]},
        ),
    ]


def run_one(
    store: SqliteLightningStore,
    task_id: str,
    reward: Optional[float],
    resources_id: Optional[str] = None,
    mode: RolloutMode = "train",
) -> Rollout:
    """Enqueue a rollout of ``task_id``, run it with one llm call, and end it (``reward`` None: leave it running)."""
    store.enqueue_rollout({"q": task_id}, task_id=task_id, resources_id=resources_id, mode=mode)
    rollout = store.dequeue_rollout("runner")
    assert rollout is not None and rollout.attempt is not None
    store.add_spans(spans_of(rollout))
    if reward is not None:
        store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=reward)
    return rollout


def exported(path: Path) -> Dict[str, float]:
    return {s.rollout_id: s.advantage for s in read_jsonl(path)}


# -- finding 1: read-only commands never turn another application's SQLite file into a store -------------------


def _file_state(path: Path) -> tuple:
    with sqlite3.connect(path) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master ORDER BY name")]
        state = (
            tables,
            conn.execute("PRAGMA journal_mode").fetchone()[0],
            conn.execute("PRAGMA user_version").fetchone()[0],
        )
    conn.close()
    return state + (path.read_bytes(),)


@pytest.mark.parametrize(
    "schema, what",
    [
        ("CREATE TABLE users (name TEXT); INSERT INTO users VALUES ('ann');", "(tables: users) but not an agl store"),
        ("CREATE TABLE spans (x TEXT); INSERT INTO spans VALUES ('mine');", "its table 'spans' has other columns (x)"),
        ("", "is an empty SQLite file, not an agl store"),
    ],
)
@pytest.mark.parametrize(
    "command", [["store", "stats"], ["store", "rollouts"], ["inspect", "ro-1"], ["export", "o.jsonl"]]
)
def test_reading_commands_refuse_another_applications_database_and_leave_it_untouched(
    tmp_path: Path, schema: str, what: str, command: List[str]
) -> None:
    """`agl store stats --store app.db` created agl's tables in app.db, switched it to WAL and set its user_version;
    with a `spans` table of its own, it reported that application's rows as agl spans."""
    db = tmp_path / "app.db"
    if schema:
        with sqlite3.connect(db) as conn:
            conn.executescript(schema)
        conn.close()
    else:
        db.touch()
    before = _file_state(db)
    done = agl_cli(tmp_path, *command, "--store", str(db))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"agl: {db} is ") and what in done.stderr and "agl left it untouched" in done.stderr
    assert "Traceback" not in done.stderr
    assert _file_state(db) == before
    assert not (tmp_path / "o.jsonl").exists()


def test_a_store_is_still_created_and_read_as_before(tmp_path: Path) -> None:
    db = tmp_path / "new" / "s.db"
    with SqliteLightningStore(db) as store:
        run_one(store, "t", 1.0)
    done = agl_cli(tmp_path, "store", "stats", "--store", str(db))
    assert done.returncode == 0 and json.loads(done.stdout)["rollouts"]["succeeded"] == 1


# -- finding 2: export never computes advantages over part of a task group -------------------------------------


def test_export_leaves_out_a_group_with_a_rollout_still_running_and_says_so(tmp_path: Path) -> None:
    """A group of 3 with one rollout running was exported as a group of 2, its advantages unlike the final ones."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        whole = [run_one(store, "whole", r).rollout_id for r in (1.0, 0.0)]
        partial = [run_one(store, "partial", r).rollout_id for r in (1.0, 0.0)]
        running = run_one(store, "partial", None)
    done = agl_cli(tmp_path, "export", "out.jsonl", "--store", str(db), "--agent-match", "solver")
    assert done.returncode == 0, done.stderr
    assert (
        "1 rollouts are still queued or running: their 1 task groups are left out (2 finished rollouts of them)"
        in done.stdout
    )
    assert set(exported(tmp_path / "out.jsonl")) == set(whole)
    with SqliteLightningStore(db) as store:
        assert running.attempt is not None
        store.complete_attempt(running.rollout_id, running.attempt.attempt_id, "succeeded", reward=0.0)
    assert agl_cli(tmp_path, "export", "out.jsonl", "--store", str(db), "--agent-match", "solver").returncode == 0
    assert set(exported(tmp_path / "out.jsonl")) == set(whole + partial + [running.rollout_id])


def test_prune_keeps_whole_task_groups_so_export_sees_them_whole(tmp_path: Path) -> None:
    """`--keep-last 2` of a store whose last group has 3 rollouts deleted the spans of its first rollout: export
    then computed the group's advantages over the other 2."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        old = [run_one(store, "old", r).rollout_id for r in (1.0, 0.0)]
        last = [run_one(store, "last", r).rollout_id for r in (1.0, 0.0, 0.0)]
    assert agl_cli(tmp_path, "export", "before.jsonl", "--store", str(db), "--agent-match", "solver").returncode == 0
    done = agl_cli(tmp_path, "store", "prune", "--keep-last", "2", "--store", str(db))
    assert done.returncode == 0, done.stderr
    assert "deleted 4 spans of 2 finished rollouts" in done.stdout
    with SqliteLightningStore(db) as store:
        assert [bool(store.query_spans(i)) for i in old + last] == [False, False, True, True, True]
    assert agl_cli(tmp_path, "export", "after.jsonl", "--store", str(db), "--agent-match", "solver").returncode == 0
    before = exported(tmp_path / "before.jsonl")
    assert exported(tmp_path / "after.jsonl") == {i: before[i] for i in last}


def test_prune_keeps_a_steps_group_whole_but_frees_the_tasks_earlier_steps(tmp_path: Path) -> None:
    """A group is one task's rollouts of one step (one resources version): grouped by task alone, the latest
    rollouts of a multi-epoch run kept every earlier epoch's spans of their tasks, and prune freed nothing."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        step1, step2 = (store.add_resources({}).resources_id for _ in range(2))
        earlier = [run_one(store, "t", r, step1).rollout_id for r in (1.0, 0.0)]
        latest = [run_one(store, "t", r, step2).rollout_id for r in (1.0, 0.0)]
    done = agl_cli(tmp_path, "store", "prune", "--keep-last", "1", "--store", str(db))
    assert done.returncode == 0, done.stderr
    with SqliteLightningStore(db) as store:
        assert [bool(store.query_spans(i)) for i in earlier + latest] == [False, False, True, True]


def test_export_reads_dev_runs_only_when_asked_and_groups_each_mode_apart(tmp_path: Path) -> None:
    """`agl dev`'s runs (mode dev) were training data to `agl export`: the default reads training rollouts only,
    --mode dev the dev runs, --mode all both, a task's dev runs never in the group of its training rollouts."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        train = [run_one(store, "t", r).rollout_id for r in (1.0, 0.0)]
        dev = [run_one(store, "t", r, mode="dev").rollout_id for r in (1.0, 1.0, 0.0)]
    for mode in ("train", "dev", "all"):
        done = agl_cli(tmp_path, "export", f"{mode}.jsonl", "--store", str(db), "--mode", mode)
        assert done.returncode == 0, done.stderr
    assert agl_cli(tmp_path, "export", "default.jsonl", "--store", str(db)).returncode == 0
    assert exported(tmp_path / "default.jsonl") == exported(tmp_path / "train.jsonl")
    of_train, of_dev = exported(tmp_path / "train.jsonl"), exported(tmp_path / "dev.jsonl")
    assert set(of_train) == set(train) and set(of_dev) == set(dev)
    assert exported(tmp_path / "all.jsonl") == {**of_train, **of_dev}  # each mode's group has its own advantages
    assert {s.mode for s in read_jsonl(tmp_path / "dev.jsonl")} == {"dev"}
    pruned = agl_cli(tmp_path, "store", "prune", "--keep-last", "0", "--mode", "dev", "--store", str(db))
    assert pruned.returncode == 0, pruned.stderr
    with SqliteLightningStore(db) as store:
        assert [bool(store.query_spans(i)) for i in train + dev] == [True, True, False, False, False]


# -- findings 3 and 5: an export that finds nothing, or cannot write, leaves the previous file alone -----------


def test_an_export_without_samples_keeps_the_previous_file(tmp_path: Path) -> None:
    """A typo in --agent-match emptied the good export it was meant to replace."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        run_one(store, "t", 1.0)
        run_one(store, "t", 0.0)
    assert agl_cli(tmp_path, "export", "good.jsonl", "--store", str(db), "--agent-match", "solver").returncode == 0
    good = (tmp_path / "good.jsonl").read_bytes()
    done = agl_cli(tmp_path, "export", "good.jsonl", "--store", str(db), "--agent-match", "solvre")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "agl: no samples to export from 2 rollouts; the report above says why (good.jsonl was not written)"
    )
    assert (tmp_path / "good.jsonl").read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.jsonl", "s.db"]


@pytest.mark.parametrize(
    "out, message",
    [
        (
            "nodir/x.jsonl",
            "cannot export to nodir/x.jsonl: the folder nodir does not exist: create it first (mkdir -p nodir)",
        ),
        ("x.csv", "cannot export to x.csv: unknown export format 'csv' for x.csv: use one of ['jsonl', 'parquet']"),
    ],
)
def test_export_checks_where_it_writes_before_reading_the_store(tmp_path: Path, out: str, message: str) -> None:
    """A missing folder was a FileNotFoundError traceback, and both it and an unknown suffix came only after the
    whole batch was built. The store named here does not exist: the target is checked first."""
    done = agl_cli(tmp_path, "export", out, "--store", str(tmp_path / "missing.db"))
    assert done.returncode == 1 and done.stderr.startswith(f"agl: {message}"), done.stderr


# -- findings 4 and 7: inspect shows every span, each attempt under its own header ------------------------------


def test_inspect_shows_spans_whose_parent_links_form_a_cycle(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two spans pointing at each other (the llm call one of them) were left out of the tree without a word,
    while export repaired the tree and trained on that call."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        store.enqueue_rollout({"q": 1}, task_id="cyc")
        rollout = store.dequeue_rollout("runner")
        assert rollout is not None and rollout.attempt is not None
        root, llm = spans_of(rollout)
        store.add_spans([root.model_copy(update={"parent_id": llm.span_id}), llm])  # root <-> llm
        store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0)
    assert agl_main(["inspect", rollout.rollout_id, "--store", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("[agent] agent  agent=solver") and lines[1].endswith("(parent link repaired)")
    assert lines[2].startswith("  [llm] chat  tokens=3+2")
    assert lines[3] == "tree repairs: 1 parent cycle(s) broken, 1 orphan(s) attached to the root"


def test_inspect_all_attempts_puts_a_header_over_each(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--attempt all` printed two identical-looking trees under one header."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        store.enqueue_rollout({"q": 1}, task_id="t", config=RolloutConfig(max_attempts=2))
        attempts = []
        for status in ("failed", "succeeded"):
            rollout = store.dequeue_rollout("runner")
            assert rollout is not None and rollout.attempt is not None
            store.add_spans(spans_of(rollout))
            store.complete_attempt(
                rollout.rollout_id,
                rollout.attempt.attempt_id,
                status,  # type: ignore[arg-type]
                reward=1.0 if status == "succeeded" else None,
                error="ValueError: boom" if status == "failed" else None,
            )
            attempts.append(rollout.attempt.attempt_id)
    assert agl_main(["inspect", rollout.rollout_id, "--attempt", "all", "--store", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"attempt {attempts[0]} (1 of 2) failed: ValueError: boom  spans=2"
    assert lines[2].startswith("[agent] agent") and lines[3].startswith("  [llm] chat")
    assert lines[4] == f"attempt {attempts[1]} (2 of 2) succeeded  spans=2"
    assert lines[5].startswith("[agent] agent") and lines[6].startswith("  [llm] chat") and len(lines) == 7


# -- finding 5: a locked store is one line ---------------------------------------------------------------------


LOCK_HOLDER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(120)
"""


def test_prune_of_a_locked_store_is_one_line(tmp_path: Path) -> None:
    """A process holding the write lock made `agl store prune` end, after 30 s, in a sqlite3 traceback."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        run_one(store, "t", 1.0)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        done = agl_cli(tmp_path, "store", "prune", "--keep-last", "0", "--store", str(db))
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("agl: the SQLite store is locked (database is locked): another process")
    assert "run the command again once that process is done, or stop it" in done.stderr


BRIEF_LOCK_HOLDER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
time.sleep(2)  # the prune has opened the store: without waiting for the lock it would have failed by now
conn.execute("COMMIT")
time.sleep(120)
"""


def _has_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (Linux's /proc)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.path.realpath(fd) == str(path.resolve()) for fd in fds.iterdir())
    except OSError:  # the process ended, or a descriptor closed while listed
        return False


def test_prune_waits_for_a_lock_another_process_holds_for_a_while(tmp_path: Path) -> None:
    """A store locked for a moment (a trainer's commit) is waited for, not reported as locked at once."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        run_one(store, "t", 1.0)
    holder = subprocess.Popen(
        [sys.executable, "-c", BRIEF_LOCK_HOLDER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None and holder.stdout.readline() == "locked\n"
        prune = subprocess.Popen(
            [str(AGL), "store", "prune", "--keep-last", "0", "--store", str(db)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        eventually(lambda: _has_open(prune.pid, db), 60, "the prune to open the store")
        holder.stdin.write("go\n")
        holder.stdin.flush()
        out, err = prune.communicate(timeout=60)
    finally:
        holder.kill()
        holder.wait()
    assert prune.returncode == 0 and "deleted" in out, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["store", "rollouts", "--limit", "-3"], "must be at least 0, got -3"),
        (["export", "out.jsonl", "--limit", "0"], "must be at least 1, got 0"),
    ],
)
def test_listing_and_export_limits_out_of_range_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: List[str], message: str
) -> None:
    """`agl store rollouts --limit -3` listed all but the last three rollouts (a Python slice); `agl export
    --limit 0` read no rollout and wrote an empty export. Both are refused before the store is opened."""
    with pytest.raises(SystemExit) as exited:
        agl_main([*args, "--store", str(tmp_path / "store.db")])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "store.db").exists()


def test_store_commands_close_the_store_so_no_write_ahead_log_is_left(tmp_path: Path) -> None:
    """`agl store prune` left a write-ahead log as large as what it deleted beside the file (20.6 MB after
    deleting 23,680 spans of a 22 MB store), until another process opened and closed the store."""
    from agl.cli import main

    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        for r in (1.0, 0.0, 1.0):
            run_one(store, "t", r)
    export = ["export", str(tmp_path / "o.jsonl"), "--agent-match", "solver"]
    for command in (export, ["store", "stats"], ["store", "prune", "--keep-last", "0"]):
        assert main([*command, "--store", str(db)]) == 0
        assert not db.with_name(db.name + "-wal").exists(), command
