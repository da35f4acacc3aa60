"""Issue 38, parts 1-2: the web view (agl.ui) over a SQLite store filled by a real Trainer run against the fake
OpenAI server (tests/ui_run.py), through FastAPI's TestClient, a store server's HTTP client, and the real
``agl ui`` and ``agl store serve`` processes; and the same pages over a real PostgreSQL store."""

from __future__ import annotations

import html
import re
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List

import httpx
import pytest
from fastapi.testclient import TestClient
from ui_run import SCRIPT, TASKS, fill_store, solver

import agl
from agl.cli import main
from agl.lightningrl import LightningRL
from agl.store import LightningStore, SqliteLightningStore, open_store
from agl.store.http.client import RemoteLightningStore
from agl.store.http.server import ServerThread, TokenSet, create_app
from agl.testing import FakeOpenAIServer
from agl.testing.waiting import eventually
from agl.types import Rollout, Span
from agl.ui import create_ui
from agl.ui.html import number

TOKEN = "ui-secret"
ROW = re.compile(r'href="(?:/ui)?/rollouts/(ro-[0-9a-f]+)"')


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory, _fake_openai_server: FakeOpenAIServer) -> Path:
    """A store filled once for the module: ``Trainer.dev`` over the tasks, three steps and an evaluation."""
    path = tmp_path_factory.mktemp("ui") / "store.db"
    _fake_openai_server.reset()
    fill_store(path, _fake_openai_server.base_url)
    return path


@pytest.fixture
def store(db: Path) -> Iterator[LightningStore]:
    with SqliteLightningStore(db) as opened:
        yield opened


@pytest.fixture
def client(store: LightningStore) -> TestClient:
    return TestClient(create_ui(store))


def rows(html: str) -> List[str]:
    return ROW.findall(html)


def first_dev_rollout(store: LightningStore) -> str:
    """The dev rollout of the task whose question holds a <script> tag."""
    return next(r.rollout_id for r in store.query_rollouts(mode="dev") if r.task_id == TASKS[0]["id"])


def test_the_list_shows_every_rollout_and_filters_and_pages_through_the_store(client, store):
    everything = store.query_rollouts()
    page = client.get("/").text
    assert rows(page) == [r.rollout_id for r in everything]
    assert f"1&ndash;{len(everything)} of {len(everything)}" in page
    val = client.get("/", params={"mode": "val"}).text
    assert rows(val) == [r.rollout_id for r in everything if r.mode == "val"]
    second = client.get("/", params={"limit": 10, "offset": 10}).text
    assert rows(second) == [r.rollout_id for r in everything[10:20]]
    assert "offset=20" in second and "offset=0" in second  # next, and first/previous
    last = client.get("/", params={"limit": 10, "offset": 30}).text
    assert rows(last) == [r.rollout_id for r in everything[30:]] and "next" not in last


def test_a_rollout_shows_prompt_response_tool_call_result_tokens_and_reward_escaped(client, store):
    rollout_id = first_dev_rollout(store)
    page = client.get(f"/rollouts/{rollout_id}").text
    llm = [s for s in store.query_spans(rollout_id) if s.kind == "llm"]
    answer = llm[-1].attributes[agl.semconv.OUTPUT_MESSAGES]
    assert "The answer is 10." in answer and "The answer is 10." in page
    assert "tool call add(" in page and "<b>add</b>" in page  # the call, and the tool span with its result
    assert f"prompt {len(llm[-1].attributes[agl.semconv.PROMPT_TOKEN_IDS])} tokens" in page
    assert "reward <b>1.0</b> (episode)" in page
    assert SCRIPT not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def highlighted(page: str) -> List[str]:
    return re.findall(r'<div class="span llm sample" id="span-([0-9a-f]+)"', page)


@pytest.mark.parametrize("pattern, agent", [("^solver$", "solver"), ("plan", "planner")])
def test_agent_match_highlights_the_calls_of_the_matching_agent(client, store, pattern, agent):
    rollout_id = first_dev_rollout(store)
    spans = store.query_spans(rollout_id)
    expected = [s.span_id for s in spans if s.kind == "llm" and nearest_agent(s, spans) == agent]
    page = client.get(f"/rollouts/{rollout_id}", params={"agent_match": pattern}).text
    assert expected and highlighted(page) == expected
    assert f"{len(expected)} of 3 LLM calls become training samples" in page


def nearest_agent(span: Span, spans: List[Span]) -> str:
    by_id = {s.span_id: s for s in spans}
    parent = by_id[span.parent_id or ""]
    while parent.kind != "agent":
        parent = by_id[parent.parent_id or ""]
    return str(parent.attributes[agl.semconv.AGENT_NAME])


def test_a_bad_agent_match_is_said_on_the_page(client, store):
    answer = client.get(f"/rollouts/{first_dev_rollout(store)}", params={"agent_match": "("})
    assert answer.status_code == 200 and highlighted(answer.text) == []
    assert "agent_match pattern &#x27;(&#x27; is not a valid regular expression" in answer.text


