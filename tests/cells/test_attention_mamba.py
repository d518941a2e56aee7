"""Causal softmax attention (with RoPE) and Mamba's selective SSM against float64 NumPy loops of their
papers' equations: values, gradients (directional finite differences of the loops), Mamba's forms
against each other, causality, initialisation, state sizes and the config's refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config, fast_first
from rnnlab.cells import mamba as mamba_module
from rnnlab.cells import get_cell
from rnnlab.config import ConfigError
from rnnlab.models import RecurrentLayer

B, T, I = 2, 7, 5
ATTENTION = dict(hidden_dim=8, num_heads=2, block_size=3)  # heads of width 4; T=7 ends mid-block
MAMBA = dict(hidden_dim=4, state_size=3, conv_size=3, expand=2, dt_rank=2, chunk_size=3)  # inner width 8; T=7 ends mid-chunk


def sigmoid(v):
    return 1 / (1 + np.exp(-v))


def silu(v):
    return v * sigmoid(v)


def softplus(v):
    return np.log1p(np.exp(v))


def numpy_attention(x, p, num_heads, window=0):
    """Causal softmax attention, one query at a time, float64. x: [B, T, I] -> [B, T, H]; `window` > 0:
    query t sees keys t - window < s <= t.

    RoPE as a complex rotation: the pair (q_i, q_{i+d/2}) is the complex number q_i + j q_{i+d/2},
    multiplied by exp(j t 10000^(-2i/d)) at position t."""
    u = x @ p["W_xh"] + p["b"]
    h = u.shape[-1] // 3
    q, k, v = u[..., :h], u[..., h:2 * h], u[..., 2 * h:]
    d = h // num_heads
    half = d // 2
    freqs = 10000.0 ** (-2 * np.arange(half) / (2 * half))

    def rotate(vec, t):
        z = (vec[:half] + 1j * vec[half:2 * half]) * np.exp(1j * t * freqs)
        return np.concatenate([z.real, z.imag, vec[2 * half:]])

    out = np.zeros(u.shape[:2] + (h,))
    for b in range(u.shape[0]):
        for t in range(u.shape[1]):
            for head in range(num_heads):
                cols = slice(head * d, (head + 1) * d)
                query = rotate(q[b, t, cols], t)
                first = max(0, t - window + 1) if window else 0
                scores = np.array([rotate(k[b, s, cols], s) @ query for s in range(first, t + 1)]) / np.sqrt(d)
                weights = np.exp(scores - scores.max())
                out[b, t, cols] = (weights / weights.sum()) @ v[b, first:t + 1, cols]
    return out @ p["cell"]["W_o"]


def numpy_mamba(x, p, state_size, conv_size, dt_rank, allow_neg_eigval=False, **_):
    """Mamba's selective SSM one step at a time, float64 (Gu & Dao 2023, Algorithm 2). x: [B, T, I] -> [B, T, H].
    `allow_neg_eigval`: the decay 2 exp(Delta A) - 1 (Grazzi et al. 2025's `deltaA * 2 - 1`)."""
    c = p["cell"]
    u = x @ p["W_xh"] + p.get("b", 0)  # (Mamba's in_proj has no bias)
    inner = u.shape[-1] // 2
    xs, z = u[..., :inner], u[..., inner:]
    A = -np.exp(c["A_log"])  # [D, N]
    window = np.zeros((u.shape[0], conv_size, inner))  # the conv's last conv_size inputs, oldest first
    h = np.zeros((u.shape[0], inner, state_size))
    out = []
    for t in range(u.shape[1]):
        if conv_size:
            window = np.concatenate([window[:, 1:], xs[:, t][:, None]], axis=1)
            conv = np.einsum("bkd,kd->bd", window, c["conv_w"]) + c["conv_b"]
        else:
            conv = xs[:, t]
        x_t = silu(conv)
        proj = x_t @ c["W_x"]
        low, B_t, C_t = proj[:, :dt_rank], proj[:, dt_rank:dt_rank + state_size], proj[:, dt_rank + state_size:]
        delta = softplus(low @ c["W_dt"] + c["dt_bias"])  # [B, D]
        decay = np.exp(delta[:, :, None] * A)
        if allow_neg_eigval:
            decay = 2 * decay - 1
        h = decay * h + (delta[:, :, None] * B_t[:, None, :]) * x_t[:, :, None]
        y = np.einsum("bdn,bn->bd", h, C_t) + c["D"] * x_t
        out.append((y * silu(z[:, t])) @ c["W_out"])
    return np.stack(out, axis=1)


CELLS = {  # name: (layer fields, NumPy reference)
    "attention": (ATTENTION, lambda x, p: numpy_attention(x, p, ATTENTION["num_heads"])),
    "mamba": (MAMBA, lambda x, p: numpy_mamba(x, p, **MAMBA)),
}


def make_layer(cell, fields, **layer_fields):
    fields = dict(fields)
    hidden_dim = fields.pop("hidden_dim")
    layer_fields.setdefault("time_scan", get_cell(cell).time_scans[0])
    return RecurrentLayer(hidden_dim=hidden_dim, cell=cell, cell_options=tuple(fields.items()), init_scheme="default",
                          **layer_fields)


def key_of(fields):
    return tuple(sorted(fields.items()))


@functools.cache
def random_params(cell, fields_key, seed=1):
    """Random float64 params of a layer, in its layout (its init traced for shapes, not run): weights
    N(0, 1/fan_in), vectors N(0, 0.25); Mamba's A_log about log(1..N), D about 1, and dt_bias in [-2, 1]
    (Delta ~ 0.1 .. 1.3, where the state decays visibly within T steps)."""
    shapes = jax.eval_shape(make_layer(cell, dict(fields_key)).init, jax.random.key(0), jnp.zeros((T, B, I)))["params"]
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name, shape = path[-1].key, leaf.shape
        if name == "A_log":
            return np.log(np.arange(1, shape[1] + 1)) + 0.2 * rng.normal(size=shape)
        if name == "D":
            return 1 + 0.2 * rng.normal(size=shape)
        if name == "dt_bias":
            return rng.uniform(-2, 1, size=shape)
        return rng.normal(size=shape) * (0.5 if len(shape) == 1 else shape[0] ** -0.5)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def params_of(cell, fields=None):
    return random_params(cell, key_of(fields or CELLS[cell][0]))


@functools.cache
def jitted_apply(cell, fields_key, **layer_fields):
    return jax.jit(apply_fn(make_layer(cell, dict(fields_key), **layer_fields)))


def inputs(seed=0):
    return np.random.default_rng(seed).normal(size=(B, T, I))


def f32(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)


def apply_fn(layer):
    """(params, x: [B, T, I]) -> [B, T, H], batch-major around the time-major layer."""
    return lambda params, x: layer.apply({"params": params}, jnp.swapaxes(x, 0, 1))[0].swapaxes(0, 1)


def assert_close(actual, expected, tol=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    err = np.max(np.abs(actual - expected))
    assert err <= tol * max(1.0, np.max(np.abs(expected))), (err, np.max(np.abs(expected)))


@pytest.mark.parametrize("time_scan", ["parallel", "blockwise"])
@pytest.mark.parametrize("fields", [ATTENTION, dict(hidden_dim=6, num_heads=2, block_size=4),
                                    dict(hidden_dim=8, num_heads=4, block_size=7)],
                         ids=["width4", "odd_width3", "width2"])
def test_attention_matches_numpy(fields, time_scan):
    params, x = params_of("attention", fields), inputs()
    got = jitted_apply("attention", key_of(fields), time_scan=time_scan)(f32(params), f32(x))
    assert_close(got, numpy_attention(x, params, fields["num_heads"]))


@pytest.mark.parametrize("forms", fast_first([(("custom_vjp", "chunked"),), (("custom_vjp", "sequential"),),
                                              (("autodiff", "chunked"),), (("custom_vjp", "associative"),),
                                              (("autodiff", "sequential"),), (("autodiff", "associative"),)], keep=2,
                                             why="cross-product"),
                         ids="-".join)
def test_mamba_matches_numpy(forms):
    recurrence_, time_scan = forms
    params, x = params_of("mamba"), inputs()
    got = jitted_apply("mamba", key_of(MAMBA), recurrence=recurrence_, time_scan=time_scan)(f32(params), f32(x))
    assert_close(got, numpy_mamba(x, params, **MAMBA))


def test_mamba_without_conv_and_with_the_default_rank_matches_numpy():
    fields = {**MAMBA, "conv_size": 0, "dt_rank": 0, "hidden_dim": 4}
    params, x = params_of("mamba", fields), inputs()
    assert "conv_w" not in params["cell"] and params["cell"]["W_dt"].shape == (1, 8)  # ceil(4 / 16) = 1
    got = jitted_apply("mamba", key_of(fields))(f32(params), f32(x))
    assert_close(got, numpy_mamba(x, params, **{**fields, "dt_rank": 1}))


MAMBA_NEG = {**MAMBA, "allow_neg_eigval": True}


@pytest.mark.parametrize("forms", [("custom_vjp", "sequential"), ("autodiff", "chunked"), ("custom_vjp", "chunked"),
                                   ("custom_vjp", "associative")], ids="-".join)
def test_mamba_with_negative_eigenvalues_matches_numpy(forms):
    """Grazzi et al.'s switch in every form (with these draws, Delta A spans about [-5, -0.1]: decays of both signs)."""
    recurrence_, time_scan = forms
    params, x = params_of("mamba", MAMBA_NEG), inputs()
    got = jitted_apply("mamba", key_of(MAMBA_NEG), recurrence=recurrence_, time_scan=time_scan)(f32(params), f32(x))
    want = numpy_mamba(x, params, **MAMBA_NEG)
    assert_close(got, want)
    assert np.max(np.abs(want - numpy_mamba(x, params, **MAMBA))) > 0.05 * np.max(np.abs(want))  # the switch matters


@pytest.mark.slow("long")
def test_mamba_forms_agree_with_negative_eigenvalues():
    params, x = f32(params_of("mamba", MAMBA_NEG)), f32(inputs())
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, MAMBA["hidden_dim"])), jnp.float32)
    forms = [("autodiff", "sequential"), ("custom_vjp", "sequential"), ("custom_vjp", "associative"), ("autodiff", "chunked"),
             ("custom_vjp", "chunked")]
    assert_forms_agree([make_layer("mamba", MAMBA_NEG, recurrence=r, time_scan=t) for r, t in forms], params, x, weights)


