"""Fixtures of the policy server tests: the tiny random Llama behind a real PolicyServer on 127.0.0.1, one per
test module, and the real ``openai`` client pointed at it."""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Tuple

import openai
import pytest
from with_torch_helpers import greedy_generate

from agl.serving import PolicyServer
from agl.serving.models import load_policy


@pytest.fixture(scope="module")
def tiny() -> Tuple[Any, Any]:
    return load_policy("tiny", device="cpu")


@pytest.fixture(scope="module")
def server(tiny: Tuple[Any, Any]) -> Iterator[PolicyServer]:
    model, tokenizer = tiny
    with PolicyServer(model, tokenizer, model_name="policy", max_batch_size=8, version=1) as s:
        yield s


@pytest.fixture
def client(server: PolicyServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="session")
def greedy() -> Callable[[Any, List[int], int], List[int]]:
    """``greedy(model, prompt_ids, n)``: transformers' own greedy ``generate``, the reference the server's
    greedy answers are checked against."""
    return greedy_generate
