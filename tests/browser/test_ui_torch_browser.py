"""Issue 38, part 2: the web view over a real TorchGRPO run, in Chromium. The README's main job
(examples/main_job/train.py, ``--model tiny``: SmolLM2's tokenizer with a small random Llama) trains its
LangGraph agent for two steps into ``store.db``; ``agl ui --store <that store.db>`` runs as its own process;
Chromium follows a training rollout from the list to the prompt and response that became a sample (the job's
``agent_match``) and reads its advantage, which must be the one LightningRL gives that step's batch; the
training view's chart has a point per step whose reward is the job's metrics.csv. Screenshots as in
test_ui_browser.py."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator

import pytest

from agl import semconv
from agl.lightningrl import LightningRL
from agl.store import LightningStore, SqliteLightningStore
from agl.types import Rollout
from agl.ui.html import number

JOB = Path(__file__).resolve().parents[2] / "examples" / "main_job"


def job_agent_match() -> str:
    """The main job's ``agent_match`` (its LangGraph agent's module holds it)."""
    sys.path.insert(0, str(JOB))
    try:
        from langgraph_math_agent import AGENT_MATCH

        return str(AGENT_MATCH)
    finally:
        sys.path.remove(str(JOB))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a finished main job: two TorchGRPO steps on the tiny model, two held-out tasks."""
    out = tmp_path_factory.mktemp("main_job") / "job"
    command = [sys.executable, str(JOB / "train.py"), "--model", "tiny", "--steps", "2", "--heldout", "2"]
    done = subprocess.run([*command, "--no-greedy-eval", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def store(job: Path) -> Iterator[LightningStore]:
    with SqliteLightningStore(job / "store.db") as opened:
        yield opened


@pytest.fixture(scope="module")
def site(job: Path) -> Iterator[str]:
    """``agl ui`` over the job's store, as the README says to run it."""
    command = [sys.executable, "-m", "agl.cli", "ui", "--store", str(job / "store.db"), "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        address = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert address, line + (proc.stderr.read() if proc.stderr and proc.poll() is not None else "")
        yield address.group(0)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def step_advantages(store: LightningStore, rollout: Rollout, agent_match: str) -> Dict[str, float]:
    """Span id -> advantage of ``rollout``'s samples in its step's batch, as TorchGRPO built it: LightningRL's
    ``build_batch`` over every train rollout of the step (its resources version), the job's agent_match."""
    step = [r for r in store.query_rollouts(mode="train") if r.resources_id == rollout.resources_id]
    batch = LightningRL(agent_match=agent_match).build_batch(store, step, progress=False)
    return {i: s.advantage for s in batch.samples if s.rollout_id == rollout.rollout_id for i in s.span_ids}


def as_html_reads(text: str) -> str:
    """``text`` as a browser reads it back from a ``<pre>``: HTML parsing turns CR and CRLF into LF, NUL into
    U+FFFD, and drops one newline right after the start tag (the random model writes any character)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "\ufffd")
    return text[1:] if text.startswith("\n") else text


def test_a_torchgrpo_rollout_from_the_list_to_its_samples_and_their_advantage(browser, site, store, shots):
    agent_match = job_agent_match()
    chosen = store.query_rollouts(mode="train")[0]
    expected = step_advantages(store, chosen, agent_match)
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    page.goto(f"{site}/")
    page.get_by_label("mode").select_option("train")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url("**mode=train*")
    assert page.locator("tbody tr").count() == len(store.query_rollouts(mode="train"))
    page.screenshot(path=str(shots / "torch-1-train-rollouts.png"), full_page=True)

    page.get_by_role("link", name=chosen.rollout_id).click()
    page.wait_for_url(f"**/rollouts/{chosen.rollout_id}")
    page.get_by_label("agent_match").fill(agent_match)
    page.get_by_role("button", name="Show samples").click()
    page.wait_for_url("**agent_match=*")

    samples = page.locator(".span.sample")
    assert samples.count() == len(expected) == 2 and samples.first.is_visible()  # the solve and answer nodes
    spans = {s.span_id: s for s in store.query_spans(chosen.rollout_id)}
    for span_id, advantage in expected.items():
        shown = page.locator(f"#span-{span_id}")
        assert "sample" in (shown.get_attribute("class") or "")
        assert shown.locator(".advantage").inner_text() == number(advantage)
        (message,) = json.loads(spans[span_id].attributes[semconv.OUTPUT_MESSAGES])
        assert shown.locator(".response pre").first.text_content() == as_html_reads(message["content"])
    question = chosen.input["question"] if isinstance(chosen.input, dict) else str(chosen.input)
    assert question in samples.first.locator(".prompt").inner_text()
    assert "Advantage over its group: 4 finished rollouts" in page.content()
    page.screenshot(path=str(shots / "torch-2-rollout-samples.png"), full_page=True)


def test_the_training_view_of_a_torchgrpo_run_has_its_steps_points(browser, site, job, shots):
    rows = [r for r in csv.DictReader((job / "metrics.csv").open()) if r["rollouts"]]
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    page.goto(f"{site}/training")
    chart = page.locator("svg.chart").first
    assert chart.is_visible()
    points = chart.locator('circle.point[data-series="train reward (mean)"]')
    assert points.count() == len(rows) == 2
    for point, row in zip(points.all(), rows):
        tip = f"train reward (mean): {number(float(row['reward_mean']))} at step {row['step']}"
        assert point.locator("title").text_content() == tip
    assert chart.locator('circle.point[data-series="held-out reward (mean)"]').count() == 2  # before, after
    page.screenshot(path=str(shots / "torch-3-training.png"), full_page=True)
