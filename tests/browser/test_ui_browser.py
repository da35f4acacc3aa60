"""Issue 38, part 2: the web view in a real browser. Debian's Chromium (``apt-get install chromium``, at
/usr/bin/chromium or $AGL_CHROMIUM; Playwright downloads no browser) opens the pages of ``agl ui`` over a
store filled by a real ``Trainer.dev`` run and training steps against the fake OpenAI server
(tests/ui_run.py); it follows one rollout from the list to the prompt and response that became a sample,
and opens the training chart. Screenshots go to $AGL_SCREENSHOTS (``nox -s browser``:
.nox/browser/tmp/screenshots), else to a temporary folder named in the test's output. The same pages over a
TorchGRPO run: test_ui_torch_browser.py."""

from __future__ import annotations

from typing import Iterator, List

import pytest
from ui_run import SCRIPT, TASKS, fill_store

from agl._util.http_thread import ThreadedServer
from agl.store import LightningStore, SqliteLightningStore
from agl.testing import FakeOpenAIServer
from agl.ui import create_ui


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, _fake_openai_server: FakeOpenAIServer) -> Iterator[LightningStore]:
    path = tmp_path_factory.mktemp("browser") / "store.db"
    _fake_openai_server.reset()
    fill_store(path, _fake_openai_server.base_url)
    with SqliteLightningStore(path) as opened:
        yield opened


@pytest.fixture(scope="module")
def site(store: LightningStore) -> Iterator[str]:
    with ThreadedServer(create_ui(store), name="agl ui under test") as server:
        yield f"http://127.0.0.1:{server.port}"


def test_from_the_list_to_the_prompt_and_response_that_became_a_sample(browser, site, store, shots):
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    dialogs: List[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(f"{site}/")
    rollouts = store.query_rollouts()
    assert page.locator("tbody tr").count() == len(rollouts)
    page.screenshot(path=str(shots / "1-rollouts.png"), full_page=True)

    chosen = next(r for r in rollouts if r.mode == "dev" and r.task_id == TASKS[0]["id"])
    page.get_by_role("link", name=chosen.rollout_id).click()
    page.wait_for_url(f"**/rollouts/{chosen.rollout_id}")
    page.get_by_label("agent_match").fill("^solver$")
    page.get_by_role("button", name="Show samples").click()
    page.wait_for_url("**agent_match=*")

    samples = page.locator(".span.sample")
    assert samples.count() == 2 and samples.first.is_visible()
    first, last = samples.first.inner_text(), samples.last.inner_text()
    assert TASKS[0]["question"] in first and "tool call add(" in first  # the question shows as text, tag and all
    assert "The answer is 10." in last
    assert "Plan the steps." not in first + last  # the planner's call is no sample
    assert page.locator(".badge.sample").count() == 2
    page.screenshot(path=str(shots / "2-rollout-samples.png"), full_page=True)
    assert dialogs == [], f"a stored {SCRIPT} ran"


def test_the_training_view_draws_a_chart_with_points(browser, site, shots):
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    page.goto(f"{site}/")
    page.locator("header").get_by_role("link", name="Training").click()
    page.wait_for_url("**/training")
    chart = page.locator("svg.chart").first
    assert chart.is_visible()
    points = chart.locator("circle.point")
    assert points.count() == 4  # three steps and the evaluation
    box = points.first.bounding_box()
    assert box is not None and box["width"] > 0
    page.screenshot(path=str(shots / "3-training.png"), full_page=True)
