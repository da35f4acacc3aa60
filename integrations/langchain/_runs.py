"""Which LangChain / LangGraph runs become agl spans, and under what name.

LangChain reports every Runnable as a run (graph, node, sequence, prompt, routing function, channel
write...). Turning each into a span would bury the few that matter for training, so only these do:

- ``agent`` spans, whose ``gen_ai.agent.name`` is what ``agent_match`` selects LLM calls by:
  a LangGraph node's own run (name = node name, e.g. ``write_query``), or a functional-API ``@task``'s
  (name = the task's function name, e.g. ``write_essay``); a ``langchain.agents.create_agent``
  agent created with ``name=`` (the run where its ``lc_agent_name`` begins: name = that name; its own
  ``model``/``tools`` nodes then become chain spans, so its LLM calls belong to the agent's name); a
  classic ``AgentExecutor`` (name = its run name).
- ``chain`` spans: the root run of an invocation (e.g. the whole graph), so one call is one subtree.
- everything else (LangGraph internals such as the ``__start__`` node and ``ChannelWrite``, prompts,
  sequences, routing functions) gets no span: its children attach to the nearest run that has one.

This module only decides; it imports nothing from LangChain, so the rules read on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Literal, Mapping, Optional

SpanKind = Literal["agent", "chain"]

_HIDDEN_TAG = "langsmith:hidden"  # LangGraph tags its own plumbing runs with this
_NODE_TAG_PREFIX = "graph:step:"  # on a node's own run only (children get "seq:step:N")
_NODE_KEY = "langgraph_node"
_TASK_NS_KEY = "langgraph_checkpoint_ns"  # "node:<id>|task:<id>": one level per node or task, inherited below it
# LangGraph's own nodes, which run no user code: add_node refuses these names (a user's "__scratch" is a node)
_RESERVED_NODES = frozenset({"__start__", "__end__"})
_AGENT_NAME_KEY = "lc_agent_name"  # set by langchain.agents.create_agent(name=...), inherited by child runs


@dataclass(frozen=True)
class SpanPlan:
    """The span a run gets: its kind and name."""

    kind: SpanKind
    name: str
    named_agent: bool = False  # the run where a create_agent(name=...) agent begins


@dataclass(frozen=True)
class ParentInfo:
    """What a run's decision needs to know about its parent run."""

    agent_name: Optional[str]  # the lc_agent_name in effect in the parent
    named_agent: bool  # the parent is where a named create_agent agent begins
    task_ns: Optional[str] = None  # the LangGraph node or task the parent runs in (its checkpoint namespace)


def parent_info(metadata: Optional[Mapping[str, Any]], named_agent: bool = False) -> ParentInfo:
    """What a run's children need to know about it, from the run's own metadata."""
    task_ns = (metadata or {}).get(_TASK_NS_KEY)
    return ParentInfo(agent_name_in_effect(metadata), named_agent, task_ns if isinstance(task_ns, str) else None)


def plan_chain_run(
    name: str,
    serialized: Optional[Mapping[str, Any]],
    tags: Optional[List[str]],
    metadata: Optional[Mapping[str, Any]],
    parent: Optional[ParentInfo],
) -> Optional[SpanPlan]:
    """The span for a chain run, or None when the run should be transparent.

    ``parent`` is None for a root run (or one whose parent agl never saw).
    """
    tags = tags or []
    metadata = metadata or {}
    if _HIDDEN_TAG in tags or name in _RESERVED_NODES:
        return None
    agent_name = metadata.get(_AGENT_NAME_KEY)
    if isinstance(agent_name, str) and agent_name and (parent is None or parent.agent_name != agent_name):
        return SpanPlan("agent", agent_name, named_agent=True)
    if is_node_run(name, tags, metadata, parent):
        # The model/tools nodes of a named create_agent agent are its steps, not agents of their own.
        return SpanPlan("chain" if parent is not None and parent.named_agent else "agent", name)
    if _class_name(serialized) == "AgentExecutor":
        return SpanPlan("agent", name)
    if parent is None:
        return SpanPlan("chain", name)
    return None


def agent_name_in_effect(metadata: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The create_agent name a run belongs to (inherited through metadata), if any."""
    value = (metadata or {}).get(_AGENT_NAME_KEY)
    return value if isinstance(value, str) and value else None


def run_name(name: Optional[str], serialized: Optional[Mapping[str, Any]], default: str) -> str:
    """LangChain passes the run name as ``name=``; older callers only put it in ``serialized``."""
    if name:
        return name
    if serialized:
        return str(serialized.get("name") or _class_name(serialized) or default)
    return default


def is_node_run(
    name: str, tags: List[str], metadata: Optional[Mapping[str, Any]], parent: Optional[ParentInfo]
) -> bool:
    """A LangGraph node's or functional-API task's own run, named after it (``langgraph_node``, which its
    child runs inherit too).

    A node's run is tagged with the graph step; its children are not. A ``@task`` runs under the callbacks
    of the code that called it, so it is tagged ``seq:step:N`` like any step of a sequence: what marks its
    own run is that a checkpoint namespace level begins there (its parent runs in the caller's namespace,
    its children in its own).
    """
    metadata = metadata or {}
    if metadata.get(_NODE_KEY) != name:
        return False
    if any(tag.startswith(_NODE_TAG_PREFIX) for tag in tags):
        return True
    task_ns = metadata.get(_TASK_NS_KEY)
    return isinstance(task_ns, str) and parent is not None and parent.task_ns != task_ns


def _class_name(serialized: Optional[Mapping[str, Any]]) -> Optional[str]:
    ids = serialized.get("id") if serialized else None
    return ids[-1] if isinstance(ids, list) and ids and isinstance(ids[-1], str) else None
