"""GPU smoke of agl's own torch path: PolicyServer and TorchGRPO on CUDA, end to end, in a few minutes.

    python benchmarks/torch_gpu_smoke.py [--model smollm2|tiny|PATH] [--steps 8] [--runner-mode thread|process]

The CPU test suite pins its models to the CPU, so this script is what runs the CUDA code paths: the policy
loads on the default device (CUDA when available, bfloat16), the recording server generates on it, thread
runners run a one-call agent through the real ``openai`` client, LightningRL turns the calls into samples
and TorchGRPO updates a LoRA adapter on the GPU and pushes it to the server between steps. The agent's
reward is the share of vowels in its answer, a toy objective that varies between any model's samples (the
random ``tiny`` model's included), so every step has advantages to train on.

Before training it checks the served APIs on the device: a greedy chat completion and the same request
through the Responses API (plain and streamed) give the same token ids and text, a seeded top-p sample
repeats, a JSON-schema ``response_format`` is enforced (structured output), and a named ``tool_choice``
gives exactly one call whose arguments match the tool's schema (the one-call grammar). Prints served
tokens/s at 1 and 16 concurrent clients, seconds per training step, train tokens/s, the reward per step and
the logprob drift (served logprobs against the trainer's forward pass: the bfloat16 gap that decides whether
``old_logprobs="sample"`` is safe). Exits 1 when a check fails: the model is not on a GPU (unless
``--allow-cpu``), the API checks fail, a step did not train, the server did not get each update, or the
drift exceeds ``--max-drift``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import openai
import torch

import agl
from agl.algorithm.torch_grpo import TorchGRPO
from agl.serving import PolicyServer
from agl.serving.models import load_policy

sys.path.insert(0, str(Path(__file__).parent))
from serve_throughput import served  # the same client loop as the CPU benchmark

TASKS = [{"task_id": f"t{i}", "question": f"List a few numbers after {i}."} for i in range(32)]


@agl.rollout
def vowels_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    """One chat call; reward = the share of the answer's characters that are vowels."""
    messages = [{"role": "user", "content": task["question"]}]
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        completion = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
    text = completion.choices[0].message.content or ""
    return sum(c in "aeiouAEIOU" for c in text) / max(len(text), 1)


VERDICT = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
OPERATION_TOOL = {  # bounded arguments, so that even a random model's constrained call ends within max_tokens
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"op": {"enum": ["add", "sub"]}},
            "required": ["op"],
            "additionalProperties": False,
        },
    },
}


