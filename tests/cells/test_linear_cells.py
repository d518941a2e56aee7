"""minGRU, minLSTM, LRU and RG-LRU against NumPy loops of their papers' equations; the two time scans
and the hand-written backward against autodiff; initialisation; residual blocks; the config's refusals."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config
from rnnlab.cells import get_cell
from rnnlab.config import ConfigError
from rnnlab.models import RecurrentLayer, build_model
from rnnlab.recurrence import linear_recurrence, scan_linear

B, T, I, H = 3, 9, 4, 4
LINEAR_CELLS = ["mingru", "minlstm", "lru", "rglru"]


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def softplus(v):
    return np.log1p(np.exp(v))


def numpy_cell(cell, x, p):
    """The papers' equations one step at a time, float64. x: [B, T, I] (I = H where the cell reads x)."""
    u_all = x @ p["W_xh"] + p["b"]
    c = p.get("cell", {})
    h = np.zeros((x.shape[0], H), np.complex128 if cell == "lru" else np.float64)
    ys = []
    for t in range(x.shape[1]):
        u, x_t = u_all[:, t], x[:, t]
        if cell == "mingru":
            z = sigmoid(u[:, :H])
            h = (1 - z) * h + z * u[:, H:]
            y = h
        elif cell == "minlstm":
            f, i, h_tilde = sigmoid(u[:, :H]), sigmoid(u[:, H:2 * H]), u[:, 2 * H:]
            h = f / (f + i) * h + i / (f + i) * h_tilde
            y = h
        elif cell == "rglru":
            r, i = sigmoid(u[:, :H]), sigmoid(u[:, H:])
            a = np.exp(-8.0 * r * softplus(c["Lambda"]))
            h = a * h + np.sqrt(1 - a**2) * (i * x_t)
            y = h
        else:  # lru
            lam = np.exp(-np.exp(c["nu"]) + 1j * np.exp(c["theta"]))
            gamma = np.sqrt(1 - np.abs(lam) ** 2)
            h = lam * h + gamma * (u[:, :H] + 1j * u[:, H:])
            y = np.real(h @ (c["C_re"] + 1j * c["C_im"])) + c["D"] * x_t
        ys.append(y)
    return np.stack(ys, axis=1)


def layer_and_params(cell, seed=1, **fields):
    layer = RecurrentLayer(hidden_dim=H, cell=cell, init_scheme="default", **fields)
    x_tm = jnp.zeros((T, B, H))
    params = jax.jit(layer.init)(jax.random.key(seed), x_tm)["params"]
    rng = np.random.default_rng(seed)
    # Perturb the input weights and biases; keep the cells' own parameters as initialised (in range).
    params = {**params, "W_xh": params["W_xh"] + 0.3 * rng.normal(size=params["W_xh"].shape),
              "b": params["b"] + 0.3 * rng.normal(size=params["b"].shape)}
    return layer, params


def as_f64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


