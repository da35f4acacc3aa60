"""``agl serve --store``: new resources versions in a real SQLite store swap the served weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, List

import httpx
import openai
from with_torch_helpers import greedy_generate

from agl.serving import PolicyServer
from agl.serving.models import load_policy
from agl.serving.store_watch import StoreWatcher, checkpoint_of
from agl.store import open_store
from agl.types import LLM, PromptTemplate

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def greedy_ids(model: Any, tokenizer: Any, n: int = 8) -> List[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    return greedy_generate(model, prompt, n)


def ask(base_url: str) -> tuple[List[int], int]:
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        completion = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=8, temperature=0)
    return completion.choices[0].model_extra["token_ids"], completion.model_extra["agl_resources_version"]


def test_checkpoint_is_named_by_the_policy_llm_resource(tmp_path):
    store = open_store(str(tmp_path / "s.db"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    named = store.add_resources({"main_llm": LLM(endpoint="http://x/v1", model=str(ckpt))})
    assert checkpoint_of(named) == str(ckpt)
    only_llm = store.add_resources(
        {"judge": LLM(endpoint="http://x/v1", model=str(ckpt)), "p": PromptTemplate(template="{x}")}
    )
    assert checkpoint_of(only_llm) == str(ckpt)
    plain_name = store.add_resources({"main_llm": LLM(endpoint="http://x/v1", model="policy")})
    assert checkpoint_of(plain_name) is None


def test_watcher_loads_each_new_version_the_store_publishes(tmp_path):
    model, tokenizer = load_policy("tiny", seed=0, device="cpu")
    other, _ = load_policy("tiny", seed=3, device="cpu")
    before, after = greedy_ids(model, tokenizer), greedy_ids(other, tokenizer)
    other.save_pretrained(tmp_path / "step-1")
    store = open_store(str(tmp_path / "store.db"))
    with PolicyServer(model, tokenizer) as server:
        watcher = StoreWatcher(store, server)
        assert not watcher.check() and ask(server.base_url) == (before, 0)  # no resources yet
        store.add_resources({"main_llm": LLM(endpoint=server.base_url, model="policy")})
        assert watcher.check() and not watcher.check()
        assert ask(server.base_url) == (before, 1)  # a name, not a checkpoint: same weights, new version
        store.add_resources({"main_llm": LLM(endpoint=server.base_url, model=str(tmp_path / "step-1"))})
        assert watcher.check()
        assert ask(server.base_url) == (after, 2)
        (tmp_path / "broken").mkdir()
        store.add_resources({"main_llm": LLM(endpoint=server.base_url, model=str(tmp_path / "broken"))})
        assert not watcher.check()  # logged; the server keeps serving version 2
        assert ask(server.base_url) == (after, 2)


def test_agl_serve_follows_the_store(tmp_path):
    """The real command line in a subprocess: start, answer, load a published checkpoint, stop on SIGTERM."""
    store_path = str(tmp_path / "store.db")
    other, tokenizer = load_policy("tiny", seed=3, device="cpu")
    other.save_pretrained(tmp_path / "step-1")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl.cli",
            "serve",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--port",
            "0",
            "--store",
            store_path,
            "--poll-interval",
            "0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = process.stdout.readline()
        assert " at http://127.0.0.1:" in line, (line, process.stderr.read() if process.poll() is not None else "")
        base_url = line.rsplit(" at ", 1)[1].strip()
        assert ask(base_url)[1] == 0
        open_store(store_path).add_resources({"main_llm": LLM(endpoint=base_url, model=str(tmp_path / "step-1"))})
        deadline = time.monotonic() + 30
        while httpx.get(base_url.removesuffix("/v1") + "/health").json()["agl_resources_version"] != 1:
            assert time.monotonic() < deadline, "agl serve did not pick up the new resources version"
            time.sleep(0.1)
        assert ask(base_url) == (greedy_ids(other, tokenizer), 1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
