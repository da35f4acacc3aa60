"""Acceptance check for "Agent Lightning code runs unchanged": run Agent Lightning v0.3.0's own examples on agl.

It copies the target examples to a temporary folder, changes ONLY their import lines (``agentlightning`` ->
``agl``), prepares what they need from the outside (a fake OpenAI server, small data files, store servers, a
``uvx`` stand-in) and runs each entry point with a timeout. Each gets PASS, OUT-OF-REACH (it stopped at one of
its asserts on Agent Lightning's own span format, which agl deliberately does not reproduce), REFUSED (agl's
one-line error for a peer feature it deliberately lacks) or FAIL. The exit status is 1 if any FAIL.

    git -C /work/.mirror/microsoft+agent-lightning/repo archive v0.3.0 agentlightning examples docs \\
        | tar -x -C /tmp/al-peer
    .venv-peer/bin/python tools/agent_lightning_examples.py --peer /tmp/al-peer [--only apo] [--timeout 300]

Run it with the Python of an environment that has agl and the examples' libraries (.venv-peer: see
docs/agent-lightning.md); the examples run with the same Python.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from agl.store import open_store
from agl.testing.fake_openai import FakeOpenAIServer
from agl.testing.fake_policy import FakeReply

EXAMPLE_FOLDERS = ("spider", "calc_x", "apo", "minimal")

# (pattern, replacement): the only edits made to the examples, applied to import lines only.
IMPORT_REWRITES: Tuple[Tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^(\s*)import agentlightning as agl\b"), r"\1import agl"),
    (re.compile(r"^(\s*)from agentlightning(?=[.\s])"), r"\1from agl"),
    (re.compile(r"^(\s*)import agentlightning\b"), r"\1import agl"),
)
IMPORT_LINE = re.compile(r"^\s*(import|from)\s+agentlightning\b")
BANNER = re.compile(r"^=+ (.+?) =+$")  # a heading an example prints above a value

# Tiny data sets the examples read; the fake model answers them correctly, so rewards are not all zero.
SPIDER_DB = "concert_singer"
SPIDER_TASKS = (
    ("How many singers do we have?", "SELECT count(*) FROM singer"),
    ("What are the names of the singers from France?", "SELECT name FROM singer WHERE country = 'France'"),
)
SPIDER_SCHEMA = "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER);"
SPIDER_ROWS = ((1, "Joe Sharp", "Netherlands", 52), (2, "Timbaland", "United States", 32), (3, "Rose", "France", 41))
CALC_TASKS = (  # question, the expression the model sends to the calculator, the expected result
    ("What is 12 multiplied by 15?", "12 * 15", "180"),
    ("What is the square root of 256?", "sqrt(256)", "16"),
    ("What is 7 plus 8?", "7 + 8", "15"),
    ("What is 100 divided by 4?", "100 / 4", "25"),
)


@dataclass(frozen=True)
class Example:
    """One entry point to run, with the services it expects to find."""

    folder: str
    argv: Tuple[str, ...]
    store_port: Optional[int] = None  # `agl store serve` on this port first (the example hard-codes it)
    companion: Tuple[str, ...] = ()  # a second process of the same example, started first, stopped after
    companion_port: Optional[int] = None  # wait until the companion listens here
    store_url: Optional[str] = None  # the store to report on (else the example's AGL_STORE file, if written)
    expect_error: Optional[str] = None  # must end with a one-line error containing this (no traceback)
    out_of_reach: Tuple[str, ...] = ()  # its asserts on Agent Lightning's own span format

    @property
    def name(self) -> str:
        return " ".join((f"{self.folder}/{self.argv[0]}", *self.argv[1:]))


AL_SPAN_ASSERTS = ("agentlightning.annotation", "agentlightning.reward", "agentops", "raw_gen_ai_request")
PROXY_SPAN_ASSERTS = (*AL_SPAN_ASSERTS, "len(spans) > 1")  # AL's proxy writes several spans per call, agl one
REFUSAL = "(Agent Lightning) is not in agl"  # how agl words a deliberate refusal of a peer name
EXAMPLES = (
    Example("spider", ("sql_agent.py",)),
    Example("calc_x", ("calc_agent.py",)),
    Example(
        "calc_x",
        ("train_calc_agent.py", "--train-file", "data/train.parquet", "--val-file", "data/test.parquet"),
        expect_error="verl",
    ),
    Example("apo", ("room_selector.py",)),
    Example("apo", ("room_selector_apo.py",)),
    Example("apo", ("apo_debug.py", "--mode", "runner")),
    Example("apo", ("apo_debug.py", "--mode", "hook")),
    Example("apo", ("apo_debug.py", "--mode", "trainer")),
    Example(
        "apo",
        ("apo_custom_algorithm.py", "algo"),
        store_port=4747,
        companion=("apo_custom_algorithm.py", "runner"),
        store_url="http://127.0.0.1:4747",
    ),
    Example("apo", ("apo_custom_algorithm_trainer.py",)),
    Example("minimal", ("write_traces.py", "otel"), out_of_reach=AL_SPAN_ASSERTS),
    Example("minimal", ("write_traces.py", "operation"), out_of_reach=AL_SPAN_ASSERTS),
    Example(
        "minimal",
        ("write_traces.py", "otel", "--use-client"),
        store_port=45993,
        store_url="http://127.0.0.1:45993",
        out_of_reach=AL_SPAN_ASSERTS,
    ),
    Example(
        "minimal",
        ("write_traces.py", "operation", "--use-client"),
        store_port=45993,
        store_url="http://127.0.0.1:45993",
        out_of_reach=AL_SPAN_ASSERTS,
    ),
    Example("minimal", ("write_metrics.py", "--duration", "3", "--prom-host", "127.0.0.1", "--prom-port", "0")),
    Example(
        "minimal",
        ("llm_proxy.py", "test", "gpt-4.1-mini"),
        companion=("llm_proxy.py", "openai", "gpt-4.1-mini"),
        companion_port=43886,
        store_url="http://127.0.0.1:43887",
        out_of_reach=PROXY_SPAN_ASSERTS,
    ),
)


@dataclass
class Outcome:
    """What one run gave: the verdict, the first failure and what it stored."""

    example: Example
    status: str
    seconds: float
    detail: str = ""
    stored: str = ""
    tail: List[str] = field(default_factory=list)


# --- the examples' source: copy, rewrite imports, check nothing else changed ---------------------------------


def rewrite_line(line: str) -> str:
    """The line with ``agentlightning`` replaced by ``agl`` if it is an import line; any other line unchanged."""
    for pattern, replacement in IMPORT_REWRITES:
        if pattern.match(line):
            return pattern.sub(replacement, line, count=1)
    return line


def rewrite_imports(path: Path) -> int:
    """Rewrite one file's import lines in place; return how many changed, after checking that only they did."""
    old = path.read_text(encoding="utf-8").splitlines(keepends=True)
    new = [rewrite_line(line) for line in old]
    changed = [line for line in difflib.ndiff(old, new) if line.startswith("- ")]
    if len(new) != len(old) or any(not IMPORT_LINE.match(line[2:]) for line in changed):
        raise SystemExit(f"{path}: the import rewrite changed a line that is not an import: fix IMPORT_REWRITES")
    path.write_text("".join(new), encoding="utf-8")
    return len(changed)


