"""The verl configuration of ``agl.VERL``: the user's keys merged onto verl's own ``ppo_trainer`` defaults.

Users write the same keys as ``python -m verl.trainer.main_ppo`` takes, either as a nested dict (the Agent
Lightning form) or as Hydra-style override strings (``"data.train_batch_size=32"``). The defaults are the
``ppo_trainer.yaml`` that the installed verl ships, composed with Hydra exactly as verl composes it, so
a key verl does not know is refused here with a did-you-mean instead of failing an hour into a GPU job.

Checks, in order (each failure is a :class:`VERLConfigError` naming the key and what to do):

1. every key exists in verl's defaults (new keys only below free-form sections such as
   ``engine_kwargs.vllm`` or with Hydra's ``+key=value``);
2. every value has the type of verl's default (a bool stays a bool, an int an int, a section a section);
3. agl's own rules: required keys, positive sizes, batch sizes that divide, GRPO groups of 2 or more;
4. verl's own ``validate_config`` (micro batch sizes, LoRA ranks...), its errors re-raised with the key.

A valid key that verl's trainer reads but agl's loop does not (:data:`IGNORED_KEYS`, e.g.
``algorithm.rollout_correction.*``) is accepted with a warning naming it.

:meth:`VERLConfig.check_runtime` is separate: whether *this machine* can run the config (a vLLM rollout
needs CUDA GPUs and the ``vllm`` package), checked when training starts, not when the config is built.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import math
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

logger = logging.getLogger("agl.verl")

ConfigInput = Union[Mapping[str, Any], Sequence[str], None]

# Values agl sets unless the user set them. verl's defaults target an 8-GPU GSM8K run (tensor parallel 2,
# W&B logging) and leave the micro batch sizes unset, which verl then rejects; these make the seeds'
# minimal config (one GPU, no W&B account) run as written.
AGL_DEFAULTS: Dict[str, Any] = {
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
    "trainer.logger": ["console"],
    "trainer.project_name": "agl",
    "trainer.experiment_name": "verl",
}

# Keys a run cannot do without; verl's defaults hold placeholders for them.
REQUIRED_KEYS = ("actor_rollout_ref.model.path", "actor_rollout_ref.rollout.name")
_PLACEHOLDER_MODEL = "~/models/deepseek-llm-7b-chat"
# Hydra config-group choices at the top of ppo_trainer.yaml's defaults list: they pick files to compose,
# so they go to Hydra's compose() instead of being set on the composed config.
_GROUP_CHOICES = ("model_engine",)
_POSITIVE_INTS = (
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "trainer.total_epochs",
)
# verl keys its own trainer reads but agl's loop (which drives the steps itself) does not; a user who sets
# one is warned when the config is built, instead of getting a run that silently differs from verl's.
IGNORED_KEYS: Dict[str, str] = {
    "algorithm.rollout_correction": "no rollout correction (importance weights, rejection, bypass_mode) is applied",
    "actor_rollout_ref.rollout.val_kwargs.n": "validation runs each task of val_dataset once",
    "data.train_files": "the tasks are fit()'s train_dataset",
    "data.val_files": "the validation tasks are fit()'s val_dataset",
    "trainer.resume_mode": "a run starts from actor_rollout_ref.model.path, not from a verl checkpoint",
    "trainer.resume_from_path": "a run starts from actor_rollout_ref.model.path, not from a verl checkpoint",
    "trainer.val_only": "fit() trains; run validation alone with agl.Trainer(...).dev or run_tasks",
    "trainer.rollout_data_dir": "the rollouts and their spans are in agl's store",
    "trainer.validation_data_dir": "the validation rollouts and their spans are in agl's store",
    "trainer.log_val_generations": "the validation rollouts and their spans are in agl's store",
}
_GROUP_ESTIMATORS = ("grpo", "rloo", "grpo_passk", "grpo_vectorized", "rloo_vectorized", "opo", "gdpo")


#: The rollout engines agl's VERL loop serves the policy with (``actor_rollout_ref.rollout.name``).
ROLLOUT_ENGINES = ("vllm", "agl")


def _cuda_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class VERLConfigError(ValueError):
    """The verl configuration is invalid; the message names the key and the fix."""


class VERLNotInstalledError(ImportError):
    def __init__(self) -> None:
        super().__init__(
            "agl.VERL needs the verl package: pip install -c constraints.txt 'agl[verl]' (CPU: constraints.txt "
            "pins torch==2.13.0; GPU: see docs/verl.md for the vLLM install)"
        )


def verl_config_dir() -> str:
    """The folder of verl's Hydra configs, found without importing verl (which loads torch and ray)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise VERLNotInstalledError()
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")


