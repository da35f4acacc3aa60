"""TorchGRPO's settings: every keyword of ``TorchGRPO(...)``, its default, its type, its check and what it means,
in one pydantic model, :class:`TorchGRPOConfig`. Torch is not imported here, so ``agl train --check`` and
``--help`` work without it.

The model is read three ways:

- ``TorchGRPO(**settings)`` builds a :class:`TorchGRPOConfig` (:meth:`TorchGRPOConfig.from_keywords`): an
  unknown keyword is a TypeError, a value its check refuses a ValueError saying which and why;
- ``agl train --set KEY=VALUE`` / ``--config`` values are JSON: :func:`json_problems` checks each against the
  :class:`JsonSetting` of its field (a whole number is no float or boolean there, a count is at least 1) and
  says, one line per setting, what it expects; settings only Python can give (:class:`PythonOnly`) are named;
- the signature of ``TorchGRPO`` (:meth:`TorchGRPOConfig.signature`), for ``help()`` and editors.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    Callable,
    Dict,
    List,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agl.algorithm.base import Algorithm
from agl.checks import check_number, is_finite_number

if TYPE_CHECKING:
    import torch

    from agl.algorithm.checkpoint import TrainerState
    from agl.algorithm.metrics import MetricsLog
    from agl.algorithm.torch_grpo_evaluation import Evaluation
    from agl.algorithm.trainable import TrainablePolicy
    from agl.lightningrl.types import Sample
    from agl.types import Rollout, Task

logger = logging.getLogger("agl.train")

DEFAULT_LORA: Dict[str, Any] = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
"""LoRA on every linear layer of the transformer blocks; peft excludes the LM head for ``all-linear``."""

LoraSpec = Union[None, Mapping[str, Any], Any]  # None: full fine-tuning; a dict of LoraConfig fields; a LoraConfig

_INT, _NUM, _STR, _OBJ = "int", "number", "str", "object"
_EXPECTED = {_INT: "a whole number", _NUM: "a finite number", _STR: "text", _OBJ: "a JSON object"}


@dataclass(frozen=True)
class JsonSetting:
    """What a setting takes as a JSON value (``agl train --set KEY=VALUE``, ``--config``): ``kind`` ("int",
    "number", "str", "object", or a tuple of the allowed values), at least (``exclusive``: above) ``low``,
    ``null`` when ``nullable``; ``note`` ends the "expected ..." line. Stricter than the Python constructor,
    which keeps taking what it always took (``2.0`` for a count, a ``Path``, a ``(model, tokenizer)`` pair)."""

    kind: Union[str, Tuple[str, ...]]
    low: Optional[float] = None
    exclusive: bool = False
    nullable: bool = False
    note: str = ""

    def expected(self) -> str:
        text = "one of " + ", ".join(map(repr, self.kind)) if isinstance(self.kind, tuple) else _EXPECTED[self.kind]
        if self.low is not None:
            text += f" {'>' if self.exclusive else '>='} {self.low}"
        if self.nullable:
            text += " or null"
        return text + (f" ({self.note})" if self.note else "")

    def problem(self, value: Any) -> str:
        """What ``value`` should be instead, or "" when it fits."""
        if value is None:
            return "" if self.nullable else f"expected {self.expected()}"
        if isinstance(self.kind, tuple):
            ok = value in self.kind
        elif self.kind == _INT:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind == _NUM:
            ok = is_finite_number(value)
        elif self.kind == _STR:
            ok = isinstance(value, str) and bool(value.strip())
        else:
            ok = isinstance(value, dict)
        if ok and self.low is not None:
            ok = value > self.low if self.exclusive else value >= self.low
        return "" if ok else f"expected {self.expected()}"


@dataclass(frozen=True)
class PythonOnly:
    """A setting no JSON value can give (a callable): ``why`` says so to ``--set``/``--config``."""

    why: str


def _refuse(bad: Callable[[Any], bool], message: str) -> BeforeValidator:
    """A check of TorchGRPO(...): a value ``bad`` says is wrong raises ValueError(``message``), formatted with
    the setting's ``name`` and ``value``."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if bad(value):
            raise ValueError(message.format(name=info.field_name, value=value))
        return value

    return BeforeValidator(check)


