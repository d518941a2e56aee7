"""Every config group composes into a validated Config; bad values name their key."""

import pytest

from conftest import ROOT, compose_config
from rnnlab import cells, tasks
from rnnlab import config as cfg

GROUPS = {
    "model": sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")),
    "data": sorted(p.stem for p in (ROOT / "conf" / "data").glob("*.yaml")),
    "optimizer": ["adam", "adamw", "sgd"],
    "device": ["auto", "cpu", "gpu", "tpu"],
}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group, option):
    config = compose_config([f"{group}={option}"])
    section = getattr(config, group)
    chosen = {"model": "cell", "data": "task", "optimizer": "name", "device": "platform"}[group]
    assert getattr(section, chosen) == option


def test_every_cell_and_task_of_the_package_has_its_config_file():
    assert [n for n, c in cells.CELLS.items() if c.__module__.startswith("rnnlab.")] and \
        {n for n, c in cells.CELLS.items() if c.__module__.startswith("rnnlab.")} <= set(GROUPS["model"])
    assert {n for n, t in tasks.TASKS.items() if t.__module__.startswith("rnnlab.")} <= set(GROUPS["data"])


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
        ("data.task=sorting", "data.task", "adding, copy"),
        ("data.seq_len=1", "data.seq_len", ">= 2"),
        ("optimizer.lr=-0.1", "optimizer.lr", "> 0"),
        ("optimizer.name=rmsprop", "optimizer.name", "adam, adamw, sgd"),
        ("optimizer.schedule=step", "optimizer.schedule", "cosine"),
        ("device.num_devices=0", "device.num_devices", "1 .. 64"),
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


@pytest.mark.parametrize("key", ["hidden_dim", "num_layers"])
def test_the_model_width_and_depth_have_one_source(key):
    """`model.hidden_dim=128` would train a 128-unit model while `hidden_dim` (and HParams) said 64: refused."""
    with pytest.raises(cfg.ConfigError, match=f"key 'model.{key}': got 3, but the top-level {key} is .*; set the top-level key instead \\({key}=3\\)"):
        compose_config([f"model.{key}=3"])
    assert getattr(compose_config([f"{key}=3"]).model, key) == 3


def test_imports_names_a_module_or_fails_naming_the_key():
    with pytest.raises(cfg.ConfigError, match="key 'imports': cannot import 'no_such_module_here' \\(ModuleNotFoundError"):
        compose_config(["imports=[no_such_module_here]"])
    assert compose_config(["imports=[json]"]).imports == ("json",)


def traced_model(model_config, task):
    """The jaxpr of the model's forward over a tiny batch of `task` (traced only, nothing compiled), as text."""
    import jax

    from rnnlab.models import build_model

    # gpu: no oneDNN layer (the fused form: a CPU kernel, the same whichever recurrence)
    model = build_model(model_config, task.output_dim, "cpu" if model_config.time_scan == "fused" else "gpu",
                        task.input_dim)
    x = task.input_spec(2)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    return str(jax.make_jaxpr(lambda p, x: model.apply(p, x)[0].sum())(params, x))


# In the fast tier: a cell whose every form has a hand-written backward (lstm) and one with it in one form only (gla).
@pytest.mark.parametrize("name", ["lstm", "gla", *(pytest.param(n, marks=pytest.mark.slow("cross-product"))
                                                   for n in GROUPS["model"] if n not in ("lstm", "gla"))])
def test_custom_vjp_is_accepted_exactly_where_a_cell_runs_a_hand_written_backward(name):
    """model.recurrence=custom_vjp for a cell's form (model.time_scan) is accepted iff it changes the layer's program
    from autodiff's (a hand-written backward runs); where it would run autodiff without a word (rwkv7, attention,
    gla's chunked form, ...) it is refused naming model.recurrence. The rule comes from each cell's declaration in
    the registry (`Cell.custom_vjp_forms`), not from a list of cells."""
    import dataclasses

    mismatched = []
    base = compose_config([f"model={name}", "hidden_dim=8", "num_layers=1"])
    task = tasks.make_task(base.data)
    time_scans = base.model.make_cell().time_scans
    # The fused form's backward is its kernel's (rnnlab.fused), hand-written, whichever recurrence: custom_vjp names it
    runs_backward = {f: f == "fused" or (
        traced_model(dataclasses.replace(base.model, time_scan=f, recurrence="autodiff", remat=False), task)
        != traced_model(dataclasses.replace(base.model, time_scan=f, recurrence="custom_vjp", remat=False), task))
        for f in time_scans}
    for form in (*time_scans, "auto"):  # auto may run any form
        changes = all(runs_backward.values()) if form == "auto" else runs_backward[form]
        try:
            cfg.replace(base, **{"model.time_scan": form, "model.recurrence": "custom_vjp", "model.remat": False})
            accepted = True
        except cfg.ConfigError as e:
            assert str(e).startswith("key 'model.recurrence': got 'custom_vjp', but cell ") and "\n" not in str(e)
            accepted = False
        if accepted != changes:
            mismatched.append(f"{name} time_scan={form}: custom_vjp {'accepted' if accepted else 'refused'}, "
                              f"but it {'changes' if changes else 'does not change'} the program")
    assert not mismatched, "\n".join(mismatched)


@pytest.mark.parametrize("overrides, message", [
    (["model=attention", "model.recurrence=custom_vjp"],
     "key 'model.recurrence': got 'custom_vjp', but cell 'attention' has no hand-written backward; allowed: autodiff"),
    (["model=gla", "model.recurrence=custom_vjp"],
     "key 'model.recurrence': got 'custom_vjp', but cell 'gla' has a hand-written backward only in its forms "
     "associative, fused, not in model.time_scan=auto; allowed: autodiff, or model.time_scan=associative|fused"),
])
def test_config_exit_refuses_custom_vjp_where_it_would_run_autodiff(overrides, message):
    import train

    assert train.config_exit(overrides) == (2, message)
    assert train.config_exit([*overrides[:1], "model.recurrence=autodiff"]) == (0, "")


@pytest.mark.parametrize("overrides, message", [
    (["model=attention", "data=text"], "key 'model.window': 0 (full causal attention), but data=text carries each "
                                       "stream's state"),
    (["data=text", "data.eval_seq_lens=[16]"], "key 'data.eval_seq_lens': got [16], allowed: [] for data=text"),
])
def test_config_exit_refuses_what_text_streams_cannot_do_as_train_py_does(overrides, message):
    """The config check (`train.config_exit`, the fuzzer's) and train.py share one refusal: full attention's cache
    and evaluation lengths with data=text are refused when the config is read, before any corpus or JAX."""
    import train

    code, line = train.config_exit(overrides)
    assert code == 2 and line.startswith(message) and "\n" not in line
    assert train.config_exit([*overrides[:1], "data=text", "model.window=8"] if "model=attention" in overrides
                             else ["data=text"]) == (0, "")