@pytest.mark.parametrize("time_scan", ["sequential", "associative"])
@pytest.mark.parametrize("recurrence", ["custom_vjp", "autodiff"])
@pytest.mark.parametrize("cell", LINEAR_CELLS)
def test_cell_matches_numpy_equations(cell, recurrence, time_scan):
    layer, params = layer_and_params(cell, recurrence=recurrence, time_scan=time_scan)
    x = np.random.default_rng(0).normal(size=(B, T, H)).astype(np.float32)
    got = jax.jit(layer.apply)({"params": params}, x.swapaxes(0, 1))[0].swapaxes(0, 1)
    np.testing.assert_allclose(np.asarray(got), numpy_cell(cell, x.astype(np.float64), as_f64(params)),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.slow("long")
@pytest.mark.parametrize("cell", LINEAR_CELLS)
def test_scans_and_backward_agree_with_autodiff_of_the_sequential_scan(cell):
    """Values and gradients (parameters and input) of every (recurrence, time_scan) pair against
    jax.grad through the plain lax.scan."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(T, B, H)), jnp.float32)
    g = jnp.asarray(np.random.default_rng(4).normal(size=(T, B, H)), jnp.float32)

    def loss_and_grads(recurrence, time_scan):
        layer, params = layer_and_params(cell, recurrence=recurrence, time_scan=time_scan)
        loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x)[0] * g)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

    want_loss, want_grads = loss_and_grads("autodiff", "sequential")
    for recurrence, time_scan in [("custom_vjp", "sequential"), ("custom_vjp", "associative"),
                                  ("autodiff", "associative")]:
        loss, grads = loss_and_grads(recurrence, time_scan)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.slow("long")
def test_linear_recurrence_gradient_against_numpy():
    """The hand-written backward against the reverse recurrence written out in NumPy, complex included."""
    rng = np.random.default_rng(5)
    a = rng.uniform(0.3, 1.0, (T, B, H)) * np.exp(1j * rng.uniform(0, 3, (T, B, H)))
    b = rng.normal(size=(T, B, H)) + 1j * rng.normal(size=(T, B, H))
    g = rng.normal(size=(T, B, H)) + 1j * rng.normal(size=(T, B, H))
    hs = np.zeros_like(b)
    for t in range(T):
        hs[t] = a[t] * (hs[t - 1] if t else 0) + b[t]
    dh, da = np.zeros_like(b), np.zeros_like(a)
    carry = 0
    for t in reversed(range(T)):
        carry = g[t] + (a[t + 1] * carry if t + 1 < T else 0)
        dh[t] = carry
        da[t] = carry * (hs[t - 1] if t else 0)
    for time_scan in ("sequential", "associative"):
        out, vjp = jax.vjp(lambda a, b: linear_recurrence(a, b, time_scan, 1), jnp.asarray(a, jnp.complex64),
                           jnp.asarray(b, jnp.complex64))
        got_da, got_db = vjp(jnp.asarray(g, jnp.complex64))
        np.testing.assert_allclose(out, hs, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_db, dh, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got_da, da, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(scan_linear(jnp.asarray(a, jnp.complex64), jnp.asarray(b, jnp.complex64),
                                               time_scan, 1, reverse=True)[0],
                                   np.sum([np.prod(a[:t], axis=0) * b[t] for t in range(T)], axis=0),  # h_0 = sum_t a_0..a_{t-1} b_t
                                   rtol=1e-4, atol=1e-4)


def test_lru_eigenvalues_start_on_the_configured_ring():
    cell = get_cell("lru")(256, r_min=0.5, r_max=0.8, max_phase=math.pi / 10)
    specs = cell.param_specs()
    keys = jax.random.split(jax.random.key(0), 2)
    params = {name: init(k, shape) for (name, (shape, init)), k in zip(list(specs.items())[:2], keys)}
    lam = np.asarray(cell.eigenvalues(params))
    assert 0.5 <= np.abs(lam).min() and np.abs(lam).max() <= 0.8
    assert np.abs(lam).max() - np.abs(lam).min() > 0.2  # spread over the ring, not one radius
    phases = np.angle(lam)
    assert 0 <= phases.min() and phases.max() <= math.pi / 10


def test_rglru_decay_starts_in_the_papers_range():
    (shape, init), = get_cell("rglru")(512).param_specs().values()
    a_c = np.exp(-8.0 * softplus(np.asarray(init(jax.random.key(0), shape), np.float64)))
    assert 0.9 - 1e-6 <= a_c.min() and a_c.max() <= 0.999 + 1e-6 and a_c.max() - a_c.min() > 0.05


def numpy_rms_norm(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def numpy_gelu(v):  # flax's nn.gelu default: the tanh approximation
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))


def test_residual_block_matches_numpy():
    """model.block=residual, one minGRU layer: projection, x + layer(norm(x)), x + MLP(norm(x)), final norm, readout."""
    config = compose_config(["model=mingru", "model.block=residual", f"hidden_dim={H}", "num_layers=1"]).model
    model = build_model(config, output_dim=2, platform="cpu")
    x = np.random.default_rng(6).normal(size=(B, T, I)).astype(np.float32)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    params = jax.tree_util.tree_map(lambda p: p + 0.1 * np.random.default_rng(7).normal(size=p.shape), params)
    got = jax.jit(model.apply)({"params": params}, x)
    p = as_f64(params)
    blk = p["stack"]["layer_0"]
    h = x.astype(np.float64) @ p["input_proj"]["kernel"] + p["input_proj"]["bias"]
    h = h + numpy_cell("mingru", numpy_rms_norm(h, blk["norm_0"]["scale"]), blk["recurrence"])
    n = numpy_rms_norm(h, blk["norm_1"]["scale"])
    mlp = blk["mlp"]
    h = h + (numpy_gelu(n @ mlp["gate"]["kernel"]) * (n @ mlp["up"]["kernel"])) @ mlp["down"]["kernel"]
    want = numpy_rms_norm(h, p["final_norm"]["scale"]) @ p["readout"]["kernel"] + p["readout"]["bias"]
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
def test_a_classic_cell_refuses_the_associative_scan(cell):
    with pytest.raises(ConfigError, match=r"^key 'model.time_scan': got 'associative', allowed for cell"):
        compose_config([f"model={cell}", "model.time_scan=associative"])


@pytest.mark.parametrize("overrides, message", [
    (["model=lru", "model.r_min=0.9", "model.r_max=0.5"], r"^keys 'model.r_min', 'model.r_max': got 0.9, 0.5"),
    (["model=lru", "model.r_max=1.0"], r"r_max < 1"),
    (["model=lru", "model.max_phase=0"], r"^key 'model.max_phase': got 0.0, must be > 0"),
    (["model=mingru", "model.recurrence=autodiff", "model.remat=true"], r"^key 'model.remat': got true"),
    (["model=mingru", "model.block=dense"], r"^key 'model.block': got 'dense', allowed: plain, residual"),
    (["model=mingru", "+model.r_min=0.5"], r"^unknown key 'model.r_min'"),
])
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_cell_options_are_config_keys_that_round_trip():
    from rnnlab.config import flatten, replace

    config = compose_config(["model=lru", "model.r_min=0.25"])
    assert flatten(config)["model.r_min"] == 0.25 and "model.options" not in flatten(config)
    assert config.model.make_cell().r_min == 0.25
    assert replace(config, **{"model.r_max": 0.5}).model.make_cell().r_max == 0.5


@pytest.mark.slow("long")
@pytest.mark.parametrize("block", ["plain", "residual"])
@pytest.mark.parametrize("cell", LINEAR_CELLS)
def test_sequential_equals_associative_for_the_whole_model(cell, block):
    """Values and gradients of a two-layer model (layer scan, both blocks) under both time scans."""
    x = jnp.asarray(np.random.default_rng(8).normal(size=(B, T, 2)), jnp.float32)
    results = []
    for time_scan in ("sequential", "associative"):
        config = compose_config([f"model={cell}", f"model.block={block}", f"model.time_scan={time_scan}",
                                 f"hidden_dim={H}", "num_layers=2"]).model
        model = build_model(config, output_dim=3, platform="cpu")
        params = jax.jit(model.init)(jax.random.key(0), x)
        loss = lambda p: jnp.sum(jnp.sin(model.apply(p, x)))  # noqa: E731
        results.append(jax.jit(jax.value_and_grad(loss))(params))
    (loss_seq, grads_seq), (loss_assoc, grads_assoc) = results
    np.testing.assert_allclose(loss_assoc, loss_seq, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(grads_assoc), jax.tree_util.tree_leaves(grads_seq)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