def _finite(*, positive: bool) -> BeforeValidator:
    """A check of TorchGRPO(...): a finite number, above 0 when ``positive`` (agl.checks' words)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        check_number(info.field_name or "value", value, positive=positive)  # a field validator: always named
        return value

    return BeforeValidator(check)


_COUNT = _refuse(lambda v: v < 1, "{name} must be at least 1, got {value}")
_POSITIVE = _finite(positive=True)


class TorchGRPOConfig(BaseModel):
    """Every setting of :class:`~agl.algorithm.torch_grpo.TorchGRPO`: its type, the check ``TorchGRPO(...)``
    makes (the validators in its type), what ``--set``/``--config`` take (its :class:`JsonSetting`), its default
    and what it means; docs/training.md says more about each. ``TorchGRPO(**settings)`` takes exactly these
    keywords; its checks report the first bad setting in this order."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # the model
    model: Annotated[
        Union[str, Tuple[Any, Any]], JsonSetting(_STR, note="smollm2, tiny, or a Hugging Face name or path")
    ] = Field(
        "smollm2",
        description='"smollm2" (bundled), "tiny" (random, for tests), a Hugging Face name or path, '
        "or a loaded (model, tokenizer) pair",
    )
    lora: Annotated[
        LoraSpec,
        JsonSetting(_OBJ, nullable=True, note='LoraConfig fields such as {"r": 8}, or null for full fine-tuning'),
    ] = Field(
        default_factory=lambda: dict(DEFAULT_LORA),
        description="a dict of peft.LoraConfig fields (missing ones "
        "from DEFAULT_LORA), a LoraConfig, or None for full fine-tuning",
    )
    # the schedule and the optimisation
    lr: Annotated[float, _POSITIVE, JsonSetting(_NUM, 0, exclusive=True)] = Field(
        5e-4,
        description="AdamW learning rate (torch's other defaults: weight decay 0.01); a resumed run uses "
        "this one, not the checkpoint's",
    )
    group_size: Annotated[int, _COUNT, JsonSetting(_INT, 1)] = Field(
        4, description="rollouts per task (the GRPO group)"
    )
    batch_tasks: Annotated[int, _COUNT, JsonSetting(_INT, 1)] = Field(8, description="training tasks per step")
    steps: Annotated[
        Optional[int],
        _refuse(lambda v: v is not None and v < 0, "steps must be >= 0, got {value}"),
        JsonSetting(_INT, 0, nullable=True, note="null: as many as `epochs` passes over --data take"),
    ] = Field(None, description="training steps; None: `epochs` passes over the training tasks")
    epochs: Annotated[int, _COUNT, JsonSetting(_INT, 1)] = Field(
        1, description="passes over the training tasks when steps is None"
    )
    ppo_epochs: Annotated[int, _COUNT, JsonSetting(_INT, 1)] = Field(1, description="passes over each batch")
    micro_batch_size: Annotated[int, _COUNT, JsonSetting(_INT, 1)] = Field(16, description="samples per forward pass")
    grad_accum: Annotated[
        Optional[int],
        _refuse(
            lambda v: v is not None and v < 1, "{name} must be >= 1 or None (one optimizer step per pass), got {value}"
        ),
        JsonSetting(_INT, 1, nullable=True),
    ] = Field(None, description="micro-batches per optimizer step; None: one optimizer step per pass over the batch")
    clip_eps: Annotated[float, _POSITIVE, JsonSetting(_NUM, 0, exclusive=True)] = Field(
        0.2, description="PPO ratio clip"
    )
    kl_coef: Annotated[float, _finite(positive=False), JsonSetting(_NUM, 0)] = Field(
        0.0, description="weight of the k3 KL to the reference policy; 0 skips the reference forward pass"
    )
    max_grad_norm: Annotated[float, _POSITIVE, JsonSetting(_NUM, 0, exclusive=True)] = Field(
        1.0, description="gradient clipping"
    )
    old_logprobs: Annotated[
        Literal["sample", "recompute"],
        _refuse(
            lambda v: v not in ("sample", "recompute"), 'old_logprobs must be "sample" or "recompute", got {value!r}'
        ),
        JsonSetting(("sample", "recompute")),
    ] = Field(
        "sample",
        description="the PPO ratio's old logprobs: the server's (\"sample\") or a forward pass before "
        'the update ("recompute")',
    )
    # sampling and evaluation
    temperature: Annotated[
        float,
        _refuse(
            lambda v: not (is_finite_number(v) and v > 0),
            "temperature must be a finite number > 0 for training "
            "rollouts (got {value}); use val_sampling={{'temperature': 0.0}} for greedy evaluation",
        ),
        JsonSetting(_NUM, 0, exclusive=True),
    ] = Field(
        1.0,
        description="the training temperature, published with the LLM resource; the loss computes every logprob at it",
    )
    max_tokens: Annotated[int, _COUNT, JsonSetting(_INT, 1)] = Field(256, description="longest response per LLM call")
    sampling: Annotated[Optional[Mapping[str, Any]], JsonSetting(_OBJ, nullable=True, note='e.g. {"top_p": 0.9}')] = (
        Field(
            None,
            validate_default=True,
            description="more sampling parameters of the training rollouts (no other "
            "temperature, no seed with group_size > 1)",
        )
    )
    val_sampling: Annotated[
        Optional[Mapping[str, Any]], JsonSetting(_OBJ, nullable=True, note='e.g. {"temperature": 0.0}')
    ] = Field(
        None, description="overrides for the validation rollouts, e.g. {'temperature': 0.0} for greedy evaluation"
    )
    extra_evals: Annotated[
        Optional[Mapping[str, Mapping[str, Any]]],
        JsonSetting(_OBJ, nullable=True, note='names to sampling settings, e.g. {"greedy": {"temperature": 0.0}}'),
    ] = Field(
        None,
        validate_default=True,
        description="more evaluations, before and after training only: their sampling overrides by name",
    )
    success_threshold: Annotated[
        float,
        _refuse(lambda v: not is_finite_number(v), "success_threshold must be a finite number, got {value!r}"),
        JsonSetting(_NUM, note="the reward that counts as a success"),
    ] = Field(1.0, description="a rollout whose reward reaches it counts as a success")
    eval_every: Annotated[int, JsonSetting(_INT, 0, note="0: evaluate only before and after training")] = Field(
        0, description="validate every N steps (0: before and after training only)"
    )
    time_budget_s: Annotated[
        Optional[float],
        _refuse(  # NaN: no step would ever be over budget
            lambda v: v is not None and v != v, "time_budget_s must be a number of seconds or None (no budget), got nan"
        ),
        JsonSetting(_NUM, 0, exclusive=True, nullable=True, note="or --minutes"),
    ] = Field(
        None,
        description="wall-time budget of the whole run: no step starts unless it and the final evaluations still fit",
    )
    # the run's files: agl train decides them from --out and --resume, so they take no JSON value
    checkpoint_dir: Optional[Path] = Field(None, description="where checkpoints go (None: none are saved)")
    checkpoint_every: Annotated[int, JsonSetting(_INT, 1)] = Field(1, description="steps between checkpoints")
    resume: bool = Field(True, description="continue from the newest checkpoint in checkpoint_dir")
    output_dir: Optional[Path] = Field(
        None, description="metrics files (None: checkpoint_dir, else .agl/runs/grpo-<time>)"
    )
    # the machine
    seed: Annotated[int, JsonSetting(_INT)] = Field(
        0, description="seeds torch and Python's random at the start, and the shuffled task order"
    )
    device: Annotated[Optional[str], JsonSetting(_STR, nullable=True, note="cpu, cuda, cuda:1 ...")] = Field(
        None, description="where the model goes (None: cuda when present)"
    )
    dtype: Annotated[Any, JsonSetting(_STR, nullable=True, note="float32, bfloat16 or float16")] = Field(
        None, description="the model's dtype (None: bfloat16 on CUDA, float32 on the CPU)"
    )
    torch_threads: Annotated[Optional[int], JsonSetting(_INT, 1, nullable=True)] = Field(
        None, description="torch's CPU threads (None: all cores on the CPU)"
    )
    # the policy server
    server_batch_size: Annotated[int, _COUNT, JsonSetting(_INT, 1)] = Field(
        16, description="the policy server's batch size"
    )
    server_host: Annotated[str, JsonSetting(_STR)] = Field(
        "127.0.0.1", description='where the policy server listens ("0.0.0.0" for runners on other machines)'
    )
    server_port: Annotated[int, JsonSetting(_INT, 0, note="0 picks a free port")] = Field(
        0, description="the policy server's port (0: a free one)"
    )
    server_url: Annotated[Optional[str], JsonSetting(_STR, nullable=True)] = Field(
        None, description="the URL published to agents instead of the server's own"
    )
    model_name: Annotated[str, JsonSetting(_STR)] = Field("policy", description="the model name agents see")
    resource_name: Annotated[str, JsonSetting(_STR)] = Field("main_llm", description="the LLM resource's name")
    on_step: Annotated[
        Optional[Callable[[Dict[str, float]], None]],
        PythonOnly("a Python callable: only the Python API sets it, TorchGRPO(on_step=...)"),
    ] = Field(
        None,
        description="called with each step's row on the training thread, after the row is logged and the "
        "step's checkpoint saved (hand it to any tracker); an exception it raises stops training",
    )

    # ------------------------------------------------------------------------------------------------------
    # settings checked with others, or normalized
    # ------------------------------------------------------------------------------------------------------
    @field_validator("sampling", "val_sampling")
    @classmethod
    def _sampling(cls, value: Optional[Mapping[str, Any]], info: ValidationInfo) -> Optional[Dict[str, Any]]:
        if value is None:
            return {} if info.field_name == "sampling" else None
        _check_sampling_keys(info.field_name or "sampling", value)  # a field validator: always named
        return dict(value)

    @field_validator("extra_evals")
    @classmethod
    def _extra_evals(cls, value: Optional[Mapping[str, Mapping[str, Any]]]) -> Dict[str, Dict[str, Any]]:
        evals = {name: dict(v) for name, v in (value or {}).items()}
        for name, settings in evals.items():
            _check_sampling_keys(f"extra_evals[{name!r}]", settings)
        if "val" in evals:
            raise ValueError('extra_evals cannot use the name "val": it is the main evaluation (val_sampling)')
        return evals

    @field_validator("server_url")
    @classmethod
    def _server_url(cls, value: Optional[str]) -> Optional[str]:
        return value.rstrip("/") if value else None

    @model_validator(mode="after")
    def _training_sampling(self) -> TorchGRPOConfig:
        """Training settings in ``sampling`` that would train on something else than what the rollouts
        sampled: a ``temperature`` other than ``temperature`` (the loss computes every logprob at it), and a
        fixed ``seed`` with ``group_size > 1`` (every rollout of a group would be the same, so no advantage).
        Both are fine in ``val_sampling`` and ``extra_evals``, which train nothing."""
        sampling, temperature = self.sampling or {}, self.temperature
        if "temperature" in sampling and sampling["temperature"] != temperature:
            wanted = sampling["temperature"]
            raise ValueError(
                f"sampling has temperature={wanted!r} but TorchGRPO(temperature={temperature!r}): the rollouts would "
                f"be sampled at {wanted!r} while the loss computes every logprob at {temperature!r}. "
                + _temperature_advice(wanted)
            )
        if sampling.get("seed") is not None and self.group_size > 1:
            raise ValueError(
                f"sampling has seed={sampling['seed']!r}: with group_size={self.group_size} every rollout of a task "
                "would be sampled from the same prompt with the same seed, so a group's rollouts would be identical, "
                "their rewards equal and no advantage left to train on. Leave seed out of sampling "
                "(TorchGRPO(seed=...) seeds the run); val_sampling and extra_evals may fix one"
            )
        return self

    @model_validator(mode="after")
    def _warn_of_single_rollout_groups(self) -> TorchGRPOConfig:
        if self.group_size < 2:
            logger.warning("group_size=1: GRPO compares rollouts of the same task, every advantage will be 0")
        return self

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_keywords(cls, settings: Mapping[str, Any]) -> TorchGRPOConfig:
        """The settings of ``TorchGRPO(**settings)``, refused as TorchGRPO refuses them: an unknown keyword with
        a TypeError, a bad value with the ValueError of its check (the first one, in the fields' order)."""
        for name in settings:
            if name not in cls.model_fields:
                raise TypeError(f"TorchGRPO.__init__() got an unexpected keyword argument {name!r}")
        try:
            return cls(**settings)
        except ValidationError as exc:
            raise _plain_error(exc) from None

    @classmethod
    def signature(cls) -> inspect.Signature:
        """``TorchGRPO``'s signature: one keyword-only parameter per field, with its default."""
        parameters = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=field.annotation,
                default=field.get_default(call_default_factory=True),
            )
            for name, field in cls.model_fields.items()
        ]
        return inspect.Signature(parameters, return_annotation=None)


