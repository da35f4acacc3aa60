"""The multi-turn job's agent: an OpenAI Agents SDK calculator that needs two tool calls per task.

    "Add 17 and 4, then multiply the result by 3."
    LLM -> add(17, 4) -> 21 -> LLM -> multiply(21, 3) -> 63 = the answer

The agent has two function tools, ``add`` and ``multiply``, and a structured answer (``output_type``), so
every LLM call either calls a tool or answers. agl's policy server enforces that choice while sampling (the
answer's JSON schema, or a ``<tool_call>`` naming an offered tool with arguments valid under its schema:
``agl.serving.structured``): without it SmolLM2-135M wrote no tool call at all in 24 tries (Python code and
prose instead), which leaves GRPO nothing to learn from. With it the untrained model calls the tools,
chaining each result into its next call, but it does not stop: told to answer after two calls, it called a
tool a third time in 13 of 19 held-out tasks and answered after two in none. So the second tool result ends
the run as its answer (``tool_use_behavior``): what the model has to learn is the operation of each step (it
starts with ``add``, the first tool listed, whatever the request) and the second call's operands (the first
result, read back from the tool's answer in its prompt, and the third number). Every LLM call of the rollout
is a sample (``agent_match`` is the agent's name), credited with the episode reward.

Reward: 1.0 when the answer (the second tool result, or the structured answer of a model that answers
without the tools) is the right number, else 0.0; a rollout whose answer ``max_tokens`` cut gets 0.0 too (a
wrong answer to learn from, not a failed rollout to drop).
"""

from __future__ import annotations

from typing import Any, Dict, List

from agents import (
    Agent,
    FunctionToolResult,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunContextWrapper,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
    set_trace_processors,
)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from openai import AsyncOpenAI
from pydantic import BaseModel

import agl

# SDK configuration, not instrumentation: keep traces on this machine instead of exporting them to
# api.openai.com. It replaces the processor list, so it goes before agl.instrument(), which adds agl's.
set_trace_processors([])

AGENT_NAME = "calculator"
AGENT_MATCH = f"^{AGENT_NAME}$"  # every LLM call of the agent is trained
TOOL_CALLS = 2  # the steps of a task: the run ends at the second tool result
MAX_TURNS = 3  # two LLM calls with tool calls, and a spare one (the SDK counts turns its own way)
INSTRUCTIONS = (
    "You are a calculator. Solve the problem with the tools, one step per call: first the first step, then the "
    "second step on its result. Then give the last tool result as the answer."
)


class Answer(BaseModel):
    answer: int


@function_tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two numbers."""
    return a * b


def reward(answer: Any, expected: int) -> float:
    """1.0 for the right number: a tool result (an int) or a structured answer."""
    number = answer.answer if isinstance(answer, Answer) else answer
    return 1.0 if isinstance(number, int) and not isinstance(number, bool) and number == expected else 0.0


class StopAtToolCall:
    """``tool_use_behavior`` that ends a run at its ``n``-th tool result, which becomes the final output."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.results: List[FunctionToolResult] = []

    def __call__(self, context: RunContextWrapper[Any], results: List[FunctionToolResult]) -> ToolsToFinalOutputResult:
        self.results.extend(results)
        if len(self.results) < self.n:
            return ToolsToFinalOutputResult(is_final_output=False)
        return ToolsToFinalOutputResult(is_final_output=True, final_output=self.results[self.n - 1].output)


@agl.rollout
async def calculator_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    client = AsyncOpenAI(base_url=llm.get_base_url(), api_key=llm.api_key or "unused", max_retries=1)
    sampling = dict(llm.sampling_parameters)  # the trainer's: temperature, max_tokens, logprobs...
    settings = ModelSettings(
        temperature=sampling.pop("temperature", None),
        top_p=sampling.pop("top_p", None),
        max_tokens=sampling.pop("max_tokens", None),
        extra_body=sampling or None,  # the rest as the request sends it (logprobs: the PPO ratio's old logprobs)
    )
    agent = Agent(
        name=AGENT_NAME,
        instructions=INSTRUCTIONS,
        tools=[add, multiply],
        output_type=Answer,
        tool_use_behavior=StopAtToolCall(TOOL_CALLS),  # one per rollout: it counts that rollout's results
        model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client),
        model_settings=settings,
    )
    try:
        result = await Runner.run(agent, task["question"], max_turns=MAX_TURNS)
    except (MaxTurnsExceeded, ModelBehaviorError):  # an answer cut by max_tokens, or a run that never ended
        return 0.0
    finally:
        await client.close()
    return reward(result.final_output, int(task["answer"]))