# ---------------------------------------------------------------------------------------------------------
# Reading the user's input
# ---------------------------------------------------------------------------------------------------------


class _Setting:
    """One key the user set: its dotted path, value, and whether Hydra's ``+`` allowed it to be new."""

    __slots__ = ("path", "value", "add")

    def __init__(self, path: str, value: Any, add: bool = False) -> None:
        self.path, self.value, self.add = path, value, add


def _flatten(config: Mapping[str, Any], prefix: str = "") -> List[_Setting]:
    """Nested dicts to dotted paths; a key may itself be dotted (``{"data.train_batch_size": 32}``)."""
    out: List[_Setting] = []
    for key, value in config.items():
        if not isinstance(key, str) or not key:
            raise VERLConfigError(
                f"verl config keys must be non-empty strings, got {key!r} under {prefix or 'the top'}"
            )
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.extend(_flatten(value, path + "."))
        else:
            out.append(_Setting(path, dict(value) if isinstance(value, Mapping) else value))
    return out


def _parse_overrides(overrides: Iterable[str]) -> List[_Setting]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    out: List[_Setting] = []
    for text in overrides:
        if not isinstance(text, str):
            raise VERLConfigError(f"verl overrides must be strings like 'data.train_batch_size=32', got {text!r}")
        try:
            (override,) = parser.parse_overrides([text])
        except OverrideParseException as exc:
            raise VERLConfigError(f"cannot parse verl override {text!r}: {exc}. Write it as key.path=value") from None
        if override.is_delete():
            raise VERLConfigError(f"deleting keys ({text!r}) is not supported: set the value instead")
        out.append(_Setting(override.key_or_group, override.value(), add=override.is_add() or override.is_force_add()))
    return out


def _settings(config: ConfigInput, overrides: Sequence[str]) -> List[_Setting]:
    if config is None:
        settings: List[_Setting] = []
    elif isinstance(config, Mapping):
        settings = _flatten(config)
    elif isinstance(config, (list, tuple)):
        settings = _parse_overrides(config)
    else:
        raise VERLConfigError(
            f"agl.VERL takes a dict of verl keys or a list of 'key=value' overrides, got {type(config).__name__}"
        )
    return settings + _parse_overrides(overrides)


# ---------------------------------------------------------------------------------------------------------
# Merging onto verl's defaults
# ---------------------------------------------------------------------------------------------------------

_MISSING = object()


def _node(cfg: Any, path: str) -> Any:
    from omegaconf import OmegaConf

    parent_path, _, key = path.rpartition(".")
    parent = OmegaConf.select(cfg, parent_path, default=_MISSING) if parent_path else cfg
    if parent is _MISSING or not OmegaConf.is_dict(parent):
        return _MISSING
    # Not `key in parent`, which is False for verl's mandatory "???" values.
    node = parent._get_node(key, validate_access=False)
    return _MISSING if node is None else node


def _did_you_mean(cfg: Any, path: str) -> str:
    """The closest existing keys: first among the siblings, then among all full paths."""
    from omegaconf import OmegaConf

    parent_path, _, key = path.rpartition(".")
    parent = OmegaConf.select(cfg, parent_path, default=None) if parent_path else cfg
    if OmegaConf.is_dict(parent):
        close = difflib.get_close_matches(key, [str(k) for k in parent.keys()], n=3, cutoff=0.6)
        if close:
            return ", ".join(f"{parent_path + '.' if parent_path else ''}{k}" for k in close)
    close = difflib.get_close_matches(path, _all_paths(cfg), n=3, cutoff=0.75)
    return ", ".join(close)


def _all_paths(cfg: Any, prefix: str = "") -> List[str]:
    from omegaconf import OmegaConf

    out = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        out.append(path)
        child = cfg._get_node(key)
        if OmegaConf.is_dict(child):
            out.extend(_all_paths(child, path + "."))
    return out


def _is_free_form(cfg: Any, path: str) -> bool:
    """A section verl leaves open for arbitrary keys: its default is an empty dict (``engine_kwargs.vllm: {}``)."""
    from omegaconf import OmegaConf

    parent_path = path.rpartition(".")[0]
    while parent_path:
        parent = OmegaConf.select(cfg, parent_path, default=_MISSING)
        if parent is not _MISSING and parent is not None:
            return OmegaConf.is_dict(parent) and len(parent) == 0
        parent_path = parent_path.rpartition(".")[0]
    return False


