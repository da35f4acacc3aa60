"""An AutoGen (agentchat 0.5+) calculator agent with two tools, trainable with agl.

Run it on the bundled tasks with agl's scripted fake model (no GPU, no network):

    agl dev examples/autogen_agent.py:autogen_calc_agent --data examples/data/calc_tasks.jsonl --fake-model

or against any OpenAI-compatible endpoint (vLLM, agl serve, OpenAI):

    agl dev examples/autogen_agent.py:autogen_calc_agent --data examples/data/calc_tasks.jsonl \\
        --endpoint http://127.0.0.1:8000/v1 --model Qwen/Qwen2.5-0.5B-Instruct

Each model request becomes an ``llm`` span (with token ids) under the agent span ``calculator``, each
tool call a ``tool`` span; train this agent's calls with ``agent_match="^calculator$"``.
"""

from __future__ import annotations

import re

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

import agl

agl.instrument()  # the one line: AutoGen agents, tools and their LLM calls become spans

# The fake model and most open models are not in AutoGen's model table: say what they can do.
MODEL_INFO = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "family": "unknown",
    "structured_output": False,
}


def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@agl.rollout
async def autogen_calc_agent(task: dict, llm: agl.LLM) -> float:
    """Answer an arithmetic question with the tools; reward 1 if the final answer holds the right number."""
    model_client = OpenAIChatCompletionClient(
        model=llm.model,
        base_url=llm.get_base_url(),
        api_key=llm.api_key or "unused",
        model_info=MODEL_INFO,
        **llm.sampling_parameters,
    )
    agent = AssistantAgent(
        "calculator",
        model_client=model_client,
        tools=[add, multiply],
        system_message="You are a careful calculator. Use the tools, then state the answer.",
        reflect_on_tool_use=True,  # a second model call turns the tool result into the answer
    )
    try:
        result = await agent.run(task=task["question"])
    finally:
        await model_client.close()
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", str(result.messages[-1].content))]
    return 1.0 if float(task["answer"]) in numbers else 0.0