# What the gradient test differentiates beyond the layer input x.
GRAD_PARAMS = {"attention": [("W_xh",), ("cell", "W_o")],
               "mamba": [("cell", "A_log"), ("cell", "dt_bias"), ("cell", "conv_w")]}


def get_leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def with_leaf(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: with_leaf(tree[path[0]], path[1:], value)}


@pytest.mark.parametrize("cell, time_scan, switch", [("attention", "parallel", {}), ("attention", "blockwise", {}),
                                                     ("mamba", "sequential", {}), ("mamba", "chunked", {}),
                                                     pytest.param("mamba", "chunked", {"allow_neg_eigval": True},
                                                                  marks=pytest.mark.slow("cross-product"))])
def test_gradients_match_finite_differences(cell, time_scan, switch):
    """jax.grad of sum(out * R) along random directions of x and of parameters, against central
    differences of the float64 loop."""
    fields, reference = CELLS[cell]
    if switch:
        fields, reference = {**fields, **switch}, lambda x, p: numpy_mamba(x, p, **MAMBA, **switch)
    params, x = params_of(cell, fields), inputs()
    weights = np.random.default_rng(7).normal(size=(B, T, fields["hidden_dim"]))
    apply = apply_fn(make_layer(cell, fields, time_scan=time_scan))
    loss = lambda p, x: jnp.sum(apply(p, x) * jnp.asarray(weights, jnp.float32))  # noqa: E731
    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(f32(params), f32(x))
    rng = np.random.default_rng(11)
    eps = 1e-5
    for path in [None, *GRAD_PARAMS[cell]]:
        value = x if path is None else get_leaf(params, path)
        grad = np.asarray(g_x if path is None else get_leaf(g_params, path), np.float64)

        def f(v, path=path):
            if path is None:
                return np.sum(reference(v, params) * weights)
            return np.sum(reference(x, with_leaf(params, path, v)) * weights)

        for _ in range(2):
            direction = rng.normal(size=value.shape)
            fd = (f(value + eps * direction) - f(value - eps * direction)) / (2 * eps)
            ad = np.sum(grad * direction)
            scale = np.linalg.norm(grad) * np.linalg.norm(direction)  # bounds |ad|
            assert abs(ad - fd) <= 2e-5 * scale, (cell, path, ad, fd, scale)


