"""`agl dev` as a user runs it: the `agl` console script in a project folder, and its one-line answers."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import agl
from agl.cli import main as agl_main
from agl.cli.common import load_agent
from agl.store import SqliteLightningStore

AGL = Path(sys.executable).with_name("agl")  # the console script, which puts its own folder on sys.path, not "."

AGENTS = """
import functools
import agl

def agent(task):
    return float(task["n"])

def with_prefix(prefix, task):
    return 1.0

partial_agent = functools.partial(with_prefix, "p")
partial_needing_more = functools.partial(lambda task, k, extra: 1.0, k=3)

def uses_llm(task, llm):
    return 1.0

@agl.rollout
def asks(task, llm):
    from openai import OpenAI

    question = [{"role": "user", "content": f"What is {task['n']} plus 2?"}]
    OpenAI(base_url=llm.get_base_url(), api_key="x").chat.completions.create(model=llm.model, messages=question)
    return float(task["n"])
"""


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "my_agent.py").write_text(AGENTS)
    (tmp_path / "broken_agent.py").write_text("import a_dependency_that_is_not_installed\n")
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"n": n}) + "\n" for n in range(3)))
    return tmp_path


def agl_cli(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(AGL), *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(project)},
    )


def test_agl_dev_imports_a_module_of_the_current_folder_as_python_m_does(project: Path) -> None:
    """README's `agl dev MODULE:AGENT` in the project folder gave ModuleNotFoundError with a full traceback."""
    done = agl_cli(
        project, "dev", "my_agent:agent", "--data", "tasks.jsonl", "--store", "s.db", "--runner-mode", "thread"
    )
    assert done.returncode == 0, done.stderr
    with SqliteLightningStore(project / "s.db") as store:
        assert sorted(r.final_reward for r in store.query_rollouts()) == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "target, message",
    [
        (
            "my_agentz:agent",
            r"agl: cannot import module 'my_agentz' for 'my_agentz:agent': no module named 'my_agentz' "
            r"in the current folder \(.*\) or on sys.path .*; pass MODULE:NAME for an importable module, or "
            r"path/to/file.py:NAME for a file \(e.g. my_agentz.py:agent\)",
        ),
        ("nopackage.sub:agent", r"agl: cannot import module 'nopackage.sub' .*no module named 'nopackage'.*"),
        (
            "my_agent:agnet",
            r"agl: my_agent \(.*my_agent.py\) has no attribute 'agnet': pass MODULE:NAME with the name "
            r"of a LitAgent or rollout function defined in it",
        ),
    ],
)
def test_a_module_or_attribute_that_does_not_exist_is_one_line(project: Path, target: str, message: str) -> None:
    done = agl_cli(project, "dev", target, "--data", "tasks.jsonl", "--store", "s.db")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert re.fullmatch(message, done.stderr.strip()), done.stderr


def test_a_module_that_fails_inside_keeps_its_own_traceback(project: Path) -> None:
    """A missing dependency of a module that exists is the user's module's error, not a wrong MODULE name."""
    done = agl_cli(project, "dev", "broken_agent:agent", "--data", "tasks.jsonl", "--store", "s.db")
    assert done.returncode == 1 and "Traceback" in done.stderr
    assert "No module named 'a_dependency_that_is_not_installed'" in done.stderr
    assert "cannot import module" not in done.stderr


