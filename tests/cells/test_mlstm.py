"""The xLSTM's mLSTM (rnnlab.cells.mlstm_forms, rnnlab.cells.mlstm; the fused form rnnlab.fused.mlstm). Fast tier:
each form against a float64 NumPy loop of the paper's stabilised equations (values), each other's gradients,
finite differences of the loop; the layer's forms through a whole model; init, state size, refusals. Full tier: the authors' own
references, mlstm-kernels' native forms (outputs and the gradients of q, k, v, i, f: torch autograd against
jax.vjp, one random cotangent, float32) and xlstm's `mLSTMLayer` (the layer, its weights copied over).

mlstm-kernels' layout is batch-major per head: q, k: [B, NH, S, DHQK], v: [B, NH, S, DHV], i, f: [B, NH, S]
(f the pre-activation; they apply log sigmoid). Ours are time-major, q: [S, B, NH, DHQK], gates [S, B, NH], and
take log sigmoid(f): `to_theirs` moves the time axis to third place (after B and NH) and back.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first, require, tiny_config
from rnnlab import fused
from rnnlab.cells import get_cell
from rnnlab.cells.mlstm_forms import mlstm_chunked, mlstm_parallel, mlstm_recurrent
from rnnlab.config import ConfigError
from rnnlab.models import build_model
from test_matrix_forms import assert_close, assert_grads_match_finite_differences, f32

B, HEADS, D, CHUNK, EPS = 2, 2, 4, 4, 1e-6
LENGTHS = (7, 13, 20)  # not a multiple of CHUNK, twice not, a multiple
FORMS = {
    "parallel": mlstm_parallel,
    "chunked": functools.partial(mlstm_chunked, chunk_size=CHUNK),
    "sequential": functools.partial(mlstm_recurrent, checkpoint_every=CHUNK),
    "fused": functools.partial(fused.mlstm, eps=EPS),  # gated linear attention's CPU kernel
}


def numpy_mlstm(q, k, v, log_i, log_f, condition=False):
    """C_t = f_t C_{t-1} + i_t k_t^T v_t, n_t = f_t n_{t-1} + i_t k_t, h_t = q~_t C_t / (max(|q~_t n_t|, 1) + eps),
    q~ = q / sqrt(d), kept scaled by exp(-m_t), m_t = max(log f_t + m_{t-1}, log i_t), m_0 = 0; float64.
    `condition`: also the normaliser's largest condition number, |q~_t| |n_t| / max(|q~_t n_t|, 1) (the
    relative error float32 rounding of q~ n grows by)."""
    c = np.zeros(q.shape[1:3] + (q.shape[-1], v.shape[-1]))
    n, m, out, kappa = np.zeros(q.shape[1:]), np.zeros(q.shape[1:3]), [], 1.0
    for t in range(q.shape[0]):
        m_new = np.maximum(log_f[t] + m, log_i[t])
        f, i = np.exp(log_f[t] + m - m_new), np.exp(log_i[t] - m_new)
        c = f[..., None, None] * c + i[..., None, None] * k[t][..., :, None] * v[t][..., None, :]
        n, m = f[..., None] * n + i[..., None] * k[t], m_new
        q_t = q[t] / np.sqrt(q.shape[-1])
        denominator = np.maximum(np.abs(np.einsum("bhk,bhk->bh", q_t, n)), np.exp(-m)) + EPS
        kappa = max(kappa, np.max(np.linalg.norm(q_t, axis=-1) * np.linalg.norm(n, axis=-1) / denominator))
        out.append(np.einsum("bhk,bhkv->bhv", q_t, c) / denominator[..., None])
    return (np.stack(out), kappa) if condition else np.stack(out)


def make_inputs(length, seed=0, strong=False):
    """float64 (q, k, v, log i, log f). `strong`: input gates up to exp(40), past float32 unstabilised."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(3, length, B, HEADS, D))
    log_i = rng.normal(size=(length, B, HEADS)) * 2 + (rng.uniform(0, 40, size=(length, B, HEADS)) if strong else 0)
    f_pre = rng.normal(size=(length, B, HEADS)) * 2 + 1
    return [q, k, v, log_i, -np.logaddexp(0, -f_pre)]


@functools.cache
def jitted(form):
    return jax.jit(FORMS[form])


@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_equals_the_papers_equations(form):
    """1e-6 of the largest value times the normaliser's condition number (at least 10). The parallel form's
    stabiliser omits the m_0 = 0 term: that moves eps, at most 1e-6 of a denominator."""
    for length in LENGTHS:
        for strong in (False, True):
            args = make_inputs(length, seed=length, strong=strong)
            expected, kappa = numpy_mlstm(*args, condition=True)
            assert_close(jitted(form)(*f32(args)), expected, tol=1e-6 * max(10.0, kappa))