class TorchGRPOBase(Algorithm):
    """What :class:`~agl.algorithm.torch_grpo.TorchGRPO` and each of its parts (the session, loop, evaluation
    and checkpoint mixins, which all derive from this class) share, declared with their types so that each
    part type-checks on its own. Declarations only: nothing here runs.

    - the settings, which ``TorchGRPO.__init__`` copies from :class:`TorchGRPOConfig` (``model`` as
      ``model_spec``), with the types they have after its checks (``sampling`` and ``extra_evals`` are dicts);
    - the run's state, which ``TorchGRPO.__init__`` sets up and ``run`` fills in;
    - the methods one part calls on another (under ``TYPE_CHECKING``: the parts and TorchGRPO define them).
    """

    # the settings (TorchGRPOConfig's fields)
    model_spec: Union[str, Tuple[Any, Any]]
    lora: LoraSpec
    lr: float
    group_size: int
    batch_tasks: int
    steps: Optional[int]
    epochs: int
    ppo_epochs: int
    micro_batch_size: int
    grad_accum: Optional[int]
    clip_eps: float
    kl_coef: float
    max_grad_norm: float
    old_logprobs: Literal["sample", "recompute"]
    temperature: float
    max_tokens: int
    sampling: Dict[str, Any]
    val_sampling: Optional[Dict[str, Any]]
    extra_evals: Dict[str, Dict[str, Any]]
    success_threshold: float
    eval_every: int
    time_budget_s: Optional[float]
    checkpoint_dir: Optional[Path]
    checkpoint_every: int
    resume: bool
    output_dir: Optional[Path]
    seed: int
    device: Optional[str]
    dtype: Any
    torch_threads: Optional[int]
    server_batch_size: int
    server_host: str
    server_port: int
    server_url: Optional[str]
    model_name: str
    resource_name: str
    on_step: Optional[Callable[[Dict[str, float]], None]]

    # the run's state
    policy: Optional[TrainablePolicy]  # attach() wraps the model
    tokenizer: Any
    server: Any  # the PolicyServer while a run lasts
    optimizer: Optional[torch.optim.Optimizer]
    state: TrainerState
    _saved_step: int  # the step of the newest checkpoint (made or resumed from)
    _sampling_of: Dict[str, Dict[str, Any]]  # resources id -> the sampling settings published in it

    if TYPE_CHECKING:  # defined by TorchGRPO and its parts, called across them

        def attach(self, model: Any, tokenizer: Any) -> None: ...

        def update(self, samples: Sequence[Sample]) -> Dict[str, float]: ...

        def _publish(self, sampling: Mapping[str, Any]) -> str: ...

        def _run_rollouts(self, tasks: List[Task], resources_id: str, **kwargs: Any) -> List[Rollout]: ...

        def _train_sampling(self) -> Dict[str, Any]: ...

        def _evaluate(
            self, val_tasks: List[Task], metrics: MetricsLog, name: str = "val", deadline: Optional[float] = None
        ) -> Evaluation: ...

        def _over_budget(self, started: float) -> bool: ...

        def _save(self) -> None: ...

        def _save_if_behind(self) -> None: ...