def copy_examples(peer: Path, work: Path) -> Path:
    """Copy the target folders of ``peer/examples`` under ``work`` and rewrite their imports, printing counts."""
    source = peer / "examples"
    if not all((source / folder).is_dir() for folder in EXAMPLE_FOLDERS):
        raise SystemExit(
            f"{source} lacks {', '.join(EXAMPLE_FOLDERS)}: make it with `git -C "
            f"/work/.mirror/microsoft+agent-lightning/repo archive v0.3.0 examples docs | tar -x -C {peer}`"
        )
    target = work / "examples"
    for folder in EXAMPLE_FOLDERS:
        shutil.copytree(source / folder, target / folder)
    print("Import lines rewritten (nothing else changed):")
    for path in sorted(target.rglob("*.py")):
        count = rewrite_imports(path)
        if count:
            print(f"  {path.relative_to(target)}: {count}")
    return target


# --- the environment: data files, the uvx stand-in, the fake model ------------------------------------------


def write_spider_data(root: Path) -> None:
    """A Spider-like folder: dev.parquet and one database with its schema.sql (train and test copies)."""
    import pandas as pd

    root.mkdir(parents=True)
    rows = [{"db_id": SPIDER_DB, "question": q, "query": sql} for q, sql in SPIDER_TASKS]
    pd.DataFrame(rows).to_parquet(root / "dev.parquet")
    for folder in ("database", "test_database"):
        db_dir = root / folder / SPIDER_DB
        db_dir.mkdir(parents=True)
        (db_dir / "schema.sql").write_text(SPIDER_SCHEMA + "\n", encoding="utf-8")
        with sqlite3.connect(db_dir / f"{SPIDER_DB}.sqlite") as db:
            db.execute(SPIDER_SCHEMA)
            db.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", SPIDER_ROWS)
        db.close()


