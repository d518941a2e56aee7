"""The Elman layer and model against an independent NumPy loop; scanned stack == Python-loop stack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config, fast_first
from rnnlab import config as cfg
from rnnlab.cells import initializers
from rnnlab.models import LayerStack, RecurrentLayer, build_model, default_unroll, stack_layer_params


def numpy_elman(x, w_xh, w_hh, b, act=np.tanh):
    """h_t = act(h_{t-1} W_hh + x_t W_xh + b), h_0 = 0, one time step at a time. x: [B, T, I]."""
    h = np.zeros((x.shape[0], w_hh.shape[0]))
    outputs = []
    for t in range(x.shape[1]):
        h = act(h @ w_hh + x[:, t] @ w_xh + b)
        outputs.append(h)
    return np.stack(outputs, axis=1)


@pytest.mark.parametrize("recurrence", ["autodiff", "custom_vjp"])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_elman_layer_matches_numpy_loop(activation, recurrence):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 7, 5)).astype(np.float32)
    layer = RecurrentLayer(hidden_dim=4, cell="rnn", activation=activation, recurrence=recurrence)
    x_tm = x.swapaxes(0, 1)  # the layer is time-major
    params = layer.init(jax.random.key(0), x_tm)["params"]
    # Random weights, not the init, so that every entry matters.
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape, scale=0.5), p.dtype), params)
    got = layer.apply({"params": params}, x_tm)[0].swapaxes(0, 1)
    act = np.tanh if activation == "tanh" else (lambda v: np.maximum(v, 0))
    want = numpy_elman(x.astype(np.float64), *(np.asarray(params[k], np.float64) for k in ("W_xh",)),
                       np.asarray(params["cell"]["W_hh"], np.float64), np.asarray(params["b"], np.float64), act)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_layers", [2, 4])
def test_scanned_stack_equals_python_loop_stack(num_layers):
    x = jax.random.normal(jax.random.key(1), (2, 9, 6))
    loop = LayerStack(hidden_dim=6, num_layers=num_layers, scan_layers=False, layer_options=(("cell", "rnn"),))
    scan = LayerStack(hidden_dim=6, num_layers=num_layers, scan_layers=True, layer_options=(("cell", "rnn"),))
    loop_params = loop.init(jax.random.key(2), x)["params"]
    scan_params = stack_layer_params({"stack": loop_params}, num_layers)["stack"]
    want = loop.apply({"params": loop_params}, x)
    got = scan.apply({"params": scan_params}, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    # The layers really differ, so the comparison is not trivially of one layer.
    assert not np.allclose(loop_params["layer_0"]["W_xh"], loop_params["layer_1"]["W_xh"])


def test_scanned_params_are_stacked_on_a_leading_layer_axis():
    config = compose_config(["hidden_dim=16", "num_layers=4"])
    model = build_model(config.model, output_dim=1)
    params = model.init(jax.random.key(0), jnp.zeros((2, 5, 2)))["params"]
    first, layers = params["stack"]["layer_0"], params["stack"]["layers"]
    assert first["W_xh"].shape == (16, 16) and first["cell"]["W_hh"].shape == (16, 16)
    assert layers["W_xh"].shape == (3, 16, 16) and layers["b"].shape == (3, 16)
    assert layers["cell"]["W_hh"].shape == (3, 16, 16)
    assert params["input_proj"]["kernel"].shape == (2, 16) and params["readout"]["kernel"].shape == (16, 1)
    assert not np.allclose(layers["cell"]["W_hh"][0], layers["cell"]["W_hh"][1])


# input width 5: folded (5 < 2H) and not (5 >= 2H)
@pytest.mark.parametrize("hidden_dim, recurrence", fast_first([(8, "custom_vjp"), (2, "autodiff"), (8, "autodiff"),
                                                              (2, "custom_vjp")], keep=2, why="cross-product"))
def test_model_is_projection_then_elman_stack_then_readout(hidden_dim, recurrence):
    """The whole model against NumPy: x P + c, two Elman layers, the readout at every step,
    however the first layer computes its input term (the projection folded into W_xh or not)."""
    config = compose_config([f"hidden_dim={hidden_dim}", "num_layers=2", f"model.recurrence={recurrence}"])
    model = build_model(config.model, output_dim=3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 5)).astype(np.float32)
    params = model.init(jax.random.key(0), x)["params"]
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape, scale=0.5), p.dtype), params)
    got = jax.jit(model.apply)({"params": params}, x)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    h = x.astype(np.float64) @ p["input_proj"]["kernel"] + p["input_proj"]["bias"]
    first, rest = p["stack"]["layer_0"], p["stack"]["layers"]
    h = numpy_elman(h, first["W_xh"], first["cell"]["W_hh"], first["b"])
    h = numpy_elman(h, rest["W_xh"][0], rest["cell"]["W_hh"][0], rest["b"][0])
    want = h @ p["readout"]["kernel"] + p["readout"]["bias"]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_initializers():
    key, shape = jax.random.key(0), (32, 32)
    w_in, w_rec = (f(key, shape) for f in initializers("uniform"))
    assert float(jnp.abs(w_in).max()) <= 0.1 and float(jnp.abs(w_rec).max()) <= 0.1
    assert float(jnp.abs(w_rec).max()) > 0.09  # spread over the interval, not a constant
    _, w_rec = (f(key, shape) for f in initializers("orthogonal"))
    np.testing.assert_allclose(np.asarray(w_rec @ w_rec.T), np.eye(32), atol=1e-5)
    w_in, w_rec = (f(key, shape) for f in initializers("identity"))
    np.testing.assert_array_equal(np.asarray(w_rec), np.eye(32))
    assert float(jnp.std(w_in)) < 0.01


def test_init_choice_reaches_every_layer_of_the_stack():
    config = cfg.replace(compose_config(["num_layers=3", "hidden_dim=8"]), **{"model.init": "identity"})
    params = build_model(config.model, 1).init(jax.random.key(0), jnp.zeros((1, 4, 2)))["params"]
    np.testing.assert_array_equal(np.asarray(params["stack"]["layer_0"]["cell"]["W_hh"]), np.eye(8))
    for w in params["stack"]["layers"]["cell"]["W_hh"]:
        np.testing.assert_array_equal(np.asarray(w), np.eye(8))


def test_unroll_null_is_chosen_per_platform():
    assert compose_config([]).model.unroll is None
    assert default_unroll("cpu") == 1 and default_unroll("gpu") == 8 and default_unroll("tpu") == 8