def _check_type(cfg: Any, setting: _Setting) -> None:
    """The value must have the type of verl's default (which stays unchecked where the default is unset)."""
    from omegaconf import OmegaConf

    node = _node(cfg, setting.path)
    if node is _MISSING:
        return
    value = setting.value
    if OmegaConf.is_dict(node):
        if value is not None and not isinstance(value, Mapping):
            raise VERLConfigError(f"{setting.path} is a section of verl's config, not a value: got {value!r}")
        return
    if node._is_missing() or node._is_interpolation():
        return
    default = node._value()
    if default is None or value is None:
        return
    expected: Tuple[type, ...]
    if isinstance(default, bool):
        expected, name = (bool,), "true or false"
    elif isinstance(default, int):
        expected, name = (int,), "an integer"
    elif isinstance(default, float):
        expected, name = (int, float), "a number"
    elif isinstance(default, str):
        expected, name = (str,), "a string"
    elif OmegaConf.is_list(node) or isinstance(default, list):
        expected, name = (list, tuple), "a list"
    else:
        return
    # A bool is an int to Python, not to verl; a float for an int key (32.0) is refused too.
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
        raise VERLConfigError(
            f"{setting.path} must be {name} (verl's default is {default!r}), got {value!r} ({type(value).__name__})"
        )


def _compose(group_choices: List[str]) -> Any:
    """verl's defaults for these group choices: composed once per process (Hydra takes a good fraction of a
    second), then copied for each config."""
    import copy

    key = tuple(group_choices)
    if key not in _COMPOSED:
        _COMPOSED[key] = _compose_with_hydra(group_choices)
    return copy.deepcopy(_COMPOSED[key])


_COMPOSED: Dict[Tuple[str, ...], Any] = {}


