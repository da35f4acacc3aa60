"""An AG2 1.x agent (``ag2.Agent`` with two calculator tools), trainable with agl unchanged.

Run it on the bundled tasks with agl's scripted fake model (no GPU, no network; needs ``pip install "ag2[openai]>=1"``):

    agl dev examples/ag2_agent.py:ag2_calc_agent --data examples/data/calc_tasks.jsonl --fake-model

or against any OpenAI-compatible endpoint (vLLM, agl serve, OpenAI):

    agl dev examples/ag2_agent.py:ag2_calc_agent --data examples/data/calc_tasks.jsonl \\
        --endpoint http://127.0.0.1:8000/v1 --model Qwen/Qwen2.5-0.5B-Instruct

Each task's spans: the runner's root agent span, the ``calculator`` agent span of the AG2 turn, one llm
span per model request inside it (with token ids) and a tool span per tool run. To train only this
agent's calls: ``Trainer(adapter={"agent_match": "^calculator$"})``. AG2 classic (``ag2<1``,
``import autogen``) is hooked by the same ``agl.instrument()``; see docs/integrations/ag2.md.
"""

from __future__ import annotations

from ag2 import Agent
from ag2.config.openai import OpenAIConfig

import agl

agl.instrument()  # the one line: AG2 turns, tool runs and LLM calls become spans


def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


def _format(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@agl.rollout
async def ag2_calc_agent(task: dict, llm: agl.LLM) -> float:
    """Answer an arithmetic question with the tools; reward 1 if the reply holds the right number."""
    config = OpenAIConfig(
        model=llm.model, base_url=llm.get_base_url(), api_key=llm.api_key or "unused", **llm.sampling_parameters
    )
    agent = Agent(
        "calculator",
        "You are a careful calculator. Use the tools, then state the answer.",
        config=config,
        tools=[add, multiply],
    )
    reply = await agent.ask(task["question"])
    return 1.0 if _format(task["answer"]) in (reply.body or "") else 0.0
