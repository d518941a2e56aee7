"""Hybrid stacks (`model.pattern`): a one-cell pattern is today's model bit for bit; a hybrid's layers run
each their own cell with its own defaults or its `model.pattern_keys`, in the documented parameter layout;
it trains, saves and resumes; bad patterns exit 2 with one line."""

import dataclasses
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, assert_same_tree, compose_config, saved_state, tiny_config
from rnnlab import cells, rundir
from rnnlab.config import ConfigError
from rnnlab.models import build_model, stack_layer_params

sys.path.insert(0, str(ROOT))
import train  # noqa: E402  (train.py: the exit code a config gets, in process)

from test_fuzz_config import group_options  # noqa: E402

HYBRID = ["model=gated_deltanet", "model.pattern=[gated_deltanet,attention]", "num_layers=4"]
SMALL = ["hidden_dim=8", "data.seq_len=6"]


def init_and_apply(config, x, key=0):
    model = build_model(config.model, output_dim=1)
    params = jax.jit(model.init)(jax.random.key(key), x)["params"]  # a program each, not one a primitive
    return params, jax.jit(model.apply)({"params": params}, x)


@pytest.mark.parametrize("model", group_options("model"))
def test_pattern_defaults_of_every_cell_class_agree_with_its_model_config(model):
    """The yaml is the user's place, the class the core's: a pattern layer of a cell other than model.cell
    runs the class's defaults, which must be what `model=<cell>` runs."""
    m = compose_config([f"model={model}"]).model
    kind = cells.get_cell(m.cell)
    assert (kind.default_init, kind.default_recurrence, kind.default_form()) == (m.init, m.recurrence, m.time_scan)
    assert m.pattern == () and m.layer_cells() == (m.layer_cells()[0],) and len(m.layer_cells()) == 1


@pytest.mark.parametrize("cell, scan", [pytest.param("rnn", True, marks=pytest.mark.slow("cross-product")),
                                        ("rnn", False),
                                        pytest.param("gated_deltanet", False, marks=pytest.mark.slow("cross-product")),
                                        pytest.param("gated_deltanet", True, marks=pytest.mark.slow("cross-product"))])
def test_a_one_cell_pattern_is_todays_model_bit_for_bit(cell, scan):
    """Same parameter tree (names, shapes, values) and the same outputs, exactly, for [cell] and [cell, cell]."""
    x = jax.random.normal(jax.random.key(1), (2, 6, 2))
    base = [f"model={cell}", "num_layers=2", f"model.scan_layers={str(scan).lower()}", *SMALL]
    want_params, want = init_and_apply(compose_config(base), x)
    for pattern in (f"[{cell}]", f"[{cell},{cell}]")[:2 if cell == "rnn" else 1]:
        params, got = init_and_apply(compose_config([*base, f"model.pattern={pattern}"]), x)
        assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(want_params)
        jax.tree_util.tree_map(np.testing.assert_array_equal, params, want_params)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow("long")
def test_hybrid_parameter_tree_has_the_documented_names_and_stacked_shapes():
    config = compose_config([*HYBRID, *SMALL])
    params, y = init_and_apply(config, jnp.ones((2, 6, 2)))
    assert y.shape == (2, 6, 1)
    assert set(params["stack"]) == {"groups"} and set(params["stack"]["groups"]) == {"layer_0", "layer_1"}
    groups = params["stack"]["groups"]
    # In the model's block (residual, gated_deltanet's SwiGLU MLP) both; stacked over the 2 groups.
    assert groups["layer_0"]["recurrence"]["W_xh"].shape[:2] == (2, 8)
    assert "A_log" in groups["layer_0"]["recurrence"]["cell"]  # gated_deltanet's own
    assert groups["layer_1"]["recurrence"]["W_xh"].shape == (2, 8, 24)  # attention's q, k, v
    assert groups["layer_1"]["mlp"]["gate"]["kernel"].shape == (2, 8, 21)
    loop = compose_config([*HYBRID, *SMALL, "model.scan_layers=false"])
    loop_params, _ = init_and_apply(loop, jnp.ones((2, 6, 2)))
    assert set(loop_params["stack"]) == {f"layer_{j}" for j in range(4)}
    assert loop_params["stack"]["layer_3"]["recurrence"]["W_xh"].shape == (8, 24)


