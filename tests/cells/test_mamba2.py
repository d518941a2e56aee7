"""Mamba-2's SSD layer against a float64 NumPy loop of the paper's equations (per head h: [P, N]): both
forms' values and gradients (directional finite differences of the loop), the forms against each
other, the chunked SSD kernel alone, the reference's initialisation, and its refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config
from rnnlab.cells import get_cell
from rnnlab.cells.gla_forms import ssd_chunked
from rnnlab.config import ConfigError
from test_attention_mamba import apply_fn, assert_close, assert_forms_agree, f32, make_layer, silu, softplus, with_leaf
from test_matrix_forms import numpy_gla

B, T, I = 2, 7, 5
# inner width 8, heads of 4 (2 heads), N = 3; T=7 ends mid-chunk
MAMBA2 = dict(hidden_dim=4, state_size=3, head_dim=4, conv_size=3, expand=2, chunk_size=3)


def numpy_mamba2(x, p, state_size, head_dim, conv_size, expand, allow_neg_eigval=False, **_):
    """Mamba-2 one step at a time, float64 (Dao & Gu 2024, Sec. 7). x: [B, T, I] -> [B, T, H].
    `allow_neg_eigval`: the decay 2 exp(Delta A) - 1 (Grazzi et al. 2025)."""
    c = p["cell"]
    u = x @ p["W_xh"]  # in_proj: no bias
    inner = expand * c["W_out"].shape[1]
    n, width = state_size, min(head_dim, inner)
    heads = inner // width
    z, xbc, dt = u[..., :inner], u[..., inner:2 * inner + 2 * n], u[..., 2 * inner + 2 * n:]
    A = -np.exp(c["A_log"])  # [heads]
    window = np.zeros((u.shape[0], conv_size, xbc.shape[-1]))
    h = np.zeros((u.shape[0], heads, width, n))
    out = []
    for t in range(u.shape[1]):
        if conv_size:
            window = np.concatenate([window[:, 1:], xbc[:, t][:, None]], axis=1)
            conv = silu(np.einsum("bkd,kd->bd", window, c["conv_w"]) + c["conv_b"])
        else:
            conv = silu(xbc[:, t])
        x_t, B_t, C_t = conv[:, :inner].reshape(-1, heads, width), conv[:, inner:inner + n], conv[:, inner + n:]
        delta = softplus(dt[:, t] + c["dt_bias"])  # [B, heads]
        decay = 2 * np.exp(delta * A) - 1 if allow_neg_eigval else np.exp(delta * A)
        h = (decay[:, :, None, None] * h
             + (delta[:, :, None] * x_t)[..., None] * B_t[:, None, None, :])
        y = np.einsum("bhpn,bn->bhp", h, C_t) + c["D"][:, None] * x_t
        y = y.reshape(-1, inner) * silu(z[:, t])
        y = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + 1e-5) * c["norm"]
        out.append(y @ c["W_out"])
    return np.stack(out, axis=1)


def key_of(fields):
    return tuple(sorted(fields.items()))


@functools.cache
def random_params(fields_key, seed=1):
    """Random float64 params: weights N(0, 1/fan_in), vectors N(0, 0.25); A = exp(A_log) in about [1, 4],
    D about 1, dt_bias in [-2, 1] (Delta ~ 0.1 .. 1.3, decays visible within T steps), norm about 1."""
    shapes = jax.eval_shape(make_layer("mamba2", dict(fields_key)).init, jax.random.key(0), jnp.zeros((T, B, I)))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name, shape = path[-1].key, leaf.shape
        if name == "A_log":
            return rng.uniform(0, np.log(4), size=shape)
        if name in ("D", "norm"):
            return 1 + 0.2 * rng.normal(size=shape)
        if name == "dt_bias":
            return rng.uniform(-2, 1, size=shape)
        return rng.normal(size=shape) * (0.5 if len(shape) == 1 else shape[0] ** -0.5)

    return jax.tree_util.tree_map_with_path(draw, shapes["params"])


def inputs(seed=0):
    return np.random.default_rng(seed).normal(size=(B, T, I))


@functools.cache
def jitted_apply(fields_key, time_scan):
    return jax.jit(apply_fn(make_layer("mamba2", dict(fields_key), time_scan=time_scan)))


@pytest.mark.parametrize("time_scan", ["sequential", "chunked"])
@pytest.mark.parametrize("fields", [MAMBA2, {**MAMBA2, "conv_size": 0, "chunk_size": 4},
                                    {**MAMBA2, "head_dim": 64, "chunk_size": 7}],
                         ids=["two_heads", "no_conv", "one_head_below_head_dim"])
def test_mamba2_matches_numpy(fields, time_scan):
    params, x = random_params(key_of(fields)), inputs()
    got = jitted_apply(key_of(fields), time_scan)(f32(params), f32(x))
    assert_close(got, numpy_mamba2(x, params, **fields))


MAMBA2_NEG = {**MAMBA2, "allow_neg_eigval": True}


@pytest.mark.parametrize("time_scan", ["sequential", "chunked"])
@pytest.mark.parametrize("fields", [MAMBA2_NEG, {**MAMBA2_NEG, "chunk_size": 7}], ids=["chunk3", "chunk7"])
def test_mamba2_with_negative_eigenvalues_matches_numpy(fields, time_scan):
    """Grazzi et al.'s switch: with these draws Delta A spans about [-5, -0.1], decays of both signs."""
    params, x = random_params(key_of(fields)), inputs()
    got = jitted_apply(key_of(fields), time_scan)(f32(params), f32(x))
    want = numpy_mamba2(x, params, **fields)
    assert_close(got, want)
    assert np.max(np.abs(want - numpy_mamba2(x, params, **MAMBA2))) > 0.05 * np.max(np.abs(want))  # the switch matters