def test_the_training_view_has_a_point_per_step_and_one_per_evaluation(client, store):
    assert_training_view(client.get("/training").text, store)


def assert_training_view(page: str, store: LightningStore) -> None:
    """Three steps of eight rollouts and one evaluation (tests/ui_run.py), each step's mean reward a point."""
    train = [r for r in store.query_rollouts(mode="train")]
    steps = list(dict.fromkeys(r.resources_id for r in train))
    means = [sum(r.final_reward or 0 for r in train if r.resources_id == s) / 8 for s in steps]
    assert len(re.findall(r'data-series="train reward \(mean\)"', page)) == len(steps) == 3
    assert len(re.findall(r'data-series="held-out success"', page)) == 1
    for step, mean in enumerate(means, 1):
        assert f"train reward (mean): {mean:.3g} at step {step}" in page
    assert '<meta http-equiv="refresh"' in page


def advantages_shown(page: str) -> Dict[str, str]:
    """Span id -> the advantage its sample badge shows (the badge is in the span's title line)."""
    title = r'id="span-([0-9a-f]+)"[^>]*><div>(?:(?!</div>).)*?advantage <b class="advantage">([^<]+)</b>'
    return dict(re.findall(title, page))


def step_advantages(store: LightningStore, rollout: Rollout, agent_match: str) -> Dict[str, float]:
    """Span id -> advantage of ``rollout``'s samples in the batch a TorchGRPO step builds: LightningRL's
    ``build_batch`` over every train rollout of the step (its resources version)."""
    step = [r for r in store.query_rollouts(mode="train") if r.resources_id == rollout.resources_id]
    batch = LightningRL(agent_match=agent_match).build_batch(store, step, progress=False)
    return {i: s.advantage for s in batch.samples if s.rollout_id == rollout.rollout_id for i in s.span_ids}


def assert_advantages_as_in_training(client: TestClient, store: LightningStore) -> None:
    """Every train rollout's samples show the advantage its step's batch gives them; some are not 0."""
    values: List[float] = []
    for rollout in store.query_rollouts(mode="train"):
        page = client.get(f"/rollouts/{rollout.rollout_id}", params={"agent_match": "^solver$"}).text
        expected = step_advantages(store, rollout, "^solver$")
        assert len(expected) == 2 and advantages_shown(page) == {k: number(v) for k, v in expected.items()}
        assert f"Advantage over its group: 2 finished rollouts of task {rollout.task_id} at this policy" in page
        values += expected.values()
    assert any(v > 0 for v in values) and any(v < 0 for v in values)


def test_each_training_sample_shows_the_advantage_of_its_steps_batch(client, store):
    assert_advantages_as_in_training(client, store)


@pytest.mark.parametrize(
    "mode, said", [("dev", "dev rollouts (Trainer.dev) are never trained on"), ("val", "held-out evaluations")]
)
def test_a_rollout_that_is_never_trained_on_says_why_it_has_no_advantage(client, store, mode, said):
    rollout = store.query_rollouts(mode=mode)[0]
    page = client.get(f"/rollouts/{rollout.rollout_id}", params={"agent_match": "^solver$"}).text
    assert len(highlighted(page)) == 2 and advantages_shown(page) == {}
    assert f"No advantage: {said}" in page


def test_a_group_of_one_and_an_unfinished_group_say_why_they_have_no_advantage(
    db, tmp_path, fake_trainer, instrumented
):
    copy = tmp_path / "store.db"
    with sqlite3.connect(db) as source, sqlite3.connect(copy) as target:
        source.backup(target)
    with SqliteLightningStore(copy) as store:
        trainer = fake_trainer(store, n_runners=1)
        first = next(r for r in store.query_rollouts(mode="train") if r.task_id == TASKS[0]["id"])
        with trainer.runners(solver):
            version = store.add_resources(store.get_resources(first.resources_id).resources).resources_id
            (alone,) = trainer.run_tasks([TASKS[5]], mode="train", resources_id=version)
        store.enqueue_rollout(TASKS[0], task_id=TASKS[0]["id"], mode="train", resources_id=first.resources_id)
        client = TestClient(create_ui(store))
        page = client.get(f"/rollouts/{alone.rollout_id}", params={"agent_match": "^solver$"}).text
        assert len(highlighted(page)) == 2 and advantages_shown(page) == {}
        assert f"No advantage: a group of one (task {TASKS[5]['id']} at this policy version)" in page
        page = client.get(f"/rollouts/{first.rollout_id}", params={"agent_match": "^solver$"}).text
        assert len(highlighted(page)) == 2 and advantages_shown(page) == {}
        assert f"No advantage yet: 1 of the 3 rollouts of its group (task {TASKS[0]['id']} at this policy" in page


