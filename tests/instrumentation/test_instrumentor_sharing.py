"""Instances of one instrumentor class share one set of hooks (agl.instrumentation.base).

``agl.instrument()`` makes its own instances; a user or a library may hook another (OpenInference-style).
Before, the second instance either stacked its hooks on the first (AutoGen: every span twice) or hooked
nothing yet said it was instrumented, and recorded nothing once ``agl.uninstrument()`` took the first one's
hooks out (CrewAI, the OpenAI Agents SDK). A toy instrumentor patching a module attribute checks the
contract; tests/integrations check it on the real frameworks, the OpenAI client layer here too.
"""

from __future__ import annotations

import types
from typing import Any, Iterator, List

import openai
import pytest

import agl.instrumentation
from agl.instrumentation.base import Instrumentor, is_hooked
from agl.instrumentation.openai_client import OpenAIInstrumentor

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
target = types.SimpleNamespace(greet=lambda: "hello")
ORIGINAL = target.greet


class Toy(Instrumentor):
    """Wraps ``target.greet``: a hooked call returns the text in brackets, once per layer of hooks."""

    name = "toy_sharing"
    hooked: List[Toy] = []  # the instances whose _instrument ran, in order

    def _instrument(self, **kwargs: Any) -> None:
        self._saved = target.greet
        inner = target.greet
        target.greet = lambda: f"[{inner()}]"
        self.settings = kwargs
        Toy.hooked.append(self)

    def _uninstrument(self) -> None:
        target.greet = self._saved


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    Toy.hooked = []
    yield
    target.greet = ORIGINAL


@pytest.mark.parametrize("first_out", ["first", "second"])
def test_two_instances_share_one_set_of_hooks_until_the_last_lets_go(first_out: str) -> None:
    first, second = Toy(), Toy()
    assert first.instrument(setting=1) and second.instrument(setting=2)
    assert target.greet() == "[hello]"  # hooked once, not twice
    assert Toy.hooked == [first] and first.settings == {"setting": 1}
    leaving, staying = (first, second) if first_out == "first" else (second, first)
    leaving.uninstrument()
    assert not leaving.is_instrumented and staying.is_instrumented
    assert target.greet() == "[hello]" and is_hooked("toy_sharing")  # the one still in use keeps recording
    leaving.uninstrument()  # twice equals once: it does not take the other's use away
    assert target.greet() == "[hello]"
    staying.uninstrument()
    assert target.greet is ORIGINAL and not is_hooked("toy_sharing")


def test_hooks_come_back_when_an_instance_instruments_again() -> None:
    first, second = Toy(), Toy()
    first.instrument()
    second.instrument()
    first.uninstrument()
    second.uninstrument()
    assert second.instrument() and target.greet() == "[hello]"
    assert Toy.hooked == [first, second]  # hooked afresh, by the instance that asked
    assert first.instrument() and Toy.hooked == [first, second]  # joins again
    first.uninstrument()
    second.uninstrument()
    assert target.greet is ORIGINAL


def test_a_failed_hook_is_undone_and_the_next_instance_tries_again() -> None:
    class Broken(Toy):
        name = "toy_broken"
        fail = True

        def _instrument(self, **kwargs: Any) -> None:
            super()._instrument(**kwargs)
            if Broken.fail:
                raise RuntimeError("framework changed shape")

    assert not Broken().instrument() and target.greet is ORIGINAL and not is_hooked("toy_broken")
    Broken.fail = False
    works = Broken()
    assert works.instrument() and target.greet() == "[hello]"
    works.uninstrument()
    assert target.greet is ORIGINAL


def test_a_users_openai_instrumentor_keeps_recording_after_agl_uninstrument(
    fake_openai: Any, sink: Any, rollout: Any
) -> None:
    """The OpenAI client layer: a user's own instance hooked while agl.instrument() was on."""
    agl.instrumentation.uninstrument()
    agl.instrumentation.instrument([])
    mine = OpenAIInstrumentor()
    assert mine.instrument()
    agl.instrumentation.uninstrument()
    client = openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)
    try:
        assert mine.is_instrumented
        with rollout() as scope:
            client.chat.completions.create(model="fake-model", messages=MESSAGES)
        assert len(sink.of(scope.rollout_id)) == 1
    finally:
        mine.uninstrument()
    with rollout() as scope:
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert sink.of(scope.rollout_id) == []
