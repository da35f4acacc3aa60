"""``LightningRL``: the one object trainers use to turn finished rollouts into a training batch.

    adapter = LightningRL.from_config({"agent_match": "writer|rewriter", "credit": "broadcast"})
    batch = adapter.build_batch(store, rollouts)
    batch.samples   # List[Sample], advantage and loss_weight set
    batch.report    # BatchReport: what happened to every rollout and every llm span; str() is one log line

Per rollout (its latest attempt's spans): trace tree (repaired, ``tree.py``) -> transitions (one per
selected llm call, ``transitions.py``) -> step rewards linked to their calls (``links.py``) and Automatic
Intermediate Rewards (``air.py``) -> credit assignment (``credit.py``). Then for the batch: samples (one per
transition, or merged trajectories with ``aggregate=True``, ``aggregate.py``) -> advantages, GRPO or RLOO
per policy, grouped by (mode, task) at the rollout level, with loss weights (``advantages.py``). Failed
rollouts are dropped or filled with a configured reward, never silently rewarded 0. See docs/lightningrl.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Pattern,
    Sequence,
    Tuple,
    Union,
)

from agl.lightningrl.advantages import (
    ADVANTAGE_ESTIMATORS,
    FailedRolloutPolicy,
    FailedRollouts,
    compute_advantages,
    resolve_rollout_rewards,
)
from agl.lightningrl.agent_match import AgentMatch
from agl.lightningrl.aggregate import aggregate_trajectories, to_samples
from agl.lightningrl.air import AIRConfig, air_rewards
from agl.lightningrl.credit import CreditRule, credit_rule
from agl.lightningrl.links import CallLinks
from agl.lightningrl.retokenize import Retokenizer
from agl.lightningrl.transitions import CallSelector, Extraction, extract_transitions
from agl.lightningrl.tree import DEFAULT_TOLERANCE_NS, RepairReport, build_tree
from agl.lightningrl.types import Sample, Transition
from agl.types import Rollout, Span

if TYPE_CHECKING:
    from agl.store.base import LightningStore

logger = logging.getLogger("agl.lightningrl")

__all__ = ["Batch", "BatchReport", "LightningRL"]


@dataclass
class BatchReport:
    """Counts of what happened to every rollout and every llm span of a batch.

    Rollouts: ``rollouts = used + failed_dropped``; ``failed_filled`` of the used ones had failed and got
    the configured reward. LLM spans (of the used rollouts' latest attempts):
    ``llm_spans = filtered_by_agent + filtered_by_call + sum(skipped) + transitions`` (``accounted``).
    """

    rollouts: int = 0
    used: int = 0
    failed_dropped: int = 0
    failed_filled: int = 0
    without_samples: int = 0  # used rollouts none of whose calls became a transition
    llm_spans: int = 0
    filtered_by_agent: int = 0
    filtered_agents: Dict[str, int] = field(default_factory=dict)  # agent name -> calls agent_match left out
    filtered_by_call: int = 0
    skipped: Dict[str, int] = field(default_factory=dict)  # reason -> llm spans
    transitions: int = 0
    samples: int = 0
    merged_calls: int = 0
    prefix_mismatches: int = 0
    retokenized: int = 0
    logprobs_dropped: int = 0
    several_choices: int = 0
    step_rewards_unattributed: int = 0
    tree_repairs: RepairReport = field(default_factory=RepairReport)

    @property
    def accounted(self) -> bool:
        placed = self.filtered_by_agent + self.filtered_by_call + sum(self.skipped.values()) + self.transitions
        return placed == self.llm_spans

    def add(self, extraction: Extraction, repairs: RepairReport, unattributed: int) -> None:
        """Add one attempt's counts."""
        self.llm_spans += extraction.llm_spans
        self.filtered_by_agent += extraction.filtered_by_agent
        for agent, n in extraction.filtered_agents.items():
            self.filtered_agents[agent] = self.filtered_agents.get(agent, 0) + n
        self.filtered_by_call += extraction.filtered_by_call
        for reason, n in extraction.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        self.transitions += len(extraction.transitions)
        self.retokenized += extraction.retokenized
        self.logprobs_dropped += extraction.logprobs_dropped
        self.several_choices += extraction.several_choices
        self.step_rewards_unattributed += unattributed
        self.without_samples += not extraction.transitions
        for f in dataclasses.fields(RepairReport):
            setattr(self.tree_repairs, f.name, getattr(self.tree_repairs, f.name) + getattr(repairs, f.name))

    def __str__(self) -> str:
        parts = [
            f"{self.rollouts} rollouts ({self.used} used, {self.failed_dropped} failed dropped, "
            f"{self.failed_filled} failed filled)",
            f"{self.llm_spans} llm spans -> {self.transitions} transitions -> {self.samples} samples",
        ]
        filtered = self.filtered_by_agent + self.filtered_by_call
        if filtered:
            agents = ", ".join(f"{name} {n}" for name, n in sorted(self.filtered_agents.items()))
            parts.append(
                f"filtered {self.filtered_by_agent} by agent_match{f' ({agents})' if agents else ''}, "
                f"{self.filtered_by_call} by llm_call_match"
            )
        if self.skipped:
            parts.append("skipped " + ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())))
        for n, what in (
            (self.merged_calls, "merged calls"),
            (self.prefix_mismatches, "prefix mismatches"),
            (self.retokenized, "re-tokenized"),
            (self.logprobs_dropped, "logprobs dropped (length mismatch or not finite)"),
            (self.several_choices, "calls with n > 1 (choice 0 trained)"),
            (self.step_rewards_unattributed, "step rewards without a call"),
            (self.without_samples, "rollouts without samples"),
        ):
            if n:
                parts.append(f"{n} {what}")
        if self.tree_repairs.total:
            parts.append(f"tree repairs: {self.tree_repairs}")
        return "; ".join(parts)

    def why_empty(self, agent_match: Any = None) -> str:
        """Why a batch with no sample has none, and what to check (for the error a trainer raises)."""
        if not self.used:
            return (
                f"every rollout failed ({self.failed_dropped} dropped): see their errors "
                "(agl store rollouts --status failed)"
            )
        if not self.llm_spans:
            return (
                "no rollout recorded an LLM call: agl records calls made through the openai client (every supported "
                "framework uses it) while instrumented; check that the agent calls the LLM resource it is given"
            )
        if self.filtered_by_agent == self.llm_spans:
            agents = ", ".join(f"{name!r} ({n})" for name, n in sorted(self.filtered_agents.items()))
            return (
                f"agent_match {agent_match!r} left out every LLM call; the calls' agents: {agents}. "
                "agent_match is a regex (re.search) on those names"
            )
        return f"no call became a sample ({self})"


