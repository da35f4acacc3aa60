"""Automatic Prompt Optimization: improve a ``PromptTemplate`` resource by a textual-gradient beam search.

The method is the one of ProTeGi and TextGrad that Agent Lightning's APO uses. Each round, for every prompt
in the beam: run the agent with it on ``gradient_batch_size`` training tasks; show an optimizer model the
prompt and the transcripts of the rollouts that scored worst (their LLM and tool calls, read from the spans,
with their rewards) and ask what in the prompt made them fail (the "gradient"); ask it ``branch_factor``
times for an edited prompt that fixes that. Every new prompt is scored by the mean reward of one rollout per
validation task (the same tasks for every candidate); the best ``beam_width`` prompts go on to the next
round. At the end the best prompt is published as a new resources version and becomes the trainer's
current resources, so a later ``Trainer.dev`` or training run uses it.

The optimizer is any OpenAI-compatible chat endpoint given as an ``agl.LLM`` (a hosted model, a vLLM server,
``agl serve``). Its calls are made on the algorithm's thread, outside any rollout, so they are never recorded
as training data. An edit that drops or invents a ``{placeholder}`` of the seed prompt would make the agent's
``template.format(...)`` fail, so it is refused (logged, not scored).
"""

from __future__ import annotations

import json
import logging
import random
import re
import statistics
import string
from dataclasses import dataclass, field
from typing import Any, Dict, Generic, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar, Union

from agl import semconv
from agl.algorithm.base import Algorithm
from agl.checks import check_count, check_number
from agl.errors import AglError
from agl.openai_wire.sampling import openai_arguments
from agl.runtime.dataset import as_tasks
from agl.types import LLM, PromptTemplate, Rollout, RolloutMode, Span, Task, call_order_key

logger = logging.getLogger("agl.apo")
AL_LOGGER = "agentlightning.algorithm.apo"  # Agent Lightning's examples attach their APO log handlers to it


class _ToPeerLogger(logging.Filter):
    """Hands each APO record to the handlers on Agent Lightning's APO logger too, so that a script that attaches
    a file handler there (``logging.getLogger("agentlightning.algorithm.apo").addHandler(...)``) gets APO's log.
    A filter, not a handler: with no logging set up, APO's warnings still reach Python's last-resort handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        peer = logging.getLogger(AL_LOGGER)
        if not peer.level or record.levelno >= peer.level:
            for handler in peer.handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)
        return True


logger.addFilter(_ToPeerLogger())

CRITIQUE_PROMPT = """You improve the prompt of an AI agent. The agent ran with this prompt:
<prompt>
{prompt}
</prompt>

Here are runs of the agent with it, worst first; each shows its reward (higher is better) and what the agent did:
{runs}

In a few sentences: what in the prompt led the agent to these results, and what should change?"""

EDIT_PROMPT = """You improve the prompt of an AI agent. The current prompt is:
<prompt>
{prompt}
</prompt>

A review of the agent's runs with it says:
{critique}

Write an improved prompt that fixes these problems.{keep} Reply with the new prompt only, between <prompt> and
</prompt>."""

KEEP_PLACEHOLDERS = " Keep every placeholder in braces ({placeholders}) exactly as it is."
NO_PLACEHOLDERS = " The prompt has no placeholders in braces: do not add any."

# Agent Lightning's APO takes an AsyncOpenAI client and these model names for its two requests.
AL_GRADIENT_MODEL = "gpt-5-mini"
AL_APPLY_EDIT_MODEL = "gpt-4.1-mini"

# A reasoning model's thinking, which often mentions <prompt> tags itself: a whole <think> block, everything
# before a lone </think> (the chat template opened the block), or an unclosed block (the reply was cut off).
_THINKING = re.compile(r"<think>.*?</think>|^.*</think>|<think>.*", re.IGNORECASE | re.DOTALL)
# A closed <prompt> block whose content opens no other one; an unclosed last tag is the fallback.
_PROMPT_BLOCK = re.compile(r"<prompt>((?:(?!<prompt>).)*?)</prompt>", re.IGNORECASE | re.DOTALL)
_PROMPT_OPEN = re.compile(r"<prompt>", re.IGNORECASE)
_LEFTOVER_TAG = re.compile(r"</?(?:prompt|think)>", re.IGNORECASE)

#: APO's settings that count something: whole numbers, at least 1
_COUNTS = ("beam_width", "branch_factor", "rounds", "gradient_batch_size", "val_batch_size", "max_transcripts")
DEFAULT_ROUNDS = 2

T_task = TypeVar("T_task")


class APOError(AglError):
    """APO cannot start (no prompt to optimize, no tasks) or the optimizer model cannot be used.

    Raised mid-search, it carries the search so far as ``result`` (``None`` before the seed was scored),
    whose best prompt is already published as the trainer's current resources."""

    result: Optional[APOResult] = None


