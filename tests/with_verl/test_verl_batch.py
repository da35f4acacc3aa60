"""LightningRL samples -> verl DataProto: the exact contract verl's update reads, checked with verl itself."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import AdvantageEstimator
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.model import compute_position_id_with_mask
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from agl.algorithm.verl.batch import apply_loss_weights, pad_to_divisor, samples_to_dataproto
from agl.algorithm.verl.config import VERLConfig
from agl.lightningrl.advantages import grpo_advantages, rloo_advantages
from agl.lightningrl.types import Sample

P, R, PAD = 8, 6, 0


def sample(
    rollout: str,
    task: str,
    prompt: List[int],
    response: List[int],
    reward: float,
    mask: Optional[List[int]] = None,
    logprobs: Optional[List[float]] = None,
) -> Sample:
    return Sample(
        rollout_id=rollout,
        task_id=task,
        policy="default",
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask if mask is not None else [1] * len(response),
        reward=reward,
        response_logprobs=logprobs,
    )


def grpo_batch(rewards: dict) -> List[Sample]:
    """One sample per rollout, prompts and responses of varied lengths (ids start at 10: none is PAD)."""
    out, k = [], 0
    for task, values in rewards.items():
        for j, r in enumerate(values):
            k += 1
            out.append(
                sample(f"{task}-r{j}", task, list(range(10, 10 + 1 + k % P)), list(range(100, 100 + 1 + k % R)), r)
            )
    return out


REWARDS = {"t1": [1.0, 0.0, 0.5, 0.25], "t2": [0.2, 0.9], "t3": [1.0, 1.0, 0.0]}


def test_keys_shapes_and_dtypes() -> None:
    data, report = samples_to_dataproto(
        grpo_advantages(grpo_batch(REWARDS)), max_prompt_length=P, max_response_length=R
    )
    B = 9
    expected = {
        "prompts": ((B, P), torch.int64),
        "responses": ((B, R), torch.int64),
        "input_ids": ((B, P + R), torch.int64),
        "attention_mask": ((B, P + R), torch.int64),
        "position_ids": ((B, P + R), torch.int64),
        "response_mask": ((B, R), torch.int64),
        "token_level_scores": ((B, R), torch.float32),
        "token_level_rewards": ((B, R), torch.float32),
        "advantages": ((B, R), torch.float32),
        "returns": ((B, R), torch.float32),
        "loss_weights": ((B,), torch.float32),
    }
    assert {k: (tuple(v.shape), v.dtype) for k, v in data.batch.items()} == expected
    assert set(data.non_tensor_batch) == {"uid", "rollout_id", "task_id", "agl_padding"}
    assert all(v.shape == (B,) for v in data.non_tensor_batch.values())
    assert data.meta_info["agl"]["samples_out"] == B and report.samples_in == B
    data.check_consistency()


def test_layout_left_padded_prompts_right_padded_responses() -> None:
    samples = [
        sample("r1", "t", [11, 12, 13], [21, 22], 1.0),
        sample("r2", "t", [11] * P, [21, 0, 23, 24, 25, 26], 0.5, mask=[1, 1, 0, 0, 1, 1]),  # a merged trajectory
    ]
    data, _ = samples_to_dataproto(samples, max_prompt_length=P, max_response_length=R, pad_token_id=PAD)
    b = data.batch
    assert b["prompts"][0].tolist() == [PAD] * 5 + [11, 12, 13]
    assert b["responses"][0].tolist() == [21, 22] + [PAD] * 4
    assert b["input_ids"][0].tolist() == b["prompts"][0].tolist() + b["responses"][0].tolist()
    assert b["attention_mask"][0].tolist() == [0] * 5 + [1] * 5 + [0] * 4
    assert b["attention_mask"][1].tolist() == [1] * (P + R)  # token id 0 inside a response is still attended
    assert b["position_ids"][0].tolist() == [0] * 5 + [0, 1, 2, 3, 4] + [4] * 4
    assert torch.equal(b["position_ids"], compute_position_id_with_mask(b["attention_mask"]))
    assert b["response_mask"][0].tolist() == [1, 1, 0, 0, 0, 0]
    assert b["response_mask"][1].tolist() == [1, 1, 0, 0, 1, 1]
    # the reward sits on the last response token, as verl's reward managers put it
    assert b["token_level_scores"][0].tolist() == [0.0, 1.0, 0, 0, 0, 0]
    assert b["token_level_scores"][1].tolist() == [0, 0, 0, 0, 0, 0.5]
    assert torch.equal(b["token_level_rewards"], b["token_level_scores"])


@pytest.mark.parametrize("normalize", [True, False])
def test_lightningrl_grpo_equals_verls_grpo_estimator(normalize: bool) -> None:
    samples = grpo_advantages(grpo_batch(REWARDS), normalize_std=normalize)
    data, _ = samples_to_dataproto(samples, max_prompt_length=P, max_response_length=R)
    b = data.batch
    verl_adv, verl_ret = core_algos.compute_grpo_outcome_advantage(
        b["token_level_rewards"], b["response_mask"], data.non_tensor_batch["uid"], norm_adv_by_std_in_grpo=normalize
    )
    assert torch.allclose(b["advantages"], verl_adv, atol=1e-5)
    assert torch.allclose(b["returns"], verl_ret, atol=1e-5)
    assert b["advantages"].abs().sum() > 0  # not trivially equal
    # and through the function agl's "verl" advantage mode calls, on a batch without precomputed advantages
    raw, _ = samples_to_dataproto(samples, max_prompt_length=P, max_response_length=R, precomputed_advantages=False)
    assert "advantages" not in raw.batch.keys()
    computed = compute_advantage(
        raw, AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=normalize, config=OmegaConf.create({})
    )
    assert torch.allclose(computed.batch["advantages"], b["advantages"], atol=1e-5)


def test_lightningrl_rloo_equals_verls_rloo_estimator() -> None:
    data, _ = samples_to_dataproto(rloo_advantages(grpo_batch(REWARDS)), max_prompt_length=P, max_response_length=R)
    b = data.batch
    verl_adv, _ = core_algos.compute_rloo_outcome_advantage(
        b["token_level_rewards"], b["response_mask"], data.non_tensor_batch["uid"]
    )
    assert torch.allclose(b["advantages"], verl_adv, atol=1e-5)


def test_multi_call_rollouts_get_rollout_level_advantages_and_weights() -> None:
    """Two calls of one rollout: both carry the rollout's advantage (verl's GRPO on one row per rollout)
    and weigh 1/2 each, so the rollout counts once however many calls it made."""
    samples = grpo_advantages(
        [
            sample("a", "t", [11, 12], [21], 1.0),
            sample("a", "t", [11, 12, 21, 13], [22], 1.0),
            sample("b", "t", [11, 12], [23], 0.0),
        ]
    )
    data, _ = samples_to_dataproto(samples, max_prompt_length=P, max_response_length=R)
    one_row_per_rollout = data.select_idxs([0, 2])
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(
        one_row_per_rollout.batch["token_level_rewards"],
        one_row_per_rollout.batch["response_mask"],
        one_row_per_rollout.non_tensor_batch["uid"],
    )
    assert data.batch["advantages"][:, 0].tolist() == pytest.approx(
        [verl_adv[0, 0].item(), verl_adv[0, 0].item(), verl_adv[1, 0].item()], abs=1e-5
    )
    assert data.batch["loss_weights"].tolist() == [0.5, 0.5, 1.0]
    assert list(data.non_tensor_batch["uid"]) == ["t", "t", "t"]
    assert list(data.non_tensor_batch["rollout_id"]) == ["a", "a", "b"]


def test_over_long_samples_follow_the_policy_and_are_counted() -> None:
    long_prompt = sample("p", "t", list(range(1, P + 3)), [21], 1.0)
    long_response = sample("r", "t", [11], list(range(30, 30 + R + 2)), 0.7)
    ok = sample("ok", "t", [11], [21], 0.0)
    empty = sample("e", "t", [], [21], 0.0)
    all_masked = sample("m", "t", [11], [21, 22], 0.0, mask=[0, 0])

    data, report = samples_to_dataproto(
        [long_prompt, long_response, ok, empty, all_masked], max_prompt_length=P, max_response_length=R
    )
    assert list(data.non_tensor_batch["rollout_id"]) == ["r", "ok"]
    assert (report.dropped_prompt_too_long, report.responses_truncated, report.dropped_empty) == (1, 1, 2)
    assert data.batch["responses"][0].tolist() == list(range(30, 30 + R))  # the first R tokens, as generated
    assert data.batch["token_level_scores"][0, R - 1].item() == pytest.approx(0.7)  # reward on the last kept token
    assert "1 responses truncated" in str(report) and "1 dropped: prompt too long" in str(report)

    data, report = samples_to_dataproto(
        [long_prompt, long_response],
        max_prompt_length=P,
        max_response_length=R,
        overlong_prompt="truncate",
        overlong_response="drop",
    )
    assert list(data.non_tensor_batch["rollout_id"]) == ["p"]
    assert data.batch["prompts"][0].tolist() == list(range(1, P + 3))[-P:]  # the last P tokens of the prompt
    assert (report.prompts_truncated, report.dropped_response_too_long) == (1, 1)
    assert report.metrics()["agl/batch/dropped_response_too_long"] == 1.0


def test_a_rollout_that_lost_a_sample_still_weighs_one() -> None:
    """Rollout "a" made two calls; its second is dropped (prompt too long): its remaining sample must weigh
    1, like rollout "b"'s single sample, not the 1/2 LightningRL gave it before the drop."""
    samples = grpo_advantages(
        [
            sample("a", "t", [11, 12], [21], 1.0),
            sample("a", "t", list(range(11, 11 + P + 1)), [22], 1.0),
            sample("b", "t", [11, 12], [23], 0.0),
        ]
    )
    assert [s.loss_weight for s in samples] == [0.5, 0.5, 1.0]
    data, report = samples_to_dataproto(samples, max_prompt_length=P, max_response_length=R)
    assert report.dropped_prompt_too_long == 1
    assert list(data.non_tensor_batch["rollout_id"]) == ["a", "b"]
    assert data.batch["loss_weights"].tolist() == [1.0, 1.0]


