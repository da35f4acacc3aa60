"""Layer 3: the OpenAI wire format, once. Requests, answers and streams of the chat, completions and Responses
APIs as torch-free data code, shared by the client hook, the recording proxy, the policy server and
LightningRL's re-tokenizer."""
