"""Every config group composes into a validated Config; bad values name their key."""

import pytest

from conftest import compose_config
from rnnlab import config as cfg

GROUPS = {
    "model": ["rnn"],
    "data": ["adding", "copy"],
    "optimizer": ["adam", "adamw", "sgd"],
    "device": ["auto", "cpu", "gpu", "tpu"],
}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group, option):
    config = compose_config([f"{group}={option}"])
    section = getattr(config, group)
    chosen = {"model": "cell", "data": "task", "optimizer": "name", "device": "platform"}[group]
    assert getattr(section, chosen) == option


def test_top_level_sizes_reach_the_model_by_interpolation():
    config = compose_config(["model=rnn", "hidden_dim=100", "num_layers=3"])
    assert (config.model.hidden_dim, config.model.num_layers) == (100, 3)


def test_adamw_inherits_adam_keys_and_decays():
    config = compose_config(["optimizer=adamw"])
    assert config.optimizer.weight_decay > 0 and config.optimizer.b2 == 0.999


@pytest.mark.parametrize(
    "override,key,hint",
    [
        ("hidden_dim=0", "hidden_dim", "> 0"),
        ("steps=-5", "steps", "> 0"),
        ("batch_size=abc", "batch_size", "integer"),
        ("model.cell=transformer", "model.cell", "rnn"),
        ("model.init=xavier", "model.init", "orthogonal"),
        ("data.task=parity", "data.task", "adding, copy"),
        ("data.seq_len=1", "data.seq_len", ">= 2"),
        ("optimizer.lr=-0.1", "optimizer.lr", "> 0"),
        ("optimizer.name=rmsprop", "optimizer.name", "adam, adamw, sgd"),
        ("optimizer.schedule=step", "optimizer.schedule", "cosine"),
        ("device.num_devices=0", "device.num_devices", "> 0"),
        ("device.platform=ipu", "device.platform", "auto, cpu, gpu, tpu"),
        ("device.steps_per_dispatch=9", "device.steps_per_dispatch", "null or 1 .. 8"),
        ("device.steps_per_dispatch=0", "device.steps_per_dispatch", "null or 1 .. 8"),
        ("checkpoint.keep=0", "checkpoint.keep", "> 0"),
        ("+model.depth=3", "model.depth", "allowed in model"),
        ("model.recurrence=manual", "model.recurrence", "autodiff, custom_vjp"),
        ("model.recurrence=custom_vjp model.remat=true", "model.remat", "model.recurrence=autodiff"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, key, hint):
    with pytest.raises(cfg.ConfigError) as info:
        compose_config(override.split())
    message = str(info.value)
    assert f"'{key}'" in message and hint in message and "\n" not in message


def test_missing_key_is_named():
    values = cfg.to_dict(compose_config())
    del values["model"]["init"]
    with pytest.raises(cfg.ConfigError, match="missing key 'model.init'"):
        cfg.from_dict(values)


def test_config_is_frozen_and_replace_validates():
    config = compose_config()
    with pytest.raises(Exception):
        config.steps = 3
    assert cfg.replace(config, **{"model.init": "identity"}).model.init == "identity"
    with pytest.raises(cfg.ConfigError, match="model.init"):
        cfg.replace(config, **{"model.init": "nope"})
