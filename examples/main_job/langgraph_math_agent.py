"""The main job's agent: a LangGraph calculator with two LLM nodes and a tool node between them.

    START -> solve (LLM: request -> arithmetic expression) -> calculator (tool: evaluates it)
          -> answer (LLM: states the result as "The answer is N.") -> END

The reward asks for the exact final sentence with the right number, which the untrained SmolLM2-135M rarely
writes: it often rewrites the request in words instead of an expression, gets the operation wrong, or
wraps the answer in chatter ("The final answer is 46", "The result is 63."). Both LLM nodes are trained
(``agent_match="^(solve|answer)$"``); the calculator is plain Python, so the arithmetic itself is exact once
the solver writes the right expression.

Reward: 1.0 for exactly ``The answer is N.`` with the correct N, 0.0 for anything else; a rollout succeeds
when its reward is 1.0. There is deliberately no partial credit for the right number in another sentence:
with 0.5 for it, two of five runs ended with every sample of every group on 0.5 ("The final answer is: 20"),
no advantage left and 0% success (docs/training.md, "The main job").
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

import agl

SOLVE_PROMPT = (
    "Translate the request into an arithmetic expression for the calculator. Examples:\n"
    "Add 3 and 5. -> 3 + 5\nWhat is 9 minus 2? -> 9 - 2\nMultiply 4 by 6. -> 4 * 6\n"
    "Reply with the expression only."
)
ANSWER_PROMPT = "Request: {question}\nCalculator: {calculation}\nWrite the final answer as: The answer is <result>."
AGENT_MATCH = "^(solve|answer)$"  # the LangGraph node names: both LLM nodes are trained

_EXPRESSION = re.compile(r"(-?\d+)\s*([+\-*x×])\s*(-?\d+)")


class State(TypedDict, total=False):
    question: str
    expression: str
    calculation: str
    answer: str


def calculate(text: str) -> Tuple[Optional[int], str]:
    """Evaluate the first ``a op b`` in ``text``: ``(value, "a op b = value")`` or ``(None, reason)``."""
    match = _EXPRESSION.search(text)
    if match is None:
        return None, "no expression found"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return value, f"{a} {op} {b} = {value}"


def build_graph(model: ChatOpenAI) -> Any:
    def solve(state: State) -> Dict[str, Any]:
        reply = model.invoke([SystemMessage(SOLVE_PROMPT), HumanMessage(state["question"])])
        return {"expression": str(reply.content)}

    def calculator(state: State) -> Dict[str, Any]:
        return {"calculation": calculate(state["expression"])[1]}

    def answer(state: State) -> Dict[str, Any]:
        prompt = ANSWER_PROMPT.format(question=state["question"], calculation=state["calculation"])
        return {"answer": str(model.invoke([HumanMessage(prompt)]).content)}

    graph = StateGraph(State)
    graph.add_node("solve", solve)
    graph.add_node("calculator", calculator)
    graph.add_node("answer", answer)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "calculator")
    graph.add_edge("calculator", "answer")
    graph.add_edge("answer", END)
    return graph.compile()


def reward(answer: str, expected: int) -> float:
    return 1.0 if answer.strip() == f"The answer is {expected}." else 0.0


@agl.rollout
def math_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    model = ChatOpenAI(
        base_url=llm.get_base_url(),
        api_key=llm.api_key or "unused",
        model=llm.model,
        max_retries=1,
        **llm.sampling_parameters,
    )
    state = build_graph(model).invoke({"question": task["question"]})
    return reward(state["answer"], int(task["answer"]))
