"""LSTM and GRU against NumPy and torch; custom_vjp == autodiff; vmap init == scan init; remat; bf16; dropout."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import compose_config, fast_first, require
from rnnlab.cells import from_torch
from rnnlab.models import LayerStack, RecurrentLayer, build_model

B, T, I, H = 3, 7, 5, 4


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def numpy_lstm(x, w_xh, b, w_hh):
    """The documented nn.LSTM equations, gate blocks i, f, g, o, one step at a time. x: [B, T, I]."""
    h = c = np.zeros((x.shape[0], w_hh.shape[0]))
    hs = []
    for t in range(x.shape[1]):
        i, f, g, o = np.split(x[:, t] @ w_xh + b + h @ w_hh, 4, axis=-1)
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
        hs.append(h)
    return np.stack(hs, axis=1)


def numpy_gru(x, w_xh, b, w_hh, b_hn):
    """The documented nn.GRU equations, blocks r, z, n, reset gate applied to (h W_hn + b_hn)."""
    hid = w_hh.shape[0]
    w_ir, w_iz, w_in = (w_xh[:, k * hid : (k + 1) * hid] for k in range(3))
    w_hr, w_hz, w_hn = (w_hh[:, k * hid : (k + 1) * hid] for k in range(3))
    b_r, b_z, b_n = np.split(b, 3)
    h = np.zeros((x.shape[0], hid))
    hs = []
    for t in range(x.shape[1]):
        x_t = x[:, t]
        r = sigmoid(x_t @ w_ir + b_r + h @ w_hr)
        z = sigmoid(x_t @ w_iz + b_z + h @ w_hz)
        n = np.tanh(x_t @ w_in + b_n + r * (h @ w_hn + b_hn))
        h = (1 - z) * n + z * h
        hs.append(h)
    return np.stack(hs, axis=1)


def random_like(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape, scale=0.5), p.dtype), params)


def init(module, x, seed=0):
    """The module's params, initialised under jit (eager init of scans is slow)."""
    return jax.jit(module.init)(jax.random.key(seed), x)["params"]


def f64(a):
    return np.asarray(a, np.float64)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("recurrence", ["autodiff", "custom_vjp"])
def test_cell_matches_numpy_equations(cell, recurrence):
    x = np.random.default_rng(0).normal(size=(B, T, I)).astype(np.float32)
    layer = RecurrentLayer(hidden_dim=H, cell=cell, recurrence=recurrence)
    x_tm = x.swapaxes(0, 1)  # the layer is time-major
    params = random_like(init(layer, x_tm), seed=1)
    got = jax.jit(layer.apply)({"params": params}, x_tm)[0].swapaxes(0, 1)
    args = [f64(params["W_xh"]), f64(params["b"]), f64(params["cell"]["W_hh"])]
    want = numpy_lstm(f64(x), *args) if cell == "lstm" else numpy_gru(f64(x), *args, f64(params["cell"]["b_hn"]))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow("extra")  # torch comes with the full tier's install (.[test,bench])