@pytest.mark.slow("long")
def test_mamba2_forms_agree_with_negative_eigenvalues():
    params, x = f32(random_params(key_of(MAMBA2_NEG))), f32(inputs())
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, MAMBA2["hidden_dim"])), jnp.float32)
    layers = [make_layer("mamba2", {**MAMBA2_NEG, "chunk_size": c}, time_scan=s)
              for s, c in [("sequential", 3), ("chunked", 3), ("chunked", 8)]]
    assert_forms_agree(layers, params, x, weights)


@pytest.mark.parametrize("fields", [MAMBA2, MAMBA2_NEG], ids=["positive", "neg_eigval"])
@pytest.mark.parametrize("time_scan", ["sequential", "chunked"])
def test_mamba2_gradients_match_finite_differences(time_scan, fields):
    """jax.grad of sum(out * R) along random directions of x and of the SSM's parameters, against central
    differences of the float64 loop."""
    params, x = random_params(key_of(fields)), inputs()
    weights = np.random.default_rng(7).normal(size=(B, T, MAMBA2["hidden_dim"]))
    apply = apply_fn(make_layer("mamba2", fields, time_scan=time_scan))
    loss = lambda p, x: jnp.sum(apply(p, x) * jnp.asarray(weights, jnp.float32))  # noqa: E731
    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(f32(params), f32(x))
    rng = np.random.default_rng(11)
    eps = 1e-5
    for path in [None, ("cell", "A_log"), ("cell", "dt_bias"), ("cell", "conv_w"), ("cell", "D"), ("W_xh",)]:
        value = x if path is None else functools.reduce(lambda t, k: t[k], path, params)
        grad = np.asarray(g_x if path is None else functools.reduce(lambda t, k: t[k], path, g_params), np.float64)

        def f(v, path=path):
            if path is None:
                return np.sum(numpy_mamba2(v, params, **fields) * weights)
            return np.sum(numpy_mamba2(x, with_leaf(params, path, v), **fields) * weights)

        for _ in range(2):
            direction = rng.normal(size=value.shape)
            fd = (f(value + eps * direction) - f(value - eps * direction)) / (2 * eps)
            ad = np.sum(grad * direction)
            scale = np.linalg.norm(grad) * np.linalg.norm(direction)
            assert abs(ad - fd) <= 2e-5 * scale, (time_scan, path, ad, fd, scale)


