"""The zoo's protocol (scripts/zoo_protocol.py through summarize.py) on fabricated sweeps: the lr is
chosen on the training-length eval only, seeds aggregate, a failed job fails its lr and is reported;
and each cell's state-size fact (`Cell.state_floats`, logged as state_floats) is the size of the
carry its time scan keeps."""

import json
import statistics

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from conftest import CONF_DIR, ROOT, compose_config
from rnnlab.cells import CELLS, get_cell
from rnnlab.models import RecurrentLayer

LRS = ("0.0003", "0.001", "0.003", "0.01")
TRAIN_LEN, LONG = 32, 128


@pytest.fixture
def summarize(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import summarize

    yield summarize
    if "matplotlib.pyplot" in __import__("sys").modules:
        __import__("sys").modules["matplotlib.pyplot"].close("all")


def write_job(root, n, overrides, status="completed", train=None, long=None, state_floats=64, platform="cpu"):
    """A zoo job dir as train.py leaves it: overrides, config, results.json with eval_by_len."""
    job = root / f"{n}_{','.join(overrides)}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    values = dict(o.split("=", 1) for o in overrides)
    config = {"model": {"cell": values["model"]}, "data": {"task": "mqar", "seq_len": TRAIN_LEN},
              "optimizer": {"lr": 0.001}}
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    finished = status == "completed"
    results = {"status": status, "task": "mqar", "eval_metric_name": "accuracy",
               "eval_loss": 1.0 - train if finished else None,
               "eval_metrics": {"accuracy": train if finished else None},
               "eval_by_len": {str(TRAIN_LEN): {"loss": None, "accuracy": train if finished else None},
                               str(LONG): {"loss": None, "accuracy": long if finished else None}},
               "num_params": 100, "state_floats": state_floats, "tokens_per_sec": 1000.0, "platform": platform}
    (job / "results.json").write_text(json.dumps(results))


def grid_sweep(root, table):
    """table: {(cell, lr, seed): (status, accuracy at TRAIN_LEN, accuracy at LONG)} -> a sweep dir."""
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("{}\n")
    for n, ((cell, lr, seed), (status, train, long)) in enumerate(table.items()):
        write_job(root, n, [f"model={cell}", f"optimizer.lr={lr}", f"seed={seed}"], status, train, long)
    return root


def test_the_lr_is_chosen_on_the_training_length_only(tmp_path, summarize):
    # lr 0.003 is best at the training length; lr 0.01 would win on the longer length.
    train = {"0.0003": 0.2, "0.001": 0.5, "0.003": 0.9, "0.01": 0.8}
    long = {"0.0003": 0.1, "0.001": 0.3, "0.003": 0.4, "0.01": 0.95}
    root = grid_sweep(tmp_path / "zoo", {("gru", lr, 0): ("completed", train[lr], long[lr]) for lr in LRS})
    zoo = summarize.Zoo(summarize.Sweep(root))
    (choice,) = zoo.choices
    assert choice.lr == 0.003 and [g.lr for g in choice.grid] == [float(lr) for lr in LRS]
    assert zoo.values[0] == {TRAIN_LEN: 0.9, LONG: 0.4}  # the longer length reported at the chosen lr
    assert summarize.main([str(root), "--no-plots"]) == 0
    row = (root / "zoo_table.md").read_text().splitlines()[4]
    assert row.startswith("| gru | 0.9 | 0.4 | 0.003 | 1 |")
    rows = list(__import__("csv").DictReader(open(root / "summary.csv")))
    assert len(rows) == 4 and [r["chosen_lr"] for r in rows] == ["False", "False", "True", "False"]


def test_a_loss_is_minimised_and_ties_go_to_the_smaller_lr(summarize):
    import zoo_protocol as zp

    grid = [zp.LrResult(lr, [i], [s]) for i, (lr, s) in enumerate([(0.01, 0.5), (0.001, 0.2), (0.003, 0.2)])]
    assert zp.choose(grid, "loss").lr == 0.001 and zp.choose(grid, "accuracy").lr == 0.01
    assert zp.lower_is_better("mse") and not zp.lower_is_better("accuracy")


def test_seeds_aggregate_into_mean_and_spread(tmp_path, summarize):
    acc = {("0.001", 0): 0.6, ("0.001", 1): 0.7, ("0.001", 2): 0.8,  # mean 0.7: chosen
           ("0.01", 0): 1.0, ("0.01", 1): 0.2, ("0.01", 2): 0.3}  # mean 0.5
    root = grid_sweep(tmp_path / "zoo", {("lstm", lr, s): ("completed", a, a / 2) for (lr, s), a in acc.items()})
    zoo = summarize.Zoo(summarize.Sweep(root))
    (choice,) = zoo.choices
    assert choice.lr == 0.001 and len(choice.best.jobs) == 3
    assert zoo.values[0][TRAIN_LEN] == pytest.approx(0.7)
    assert zoo.spreads[0][TRAIN_LEN] == pytest.approx(statistics.stdev([0.6, 0.7, 0.8]))
    assert zoo.spreads[0][LONG] == pytest.approx(np.std([0.3, 0.35, 0.4], ddof=1))
    assert "| lstm | 0.7 ± 0.1 | 0.35 ± 0.05 | 0.001 | 3 |" in zoo.markdown()


def test_a_failed_job_fails_its_lr_and_is_reported(tmp_path, summarize):
    table = {("gru", "0.001", 0): ("completed", 0.5, 0.4), ("gru", "0.001", 1): ("completed", 0.5, 0.4),
             ("gru", "0.01", 0): ("completed", 0.99, 0.9), ("gru", "0.01", 1): ("diverged", None, None),
             ("rnn", "0.001", 0): ("diverged", None, None), ("rnn", "0.001", 1): ("failed", None, None)}
    root = grid_sweep(tmp_path / "zoo", table)
    (root / "6_model=rnn,optimizer.lr=0.01,seed=0" / ".hydra").mkdir(parents=True)  # killed before results.json
    (root / "6_model=rnn,optimizer.lr=0.01,seed=0" / ".hydra" / "overrides.yaml").write_text(
        "- model=rnn\n- optimizer.lr=0.01\n- seed=0\n")
    zoo = summarize.Zoo(summarize.Sweep(root))
    gru, rnn = zoo.choices
    assert gru.lr == 0.001 and zoo.values[0][TRAIN_LEN] == 0.5  # 0.01's better seed does not make it the result
    assert rnn.best is None and zoo.values[1] == {TRAIN_LEN: None, LONG: None}
    table_text = zoo.markdown()
    assert "| gru | 0.5 ± 0 | 0.4 ± 0 | 0.001 (1 of 2 lrs failed) | 2 |" in table_text
    assert "| rnn | n/a | n/a | all 2 lrs failed (diverged, failed, missing) | 0 |" in table_text


def test_two_sweeps_of_the_same_setting_stay_apart(tmp_path, summarize):
    """A folder of two zoo sweeps: the same cell in each is two rows, not one row with twice the seeds."""
    for name, acc in (("a", 0.9), ("b", 0.3)):
        grid_sweep(tmp_path / "zoos" / name, {("gru", lr, 0): ("completed", acc, acc) for lr in LRS})
    zoo = summarize.Zoo(summarize.Sweep(tmp_path / "zoos"))
    assert [len(c.best.jobs) for c in zoo.choices] == [1, 1]
    assert sorted(v[TRAIN_LEN] for v in zoo.values) == [0.3, 0.9]
    assert sorted(zoo.labels) == ["gru sweep=a", "gru sweep=b"]


def test_a_table_that_mixes_platforms_names_each_rows(tmp_path, summarize):
    root = grid_sweep(tmp_path / "zoo", {(cell, lr, 0): ("completed", 0.5, 0.4) for cell in ("gru", "gla") for lr in LRS})
    assert "platform" not in summarize.Zoo(summarize.Sweep(root)).markdown()  # one platform: no column
    for job in root.glob("*model=gla*"):
        results = json.loads((job / "results.json").read_text())
        (job / "results.json").write_text(json.dumps(results | {"platform": "gpu"}))
    lines = summarize.Zoo(summarize.Sweep(root)).markdown().splitlines()
    assert lines[2].endswith("| tokens/s | platform |")
    assert [line.rsplit("|", 2)[1].strip() for line in lines[4:]] == ["cpu", "gpu"]


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


@pytest.mark.parametrize("zoo", ["zoo_parity", "zoo_selective_copy", "zoo_mqar", "zoo_parity_paper",
                                 "zoo_selective_copy_paper", "zoo_mqar_paper"])
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


def test_seeds_added_at_the_chosen_lr_report_the_choice_without_changing_it(tmp_path, summarize):
    # The grid on seed 0 ties 0.003 with 0.01 (the smaller wins); seeds 1 and 2 then ran at 0.003 alone and
    # score lower. Compared over every seed of each lr, 0.01's one seed (1.0) would beat 0.003's mean (0.9).
    table = {("gdn", lr, 0): ("completed", a, a) for lr, a in zip(LRS, (0.2, 0.5, 1.0, 1.0))}
    table |= {("gdn", "0.003", 1): ("completed", 0.8, 0.8), ("gdn", "0.003", 2): ("completed", 0.9, 0.9)}
    zoo = summarize.Zoo(summarize.Sweep(grid_sweep(tmp_path / "zoo", table)))
    (choice,) = zoo.choices
    assert choice.lr == 0.003 and len(choice.best.jobs) == 3
    assert zoo.values[0][TRAIN_LEN] == pytest.approx(0.9)
    # A failed extra seed still fails its lr: the next lr on the shared seed wins.
    table[("gdn", "0.003", 2)] = ("diverged", None, None)
    zoo = summarize.Zoo(summarize.Sweep(grid_sweep(tmp_path / "zoo2", table)))
    assert zoo.choices[0].lr == 0.01
