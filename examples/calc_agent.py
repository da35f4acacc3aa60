"""A plain-Python tool-using agent (openai client + two calculator tools), trainable with agl.

Run it on the bundled tasks with agl's scripted fake model (no GPU, no network):

    agl dev examples/calc_agent.py:calc_agent --data examples/data/calc_tasks.jsonl --fake-model

or against any OpenAI-compatible endpoint (vLLM, agl serve, OpenAI):

    agl dev examples/calc_agent.py:calc_agent --data examples/data/calc_tasks.jsonl \\
        --endpoint http://127.0.0.1:8000/v1 --model Qwen/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import json

from openai import OpenAI

import agl

agl.instrument()  # the one line: LLM calls become spans with token ids

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.capitalize()} two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
    for name in ("add", "multiply")
]


@agl.tool
def add(a: float, b: float) -> float:
    return a + b


@agl.tool
def multiply(a: float, b: float) -> float:
    return a * b


def _format(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@agl.rollout
def calc_agent(task: dict, llm: agl.LLM) -> float:
    """Answer an arithmetic question with the tools; reward 1 if the final answer holds the right number."""
    client = OpenAI(base_url=llm.get_base_url(), api_key=llm.api_key or "unused")
    messages: list = [
        {"role": "system", "content": "You are a careful calculator. Use the tools, then state the answer."},
        {"role": "user", "content": task["question"]},
    ]
    answer = ""
    for _ in range(4):
        response = client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS, **llm.sampling_parameters
        )
        message = response.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            fn = {"add": add, "multiply": multiply}.get(call.function.name)
            try:
                result = _format(fn(**json.loads(call.function.arguments))) if fn else "unknown tool"
            except Exception as exc:  # noqa: BLE001 - the model gave bad arguments: tell it, as agents do
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 1.0 if _format(task["answer"]) in answer else 0.0
