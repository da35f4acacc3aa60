"""Span attribute names: the one vocabulary every integration writes and LightningRL reads.

Names follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``) where those define the concept;
``agl.*`` names are added only where none exists (token ids, logprobs, rewards, rollout bookkeeping).
See docs/semconv.md for the meaning and type of each attribute.
"""

from __future__ import annotations

import enum

# --- span kind (agl) ----------------------------------------------------------------------------------
SPAN_KIND = "agl.span.kind"  # agent | llm | tool | chain | reward | annotation
SPAN_STOPPED = "agl.span.stopped"  # True: the caller stopped the run (left its stream, cancelled it): no error
# Rollout id, attempt id and sequence id are fields of agl.types.Span, not attributes. Spans that arrive
# over OTLP (the store server's /v1/traces) carry them as attributes of the span or of its resource:
OTLP_ROLLOUT_ID = "agl.rollout.id"  # str: the rollout the span belongs to
OTLP_ATTEMPT_ID = "agl.attempt.id"  # str: the attempt (rollout.attempt.attempt_id)
OTLP_SEQUENCE_ID = "agl.sequence.id"  # int >= 0, optional: order within the attempt (default: start time in ns)
# On the runner's root span (``agl.rollout``), for readers of the trace alone (an OTLP backend, agl inspect):
ROLLOUT_TASK_ID = "agl.task_id"  # str: the rollout's task
ROLLOUT_MODE = "agl.mode"  # train | val | dev

# --- agents (OTel GenAI) ---------------------------------------------------------------------------------
OPERATION_NAME = "gen_ai.operation.name"  # chat | invoke_agent | execute_tool | ...
AGENT_NAME = "gen_ai.agent.name"
AGENT_ID = "gen_ai.agent.id"
FRAMEWORK = "agl.framework"  # which integration produced the span: openai, langchain, ...

# --- LLM requests and responses (OTel GenAI) -------------------------------------------------------------
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"  # n (x prompts of a Completions batch): choice 0 trains
INPUT_MESSAGES = "gen_ai.input.messages"  # JSON list of chat messages as sent
TOOL_DEFINITIONS = "gen_ai.tool.definitions"  # JSON list of tools offered
OUTPUT_MESSAGES = "gen_ai.output.messages"  # JSON list with the assistant message (content + tool calls)
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

# --- LLM extras for training (agl) -----------------------------------------------------------------------
LLM_API = "agl.llm.api"  # chat.completions | responses | completions
LLM_STREAM = "agl.llm.stream"  # bool
STREAM_ABANDONED = "agl.llm.stream_abandoned"  # True: the agent stopped reading the stream before it ended
STREAM_TRUNCATED = "agl.llm.stream_truncated"  # True: the server ended the stream before the answer was complete
REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"  # list[str]: the request's `stop` strings
LLM_PROMPT = "agl.llm.prompt"  # completions API: the prompt as sent, a string or a list of token ids
PROMPT_TOKEN_IDS = "agl.llm.prompt_token_ids"  # list[int], exactly as the server tokenized the prompt
RESPONSE_TOKEN_IDS = "agl.llm.response_token_ids"  # list[int], exactly as sampled
RESPONSE_LOGPROBS = "agl.llm.response_logprobs"  # list[float], one per response token
#: Set by a store on a span whose prompt began with an earlier span's ids when that span was deleted first: how
#: many ids are missing from the front of its prompt_token_ids (agl.store.prefixes).
PROMPT_PREFIX_MISSING = "agl.llm.prompt_prefix_missing"
TOKEN_IDS_SOURCE = "agl.llm.token_ids_source"  # server | absent | refused (the server rejects the request for them)
RESOURCES_VERSION = "agl.llm.resources_version"  # the policy version that answered (agl server)
# structured output (``parse``): the answer arrived but did not parse (``ValidationError: ...``); still a sample
PARSE_ERROR = "agl.llm.parse_error"

# --- tools (OTel GenAI) ----------------------------------------------------------------------------------
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"  # JSON string
TOOL_CALL_RESULT = "gen_ai.tool.call.result"  # string (JSON when structured)
ERROR_TYPE = "error.type"  # exception class name when the operation failed

# --- rewards and annotations (agl) -----------------------------------------------------------------------
REWARD_VALUE = "agl.reward.value"  # float: the primary reward
REWARD_PRIMARY = "agl.reward.primary"  # str: name of the primary dimension
REWARD_DIMENSIONS = "agl.reward.dimensions"  # JSON object {name: float} when rewards are named
REWARD_SOURCE = "agl.reward.source"  # emitted | returned
REWARD_SCOPE = "agl.reward.scope"  # episode (the rollout's outcome) | step (inside an agl.operation)
MESSAGE_BODY = "agl.message.body"
OBJECT_JSON = "agl.object.json"
OBJECT_TYPE = "agl.object.type"
OPERATION = "agl.operation.name"
OPERATION_INPUT = "agl.operation.input"
OPERATION_OUTPUT = "agl.operation.output"
OPERATION_SPAN_ID = "agl.operation.span_id"  # on llm, tool and reward spans made inside an agl.operation
TAG = "agl.tag"  # agl.tag.N: tags of a span (agl.compat.utils.make_tag_attributes)
LINK = "agl.link"  # agl.link.N.{key_match,value_match}: which spans a span judges (make_link_attributes)

# --- span names written by agl itself --------------------------------------------------------------------
SPAN_REWARD = "agl.reward"
SPAN_MESSAGE = "agl.message"
SPAN_OBJECT = "agl.object"
SPAN_EXCEPTION = "agl.exception"
SPAN_OPERATION = "agl.operation"
SPAN_ANNOTATION = "agl.annotation"
SPAN_CHAT = "chat"  # llm spans: "chat {model}" per the GenAI conventions


# --- Agent Lightning v0.3's names for agl's span names and attribute prefixes (its code imports them from
# agentlightning.semconv): the same meaning, agl's values, so such code finds agl's spans.
AGL_ANNOTATION = SPAN_ANNOTATION
AGL_MESSAGE = SPAN_MESSAGE
AGL_OBJECT = SPAN_OBJECT
AGL_EXCEPTION = SPAN_EXCEPTION
AGL_OPERATION = SPAN_OPERATION
AGL_REWARD = SPAN_REWARD


class LightningSpanAttributes(enum.Enum):
    """Agent Lightning's attribute names, as agl writes them (``filter_and_unflatten_attributes(attrs,
    LightningSpanAttributes.REWARD.value)`` reads agl's reward: ``{"value": ..., "primary": ...}``)."""

    REWARD = "agl.reward"
    LINK = LINK
    TAG = TAG
    MESSAGE_BODY = MESSAGE_BODY
    OBJECT_TYPE = OBJECT_TYPE
    OBJECT_JSON = OBJECT_JSON
    OPERATION_NAME = OPERATION
    OPERATION_INPUT = OPERATION_INPUT
    OPERATION_OUTPUT = OPERATION_OUTPUT
