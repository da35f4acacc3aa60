"""The ``agl`` command line: run an agent in dev mode, inspect rollouts, look into the store."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import shlex
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from agl import __version__
from agl.litagent import LitAgent, as_agent
from agl.span_retention import delete_spans_in_batches

FINISHED = ["succeeded", "failed", "cancelled"]
UNFINISHED = ["queued", "running"]


def load_agent(target: str) -> LitAgent[Any]:
    """``path/to/file.py:name`` or ``package.module:name`` -> a LitAgent.

    The object may be a LitAgent instance, a LitAgent subclass (built with no arguments) or a plain
    rollout function (wrapped with ``@agl.rollout``).
    """
    module_part, sep, attr = target.partition(":")
    if not sep or not attr:
        raise SystemExit(f"agl: agent {target!r} must look like MODULE:NAME or path/to/file.py:NAME")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        if not path.exists():
            raise SystemExit(f"agl: file {path} does not exist")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        sys.path.insert(0, str(path.parent.resolve()))
        spec.loader.exec_module(module)
    else:
        module = _import_module(module_part, target)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        where = getattr(module, "__file__", None)
        raise SystemExit(
            f"agl: {module_part}{f' ({where})' if where else ''} has no attribute {attr!r}: pass MODULE:NAME with the "
            "name of a LitAgent or rollout function defined in it"
        ) from None
    try:
        return as_agent(obj)
    except TypeError as exc:  # not an agent, or a function taking arguments agl cannot supply
        raise SystemExit(f"agl: {target}: {exc}") from None


def _import_module(name: str, target: str) -> Any:
    """``import name`` with the current folder on ``sys.path`` first, as ``python -m`` has it (the ``agl`` script
    has its own folder there instead), so that ``agl dev my_agent:agent`` finds ./my_agent.py. A module that
    cannot be found is one line saying what was tried; an error inside a module that was found is its own."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
            raise  # the module was found, and one it imports is missing: its own traceback says which
        path = Path(*name.split(".")).with_suffix(".py")
        raise SystemExit(
            f"agl: cannot import module {name!r} for {target!r}: no module named {exc.name!r} in the current folder "
            f"({cwd}) or on sys.path (PYTHONPATH, installed packages); pass MODULE:NAME for an importable module, "
            f"or path/to/file.py:NAME for a file (e.g. {path}:{target.partition(':')[2]})"
        ) from None


def load_tasks(path: str) -> List[Any]:
    """A dataset file's tasks, or a clean exit saying what is wrong with the file."""
    from agl.dataset import load_dataset

    try:
        tasks = load_dataset(path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"agl: cannot read tasks from {path}: {exc}") from None
    if not tasks:
        raise SystemExit(f"agl: {path} holds no tasks")
    return tasks