@pytest.mark.slow("long")
def test_mamba2_forms_agree_values_and_gradients():
    """chunked (chunks of 3 and 2; T=7 ends mid-chunk) against sequential: outputs, every parameter's gradient and x's."""
    params, x = f32(random_params(key_of(MAMBA2))), f32(inputs())
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, MAMBA2["hidden_dim"])), jnp.float32)
    layers = [make_layer("mamba2", {**MAMBA2, "chunk_size": c}, time_scan=s)
              for s, c in [("sequential", 3), ("chunked", 3), ("chunked", 2), ("chunked", 8)]]
    assert_forms_agree(layers, params, x, weights)


@pytest.mark.parametrize("length", [11, 3, 12])
def test_ssd_chunked_is_gla_with_one_gate_per_head(length):
    """The chunked kernel alone, q and k shared by the heads (one group) and per head, against the GLA
    loop with the head's gate on every key dimension; strong gates (down to -30 per step) included."""
    rng = np.random.default_rng(length)
    heads, dk, dv = 3, 4, 5
    v = rng.normal(size=(length, B, heads, dv))
    log_alpha = np.where(rng.random((length, B, heads)) < 0.5, rng.uniform(-0.1, 0, (length, B, heads)),
                         rng.uniform(-30, 0, (length, B, heads)))
    for groups in (1, heads):
        q, k = 0.5 * rng.normal(size=(2, length, B, groups, dk))
        got = jax.jit(ssd_chunked, static_argnums=4)(*f32([q, k, v, log_alpha]), 4)
        shape = (length, B, heads, dk)
        want = numpy_gla(np.broadcast_to(q, shape), np.broadcast_to(k, shape), v,
                         np.broadcast_to(log_alpha[..., None], shape))
        assert_close(got, want)


def test_mamba2_starts_as_the_reference_initialises_it():
    """mamba_ssm's Mamba2: A ~ U[1, 16] and D = 1 per head, softplus(dt_bias) log-uniform in [1e-3, 1e-1],
    conv weight and bias U(+-K^-1/2), out_proj U(+-D^-1/2), norm weight 1, no bias on in_proj or out_proj."""
    cell = get_cell("mamba2")(hidden_dim=256, state_size=16, head_dim=8)  # inner 512, 64 heads
    specs = cell.param_specs()
    keys = dict(zip(specs, jax.random.split(jax.random.key(0), len(specs))))
    p = {name: np.asarray(init(keys[name], shape), np.float64) for name, (shape, init) in specs.items()}
    a = np.exp(p["A_log"])
    assert p["A_log"].shape == (64,) and 1 <= a.min() and a.max() <= 16 and a.max() - a.min() > 10
    np.testing.assert_array_equal(p["D"], np.ones(64))
    np.testing.assert_array_equal(p["norm"], np.ones(512))
    dt = softplus(p["dt_bias"])
    assert 1e-3 * (1 - 1e-4) <= dt.min() and dt.max() <= 1e-1 * (1 + 1e-4)
    assert abs(np.mean(np.log(dt)) - np.log(1e-2)) < 0.5  # log-uniform: mean of log dt at the log midpoint
    assert p["conv_w"].shape == (4, 512 + 32) and p["conv_b"].shape == (544,)
    for name, bound in (("conv_w", 0.5), ("conv_b", 0.5), ("W_out", 512 ** -0.5)):
        assert np.abs(p[name]).max() <= bound and np.abs(p[name]).max() > 0.9 * bound, name
    assert cell.input_width == 2 * 512 + 2 * 16 + 64 and not cell.input_bias
    assert set(p) == {"conv_w", "conv_b", "dt_bias", "A_log", "D", "norm", "W_out"}  # W_out: no bias
    layer = compose_config(["model=mamba2", "hidden_dim=64"]).model
    assert (layer.block, layer.mlp) == ("residual", "none")


@pytest.mark.parametrize("overrides, message", [
    (["model=mamba2", "model.head_dim=48"],
     r"^key 'model.head_dim': got 48, must divide the inner width expand \* hidden_dim \(128\) or exceed it$"),
    (["model=mamba2", "model.state_size=0"], r"^key 'model.state_size': got 0, must be >= 1$"),
    (["model=mamba2", "model.time_scan=associative"], r"^key 'model.time_scan': got 'associative', allowed for cell"),
])
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(["hidden_dim=64", *overrides])