@dataclass
class Candidate:
    """One prompt APO tried: its text, its validation score, and where it came from."""

    template: str
    score: float
    round: int  # 0 for the seed prompt
    parent: Optional[int] = None  # index in APOResult.history of the prompt it was edited from
    critique: Optional[str] = None
    resources_id: str = ""


@dataclass
class APOResult:
    """Every prompt tried, in order (``history[0]`` is the seed), and the best one, now published."""

    history: List[Candidate] = field(default_factory=list)
    best_index: int = 0
    refused: int = 0  # optimizer replies refused: no tagged prompt, an empty one, or changed placeholders

    @property
    def best(self) -> Candidate:
        return self.history[self.best_index]

    @property
    def seed(self) -> Candidate:
        return self.history[0]


class TraceToMessages:
    """Agent Lightning's APO needs ``Trainer(adapter=agl.TraceToMessages())`` to turn spans into chat messages.
    agl's APO reads the rollouts' spans itself (:func:`transcript`), so as an adapter this class only lets such
    code run unchanged; a training algorithm (LightningRL) refuses it as an adapter."""

    def adapt(self, spans: Sequence[Span], /) -> List[Dict[str, Any]]:
        """Each LLM call of ``spans``, in call order, as Agent Lightning's chat payload: ``{"messages": the
        call's input and output messages, "tools": the tools it offered, or None}`` (for code that reads them)."""
        return [
            {
                "messages": _json_list(s.attributes.get(semconv.INPUT_MESSAGES))
                + _json_list(s.attributes.get(semconv.OUTPUT_MESSAGES)),
                "tools": _json_list(s.attributes.get(semconv.TOOL_DEFINITIONS)) or None,
            }
            for s in sorted(spans, key=call_order_key)
            if s.kind == "llm"
        ]


