"""The zoo presets: each is one job's shape of a table of the protocol (rnnlab/zoo/protocol.py, the one place that
lists cells, grids and seeds) and sweeps nothing; a preset alone is its table's job but for the lr and the seed, and
`-m` with lists of one's own sweeps it; the stacks, the state-tracking tasks and the switches compose as named; the
commands in each preset's header compose; the `zoo` group is an unknown key; and each cell's state-size fact
(`Cell.state_floats`, logged as state_floats) is the size of the carry its time scan keeps. That every setting of
every table composes with its preset through `Table.job_overrides`: tests/zoo/test_runner.py
(`test_every_table_s_job_composes_with_the_preset_it_names`); the protocol's own rule and tables: the rest of
tests/zoo/."""

import shlex
import sys
from pathlib import Path

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from conftest import CONF_DIR, ROOT, compose_config
from rnnlab.cells import CELLS, SequenceCell, get_cell
from rnnlab.config import flatten
from rnnlab.models import RecurrentLayer
from rnnlab.zoo import protocol

PRESETS = sorted(p.stem for p in Path(CONF_DIR, "experiment").glob("zoo_*.yaml"))
# Presets at their papers' scale, for a GPU: no table of the protocol runs them (their headers say so).
PAPER_PRESETS = ["zoo_mqar_paper", "zoo_parity_paper", "zoo_selective_copy_paper"]
# One table of each preset (the first the protocol lists), its budget checks and width tables being the same shape.
TABLE_OF = {}
for _table in protocol.TABLES.values():
    TABLE_OF.setdefault(_table.preset, _table)


def train_module():
    sys.path.insert(0, str(ROOT))
    import train

    return train


def leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, (*path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from leaves(value, (*path, str(i)))
    else:
        yield ".".join(path), node


def test_no_zoo_preset_sweeps_or_lists_cells_lrs_or_seeds():
    """The protocol is the one list: a preset holds no hydra.sweeper (nor hydra.mode: without `-m` it is one job),
    no value Hydra would sweep (`a,b`, `range(..)`, `choice(..)`), no seed and no `zoo` group; and every preset
    but the papers' is the preset of a protocol table."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    assert set(TABLE_OF) == set(PRESETS) - set(PAPER_PRESETS)
    for preset in PRESETS:
        text = Path(CONF_DIR, "experiment", f"{preset}.yaml").read_text()
        values = yaml.safe_load(text)
        assert not (values.get("hydra") or {}).get("sweeper") and "mode" not in (values.get("hydra") or {}), preset
        assert not {"seed", "zoo"} & set(values) and "zoo.seeds" not in text, preset
        for key, value in leaves({k: v for k, v in values.items() if k != "defaults"}):
            if isinstance(value, str):
                assert not parser.parse_override(f"k={value}").is_sweep_override(), (preset, key, value)


def test_a_preset_alone_is_one_job_of_its_table_but_for_the_lr_and_the_seed():
    """`python train.py experiment=<preset> <the table's keys> <cell>` trains the job the protocol would, but for
    optimizer.lr and seed, which it leaves to the command line (zoo_state_tracking alone trains 2,000 steps, the s3
    table 4,000: the protocol sets steps)."""
    for preset, table in TABLE_OF.items():
        setting = table.settings[0]
        alone = flatten(compose_config([f"experiment={preset}", *table.overrides, f"{table.cell_key}={setting.cell}",
                                        *setting.overrides]))
        job = flatten(compose_config(table.job_overrides(setting, table.lrs[0], 1)))
        differ = {k for k in alone.keys() | job.keys() if alone.get(k) != job.get(k)}
        expected = {"optimizer.lr", "seed"} | ({"steps"} if table.key == "s3" else set())
        assert differ <= expected, (table.key, {k: (alone.get(k), job.get(k)) for k in differ - expected})


def test_python_train_py_experiment_zoo_parity_model_gru_is_one_job_and_dash_m_sweeps_your_lists():
    """Without `-m` a zoo preset is one run (Hydra's RUN mode, nothing in hydra.sweeper.params); with `-m` the jobs are
    the command line's lists alone (2 cells x 2 lrs), each the preset's shape."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        hydra = compose(config_name="config", overrides=["experiment=zoo_parity", "model=gru"],
                        return_hydra_config=True).hydra
    assert hydra.mode in (None, RunMode.RUN) and not hydra.sweeper.get("params")
    config = compose_config(["experiment=zoo_parity", "model=gru"])
    assert (config.model.cell, config.steps, config.data.seq_len) == ("gru", 2000, 16)
    assert train_module().config_exit(["experiment=zoo_parity", "model=gru"]) == (0, "")

    # `-m`: Hydra's basic sweeper crosses the preset's hydra.sweeper.params (none) with the command line's lists
    sweep = [*(f"{k}={v}" for k, v in (hydra.sweeper.get("params") or {}).items()), "model=gru,lstm",
             "optimizer.lr=1e-3,3e-3"]
    (batch,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(sweep), None)
    assert sorted(map(tuple, batch)) == [(f"model={m}", f"optimizer.lr={lr}") for m in ("gru", "lstm")
                                         for lr in ("0.001", "0.003")]
    for job in batch:
        config = compose_config(["experiment=zoo_parity", *job])
        assert config.data.eval_seq_lens == (16, 32, 64, 128) and config.steps == 2000


def test_the_zoo_group_is_an_unknown_key():
    """The `zoo` group held only the presets' seed ranges: it is gone, refused as any unknown key (exit 2, one line)."""
    train = train_module()
    for overrides in (["zoo.seeds=3"], ["experiment=zoo_parity", "zoo.seeds=3"]):
        code, line = train.config_exit(overrides)
        assert code == 2 and line.startswith("unknown key 'zoo'") and "\n" not in line, (code, line)
    # a run dir from before records the group (always its default seeds=1): it still resumes, the key a free one
    from rnnlab import rundir

    now = rundir.recorded_config(compose_config(["experiment=zoo_parity", "model=gru"]))
    assert not any(k.startswith("zoo.") for k in now)
    assert rundir.resume_changes({**now, "zoo.seeds": 1}, now, []) == {}


def test_every_tables_lr_grid_is_ascending_log_spaced_and_within_its_bounds():
    for table in protocol.TABLES.values():
        lrs = table.lrs
        assert list(lrs) == sorted(set(lrs)) and len(lrs) >= 2, table.key
        assert table.lr_bounds[0] <= lrs[0] and lrs[-1] <= table.lr_bounds[1], table.key
        ratios = np.diff(np.log(lrs))
        np.testing.assert_allclose(ratios, ratios[0], rtol=0.15)  # log-spaced (rounded: 3e-4, 1e-3, ...)
        assert table.seeds >= 2 and table.jobs_per_setting() == len(lrs) + table.seeds - 1


@pytest.mark.slow("long")
@pytest.mark.parametrize("key", ["parity", "selective_copy", "mqar8"])
def test_every_cell_of_a_table_runs_in_the_block_its_model_config_names(key):
    """The presets of these tables set no block: each cell keeps its model config's (classic: plain; whole-sequence
    mixers: residual), trained at the table's length and evaluated longer. (That the core tables hold every cell:
    tests/zoo/test_runner.py.)"""
    table = protocol.TABLES[key]
    for setting in table.settings:
        config = compose_config(table.job_overrides(setting, table.lrs[0], 0))
        assert config.data.task == table.preset.removeprefix("zoo_") and config.model.cell == setting.cell
        assert config.data.seq_len == table.train_len and max(config.data.eval_seq_lens) > config.data.seq_len
        assert config.model.block == ("residual" if issubclass(CELLS[setting.cell], SequenceCell) else "plain")


ST = "zoo_state_tracking"
ST_TASKS = {"parity": ("parity", {}), "modular_arithmetic": ("modular_arithmetic", {"modulus": 5}),
            "s3": ("word_problem", {"group": "s3"}), "a4": ("word_problem", {"group": "a4"}),
            "a4_x_z5": ("word_problem", {"group": "a4_x_z5"}), "a5": ("word_problem", {"group": "a5"}),
            "s5": ("word_problem", {"group": "s5"})}


def check_task(config, choice):
    task, options = ST_TASKS[choice]
    assert config.data.task == task and dict(config.data.options) == options
    lengths = config.data.eval_seq_lens
    assert lengths[0] == config.data.seq_len and 4 * config.data.seq_len <= max(lengths) <= 9 * config.data.seq_len
    # one target per example (parity, modular arithmetic): lengths vary; a word problem scores every prefix
    assert (config.data.min_seq_len is None) == (task == "word_problem")
    if task == "modular_arithmetic":  # an expression has an odd number of tokens: every length is one
        assert config.data.seq_len % 2 and all(n % 2 for n in lengths)


def test_every_state_tracking_task_composes_with_the_preset():
    """Each task of conf/state_tracking/, chosen as `state_tracking=`, with the preset's shape."""
    assert sorted(ST_TASKS) == sorted(p.stem for p in Path(CONF_DIR, "state_tracking").glob("*.yaml"))
    for choice in ST_TASKS:
        config = compose_config([f"experiment={ST}", f"state_tracking={choice}", "model=gru"])
        check_task(config, choice)
        assert (config.steps, config.hidden_dim, config.num_layers, config.model.block) == (2000, 64, 2, "plain")


@pytest.mark.slow("long")
def test_the_protocols_switch_settings_reach_the_config_and_the_presets_cell_takes_both():
    """Each setting's overrides (the switch, n_h = 3, attention's window) reach its job's config; and the state-tracking
    preset's own cell (deltaproduct) takes both switches, so that a `-m` sweep fixing them composes (Hydra composes a
    sweep's config first with the command line's fixed keys and the preset's default cell)."""
    for table in (protocol.TABLES["parity"], protocol.TABLES["s3"], protocol.TABLES["text"]):
        for setting in (s for s in table.settings if s.overrides):
            config = compose_config(table.job_overrides(setting, table.lrs[0], 0))
            assert config.model.cell == setting.cell
            for override in setting.overrides:
                key, value = override.split("=", 1)
                assert str(config_value(config, key)).lower() == value, (table.key, setting.name)
    switched = compose_config([f"experiment={ST}", "model.allow_neg_eigval=true", "model.num_householder=3"])
    assert switched.model.cell == "deltaproduct"
    assert dict(switched.model.options)["allow_neg_eigval"] is True


def test_the_hybrid_tables_run_every_stack_of_conf_hybrid_and_each_composes_as_named():
    stacks = [s.cell for s in protocol.TABLES["hybrid_mqar8"].settings]
    assert all([s.cell for s in t.settings] == stacks for t in protocol.TABLES.values() if t.cell_key == "hybrid")
    assert sorted(stacks) == sorted(p.stem for p in Path(CONF_DIR, "hybrid").glob("*.yaml"))
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


def header_commands(preset):
    """The commands in a preset's header comment, each as its words."""
    text = Path(CONF_DIR, "experiment", f"{preset}.yaml").read_text()
    lines = [line.lstrip("# ").split("  #")[0] for line in text.splitlines() if line.startswith("#")]
    return [shlex.split(line) for line in lines if line.startswith("python ")]


def header_jobs(words):
    """The jobs of a `python train.py` command in a header, as Hydra's basic sweeper expands it, one per setting of
    the keys other than optimizer.lr and seed (which only pick the job's inputs: the same config otherwise)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [w for w in words[2:] if "=" in w and not w.startswith(("hydra/", "hydra."))]
    (batch,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    jobs = {}
    for job in batch:
        jobs.setdefault(tuple(o for o in job if not o.startswith(("optimizer.lr=", "seed="))), job)
    return list(jobs.values())


@pytest.mark.parametrize("preset", [p if p in ("zoo_parity", "zoo_mqar") else pytest.param(
    p, marks=pytest.mark.slow("cross-product")) for p in PRESETS])
def test_every_command_in_a_zoo_presets_header_composes(preset):
    """Each `python train.py` line of the header (one job, or a sweep of one's own: every job of it but for its lrs
    and seeds, which validate alike), and each `python -m rnnlab.zoo run` names a table of the protocol."""
    train = train_module()
    commands = header_commands(preset)
    assert any(w[:2] == ["python", "train.py"] and "-m" not in w for w in commands), "a command for one job"
    assert any(w[:2] == ["python", "train.py"] and "-m" in w for w in commands), "a sweep of one's own"
    for words in commands:
        if words[:3] == ["python", "-m", "rnnlab.zoo"]:
            assert words[3] == "run" and protocol.suite_tables(words[4])[0].preset == preset, words
        elif words[:2] == ["python", "train.py"]:
            assert f"experiment={preset}" in words, words
            for job in header_jobs(words):
                assert train.config_exit(job) == (0, ""), job


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


def config_value(config, key: str):
    """config's value at a dotted key, a task's own keys (data.num_pairs) from data.options."""
    group, name = key.split(".", 1) if "." in key else (None, key)
    node = getattr(config, group) if group else config
    return getattr(node, name) if hasattr(node, name) else dict(node.options)[name]