@pytest.mark.slow("long")
def test_mamba_forms_agree_values_and_gradients():
    """Each (recurrence, time_scan) pair against autodiff of the sequential scan: the output and the
    gradients of every parameter and of x."""
    params, x = f32(params_of("mamba")), f32(inputs())
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, MAMBA["hidden_dim"])), jnp.float32)

    forms = [("autodiff", "sequential"), ("custom_vjp", "sequential"), ("custom_vjp", "associative"),
             ("autodiff", "associative"), ("autodiff", "chunked"), ("custom_vjp", "chunked")]

    assert_forms_agree([make_layer("mamba", MAMBA, recurrence=r, time_scan=t) for r, t in forms], params, x, weights)


@pytest.mark.slow("long")
def test_attention_forms_agree_values_and_gradients():
    """blockwise (blocks of 3 and of 2, T=7 ending mid-block) against parallel: the output and the
    gradients of every parameter and of x."""
    params, x = f32(params_of("attention")), f32(inputs())
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, ATTENTION["hidden_dim"])), jnp.float32)

    layers = [make_layer("attention", {**ATTENTION, "block_size": block}, time_scan=time_scan)
              for time_scan, block in [("parallel", 3), ("blockwise", 3), ("blockwise", 2)]]
    assert_forms_agree(layers, params, x, weights)


