"""From transitions to training samples: one sample per call, or consecutive calls merged into one.

Merging (``aggregate_trajectories``): within one ``(rollout_id, attempt_id, policy)``, calls are walked in
``step`` order and call k+1 is merged into the sample of call k when call k's ``prompt_ids + response_ids``
is an exact prefix of call k+1's ``prompt_ids``. The merged sample keeps the first call's prompt; its response
runs from there to the end of the last merged call's response, with ``response_mask`` 1 on the tokens the
model generated (each call's ``response_ids``) and 0 on the tokens in between (tool results, user turns,
chat-template tokens that only appear in the next prompt).

When the prefix does not match (retokenization drift, a rewritten history) the call starts a new sample and
the break is recorded as a :class:`PrefixMismatch`; calls are never merged on a near match.

Conventions of a merged sample:

- ``reward`` is the LAST merged call's reward (after credit assignment the episode reward reaches every
  call anyway, and the last call's reward is the one that covers the whole merged response);
- ``response_logprobs`` is aligned with ``response_ids`` and holds ``0.0`` at masked (mask 0) positions;
  it is ``None`` for the whole sample if any merged call has no logprobs (or not one per response token);
- ``span_ids`` lists the span of every merged call, in step order;
- ``task_id`` and ``mode`` are the first call's (one rollout has one of each); ``advantage`` and
  ``loss_weight`` keep their defaults.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from agl.lightningrl.types import Sample, Transition

__all__ = ["AggregationResult", "PrefixMismatch", "aggregate_trajectories", "to_samples"]


def to_samples(transitions: Iterable[Transition]) -> List[Sample]:
    """One sample per transition, in input order: the whole response is generated (mask all ones). A sample
    holds its transition's token and logprob lists, not copies: neither is changed once made, and copying
    a batch's token lists was a tenth of the time it took to build."""
    return [_sample(t, t.prompt_ids, t.response_ids, t.response_logprobs) for t in transitions]


@dataclass(frozen=True)
class PrefixMismatch:
    """Call ``step`` of an attempt could not be merged into the sample before it: its ``prompt_ids`` first
    differ from the previous call's ``prompt_ids + response_ids`` at ``token_index`` (equal to the shorter
    length when one is a prefix of the other, i.e. the prompt is too short)."""

    rollout_id: str
    attempt_id: str
    policy: str
    step: int
    span_id: str
    token_index: int


@dataclass
class AggregationResult:
    """The merged samples, how many calls were folded into an earlier call's sample, and the breaks."""

    samples: List[Sample] = field(default_factory=list)
    #: Calls appended to an earlier call's sample (so ``len(samples) + merged_calls`` is the number of calls).
    merged_calls: int = 0
    prefix_mismatches: List[PrefixMismatch] = field(default_factory=list)

    def mismatches_by_rollout(self) -> Dict[str, List[PrefixMismatch]]:
        """The prefix mismatches grouped by rollout id (in the order they were found)."""
        grouped: Dict[str, List[PrefixMismatch]] = defaultdict(list)
        for mismatch in self.prefix_mismatches:
            grouped[mismatch.rollout_id].append(mismatch)
        return dict(grouped)

    def summary(self) -> str:
        """A few readable lines: calls in, samples out, merges, and where each prefix mismatch happened."""
        calls = len(self.samples) + self.merged_calls
        lines = [
            f"{calls} calls -> {len(self.samples)} samples ({self.merged_calls} merged), "
            f"{len(self.prefix_mismatches)} prefix mismatch(es)"
        ]
        for rollout_id, mismatches in self.mismatches_by_rollout().items():
            for m in mismatches:
                lines.append(
                    f"  rollout {rollout_id} attempt {m.attempt_id} policy {m.policy}: "
                    f"step {m.step} (span {m.span_id}) breaks the prefix at token {m.token_index}"
                )
        return "\n".join(lines)


def _first_difference(expected: List[int], actual: List[int]) -> Optional[int]:
    """None if ``expected`` is a prefix of ``actual``; else the first index where they differ."""
    for i, token in enumerate(expected):
        if i >= len(actual) or actual[i] != token:
            return i
    return None


def _logprobs(t: Transition) -> Optional[List[float]]:
    """The call's logprobs if there is exactly one per response token, else None."""
    if t.response_logprobs is None or len(t.response_logprobs) != len(t.response_ids):
        return None
    return list(t.response_logprobs)


def _sample(t: Transition, prompt_ids: List[int], response_ids: List[int], logprobs: Optional[List[float]]) -> Sample:
    """A sample of one transition's own tokens (``t``'s lists or copies): the whole response is generated
    (mask all ones)."""
    return Sample(
        rollout_id=t.rollout_id,
        task_id=t.task_id,
        policy=t.policy,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_mask=[1] * len(response_ids),
        reward=t.reward,
        response_logprobs=logprobs,
        span_ids=[t.span_id],
        mode=t.mode,
    )


def _append(sample: Sample, t: Transition, seen: int) -> None:
    """Extend ``sample`` (whose prompt + response is the first ``seen`` tokens of ``t.prompt_ids``) with the
    rest of ``t``'s prompt (mask 0) and ``t``'s response (mask 1)."""
    between = t.prompt_ids[seen:]
    sample.response_ids += between + list(t.response_ids)
    sample.response_mask += [0] * len(between) + [1] * len(t.response_ids)
    logprobs = _logprobs(t)
    if sample.response_logprobs is not None and logprobs is not None:
        sample.response_logprobs += [0.0] * len(between) + logprobs
    else:
        sample.response_logprobs = None
    sample.reward = t.reward
    sample.span_ids.append(t.span_id)


def aggregate_trajectories(transitions: Iterable[Transition]) -> AggregationResult:
    """Merge consecutive calls of each ``(rollout_id, attempt_id, policy)`` whose prompts extend each other
    exactly (see the module docstring). Groups come out in order of first appearance, calls in step order."""
    groups: Dict[Tuple[str, str, str], List[Transition]] = {}
    for t in transitions:
        groups.setdefault((t.rollout_id, t.attempt_id, t.policy), []).append(t)

    result = AggregationResult()
    for calls in groups.values():
        sample: Optional[Sample] = None
        for t in sorted(calls, key=lambda c: c.step):
            if sample is not None:
                seen = sample.prompt_ids + sample.response_ids
                index = _first_difference(seen, t.prompt_ids)
                if index is None:
                    _append(sample, t, len(seen))
                    result.merged_calls += 1
                    continue
                result.prefix_mismatches.append(
                    PrefixMismatch(t.rollout_id, t.attempt_id, t.policy, t.step, t.span_id, index)
                )
            sample = _sample(t, list(t.prompt_ids), list(t.response_ids), _logprobs(t))  # copies: merging extends them
            result.samples.append(sample)
    return result