@dataclass
class Batch:
    """The training batch: ``samples`` (advantage and loss_weight set), the ``transitions`` they came
    from (rewards and step rewards per call), and the ``report``."""

    samples: List[Sample]
    transitions: List[Transition]
    report: BatchReport

    def by_policy(self) -> Dict[str, List[Sample]]:
        """The samples of each policy, in batch order (one trainer per policy when several are trained)."""
        out: Dict[str, List[Sample]] = {}
        for s in self.samples:
            out.setdefault(s.policy, []).append(s)
        return out


Config = Union[None, Mapping[str, Any], "LightningRL"]


class LightningRL:
    """Spans -> transitions -> credit -> samples with advantages; see the module docstring.

    Settings (all keyword-only, the same keys as ``from_config``'s dict):

    - ``agent_match``: None (every llm call), a regex on the calling agent's name, or ``{regex: policy}``
      (first match wins); ``llm_call_match``: a regex on the call's span name or request model;
    - ``credit``: ``"broadcast"`` (default), ``"discounted"`` (needs ``gamma``), ``"step"`` or a rule object;
    - ``air``: None (off), a dict of :class:`AIRConfig` fields or an AIRConfig;
    - ``estimator``: ``"grpo"`` (default) or ``"rloo"``; ``estimator_options``: e.g. ``{"normalize_std": False}``;
    - ``failed``: ``"drop"`` (default) or the reward failed rollouts get (a number or FailedRollouts);
    - ``aggregate``: merge consecutive calls of a policy into one sample with a response mask;
    - ``tokenizer``: re-tokenize calls whose server returned no token ids (else they raise);
    - ``tolerance_ns``: clock skew tolerated when the trace tree re-parents spans by time.
    """

    def __init__(
        self,
        *,
        agent_match: AgentMatch = None,
        llm_call_match: Union[str, Pattern[str], None] = None,
        credit: Union[str, CreditRule] = "broadcast",
        gamma: Optional[float] = None,
        air: Union[None, Mapping[str, Any], AIRConfig] = None,
        estimator: str = "grpo",
        estimator_options: Optional[Mapping[str, Any]] = None,
        failed: Union[str, float, FailedRollouts] = "drop",
        aggregate: bool = False,
        tokenizer: Any = None,
        tolerance_ns: int = DEFAULT_TOLERANCE_NS,
    ) -> None:
        self.selector = CallSelector(agent_match, llm_call_match)
        self.agent_match = agent_match
        self.llm_call_match = llm_call_match
        self.credit = credit_rule(credit, gamma)
        self.air = AIRConfig.from_config(air)
        if estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
        self.estimator = estimator
        self.estimator_options = dict(estimator_options or {})
        self.failed = _failed_policy(failed)
        if not isinstance(aggregate, bool):
            raise TypeError(f"aggregate must be True or False, got {aggregate!r}")
        self.aggregate = aggregate
        self.retokenizer = Retokenizer(tokenizer) if tokenizer is not None else None
        self.tolerance_ns = tolerance_ns

    @classmethod
    def from_config(cls, config: Config = None) -> LightningRL:
        """From what a Trainer was given as ``adapter``: None (defaults), a dict of settings, or a LightningRL."""
        if config is None:
            return cls()
        if isinstance(config, LightningRL):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"adapter config must be None, a dict or a LightningRL, got {type(config).__name__}")
        known = set(cls.__init__.__kwdefaults__ or {})
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown LightningRL setting(s) {unknown}; known: {sorted(known)}")
        return cls(**config)

    def with_agent_match(self, agent_match: AgentMatch) -> LightningRL:
        """A copy that selects calls by ``agent_match``, every other setting the same."""
        adapted = copy.copy(self)
        adapted.agent_match = agent_match
        adapted.selector = CallSelector(agent_match, self.llm_call_match)
        return adapted

    # -- one attempt -----------------------------------------------------------------------------------------
    def attempt_transitions(
        self, rollout: Rollout, spans: Sequence[Span], episode_reward: float
    ) -> Tuple[Extraction, RepairReport, int]:
        """The transitions of one attempt with step rewards and credit set; also the extraction counts, the
        tree repairs and the number of step rewards that could not be linked to a call."""
        tree = build_tree(spans, tolerance_ns=self.tolerance_ns)
        extraction = extract_transitions(
            tree, task_id=rollout.task_id, mode=rollout.mode, selector=self.selector, retokenizer=self.retokenizer
        )
        unattributed = 0
        if extraction.transitions:
            links = CallLinks(tree)
            step = links.step_rewards()
            unattributed = step.unattributed
            air = air_rewards(links, (t.span_id for t in extraction.transitions), self.air) if self.air else {}
            for t in extraction.transitions:
                t.step_rewards = {**step.by_call.get(t.span_id, {}), **air.get(t.span_id, {})}
            for t, reward in zip(extraction.transitions, self.credit.assign(extraction.transitions, episode_reward)):
                t.reward = float(reward)
        return extraction, tree.repairs, unattributed

    # -- a batch ---------------------------------------------------------------------------------------------
    def build_batch(self, store: LightningStore, rollouts: Sequence[Rollout], *, progress: bool = True) -> Batch:
        """The batch of finished ``rollouts``, reading each one's latest attempt's spans from ``store``."""
        from agl._util.progress import progress_bar

        with progress_bar("LightningRL batch", total=len(rollouts), enabled=progress) as advance:

            def spans_of() -> Iterable[Tuple[Rollout, Sequence[Span]]]:
                for rollout in rollouts:
                    yield rollout, store.query_spans(rollout.rollout_id)
                    advance(1)

            return self.batch_from_spans(rollouts, spans_of())

    def batch_from_spans(self, rollouts: Sequence[Rollout], spans: Iterable[Tuple[Rollout, Sequence[Span]]]) -> Batch:
        """The batch from ``rollouts`` and ``(rollout, its attempt's spans)`` pairs (any order, lazily read;
        pairs of rollouts that are dropped or not listed are ignored)."""
        with _collector_paused():
            return self._batch(rollouts, spans)

    def _batch(self, rollouts: Sequence[Rollout], spans: Iterable[Tuple[Rollout, Sequence[Span]]]) -> Batch:
        resolution = resolve_rollout_rewards(rollouts, self.failed)
        report = BatchReport(
            rollouts=len(rollouts),
            used=len(resolution.rewards),
            failed_dropped=resolution.n_dropped,
            failed_filled=resolution.n_filled,
        )
        transitions: List[Transition] = []
        seen = set()
        for rollout, attempt_spans in spans:
            reward = resolution.rewards.get(rollout.rollout_id)
            if reward is None or rollout.rollout_id in seen:
                continue
            seen.add(rollout.rollout_id)
            extraction, repairs, unattributed = self.attempt_transitions(rollout, attempt_spans, reward)
            report.add(extraction, repairs, unattributed)
            transitions.extend(extraction.transitions)
        report.without_samples += len(resolution.rewards) - len(seen)  # used rollouts whose spans never came
        samples = self._advantages(self._samples(transitions, report))
        report.samples = len(samples)
        self._log(report)
        _warn_failed(rollouts, resolution.n_filled > 0)
        return Batch(samples=samples, transitions=transitions, report=report)

    def _samples(self, transitions: List[Transition], report: BatchReport) -> List[Sample]:
        if not self.aggregate:
            return to_samples(transitions)
        result = aggregate_trajectories(transitions)
        report.merged_calls = result.merged_calls
        report.prefix_mismatches = len(result.prefix_mismatches)
        if result.prefix_mismatches:
            logger.warning("LightningRL: calls not merged because of prefix mismatches:\n%s", result.summary())
        return result.samples

    def _advantages(self, samples: List[Sample]) -> List[Sample]:
        """Advantages per policy: each policy's samples are grouped by ``(mode, task)`` on their own (one
        policy's rewards are no baseline for another's, nor a validation rollout's for a training one's), and
        each rollout weighs the same within each policy."""
        positions: Dict[str, List[int]] = {}
        for i, s in enumerate(samples):
            positions.setdefault(s.policy, []).append(i)
        out: List[Sample] = list(samples)
        for indices in positions.values():
            done = compute_advantages([samples[i] for i in indices], self.estimator, **self.estimator_options)
            for i, sample in zip(indices, done):
                out[i] = sample
        return out

    @staticmethod
    def _log(report: BatchReport) -> None:
        logger.info("LightningRL batch: %s", report)
        if report.retokenized:
            logger.warning(
                "LightningRL re-tokenized %d llm call(s) whose server returned no token ids: their ids are "
                "approximate; serve the model with agl serve or vLLM (return_token_ids) for exact ids",
                report.retokenized,
            )
        if report.several_choices:
            logger.warning(
                "LightningRL: %d llm call(s) asked for several choices (n > 1, or a Completions batch of prompts); "
                "each trains as choice 0, whichever choice the agent went on with (only choice 0's token ids are "
                "recorded). Ask for one choice of one prompt per call (n=1), or run n rollouts, to train what the "
                "agent did",
                report.several_choices,
            )
        if report.step_rewards_unattributed:
            logger.warning(
                "LightningRL: %d step reward(s) could not be linked to an llm call (see docs/lightningrl.md, "
                "step rewards) and were not used",
                report.step_rewards_unattributed,
            )

    def __repr__(self) -> str:
        return (
            f"LightningRL(agent_match={self.agent_match!r}, llm_call_match={self.llm_call_match!r}, "
            f"credit={self.credit!r}, air={self.air!r}, estimator={self.estimator!r}, failed={self.failed!r}, "
            f"aggregate={self.aggregate})"
        )


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a batch is built.

    A batch is millions of small token lists, none in a reference cycle (reference counting frees them), but
    every full collection walks all of them: at 100k spans that was a third of the time, and the share grows
    with the batch. Paused, the cost per span stays flat from 10k to 1M spans (benchmarks/transitions.py).
    The first collection after the pause would still walk the whole batch once (a sixth of the time with
    real-sized token lists), so the process's young objects, the batch among them, go straight to the oldest
    generation instead (``gc.freeze`` then ``gc.unfreeze``: two list splices; only a full collection walks the
    oldest generation). Not when something else froze objects: those must stay frozen.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if was_enabled:
            gc.enable()