@functools.cache
def grads(form, length=13):
    args = make_inputs(length, seed=3)
    weights = np.random.default_rng(7).normal(size=(length, B, HEADS, D))
    loss = lambda *a: jnp.sum(jitted(form)(*a) * jnp.asarray(weights, jnp.float32))  # noqa: E731
    g = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*f32(args))
    return args, weights, [np.asarray(x, np.float64) for x in g]


@pytest.mark.parametrize("form", [pytest.param("parallel", marks=pytest.mark.slow("cross-product")), "sequential",
                                  "fused"])
def test_every_form_has_the_chunked_forms_gradients(form):
    for a, b in zip(grads(form)[2], grads("chunked")[2]):
        assert_close(a, b)


def test_chunked_gradients_match_finite_differences():
    args, weights, g = grads("chunked")
    assert_grads_match_finite_differences(numpy_mlstm, args, g, weights)


def layer_model(form, length=13):
    config = tiny_config("model=mlstm", f"model.time_scan={form}", f"data.seq_len={length}", "model.num_heads=2",
                         "model.chunk_size=4").model
    return build_model(config, 3, "cpu")


@pytest.mark.parametrize("form", fast_first(["chunked", "parallel"], why="cross-product", first_why="long"))
def test_layer_forms_agree_through_a_whole_model(form):
    """Two mLSTM blocks, values and every parameter's gradient, against the sequential form (float32, 1e-5)."""
    x = np.random.default_rng(0).normal(size=(2, 13, 5)).astype(np.float32)
    outputs = {}
    for name in (form, "sequential"):
        model = layer_model(name)
        params = jax.jit(model.init)(jax.random.key(0), x)["params"]
        # off the init, where W_i = W_f = 0 would leave the gates independent of the input
        params = jax.tree_util.tree_map(lambda p: p + 0.1 * jnp.sin(jnp.arange(p.size).reshape(p.shape)), params)
        loss = lambda p, model=model: jnp.sum(jnp.sin(model.apply({"params": p}, x)))  # noqa: E731
        outputs[name] = jax.jit(jax.value_and_grad(loss))(params)
    (value, grad), (v_seq, g_seq) = outputs[form], outputs["sequential"]
    np.testing.assert_allclose(value, v_seq, rtol=1e-5)
    # atol on the scale of all the gradients: a small leaf (a 2-element bias gradient of 0.0099, a sum of terms
    # the forms add in other orders) differed by 3e-7, 3e-5 of itself, in one full-tier run.
    scale = max(np.abs(np.asarray(b)).max() for b in jax.tree_util.tree_leaves(g_seq))
    for a, b in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(g_seq)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)


def test_init_is_the_references():
    cell = get_cell("mlstm")(32, "default", num_heads=4, num_blocks=2)
    specs = cell.param_specs()
    keys = jax.random.split(jax.random.key(0), len(specs))
    p = {name: init(key, shape) for key, (name, (shape, init)) in zip(keys, sorted(specs.items()))}
    np.testing.assert_allclose(p["b_f"], np.linspace(3, 6, 4), rtol=1e-6)
    assert not np.any(p["W_i"]) and not np.any(p["W_f"]) and np.all(p["norm"] == 1) and np.all(p["skip"] == 1)
    assert p["W_q"].shape == (16, 4, 4) and cell.input_width == 128 and p["W_o"].shape == (64, 32)
    assert 0.8 < np.std(p["W_o"]) / (2 / 2 / np.sqrt(32)) < 1.2
    assert 0.8 < np.std(p["W_q"]) / np.sqrt(2 / (5 * 32)) < 1.2


def test_state_size_is_heads_times_c_n_and_m():
    assert get_cell("mlstm")(32, num_heads=4).state_floats(100) == 4 * (16 * 16 + 16 + 1)


@pytest.mark.parametrize("override, key", [("model.num_heads=3", "model.num_heads"),
                                           ("model.proj_factor=0", "model.proj_factor"),
                                           ("model.proj_factor=nan", "model.proj_factor"),
                                           ("model.qkv_proj_blocksize=5", "model.qkv_proj_blocksize"),
                                           ("model.chunk_size=0", "model.chunk_size"),
                                           ("model.conv_size=-1", "model.conv_size"),
                                           ("model.num_blocks=0", "model.num_blocks"),
                                           ("model.time_scan=associative", "model.time_scan")])
def test_refusals_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        tiny_config("model=mlstm", override)


# --- Full tier: the authors' references ----------------------------------------------------------------------


def to_theirs(x):
    """Ours [S, B, NH, ...] -> theirs [B, NH, S, ...] (a float64 NumPy array in, a float32 torch tensor out)."""
    import torch

    return torch.tensor(np.moveaxis(np.asarray(x), 0, 2), dtype=torch.float32, requires_grad=True)