def test_hybrid_layers_run_their_own_cells_with_their_own_defaults():
    specs = compose_config([*HYBRID, *SMALL]).model.layer_cells()
    assert [(s.cell, s.time_scan, s.recurrence) for s in specs] == [("gated_deltanet", "auto", "autodiff"),
                                                                     ("attention", "blockwise", "autodiff")]
    assert dict(specs[0].options)["num_heads"] == 4 and specs[1].options == ()  # attention: its dataclass's
    # model.cell's keys reach its layers only; [a, b, a, b] is [a, b] repeated
    m = compose_config(["model=rnn", "model.pattern=[rnn,gru,rnn,gru]", "num_layers=4", "model.init=identity"]).model
    assert [(s.cell, s.init, s.recurrence) for s in m.layer_cells()] == [("rnn", "identity", "custom_vjp"),
                                                                         ("gru", "orthogonal", "custom_vjp")]


@pytest.mark.slow("long")
def test_pattern_keys_set_their_cells_layers_as_model_cell_would():
    """[gated_deltanet, attention] with +model.pattern_keys.attention.window=2 is, parameter for parameter and output
    for output, the same stack with attention as model.cell and model.window=2; and the window is not ignored."""
    x = jax.random.normal(jax.random.key(1), (2, 6, 2))
    common = ["model.pattern=[gated_deltanet,attention]", "num_layers=2", "model.block=residual", "model.mlp=none",
              "model.dtype=float32", *SMALL]
    keys = compose_config(["model=gated_deltanet", *common, "+model.pattern_keys.attention.window=2",
                           "+model.pattern_keys.attention.block_size=4"])
    cell = compose_config(["model=attention", *common, "model.window=2", "model.block_size=4"])
    run = lambda m: [(dataclasses.replace(s, options=()), s.make(m.hidden_dim)) for s in m.layer_cells()]  # noqa: E731
    assert run(keys.model) == run(cell.model)
    assert dict(keys.model.layer_cells()[1].options) == {"block_size": 4, "window": 2}
    want_params, want = init_and_apply(cell, x)
    params, got = init_and_apply(keys, x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, want_params)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    _, full = init_and_apply(compose_config(["model=gated_deltanet", *common]), x)
    assert not np.allclose(np.asarray(full), np.asarray(got))
    # a pattern cell's common keys too: the time form, its recurrence
    m = compose_config(["model=attention", *common, "+model.pattern_keys.gated_deltanet.time_scan=sequential"]).model
    assert m.layer_cells()[0].time_scan == "sequential" and m.layer_cells()[1].time_scan == "blockwise"
    m = compose_config(["model=rnn", "model.pattern=[rnn,lstm]", "num_layers=2",
                        "+model.pattern_keys.lstm.recurrence=autodiff", "+model.pattern_keys.lstm.forget_bias=0.0"]).model
    assert (m.layer_cells()[1].recurrence, m.layer_cells()[1].forget_bias) == ("autodiff", 0.0)


@pytest.mark.parametrize("overrides", [pytest.param(HYBRID, marks=pytest.mark.slow("cross-product")),
                                       ["model=rnn", "model.pattern=[rnn,lstm,gru]", "num_layers=6"]],
                         ids=["gated_deltanet+attention", "rnn+lstm+gru"])
