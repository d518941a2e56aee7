"""The zoo presets: every job of each sweep composes and validates, and the sweep covers every cell; the presets
sweep lrs and seeds; and each cell's state-size fact (`Cell.state_floats`, logged as state_floats) is the size of the
carry its time scan keeps. (The protocol itself, `rnnlab.zoo`, has its own tests.)"""

import os
from pathlib import Path

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from conftest import CONF_DIR, compose_config
from rnnlab.cells import CELLS, SequenceCell, get_cell
from rnnlab.models import RecurrentLayer

ZOOS = ["zoo_parity", "zoo_selective_copy", "zoo_mqar"]
PACKAGE_CELLS = sorted(name for name, cls in CELLS.items() if cls.__module__.startswith("rnnlab."))


def swept_models(zoo):
    preset = yaml.safe_load(open(f"{CONF_DIR}/experiment/{zoo}.yaml"))
    return preset["hydra"]["sweeper"]["params"]["model"].split(",")


@pytest.mark.slow("long")
@pytest.mark.parametrize("zoo", ZOOS)
def test_a_zoo_sweeps_every_cell_with_the_block_it_needs(zoo):
    assert sorted(swept_models(zoo)) == PACKAGE_CELLS
    for cell in swept_models(zoo):
        config = compose_config([f"experiment={zoo}", f"model={cell}"])
        assert config.data.task == zoo.removeprefix("zoo_") and config.model.cell == cell
        assert config.data.eval_seq_lens and max(config.data.eval_seq_lens) > config.data.seq_len
        whole_sequence = issubclass(CELLS[cell], SequenceCell)
        assert config.model.block == ("residual" if whole_sequence else "plain")


ST = "zoo_state_tracking"
ST_TASKS = {"parity": ("parity", {}), "modular_arithmetic": ("modular_arithmetic", {"modulus": 5}),
            "s3": ("word_problem", {"group": "s3"}), "a4": ("word_problem", {"group": "a4"}),
            "a4_x_z5": ("word_problem", {"group": "a4_x_z5"}), "a5": ("word_problem", {"group": "a5"}),
            "s5": ("word_problem", {"group": "s5"})}


def st_params():
    return yaml.safe_load(Path(f"{CONF_DIR}/experiment/{ST}.yaml").read_text())["hydra"]["sweeper"]["params"]


def st_commands():
    """The further sweeps the preset's header documents (its commands that set a model key): the command
    lines after `python train.py`."""
    text = Path(f"{CONF_DIR}/experiment/{ST}.yaml").read_text()
    lines = [line.lstrip("# ").split() for line in text.splitlines() if line.startswith("#")]
    return [words[2:] for words in lines if words[:2] == ["python", "train.py"] and f"experiment={ST}" in words
            and any(w.startswith("model.") for w in words)]