def _dev_on_the_first_task(project: Path, agent: str, store: Path) -> int:
    """``agl dev`` of my_agent.py's ``agent`` on the first task, in thread runners, into ``store``: its status."""
    target = f"{project / 'my_agent.py'}:{agent}"
    first_task_in_threads = ["--limit", "1", "--runner-mode", "thread"]
    return agl_main(
        ["dev", target, "--data", str(project / "tasks.jsonl"), *first_task_in_threads, "--store", str(store)]
    )


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--limit", "0", "must be at least 1, got 0"),
        ("--limit", "-1", "must be at least 1, got -1"),
        ("--n-runners", "-1", "must be at least 0, got -1"),
        ("--limit", "two", "invalid positive_int value: 'two'"),
    ],
)
def test_agl_dev_refuses_counts_out_of_range_as_usage_errors(
    project: Path, capsys: pytest.CaptureFixture, flag: str, value: str, message: str
) -> None:
    """--limit 0 ran every task, --limit -1 all but the last; --n-runners -1 was a ValueError traceback."""
    with pytest.raises(SystemExit) as exited:
        agl_main(["dev", f"{project / 'my_agent.py'}:agent", "--data", str(project / "tasks.jsonl"), flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_agl_dev_limit_runs_the_first_n_tasks(project: Path) -> None:
    store = project / "s.db"
    assert _dev_on_the_first_task(project, "agent", store) == 0
    with SqliteLightningStore(store) as opened:
        assert [r.input for r in opened.query_rollouts()] == [{"n": 0}]


def test_an_llm_agent_without_a_model_is_told_the_cli_flags(project: Path) -> None:
    """The rollout's error said "pass initial_resources={...} to the Trainer", Python advice for a CLI user."""
    store = project / "s.db"
    assert _dev_on_the_first_task(project, "uses_llm", store) == 1
    with SqliteLightningStore(store) as opened:
        (rollout,) = opened.query_rollouts()
    assert rollout.status == "failed" and rollout.error
    assert "with `agl dev`, pass --endpoint URL --model NAME (or --fake-model" in rollout.error
    assert "initial_resources={'main_llm': agl.LLM(...)} to the Trainer" in rollout.error  # the Python way too


def test_a_functools_partial_agent_is_named_in_its_error(project: Path) -> None:
    """Building the error message raised AttributeError: 'functools.partial' object has no attribute '__name__'."""
    agent = load_agent(f"{project / 'my_agent.py'}:partial_agent")  # prefix is bound: only the task is left
    assert agent.rollout({"n": 1}, {}, None) == 1.0  # type: ignore[arg-type]
    with pytest.raises(
        SystemExit,
        match=r"functools.partial\(<lambda>, \.\.\.\) has arguments \['k', 'extra'\] that agl "
        r"cannot supply",
    ):
        load_agent(f"{project / 'my_agent.py'}:partial_needing_more")

    def two(task: object, database: object) -> float:
        return 1.0

    with pytest.raises(
        TypeError,
        match=r"@agl.rollout function functools.partial\(two, \.\.\.\) has arguments "
        r"\['database'\]",
    ):
        agl.rollout(functools.partial(two))
    with pytest.raises(TypeError, match=r"functools.partial\(two, \.\.\.\) must take the task"):
        agl.rollout(functools.partial(two, 1, 2))


def test_inspect_of_an_attempt_that_does_not_exist_gives_cli_advice(tmp_path: Path) -> None:
    """It said "use the attempt id returned by dequeue_rollout (rollout.attempt.attempt_id)", advice for the API."""
    db = tmp_path / "s.db"
    with SqliteLightningStore(db) as store:
        store.enqueue_rollout({"q": 1})
        claimed = store.dequeue_rollout("runner-1")
        assert claimed is not None and claimed.attempt is not None
    with pytest.raises(SystemExit) as exited:
        agl_main(["inspect", claimed.rollout_id, "--attempt", "at-nope", "--store", str(db)])
    assert str(exited.value) == (
        f"agl: rollout {claimed.rollout_id} has no attempt 'at-nope': pass --attempt latest (the default), "
        f"--attempt all, or one of its attempt ids ({claimed.attempt.attempt_id})"
    )


def test_agl_dev_with_no_runners_says_at_once_how_to_start_them(project: Path) -> None:
    """`agl dev --n-runners 0 --store s.db` waited in silence (a minute before the first warning): it now says
    what it waits for and the `agl runner` command, which then runs the tasks."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(project)}
    log = project / "dev.err"
    with log.open("w") as err:
        dev = subprocess.Popen(
            [str(AGL), "dev", "my_agent:agent", "--data", "tasks.jsonl", "--n-runners", "0", "--store", "s.db"],
            cwd=project,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    runner = None
    try:
        hint = (
            f"agl dev: --n-runners 0: no runner starts here; waiting for runners started elsewhere, e.g. in another "
            f"terminal: agl runner --store {project / 's.db'} --agent my_agent:agent"
        )
        deadline = time.monotonic() + 30
        while hint not in log.read_text() and time.monotonic() < deadline and dev.poll() is None:
            time.sleep(0.2)
        assert hint in log.read_text(), log.read_text()
        runner = subprocess.Popen(
            [
                str(AGL),
                "runner",
                "--store",
                str(project / "s.db"),
                "--agent",
                "my_agent:agent",
                "--runner-mode",
                "thread",
            ],
            cwd=project,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        out, _ = dev.communicate(timeout=120)
        assert dev.returncode == 0, log.read_text()
        assert "inspect one: agl inspect" in out
    finally:
        for proc in (dev, runner):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)


def test_agl_dev_with_no_runners_refuses_a_store_in_memory(project: Path) -> None:
    done = agl_cli(project, "dev", "my_agent:agent", "--data", "tasks.jsonl", "--n-runners", "0", "--store", "memory")
    assert done.returncode == 1 and done.stderr.strip() == (
        "agl: --n-runners 0 waits for runners started elsewhere, which cannot reach a store in memory: pass "
        "--store FILE.db (or a store server's http://...), or --n-runners 1 or more"
    )


def test_store_hints_never_show_a_database_password() -> None:
    """`agl dev` ends with an `agl inspect ... --store URL` hint (and --n-runners 0 with an `agl runner` one):
    a PostgreSQL URL was printed with its password, into terminals and CI logs."""
    from agl.cli.common import store_argument

    shown = store_argument("postgresql://agl:s3cr3t@db.example:5432/agl")
    assert "s3cr3t" not in shown and "db.example" in shown
    assert store_argument("http://u:tok@host:8000") == "http://host:8000"
    assert store_argument("/runs/my store.db") == "'/runs/my store.db'"


def test_agl_dev_runs_are_mode_dev_and_exported_only_when_asked(project: Path) -> None:
    """`agl dev` stored its runs as mode train, and `agl export` then read them as training data: they are
    mode dev now, left out of the default export (which says how to ask) and exported with --mode dev."""
    fake_model_in_threads = ["--fake-model", "--runner-mode", "thread"]
    dev = agl_cli(project, "dev", "my_agent:asks", "--data", "tasks.jsonl", "--store", "s.db", *fake_model_in_threads)
    assert dev.returncode == 0, dev.stderr
    with SqliteLightningStore(project / "s.db") as store:
        assert [(r.task_id, r.mode) for r in store.query_rollouts()] == [(f"task-{n}", "dev") for n in range(3)]
        assert store.query_rollouts(mode="train") == []
    listed = agl_cli(project, "store", "rollouts", "--store", "s.db")
    assert [line.split()[2] for line in listed.stdout.splitlines()[1:]] == ["dev"] * 3
    unasked = agl_cli(project, "export", "out.jsonl", "--store", "s.db")
    assert unasked.returncode == 1 and not (project / "out.jsonl").exists()
    assert unasked.stderr.strip().splitlines()[-1] == (
        "agl: no samples to export from 0 rollouts; no finished train rollout was read, and the store has dev "
        "rollouts: --mode dev (or --mode all) exports them (out.jsonl was not written)"
    )
    asked = agl_cli(project, "export", "out.jsonl", "--store", "s.db", "--mode", "dev")
    assert asked.returncode == 0, asked.stderr
    records = [json.loads(line) for line in (project / "out.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["mode"]) for r in records) == [(f"task-{n}", "dev") for n in range(3)]
