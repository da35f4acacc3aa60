"""A CrewAI crew (a "Calculator" agent with two tools), trainable with agl.

Run it on the bundled tasks with agl's scripted fake model (no GPU, no network):

    agl dev examples/crewai_agent.py:crewai_calc_agent --data examples/data/calc_tasks.jsonl --fake-model

Each CrewAI agent is an agent span named by its ``role``: train only this agent's LLM calls with
``agent_match="^Calculator$"`` (useful once a crew has several agents).
"""

from __future__ import annotations

import os

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")  # keep CrewAI's own telemetry offline

from crewai import LLM, Agent, Crew, Task
from crewai.tools import tool

import agl

agl.instrument()  # the one line: crews, agents, tools and LLM calls become spans with token ids


@tool("add")
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@tool("multiply")
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


def _format(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@agl.rollout
def crewai_calc_agent(task: dict, llm: agl.LLM) -> float:
    """Answer an arithmetic question with a one-agent crew; reward 1 if the answer holds the right number."""
    model = LLM(
        model=llm.model,
        provider="openai",  # CrewAI's native OpenAI provider, pointed at the trained model's endpoint
        base_url=llm.get_base_url(),
        api_key=llm.api_key or "unused",
        **llm.sampling_parameters,
    )
    calculator = Agent(
        role="Calculator",
        goal="Compute the exact answer with the tools.",
        backstory="You are a careful calculator.",
        llm=model,
        tools=[add, multiply],
        max_iter=4,
    )
    question = Task(description=task["question"], expected_output="The number.", agent=calculator)
    answer = Crew(agents=[calculator], tasks=[question]).kickoff().raw
    return 1.0 if _format(task["answer"]) in answer else 0.0