def sweep_jobs(args):
    """The jobs Hydra's basic sweeper runs for `python train.py ARGS` (zoo.seeds=1): the preset's
    hydra.sweeper.params, then the command line's task overrides, which replace a key's list."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}".replace("${zoo.seeds}", "1") for k, v in st_params().items()]
    task = [a for a in args if "=" in a and not a.startswith(("hydra/", "hydra.", "experiment="))]
    (batch,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(params + task), None)
    return [dict(o.split("=", 1) for o in job) for job in batch]


def check_task(config, choice):
    task, options = ST_TASKS[choice]
    assert config.data.task == task and dict(config.data.options) == options
    lengths = config.data.eval_seq_lens
    assert lengths[0] == config.data.seq_len and 4 * config.data.seq_len <= max(lengths) <= 9 * config.data.seq_len
    # one target per example (parity, modular arithmetic): lengths vary; a word problem scores every prefix
    assert (config.data.min_seq_len is None) == (task == "word_problem")
    if task == "modular_arithmetic":  # an expression has an odd number of tokens: every length is one
        assert config.data.seq_len % 2 and all(n % 2 for n in lengths)


@pytest.mark.parametrize("cells", [pytest.param(("rnn", "mamba", "deltaproduct", "attention"), id="four-families",
                                                marks=pytest.mark.slow("long")),
                                   pytest.param(None, id="every-cell", marks=pytest.mark.slow("cross-product"))])
def test_the_state_tracking_zoo_composes_every_job_of_its_sweep(cells):
    params = st_params()
    assert sorted(params["model"].split(",")) == PACKAGE_CELLS == sorted(swept_models("zoo_parity"))
    assert params["state_tracking"].split(",") == ["parity", "modular_arithmetic", "s3", "a5"]
    jobs = sweep_jobs([f"experiment={ST}"])
    assert len(jobs) == 4 * len(PACKAGE_CELLS) * 4  # tasks x cells x lrs, one seed
    jobs = [j for j in jobs if cells is None or j["model"] in cells]
    for job in {(j["state_tracking"], j["model"]): j for j in jobs}.values():  # one lr and seed: they validate alike
        config = compose_config([f"experiment={ST}", *(f"{k}={v}" for k, v in job.items())])
        check_task(config, job["state_tracking"])
        assert config.model.cell == job["model"] and config.steps == 2000 and config.hidden_dim == 64
        assert config.model.block == ("residual" if issubclass(CELLS[job["model"]], SequenceCell) else "plain")
    for choice in set(ST_TASKS) - set(params["state_tracking"].split(",")):  # the other tasks of conf/state_tracking/
        check_task(compose_config([f"experiment={ST}", f"state_tracking={choice}", "model=deltaproduct"]), choice)


@pytest.mark.slow("long")
def test_the_state_tracking_switches_are_sweeps_of_the_preset_in_its_home():
    """The header's switch-on and n_h commands: the command line's model list replaces the preset's, the switches
    reach every job's config, and each sweep lands in a subdir of multirun/zoo_state_tracking."""
    import datetime
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT))
    import train

    switch, householder = st_commands()
    homes = {train.sweep_home(["-m", *args], datetime.datetime.now()) for args in (switch, householder)}
    assert len(homes) == 2 and all(home.startswith(f"multirun/{ST}/") for home in homes)
    switched = ("mamba", "mamba2", "deltanet", "gated_deltanet", "deltaproduct", "rwkv7")
    expected = {"switch": {(cell, None, "true") for cell in switched},
                "householder": {("deltaproduct", n, neg) for n in ("1", "3") for neg in ("false", "true")}}
    for name, args in (("switch", switch), ("householder", householder)):
        jobs = sweep_jobs(args)
        settings = {(j["model"], j.get("model.num_householder"), j["model.allow_neg_eigval"].lower()) for j in jobs}
        assert settings == expected[name] and len(jobs) == len(settings) * 4 * 4  # x tasks x lrs
        for model, n_h, neg in settings:
            config = compose_config([f"experiment={ST}", "state_tracking=s3", f"model={model}",
                                     f"model.allow_neg_eigval={neg}", *([f"model.num_householder={n_h}"] * bool(n_h))])
            options = dict(config.model.options)
            assert options["allow_neg_eigval"] is (neg == "true")
            assert n_h is None or options["num_householder"] == int(n_h)
    # Hydra composes the sweep's own config first, with the fixed overrides and the preset's default cell.
    for args in (switch, householder):
        fixed = [a for a in args if "," not in a and not a.startswith(("-m", "hydra/"))]
        assert compose_config(fixed).model.cell == "deltaproduct"


def test_the_hybrid_zoo_sweeps_every_stack_of_conf_hybrid_and_each_composes_as_named():
    params = yaml.safe_load(open(f"{CONF_DIR}/experiment/zoo_hybrid.yaml"))["hydra"]["sweeper"]["params"]
    stacks = params["hybrid"].split(",")
    assert sorted(stacks) == sorted(p[:-5] for p in os.listdir(f"{CONF_DIR}/hybrid"))
    want = {"gated_deltanet": ("gated_deltanet", (), 0), "attention": ("attention", (), 0),
            "window": ("attention", (), 16),
            "gdn3_attention1": ("gated_deltanet", ("gated_deltanet",) * 3 + ("attention",), 0),
            "gdn1_attention1": ("gated_deltanet", ("gated_deltanet", "attention"), 0),
            "attention1_gdn3": ("gated_deltanet", ("attention",) + ("gated_deltanet",) * 3, 0),
            "gdn3_window1": ("gated_deltanet", ("gated_deltanet",) * 3 + ("attention",), 16)}
    assert set(want) == set(stacks)
    for stack, (cell, pattern, window) in want.items():
        config = compose_config(["experiment=zoo_hybrid", f"hybrid={stack}"])
        m = config.model
        windows = {dict(spec.options).get("window", 0) for spec in m.layer_cells() if spec.cell == "attention"}
        assert (m.cell, m.pattern, max(windows, default=0)) == (cell, pattern, window), stack
        assert (m.block, m.mlp, config.num_layers, config.data.eval_seq_lens) == ("residual", "none", 4, (64, 128, 256))


