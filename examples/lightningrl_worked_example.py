"""LightningRL on a real multi-agent trace: a LangGraph writer -> checker -> rewriter graph.

The graph runs inside agl rollouts (``agl.instrument()``, one SQLite store) against agl's local fake
OpenAI-compatible server, whose scripted model returns token ids like vLLM does. Then ``LightningRL`` turns
the stored spans into transitions, rewards and advantages for two ``agent_match`` settings. The printed
output is the worked example of docs/lightningrl.md.

    python examples/lightningrl_worked_example.py [--store path/to/store.db]

The nodes: ``writer`` drafts a slogan (inside ``agl.operation("draft")``, where it emits a step reward for
the draft's length); ``checker`` calls a ``count_words`` tool through LangGraph's ``ToolNode`` and gives a
verdict; ``rewriter`` writes the final slogan. The episode reward is 1 if the final slogan names the product.
Two rollouts per task form a GRPO group; in the second one the checker's tool call has broken JSON
arguments, so the tool never runs (an Automatic Intermediate Reward penalises that call).

Needs ``pip install "agl[langgraph]"``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import agl
from agl.cli.inspection import render
from agl.lightningrl import Batch, LightningRL
from agl.testing import FakeOpenAIServer, FakeReply

agl.instrument()


@tool
def count_words(text: str) -> int:
    """Count the words of a text."""
    return len(text.split())


def build_graph(model: ChatOpenAI) -> Any:
    """START -> writer -> checker <-> tools, then rewriter -> END."""
    checker_model = model.bind_tools([count_words])

    def writer(state: MessagesState) -> Dict[str, Any]:
        with agl.operation("draft"):
            draft = model.invoke([SystemMessage("Write a short slogan."), *state["messages"]])
            agl.emit_reward({"brevity": 1.0 if len(str(draft.content).split()) <= 6 else 0.0})
        return {"messages": [draft]}

    def checker(state: MessagesState) -> Dict[str, Any]:
        return {"messages": [checker_model.invoke([SystemMessage("Check the slogan."), *state["messages"]])]}

    def rewriter(state: MessagesState) -> Dict[str, Any]:
        review = f"Slogan and review: {state['messages'][-2].content} / {state['messages'][-1].content}"
        return {"messages": [model.invoke([SystemMessage("Rewrite the slogan."), HumanMessage(review)])]}

    graph = StateGraph(MessagesState)
    graph.add_node("writer", writer)
    graph.add_node("checker", checker)
    graph.add_node("tools", ToolNode([count_words]))
    graph.add_node("rewriter", rewriter)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "checker")
    graph.add_conditional_edges("checker", tools_condition, {"tools": "tools", END: "rewriter"})
    graph.add_edge("tools", "checker")
    graph.add_edge("rewriter", END)
    return graph.compile()


@agl.rollout
def slogan_team(task: Dict[str, Any], llm: agl.LLM) -> float:
    model = ChatOpenAI(base_url=llm.get_base_url(), api_key="unused", model=llm.model)
    state = build_graph(model).invoke({"messages": [HumanMessage(f"Product: {task['product']}")]})
    return 1.0 if task["product"].lower() in str(state["messages"][-1].content).lower() else 0.0


def script(server: FakeOpenAIServer) -> None:
    """The model's answers, in request order (one runner, so the two rollouts run one after the other)."""
    server.script(
        # rollout 1: short draft, the checker counts its words, names the product in the final slogan
        FakeReply(content="Glow brighter every day"),
        FakeReply(tool_calls=[{"name": "count_words", "arguments": {"text": "Glow brighter every day"}}]),
        FakeReply(content="Four words: fine."),
        FakeReply(content="Lumo: glow brighter every day"),
        # rollout 2: long draft, the checker's tool call has broken JSON, the final slogan forgets the product
        FakeReply(content="A lamp that makes your whole evening a little warmer"),
        FakeReply(tool_calls=[{"name": "count_words", "arguments": '{"text": "A lamp'}]),
        FakeReply(content="Too long."),
        FakeReply(content="Warm evenings"),
    )


def show(title: str, batch: Batch) -> None:
    print(f"\n=== {title}")
    print(f"report: {batch.report}")
    advantage = {s.span_ids[0]: (s.advantage, s.loss_weight) for s in batch.samples}
    print(
        f"{'rollout':<8} {'step':>4} {'agent':<9} {'policy':<8} {'prompt':>6} {'resp':>4} "
        f"{'step rewards':<40} {'reward':>7} {'adv':>7} {'weight':>6}"
    )
    rollouts: List[str] = []
    for t in batch.transitions:
        if t.rollout_id not in rollouts:
            rollouts.append(t.rollout_id)
        adv, weight = advantage[t.span_id]
        steps = json.dumps({k: round(v, 3) for k, v in t.step_rewards.items()})
        print(
            f"{'#' + str(rollouts.index(t.rollout_id) + 1):<8} {t.step:>4} {t.agent_name:<9} {t.policy:<8} "
            f"{len(t.prompt_ids):>6} {len(t.response_ids):>4} {steps:<40} {t.reward:>7.3f} {adv:>7.3f} {weight:>6.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="SQLite file to write (default: a temporary one)")
    args = parser.parse_args()
    store_path = Path(args.store or Path(tempfile.mkdtemp()) / "worked_example.db")

    with FakeOpenAIServer() as server:
        script(server)
        trainer = agl.Trainer(
            store=str(store_path),
            runner_mode="thread",
            initial_resources={"main_llm": agl.LLM(endpoint=server.base_url, model="fake-model")},
            progress=False,
        )
        with trainer.runners(slogan_team):
            rollouts = trainer.run_tasks([{"product": "Lumo"}], n_per_task=2)

    print(f"store: {store_path}")
    for i, r in enumerate(rollouts, 1):
        print(f"rollout #{i} {r.rollout_id}: {r.status}, episode reward {r.final_reward}")
    print("\nthe trace of rollout #1 (agl inspect):")
    print(render(trainer.store.query_spans(rollouts[0].rollout_id)))

    common = {"credit": "discounted", "gamma": 0.9, "air": {"tool_ok": 0.1}}
    settings = [
        ('agent_match="writer|rewriter"', {"agent_match": "writer|rewriter", **common}),
        (
            'agent_match={"writer": "author", "checker": "critic"}',
            {"agent_match": {"writer": "author", "checker": "critic"}, **common},
        ),
    ]
    for title, config in settings:
        show(title, LightningRL.from_config(config).build_batch(trainer.store, rollouts, progress=False))


if __name__ == "__main__":
    main()