def test_no_trainable_sample_is_an_error_that_says_why() -> None:
    with pytest.raises(ValueError, match="no sample can be trained on .*1 dropped: prompt too long"):
        samples_to_dataproto(
            [sample("p", "t", list(range(1, P + 3)), [21], 1.0)], max_prompt_length=P, max_response_length=R
        )
    with pytest.raises(ValueError, match="response_mask"):
        samples_to_dataproto(
            [sample("x", "t", [11], [21, 22], 1.0, mask=[1])], max_prompt_length=P, max_response_length=R
        )


def test_rollout_logprobs_only_when_every_sample_has_them() -> None:
    with_lp = [
        sample("a", "t", [11], [21, 22], 1.0, logprobs=[-0.5, -0.25]),
        sample("b", "t", [11], [23], 0.0, logprobs=[-1.0]),
    ]
    data, _ = samples_to_dataproto(with_lp, max_prompt_length=P, max_response_length=R)
    assert data.batch["rollout_log_probs"][0, :3].tolist() == [-0.5, -0.25, 0.0]
    data, _ = samples_to_dataproto(
        with_lp[:1] + [replace(with_lp[1], response_logprobs=None)], max_prompt_length=P, max_response_length=R
    )
    assert "rollout_log_probs" not in data.batch.keys()