def _metadata(kind: type) -> Dict[str, Any]:
    return {
        name: meta
        for name, field in TorchGRPOConfig.model_fields.items()
        for meta in field.metadata
        if isinstance(meta, kind)
    }


#: what ``--set``/``--config`` take, by setting (the run's folder, ``on_step``: none)
JSON_SETTINGS: Dict[str, JsonSetting] = _metadata(JsonSetting)
#: the settings only the Python API can give, and why
PYTHON_ONLY: Dict[str, str] = {name: meta.why for name, meta in _metadata(PythonOnly).items()}
#: LoraConfig fields whose type ``--set lora=...`` checks before peft (and torch) is imported
_LORA_FIELDS = {
    "r": JsonSetting(_INT, 1),
    "lora_alpha": JsonSetting(_NUM, 0, exclusive=True),
    "lora_dropout": JsonSetting(_NUM, 0, note="a fraction below 1"),
}


def json_problems(settings: Mapping[str, Any]) -> List[str]:
    """One line per JSON setting whose name, type or range is wrong (name, value, what it takes), without
    importing torch; empty when all are fine. The run's folder (``output_dir``, ``checkpoint_dir``, ``resume``)
    is the caller's to refuse or take (``agl train``: ``--out``, ``--resume``)."""
    problems = []
    for key, value in settings.items():
        if key in PYTHON_ONLY:
            problems.append(f"{key}={value!r}: {PYTHON_ONLY[key]}")
        elif key not in TorchGRPOConfig.model_fields:
            problems.append(f"{key}={value!r}: TorchGRPO has no setting {key!r}")
        elif key in JSON_SETTINGS:
            wrong = JSON_SETTINGS[key].problem(value)
            if wrong:
                problems.append(f"{key}={value!r}: {wrong}")
            elif key == "lora" and value is not None:
                problems.extend(f"lora={value!r}: {field} {wrong}" for field, wrong in _lora_problems(value))
            elif key == "extra_evals" and value is not None:
                problems.extend(
                    f"extra_evals={value!r}: {name!r} must map to an object of sampling settings"
                    for name, inner in value.items()
                    if not isinstance(inner, dict)
                )
    return problems