def json_setting(value: str, flag: str, *, yaml_ok: bool = False) -> Dict[str, Any]:
    """A JSON object given inline or as ``@file`` (``.yaml``/``.yml`` files too when ``yaml_ok``)."""
    try:
        data = _read_setting(value, yaml_ok)
    except (OSError, ValueError, ImportError) as exc:
        raise SystemExit(f"agl: cannot read {flag} {value!r}: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"agl: {flag} must be a JSON object of settings, got {value!r}")
    return data


def prompt_setting(value: str, flag: str = "--prompt") -> str:
    """A prompt given inline or as ``@FILE``."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise SystemExit(f"agl: cannot read {flag} {value!r}: {exc}") from None


def _read_setting(value: str, yaml_ok: bool) -> Any:
    if not value.startswith("@"):
        return json.loads(value)
    path = Path(value[1:])
    if yaml_ok and path.suffix in (".yaml", ".yml"):
        import yaml  # the verl extra brings it (omegaconf needs it)

        try:
            return yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(str(exc)) from None
    return json.loads(path.read_text())


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
        rows = trainer.dev(agent, data)
    where = f" --store {store_argument(args.store)}" if args.store else ""
    print(f"inspect one: agl inspect {rows[0].rollout_id}{where}" if rows else "no tasks")
    return 0 if all(r.status == "succeeded" for r in rows) else 1


def store_argument(store: str) -> str:
    """A store address for a command line agl prints as a hint: without a database password (the output goes
    to terminals, CI and Job logs; libpq then takes it from PGPASSWORD or ~/.pgpass), quoted for the shell."""
    from agl.remote_cli import shown_store

    return shlex.quote(shown_store(store))


def _say_runners_are_awaited(args: argparse.Namespace, store: Any) -> None:
    """``--n-runners 0``: nothing runs the rollouts here, so ``dev`` waits for runners started elsewhere; say so
    at once, with the command that starts one (else the wait is silent for a minute, then only a warning).
    A store in memory can never get such a runner: refused."""
    from agl.store import InMemoryLightningStore

    if isinstance(store, InMemoryLightningStore):
        raise SystemExit("agl: --n-runners 0 waits for runners started elsewhere, which cannot reach a store in "
                         "memory: pass --store FILE.db (or a store server's http://...), or --n-runners 1 or more")
    where = store_argument(getattr(store, "path", None) or args.store or os.environ.get("AGL_STORE") or "")
    local = " on this machine (--fake-model's server listens on 127.0.0.1)" if args.fake_model else ""
    print(f"agl dev: --n-runners 0: no runner starts here; waiting for runners started elsewhere{local}, e.g. in "
          f"another terminal: agl runner --store {where} --agent {args.agent}", file=sys.stderr, flush=True)


_OPENED_STORES: List[Any] = []  # closed by main() when the command ends


def _existing_store(target: Optional[str]) -> Any:
    """The store a reading command looks at: never a new, empty SQLite file made by a mistyped path. main()
    closes it when the command ends: a SQLite store's last connection then folds its write-ahead log into the
    file and deletes it (left open, `agl store prune` left a log as large as what it deleted beside the file)."""
    from agl.errors import StoreNotFoundError
    from agl.store import open_store

    try:
        store = open_store(target, create=False)
    except StoreNotFoundError as exc:
        raise SystemExit(f"agl: {exc}") from None
    _OPENED_STORES.append(store)
    return store


def _close_opened_stores() -> None:
    while _OPENED_STORES:
        store = _OPENED_STORES.pop()
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001 - the command's own result stands
            logging.getLogger("agl").warning("could not close the store %r: %s", store, exc)


def cmd_inspect(args: argparse.Namespace) -> int:
    from agl.errors import UnknownAttemptError
    from agl.inspection import render

    store = _existing_store(args.store)
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
        print(render(spans) if attempt is not None else _render_attempts(store.query_attempts(args.rollout_id), spans))
    elif rollout_.is_terminal and rollout_.n_attempts:
        print("(no spans: the agent recorded none, or they were deleted afterwards by span retention, "
              "Trainer(span_retention_steps=...), or by `agl store prune`)")
    else:
        print("(no spans yet)" if rollout_.status in ("queued", "running") else "(no spans)")
    return 0


def _render_attempts(attempts: List[Any], spans: List[Any]) -> str:
    """``--attempt all``: each attempt's tree under a header of its own (id, number, status, error), so that
    a retried rollout's attempts are not read as one tree."""
    from agl.inspection import one_line, render

    lines = []
    for attempt in attempts:
        own = [s for s in spans if s.attempt_id == attempt.attempt_id]
        error = f": {one_line(attempt.error)}" if attempt.error else ""
        lines.append(f"attempt {attempt.attempt_id} ({attempt.sequence} of {len(attempts)}) {attempt.status}{error}"
                     f"  spans={len(own)}")
        lines.append(render(own) if own else "(no spans)")
    return "\n".join(lines)


def cmd_store(args: argparse.Namespace) -> int:
    store = _existing_store(args.store)
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
    store = _existing_store(args.store)
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
    print(f"deleted {deleted} spans of {len(doomed)} finished rollouts; the rollouts and their rewards stay, and "
          f"so do the spans of {len(finished) - len(doomed)} finished rollouts (the task groups of the last "
          f"{len(latest)}, whole) and of every unfinished rollout and its task group")
    if isinstance(store, SqliteLightningStore) and args.vacuum:
        _vacuum(store)
    return 0


def _vacuum(store: Any) -> None:
    before = store.file_size()
    if store.vacuum():
        print(f"vacuumed {store.path}: {before / 1e6:.1f} MB -> {store.file_size() / 1e6:.1f} MB")
    else:  # the new file is still in the WAL, beside the old one: the size now would read as vacuum's fault
        print(f"vacuumed {store.path}, but another process is reading the store: the space returns to the file "
              "system at a later checkpoint, once that reader is done (until then the file is larger, not smaller)")


def _group(rollout: Any) -> Tuple[str, str]:
    """A rollout's GRPO group as `agl export` pools it: its mode and task (every step's rollouts of the task)."""
    return (rollout.mode, rollout.task_id)


def _step_group(rollout: Any) -> Tuple[str, str, Optional[str]]:
    """The GRPO group a trainer made: the rollouts of one task run with one resources version (one step). Prune
    keeps these whole; pooled by task alone, the latest rollouts of a multi-epoch run would keep every earlier
    epoch's spans of their tasks, and prune would free almost nothing."""
    return (rollout.mode, rollout.task_id, rollout.resources_id)


def cmd_export(args: argparse.Namespace) -> int:
    from agl.lightningrl import LightningRL
    from agl.lightningrl.export import check_target, export
    from agl.train_cli import adapter_settings

    try:
        fmt = check_target(args.out, args.format)  # before the batch, which may take minutes to build
    except (ImportError, ValueError, OSError) as exc:
        raise SystemExit(f"agl: cannot export to {args.out}: {exc}") from None
    settings = adapter_settings(args.adapter_settings, args.agent_match, json_setting(args.config, "--config"))
    adapter = LightningRL.from_config(settings)
    store = _existing_store(args.store)
    mode = None if args.mode == "all" else args.mode
    rollouts = _finished_groups(
        store.query_rollouts(status=args.status or FINISHED, mode=mode), store.query_rollouts(status=UNFINISHED, mode=mode)
    )
    if args.limit is not None:
        rollouts = _whole_groups(rollouts, args.limit)
    batch = adapter.build_batch(store, rollouts)
    print(batch.report)
    if not batch.samples:  # a script that exports then trains must not go on with an empty (or an old) file
        why = "the report above says why" if rollouts else "no finished rollout was read (agl store rollouts lists them)"
        raise SystemExit(f"agl: no samples to export from {len(rollouts)} rollouts; {why} ({args.out} was not written)")
    try:
        n = export(batch, args.out, fmt)
    except OSError as exc:  # a full disk, a lost permission: the previous file, if any, is left as it was
        raise SystemExit(f"agl: cannot write {args.out}: {exc}") from None
    print(f"wrote {n} samples to {args.out}")
    return 0


def _finished_groups(rollouts: List[Any], unfinished: List[Any]) -> List[Any]:
    """``rollouts`` less the task groups that still have a queued or running rollout: exported now, such a
    group would get advantages over part of it, which change once the rest finishes (as with ``--limit``, a
    group is never cut). Says what it left out."""
    waiting = {_group(r) for r in unfinished}
    kept = [r for r in rollouts if _group(r) not in waiting]
    if unfinished:
        print(f"{len(unfinished)} rollouts are still queued or running: their {len(waiting)} task groups are left "
              f"out ({len(rollouts) - len(kept)} finished rollouts of them); export again once they finish")
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


def positive_int(value: str) -> int:
    """An argparse type: an int of at least 1 (argparse says what is wrong, with the usage line)."""
    number = int(value)  # a ValueError reads "invalid positive_int value: 'x'"
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def non_negative_int(value: str) -> int:
    """An argparse type: an int of at least 0."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agl", description="Train any AI agent with reinforcement learning.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"agl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    store_help = ("store location: a .db file, sqlite:///path, memory, postgresql://... or a store server's "
                  "http://HOST:PORT (default: $AGL_STORE or .agl/store.db)")

    dev = sub.add_parser("dev", help="run an agent on a dataset with the current model, no training")
    dev.add_argument("agent", help="MODULE:NAME or path/to/file.py:NAME (a LitAgent or a rollout function)")
    dev.add_argument("--data", required=True, help="tasks: .jsonl (one per line), .json (a list), .parquet or .csv")
    dev.add_argument("--n-runners", type=non_negative_int, default=2,
                     help="runners to start here (default 2; 0: only runners started elsewhere, by agl runner)")
    dev.add_argument("--runner-mode", choices=["process", "thread"], default="process")
    dev.add_argument("--store", default=None, help=store_help)
    dev.add_argument("--endpoint", help="OpenAI-compatible base URL the agent should use (main_llm)")
    dev.add_argument("--model", help="model name to ask the endpoint for")
    dev.add_argument("--api-key", default=None)
    dev.add_argument("--fake-model", action="store_true", help="serve agl's scripted fake model locally and use it")
    dev.add_argument("--limit", type=positive_int, metavar="N", help="run only the first N tasks")
    dev.add_argument("--prompt", help="a PromptTemplate resource 'prompt' for the agent: TEXT or @FILE (e.g. the "
                     "best_prompt.txt of `agl train --algorithm apo`)")
    dev.set_defaults(func=cmd_dev)

    inspect_ = sub.add_parser("inspect", help="print a rollout's span tree")
    inspect_.add_argument("rollout_id")
    inspect_.add_argument("--attempt", default="latest", help="attempt id, 'latest' (default) or 'all'")
    inspect_.add_argument("--store", default=None, help=store_help)
    inspect_.set_defaults(func=cmd_inspect)

    store = sub.add_parser("store", help="look into a store")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    listing = store_sub.add_parser("rollouts", help="list rollouts")
    listing.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    listing.add_argument("--limit", type=non_negative_int, default=50, help="list the latest N (default 50; 0: all)")
    stats = store_sub.add_parser("stats", help="counts of rollouts, attempts, spans")
    for p in (listing, stats):
        p.add_argument("--store", default=None, help=store_help)
        p.set_defaults(func=cmd_store)
    prune = store_sub.add_parser(
        "prune", help="delete the spans of older finished rollouts (the rollouts and rewards stay)",
        description="Spans (prompts, responses, token ids) are nearly all of a store's volume. This deletes the "
        "spans of every finished rollout but the latest --keep-last, which keep them with the rest of their task "
        "groups (a GRPO group is never cut, so agl export still sees it whole); rollouts, attempts and rewards stay, "
        "and so do the spans of queued and running rollouts and their groups. Export what you want to keep first "
        "(agl export). During "
        "training, Trainer(span_retention_steps=N) / agl train --span-retention-steps N does this step by step.",
    )
    prune.add_argument("--keep-last", type=int, required=True, metavar="N",
                       help="how many of the latest finished rollouts keep their spans (with their whole task groups)")
    prune.add_argument("--mode", choices=["train", "val"], help="only rollouts of this mode (default: both)")
    prune.add_argument("--vacuum", action="store_true",
                       help="SQLite: give the freed space back to the file system (rewrites the file; without "
                       "this the file keeps its size and new spans reuse the space)")
    prune.add_argument("--store", default=None, help=store_help)
    prune.set_defaults(func=cmd_store_prune)
    from agl.remote_cli import add_runner_parser, add_serve_parser

    add_serve_parser(store_sub)  # agl store serve
    add_runner_parser(sub)  # agl runner
    from agl.serving.cli import add_serve_command

    add_serve_command(sub, store_help)  # agl serve (the policy server)
    from agl.train_cli import add_export_model_parser, add_train_parser

    add_train_parser(sub, store_help)  # agl train
    add_export_model_parser(sub)  # agl export-model
    export_ = sub.add_parser("export", help="build a LightningRL batch from stored rollouts; write JSONL or Parquet")
    export_.add_argument("out", help="output file (.jsonl, or .parquet with pyarrow installed)")
    export_.add_argument("--format", choices=["jsonl", "parquet"], help="default: from the file suffix")
    export_.add_argument("--config", default="{}", help="LightningRL settings as JSON, or @file.json")
    export_.add_argument("--adapter", dest="adapter_settings", action="append", default=[], metavar="KEY=VALUE",
                         help="one LightningRL setting, as for agl train (over --config), e.g. --adapter aggregate=true")
    export_.add_argument("--agent-match", help="regex on agent names (overrides the config's agent_match)")
    export_.add_argument("--status", action="append", choices=["succeeded", "failed", "cancelled"],
                         help="rollouts to read (repeatable; default: every finished rollout); a task group with a "
                         "rollout still queued or running is left out, and the command says so")
    export_.add_argument("--mode", choices=["train", "val", "all"], default="train",
                         help="rollouts of this mode (default: train; 'all': train and val, grouped apart); each "
                         "record has its rollout's mode")
    export_.add_argument("--limit", type=positive_int, metavar="N",
                         help="read at most N rollouts, in whole task groups (a GRPO group is never cut)")
    export_.add_argument("--store", default=None, help=store_help)
    export_.set_defaults(func=cmd_export)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from agl.errors import AglError

    try:
        return int(args.func(args) or 0)
    except AglError as exc:
        print(f"agl: {exc}", file=sys.stderr)
        return 2
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc) and "busy" not in str(exc):
            raise
        print(f"agl: the SQLite store is locked ({exc}): another process (a trainer or runner in a long transaction, "
              "a sqlite3 shell with an open transaction) has held its write lock for longer than agl waits (30 s); "
              "run the command again once that process is done, or stop it", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `agl store rollouts | head`: the reader left; say nothing more, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush too
        return 128 + signal.SIGPIPE
    finally:
        _close_opened_stores()


if __name__ == "__main__":
    sys.exit(main())