def _warn_failed(rollouts: Sequence[Rollout], filled: bool) -> None:
    """Say how many rollouts of the batch failed and why (the most common reason): a step whose rollouts all
    failed, e.g. on a request the server refuses, must not look like a step with no reward signal."""
    failed = [r for r in rollouts if not (r.status == "succeeded" and r.final_reward is not None)]
    if not failed:
        return
    reasons = Counter(_failure_reason(r) for r in failed)
    reason, count = reasons.most_common(1)[0]
    logger.warning(
        "LightningRL: %d of %d rollouts failed or gave no reward (%s); most common reason (%d of them): %s",
        len(failed),
        len(rollouts),
        "given the failed-rollout reward" if filled else "dropped",
        count,
        reason,
    )


def _failure_reason(rollout: Rollout) -> str:
    lines = (rollout.error or "").strip().splitlines()
    return lines[0][:300] if lines else f"{rollout.status}, without a reward"


def _failed_policy(failed: Union[str, float, FailedRollouts]) -> FailedRolloutPolicy:
    if failed == "drop" or isinstance(failed, FailedRollouts):
        return failed  # type: ignore[return-value]  # a list of the failed rollouts, typed as the samples it stands for
    if isinstance(failed, (int, float)) and not isinstance(failed, bool):
        return FailedRollouts(reward=float(failed))
    raise ValueError(f'failed must be "drop" or the reward failed rollouts get (a number), got {failed!r}')
