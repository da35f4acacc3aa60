"""The GRPO / PPO-clip loss on LightningRL samples, in torch.

A batch of :class:`~agl.lightningrl.types.Sample` becomes padded tensors (:func:`collate`); the policy's
log-probabilities of the response tokens come from one forward pass (:func:`response_logprobs`); the loss
(:func:`policy_loss`) is, for sample ``i`` with response tokens ``t`` where ``response_mask == 1``::

    ratio_t  = exp(logp_t - old_logp_t)                                      # log-ratio clamped to [-20, 20]
    pg_t     = -min(ratio_t * A_i, clip(ratio_t, 1 - eps, 1 + eps) * A_i)
    kl_t     = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1          # k3 estimator, >= 0 (same clamp)
    L_i      = mean_t (pg_t + kl_coef * kl_t)                                # mean over the sample's tokens
    loss     = sum_i w_i * L_i / W                                           # w_i = loss_weight

``W`` is the sum of the loss weights of the optimizer step's samples (the number of rollouts when whole
rollouts are in the step, since a rollout's weights sum to 1), so every rollout weighs the same whatever
number of samples or tokens it produced.

Log-probabilities use ``log_softmax(logits / temperature)``: the distribution the policy server sampled
from, so the server's logprobs are the exact "old" logprobs of an on-policy step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from agl.lightningrl.types import Sample

#: verl's bound on a log-ratio before ``exp`` (``compute_policy_loss``, ``kl_penalty``): e^20 is about 4.9e8
LOG_RATIO_LIMIT = 20.0


@dataclass
class TokenBatch:
    """Samples as left-padded tensors; ``positions`` index the response tokens in ``input_ids``.

    Left padding puts every sequence's end at the last column, so the response tokens of all samples lie in
    the last ``response_width`` columns and the LM head only runs there (``logits_to_keep``).
    """

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T), counted from each sequence's first real token
    response_ids: torch.Tensor  # (B, R), right-aligned like the sequences, 0 where there is no token
    response_mask: torch.Tensor  # (B, R) float: 1 on generated tokens to train on
    old_logprobs: Optional[torch.Tensor]  # (B, R) or None when a sample has none
    advantages: torch.Tensor  # (B,)
    weights: torch.Tensor  # (B,)

    @property
    def response_width(self) -> int:
        return self.response_ids.shape[1]

    def to(self, device: torch.device) -> TokenBatch:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return TokenBatch(**moved)


def collate(samples: Sequence[Sample], pad_id: int) -> TokenBatch:
    """Left-pad ``prompt_ids + response_ids`` of each sample into one batch.

    Raises ValueError on a sample that cannot be trained on (no prompt or no response tokens, mismatched
    lengths), naming the rollout so the user can find it with ``agl inspect``.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    for s in samples:
        if not s.prompt_ids:
            # The first response token's logprob is predicted from the token before it: without one there is
            # nothing to predict it from (the column before it would be padding, or not exist).
            raise ValueError(
                f"sample of rollout {s.rollout_id} has no prompt tokens: its first response token cannot be "
                "scored (the model predicts each token from the ones before it); the request must send a prompt"
            )
        if not s.response_ids:
            raise ValueError(f"sample of rollout {s.rollout_id} has no response tokens; LightningRL should drop it")
        if len(s.response_mask) != len(s.response_ids):
            raise ValueError(
                f"sample of rollout {s.rollout_id}: response_mask has {len(s.response_mask)} entries for "
                f"{len(s.response_ids)} response tokens"
            )
        if s.response_logprobs is not None and len(s.response_logprobs) != len(s.response_ids):
            raise ValueError(
                f"sample of rollout {s.rollout_id}: {len(s.response_logprobs)} logprobs for "
                f"{len(s.response_ids)} response tokens"
            )
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    resp_width = max(len(s.response_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response_ids = torch.zeros((n, resp_width), dtype=torch.long)
    response_mask = torch.zeros((n, resp_width), dtype=torch.float32)
    have_old = all(s.response_logprobs is not None for s in samples)
    old = torch.zeros((n, resp_width), dtype=torch.float32) if have_old else None
    for i, s in enumerate(samples):
        seq = list(s.prompt_ids) + list(s.response_ids)
        input_ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        attention[i, width - len(seq) :] = 1
        r = len(s.response_ids)
        response_ids[i, resp_width - r :] = torch.tensor(s.response_ids, dtype=torch.long)
        response_mask[i, resp_width - r :] = torch.tensor(s.response_mask, dtype=torch.float32)
        if old is not None:
            old[i, resp_width - r :] = torch.tensor(s.response_logprobs, dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        response_ids=response_ids,
        response_mask=response_mask,
        old_logprobs=old,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        weights=torch.tensor([s.loss_weight for s in samples], dtype=torch.float32),
    )


def response_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities ``(B, R)`` of the response columns under ``model`` (meaningful where the mask is 1).

    The logit predicting the token at column ``c`` sits at column ``c - 1``, so the last ``R + 1`` columns'
    logits (minus the very last) cover the ``R`` response columns.
    """
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0 to train (got {temperature}): greedy decoding has no distribution to "
            "learn from; sample training rollouts with a temperature"
        )
    width = batch.response_width
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=width + 1,
        use_cache=False,
    )
    # Sliced here too: a model may return every column's logits whatever logits_to_keep says (transformers
    # 4.46-4.48 take the argument and ignore it), and the first columns would then be read as the response's.
    logits = out.logits[:, -(width + 1) : -1, :].float() / temperature  # (B, R, V): the R response columns
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)


@dataclass
class LossParts:
    """The loss of one micro-batch and the statistics the trainer logs (sums, to average across steps)."""

    loss: torch.Tensor
    stats: Dict[str, float]


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    batch: TokenBatch,
    *,
    clip_eps: float,
    kl_coef: float = 0.0,
    ref_logprobs: Optional[torch.Tensor] = None,
    weight_total: float,
) -> LossParts:
    """The clipped policy-gradient loss (module docs) of a micro-batch, scaled by ``1 / weight_total`` so
    micro-batches of one optimizer step add up to the step's loss."""
    mask = batch.response_mask
    tokens = mask.sum(-1).clamp(min=1.0)  # (B,)
    adv = batch.advantages.unsqueeze(-1)
    log_ratio = _clamped((logprobs - old_logprobs) * mask)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = _clamped((ref_logprobs - logprobs) * mask)
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    per_sample = (per_token * mask).sum(-1) / tokens
    loss = (per_sample * batch.weights).sum() / weight_total
    with torch.no_grad():
        n_tokens = float(mask.sum())
        stats = {
            "tokens": n_tokens,
            # as verl's pg_clipfrac: the tokens whose clipped term is the one taken (their gradient is cut)
            "clipped_tokens": float(((clipped < unclipped).float() * mask).sum()),
            # k3 estimate of KL(old || new) per token (the tokens were sampled from old, r = new / old:
            # r - 1 - log r, whose mean under old is the KL), a drift gauge between epochs
            "kl_old_sum": float(((ratio - 1.0 - log_ratio) * mask).sum()),
            "kl_ref_sum": float((kl * mask).sum()) if kl is not None else 0.0,
            "entropy_proxy_sum": float((-logprobs.detach() * mask).sum()),
        }
    return LossParts(loss=loss, stats=stats)


def _clamped(log_ratio: torch.Tensor) -> torch.Tensor:
    """``log_ratio`` within ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]``, as verl clamps it before ``exp``: a token
    whose logprobs moved far apart (a long sample, a mismatched server) would otherwise make the ratio ``inf``
    and the loss or its gradient NaN."""
    return torch.clamp(log_ratio, min=-LOG_RATIO_LIMIT, max=LOG_RATIO_LIMIT)


def split_micro_batches(
    samples: Sequence[Sample], max_samples: int, max_tokens: Optional[int] = None
) -> List[List[Sample]]:
    """Group samples of similar length into micro-batches of at most ``max_samples`` samples and (when
    given) ``max_tokens`` padded tokens, so little compute is spent on padding."""
    if max_samples < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {max_samples}")
    order = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids))
    batches: List[List[Sample]] = []
    current: List[Sample] = []
    for s in order:
        length = len(s.prompt_ids) + len(s.response_ids)
        too_many = len(current) >= max_samples
        too_long = max_tokens is not None and current and length * (len(current) + 1) > max_tokens
        if current and (too_many or too_long):
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches
