"""Test helpers: a real OpenAI-compatible HTTP server whose model is scripted.

``FakeOpenAIServer`` lets tests, examples and ``agl dev`` run real agent frameworks and the real ``openai``
client end to end without a GPU or network; ``FakeReply`` scripts its answers and ``FakeTokenizer`` is the
byte-level tokenizer it reports token ids with; ``ADD_TOOL`` is a calculator tool its default model calls.
``ListSink`` is an in-memory span sink; ``without_token_ids`` makes stored spans look as if a server without
token ids had answered; ``assert_tool_reward_credited`` checks the credit of a reward emitted in a framework's
tool.
"""

from agl.testing.fake_openai import FakeOpenAIServer
from agl.testing.fake_policy import ADD_TOOL, FakeReply, FakeTokenizer
from agl.testing.sink import ListSink, tracer_writes_to
from agl.testing.spans import assert_tool_reward_credited, without_token_ids

__all__ = [
    "ADD_TOOL",
    "FakeOpenAIServer",
    "FakeReply",
    "FakeTokenizer",
    "ListSink",
    "assert_tool_reward_credited",
    "tracer_writes_to",
    "without_token_ids",
]