@pytest.mark.parametrize(
    "path, status, said",
    [
        ("/rollouts/ro-nope", 404, "unknown rollout id"),
        ("/?status=done", 400, "status=&#x27;done&#x27; is not one of"),
        ("/?limit=0", 400, "limit=0 must be between 1 and 500"),
        ("/training?threshold=nan", 400, "threshold must be a finite number"),
        ("/nowhere", 404, "/nowhere: Not Found"),
    ],
)
def test_bad_input_gets_a_page_that_says_what_was_wrong(client, path, status, said):
    answer = client.get(path)
    assert answer.status_code == status and said in answer.text and "Traceback" not in answer.text


def test_an_unknown_attempt_is_a_404_page(client, store):
    answer = client.get(f"/rollouts/{first_dev_rollout(store)}", params={"attempt": "at-nope"})
    assert answer.status_code == 404 and "unknown attempt id" in answer.text


def test_the_pages_work_over_a_store_server_with_its_token(db, store, capsys):
    app = create_app(store, tokens=TokenSet({"shared": TOKEN}))
    with ServerThread(app) as server:
        remote = RemoteLightningStore(server.url, token=TOKEN)
        try:
            page = TestClient(create_ui(remote)).get("/").text
        finally:
            remote.close()
        assert rows(page) == [r.rollout_id for r in store.query_rollouts()]
        assert main(["ui", "--store", server.url, "--token", "wrong"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("agl: token not accepted")


def test_agl_ui_refuses_a_store_file_that_does_not_exist(tmp_path):
    with pytest.raises(SystemExit, match=r"^agl: .*nope\.db"):
        main(["ui", "--store", str(tmp_path / "nope.db")])
    assert not (tmp_path / "nope.db").exists()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_agl_ui_serves_the_pages_until_terminated(db, store):
    command = [sys.executable, "-m", "agl.cli", "ui", "--store", str(db), "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        address = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert address, line
        assert rows(httpx.get(address.group(0), timeout=30).text) == [r.rollout_id for r in store.query_rollouts()]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_agl_store_serve_has_the_pages_under_ui_behind_its_token(db, store):
    port = free_port()
    command = [sys.executable, "-m", "agl.cli", "store", "serve", "--store", str(db), "--port", str(port)]
    proc = subprocess.Popen([*command, "--token", TOKEN], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:

        def answers() -> bool:
            try:
                return httpx.get(f"{base}/healthz", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        eventually(answers, 60, "agl store serve to answer")
        assert httpx.get(f"{base}/ui/", timeout=30).status_code == 401
        assert httpx.get(f"{base}/ui/", params={"token": "wrong"}, timeout=30).status_code == 403
        with httpx.Client(base_url=base, timeout=30) as browser:
            given = browser.get("/ui/", params={"token": TOKEN, "mode": "val"})
            assert given.status_code == 303 and given.headers["location"] == "/ui/?mode=val"
            page = browser.get(given.headers["location"]).text  # the cookie now carries the token
            assert rows(page) == [r.rollout_id for r in store.query_rollouts(mode="val")]
            assert f'href="/ui/rollouts/{rows(page)[0]}"' in page
        bearer = httpx.get(f"{base}/ui/training", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert bearer.status_code == 200 and "Training" in bearer.text
        assert httpx.get(f"{base}/v1/rollouts", timeout=30).status_code == 401  # the API's own check is unchanged
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def postgres(_fake_openai_server: FakeOpenAIServer) -> Iterator[LightningStore]:
    """A PostgreSQL store (a database of its own on a throwaway server) filled as the SQLite one."""
    from agl.testing.postgres import postgres_for_tests

    with postgres_for_tests() as server, server.store_database() as dsn:
        _fake_openai_server.reset()
        fill_store(dsn, _fake_openai_server.base_url)
        opened = open_store(dsn, create=False)
        try:
            yield opened
        finally:
            opened.close()


def test_the_list_pages_through_a_postgresql_store(postgres):
    client = TestClient(create_ui(postgres))
    seen: List[str] = []
    address = "/?limit=7"
    while address:
        page = client.get(address).text
        seen += rows(page)
        following = re.search(r'href="([^"]+)">next</a>', page)
        address = html.unescape(following.group(1)) if following else ""
    assert seen == [r.rollout_id for r in postgres.query_rollouts()] and len(seen) == 6 + 24 + 3
    train = client.get("/", params={"mode": "train", "limit": 5, "offset": 20}).text
    assert rows(train) == [r.rollout_id for r in postgres.query_rollouts(mode="train")][20:]


def test_a_rollout_and_the_training_view_over_a_postgresql_store(postgres):
    client = TestClient(create_ui(postgres))
    rollout_id = first_dev_rollout(postgres)
    page = client.get(f"/rollouts/{rollout_id}", params={"agent_match": "^solver$"}).text
    assert "The answer is 10." in page and "tool call add(" in page and len(highlighted(page)) == 2
    assert SCRIPT not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert_advantages_as_in_training(client, postgres)
    assert_training_view(client.get("/training").text, postgres)