@pytest.mark.parametrize("recurrence", ["autodiff", "custom_vjp"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_two_layer_stack_matches_torch(cell, recurrence):
    torch = require("torch")
    torch.manual_seed(0)
    # Input width H so that the torch layers' shapes match our stack (which follows input_proj).
    net = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(H, H, num_layers=2, batch_first=True)
    x = np.random.default_rng(2).normal(size=(B, T, H)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x))[0].numpy()
    sd = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    first, second = (from_torch(cell, *(sd[f"{w}_l{k}"] for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")))
                     for k in (0, 1))
    params = {"layer_0": first, "layers": jax.tree_util.tree_map(lambda a: a[None], second)}
    stack = LayerStack(hidden_dim=H, num_layers=2, layer_options=(("cell", cell), ("recurrence", recurrence)))
    got = jax.jit(stack.apply)({"params": params}, x.swapaxes(0, 1)).swapaxes(0, 1)  # time-major stack
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def model_config(*overrides, **fields):
    return dataclasses.replace(compose_config(list(overrides)).model, **fields)


@pytest.mark.parametrize("cell,scheme", fast_first([("rnn", "identity"), ("lstm", "orthogonal")], why="cross-product"))
def test_vmap_init_matches_scan_init(cell, scheme):
    x = jnp.zeros((2, 3, 2))
    trees = {}
    for how in ("scan", "vmap"):
        config = model_config(f"model={cell}", "hidden_dim=32", "num_layers=6", init=scheme, stack_init=how)
        trees[how] = init(build_model(config, 1), x)
    scan, vmap = trees["scan"], trees["vmap"]
    assert jax.tree_util.tree_map(jnp.shape, scan) == jax.tree_util.tree_map(jnp.shape, vmap)
    assert jax.tree_util.tree_map(lambda a: a.dtype, scan) == jax.tree_util.tree_map(lambda a: a.dtype, vmap)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(scan), jax.tree_util.tree_leaves(vmap)):
        a, b = np.asarray(a), np.asarray(b)
        # Same distribution: matching moments (thousands of draws per stacked matrix), same extremes.
        assert abs(a.mean() - b.mean()) < 0.02 and abs(a.std() - b.std()) < 0.1 * a.std() + 1e-6, jax.tree_util.keystr(path)
        assert abs(np.abs(a).max() - np.abs(b).max()) < 0.2 * np.abs(a).max() + 1e-6, jax.tree_util.keystr(path)
    for how in ("scan", "vmap"):  # independent draws per layer either way: no two of the 6 layers alike
        stack = trees[how]["stack"]
        at = lambda tree, path: functools.reduce(dict.__getitem__, path, tree)  # noqa: E731
        per_layer = lambda *path: [np.asarray(at(stack["layer_0"], path)),  # noqa: E731  (layer_0, then the 5 stacked)
                                   *np.asarray(at(stack["layers"], path))]
        for path in [("W_xh",), ("cell", "W_hh")] if scheme != "identity" else [("W_xh",)]:  # W_xh: drawn either way
            layers = per_layer(*path)
            assert len(layers) == 6 and all(a.shape == layers[0].shape for a in layers), (how, path)
            for i in range(6):
                for j in range(i):
                    assert not np.allclose(layers[i], layers[j]), (how, path, i, j)
        if scheme == "identity":  # W_hh is I in every layer, not drawn
            np.testing.assert_array_equal(np.stack(per_layer("cell", "W_hh")), np.broadcast_to(np.eye(32), (6, 32, 32)))


def test_lstm_forget_bias_is_a_config_key():
    config = model_config("model=lstm", "hidden_dim=4", "num_layers=3", forget_bias=2.5)
    stack = init(build_model(config, 1), jnp.zeros((1, 3, 2)))["stack"]
    gates = [0.0] * 4 + [2.5] * 4 + [0.0] * 8
    np.testing.assert_array_equal(np.asarray(stack["layer_0"]["b"]), gates)
    np.testing.assert_array_equal(np.asarray(stack["layers"]["b"]), np.repeat([gates], 2, axis=0))


def loss_and_grads(config, seq_len=9, seed=0):
    """Loss and gradients of a sum-of-squares loss on random inputs (jitted)."""
    model = build_model(config, 2)
    x = jax.random.normal(jax.random.key(seed), (2, seq_len, 3))
    params = random_like(init(model, x, seed=1), seed=5)
    loss = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("cell,activation", fast_first([("rnn", "tanh"), ("gru", "tanh"), ("rnn", "relu"), ("lstm", "tanh")],
                                                        why="cross-product"))
def test_custom_vjp_gives_the_same_loss_and_gradients_as_autodiff(cell, activation):
    """rnnlab/recurrence.py's hand-written backward against jax.grad through the scanned cell."""
    base = model_config(f"model={cell}", f"model.activation={activation}", "hidden_dim=8", "num_layers=2",
                        recurrence="autodiff")
    want_loss, want_grads = loss_and_grads(base)
    got_loss, got_grads = loss_and_grads(dataclasses.replace(base, recurrence="custom_vjp", unroll=2))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for path, a in jax.tree_util.tree_leaves_with_path(got_grads):
        b = _leaf(want_grads, path)
        assert np.abs(np.asarray(b)).max() > 0, path  # every parameter is reached
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6, err_msg=str(path))


def test_custom_vjp_keeps_the_parameter_layout_and_initial_values():
    base = model_config("model=gru", "hidden_dim=8", "num_layers=2", recurrence="autodiff")
    x = jnp.zeros((1, 3, 2))
    want = init(build_model(base, 1), x)
    got = init(build_model(dataclasses.replace(base, recurrence="custom_vjp"), 1), x)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.slow("long")
def test_remat_gives_the_same_loss_and_gradients():
    base = model_config("model=lstm", "hidden_dim=8", "num_layers=2", recurrence="autodiff")
    want_loss, want_grads = loss_and_grads(base)
    got_loss, got_grads = loss_and_grads(dataclasses.replace(base, remat=True, unroll=2))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_remat_lowers_peak_memory_on_a_long_sequence():
    """XLA's memory analysis of the compiled gradient: remat stores the carry, not every gate."""
    x = jnp.zeros((4, 400, 2))

    def temp_bytes(remat):
        model = build_model(model_config("model=lstm", "hidden_dim=32", "num_layers=1", remat=remat, recurrence="autodiff"), 1)
        params = init(model, x[:, :2])
        grad = jax.jit(jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x))))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(remat=True) < 0.7 * temp_bytes(remat=False)


@pytest.mark.slow("long")
def test_bfloat16_trains_and_stays_finite():
    config = model_config("model=lstm", "hidden_dim=16", "num_layers=2", dtype="bfloat16")
    model = build_model(config, 1)
    x = jax.random.uniform(jax.random.key(0), (8, 20, 2))
    target = x[:, :, :1].sum(axis=1)
    params = init(model, x)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply({"params": p}, x)[:, -1] - target) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert jax.eval_shape(lambda p: model.apply({"params": p}, x), params).dtype == jnp.float32
    leaves = jax.tree_util.tree_leaves((params, opt_state))
    assert all(leaf.dtype == jnp.float32 for leaf in leaves if jnp.issubdtype(leaf.dtype, jnp.floating))


@pytest.mark.slow("long")
def test_dropout_only_in_training_and_driven_by_the_dropout_rng():
    config = model_config("model=gru", "hidden_dim=8", "num_layers=2", dropout=0.5)
    model, plain = build_model(config, 1), build_model(dataclasses.replace(config, dropout=0.0), 1)
    x = jax.random.normal(jax.random.key(0), (2, 5, 2))
    params = {"params": init(model, x)}
    run = jax.jit(lambda key: model.apply(params, x, train=True, rngs={"dropout": key}))
    evaluated = jax.jit(model.apply)(params, x)  # train=False: deterministic, no rng needed
    np.testing.assert_array_equal(np.asarray(evaluated), np.asarray(jax.jit(plain.apply)(params, x)))
    a, b, c = run(jax.random.key(2)), run(jax.random.key(2)), run(jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c)) and not np.allclose(np.asarray(a), np.asarray(evaluated))