def test_hybrid_scanned_groups_equal_the_python_loop(overrides):
    x = jax.random.normal(jax.random.key(1), (2, 6, 2))
    loop = compose_config([*overrides, *SMALL, "model.scan_layers=false"])
    scan = compose_config([*overrides, *SMALL])
    loop_params, want = init_and_apply(loop, x)
    period = len(scan.model.layer_cells())
    scan_params = stack_layer_params(loop_params, scan.num_layers, period)
    got = build_model(scan.model, output_dim=1).apply({"params": scan_params}, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the layers differ: not one layer's parameters repeated
    w = scan_params["stack"]["groups"]["layer_1"]
    w = w["recurrence"]["W_xh"] if "recurrence" in w else w["W_xh"]
    assert not np.allclose(w[0], w[1])


@pytest.mark.slow("long")
def test_hybrid_stack_init_vmap_gives_the_scan_layout():
    x = jnp.ones((2, 6, 2))
    hybrid = ["model=rnn", "model.pattern=[rnn,gru]", "num_layers=4", "model.block=residual", *SMALL]
    scan, _ = init_and_apply(compose_config(hybrid), x)
    vmap, y = init_and_apply(compose_config([*hybrid, "model.stack_init=vmap"]), x)
    shapes = lambda t: jax.tree_util.tree_map(lambda a: a.shape, t)  # noqa: E731
    assert shapes(vmap) == shapes(scan) and np.isfinite(np.asarray(y)).all()


@pytest.mark.parametrize("overrides, needle", [
    (["model.pattern=[rnn,foo]"], "key 'model.pattern': got 'foo', allowed: "),
    (["model.pattern=[rnn,lstm,gru]", "num_layers=4"], "does not divide num_layers=4"),
    (["model.pattern=[lstm,gru]", "num_layers=2"], "without model.cell='rnn'"),
    (["model=rnn", "model.pattern=[rnn,gru]", "num_layers=2", "model.recurrence=autodiff", "model.remat=true"],
     "key 'model.remat'"),
    (["model=rnn", "model.pattern=[rnn,attention]", "num_layers=2", "hidden_dim=6"],
     "key 'model.pattern_keys.attention.num_heads': got 4, must be >= 1 and divide hidden_dim=6 (num_heads: attention's "
     "class default)"),
    (["checkpoint.allow_changes=[model.pattern_keys.attention.wndow]"], "key 'checkpoint.allow_changes'"),
    (["model.pattern=[1,2]"], "key 'model.pattern'"),
    ([*HYBRID, "+model.pattern_keys.attention.window=-1"], "key 'model.pattern_keys.attention.window': got -1"),
    ([*HYBRID, "+model.pattern_keys.attention.wndow=4"], "unknown key 'model.pattern_keys.attention.wndow' (allowed"),
    ([*HYBRID, "+model.pattern_keys.attention.time_scan=chunked"], "allowed for cell 'attention': parallel, blockwise"),
    ([*HYBRID, "+model.pattern_keys.attention.init=foo"], "key 'model.pattern_keys.attention.init': got 'foo'"),
    ([*HYBRID, "+model.pattern_keys.gated_deltanet.time_scan=sequential"], "gated_deltanet is model.cell"),
    ([*HYBRID, "+model.pattern_keys.lstm.forget_bias=0"], "lstm is not in model.pattern"),
    ([*HYBRID, "+model.pattern_keys.foo.window=4"], "key 'model.pattern_keys': got 'foo', allowed: "),
    (["+model.pattern_keys.attention.window=4"], "model.pattern is empty"),
    (["model=rnn", "model.pattern=[rnn,gru]", "num_layers=2", "+model.pattern_keys.gru.recurrence=onednn"],
     "key 'model.pattern_keys.gru.recurrence': got 'onednn', but cell 'gru' has no oneDNN kernel"),
])
def test_bad_patterns_exit_2_with_one_line_naming_the_key(overrides, needle):
    code, line = train.config_exit(overrides)
    assert code == 2 and needle in line and "\n" not in line, line


def test_a_resume_that_changes_the_pattern_is_refused_and_old_records_resume():
    old = {"model.cell": "rnn", "model.hidden_dim": 8}  # a record written before model.pattern existed
    assert rundir.resume_changes(old, {**old, "model.pattern": []}, ()) == {}
    with pytest.raises(ConfigError, match="key 'model.pattern'"):
        rundir.resume_changes({**old, "model.pattern": []}, {**old, "model.pattern": ["rnn", "gru"]}, ["model.pattern"])
    hybrid = {**old, "model.pattern": ["rnn", "attention"]}  # a pattern cell's key: refused unless allowed
    with pytest.raises(ConfigError, match="model.pattern_keys.attention.window None -> 4"):
        rundir.resume_changes(hybrid, {**hybrid, "model.pattern_keys.attention.window": 4}, ())
    # allowed, also where the new config drops the key (absent from its flat view)
    assert train.config_exit(["checkpoint.allow_changes=[model.pattern_keys.attention.window]"]) == (0, "")


@pytest.mark.slow("long")  # train_and_evaluate end to end; the fast tier keeps the stack's own equivalences
def test_a_hybrid_trains_saves_and_resumes(tmp_path):
    from rnnlab.trainer import train_and_evaluate

    config = tiny_config(*HYBRID, "steps=6")
    results = train_and_evaluate(config, tmp_path)
    assert results["status"] == "completed" and np.isfinite(results["train_loss"])
    uninterrupted = saved_state(tmp_path, 6)
    groups = uninterrupted["params"]["stack"]["groups"]
    assert groups["layer_1"]["recurrence"]["W_xh"].shape == (2, 8, 24)
    # The state: two gated_deltanet layers' [heads, d, d] and two attention layers' keys and values.
    specs = config.model.layer_cells()
    from rnnlab import tasks
    total_len = tasks.make_task(config.data).total_len
    per_cell = [s.make(8).state_floats(total_len) for s in specs]
    assert results["model_state_floats"] == 2 * sum(per_cell)
    assert results["state_floats"] == round(2 * sum(per_cell) / 4)
    shutil.rmtree(tmp_path / "checkpoints" / "6")  # as if it had died after step 3's checkpoint
    resumed = train_and_evaluate(config, tmp_path)
    assert resumed["step"] == 6
    assert_same_tree(saved_state(tmp_path, 6), uninterrupted)