def from_theirs(x):
    return np.moveaxis(x.detach().numpy().astype(np.float64), 2, 0)


REFERENCES = {  # our form -> (mlstm-kernels module, function, extra keyword arguments)
    "parallel": ("mlstm_kernels.torch.parallel.native", "mlstm_parallel__native_autograd", {}),
    "chunked": ("mlstm_kernels.torch.chunkwise.native", "mlstm_chunkwise__native_autograd", {"chunk_size": CHUNK}),
    "sequential": ("mlstm_kernels.torch.recurrent.native_sequence", "mlstm_recurrent_sequence__native_fw", {}),
}


@pytest.mark.slow("extra")
@pytest.mark.parametrize("reference", list(REFERENCES))
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("strong", [False, True])
def test_forms_equal_mlstm_kernels(form, reference, strong):
    """Outputs and the gradients of q, k, v, i, f (f the pre-activation, as theirs takes it). Their chunkwise
    form needs whole chunks: T = 16. float32 both; tolerance 1e-5 of each array's largest value."""
    require("torch")
    module, name, kwargs = REFERENCES[reference]
    theirs = getattr(require(module), name)
    length = 16
    q, k, v, log_i, log_f = make_inputs(length, seed=5, strong=strong)
    f_pre = np.log(-np.expm1(log_f)) - log_f  # f~ with log sigmoid(f~) = log_f
    cotangent = np.random.default_rng(9).normal(size=(length, B, HEADS, D))

    tensors = [to_theirs(a) for a in (q, k, v, log_i, f_pre)]
    out = theirs(*tensors, **kwargs)
    out.backward(to_theirs(cotangent).detach())
    expected = [from_theirs(out)] + [from_theirs(t.grad) for t in tensors]

    ours = lambda q, k, v, i, f: FORMS[form](q, k, v, i, jax.nn.log_sigmoid(f))  # noqa: E731
    o, vjp = jax.vjp(ours, *f32([q, k, v, log_i, f_pre]))
    actual = [o] + list(vjp(jnp.asarray(cotangent, jnp.float32)))
    for a, e in zip(actual, expected):
        assert_close(a, e)


@pytest.mark.slow("extra")
@pytest.mark.parametrize("form", list(FORMS))
def test_layer_equals_xlstms_mlstm_layer(form):
    """xlstm's `mLSTMLayer` (up-projection, conv, headwise q k v, gates, the cell, its group norm, skip, gate,
    down-projection; parallel form), its weights copied into ours, every gate off its init; float32, 1e-5."""
    torch = require("torch")
    layer_module = require("xlstm.blocks.mlstm.layer")
    hidden, length = 32, 12  # inner width 64: xlstm rounds it up to a multiple of 64, ours does not round
    cfg = layer_module.mLSTMLayerConfig(embedding_dim=hidden, num_heads=HEADS, context_length=length, _num_blocks=1)
    torch.manual_seed(0)
    ref = layer_module.mLSTMLayer(cfg)
    with torch.no_grad():  # off the init: gates from their inputs, a norm weight other than 1
        for p in (ref.mlstm_cell.igate.weight, ref.mlstm_cell.fgate.weight, ref.mlstm_cell.outnorm.weight):
            p.normal_(0, 0.3)
    x = np.random.default_rng(1).normal(size=(2, length, hidden)).astype(np.float32)
    expected = ref(torch.tensor(x)).detach().numpy()

    t = lambda w: np.asarray(w.detach().numpy(), np.float32)  # noqa: E731
    cell = get_cell("mlstm")(hidden, "default", num_heads=HEADS, chunk_size=CHUNK, proj_factor=cfg.proj_factor)
    assert cell.inner == cfg._inner_embedding_dim
    headwise = lambda m: t(m.weight).transpose(0, 2, 1)  # noqa: E731  [blocks, out, in] -> [blocks, in, out]
    c = ref.mlstm_cell
    params = {"conv_w": t(ref.conv1d.conv.weight)[:, 0, :].T, "conv_b": t(ref.conv1d.conv.bias),
              "W_q": headwise(ref.q_proj), "W_k": headwise(ref.k_proj), "W_v": headwise(ref.v_proj),
              "W_i": t(c.igate.weight).T, "b_i": t(c.igate.bias), "W_f": t(c.fgate.weight).T, "b_f": t(c.fgate.bias),
              "norm": t(c.outnorm.weight_proxy), "skip": t(ref.learnable_skip), "W_o": t(ref.proj_down.weight).T}
    assert set(params) == set(cell.param_specs())
    xs = np.swapaxes(x, 0, 1)
    u = xs @ t(ref.proj_up.weight).T
    actual = cell.mix(params, jnp.asarray(u), jnp.asarray(xs), form, 1, "autodiff")
    assert_close(np.swapaxes(np.asarray(actual), 0, 1), expected)
