"""``agl.VERL``'s config: the seeds' keys merged onto the installed verl's ppo_trainer defaults, validated."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict

import pytest

import agl
from agl.algorithm.verl.config import AGL_DEFAULTS, VERLConfig, VERLConfigError

# The configuration of the seed article, with a small model.
SEED: Dict[str, Any] = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 32, "max_prompt_length": 4096, "max_response_length": 2048},
    "actor_rollout_ref": {
        "rollout": {"name": "vllm", "n": 4, "multi_turn": {"format": "hermes"}},
        "actor": {"ppo_mini_batch_size": 32, "optim": {"lr": 1e-6}},
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
    },
    "trainer": {"n_gpus_per_node": 1, "val_before_train": True, "test_freq": 32, "save_freq": 64, "total_epochs": 2},
}
SEED_OVERRIDES = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=false",
    "data.train_batch_size=32",
    "data.max_prompt_length=4096",
    "data.max_response_length=2048",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.multi_turn.format=hermes",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "trainer.n_gpus_per_node=1",
    "trainer.val_before_train=true",
    "trainer.test_freq=32",
    "trainer.save_freq=64",
    "trainer.total_epochs=2",
]


@pytest.fixture(scope="module")
def seed_config() -> VERLConfig:
    return VERLConfig(SEED)


def with_change(change: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    config = copy.deepcopy(SEED)
    change(config)
    return config


def test_seed_dict_lands_on_verls_defaults(seed_config: VERLConfig) -> None:
    c = seed_config
    assert (c.train_batch_size, c.n, c.ppo_mini_batch_size) == (32, 4, 32)
    assert (c.max_prompt_length, c.max_response_length) == (4096, 2048)
    assert c.adv_estimator == "grpo" and c.rollout_name == "vllm" and c.model_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert c.get("actor_rollout_ref.actor.optim.lr") == 1e-6
    assert c.get("trainer.test_freq") == 32 and c.get("trainer.save_freq") == 64 and c.total_epochs == 2
    assert c.get("actor_rollout_ref.rollout.multi_turn.format") == "hermes"
    # verl's own interpolations follow the user's values
    assert c.get("actor_rollout_ref.rollout.prompt_length") == 4096
    assert c.get("actor_rollout_ref.rollout.response_length") == 2048
    # a default nobody set comes from verl's yaml
    assert c.get("algorithm.norm_adv_by_std_in_grpo") is True
    for path, value in AGL_DEFAULTS.items():
        assert c.get(path) == value


def test_override_strings_give_the_same_config(seed_config: VERLConfig) -> None:
    assert VERLConfig(SEED_OVERRIDES).to_dict() == seed_config.to_dict()


def test_overrides_apply_after_the_dict() -> None:
    c = VERLConfig(SEED, overrides=["data.train_batch_size=64", "actor_rollout_ref.rollout.n=8"])
    assert (c.train_batch_size, c.n) == (64, 8)


def test_user_values_win_over_agl_defaults() -> None:
    c = VERLConfig(SEED, ["trainer.logger=[console,wandb]", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert list(c.get("trainer.logger")) == ["console", "wandb"]
    assert c.get("actor_rollout_ref.rollout.tensor_model_parallel_size") == 2


def test_agl_VERL_accepts_the_seed_dict_and_exposes_it() -> None:
    algorithm = agl.VERL(SEED)
    assert algorithm.config.train_batch_size == 32 and algorithm.advantages == "lightningrl"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda c: c["data"].update(train_batch_sise=32),
            "unknown verl config key 'data.train_batch_sise'; did you mean data.train_batch_size",
        ),
        (
            lambda c: c["actor_rollout_ref"]["actor"].update(ppo_mini_batchsize=8),
            "did you mean actor_rollout_ref.actor.ppo_mini_batch_size",
        ),
        (lambda c: c.update(trainr={"total_epochs": 1}), "unknown verl config key 'trainr.total_epochs'"),
        (lambda c: c["data"].update(train_batch_size="32"), "data.train_batch_size must be an integer"),
        (lambda c: c["data"].update(train_batch_size=32.0), "data.train_batch_size must be an integer"),
        (lambda c: c["trainer"].update(val_before_train=1), "trainer.val_before_train must be true or false"),
        (lambda c: c["actor_rollout_ref"]["actor"]["optim"].update(lr="fast"), "optim.lr must be a number"),
        (lambda c: c["actor_rollout_ref"].update(rollout=4), "actor_rollout_ref.rollout is a section"),
        (lambda c: c["data"].update(train_batch_size=48), r"make data.train_batch_size \(48\) a multiple of"),
        (lambda c: c["actor_rollout_ref"]["actor"].update(ppo_mini_batch_size=64), "larger than data.train_batch_size"),
        (lambda c: c["actor_rollout_ref"]["rollout"].update(n=1), "set actor_rollout_ref.rollout.n to 2 or more"),
        (lambda c: c["trainer"].update(n_gpus_per_node=3), "does not split over 3 GPUs"),
        (lambda c: c["data"].update(max_response_length=0), "data.max_response_length must be a positive integer"),
        (lambda c: c["actor_rollout_ref"]["actor"]["optim"].update(lr=0.0), "optim.lr must be a positive number"),
        (lambda c: c["algorithm"].update(adv_estimator="grp0"), "did you mean 'grpo'"),
        (lambda c: c["algorithm"].update(adv_estimator="gae"), "trains without a critic"),
        (lambda c: c["actor_rollout_ref"].pop("model"), "set actor_rollout_ref.model.path"),
        (lambda c: c["actor_rollout_ref"]["rollout"].pop("name"), "set actor_rollout_ref.rollout.name"),
        # verl's own validate_config: both the deprecated and the new micro batch key
        (
            lambda c: c["actor_rollout_ref"]["rollout"].update(
                log_prob_micro_batch_size=8, log_prob_micro_batch_size_per_gpu=4
            ),
            "verl rejected the config: .*log_prob_micro_batch_size",
        ),
    ],
)
def test_bad_configs_are_refused_with_the_key_and_the_fix(
    change: Callable[[Dict[str, Any]], None], message: str
) -> None:
    with pytest.raises(VERLConfigError, match=message):
        VERLConfig(with_change(change))


def test_bad_override_syntax_is_explained() -> None:
    with pytest.raises(VERLConfigError, match="cannot parse verl override 'data.train_batch_size'"):
        VERLConfig(SEED, overrides=["data.train_batch_size"])


def test_new_keys_only_in_free_form_sections_or_with_plus() -> None:
    c = VERLConfig(
        with_change(
            lambda d: d["actor_rollout_ref"]["rollout"].update(engine_kwargs={"vllm": {"tool_call_parser": "hermes"}})
        ),
        overrides=["+trainer.agl_note=hello"],
    )
    assert c.get("actor_rollout_ref.rollout.engine_kwargs.vllm.tool_call_parser") == "hermes"
    assert c.get("trainer.agl_note") == "hello"


def test_keys_agls_loop_does_not_use_are_warned_about_one_line_each(caplog) -> None:
    overrides = [
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.rollout_is=token",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.top_k=20",  # used: filled into requests by the proxy
    ]
    with caplog.at_level("WARNING", logger="agl.verl"):
        VERLConfig(SEED, overrides)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("\n" not in line and "agl's VERL loop does not use it" in line for line in lines)
    assert [line.split("=")[0] for line in lines] == [
        "actor_rollout_ref.rollout.val_kwargs.n",
        "algorithm.rollout_correction.bypass_mode",
        "algorithm.rollout_correction.rollout_is",
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="agl.verl"):
        VERLConfig(SEED)
    assert caplog.records == []


def test_deprecated_micro_batch_key_replaces_agls_per_gpu_default() -> None:
    c = VERLConfig(SEED, ["actor_rollout_ref.actor.ppo_micro_batch_size=8"])
    assert c.get("actor_rollout_ref.actor.ppo_micro_batch_size") == 8
    assert c.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") is None


def test_loop_options_are_checked() -> None:
    with pytest.raises(VERLConfigError, match="not a LightningRL estimator"):
        agl.VERL(with_change(lambda c: c["algorithm"].update(adv_estimator="reinforce_plus_plus")))
    assert agl.VERL(
        with_change(lambda c: c["algorithm"].update(adv_estimator="reinforce_plus_plus")), advantages="verl"
    )
    with pytest.raises(VERLConfigError, match="async_groups"):
        agl.VERL(SEED, async_groups=-1)


def test_vllm_on_a_cpu_machine_is_refused_when_training_starts(seed_config: VERLConfig) -> None:
    with pytest.raises(VERLConfigError, match="rollout.name=vllm cannot run here: .*CUDA GPU"):
        seed_config.check_runtime()


def test_the_agl_rollout_engine_runs_on_a_cpu_machine_and_others_are_refused() -> None:
    def engine(name: str, **trainer: Any) -> VERLConfig:
        return VERLConfig(
            with_change(lambda c: (c["actor_rollout_ref"]["rollout"].update(name=name), c["trainer"].update(trainer)))
        )

    engine("agl").check_runtime()  # agl's policy server, verl's actor on the CPU
    with pytest.raises(VERLConfigError, match="trainer.nnodes must be 1 on a machine without GPUs"):
        engine("agl", nnodes=2).check_runtime()
    with pytest.raises(VERLConfigError, match="rollout.name='sglang' is not an engine .*use vllm or agl"):
        engine("sglang").check_runtime()
