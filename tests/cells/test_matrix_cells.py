"""The matrix-state cells (gla, linear_attention, deltanet, gated_deltanet) as whole layers against a
float64 NumPy loop of their papers' equations, every form, values and gradients; chunked equals
sequential through a whole model; the config's refusals; the state size."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first, tiny_config
from rnnlab.cells import get_cell
from rnnlab.config import ConfigError
from rnnlab.models import build_model

T, B, H, HEADS, CONV, CHUNK = 11, 2, 8, 2, 3, 4  # T not a multiple of the chunk
FORMS = {"gla": ["sequential", "associative", "chunked"], "linear_attention": ["sequential", "chunked"],
         "deltanet": ["sequential", "chunked"], "gated_deltanet": ["sequential", "chunked"],
         "deltaproduct": ["sequential", "chunked"]}
CASES = [(cell, form) for cell, forms in FORMS.items() for form in forms]
# The state-tracking switches (Grazzi et al. 2025; DeltaProduct's n_h): (cell, fields) beside the defaults.
SWITCHED = [("deltanet", {"allow_neg_eigval": True}), ("gated_deltanet", {"allow_neg_eigval": True}),
            ("deltaproduct", {"allow_neg_eigval": True, "num_householder": 3}), ("deltaproduct", {"num_householder": 1})]


def make(cell_name, **fields):
    cell = get_cell(cell_name)(H, "default", num_heads=HEADS, conv_size=CONV, chunk_size=CHUNK, **fields)
    keys = jax.random.split(jax.random.key(3), 8)
    params = {name: init(key, shape) for key, (name, (shape, init)) in zip(keys, sorted(cell.param_specs().items()))}
    rng = np.random.default_rng(5)
    params["norm"] = params["norm"] + 0.2 * rng.normal(size=params["norm"].shape)  # not all ones
    u = rng.normal(size=(T, B, cell.input_width)).astype(np.float32)
    if cell.gated if hasattr(cell, "gated") else cell_name == "gla":  # some strongly decaying steps
        width = cell.qkv_width()
        u[..., width:width + cell.extra_width()] -= 2.0 * rng.random(size=(T, B, cell.extra_width()))
    return cell, params, u


def silu(v):
    return v / (1 + np.exp(-v))


def sigmoid(v):
    return 1 / (1 + np.exp(-v))


def softplus(v):
    return np.log1p(np.exp(v))


def numpy_layer(name, u, p, allow_neg_eigval=False, num_householder=None):
    """The paper's layer one step at a time, float64. u: [T, B, W] -> [T, B, H]. DeltaProduct (Siems et al.
    2025): per token the gate, then n delta-rule steps, as fla's naive_recurrent_gated_delta_product."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    u = np.asarray(u, np.float64)
    d = H // HEADS
    n = num_householder or (2 if name == "deltaproduct" else 1)
    qkv = u[..., :(1 + 2 * n) * H]
    conv = np.zeros_like(qkv)
    for t in range(T):
        for i in range(CONV):
            if t - CONV + 1 + i >= 0:
                conv[t] += p["conv"][i] * qkv[t - CONV + 1 + i]
    conv = silu(conv)
    q = conv[..., :H].reshape(T, B, HEADS, d)
    k, v = (conv[..., a:a + n * H].reshape(T, B, n, HEADS, d) for a in (H, (1 + n) * H))  # fla's (n, heads, d)
    extra = u[..., (1 + 2 * n) * H:]
    out = np.zeros((T, B, H))
    for b in range(B):
        for h in range(HEADS):
            S = np.zeros((d, d))
            for t in range(T):
                qt, kt, vt = q[t, b, h], k[t, b, 0, h], v[t, b, 0, h]
                if name in ("gla", "linear_attention"):
                    alpha = np.ones(d)
                    if name == "gla":
                        alpha = sigmoid(extra[t, b, h * d:(h + 1) * d]) ** (1 / 16)
                    S = np.diag(alpha) @ S + np.outer(kt, vt)  # S_t = diag(alpha_t) S_{t-1} + k_t^T v_t
                else:
                    qt = qt / np.linalg.norm(qt)
                    if name != "deltanet":
                        S = S * np.exp(-np.exp(p["A_log"][h]) * softplus(extra[t, b, n * HEADS + h] + p["dt_bias"][h]))
                    for j in range(n):
                        kt, vt = k[t, b, j, h] / np.linalg.norm(k[t, b, j, h]), v[t, b, j, h]
                        beta = sigmoid(extra[t, b, j * HEADS + h]) * (2 if allow_neg_eigval else 1)
                        # paper (columns): S_t = S_{t-1} (I - beta k k^T) + beta v k^T; here its transpose
                        S = (np.eye(d) - beta * np.outer(kt, kt)) @ S + beta * np.outer(kt, vt)
                o = qt @ S / math.sqrt(d)
                out[t, b, h * d:(h + 1) * d] = o / np.sqrt(np.mean(o * o) + 1e-6) * p["norm"]
    if name in ("gla", "gated_deltanet", "deltaproduct"):
        out = out * silu(u[..., -H:])
    return out @ p["W_o"]