class APO(Algorithm, Generic[T_task]):
    """Textual-gradient beam search over one ``PromptTemplate`` of the trainer's initial resources.

    ``optimizer``: the model that critiques and edits: ``agl.LLM`` (or its fields as a dict), or, as in
    Agent Lightning, an ``openai.OpenAI`` / ``AsyncOpenAI`` client, whose base URL and key are used with the
    models ``gradient_model`` (critiques) and ``apply_edit_model`` (edits), Agent Lightning's defaults when
    not given. With an ``agl.LLM`` they default to its model. ``diversity_temperature``: the optimizer's
    sampling temperature (default: the LLM's own sampling parameters).
    ``prompt``: the name of the resource to optimize (default: the only, or first, ``PromptTemplate``).
    ``beam_width`` prompts survive each of ``rounds`` rounds (``beam_rounds``, Agent Lightning's name, is
    the same); each spawns ``branch_factor`` edits from one critique of ``gradient_batch_size`` training
    rollouts (the ``max_transcripts`` worst are shown). Candidates are scored on ``val_batch_size``
    validation tasks (the validation set, else the training set), the same for every candidate. Failed
    rollouts and rollouts without a reward count as 0. ``APO[MyTask](...)``, Agent Lightning's spelling,
    works too (the task type is only a hint). ``rollout_batch_timeout``: how long to wait for one batch of
    rollouts (None: no limit); past it the search stops with an ``APOError``, its best prompt published.
    Agent Lightning's ``run_initial_validation`` and ``_poml_trace`` are accepted: the seed is always scored
    once, and there are no POML files (the optimizer's requests are logged at DEBUG). APO's log also reaches
    the handlers on Agent Lightning's logger ``agentlightning.algorithm.apo``.

    ``result`` holds the search so far, while it runs and after it stopped for any reason (an optimizer
    failure, Ctrl-C): a caller that catches the exception still has every prompt scored.
    """

    def __init__(
        self,
        optimizer: Union[LLM, Mapping[str, Any], Any],
        *,
        prompt: Optional[str] = None,
        beam_width: int = 2,
        branch_factor: int = 2,
        rounds: Optional[int] = None,
        gradient_batch_size: int = 4,
        val_batch_size: int = 8,
        max_transcripts: int = 3,
        request_timeout: float = 120.0,
        seed: int = 0,
        gradient_model: Optional[str] = None,
        apply_edit_model: Optional[str] = None,
        diversity_temperature: Optional[float] = None,
        beam_rounds: Optional[int] = None,
        rollout_batch_timeout: Optional[float] = None,
        run_initial_validation: bool = True,
        _poml_trace: bool = False,
    ) -> None:
        rounds = _rounds(rounds, beam_rounds)
        if rollout_batch_timeout is not None:
            check_number("rollout_batch_timeout", rollout_batch_timeout, positive=True)
        self.rollout_batch_timeout = rollout_batch_timeout
        if not run_initial_validation:
            logger.info("APO(run_initial_validation=False): agl's APO scores the seed prompt once, as every candidate")
        if _poml_trace:
            logger.info("APO(_poml_trace=True): agl's APO uses no POML files; its requests are logged at DEBUG")
        self.beam_width = beam_width
        self.branch_factor = branch_factor
        self.rounds = rounds
        self.gradient_batch_size = gradient_batch_size
        self.val_batch_size = val_batch_size
        self.max_transcripts = max_transcripts
        for name in _COUNTS:
            check_count(name, getattr(self, name))
        check_number("request_timeout", request_timeout, positive=True)
        if diversity_temperature is not None:
            check_number("diversity_temperature", diversity_temperature, positive=False)
        self.optimizer = _optimizer_llm(optimizer, gradient_model)
        is_client = not isinstance(optimizer, (LLM, Mapping))
        self.gradient_model = gradient_model or self.optimizer.model
        self.apply_edit_model = apply_edit_model or (AL_APPLY_EDIT_MODEL if is_client else self.optimizer.model)
        self.sampling = dict(self.optimizer.sampling_parameters)
        if diversity_temperature is not None:
            self.sampling["temperature"] = diversity_temperature
        self.prompt_name = prompt
        self.request_timeout = request_timeout
        self.rng = random.Random(seed)
        # set by run() from the trainer's resources: the prompt's name, its placeholders, the other resources
        self._name = ""
        self._fields: Set[str] = set()
        self._base: Dict[str, Any] = {}
        self.result: Optional[APOResult] = None

    # --- the search ---------------------------------------------------------------------------------------

    def run(self, train_dataset: Optional[Sequence[Any]], val_dataset: Optional[Sequence[Any]]) -> APOResult:
        train = as_tasks(train_dataset or [])
        if not train:
            raise APOError("APO needs training tasks: the critiques are drawn from rollouts on them")
        val_pool = as_tasks(val_dataset, mode="val") if val_dataset else train
        val = self.rng.sample(val_pool, min(self.val_batch_size, len(val_pool)))
        self._name, seed_template, self._base = self._seed_prompt()
        self._fields = _fields(seed_template)

        self.result = result = APOResult()
        try:
            result.history.append(self._scored(seed_template, val, round_=0))
            self._search(result, train, val)
        except BaseException as exc:  # the optimizer, Ctrl-C or a bug: keep what was found, say so, and stop
            self._stopped(result, exc)
            raise
        self._publish_best(result)
        return result

    def _stopped(self, result: APOResult, exc: BaseException) -> None:
        """Whatever ended the search early, the prompts scored so far are not lost: the best is published
        (a later ``trainer.dev`` uses it) and an ``APOError`` carries them as ``result``."""
        if isinstance(exc, APOError):
            exc.result = result if result.history else None
        if not result.history:
            return
        self._publish_best(result)
        reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
        logger.error(
            "APO stopped after %d prompts (%s); the best so far (%.3f) is published as %s",
            len(result.history),
            reason,
            result.best.score,
            result.best.resources_id,
        )

    def _search(self, result: APOResult, train: List[Task], val: List[Task]) -> None:
        """The rounds of the beam search, adding every prompt scored to ``result.history``."""
        seed = result.seed
        beam = [0]
        for round_ in range(1, self.rounds + 1):
            seen = {
                c.template.strip() for c in result.history
            }  # edits are stripped; a seed read from a file may not be
            for parent in beam:
                critique = self._critique(result.history[parent], train)
                if not critique.strip():  # edits asked with an empty review would be blind guesses
                    result.refused += 1
                    logger.warning(
                        "APO round %d: the optimizer's critique is empty; no edits of this prompt this round", round_
                    )
                    continue
                for edited in self._edits(result.history[parent].template, critique):
                    if edited is None:
                        result.refused += 1
                        continue
                    if edited in seen:
                        continue
                    if _fields(edited) != self._fields:
                        result.refused += 1
                        logger.warning(
                            "APO round %d: refused an edit whose placeholders %s differ from the seed's %s",
                            round_,
                            sorted(_fields(edited)),
                            sorted(self._fields),
                        )
                        continue
                    seen.add(edited)
                    candidate = self._scored(edited, val, round_, parent=parent, critique=critique)
                    result.history.append(candidate)
            ranked = sorted(range(len(result.history)), key=lambda i: (-result.history[i].score, i))
            beam = ranked[: self.beam_width]
            logger.info(
                "APO round %d/%d: best score %.3f (seed %.3f), %d prompts tried",
                round_,
                self.rounds,
                result.history[beam[0]].score,
                seed.score,
                len(result.history),
            )

    def _publish_best(self, result: APOResult) -> None:
        result.best_index = min(range(len(result.history)), key=lambda i: (-result.history[i].score, i))
        self.trainer.resources_id = result.best.resources_id  # later rollouts of this trainer use the best
        logger.info(
            "APO: best prompt scores %.3f against the seed's %.3f (published as %s)",
            result.best.score,
            result.seed.score,
            result.best.resources_id,
        )

    def _seed_prompt(self) -> Tuple[str, str, Dict[str, Any]]:
        update = self.store.get_resources(self.trainer.resources_id) if self.trainer.resources_id else None
        resources: Dict[str, Any] = dict(update.resources) if update is not None else {}
        templates = [k for k, v in resources.items() if isinstance(v, PromptTemplate)]
        if self.prompt_name is not None:
            if self.prompt_name not in templates:
                raise APOError(
                    f"no PromptTemplate named {self.prompt_name!r} in the trainer's resources (it has "
                    f"{sorted(templates) or 'none'}): pass initial_resources={{{self.prompt_name!r}: "
                    "agl.PromptTemplate(template=...)}} to the Trainer"
                )
            name = self.prompt_name
        elif templates:
            name = templates[0]
        else:
            raise APOError(
                "APO optimizes a PromptTemplate resource and the trainer has none: pass "
                "initial_resources={'prompt': agl.PromptTemplate(template='...')} to the Trainer, and have the "
                "agent read it (resources['prompt'].format(...))"
            )
        return name, resources[name].template, resources

    def _scored(self, template: str, val: List[Task], round_: int, **origin: Any) -> Candidate:
        resources_id = self._publish(template)
        rollouts = self._run_batch(val, "val", resources_id, f"APO round {round_}: scoring")
        error = _all_failed(rollouts)
        if error is not None and round_ == 0:
            raise APOError(
                f"every rollout of the seed prompt failed, so no prompt can be scored (first error: {error}): "
                "check the agent's model endpoint, and that the prompt's placeholders are fields of the tasks"
            )
        if error is not None:
            logger.warning(
                "APO round %d: every rollout scoring a prompt failed (first error: %s); it scores 0", round_, error
            )
        score = statistics.fmean(_reward(r) for r in rollouts)
        logger.info("APO round %d: prompt scored %.3f on %d tasks", round_, score, len(rollouts))
        return Candidate(template=template, score=score, round=round_, resources_id=resources_id, **origin)

    def _run_batch(self, tasks: List[Task], mode: RolloutMode, resources_id: str, description: str) -> List[Rollout]:
        """One batch of rollouts, waited for up to ``rollout_batch_timeout`` (then the search stops: APOError)."""
        try:
            return self.trainer.run_tasks(
                tasks, mode=mode, resources_id=resources_id, description=description, timeout=self.rollout_batch_timeout
            )
        except TimeoutError as exc:
            raise APOError(f"{description}: {exc} (rollout_batch_timeout); raise it, or add runners") from exc

    def _publish(self, template: str) -> str:
        resources = dict(self._base)
        resources[self._name] = PromptTemplate(template=template)
        return self.store.add_resources(resources).resources_id

    # --- the optimizer model ------------------------------------------------------------------------------

    def _critique(self, candidate: Candidate, train: List[Task]) -> str:
        batch = self.rng.sample(train, min(self.gradient_batch_size, len(train)))
        rollouts = self._run_batch(batch, "train", candidate.resources_id, "APO: rollouts to critique")
        error = _all_failed(rollouts)
        if error is not None:
            logger.warning(
                "APO: every rollout to critique failed (first error: %s); the critique sees only the errors", error
            )
        worst = sorted(rollouts, key=_reward)[: self.max_transcripts]
        runs = "\n\n".join(
            f'<run reward="{_reward(r):g}">\n{transcript(self.store.query_spans(r.rollout_id), r)}\n</run>'
            for r in worst
        )
        self.trainer.learned_from(rollouts)
        return self._ask(CRITIQUE_PROMPT.format(prompt=candidate.template, runs=runs), 1, self.gradient_model)[0]

    def _edits(self, template: str, critique: str) -> List[Optional[str]]:
        """The edited prompts of ``branch_factor`` replies; None for a reply that holds no prompt."""
        if self._fields:
            keep = KEEP_PLACEHOLDERS.format(placeholders=", ".join("{" + f + "}" for f in sorted(self._fields)))
        else:
            keep = NO_PLACEHOLDERS
        request = EDIT_PROMPT.format(prompt=template, critique=critique, keep=keep)
        edits: List[Optional[str]] = []
        for reply in self._ask(request, self.branch_factor, self.apply_edit_model):
            edited = _extract_prompt(reply)
            if edited is None:
                logger.warning(
                    "APO: refused an optimizer reply with no prompt between <prompt> tags (or an empty one): %r",
                    _cut(reply, 200),
                )
            edits.append(edited)
        return edits

    def _ask(self, content: str, n: int, model: str) -> List[str]:
        """``n`` replies of the optimizer ``model`` to one user message (one request each: not every server
        honours ``n``)."""
        import openai

        llm = self.optimizer
        replies = []
        known, extra = openai_arguments(self.sampling)
        with openai.OpenAI(
            base_url=llm.get_base_url(), api_key=llm.api_key or "agl", timeout=self.request_timeout, max_retries=2
        ) as client:
            for _ in range(n):
                try:
                    completion = client.chat.completions.create(  # type: ignore[call-overload]  # plain dict messages, as the API takes them
                        model=model,
                        messages=[{"role": "user", "content": content}],
                        **known,
                        **({"extra_body": extra} if extra else {}),
                    )
                except openai.OpenAIError as exc:
                    raise APOError(f"the optimizer model {model!r} at {llm.get_base_url()} failed: {exc}") from exc
                replies.append(_reply_text(completion, model, llm.get_base_url()))
                logger.debug("APO asked %s:\n%s\nreply:\n%s", model, content, replies[-1])
        return replies