def write_calc_data(folder: Path) -> None:
    """calc_x's data/train.parquet and data/test.parquet, with the columns of its MathProblem."""
    import pandas as pd

    rows = [
        {"id": f"calc-{i}", "question": q, "chain": "", "result": result, "source": "agl-check"}
        for i, (q, _, result) in enumerate(CALC_TASKS)
    ]
    (folder / "data").mkdir()
    for name in ("train", "test"):
        pd.DataFrame(rows).to_parquet(folder / "data" / f"{name}.parquet")


def write_uvx_shim(bin_dir: Path) -> None:
    """calc_x starts its MCP calculator with `uvx mcp-server-calculator`: run the pip-installed one instead."""
    calculator = Path(sys.executable).parent / "mcp-server-calculator"
    if not calculator.exists():
        raise SystemExit(f"{calculator} is missing: pip install mcp-server-calculator into this environment")
    bin_dir.mkdir()
    shim = bin_dir / "uvx"
    shim.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = mcp-server-calculator ]; then shift; exec "{calculator}" "$@"; fi\n'
        'echo "uvx stand-in: only mcp-server-calculator is installed here, not $1" >&2\n'
        "exit 2\n",
        encoding="utf-8",
    )
    shim.chmod(0o755)


def message_text(content: Any) -> str:
    """The text of a chat message's content (a string or a list of typed parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return ""


def schema_sample(schema: Mapping[str, Any]) -> Dict[str, Any]:
    """An object that satisfies a flat JSON schema, for ``response_format`` requests (the judges' scores)."""
    samples = {"number": 0.5, "integer": 1, "boolean": True, "array": [], "object": {}}
    return {
        name: samples.get(str(prop.get("type")), "judged by agl's fake model")
        for name, prop in (schema.get("properties") or {}).items()
    }


def model_answer(body: Mapping[str, Any]) -> Optional[FakeReply]:
    """The answers the examples need from a real model; None leaves the request to the fake's default policy.

    The examples parse their model's output (a JSON judgement, a number, a fenced SQL query, a calculator
    call): an answer of the right shape lets them run to the end, as they do against OpenAI.
    """
    messages = [m for m in body.get("messages") or [] if isinstance(m, Mapping)]
    if not messages:
        return None
    users = [message_text(m.get("content")) for m in messages if m.get("role") == "user"]
    system = " ".join(message_text(m.get("content")) for m in messages if m.get("role") == "system")
    last_user = users[-1] if users else ""
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") == "json_schema":
        return FakeReply(content=json.dumps(schema_sample(response_format["json_schema"].get("schema") or {})))
    if "Return only a number between 0 and 1" in last_user:
        return FakeReply(content="0.75")
    if last_user.strip() == "Hello, what's your name?":
        return FakeReply(content="Hello! I'm ChatGPT, as played by agl's fake OpenAI server.")
    return spider_answer(system, last_user) or calc_answer(body, messages, last_user)


def spider_answer(system: str, last_user: str) -> Optional[FakeReply]:
    """sql_agent.py: the gold query in a fenced block when asked to write one; "correct" when asked to check."""
    if "Double check the" in system:
        return FakeReply(content="No mistakes found.\n\nTHE QUERY IS CORRECT.")
    if "GENERATED QUERY" in system or "REWRITTEN QUERY" in system:
        gold = next((sql for q, sql in SPIDER_TASKS if f"Question: {q}" in last_user), "SELECT 1")
        return FakeReply(content=f"```sqlite\n{gold}\n```")
    return None


def calc_answer(body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], last_user: str) -> Optional[FakeReply]:
    """calc_agent.py: call the calculator with the question's expression, then answer in its ### format."""
    if "### ANSWER" not in last_user:
        return None
    if messages[-1].get("role") == "tool":
        number = re.search(r"-?\d+(?:\.\d+)?", message_text(messages[-1].get("content")))
        return FakeReply(content=f"### ANSWER: {number.group(0) if number else 'unknown'} ###")
    tools = [t.get("function", {}).get("name") for t in body.get("tools") or [] if isinstance(t, Mapping)]
    expression = next((expr for q, expr, _ in CALC_TASKS if q in last_user), None)
    if "calculate" in tools and expression:
        return FakeReply(tool_calls=[{"name": "calculate", "arguments": {"expression": expression}}])
    return None


