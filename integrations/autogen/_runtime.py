"""Handle each message an AutoGen runtime delivers in the context of the code that sent it.

``SingleThreadedAgentRuntime`` handles every message in a task of its own, created by its processing loop.
Such a task inherits the contextvars of the loop, that is of whichever code called ``runtime.start()``,
not of the code that sent the message. A runtime started in one rollout and kept for the next ones (the
runner keeps its event loop across rollouts) handled every later rollout's messages in the first
rollout's context: once that rollout had returned, the agent, tool and ``llm`` spans made while handling
them were not stored (``agl.tracing.context.current_scope``), and their parent was a span of the first rollout.

AutoGen offers no public hook that runs where a message is sent: intervention handlers run in the
processing loop, and the envelope's telemetry metadata carries only an OpenTelemetry trace parent
(which AutoGen makes a span link, not the parent). So the adapter notes the sender's rollout scope and
OpenTelemetry context on each send and publish envelope as it is made, in the sender's code, and the task
that handles the envelope (``_process_send`` / ``_process_publish``) runs in them. A message sent by a
handler carries the context that handler was given, so a team's whole exchange stays in the rollout that
started it. Responses (``_process_response``) only resolve the sender's future, nothing of an agent runs
there: they keep the loop's context. Where a version lacks one of these private names, the hook is
skipped (:class:`PatchSet`) and only the spans of a reused runtime are lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Dict, Optional, Tuple

from opentelemetry import context as otel_context

from agl._util.safety import guard
from agl.instrumentation.framework import PatchSet
from agl.tracing.context import RolloutScope, current_scope, ended_scope, enter_scope, exit_scope

_RUNTIME_MODULE = "autogen_core._single_threaded_agent_runtime"
_ENVELOPES = ("SendMessageEnvelope", "PublishMessageEnvelope")
_HANDLERS = ("SingleThreadedAgentRuntime._process_send", "SingleThreadedAgentRuntime._process_publish")
_SENDER = "_agl_sender"  # the attribute of an envelope that holds its sender's context


@dataclass(frozen=True)
class _SenderContext:
    """What the handling of a message needs of its sender's context: its rollout and its current span."""

    scope: Optional[RolloutScope]
    otel: otel_context.Context

    @classmethod
    def capture(cls) -> _SenderContext:
        # An ended scope is kept too (not None): what a task the rollout left running sends is then known
        # to come after that rollout (the tracer says so once), instead of looking like a call made outside
        # every rollout.
        return cls(current_scope() or ended_scope(), otel_context.get_current())


def _remember_sender(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """An envelope's ``__init__``: runs in the sender's code (``send_message`` / ``publish_message``)."""
    wrapped(*args, **kwargs)
    with guard("autogen.runtime_context"):
        setattr(instance, _SENDER, _SenderContext.capture())


def _handle_as_sender(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``_process_send`` / ``_process_publish``: the coroutine the runtime's task runs, in the sender's context."""
    envelope = args[0] if args else kwargs.get("message_envelope")
    sender = getattr(envelope, _SENDER, None)
    coroutine = wrapped(*args, **kwargs)
    return coroutine if sender is None else _run_in(sender, coroutine)


async def _run_in(sender: _SenderContext, coroutine: Coroutine[Any, Any, Any]) -> Any:
    # The runtime runs this coroutine in a task of its own: what is set here stays in that task.
    scope_token = enter_scope(sender.scope)
    otel_token = otel_context.attach(sender.otel)
    try:
        return await coroutine
    finally:
        otel_context.detach(otel_token)
        exit_scope(scope_token)


def handle_messages_in_sender_context(patches: PatchSet) -> None:
    """Wrap the envelopes' ``__init__`` and the runtime's handlers (each skipped where a version lacks it)."""
    for envelope in _ENVELOPES:
        patches.wrap(_RUNTIME_MODULE, f"{envelope}.__init__", _remember_sender)
    for handler in _HANDLERS:
        patches.wrap(_RUNTIME_MODULE, handler, _handle_as_sender)