def jax_layer(cell, form):
    return jax.jit(lambda params, u: cell.mix(params, u, None, form, 1, "autodiff"))


@pytest.mark.parametrize("cell_name, form", CASES)
def test_every_form_equals_the_papers_equations(cell_name, form):
    cell, params, u = make(cell_name)
    got = np.asarray(jax_layer(cell, form)(params, u))
    want = numpy_layer(cell_name, u, params)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("cell_name, fields", SWITCHED)
@pytest.mark.parametrize("form", ["sequential", "chunked"])
def test_switched_forms_equal_the_papers_equations(cell_name, fields, form):
    cell, params, u = make(cell_name, **fields)
    got = np.asarray(jax_layer(cell, form)(params, u))
    want = numpy_layer(cell_name, u, params, **fields)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    if fields.get("allow_neg_eigval"):  # the switch matters
        assert np.abs(want - numpy_layer(cell_name, u, params, num_householder=fields.get("num_householder"))).max() \
            > 0.05 * np.abs(want).max()


@pytest.mark.slow("long")
def test_one_householder_step_is_gated_deltanet():
    """deltaproduct with num_householder=1 is gated_deltanet, parameter for parameter, bit for bit."""
    product, params, u = make("deltaproduct", num_householder=1)
    gated = get_cell("gated_deltanet")(H, "default", num_heads=HEADS, conv_size=CONV, chunk_size=CHUNK)
    assert product.input_width == gated.input_width
    assert {k: v[0] for k, v in product.param_specs().items()} == {k: v[0] for k, v in gated.param_specs().items()}
    for form in ("sequential", "chunked"):
        np.testing.assert_array_equal(np.asarray(jax_layer(product, form)(params, u)),
                                      np.asarray(jax_layer(gated, form)(params, u)))


@pytest.mark.parametrize("cell_name, form", fast_first(sorted(CASES, key=lambda case: case[1] != "chunked"), keep=4,
                                                     why="cross-product"))
def test_every_form_has_the_gradient_of_the_papers_equations(cell_name, form):
    """Directional derivatives in u and in every parameter against central differences of the NumPy loop."""
    cell, params, u = make(cell_name)
    rng = np.random.default_rng(7)
    probe = rng.normal(size=(T, B, H))
    loss = lambda p, x: jnp.sum(probe * cell.mix(p, x, None, form, 1, "autodiff"))  # noqa: E731
    g_params, g_u = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(u))
    for name, grad, value in [("u", g_u, u)] + [(k, g_params[k], params[k]) for k in sorted(params)]:
        direction = rng.normal(size=np.shape(value))
        eps = 1e-5

        def f(sign):
            shifted = np.asarray(value, np.float64) + sign * eps * direction
            if name == "u":
                return np.sum(probe * numpy_layer(cell_name, shifted, params))
            return np.sum(probe * numpy_layer(cell_name, u, {**params, name: shifted}))

        numeric = (f(1) - f(-1)) / (2 * eps)
        analytic = float(np.sum(np.asarray(grad, np.float64) * direction))
        scale = np.linalg.norm(np.asarray(grad)) * np.linalg.norm(direction)
        assert abs(analytic - numeric) <= 1e-4 * scale + 1e-6, (name, analytic, numeric)


@pytest.mark.parametrize("cell_name", fast_first(["gated_deltanet", "gla"], why="cross-product", first_why="long"))
def test_chunked_equals_sequential_through_a_whole_model(cell_name):
    """Two residual layers of the cell, values and every parameter's gradient (float32, 1e-5 relative)."""
    outputs = {}
    for form in ("sequential", "chunked"):
        config = tiny_config(f"model={cell_name}", f"model.time_scan={form}", "model.chunk_size=4",
                             "model.num_heads=2", "data.seq_len=13").model
        model = build_model(config, 3, "cpu")
        x = np.random.default_rng(0).normal(size=(2, 13, 5)).astype(np.float32)
        params = jax.jit(model.init)(jax.random.key(0), x)["params"]
        loss = lambda p: jnp.sum(jnp.sin(model.apply({"params": p}, x)))  # noqa: E731
        outputs[form] = jax.jit(jax.value_and_grad(loss))(params)
    (v_seq, g_seq), (v_chunk, g_chunk) = outputs["sequential"], outputs["chunked"]
    np.testing.assert_allclose(v_chunk, v_seq, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g_chunk), jax.tree_util.tree_leaves(g_seq)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(np.asarray(b)).max())


def test_state_size_is_heads_times_dk_times_dv():
    cell = get_cell("deltanet")(64, num_heads=4)
    assert cell.state_floats(100) == 4 * 16 * 16 == cell.hidden_dim ** 2 // 4


@pytest.mark.parametrize("override, key", [("model.num_heads=3", "model.num_heads"),
                                           ("model.chunk_size=0", "model.chunk_size"),
                                           ("model.conv_size=-1", "model.conv_size"),
                                           ("model.time_scan=associative", "model.time_scan")])
def test_refusals_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        tiny_config("model=deltanet", override)