class ExampleModel(FakeOpenAIServer):
    """agl's fake OpenAI server with :func:`model_answer` in front of its default policy.

    The server records each request and then takes its reply, with no ``await`` in between on its one event
    loop thread, so the body stashed by ``_record`` is the one ``_next_reply`` answers.
    """

    _body: Any = None

    def _record(self, request: Any, body: Any) -> None:
        super()._record(request, body)
        self._body = body

    def _next_reply(self) -> Optional[FakeReply]:
        scripted = super()._next_reply()
        if scripted is not None or not isinstance(self._body, Mapping):
            return scripted
        return model_answer(self._body)


# --- running ---------------------------------------------------------------------------------------------------


def wait_for_port(port: int, seconds: float, process: Optional[subprocess.Popen[bytes]] = None) -> None:
    """Return once 127.0.0.1:port accepts connections; fail if it does not in time or the process exits."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the process for port {port} exited with {process.returncode} before listening")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds:.0f} s")


def start(argv: Sequence[str], cwd: Path, env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start a process in its own session (so it and its children can be stopped together), output to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv), cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    """Stop a process started by :func:`start` and its children: SIGTERM, then SIGKILL after 10 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def last_traceback_line(lines: Sequence[str], file_name: str) -> str:
    """The source line of the last frame in ``file_name`` of the output's last traceback ("" if none)."""
    frame = re.compile(r'^\s*File ".*' + re.escape(file_name) + r'", line \d+')
    hits = [i for i, line in enumerate(lines) if frame.match(line)]
    return lines[hits[-1] + 1].strip() if hits and hits[-1] + 1 < len(lines) else ""


def first_failure(lines: Sequence[str]) -> str:
    """The error a failed run ended with: the last line that names an exception, else the last line."""
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b|^\w+Error:", line.strip()):
            return line.strip()
    return lines[-1].strip() if lines else "(no output)"