# --- helpers ------------------------------------------------------------------------------------------------


def transcript(spans: Sequence[Span], rollout: Optional[Rollout] = None, limit: int = 600) -> str:
    """What the agent did in one rollout, as text for the optimizer: its LLM calls and tool calls, in order,
    each message cut to ``limit`` characters. A call that continues the previous call's conversation shows
    only its new messages; one that starts another conversation (a pipeline's next stage, another agent,
    whose system message is often the prompt being optimized) shows its whole input after a marker."""
    lines: List[str] = []
    previous: Optional[Tuple[List[Tuple[str, str]], int]] = None  # the last call's input, and its reply count
    for span in sorted(spans, key=call_order_key):
        attrs = span.attributes
        if span.kind == "llm":
            inputs = _json_list(attrs.get(semconv.INPUT_MESSAGES))
            outputs = _json_list(attrs.get(semconv.OUTPUT_MESSAGES))
            keys = [_message_key(m) for m in inputs]
            new_from = _continues(previous, keys)
            if previous is not None and new_from == 0:
                lines.append("[new conversation]")
            for message in inputs[new_from:]:
                lines.append(f"[{message.get('role', '?')}] {_cut(_content(message), limit)}")
            for message in outputs:
                text = _content(message)
                calls = message.get("tool_calls") or []
                if calls:
                    text += " " + " ".join(f"<call {json.dumps(c, default=str)}>" for c in calls)
                lines.append(f"[assistant] {_cut(text, limit)}")
            previous = (keys, len(outputs))
        elif span.kind == "tool":
            lines.append(
                f"[tool {attrs.get(semconv.TOOL_NAME, span.name)}] "
                f"{_cut(str(attrs.get(semconv.TOOL_CALL_ARGUMENTS, '')), limit)} -> "
                f"{_cut(str(attrs.get(semconv.TOOL_CALL_RESULT, span.error or '')), limit)}"
            )
    if rollout is not None and rollout.status != "succeeded":
        lines.append(f"[rollout {rollout.status}] {_cut(rollout.error or '', limit)}")
    return "\n".join(lines) or "(no LLM or tool calls were recorded)"