def assert_forms_agree(layers, params, x, weights):
    """Every layer's sum(output * weights) and its gradients in the params and x equal the first layer's
    (the forms run as one jitted program: one compile)."""

    @jax.jit
    def values_and_grads(params, x):
        return [jax.value_and_grad(lambda p, x, f=apply_fn(layer): jnp.sum(f(p, x) * weights), argnums=(0, 1))(params, x)
                for layer in layers]

    (want_loss, want_grads), *others = values_and_grads(params, x)
    for loss, grads in others:
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
            assert_close(got, want, tol=2e-5)


@pytest.mark.parametrize("cell", list(CELLS))
def test_output_is_causal(cell):
    """Changing x at step t changes no output before t, and the output at t."""
    fields, _ = CELLS[cell]
    params, x = f32(params_of(cell)), inputs()
    apply = jitted_apply(cell, key_of(fields))
    t = 4
    moved = x.copy()
    moved[:, t] += 1.0
    before, after = np.asarray(apply(params, f32(x))), np.asarray(apply(params, f32(moved)))
    np.testing.assert_array_equal(after[:, :t], before[:, :t])
    assert np.all(np.abs(after[:, t] - before[:, t]).max(axis=-1) > 1e-4)


def test_state_floats_is_the_size_of_the_state():
    """Mamba: the h that the linear recurrence carries (b: [T, B, E*H, N]); attention: the keys and
    values its score and output products read (the KV cache), per example."""
    mamba = get_cell("mamba")(**MAMBA)
    carried = []
    original = mamba_module.scan_linear
    mamba_params = f32(params_of("mamba"))  # before the spy: drawing them traces the layer's init

    def spy(a, b, *args):
        carried.append(b.shape)
        return original(a, b, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mamba_module, "scan_linear", spy)  # the name mamba.py calls
        jax.eval_shape(apply_fn(make_layer("mamba", MAMBA, recurrence="autodiff")), mamba_params, f32(inputs()))
    (shape,) = carried
    assert shape[:2] == (T, B) and np.prod(shape[2:]) == mamba.state_floats(T) == 2 * 4 * 3

    attention = get_cell("attention")(**ATTENTION)
    params = f32(params_of("attention"))
    u = jnp.zeros((T, B, attention.input_width))
    jaxpr = jax.make_jaxpr(lambda u: attention.mix(params["cell"], u, None, "parallel", 1, "autodiff"))(u).jaxpr
    scores, values, _ = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]  # q k^T, p v, o W_o
    per_head = sorted((T, B, attention.num_heads, attention.head_dim))  # time- or batch-major (the kernel's)
    k, v = ([a for a in e.invars if sorted(a.aval.shape) == per_head][-1] for e in (scores, values))  # (q, k: alike)
    assert (np.prod(k.aval.shape) + np.prod(v.aval.shape)) // B == attention.state_floats(T) == 2 * T * 8


def test_mamba_starts_as_the_paper_initialises_it():
    cell = get_cell("mamba")(hidden_dim=32, state_size=8)
    specs = cell.param_specs()
    keys = dict(zip(specs, jax.random.split(jax.random.key(0), len(specs))))
    p = jax.jit(lambda: {name: init(keys[name], shape) for name, (shape, init) in specs.items()})()
    p = {name: np.asarray(a, np.float64) for name, a in p.items()}
    np.testing.assert_allclose(-np.exp(p["A_log"]), -np.broadcast_to(np.arange(1, 9), (64, 8)), rtol=1e-6)
    np.testing.assert_array_equal(p["D"], np.ones(64))
    dt = softplus(p["dt_bias"])
    assert 1e-3 * (1 - 1e-4) <= dt.min() and dt.max() <= 1e-1 * (1 + 1e-4) and dt.max() / dt.min() > 10
    assert p["W_dt"].shape == (2, 64) and np.abs(p["W_dt"]).max() <= 2 ** -0.5  # R = ceil(32 / 16)
    assert p["W_x"].shape == (64, 2 + 16) and p["conv_w"].shape == (4, 64) and p["W_out"].shape == (64, 32)