def check_apis(base_url: str) -> List[str]:
    """Chat and Responses answers agree on the device; a seeded top-p sample repeats. Returns failures."""
    failures: List[str] = []

    def ids(obj: Any, name: str) -> Any:  # agl's token-id extension fields
        return (obj.model_extra or {}).get(name)

    question = "Name three colours."
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        chat = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0
        )
        plain = client.responses.create(model="policy", input=question, max_output_tokens=16, temperature=0)
        with client.responses.stream(model="policy", input=question, max_output_tokens=16, temperature=0) as stream:
            streamed = list(stream)[-1].response  # "response.incomplete" when cut at max_output_tokens
        chat_ids = ids(chat.choices[0], "token_ids")
        if (
            not chat_ids
            or ids(plain, "response_token_ids") != chat_ids
            or ids(streamed, "response_token_ids") != chat_ids
        ):
            failures.append("greedy chat, Responses and streamed Responses answers have different token ids")
        if not plain.output_text == streamed.output_text == (chat.choices[0].message.content or ""):
            failures.append("greedy chat, Responses and streamed Responses answers have different text")
        sampled = [
            client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": question}],
                max_tokens=16,
                temperature=1.0,
                top_p=0.9,
                seed=7,
                logprobs=True,
            )
            for _ in range(2)
        ]
        if ids(sampled[0].choices[0], "token_ids") != ids(sampled[1].choices[0], "token_ids"):
            failures.append("a seeded top-p sample did not repeat")
        if not all(math.isfinite(t.logprob) for t in sampled[0].choices[0].logprobs.content):
            failures.append("a top-p sample has a token of logprob -inf (drawn outside its nucleus)")
        structured = client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": question}],
            max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}},
        )
        try:
            answer = json.loads(structured.choices[0].message.content or "")
            if answer.get("answer") not in ("yes", "no") or not isinstance(answer.get("sure"), bool):
                failures.append(f"a structured answer does not match its schema: {answer}")
        except ValueError:
            failures.append(f"a structured answer is not JSON: {structured.choices[0].message.content!r}")
        forced = client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "Pick an operation."}],
            max_tokens=64,
            temperature=1.0,
            tools=[OPERATION_TOOL],
            tool_choice={"type": "function", "function": {"name": "pick"}},
        )
        calls = forced.choices[0].message.tool_calls or []
        try:
            ok = (
                len(calls) == 1
                and calls[0].function.name == "pick"
                and (json.loads(calls[0].function.arguments).get("op") in ("add", "sub"))
            )
        except ValueError:
            ok = False
        if not ok:
            failures.append(f"a named tool_choice did not give exactly one valid call: {forced.choices[0].message}")
    checks = (
        "chat = Responses = streamed Responses, seeded top-p repeats, a JSON schema is enforced, "
        "a named tool_choice gives one valid call"
    )
    print(f"  API checks ({checks}): {'FAILED' if failures else 'ok'}")
    return failures


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (bundled), tiny, or a save_pretrained folder")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=".agl/torch_gpu_smoke")
    parser.add_argument("--max-drift", type=float, default=0.05, help="mean |served - recomputed| logprob allowed")
    parser.add_argument(
        "--runner-mode",
        choices=["thread", "process"],
        default="thread",
        help="runners as threads of this process (default) or as separate processes",
    )
    parser.add_argument("--allow-cpu", action="store_true", help="run on a machine without a GPU (checks the script)")
    args = parser.parse_args(argv)

    failures: List[str] = []
    if torch.cuda.is_available():
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    elif not args.allow_cpu:
        print("no CUDA GPU here: this is a GPU smoke (pass --allow-cpu to check the script itself on a CPU)")
        return 1

    start = time.perf_counter()
    model, tokenizer = load_policy(args.model)
    param = next(model.parameters())
    print(f"policy {args.model!r} loaded in {time.perf_counter() - start:.1f} s: {param.dtype} on {param.device}")
    if param.device.type != "cuda" and not args.allow_cpu:
        failures.append(f"the policy loaded on {param.device}, not on the GPU")

    with PolicyServer(model, tokenizer, max_batch_size=16) as server:
        served(server.base_url, 1, 1, 4)  # warm-up (CUDA context, kernels)
        failures += check_apis(server.base_url)
        rates = {}
        for clients in (1, 16):
            rate, tokens, elapsed = served(server.base_url, clients, 2, 48)
            rates[clients] = rate
            print(f"  served, {clients:2d} concurrent: {rate:7.1f} tokens/s ({tokens} tokens in {elapsed:.1f} s)")
        print(f"  16 vs 1 concurrent: {rates[16] / rates[1]:.1f}x")

    agl.instrument()
    algorithm = TorchGRPO(
        model=(model, tokenizer),
        group_size=4,
        batch_tasks=8,
        steps=args.steps,
        max_tokens=24,
        temperature=1.0,
        lr=5e-3,
        micro_batch_size=16,
        eval_every=0,
        output_dir=Path(args.out),
        seed=0,
    )
    trainer = agl.Trainer(
        algorithm=algorithm, store=str(Path(args.out) / "store.db"), n_runners=16, runner_mode=args.runner_mode
    )
    started = time.perf_counter()
    result = trainer.fit(vowels_agent, TASKS)
    wall = time.perf_counter() - started
    agl.uninstrument()

    rows = result.rows
    print(f"\n{len(rows)} steps in {wall:.1f} s (evaluations and model setup included)")
    print("step  reward  drift    step_s  train_tok/s  policy_version")
    versions = []
    for row in rows:
        versions.append(row["policy_version"])
        print(
            f"{row['step']:4d}  {row['reward_mean']:6.3f}  {row.get('logprob_drift', float('nan')):.5f}  "
            f"{row['step_time_s']:6.2f}  {row.get('train_tokens_per_s', float('nan')):11.0f}  {row['policy_version']}"
        )
        if not row.get("optimizer_steps"):
            failures.append(f"step {row['step']} made no optimizer step")
        if row.get("logprob_drift", 0.0) > args.max_drift:
            failures.append(f"step {row['step']}: logprob drift {row['logprob_drift']:.4f} > {args.max_drift}")
    if len(rows) != args.steps:
        failures.append(f"{len(rows)} steps ran, {args.steps} asked for")
    if versions != sorted(set(versions)):
        failures.append(f"the server's policy version did not advance every step: {versions}")
    trained = next(p for p in algorithm.policy.module.parameters() if p.requires_grad)
    print(f"trained parameters on {trained.device} ({trained.dtype}); metrics in {args.out}")

    for failure in failures:
        print(f"FAILED: {failure}")
    print("GPU smoke: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
