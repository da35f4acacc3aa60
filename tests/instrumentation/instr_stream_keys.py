"""What a streamed call's llm span records as its plain (non-streamed) twin does, for the OpenAI tests here."""

from __future__ import annotations

from agl import semconv

STREAMED_AS_PLAIN = (
    semconv.PROMPT_TOKEN_IDS,
    semconv.RESPONSE_TOKEN_IDS,
    semconv.RESPONSE_LOGPROBS,
    semconv.RESPONSE_FINISH_REASONS,
    semconv.USAGE_INPUT_TOKENS,
    semconv.USAGE_OUTPUT_TOKENS,
)
