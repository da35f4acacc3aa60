"""The GRPO update on a real (tiny, random) Llama: rewarded responses become likelier, punished ones less
likely; the loss pieces follow their formulas."""

from __future__ import annotations

import math
from typing import Any, List, Tuple

import pytest
import torch
from with_torch_helpers import trained_sample

from agl.algorithm.grpo_loss import (
    collate,
    policy_loss,
    response_logprobs,
    split_micro_batches,
)
from agl.algorithm.torch_grpo import TorchGRPO
from agl.lightningrl.advantages import grpo_advantages
from agl.lightningrl.types import Sample
from agl.serving.models import load_policy

TEMPERATURE = 0.8


@pytest.fixture
def tiny() -> Tuple[Any, Any]:
    torch.manual_seed(0)
    return load_policy("tiny", device="cpu", seed=0)


def _ids(tokenizer: Any, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _group(tokenizer: Any, with_logprobs: Any = None) -> List[Sample]:
    """One task, four rollouts: two rewarded answers, two punished ones (rollout-level GRPO advantages)."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = _ids(tokenizer, prompt)
    answers = [("The answer is 5.", 1.0), ("5", 1.0), ("I like turtles and tea.", 0.0), ("seven hundred", 0.0)]
    samples = [
        Sample(
            rollout_id=f"ro-{i}",
            task_id="task-0",
            policy="default",
            prompt_ids=prompt_ids,
            response_ids=_ids(tokenizer, text) + [tokenizer.eos_token_id],
            response_mask=[1] * (len(_ids(tokenizer, text)) + 1),
            reward=reward,
        )
        for i, (text, reward) in enumerate(answers)
    ]
    if with_logprobs is not None:
        for s in samples:
            s.response_logprobs = with_logprobs(s)
    return grpo_advantages(samples)


def _sequence_logprobs(model: Any, tokenizer: Any, samples: List[Sample]) -> torch.Tensor:
    batch = collate(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        return (response_logprobs(model, batch, TEMPERATURE) * batch.response_mask).sum(-1)


@pytest.mark.parametrize("lora", ["default", None], ids=["lora", "full"])
def test_one_step_moves_rewarded_up_and_punished_down(tiny: Tuple[Any, Any], lora: Any) -> None:
    model, tokenizer = tiny
    kwargs = {} if lora == "default" else {"lora": None, "lr": 1e-3}
    algo = TorchGRPO(model="tiny", temperature=TEMPERATURE, **kwargs)
    algo.attach(model, tokenizer)
    samples = _group(tokenizer)
    assert [s.advantage > 0 for s in samples] == [True, True, False, False]
    before = _sequence_logprobs(model, tokenizer, samples)

    stats = algo.update(samples)

    after = _sequence_logprobs(model, tokenizer, samples)
    delta = (after - before).tolist()
    assert delta[0] > 0.01 and delta[1] > 0.01, f"rewarded responses did not become likelier: {delta}"
    assert delta[2] < -0.01 and delta[3] < -0.01, f"punished responses did not become less likely: {delta}"
    assert stats["optimizer_steps"] == 1 and stats["live_samples"] == 4
    assert stats["train_tokens"] == sum(len(s.response_ids) for s in samples)


def test_server_logprobs_are_the_old_logprobs(tiny: Tuple[Any, Any]) -> None:
    """With the sampler's logprobs in the samples, the first pass has ratio 1 (no drift) and no clipping."""
    model, tokenizer = tiny
    exact = {}
    for s in _group(tokenizer):
        exact[s.rollout_id] = response_logprobs(model, collate([s], tokenizer.pad_token_id), TEMPERATURE)[0].tolist()
    samples = _group(tokenizer, with_logprobs=lambda s: exact[s.rollout_id])
    algo = TorchGRPO(model="tiny", temperature=TEMPERATURE)
    algo.attach(model, tokenizer)
    stats = algo.update(samples)
    assert stats["logprob_drift"] < 1e-5
    assert stats["clip_frac"] == 0.0


def test_zero_advantage_groups_are_skipped_without_kl(tiny: Tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    samples = [trained_sample(f"ro-{i}", [1, 2, 3], [4, 5], reward=1.0, policy="default") for i in range(3)]
    algo = TorchGRPO(model="tiny")
    algo.attach(model, tokenizer)
    before = [p.detach().clone() for p in algo.policy.parameters()]  # type: ignore[union-attr]
    stats = algo.update(grpo_advantages(samples))
    assert stats["live_samples"] == 0 and stats["optimizer_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, algo.policy.parameters(), strict=True))  # type: ignore[union-attr]


def test_kl_to_reference_is_zero_before_training_and_positive_after(tiny: Tuple[Any, Any]) -> None:
    """LoRA's reference is the adapter switched off: identical to the policy until the adapter has learnt."""
    model, tokenizer = tiny
    algo = TorchGRPO(model="tiny", temperature=TEMPERATURE, kl_coef=0.1, ppo_epochs=2)
    algo.attach(model, tokenizer)
    samples = _group(tokenizer)
    batch = collate(samples, tokenizer.pad_token_id)
    with algo.policy.reference() as ref:  # type: ignore[union-attr]
        ref_lp = response_logprobs(ref, batch, TEMPERATURE)
    assert torch.allclose(ref_lp, response_logprobs(algo.policy.module, batch, TEMPERATURE).detach())  # type: ignore[union-attr]
    stats = algo.update(samples)
    assert stats["kl_ref"] > 0  # measured over both passes: the second one runs on moved weights
    with algo.policy.reference() as ref:  # type: ignore[union-attr]
        assert torch.allclose(response_logprobs(ref, batch, TEMPERATURE), ref_lp)  # the reference never moves


def test_clipped_ratio_stops_the_gradient() -> None:
    """PPO clip: a positive-advantage token whose ratio is already above 1 + eps gets no gradient."""
    sample = trained_sample("r", [1], [2, 3], reward=1.0, advantage=1.0, response_logprobs=[-1.0, -1.0])
    batch = collate([sample], pad_id=0)
    logprobs = torch.tensor([[-0.5, -1.05]], requires_grad=True)  # ratios e^0.5 (clipped) and e^-0.05
    parts = policy_loss(logprobs, batch.old_logprobs, batch, clip_eps=0.2, weight_total=1.0)  # type: ignore[arg-type]
    parts.loss.backward()
    grad = logprobs.grad[0].tolist()  # type: ignore[union-attr]
    assert grad[0] == 0.0
    assert grad[1] == pytest.approx(-0.5 * torch.exp(torch.tensor(-0.05)).item(), rel=1e-5)  # -(1/2 tokens) * ratio
    assert parts.stats["clipped_tokens"] == 1.0


class IgnoresLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward takes ``logits_to_keep`` and returns every column's logits anyway, as
    transformers 4.46-4.48's models do (the argument lands in their ``**kwargs``)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, logits_to_keep: int = 0, **kwargs: Any) -> Any:
        return self.model(**kwargs)


def _full_forward_logprobs(model: Any, sample: Sample) -> List[float]:
    """The response tokens' logprobs from one unpadded forward pass over the sample alone, every column's
    logits computed: the reference that batching, padding and ``logits_to_keep`` must not change."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float() / TEMPERATURE
    predictions = torch.log_softmax(logits[len(sample.prompt_ids) - 1 : -1], dim=-1)
    return predictions.gather(-1, torch.tensor(sample.response_ids).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.mark.parametrize("honours_logits_to_keep", [True, False], ids=["keeps", "ignores"])
def test_response_logprobs_are_those_of_a_full_forward_pass(
    tiny: Tuple[Any, Any], honours_logits_to_keep: bool
) -> None:
    """The gather read the first columns of whatever logits came back: with a model that ignored
    ``logits_to_keep`` those were prompt positions, and the loss trained on wrong logprobs without a word."""
    model, tokenizer = tiny
    samples = _group(tokenizer)  # four responses of different lengths: left padding in the batch
    scored = model if honours_logits_to_keep else IgnoresLogitsToKeep(model)
    batch = collate(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = response_logprobs(scored, batch, TEMPERATURE)
    for row, sample in zip(logprobs, samples, strict=True):
        expected = torch.tensor(_full_forward_logprobs(model, sample))
        assert torch.allclose(row[-len(sample.response_ids) :], expected, atol=1e-4), sample.rollout_id


def test_a_huge_log_ratio_is_clamped_as_verl_clamps_it() -> None:
    """A log-ratio of 100 made the ratio inf: the loss was inf and the gradient NaN, for one token."""
    sample = trained_sample("r", [1], [2, 3], reward=0.0, advantage=-1.0, response_logprobs=[-100.5, -1.0])
    batch = collate([sample], pad_id=0)
    logprobs = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    parts = policy_loss(logprobs, batch.old_logprobs, batch, clip_eps=0.2, weight_total=1.0)  # type: ignore[arg-type]
    parts.loss.backward()
    assert parts.loss.item() == pytest.approx((math.exp(20.0) + 1.0) / 2)  # ratios e^20 and 1, advantage -1
    assert torch.isfinite(logprobs.grad).all()  # type: ignore[arg-type]
    assert math.isfinite(parts.stats["kl_old_sum"])


def test_clip_frac_counts_the_tokens_whose_clipped_term_is_taken() -> None:
    """verl's pg_clipfrac: a ratio outside [1 - eps, 1 + eps] counts only where clipping changes the loss
    (above the band with a positive advantage, below it with a negative one)."""
    old = [-1.5, -0.5]  # against new logprobs of -1.0: ratios e^0.5 (above the band) and e^-0.5 (below it)
    samples = [
        trained_sample("up", [1], [2, 3], reward=1.0, advantage=1.0, response_logprobs=old),
        trained_sample("down", [1], [2, 3], reward=0.0, advantage=-1.0, response_logprobs=old),
    ]
    batch = collate(samples, pad_id=0)
    logprobs = torch.full((2, 2), -1.0)
    parts = policy_loss(logprobs, batch.old_logprobs, batch, clip_eps=0.2, weight_total=2.0)  # type: ignore[arg-type]
    assert parts.stats["clipped_tokens"] == 2.0  # "up" above the band, "down" below it; not the other two


def test_bad_samples_are_refused_with_the_rollout_named() -> None:
    sample = Sample(
        rollout_id="ro-bad", task_id="t", policy="p", prompt_ids=[1], response_ids=[2, 3], response_mask=[1], reward=0.0
    )
    with pytest.raises(ValueError, match="ro-bad.*response_mask has 1 entries for 2"):
        collate([sample], pad_id=0)


def test_micro_batches_group_similar_lengths() -> None:
    samples = [trained_sample(str(n), [1] * n, [2], reward=0.0) for n in (50, 3, 48, 4, 49, 5)]
    batches = split_micro_batches(samples, 3)
    assert [[len(s.prompt_ids) for s in b] for b in batches] == [[3, 4, 5], [48, 49, 50]]