def verdict(example: Example, code: Optional[int], lines: Sequence[str]) -> Tuple[str, str]:
    """PASS, OUT-OF-REACH or FAIL, with the failure (or the expected error) as detail."""
    if code is None:
        return "FAIL", "timed out"
    text = "\n".join(lines)
    if example.expect_error is not None:  # the example's own call raises agl's error: Python adds a traceback
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        if code != 0 and last.startswith("agl.") and example.expect_error in last.lower():
            return "PASS", f"stops with agl's one-line error{' (after a traceback)' * ('Traceback' in text)}: {last}"
        return "FAIL", f"expected agl's one-line error naming {example.expect_error!r}; got: {first_failure(lines)}"
    if code == 0:
        return "PASS", ""
    failed_at = last_traceback_line(lines, example.argv[0])
    if failed_at.startswith("assert") and any(marker in failed_at for marker in example.out_of_reach):
        return "OUT-OF-REACH", f"stops at its assert on AL's span format: {failed_at}"
    error = first_failure(lines)
    if REFUSAL in error:
        return "REFUSED", error
    return "FAIL", error + (f"  [at: {failed_at}]" if failed_at else "")


def describe_store(address: str) -> str:
    """Rollouts (by status), spans and final rewards in a store, in one line."""
    store = open_store(address, create=False)
    try:
        rollouts = store.query_rollouts()
        statuses = Counter(r.status for r in rollouts)
        spans = sum(len(store.query_spans(r.rollout_id, None)) for r in rollouts)
        rewards = [r.final_reward for r in rollouts if r.final_reward is not None]
    finally:
        store.close()
    status_text = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
    shown = ", ".join(f"{r:g}" for r in rewards[:8]) + (" ..." if len(rewards) > 8 else "")
    return f"store: {len(rollouts)} rollouts ({status_text}), {spans} spans, rewards [{shown}]"


def describe_printout(lines: Sequence[str]) -> str:
    """What the example printed about rewards, for examples whose store lives only in their own process.

    A value printed under a banner (``=== Judge Score ===`` then ``0.5``) is shown as ``Judge Score: 0.5``;
    banners, when there are some, are shown alone: the other lines quote the prompts.
    """
    rewarding = re.compile(r"reward|score", re.IGNORECASE)
    banners = [
        f"{match.group(1)}: {value.strip()}"
        for line, value in zip(lines, lines[1:])
        if (match := BANNER.match(line.strip())) and rewarding.search(line)
    ]
    found = banners or [line.strip() for line in lines if rewarding.search(line)]
    return "printed: " + (" | ".join(line[:100] for line in found[-3:]) if found else "(nothing about rewards)")


def stored(example: Example, agl_store: Path, lines: Sequence[str]) -> str:
    """The store's contents when the script can reach it, else the example's own printout."""
    address = example.store_url or (str(agl_store) if agl_store.exists() else None)
    if address is None:
        return describe_printout(lines)
    try:
        return describe_store(address)
    except Exception as exc:  # noqa: BLE001 - the report says why the store could not be read, and goes on
        return f"store {address} unreadable ({type(exc).__name__}: {exc}); " + describe_printout(lines)


def run_example(example: Example, folder: Path, env: Dict[str, str], logs: Path, timeout: float) -> Outcome:
    """Start the example's services, run its entry point, read what it stored, stop everything."""
    slug = re.sub(r"[^\w]+", "_", example.name).strip("_")
    log, agl_store = logs / f"{slug}.log", logs / f"{slug}.db"
    env = {**env, "AGL_STORE": str(agl_store)}
    services: List[subprocess.Popen[bytes]] = []
    service_logs: List[Path] = []
    began = time.monotonic()
    code: Optional[int] = None
    try:
        if example.store_port is not None:
            store_db = logs / f"{slug}-server.db"
            serve = [
                sys.executable,
                "-m",
                "agl.cli",
                "store",
                "serve",
                "--store",
                str(store_db),
                "--host",
                "127.0.0.1",
                "--port",
                str(example.store_port),
                "--insecure-no-auth",
            ]
            service_logs.append(logs / f"{slug}-store.log")
            services.append(start(serve, folder, env, service_logs[-1]))
            wait_for_port(example.store_port, 60, services[-1])
        if example.companion:
            service_logs.append(logs / f"{slug}-companion.log")
            services.append(start([sys.executable, *example.companion], folder, env, service_logs[-1]))
            if example.companion_port is not None:
                wait_for_port(example.companion_port, 120, services[-1])
        main = start([sys.executable, *example.argv], folder, env, log)
        try:
            code = main.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(main)
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        status, detail = verdict(example, code, lines)
        ran = status in ("PASS", "OUT-OF-REACH") and example.expect_error is None
        report = stored(example, agl_store, lines) if ran else ""
        tail = lines[-15:]
        if status == "FAIL" and example.companion:  # the companion's error is often the first failure
            companion = service_logs[-1].read_text(errors="replace").splitlines()
            tail += [f"--- {' '.join(example.companion)} (companion) ---", *companion[-12:]]
        return Outcome(example, status, time.monotonic() - began, detail, report, tail)
    except RuntimeError as exc:  # a service did not come up: say which, with the end of its log
        tail = service_logs[-1].read_text(errors="replace").splitlines()[-25:] if service_logs else []
        return Outcome(example, "FAIL", time.monotonic() - began, f"service: {exc}", "", tail)
    finally:
        for service in reversed(services):
            stop(service)


