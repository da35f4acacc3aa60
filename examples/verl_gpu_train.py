"""Train the calculator agent (examples/calc_agent.py) with verl GRPO on one GPU: Qwen2.5-0.5B-Instruct.

Needs CUDA GPUs and the GPU install of docs/verl.md (verl + vLLM). On any machine,

    python examples/verl_gpu_train.py --check

validates the configuration against the installed verl and says whether this machine can run it. On the
GPU machine:

    python examples/verl_gpu_train.py                      # the seeds' config, 2 epochs
    python examples/verl_gpu_train.py --steps-smoke        # 2 tiny steps: checks the whole pipeline

What happens: verl starts its FSDP actor and a vLLM server on the GPU; agl starts the recording proxy in
front of it and publishes it as the ``main_llm`` resource; runner threads run the calculator agent on
generated arithmetic tasks, each rollout reaching vLLM through its own proxy URL (token ids and logprobs
recorded by the proxy); every step LightningRL turns the finished rollouts into samples with
rollout-level GRPO advantages, and verl updates the policy on them.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import agl
from agl.algorithm.verl import VERL, VERLConfig, VERLConfigError

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"

# The seeds' verl configuration with a 0.5B instruct model and lengths that fit a calculator dialogue.
VERL_CONFIG: Dict[str, Any] = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 32, "max_prompt_length": 1024, "max_response_length": 256},
    "actor_rollout_ref": {
        "rollout": {
            "name": "vllm",
            "n": 4,
            "multi_turn": {"format": "hermes"},
            "gpu_memory_utilization": 0.5,
            # The agent uses OpenAI tool calls: vLLM must parse Qwen's <tool_call> output into them.
            "engine_kwargs": {"vllm": {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}},
        },
        "actor": {"ppo_mini_batch_size": 32, "optim": {"lr": 1e-6}},
        "model": {"path": MODEL},
    },
    "trainer": {
        "n_gpus_per_node": 1,
        "val_before_train": True,
        "test_freq": 32,
        "save_freq": 64,
        "total_epochs": 2,
    },
}
SMOKE = [
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "trainer.total_epochs=1",
    "trainer.test_freq=2",
    "trainer.save_freq=-1",
]
SMOKE_STEPS = 2  # the 2nd step samples from the weights the 1st pushed; validation (test_freq=2) follows it


def datasets(train_batch_size: int, smoke: bool) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """The train and validation tasks; ``smoke``: exactly SMOKE_STEPS batches (SMOKE sets total_epochs=1)."""
    train = arithmetic_tasks(SMOKE_STEPS * train_batch_size if smoke else 1024, seed=1)
    return train, arithmetic_tasks(8 if smoke else 128, seed=2)


def arithmetic_tasks(n: int, seed: int) -> List[Dict[str, Any]]:
    """Questions in the form examples/data/calc_tasks.jsonl uses, with their answers."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op, answer = rng.choice([("plus", a + b), ("times", a * b)])
        tasks.append({"id": f"calc-{seed}-{i:04d}", "question": f"What is {a} {op} {b}?", "answer": answer})
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="validate the config and the machine, then exit")
    parser.add_argument(
        "--steps-smoke", action="store_true", help=f"tiny batches: {SMOKE_STEPS} steps to check the pipeline"
    )
    parser.add_argument("--store", default="sqlite:///runs/verl_calc.db", help="where rollouts and spans go")
    parser.add_argument("--runners", type=int, default=32, help="agent threads (rollouts run at once)")
    parser.add_argument("--async-groups", type=int, default=0, help="task groups generated while a step trains")
    parser.add_argument("override", nargs="*", help="more verl overrides, e.g. trainer.total_epochs=1")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    overrides = (SMOKE if args.steps_smoke else []) + args.override
    try:
        config = VERLConfig(VERL_CONFIG, overrides)
    except VERLConfigError as exc:
        sys.exit(f"invalid verl config: {exc}")
    print(config)
    if args.check:
        try:
            config.check_runtime()
        except VERLConfigError as exc:
            print(f"config OK; this machine cannot train it: {exc}")
            return
        print("config OK; this machine can train it")
        return

    # calc_agent calls agl.instrument() on import: its calls are recorded client-side, nested in its agent
    # spans, and marked so that the proxy forwards them without recording them twice.
    sys.path.insert(0, str(Path(__file__).parent))
    from calc_agent import calc_agent  # the agent itself: unchanged

    algorithm = VERL(config, async_groups=args.async_groups)
    trainer = agl.Trainer(
        algorithm=algorithm,
        store=args.store,
        n_runners=args.runners,
        runner_mode="thread",  # runner processes would fork the trainer after Ray and CUDA started
        rollout_timeout=600,
    )
    train, val = datasets(config.train_batch_size, args.steps_smoke)
    summary = trainer.fit(calc_agent, train_dataset=train, val_dataset=val)
    for step in summary.steps:
        keys = ("agl/reward_mean", "actor/pg_loss", "agl/batch/samples_out", "agl/batch/dropped_prompt_too_long")
        print(json.dumps({"step": step.step, **{k: step.metrics.get(k) for k in keys}}))
    for validation in summary.validations:
        print(json.dumps(validation))


if __name__ == "__main__":
    main()