def _continues(previous: Optional[Tuple[List[Tuple[str, str]], int]], keys: List[Tuple[str, str]]) -> int:
    """Where a call's new messages start: after the previous call's input and its replies (which the next
    input repeats, maybe reformatted, so they are only counted) when this input begins with that input;
    0 (all of it is new) otherwise."""
    if previous is None:
        return 0
    before, replies = previous
    if len(keys) > len(before) and keys[: len(before)] == before:
        return min(len(before) + replies, len(keys))
    return 0


def _message_key(message: Mapping[str, Any]) -> Tuple[str, str]:
    return str(message.get("role", "?")), _content(message)


def _all_failed(rollouts: Sequence[Rollout]) -> Optional[str]:
    """The first error when every rollout failed (the agent's endpoint down, a placeholder the tasks lack),
    else None: then every prompt scores 0 and the search can learn nothing."""
    if not rollouts or any(r.status == "succeeded" for r in rollouts):
        return None
    return next((r.error for r in rollouts if r.error), f"rollouts {rollouts[0].status}")


def _reply_text(completion: Any, model: str, url: str) -> str:
    """The text of an optimizer reply. An HTTP 200 that holds no completion (a proxy's HTML page, an error
    object, ``"choices": []``) is an ``APOError`` like a failed request, not an IndexError mid-search."""
    choices = getattr(completion, "choices", None)
    message = getattr(choices[0], "message", None) if isinstance(choices, list) and choices else None
    if message is None:
        raise APOError(f"the optimizer model {model!r} at {url} returned no completion: {_cut(str(completion), 200)}")
    content = getattr(message, "content", None)
    return content if isinstance(content, str) else ""


