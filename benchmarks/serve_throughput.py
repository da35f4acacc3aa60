"""Generated tokens/s of `agl serve` (PolicyServer + SmolLM2-135M) for 1, 4 and 16 concurrent clients.

Target (issue 5): with 16 concurrent requests the server generates >= 3x the tokens/s of a single request,
on this 2-core CPU machine. Each client sends its requests one after the other through the real `openai`
client over HTTP (temperature 0.7, a fixed answer budget); tokens are the `completion_tokens` the server
reports. For reference the same run measures transformers' plain `generate` at batch 1 and 8 (the issue
quotes ~28 tokens/s at batch 8). Prints figures; exits 0.

    python benchmarks/serve_throughput.py [--max-tokens 48] [--requests-per-client 2]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Tuple

import openai
import torch

from agl.serving import PolicyServer
from agl.serving.models import load_policy

TOPICS = ["the sea", "a cat", "autumn", "a robot", "the moon", "coffee", "a city", "rain"]


def question(i: int) -> List[dict]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}]


def plain_generate(model: Any, tokenizer: Any, batch: int, max_tokens: int) -> float:
    """tokens/s of transformers' generate on `batch` left-padded prompts (sampling, no early stop)."""
    texts = [
        tokenizer.apply_chat_template(question(i), tokenize=False, add_generation_prompt=True) for i in range(batch)
    ]
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True, temperature=0.7
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - inputs["input_ids"].shape[1]) * batch / elapsed


def served(base_url: str, clients: int, per_client: int, max_tokens: int) -> Tuple[float, int, float]:
    """(tokens/s, tokens, seconds) for `clients` concurrent clients sending `per_client` requests each."""

    def client_loop(index: int) -> int:
        tokens = 0
        with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=600) as client:
            for round_ in range(per_client):
                completion = client.chat.completions.create(
                    model="policy",
                    messages=question(index),
                    max_tokens=max_tokens,
                    temperature=0.7,
                    seed=index * 1000 + round_,
                )
                tokens += completion.usage.completion_tokens
        return tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client_loop, range(clients)))
    elapsed = time.perf_counter() - start
    return tokens / elapsed, tokens, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--requests-per-client", type=int, default=2)
    args = parser.parse_args()

    start = time.perf_counter()
    model, tokenizer = load_policy("smollm2")
    print(f"SmolLM2-135M loaded in {time.perf_counter() - start:.1f} s; torch threads: {torch.get_num_threads()}")
    plain_generate(model, tokenizer, 1, 2)  # warm-up
    baseline = {b: plain_generate(model, tokenizer, b, args.max_tokens) for b in (1, 8)}
    rates = {}
    with PolicyServer(model, tokenizer, max_batch_size=16) as server:
        served(server.base_url, 1, 1, 4)  # warm-up
        for clients in (1, 4, 16):
            before = server.stats.decode_steps, server.stats.row_steps
            rate, tokens, elapsed = served(server.base_url, clients, args.requests_per_client, args.max_tokens)
            steps = server.stats.decode_steps - before[0]
            mean_batch = (server.stats.row_steps - before[1]) / steps if steps else 0.0
            rates[clients] = rate
            print(
                f"  {clients:2d} concurrent: {rate:6.1f} tokens/s  ({tokens} tokens in {elapsed:5.1f} s, "
                f"mean batch {mean_batch:4.1f})"
            )
    print(f"plain generate (same run): batch 1 {baseline[1]:.1f} tokens/s, batch 8 {baseline[8]:.1f} tokens/s")
    ratio = rates[16] / rates[1]
    verdict = "met" if ratio >= 3 else "NOT met"
    print(f"16 vs 1 concurrent: {ratio:.1f}x (target >= 3x: {verdict}); max_tokens {args.max_tokens}")


if __name__ == "__main__":
    main()
