"""From an attempt's trace tree to transitions: one per selected LLM call, with its exact token ids.

Every llm span of the attempt ends up in exactly one of four places, so the counts always add up
(``Extraction.accounted``)::

    llm spans = filtered_by_agent + filtered_by_call + sum(skipped.values()) + len(transitions)

- **filtered_by_agent**: its agent's name does not match ``agent_match`` (see ``agl.lightningrl.agent_match``);
- **filtered_by_call**: ``llm_call_match`` (a regex, ``re.search``) matches neither the span's name
  (``chat {model}``) nor its ``gen_ai.request.model``;
- **skipped**, by reason: the request failed (``llm call failed``), or the call has no response tokens
  (``empty response``: also a call without ids that received no answer, such as a stream closed before
  its first chunk) or no prompt tokens (``empty prompt``): never an empty sample; or its server refused
  to return token ids (``server refuses token ids``, below); or its stream ended, abandoned by the agent
  or cut by the server, before any token ids arrived (``stream ended before token ids``); or it could not
  be re-tokenized (``cannot re-tokenize``, ``tool calls the chat template does not render``: see
  ``agl.lightningrl.retokenize``; one warning per such span, so one span never sinks a batch);
- a **transition**.

A call without token ids is decided by :func:`_skip_without_ids`. :class:`agl.errors.MissingTokenIdsError`
is meant for a server that never returns ids: it is raised only for a selected call that has an answer
(output, or a finish reason) and whose server returned none (``agl.llm.token_ids_source == "absent"``, or
a span recorded without a source), and only without a tokenizer; with one, the call's messages are
re-tokenized (``agl.lightningrl.retokenize``) and counted in ``retokenized``. Without ids and without a
tokenizer, these are skipped, never an error, since none says anything about the server:

- a call that received no answer (nothing arrived of its stream, a response closed unread): ``empty
  response``, with or without a tokenizer;
- a call whose server rejected the ``return_token_ids`` request (``"refused"``: api.openai.com and the
  like, see ``agl.instrumentation.token_id_refusals``), a model that no agl trainer serves, such as an LLM
  judge: ``server refuses token ids``;
- a stream that ended before the server sent ids (``agl.llm.stream_abandoned`` or
  ``agl.llm.stream_truncated``; a Responses API stream carries its ids on its final event): ``stream
  ended before token ids``.

A stream with ids that ended early (abandoned, truncated) is trained on what arrived, as what the agent
acted on.

``step`` is the call's index among *all* llm calls of the attempt in call order, so a call keeps its step
whatever ``agent_match`` selects. ``response_logprobs`` is kept only when there is exactly one per response
token, all finite (else None, counted in ``logprobs_dropped``); re-tokenized calls have none. A call that
asked for several choices (``n > 1``) becomes one transition of choice 0, the only one whose ids are
recorded, whichever choice the agent went on with: counted in ``several_choices``, so the batch report says
so.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, List, Optional, Pattern, Tuple, Union

from agl import semconv
from agl.errors import MissingTokenIdsError
from agl.lightningrl.agent_match import AgentMatch, PolicyMatcher
from agl.lightningrl.links import json_attribute, output_message, tool_calls_of
from agl.lightningrl.retokenize import RetokenizeError, Retokenizer
from agl.lightningrl.tree import TraceTree
from agl.lightningrl.types import Transition
from agl.types import Span

logger = logging.getLogger("agl.lightningrl")

SKIP_CALL_FAILED = "llm call failed"
SKIP_EMPTY_RESPONSE = "empty response"
SKIP_EMPTY_PROMPT = "empty prompt"
SKIP_REFUSED = "server refuses token ids"
SKIP_STREAM_NO_IDS = "stream ended before token ids"


class CallSelector:
    """``agent_match`` and ``llm_call_match``, compiled once for every attempt of a batch."""

    def __init__(self, agent_match: AgentMatch = None, llm_call_match: Union[str, Pattern[str], None] = None) -> None:
        self.policies = agent_match if isinstance(agent_match, PolicyMatcher) else PolicyMatcher(agent_match)
        if llm_call_match is None or isinstance(llm_call_match, re.Pattern):
            self.call_pattern = llm_call_match
        elif isinstance(llm_call_match, str):
            try:
                self.call_pattern = re.compile(llm_call_match)
            except re.error as exc:
                raise ValueError(
                    f"llm_call_match {llm_call_match!r} is not a valid regular expression: {exc}"
                ) from None
        else:
            raise TypeError(f"llm_call_match must be None or a regex string, got {type(llm_call_match).__name__}")

    def call_matches(self, span: Span) -> bool:
        if self.call_pattern is None:
            return True
        model = span.attributes.get(semconv.REQUEST_MODEL)
        return bool(self.call_pattern.search(span.name) or (isinstance(model, str) and self.call_pattern.search(model)))


@dataclass
class Extraction:
    """The transitions of one attempt, and where every other llm span went."""

    transitions: List[Transition] = field(default_factory=list)
    llm_spans: int = 0
    filtered_by_agent: int = 0
    filtered_agents: Counter = field(default_factory=Counter)  # agent name -> calls agent_match left out
    filtered_by_call: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> number of llm spans
    retokenized: int = 0
    logprobs_dropped: int = 0
    several_choices: int = 0  # transitions of calls that asked for n > 1 choices (choice 0 trained)

    @property
    def accounted(self) -> bool:
        """Every llm span is a transition, filtered or skipped (the counts add up)."""
        placed = self.filtered_by_agent + self.filtered_by_call + sum(self.skipped.values()) + len(self.transitions)
        return placed == self.llm_spans


def extract_transitions(
    tree: TraceTree,
    *,
    task_id: str,
    selector: Optional[CallSelector] = None,
    retokenizer: Optional[Retokenizer] = None,
    mode: str = "train",
) -> Extraction:
    """The transitions of one attempt (see the module docstring), in call order, rewards not yet set;
    ``task_id`` and ``mode`` are the rollout's."""
    selector = selector or CallSelector()
    out = Extraction()
    for step, span in enumerate(tree.llm_spans()):
        out.llm_spans += 1
        agent = tree.enclosing_agent(span.span_id)
        agent_name = agent.attributes.get(semconv.AGENT_NAME) if agent is not None else None
        policy = selector.policies.policy_for(agent_name)
        if policy is None:
            out.filtered_by_agent += 1
            out.filtered_agents[str(agent_name)] += 1
            continue
        if not selector.call_matches(span):
            out.filtered_by_call += 1
            continue
        if span.status == "error":
            out.skipped[SKIP_CALL_FAILED] += 1
            continue
        ids = _token_ids(span, agent_name, retokenizer, out)
        if ids is None:
            continue
        prompt_ids, response_ids, logprobs = ids
        if not response_ids:
            out.skipped[SKIP_EMPTY_RESPONSE] += 1
            continue
        if not prompt_ids:
            out.skipped[SKIP_EMPTY_PROMPT] += 1
            continue
        choices = span.attributes.get(semconv.REQUEST_CHOICE_COUNT)
        if type(choices) is int and choices > 1:
            out.several_choices += 1
        out.transitions.append(
            Transition(
                rollout_id=span.rollout_id,
                attempt_id=span.attempt_id,
                task_id=task_id,
                span_id=span.span_id,
                step=step,
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                policy=policy,
                agent_name=agent_name,
                response_logprobs=logprobs,
                mode=mode,
            )
        )
    return out