def _rounds(rounds: Optional[int], beam_rounds: Optional[int]) -> int:
    """``rounds`` or Agent Lightning's ``beam_rounds``; both given, they must agree."""
    if rounds is not None and beam_rounds is not None and rounds != beam_rounds:
        raise ValueError(f"rounds={rounds} and beam_rounds={beam_rounds} disagree: give one of them")
    chosen = rounds if rounds is not None else beam_rounds
    return DEFAULT_ROUNDS if chosen is None else chosen


def _reward(rollout: Rollout) -> float:
    return float(rollout.final_reward) if rollout.status == "succeeded" and rollout.final_reward is not None else 0.0


def _fields(template: str) -> Set[str]:
    try:
        return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError:  # unbalanced braces: never equal to a valid seed's fields
        return {"<unbalanced braces>"}


def _extract_prompt(reply: str) -> Optional[str]:
    """The prompt of an optimizer reply: its last closed ``<prompt>...</prompt>`` block, else the text after
    its last ``<prompt>`` tag; None when there is none, it is empty, or it still holds a tag.

    The reasoning (``<think>...</think>``) is dropped first, and the last block is taken, because models
    mention or quote the tags before their answer ("I should put it between <prompt> tags", "the current
    prompt was <prompt>OLD</prompt>"). An untagged reply is not taken as it is: its chatter ("Sure! Here is
    an improved version...") would become the agent's prompt."""
    answer = _THINKING.sub("", reply)
    blocks = _PROMPT_BLOCK.findall(answer)
    if blocks:
        prompt = blocks[-1]
    else:
        opened = list(_PROMPT_OPEN.finditer(answer))
        if not opened:
            return None
        prompt = answer[opened[-1].end() :]
    prompt = prompt.strip()
    return prompt if prompt and not _LEFTOVER_TAG.search(prompt) else None


def _optimizer_llm(optimizer: Any, gradient_model: Optional[str]) -> LLM:
    """The optimizer as an ``agl.LLM``: given as one, as its fields, or as an OpenAI client (Agent Lightning)."""
    if isinstance(optimizer, LLM):
        return optimizer
    if isinstance(optimizer, Mapping):
        return LLM(**dict(optimizer))
    base_url, api_key = getattr(optimizer, "base_url", None), getattr(optimizer, "api_key", None)
    if base_url is None or not hasattr(optimizer, "chat"):
        raise TypeError(
            f"APO's optimizer must be agl.LLM(endpoint=..., model=...), a dict of its fields, or an openai client "
            f"(OpenAI() / AsyncOpenAI()); got {type(optimizer).__name__}"
        )
    return LLM(endpoint=str(base_url).rstrip("/"), model=gradient_model or AL_GRADIENT_MODEL, api_key=api_key)


def _json_list(value: Any) -> List[Dict[str, Any]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