@pytest.mark.parametrize("overrides, message", [
    (["model=attention", "hidden_dim=6"], r"^key 'model.num_heads': got 4, must be >= 1 and divide hidden_dim=6$"),
    (["model=attention", "model.num_heads=3"], r"^key 'model.num_heads': got 3"),
    (["model=attention", "model.time_scan=sequential"],
     r"^key 'model.time_scan': got 'sequential', allowed for cell 'attention': parallel, blockwise"),
    (["model=mamba", "model.state_size=0"], r"^key 'model.state_size': got 0, must be >= 1"),
    (["model=mamba", "model.conv_size=-1"], r"^key 'model.conv_size': got -1, must be >= 0"),
    (["model=mamba", "model.expand=0"], r"^key 'model.expand': got 0"),
    (["model=mamba", "model.time_scan=parallel"],
     r"^key 'model.time_scan': got 'parallel', allowed for cell 'mamba': sequential, associative, chunked"),
    (["model=mamba", "model.chunk_size=0"], r"^key 'model.chunk_size': got 0, must be >= 1"),
    (["model=attention", "model.block_size=0"], r"^key 'model.block_size': got 0, must be >= 1"),
    (["model=attention", "model.window=-1"], r"^key 'model.window': got -1, must be >= 0 \(0 = full attention\)$"),
    (["model=attention", "model.time_scan=chunked"],
     r"^key 'model.time_scan': got 'chunked', allowed for cell 'attention': parallel, blockwise"),
])
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_options_are_config_keys():
    cell = compose_config(["model=mamba", "model.state_size=8", "model.expand=1"]).model.make_cell()
    assert (cell.state_size, cell.expand, cell.input_width, cell.state_floats(10)) == (8, 1, 128, 64 * 8)
    cell = compose_config(["model=attention", "model.num_heads=8"]).model.make_cell()
    assert cell.head_dim == 8 and cell.input_width == 3 * 64 and cell.state_floats(10) == 2 * 10 * 64


def largest_arrays(fn, *args):
    """Element counts of every value `fn(*args)` traces to, scan and checkpoint bodies included."""
    from rnnlab.flops import _subjaxprs

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for value in eqn.params.values():
                for inner in _subjaxprs(value):
                    yield from walk(inner)

    return sorted(set(walk(jax.make_jaxpr(fn)(*args).jaxpr)))


@pytest.mark.parametrize("time_scan", ["chunked", "sequential"])
def test_mamba_chunked_train_step_has_no_time_by_state_array(time_scan):
    """The whole training step (forward, backward, optimizer) of the chunked form traces to no array of
    T*B*D*N elements (nor larger); the sequential form, which builds a, b: [T, B, D, N], does."""
    from test_flops import step_and_args

    length, batch = 192, 2
    step, args, config, _ = step_and_args(["model=mamba", "hidden_dim=8", "num_layers=2", f"batch_size={batch}",
                                           "data=adding", f"data.seq_len={length}", f"model.time_scan={time_scan}",
                                           "model.chunk_size=16"])
    cell = config.model.make_cell()
    full = length * batch * cell.inner * cell.state_size
    largest = largest_arrays(step, *args)[-1]
    assert (largest < full) == (time_scan == "chunked"), (largest, full)


@pytest.mark.parametrize("time_scan", ["blockwise", "parallel"])
def test_attention_blockwise_train_step_has_no_time_by_time_array(time_scan):
    """The blockwise form's training step traces to no array of T*T elements (its causal masks included:
    JAX kept them for every block pair until they were made to depend on the data); `parallel`, whose
    kernel on CPU forms the scores, has [B, heads, T, T]."""
    from test_flops import step_and_args

    length = 192
    step, args, _, _ = step_and_args(["model=attention", "hidden_dim=8", "num_layers=2", "batch_size=2",
                                      "data=adding", f"data.seq_len={length}", f"model.time_scan={time_scan}",
                                      "model.num_heads=2", "model.block_size=16"])
    largest = largest_arrays(step, *args)[-1]
    assert (largest < length * length) == (time_scan == "blockwise"), (largest, length * length)