def base_env(model_url: str, work: Path) -> Dict[str, str]:
    """The environment every example runs in: the fake model as OpenAI, the uvx stand-in first on PATH."""
    bin_dirs = [str(work / "bin"), str(Path(sys.executable).parent)]
    return {
        **os.environ,
        "OPENAI_BASE_URL": model_url,
        "OPENAI_API_BASE": model_url,
        "OPENAI_API_KEY": "sk-agl-fake",
        "VERL_SPIDER_DATA_DIR": str(work / "spider_data"),
        "PATH": os.pathsep.join([*bin_dirs, os.environ.get("PATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "200",  # rich's log lines, unwrapped
    }


def print_outcome(outcome: Outcome) -> None:
    print(f"{outcome.status:<12} {outcome.example.name}  ({outcome.seconds:.0f} s)")
    for text in (outcome.detail, outcome.stored):
        if text:
            print(f"             {text}")
    if outcome.status == "FAIL":
        print("             last lines:")
        for line in outcome.tail:
            print(f"               | {line}")
    sys.stdout.flush()


def selected(only: Sequence[str]) -> Iterator[Example]:
    return (e for e in EXAMPLES if not only or any(word in e.name for word in only))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", type=Path, required=True, help="folder holding Agent Lightning v0.3.0's examples/")
    parser.add_argument("--only", nargs="*", default=[], help="run the examples whose name contains one of these")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each entry point may run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, stores) and say where")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    examples = list(selected(args.only))
    if not examples:
        raise SystemExit(f"no example matches {args.only}: names are {[e.name for e in EXAMPLES]}")
    work = Path(tempfile.mkdtemp(prefix="agl-al-examples-"))
    try:
        outcomes = run_all(args.peer.resolve(), work, examples, args.timeout)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        rows = [
            {
                "example": o.example.name,
                "status": o.status,
                "seconds": round(o.seconds, 1),
                "detail": o.detail,
                "stored": o.stored,
            }
            for o in outcomes
        ]
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    counts = Counter(o.status for o in outcomes)
    print("\n" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" of {len(outcomes)} runs")
    return 0 if counts["FAIL"] == 0 else 1


def run_all(peer: Path, work: Path, examples: Sequence[Example], timeout: float) -> List[Outcome]:
    """Prepare the copies and the environment once, then run each example in turn."""
    target = copy_examples(peer, work)
    write_spider_data(work / "spider_data")
    write_calc_data(target / "calc_x")
    write_uvx_shim(work / "bin")
    logs = work / "logs"
    logs.mkdir()
    outcomes = []
    with ExampleModel() as model:
        print(f"\nFake OpenAI server: {model.base_url}\n")
        env = base_env(model.base_url, work)
        for example in examples:
            outcome = run_example(example, target / example.folder, env, logs, timeout)
            print_outcome(outcome)
            outcomes.append(outcome)
    return outcomes


if __name__ == "__main__":
    sys.exit(main())
