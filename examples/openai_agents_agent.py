"""An OpenAI Agents SDK calculator (an ``Agent`` with two function tools), trainable with agl.

Run it on the bundled tasks with agl's scripted fake model (no GPU, no network):

    agl dev examples/openai_agents_agent.py:openai_agents_calc_agent \\
        --data examples/data/calc_tasks.jsonl --fake-model

or against any OpenAI-compatible endpoint (vLLM, agl serve, OpenAI) with ``--endpoint URL --model NAME``.
Spans: ``invoke_agent calculator`` (``agent_match="^calculator$"``) holding one ``llm`` span per model
request and an ``execute_tool add``/``multiply`` span per tool call.
"""

from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_trace_processors
from openai import AsyncOpenAI

import agl

# SDK configuration, not instrumentation: keep traces on this machine instead of exporting them to
# api.openai.com. It replaces the processor list, so it goes before agl.instrument(), which adds agl's.
set_trace_processors([])
agl.instrument()  # the one line: agents, tools and LLM calls (with token ids) become spans


@function_tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@function_tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


def _format(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


async def openai_agents_calc_agent(task: dict, llm: agl.LLM) -> float:
    """Answer an arithmetic question with the tools; reward 1 if the final answer holds the right number.

    The model client is made per rollout from ``llm`` (the endpoint being trained), and Chat Completions is
    used because every OpenAI-compatible server (vLLM included) speaks it.
    """
    client = AsyncOpenAI(base_url=llm.get_base_url(), api_key=llm.api_key or "unused")
    agent = Agent(
        name="calculator",
        instructions="You are a careful calculator. Use the tools, then state the answer.",
        tools=[add, multiply],
        model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client),
    )
    try:
        result = await Runner.run(agent, task["question"], max_turns=6)
    finally:
        await client.close()
    return 1.0 if _format(task["answer"]) in str(result.final_output) else 0.0