def test_the_zoo_presets_sweep_lrs_and_seeds():
    for zoo in ("zoo_parity", "zoo_selective_copy", "zoo_mqar", "zoo_state_tracking"):
        params = yaml.safe_load(open(f"{CONF_DIR}/experiment/{zoo}.yaml"))["hydra"]["sweeper"]["params"]
        lrs = [float(v) for v in str(params["optimizer.lr"]).split(",")]
        assert len(lrs) == 4 and lrs == sorted(lrs)
        ratios = np.diff(np.log(lrs))
        np.testing.assert_allclose(ratios, ratios[0], rtol=0.15)  # log-spaced (rounded: 3e-4, 1e-3, ...)
        assert params["seed"] == "range(0,${zoo.seeds})"
    assert compose_config([]).zoo.seeds == 1


def test_zoo_seeds_must_be_positive():
    from rnnlab.config import ConfigError

    with pytest.raises(ConfigError, match="zoo.seeds"):
        compose_config(["zoo.seeds=0"])


def time_scan_carry_floats(cell: str, hidden_dim: int, fields: dict, batch: int, steps: int) -> int:
    """Floats per example in the carry of the layer's time scan (its sequential form): the scan of
    length `steps` (or, for a form that checkpoints blocks, the innermost scan) in the traced layer."""
    layer = RecurrentLayer(hidden_dim=hidden_dim, cell=cell, cell_options=tuple(fields.items()),
                           init_scheme="default", time_scan="sequential")
    x = jnp.zeros((steps, batch, hidden_dim))  # a stacked layer sees the width (the LRU adds its input)
    params = jax.eval_shape(layer.init, jax.random.key(0), x)
    jaxpr = jax.make_jaxpr(lambda p, x: layer.apply(p, x))(params, x).jaxpr
    scans = []

    def visit(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "scan":
                scans.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr)
    scans = [e for e in scans if e.params["length"] == steps] or scans[-1:]
    (scan,) = scans[:1]
    start = scan.params["num_consts"]
    carry = scan.invars[start:start + scan.params["num_carry"]]
    batched = [v.aval for v in carry if v.aval.shape[:1] == (batch,) and jnp.issubdtype(v.aval.dtype, jnp.inexact)]
    return sum(int(np.prod(a.shape)) * (2 if jnp.iscomplexobj(a) else 1) for a in batched) // batch  # complex: 2


SEQUENTIAL_CELLS = sorted(n for n, c in CELLS.items() if c.__module__.startswith("rnnlab.") and "sequential" in c.time_scans)


@pytest.mark.parametrize("cell", SEQUENTIAL_CELLS)
def test_state_floats_is_the_carry_of_the_time_scan(cell):
    """Every cell with a sequential form (attention's KV cache: test_attention_mamba)."""
    fields = {"num_heads": 2} if "num_heads" in get_cell(cell).__dataclass_fields__ else {}
    steps = 5
    if "chunk_size" in get_cell(cell).__dataclass_fields__:
        fields["chunk_size"] = steps
    expected = get_cell(cell)(8, **fields).state_floats(steps)
    assert time_scan_carry_floats(cell, 8, fields, batch=3, steps=steps) == expected


@pytest.mark.parametrize("zoo", ["zoo_parity", "zoo_selective_copy", *(
    pytest.param(zoo, marks=pytest.mark.slow("cross-product"))
    for zoo in ("zoo_mqar", "zoo_parity_paper", "zoo_selective_copy_paper", "zoo_mqar_paper"))])
def test_every_swept_value_of_a_zoo_composes(zoo):
    """Each value of the sweep's task and width keys (pairs, hidden sizes) is a valid config, with the
    slowest-to-check cell (attention: heads must divide the width) and a vector-state one."""
    params = yaml.safe_load(open(f"{CONF_DIR}/experiment/{zoo}.yaml"))["hydra"]["sweeper"]["params"]
    for key, values in params.items():
        if key in ("model", "seed"):
            continue
        for value in str(values).split(","):
            for cell in ("attention", "gru"):
                config = compose_config([f"experiment={zoo}", f"model={cell}", f"{key}={value}"])
                assert str(config_value(config, key)) == str(float(value) if key == "optimizer.lr" else int(value))


def config_value(config, key: str):
    """config's value at a dotted key, a task's own keys (data.num_pairs) from data.options."""
    group, name = key.split(".", 1) if "." in key else (None, key)
    node = getattr(config, group) if group else config
    return getattr(node, name) if hasattr(node, name) else dict(node.options)[name]
