"""A LangGraph calculator agent with two LLM nodes, trainable with agl and the one line ``agl.instrument()``.

``solve`` answers with calculator tools (the ``tools`` node runs them), then ``check`` reviews the answer
and states the final one. Each node is an agent span named after it, so training can pick one node's LLM
calls: ``agent_match="^solve$"`` or ``"^check$"``.

Run it on the bundled tasks with agl's scripted fake model (no GPU, no network):

    agl dev examples/langgraph_agent.py:langgraph_calc_agent --data examples/data/calc_tasks.jsonl --fake-model

or against any OpenAI-compatible endpoint (vLLM, agl serve, OpenAI):

    agl dev examples/langgraph_agent.py:langgraph_calc_agent --data examples/data/calc_tasks.jsonl \\
        --endpoint http://127.0.0.1:8000/v1 --model Qwen/Qwen2.5-0.5B-Instruct

Needs ``pip install "agl[langgraph]"``.
"""

from __future__ import annotations

from typing import Any, Dict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import agl

agl.instrument()  # the one line: nodes become agent spans, tools tool spans, LLM calls llm spans with token ids


@tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


TOOLS = [add, multiply]


def build_graph(model: ChatOpenAI) -> Any:
    """START -> solve <-> tools, then check -> END."""
    solver = model.bind_tools(TOOLS)

    def solve(state: MessagesState) -> Dict[str, Any]:
        system = SystemMessage("You are a careful calculator. Use the tools, then state the answer.")
        return {"messages": [solver.invoke([system, *state["messages"]])]}

    def check(state: MessagesState) -> Dict[str, Any]:
        question, proposed = state["messages"][0].content, state["messages"][-1].content
        review = f"Question: {question}\nProposed answer: {proposed}\nCheck it and state the final answer."
        return {"messages": [model.invoke([HumanMessage(review)])]}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_node("check", check)
    graph.add_edge(START, "solve")
    graph.add_conditional_edges("solve", tools_condition, {"tools": "tools", END: "check"})
    graph.add_edge("tools", "solve")
    graph.add_edge("check", END)
    return graph.compile()


def _format(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@agl.rollout
def langgraph_calc_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """Answer an arithmetic question; reward 1 if the checked final answer holds the right number."""
    model = ChatOpenAI(
        base_url=llm.get_base_url(),
        api_key=llm.api_key or "unused",
        model=llm.model,
        **llm.sampling_parameters,
    )
    state = build_graph(model).invoke({"messages": [HumanMessage(task["question"])]}, {"recursion_limit": 12})
    answer = state["messages"][-1].content
    return 1.0 if _format(task["answer"]) in answer else 0.0
