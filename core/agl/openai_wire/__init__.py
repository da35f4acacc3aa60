"""Layer 3: the OpenAI wire format, once. Requests, answers and streams of the chat, completions and Responses
APIs as torch-free data code, shared by the client hook, the recording proxy, the policy server (and agl's
fake server) and LightningRL's re-tokenizer.

- :mod:`~agl.openai_wire.apis`: the APIs' names and paths, vLLM's and agl's extra fields, ``BadRequest``,
  OpenAI's error object, a response's header;
- :mod:`~agl.openai_wire.chat_completions`: chat messages, tool calls, choices, chunks, usage;
- :mod:`~agl.openai_wire.chat_format`: chat messages and tools as prompt text, generated text back to
  content and tool calls (agl's tool-call format);
- :mod:`~agl.openai_wire.responses`: Responses requests as chat requests, ``response`` objects, items, events;
- :mod:`~agl.openai_wire.logprobs`: logprob entries written and read;
- :mod:`~agl.openai_wire.stops`: stop sequences, read, checked and applied;
- :mod:`~agl.openai_wire.sampling`: sampling arguments (token limits, a trainer's defaults);
- :mod:`~agl.openai_wire.sse`: server-sent events written and read;
- :mod:`~agl.openai_wire.payloads`: what a recorded call's span holds of its request and answer;
- :mod:`~agl.openai_wire.streams`: streamed answers reassembled for recording.
"""