def test_padding_rows_are_inert_for_advantages_and_loss() -> None:
    samples = grpo_advantages(grpo_batch(REWARDS))
    data, report = samples_to_dataproto(samples, max_prompt_length=P, max_response_length=R)
    padded = pad_to_divisor(data, 4, report)
    assert len(padded) == 12 and report.padding_rows == 3 and padded.meta_info["agl"]["padding_rows"] == 3
    pad = padded.non_tensor_batch["agl_padding"]
    assert pad.tolist() == [False] * 9 + [True] * 3
    assert len(set(padded.non_tensor_batch["uid"][pad])) == 3 and not set(padded.non_tensor_batch["uid"][pad]) & set(
        REWARDS
    )
    for key in ("response_mask", "token_level_scores", "advantages", "loss_weights"):
        assert padded.batch[key][torch.from_numpy(pad)].abs().sum() == 0
    # verl's GRPO over the padded batch gives the real rows the same advantages
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        padded.batch["token_level_rewards"], padded.batch["response_mask"], padded.non_tensor_batch["uid"]
    )
    assert torch.allclose(adv[:9], data.batch["advantages"], atol=1e-5)
    assert pad_to_divisor(padded, 4) is padded  # already a multiple
    assert all(len(chunk) == 3 for chunk in padded.chunk(4))  # splits evenly over 4 data-parallel ranks


