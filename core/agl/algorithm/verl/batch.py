"""LightningRL samples to verl's ``DataProto``: the tensors verl's actor update reads, in verl's layout.

The layout is the one verl's own agent loop produces (``verl.experimental.agent_loop``), so every verl step
after generation (log-prob recomputation, advantage estimators, the padding-free actor update) reads it
unchanged. For a batch of ``B`` samples, ``P = max_prompt_length`` and ``R = max_response_length``:

=====================  ===========  =====================================================================
key                    shape/dtype  content
=====================  ===========  =====================================================================
``prompts``            (B, P) i64   prompt ids, **left**-padded with ``pad_token_id``
``responses``          (B, R) i64   response ids, **right**-padded
``input_ids``          (B, P+R) i64 ``cat(prompts, responses)``
``attention_mask``     (B, P+R) i64 1 on every real token (prompt and response), 0 on padding
``position_ids``       (B, P+R) i64 ``clip(cumsum(attention_mask) - 1, 0)`` (verl's
                                    ``compute_position_id_with_mask``)
``response_mask``      (B, R) i64   the sample's ``response_mask`` (0 on tool/user tokens inside a merged
                                    trajectory), 0 on padding: the tokens the loss trains on
``token_level_scores``  (B, R) f32  the sample's reward on its last response token (as verl's reward
``token_level_rewards``             managers place it), 0 elsewhere
``advantages``         (B, R) f32   with ``precomputed_advantages``: the sample's advantage on every token
``returns``                         of ``response_mask``, 0 elsewhere (verl's GRPO writes the same shape)
``loss_weights``       (B,) f32     LightningRL's per-sample weight (1 / samples of its rollout), rescaled
                                    after over-long drops so each rollout's kept samples weigh as it did
``rollout_log_probs``  (B, R) f32   the server's logprobs, when every sample has them
=====================  ===========  =====================================================================

Non-tensor columns (numpy object arrays): ``uid`` (the GRPO group: the task id), ``rollout_id``,
``task_id`` and ``agl_padding`` (True on the inert rows added by :func:`pad_to_divisor`).

**Over-long samples.** A prompt longer than ``P`` is dropped by default (``overlong_prompt="drop"``):
cutting its start would train the policy on a context it never saw; ``"truncate"`` keeps its last ``P``
tokens instead. A response longer than ``R`` is cut to its first ``R`` tokens by default
(``overlong_response="truncate"``: what remains is exactly what the model generated, and the reward moves
to the last kept token); ``"drop"`` drops the sample. A sample with an empty prompt or no trainable
response token is dropped. Every case is counted in :class:`ConversionReport`. The loss weights of a
rollout that lost samples are rescaled so that its kept samples weigh in total what all of them did
(LightningRL's ``1 / T`` becomes ``1 / kept``): every rollout still weighs the same.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from agl.errors import NoTrainableSamples
from agl.lightningrl.types import Sample

if TYPE_CHECKING:
    from verl import DataProto

OverlongPrompt = Literal["drop", "truncate"]
OverlongResponse = Literal["truncate", "drop"]


@dataclass
class ConversionReport:
    """What happened to the samples on the way to the DataProto (also in ``meta_info["agl"]``)."""

    samples_in: int = 0
    samples_out: int = 0
    prompts_truncated: int = 0
    responses_truncated: int = 0
    dropped_prompt_too_long: int = 0
    dropped_response_too_long: int = 0
    dropped_empty: int = 0
    padding_rows: int = 0

    @property
    def dropped(self) -> int:
        return self.dropped_prompt_too_long + self.dropped_response_too_long + self.dropped_empty

    def metrics(self, prefix: str = "agl/batch/") -> Dict[str, float]:
        return {prefix + k: float(v) for k, v in asdict(self).items()}

    def __str__(self) -> str:
        parts = [f"{self.samples_out}/{self.samples_in} samples"]
        for label, n in (
            ("prompts truncated", self.prompts_truncated),
            ("responses truncated", self.responses_truncated),
            ("dropped: prompt too long", self.dropped_prompt_too_long),
            ("dropped: response too long", self.dropped_response_too_long),
            ("dropped: empty", self.dropped_empty),
            ("padding rows", self.padding_rows),
        ):
            if n:
                parts.append(f"{n} {label}")
        return ", ".join(parts)


@dataclass
class _Row:
    sample: Sample
    prompt: List[int]
    response: List[int]
    mask: List[int]
    logprobs: Optional[List[float]]


def _fit(
    sample: Sample,
    max_prompt: int,
    max_response: int,
    prompt_policy: str,
    response_policy: str,
    report: ConversionReport,
) -> Optional[_Row]:
    """Apply the over-long policies to one sample; None (and a count) when it is dropped."""
    prompt, response, mask = sample.prompt_ids, sample.response_ids, sample.response_mask
    if len(mask) != len(response):
        raise ValueError(
            f"sample of rollout {sample.rollout_id!r} has {len(response)} response ids but a response_mask of "
            f"{len(mask)}: LightningRL samples must carry one mask value per response token"
        )
    logprobs = sample.response_logprobs
    if logprobs is not None and len(logprobs) != len(response):
        logprobs = None  # unaligned logprobs are useless; the batch then carries none (see samples_to_dataproto)
    if len(prompt) > max_prompt:
        if prompt_policy == "drop":
            report.dropped_prompt_too_long += 1
            return None
        prompt = prompt[-max_prompt:]
        report.prompts_truncated += 1
    if len(response) > max_response:
        if response_policy == "drop":
            report.dropped_response_too_long += 1
            return None
        response, mask = response[:max_response], mask[:max_response]
        logprobs = logprobs[:max_response] if logprobs is not None else None
        report.responses_truncated += 1
    if not prompt or not any(mask):
        report.dropped_empty += 1
        return None
    return _Row(sample, list(prompt), list(response), list(mask), None if logprobs is None else list(logprobs))


def _kept_loss_weights(samples: Sequence[Sample], rows: Sequence[_Row]) -> List[float]:
    """The kept rows' loss weights, each rollout's rescaled to the total its samples had before dropping.

    LightningRL gives a rollout of ``T`` samples ``1 / T`` each so that every rollout weighs 1; a rollout
    whose second turn was dropped (prompt too long) would otherwise weigh 1/2.
    """
    before: Dict[str, float] = defaultdict(float)
    kept: Dict[str, float] = defaultdict(float)
    for s in samples:
        before[s.rollout_id] += s.loss_weight
    for row in rows:
        kept[row.sample.rollout_id] += row.sample.loss_weight
    return [
        row.sample.loss_weight * before[row.sample.rollout_id] / kept[row.sample.rollout_id]
        if kept[row.sample.rollout_id]
        else row.sample.loss_weight
        for row in rows
    ]


def samples_to_dataproto(
    samples: Sequence[Sample],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int = 0,
    overlong_prompt: OverlongPrompt = "drop",
    overlong_response: OverlongResponse = "truncate",
    precomputed_advantages: bool = True,
    meta_info: Optional[Dict[str, Any]] = None,
    report: Optional[ConversionReport] = None,
) -> Tuple[DataProto, ConversionReport]:
    """Build the DataProto of ``samples`` (see the module docstring for every key) and say what was cut.

    Raises :class:`NoTrainableSamples` when no sample survives (no token ids recorded, every prompt too
    long...): the message lists why each sample was dropped. Pass a ``report`` to have the counts filled in
    even then (a skipped step still reports its ``agl/batch/*`` metrics).
    """
    from verl import DataProto

    if overlong_prompt not in ("drop", "truncate"):
        raise ValueError(f'overlong_prompt must be "drop" or "truncate", got {overlong_prompt!r}')
    if overlong_response not in ("truncate", "drop"):
        raise ValueError(f'overlong_response must be "truncate" or "drop", got {overlong_response!r}')
    if report is None:
        report = ConversionReport()
    report.samples_in = len(samples)
    rows = [
        row
        for row in (
            _fit(s, max_prompt_length, max_response_length, overlong_prompt, overlong_response, report) for s in samples
        )
        if row is not None
    ]
    if not rows:
        raise NoTrainableSamples(
            f"no sample can be trained on ({report}). Check that the llm spans carry token ids "
            "(agl.llm.prompt_token_ids) and that data.max_prompt_length / max_response_length fit the agent's calls."
        )
    report.samples_out = len(rows)
    tensors = _tensors(samples, rows, max_prompt_length, max_response_length, pad_token_id, precomputed_advantages)
    non_tensors = {
        "uid": np.array([row.sample.task_id for row in rows], dtype=object),
        "rollout_id": np.array([row.sample.rollout_id for row in rows], dtype=object),
        "task_id": np.array([row.sample.task_id for row in rows], dtype=object),
        "agl_padding": np.zeros(len(rows), dtype=bool),
    }
    meta = dict(meta_info or {})
    meta["agl"] = asdict(report)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta), report


def _tensors(
    samples: Sequence[Sample], rows: List[_Row], P: int, R: int, pad_token_id: int, precomputed_advantages: bool
) -> Dict[str, torch.Tensor]:
    """The batch's tensors: prompts left-padded to ``P``, responses right-padded to ``R``."""
    from verl.utils.model import compute_position_id_with_mask

    n = len(rows)
    prompts = torch.full((n, P), pad_token_id, dtype=torch.long)
    responses = torch.full((n, R), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, P + R), dtype=torch.long)
    response_mask = torch.zeros((n, R), dtype=torch.long)
    scores = torch.zeros((n, R), dtype=torch.float32)
    advantages = torch.zeros((n, R), dtype=torch.float32)
    with_logprobs = all(row.logprobs is not None for row in rows)
    logprobs = torch.zeros((n, R), dtype=torch.float32) if with_logprobs else None
    for i, row in enumerate(rows):
        p, r = len(row.prompt), len(row.response)
        prompts[i, P - p :] = torch.tensor(row.prompt, dtype=torch.long)
        responses[i, :r] = torch.tensor(row.response, dtype=torch.long)
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = torch.tensor(row.mask, dtype=torch.long)
        scores[i, r - 1] = row.sample.reward
        if precomputed_advantages:
            advantages[i, :r] = row.sample.advantage * response_mask[i, :r]
        if logprobs is not None:
            logprobs[i, :r] = torch.tensor(row.logprobs, dtype=torch.float32)

    tensors: Dict[str, torch.Tensor] = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": compute_position_id_with_mask(attention),
        "response_mask": response_mask,
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
        "loss_weights": torch.tensor(_kept_loss_weights(samples, rows), dtype=torch.float32),
    }
    if precomputed_advantages:
        tensors["advantages"] = advantages
        tensors["returns"] = advantages.clone()
    if logprobs is not None:
        tensors["rollout_log_probs"] = logprobs
    return tensors


def pad_to_divisor(data: DataProto, divisor: int, report: Optional[ConversionReport] = None) -> DataProto:
    """Add inert rows until ``len(data)`` is a multiple of ``divisor`` (data-parallel ranks x mini batches).

    verl's own ``pad_dataproto_to_divisor`` repeats real rows, which would train on them twice and add
    them to their GRPO groups. agl's padding rows copy the shortest real row (least compute) but have an
    all-zero ``response_mask``, zero reward, advantage and loss weight, and a group id of their own, so
    they change no loss, no advantage and no metric over ``response_mask``; ``agl_padding`` marks them.
    """
    from verl import DataProto

    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    missing = (-len(data)) % divisor
    if missing == 0:
        return data
    shortest = int(torch.argmin(data.batch["attention_mask"].sum(dim=1)))
    pad = data.select_idxs([shortest] * missing)
    for key in ("response_mask", "token_level_scores", "token_level_rewards", "advantages", "returns", "loss_weights"):
        if key in pad.batch.keys():
            pad.batch[key] = torch.zeros_like(pad.batch[key])
    pad.non_tensor_batch["uid"] = np.array([f"agl-padding-{i}" for i in range(missing)], dtype=object)
    pad.non_tensor_batch["agl_padding"] = np.ones(missing, dtype=bool)
    padded = DataProto.concat([data, pad])
    if report is not None:
        report.padding_rows += missing
        padded.meta_info["agl"] = asdict(report)
    return padded


def apply_loss_weights(data: DataProto) -> None:
    """Put ``loss_weights`` into the per-token weights verl's policy loss multiplies by.

    verl's PPO loss multiplies each token's policy-gradient loss by ``rollout_is_weights`` when the batch
    has them (importance-sampling weights of rollout correction). LightningRL's per-rollout weight is
    folded in there: ``rollout_is_weights *= loss_weight`` per row (created as the weight where absent),
    so a rollout that produced k samples contributes like one that produced a single sample.
    """
    weights = data.batch["loss_weights"].unsqueeze(-1) * data.batch["response_mask"].to(torch.float32)
    if "rollout_is_weights" in data.batch.keys():
        data.batch["rollout_is_weights"] = data.batch["rollout_is_weights"] * weights
    else:
        data.batch["rollout_is_weights"] = weights


def trained_token_ids(data: DataProto) -> Set[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """``(prompt ids, trained response ids)`` of every real row: what verl learns from, to hold against the
    token ids of the recorded calls (a one-call sample's pair is exactly its call's)."""
    width = data.batch["prompts"].shape[1]
    pairs = set()
    for i in np.flatnonzero(~data.non_tensor_batch["agl_padding"].astype(bool)):
        prompt = data.batch["prompts"][i][data.batch["attention_mask"][i, :width].bool()]
        response = data.batch["responses"][i][data.batch["response_mask"][i].bool()]
        pairs.add((tuple(prompt.tolist()), tuple(response.tolist())))
    return pairs


__all__ = [
    "ConversionReport",
    "NoTrainableSamples",
    "apply_loss_weights",
    "pad_to_divisor",
    "samples_to_dataproto",
    "trained_token_ids",
]