def _token_ids(
    span: Span, agent_name: Any, retokenizer: Optional[Retokenizer], out: Extraction
) -> Optional[Tuple[List[int], List[int], Optional[List[float]]]]:
    """The call's prompt and response ids (recorded, else re-tokenized) and its usable logprobs; None when the
    call is skipped, counted in ``out``."""
    prompt_ids = _ids(span.attributes.get(semconv.PROMPT_TOKEN_IDS))
    response_ids = _ids(span.attributes.get(semconv.RESPONSE_TOKEN_IDS))
    logprobs: Optional[List[float]] = None
    if prompt_ids is None or response_ids is None:
        reason = _skip_without_ids(span, retokenizing=retokenizer is not None)
        if reason is not None:
            out.skipped[reason] += 1
            return None
        if retokenizer is None:
            raise MissingTokenIdsError(span.rollout_id, span.attempt_id, span.span_id, agent_name, _why_missing(span))
        try:
            prompt_ids, response_ids = retokenizer.ids(span)
        except RetokenizeError as exc:  # this span only: the rest of the batch goes on
            out.skipped[exc.reason] += 1
            logger.warning(
                "LightningRL skipped an llm call of rollout %s, attempt %s (%s): %s",
                span.rollout_id,
                span.attempt_id,
                exc.reason,
                exc,  # exc names the span
            )
            return None
        out.retokenized += 1
    else:
        logprobs = _floats(span.attributes.get(semconv.RESPONSE_LOGPROBS))
        if logprobs is not None and (len(logprobs) != len(response_ids) or not _all_finite(logprobs)):
            logprobs = None  # a -inf or NaN old logprob would make the PPO ratio infinite
            out.logprobs_dropped += 1
    return prompt_ids, response_ids, logprobs


def _skip_without_ids(span: Span, retokenizing: bool) -> Optional[str]:
    """Why a call without token ids is skipped (see the module docstring); None: it is re-tokenized, or it is
    a call answered by a server that returned no ids, which raises ``MissingTokenIdsError``."""
    if not _answered(span):
        return SKIP_EMPTY_RESPONSE
    if retokenizing:
        return None
    if span.attributes.get(semconv.TOKEN_IDS_SOURCE) == "refused":
        return SKIP_REFUSED
    if span.attributes.get(semconv.STREAM_ABANDONED) or span.attributes.get(semconv.STREAM_TRUNCATED):
        return SKIP_STREAM_NO_IDS
    return None


def _answered(span: Span) -> bool:
    """Whether anything of an answer arrived: a finish reason (a whole answer, even an empty one), text or a
    tool call. A stream closed before its first chunk, or a response closed unread, has none of them."""
    if span.attributes.get(semconv.RESPONSE_FINISH_REASONS):
        return True
    message = output_message(span)
    return bool(message.get("content") or tool_calls_of(message))


def _why_missing(span: Span) -> str:
    source = span.attributes.get(semconv.TOKEN_IDS_SOURCE)
    model = span.attributes.get(semconv.REQUEST_MODEL)
    call = f"the call to model {model!r}" if model else "the call"
    if source == "absent":
        return f"the server did not return token ids for {call} ({semconv.TOKEN_IDS_SOURCE} = 'absent')"
    missing = [
        a for a in (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS) if _ids(span.attributes.get(a)) is None
    ]
    return f"the span of {call} has no {' and no '.join(missing)} ({semconv.TOKEN_IDS_SOURCE} = {source!r})"


def _ids(value: Any) -> Optional[List[int]]:
    """A list of token ids from a stored attribute (a list, or a JSON string of one); None if absent.

    Only the ends are type-checked, as the tracer does when it stores them: a per-token check would be
    most of the cost of building a batch, and ids come from the server's JSON as ints. The span's own list is
    used, not a copy (a store makes new spans for each read): copying touches every id, and that was a fifth
    of the time LightningRL took on calls of real size.
    """
    value = _decoded(value)
    if isinstance(value, list) and (not value or (type(value[0]) is int and type(value[-1]) is int)):
        return value if type(value) is list else list(value)
    return None


def _floats(value: Any) -> Optional[List[float]]:
    value = _decoded(value)
    if isinstance(value, list) and (not value or (type(value[0]) in _NUMBERS and type(value[-1]) in _NUMBERS)):
        return list(map(float, value))
    return None


_NUMBERS = (int, float)


def _all_finite(values: List[float]) -> bool:
    """No value is infinite or NaN. A finite sum proves it in one pass in C (an inf or a NaN would make the sum
    one); an infinite sum may also come from finite values adding up past the float range, so then each is
    checked."""
    return math.isfinite(sum(values)) or all(map(math.isfinite, values))


def _decoded(value: Any) -> Any:
    value = json_attribute(value)
    if isinstance(value, tuple):
        return list(value)
    return value