def _compose_with_hydra(group_choices: List[str]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = verl_config_dir()
    # compose() needs Hydra's global state; keep any the user's own program holds.
    previous = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    if previous is not None:
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose("ppo_trainer", overrides=group_choices)
    finally:
        if previous is not None:
            GlobalHydra.instance().initialize(previous)


def build_verl_config(config: ConfigInput = None, overrides: Sequence[str] = ()) -> Any:
    """verl's ``ppo_trainer`` DictConfig with agl's defaults and the user's keys applied, type-checked."""
    verl_config_dir()  # first: without the verl extra (omegaconf comes with it) say how to install it
    from omegaconf import OmegaConf, open_dict

    settings = _settings(config, overrides)
    choices = [f"{s.path}={s.value}" for s in settings if s.path in _GROUP_CHOICES]
    cfg = _compose(choices)
    user_paths = set()
    for setting in settings:
        if setting.path in _GROUP_CHOICES:
            continue
        if _node(cfg, setting.path) is _MISSING and not (setting.add or _is_free_form(cfg, setting.path)):
            hint = _did_you_mean(cfg, setting.path)
            raise VERLConfigError(
                f"unknown verl config key {setting.path!r}"
                + (f"; did you mean {hint}?" if hint else "")
                + " (to add a key verl does not define, write it as '+key=value')"
            )
        _check_type(cfg, setting)
        user_paths.add(setting.path)
    for path, value in AGL_DEFAULTS.items():
        # A user who set the deprecated ``..._micro_batch_size`` gets no ``..._per_gpu`` next to it (verl
        # refuses both at once).
        if path not in user_paths and path.removesuffix("_per_gpu") not in user_paths:
            OmegaConf.update(cfg, path, value, merge=False)
    with open_dict(cfg):
        for setting in settings:
            if setting.path not in _GROUP_CHOICES:
                OmegaConf.update(cfg, setting.path, setting.value, merge=True, force_add=True)
    return cfg, user_paths


# ---------------------------------------------------------------------------------------------------------
# The validated config
# ---------------------------------------------------------------------------------------------------------


class VERLConfig:
    """A validated verl config plus the few values agl's loop reads (batch sizes, lengths, estimator)."""

    def __init__(self, config: ConfigInput = None, overrides: Sequence[str] = (), *, verl_checks: bool = True) -> None:
        self.dictconfig, self.user_keys = build_verl_config(config, overrides)
        self._check_agl_rules()
        if verl_checks:
            self._check_with_verl()
        self._warn_ignored()

    # -- values agl reads ----------------------------------------------------------------------------------
    def get(self, path: str, default: Any = None) -> Any:
        from omegaconf import OmegaConf

        return OmegaConf.select(self.dictconfig, path, default=default)

    @property
    def train_batch_size(self) -> int:
        return int(self.get("data.train_batch_size"))

    @property
    def n(self) -> int:
        return int(self.get("actor_rollout_ref.rollout.n"))

    @property
    def max_prompt_length(self) -> int:
        return int(self.get("data.max_prompt_length"))

    @property
    def max_response_length(self) -> int:
        return int(self.get("data.max_response_length"))

    @property
    def ppo_mini_batch_size(self) -> int:
        return int(self.get("actor_rollout_ref.actor.ppo_mini_batch_size"))

    @property
    def micro_batch_rows(self) -> Tuple[int, int]:
        """Rows per GPU in one micro batch of the actor update and of the log-prob passes (1 with dynamic batch
        sizes): verl's workers cut each rank's share into micro batches of exactly that many rows."""
        actor, rollout, ref = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
        update = 1 if self.get(f"{actor}.use_dynamic_bsz") else int(self.get(f"{actor}.ppo_micro_batch_size_per_gpu"))
        infer = (
            1
            if self.get(f"{rollout}.log_prob_use_dynamic_bsz")
            else int(self.get(f"{rollout}.log_prob_micro_batch_size_per_gpu"))
        )
        if (self.get(f"{actor}.use_kl_loss") or self.get("algorithm.use_kl_in_reward")) and not self.get(
            f"{ref}.log_prob_use_dynamic_bsz"
        ):
            infer = math.lcm(infer, int(self.get(f"{ref}.log_prob_micro_batch_size_per_gpu")))
        return update, infer

    @property
    def adv_estimator(self) -> str:
        return str(self.get("algorithm.adv_estimator"))

    @property
    def n_gpus(self) -> int:
        return int(self.get("trainer.n_gpus_per_node")) * int(self.get("trainer.nnodes"))

    @property
    def total_epochs(self) -> int:
        return int(self.get("trainer.total_epochs"))

    @property
    def total_training_steps(self) -> Optional[int]:
        """``trainer.total_training_steps``: when set, the step count instead of the epochs' (as in verl)."""
        value = self.get("trainer.total_training_steps")
        return None if value is None else int(value)

    @property
    def model_path(self) -> str:
        return str(self.get("actor_rollout_ref.model.path"))

    @property
    def rollout_name(self) -> str:
        return str(self.get("actor_rollout_ref.rollout.name"))

    def to_dict(self, resolve: bool = True) -> Dict[str, Any]:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(self.dictconfig, resolve=resolve)

    # -- checks --------------------------------------------------------------------------------------------
    def _check_agl_rules(self) -> None:
        from omegaconf import OmegaConf

        for path in REQUIRED_KEYS:
            value = OmegaConf.select(self.dictconfig, path, default=None, throw_on_missing=False)
            if value in (None, "???", _PLACEHOLDER_MODEL) or path not in self.user_keys:
                example = "Qwen/Qwen2.5-0.5B-Instruct" if path.endswith("model.path") else "vllm"
                raise VERLConfigError(f"set {path} (e.g. {path}={example}): verl's default is only a placeholder")
        for path in _POSITIVE_INTS:
            value = self.get(path)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise VERLConfigError(f"{path} must be a positive integer, got {value!r}")
        steps = self.get("trainer.total_training_steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise VERLConfigError(f"trainer.total_training_steps must be a positive integer or null, got {steps!r}")
        lr = self.get("actor_rollout_ref.actor.optim.lr")
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0:
            raise VERLConfigError(f"actor_rollout_ref.actor.optim.lr must be a positive number, got {lr!r}")
        batch, mini, n = self.train_batch_size, self.ppo_mini_batch_size, self.n
        if mini > batch:
            raise VERLConfigError(
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini}) is larger than data.train_batch_size "
                f"({batch}): both count tasks (verl multiplies each by rollout.n={n}); lower the mini batch size"
            )
        if batch % mini:
            raise VERLConfigError(
                f"data.train_batch_size * rollout.n = {batch * n} samples do not split into mini batches of "
                f"ppo_mini_batch_size * rollout.n = {mini * n}: make data.train_batch_size ({batch}) a multiple of "
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini})"
            )
        if (mini * n) % self.n_gpus:
            raise VERLConfigError(
                f"a mini batch of ppo_mini_batch_size * rollout.n = {mini * n} samples does not split over "
                f"{self.n_gpus} GPUs (trainer.n_gpus_per_node * trainer.nnodes); make it a multiple"
            )
        if self.adv_estimator in _GROUP_ESTIMATORS and n < 2:
            raise VERLConfigError(
                f"algorithm.adv_estimator={self.adv_estimator} compares the rollouts of a task with each other: "
                f"set actor_rollout_ref.rollout.n to 2 or more (got {n})"
            )
        if self.adv_estimator == "gae" or self.get("critic.enable"):
            raise VERLConfigError(
                "agl's VERL loop trains without a critic: use algorithm.adv_estimator=grpo (or rloo, "
                "reinforce_plus_plus...) and leave critic.enable unset"
            )

    def _warn_ignored(self) -> None:
        """One warning per key the user set that verl would use but agl's loop does not (:data:`IGNORED_KEYS`)."""
        for path in sorted(self.user_keys):
            prefix = next((k for k in IGNORED_KEYS if path == k or path.startswith(k + ".")), None)
            if prefix is not None:
                logger.warning(
                    "%s=%r is set, but agl's VERL loop does not use it: %s", path, self.get(path), IGNORED_KEYS[prefix]
                )

    def _check_with_verl(self) -> None:
        """verl's own validation (imports verl: seconds), with its errors turned into ours."""
        try:
            from verl.trainer.ppo.core_algos import AdvantageEstimator
            from verl.trainer.ppo.utils import need_critic, need_reference_policy
            from verl.utils.config import validate_config
        except ImportError as exc:
            raise VERLNotInstalledError() from exc
        known = [e.value for e in AdvantageEstimator]
        if self.adv_estimator not in known:
            close = difflib.get_close_matches(self.adv_estimator, known, n=1)
            raise VERLConfigError(
                f"unknown algorithm.adv_estimator {self.adv_estimator!r}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + f" (verl knows: {', '.join(known)})"
            )
        import contextlib
        import io
        import warnings

        cfg = self.dictconfig
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")  # "Disabled critic as adv_estimator != gae": expected here
                validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        except Exception as exc:  # verl raises asserts, ValueErrors and Hydra's wrappers of them
            cause = exc.__cause__ or exc  # Hydra's InstantiationException wraps the dataclass's own error
            raise VERLConfigError(f"verl rejected the config: {cause}") from exc

    def check_runtime(self) -> None:
        """Whether this machine can run the config; raises with what is missing (called when training starts).

        ``rollout.name=vllm`` needs CUDA GPUs and the vllm package; ``rollout.name=agl`` (agl's policy server)
        runs on CUDA GPUs or, without any, on the CPU with one machine's worth of workers."""
        if self.rollout_name not in ROLLOUT_ENGINES:
            raise VERLConfigError(
                f"actor_rollout_ref.rollout.name={self.rollout_name!r} is not an engine agl's VERL loop serves with: "
                f"use {' or '.join(ROLLOUT_ENGINES)} (vllm on GPUs; agl: agl's policy server, on a CPU or a small GPU)"
            )
        wanted = int(self.get("trainer.n_gpus_per_node"))
        gpus = _cuda_gpus()
        missing = []
        if self.rollout_name == "vllm" and importlib.util.find_spec("vllm") is None:
            missing.append("the vllm package is not installed (see docs/verl.md: vLLM brings its own torch)")
        if self.rollout_name == "vllm" or gpus:
            if gpus < wanted:
                missing.append(f"trainer.n_gpus_per_node={wanted} but this machine has {gpus} CUDA GPU(s)")
        elif int(self.get("trainer.nnodes")) != 1:
            missing.append("trainer.nnodes must be 1 on a machine without GPUs (the CPU workers run on this one)")
        if missing:
            hint = (
                "Training with vLLM needs CUDA GPUs; on a CPU machine set actor_rollout_ref.rollout.name=agl."
                if self.rollout_name == "vllm"
                else "Lower trainer.n_gpus_per_node or run on a machine with more GPUs."
            )
            raise VERLConfigError(
                f"actor_rollout_ref.rollout.name={self.rollout_name} cannot run here: "
                + "; ".join(missing)
                + ". "
                + hint
            )

    def __repr__(self) -> str:
        return (
            f"VERLConfig(model={self.model_path!r}, adv_estimator={self.adv_estimator!r}, "
            f"train_batch_size={self.train_batch_size}, n={self.n}, ppo_mini_batch_size={self.ppo_mini_batch_size}, "
            f"lengths=({self.max_prompt_length}, {self.max_response_length}), n_gpus={self.n_gpus})"
        )


def as_verl_config(config: Union[VERLConfig, ConfigInput], overrides: Sequence[str] = ()) -> VERLConfig:
    if isinstance(config, VERLConfig):
        if overrides:
            raise VERLConfigError("pass overrides when building the VERLConfig, not with an existing one")
        return config
    return VERLConfig(config, overrides)


__all__ = [
    "AGL_DEFAULTS",
    "IGNORED_KEYS",
    "VERLConfig",
    "VERLConfigError",
    "VERLNotInstalledError",
    "build_verl_config",
]