def _lora_problems(lora: Mapping[str, Any]) -> List[Tuple[str, str]]:
    out = []
    for field, spec in _LORA_FIELDS.items():
        if field in lora:
            wrong = spec.problem(lora[field])
            if wrong:
                out.append((field, f"{lora[field]!r}: {wrong}"))
    if (
        isinstance(lora.get("lora_dropout"), (int, float))
        and not isinstance(lora["lora_dropout"], bool)
        and lora["lora_dropout"] >= 1
    ):
        out.append(("lora_dropout", f"{lora['lora_dropout']!r}: expected a fraction below 1"))
    target = lora.get("target_modules")
    if (
        "target_modules" in lora
        and target is not None
        and not isinstance(target, str)
        and not (isinstance(target, list) and all(isinstance(t, str) for t in target))
    ):
        out.append(("target_modules", f'{target!r}: expected a module name, a list of names, or "all-linear"'))
    return out


def _check_sampling_keys(name: str, values: Mapping[str, Any]) -> None:
    """Sampling settings agl's policy server cannot apply (e.g. vLLM's ``min_p``) fail here, not as a 400 on
    every rollout once the model is loaded. (The server's list comes with it: torch, only when there are
    settings to check.)"""
    if not values:
        return
    from agl.serving.openai_api import REQUEST_SETTINGS

    unknown = sorted(set(values) - REQUEST_SETTINGS)
    if unknown:
        raise ValueError(
            f"{name} has {', '.join(map(repr, unknown))}, which agl's policy server does not support; it "
            f"takes {', '.join(sorted(REQUEST_SETTINGS))}"
        )


def _temperature_advice(wanted: Any) -> str:
    """Where a temperature put in ``sampling`` belongs: TorchGRPO's own ``temperature``, unless it is greedy
    (0), which training refuses and only evaluations take."""
    if isinstance(wanted, (int, float)) and wanted <= 0:
        return (
            "Training samples at a temperature > 0 (greedy rollouts of a group are all alike: nothing to learn); "
            "for greedy evaluation leave temperature out of sampling and set val_sampling={'temperature': 0.0} "
            "or extra_evals={'greedy': {'temperature': 0.0}} (agl train: --set 'extra_evals={\"greedy\": "
            '{"temperature": 0}}\')'
        )
    return (
        f"Set the training temperature with temperature={wanted!r} (agl train: --temperature {wanted!r}) and leave "
        "it out of sampling; val_sampling and extra_evals may set their own"
    )


def _plain_error(exc: ValidationError) -> Exception:
    """The first error of a validation: the exception a check raised, or a ValueError naming the setting."""
    first = exc.errors()[0]
    raised = first.get("ctx", {}).get("error")
    if isinstance(raised, Exception):
        return raised
    where = ".".join(str(part) for part in first["loc"])
    return ValueError(f"{where}={first['input']!r}: {first['msg']}")