def test_padding_free_conversion_aligns_model_outputs_with_response_tokens() -> None:
    """verl's update converts to the padding-free layout and back; a model output that predicts the next token
    at every position must come back as exactly the response tokens, on the response mask."""
    samples = grpo_advantages(grpo_batch(REWARDS))
    data, report = samples_to_dataproto(samples, max_prompt_length=P, max_response_length=R)
    data = pad_to_divisor(data, 4, report)
    td = left_right_2_no_padding(data.to_tensordict())
    ids = td["input_ids"]
    next_token = torch.roll(ids.values(), -1).float()
    out = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(next_token, offsets=ids.offsets()), td)
    mask = data.batch["response_mask"].bool()
    assert out.shape == (len(data), R)
    assert torch.equal(out[mask].long(), data.batch["responses"][mask])
    assert torch.equal(td["loss_mask"], data.batch["response_mask"])


def test_loss_weights_scale_verls_policy_loss_per_rollout() -> None:
    minimal = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.path=m",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=2",
    ]
    actor = omega_conf_to_dataclass(VERLConfig(minimal, verl_checks=False).dictconfig.actor_rollout_ref.actor)
    samples = grpo_advantages(
        [
            sample("a", "t", [11], [21, 22], 1.0),
            sample("a", "t", [11, 21, 22, 12], [23], 1.0),
            sample("b", "t", [11], [24], 0.0),
        ]
    )
    data, _ = samples_to_dataproto(samples, max_prompt_length=P, max_response_length=R)
    apply_loss_weights(data)
    b = data.batch
    assert b["rollout_is_weights"][:, 0].tolist() == [0.5, 0.5, 1.0]
    same = torch.zeros_like(b["advantages"])  # ratio 1: the loss is -advantage per token, times its weight
    loss, _ = core_algos.compute_policy_loss_vanilla(
        same, same, b["advantages"], b["response_mask"], "token-mean", actor, rollout_is_weights=b["rollout_is_weights"]
    )
    mask = b["response_mask"].float()
    expected = -(b["advantages"] * b["loss_weights"][:, None] * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    # with rollout-correction weights already there, agl multiplies into them
    data.batch["rollout_is_weights"] = torch.full_like(mask, 2.0)
    apply_loss_weights(data)
    assert data.batch["rollout_is_weights"][:, 0].tolist() == [1.0, 1.0, 2.0]


def test_dataproto_survives_verls_batch_operations() -> None:
    data, report = samples_to_dataproto(
        grpo_advantages(grpo_batch(REWARDS)), max_prompt_length=P, max_response_length=R
    )
    data = pad_to_divisor(data, 2, report)
    halves = data.chunk(2)
    again = DataProto.concat(halves)
    assert torch.equal(again.batch["input_ids"], data.batch["input_ids"])
    assert list(again.non_tensor_batch["uid"]) == list(data.non_tensor_batch["uid"])
    old = DataProto.from_dict({"old_log_probs": torch.zeros(len(data), R)})
    assert "old_log_probs" in data.union(old).batch.keys()
    assert isinstance(data.non_tensor_batch["uid"], np.ndarray)
