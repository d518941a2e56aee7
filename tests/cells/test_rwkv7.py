"""RWKV-7 (rnnlab.cells.rwkv7) and its DPLR delta rule (rnnlab.cells.dplr_forms): both forms against a float64
NumPy loop (values; gradients against each other and against finite differences), the whole time-mixing layer
and the rwkv channel mix against NumPy transcriptions of their equations, the init against fla's
`_initialize_weights`. Full tier: flash-linear-attention's `dplr_recurrence` and `dplr_chunkwise` (outputs and
every input's gradient), and a torch transcription of fla's `RWKV7Attention.forward` (fla/layers/rwkv7.py at
bc3b101; fla-core ships no layers) from fla's own torch pieces, its recurrence `dplr_recurrence`."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first, require
from rnnlab import fused
from rnnlab.blocks import ChannelMLP
from rnnlab.cells import get_cell
from rnnlab.cells.dplr_forms import dplr_chunked, dplr_recurrent
from rnnlab.cells.rwkv7 import LOG_W_MIN
from test_matrix_forms import assert_grads_match_finite_differences

B, HEADS, D, CHUNK = 2, 2, 4, 4
LENGTHS = (13, 3, 8)  # not a multiple of CHUNK, shorter than it, a multiple

FORMS = {"recurrent": functools.partial(dplr_recurrent, checkpoint_every=CHUNK),
         "chunked": functools.partial(dplr_chunked, chunk_size=CHUNK), "fused": fused.dplr}


def numpy_dplr(q, k, v, a, b, log_w):
    """S_t = (diag(w_t) + b_t^T a_t) S_{t-1} + k_t^T v_t,  o_t = q_t S_t; float64, one step at a time."""
    S = np.zeros(q.shape[1:3] + (q.shape[-1], v.shape[-1]))
    out = []
    for t in range(q.shape[0]):
        read = np.einsum("bhk,bhkv->bhv", a[t], S)
        S = (np.exp(log_w[t])[..., None] * S + b[t][..., :, None] * read[..., None, :]
             + k[t][..., :, None] * v[t][..., None, :])
        out.append(np.einsum("bhk,bhkv->bhv", q[t], S))
    return np.stack(out)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def rwkv_inputs(length, seed=0, d=D, heads=HEADS, min_log_w=LOG_W_MIN, max_iclr=1.0):
    """q, k, v, a = -kappa, b = kappa * iclr, log_w in [min_log_w, 0] (RWKV-7's range by default), iclr in
    (0, max_iclr) (2: `allow_neg_eigval`), float64."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(length, B, heads, d)) for _ in range(3))
    kappa = unit(rng.normal(size=(length, B, heads, d)))
    iclr = max_iclr * sigmoid(rng.normal(size=kappa.shape))
    log_w = min_log_w * sigmoid(2 * rng.normal(size=kappa.shape))
    return [q, k, v, -kappa, kappa * iclr, log_w]


def f32(xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def assert_close(actual, expected, rtol=2e-5):
    """Within rtol of the largest |expected|."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * max(np.abs(expected).max(), 1e-30))


@pytest.mark.parametrize("length", fast_first(LENGTHS, why="cross-product"))
@pytest.mark.parametrize("form", fast_first(list(FORMS), why="cross-product"))
def test_forms_match_numpy(form, length):
    args = rwkv_inputs(length)
    assert_close(FORMS[form](*f32(args)), numpy_dplr(*args))


@pytest.mark.parametrize("form", list(FORMS))
def test_forms_match_numpy_with_iclr_up_to_2(form):
    """allow_neg_eigval's range: b = 2 sigmoid(.) kappa, the transition's eigenvalues to -1 and below."""
    args = rwkv_inputs(LENGTHS[0], seed=6, max_iclr=2.0)
    assert_close(FORMS[form](*f32(args)), numpy_dplr(*args))


def grads(form, length=LENGTHS[0], max_iclr=1.0):
    args = rwkv_inputs(length, seed=1, max_iclr=max_iclr)
    weights = np.random.default_rng(2).normal(size=args[2].shape)
    loss = lambda *xs: jnp.sum(FORMS[form](*xs) * weights)  # noqa: E731
    return args, weights, jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*f32(args))


@pytest.mark.parametrize("max_iclr", fast_first([1.0, 2.0], why="cross-product", first_why="long"))
def test_chunked_grads_match_recurrent(max_iclr):
    _, _, g_rec = grads("recurrent", max_iclr=max_iclr)
    _, _, g_chunk = grads("chunked", max_iclr=max_iclr)
    for a, b in zip(g_chunk, g_rec):
        assert_close(a, b)


@pytest.mark.slow("long")
def test_chunked_grads_match_finite_differences():
    args, weights, g = grads("chunked")
    assert_grads_match_finite_differences(numpy_dplr, args, [np.asarray(x, np.float64) for x in g], weights)


@pytest.mark.slow("long")  # the forms agree at chunk 4 in the fast tier; this is the float32 error at the default chunk
def test_chunk_64_float32_error():
    """RWKV-7's strongest decay over a whole chunk of 64 (e^-38.8): float32 error as the loop's."""
    args = rwkv_inputs(150, seed=3, d=16, min_log_w=LOG_W_MIN)
    args[5] = np.where(np.random.default_rng(4).random(args[5].shape) < 0.5, LOG_W_MIN, args[5])
    expected = numpy_dplr(*args)
    assert_close(dplr_chunked(*f32(args), chunk_size=64), expected, rtol=1e-5)
    assert_close(dplr_recurrent(*f32(args), checkpoint_every=64), expected, rtol=1e-5)


@pytest.mark.slow("long")
def test_strong_decays_do_not_overflow():
    """Decays far past RWKV-7's (a chunk of 16 decays by up to e^-320): exact ratios, no exp(-g)."""
    args = rwkv_inputs(37, seed=5, min_log_w=-20.0)
    out = dplr_chunked(*f32(args), chunk_size=16)
    assert np.all(np.isfinite(out))
    assert_close(out, numpy_dplr(*args))


# --- the layer ----------------------------------------------------------------------------------------------------

H = HEADS * D


def numpy_layer(p, x, heads=HEADS, allow_neg_eigval=False):
    """RWKV-7's time mixing (the cell's module docstring) in float64: x [T, B, H] -> [T, B, H];
    `allow_neg_eigval`: the in-context learning rate a doubled, in (0, 2), and the removal kappa a times w (RWKV-Othello's
    extended RWKV-7: `RUN_CUDA_RWKV7g(r, w, k, v, -kk, kk * (a * exp(-exp(w))))` with `a = sigmoid(.) * 2.0`)."""
    t_len, batch, h = x.shape
    d = h // heads
    split = lambda y: y.reshape(t_len, batch, heads, d)  # noqa: E731
    prev = np.concatenate([np.zeros_like(x[:1]), x[:-1]])
    xs = {c: x + (prev - x) * p[f"x_{c}"] for c in "rwkvag"}
    r, k, v = xs["r"] @ p["W_r"], xs["k"] @ p["W_k"], xs["v"] @ p["W_v"]
    log_w = -np.exp(-0.5) * sigmoid(np.tanh(xs["w"] @ p["w_1"]) @ p["w_2"] + p["w_0"])
    a = sigmoid(xs["a"] @ p["a_1"] @ p["a_2"] + p["a_0"]) * (2 if allow_neg_eigval else 1)
    g = sigmoid(xs["g"] @ p["g_1"]) @ p["g_2"]
    kappa = unit(split(k * p["k_k"]))
    k = k * (1 + (a - 1) * p["k_a"])
    removal = kappa * split(a) * (np.exp(split(log_w)) if allow_neg_eigval else 1)
    o = numpy_dplr(split(r), split(k), split(v), -kappa, removal, split(log_w))
    o = (o - o.mean(-1, keepdims=True)) / np.sqrt(o.var(-1, keepdims=True) + d * 1e-5)
    o = o.reshape(t_len, batch, h) * p["norm"] + p["norm_bias"]
    bonus = np.sum(split(r) * split(k) * p["r_k"], axis=-1, keepdims=True) * split(v)
    return ((o + bonus.reshape(o.shape)) * g) @ p["W_o"]


def cell_and_params(hidden=H, heads=HEADS, seed=0, **options):
    """The cell and its initial parameters, each perturbed (the init zeroes W_o and the LoRAs' first maps)."""
    cell = get_cell("rwkv7")(hidden, num_heads=heads, chunk_size=CHUNK, **options)
    keys = jax.random.split(jax.random.key(seed), 64)
    rng = np.random.default_rng(seed)
    params = {}
    for i, (name, (shape, init)) in enumerate(sorted(cell.param_specs().items())):
        params[name] = np.asarray(init(keys[i], shape), np.float64) + 0.3 * rng.normal(size=shape)
    return cell, params


@pytest.mark.parametrize("time_scan, allow_neg_eigval", [
    # the chunked form against NumPy in the fast tier: test_forms_match_numpy_with_iclr_up_to_2[chunked]
    pytest.param("chunked", False, marks=pytest.mark.slow("cross-product")),
    pytest.param("chunked", True, marks=pytest.mark.slow("cross-product")), ("sequential", False), ("sequential", True),
    pytest.param("fused", True, marks=pytest.mark.slow("cross-product"))])
def test_layer_matches_numpy(time_scan, allow_neg_eigval):
    cell, params = cell_and_params(decay_rank=3, iclr_rank=2, gate_rank=5, allow_neg_eigval=allow_neg_eigval)
    x = np.random.default_rng(7).normal(size=(11, B, H))
    out = cell.mix(jax.tree_util.tree_map(jnp.float32, params), jnp.zeros((11, B, 0)), jnp.float32(x), time_scan, 1,
                   "autodiff")
    assert_close(out, numpy_layer(params, x, allow_neg_eigval=allow_neg_eigval), rtol=5e-5)
    if allow_neg_eigval:  # the switch is wired: the unswitched layer differs
        assert np.abs(np.asarray(out) - numpy_layer(params, x)).max() > 1e-2 * np.abs(np.asarray(out)).max()


@pytest.mark.parametrize("time_scan", fast_first(["sequential", "chunked"], why="cross-product", first_why="long"))
def test_layer_gradients_are_finite_where_the_input_is_zero(time_scan):
    """Padded steps (data.min_seq_len) feed zeros: kappa = k k_k / |k k_k| must keep a finite gradient there."""
    cell, params = cell_and_params()
    x = np.random.default_rng(8).normal(size=(9, B, H))
    x[5:] = 0.0

    def loss(p):
        return jnp.sum(cell.mix(p, jnp.zeros((9, B, 0)), jnp.float32(x), time_scan, 1, "autodiff") ** 2)

    grads = jax.jit(jax.grad(loss))(jax.tree_util.tree_map(jnp.float32, params))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree_util.tree_leaves(grads))


def test_layer_ranks_default_from_the_width():
    cell = get_cell("rwkv7")(64)
    assert cell.ranks() == (20, 20, 40)
    assert cell.param_specs()["w_1"][0] == (64, 20) and cell.param_specs()["g_2"][0] == (40, 64)
    assert cell.state_floats(100) == 4 * 16 * 16  # the token shift's x_{t-1} is not counted, as no conv state is


def test_init_is_fla_layer_0():
    """The deterministic parts of fla's `RWKV7Attention._initialize_weights` with layer_idx = 0, transcribed."""
    h, d = 8, 4
    cell = get_cell("rwkv7")(h, num_heads=h // d)
    got = {name: np.asarray(init(jax.random.key(0), shape)) for name, (shape, init) in cell.param_specs().items()}
    ratio_0_to_1, ratio_1_to_almost0 = 0 / (3 - 1), 1.0 - 0 / 3
    ddd, www, zigzag, linear = (np.zeros(h) for _ in range(4))
    for n in range(h):
        linear[n] = n / (h - 1) - 0.5
        zigzag[n] = ((n % d) - ((d - 1) / 2)) / ((d - 1) / 2)
        zigzag[n] = zigzag[n] * abs(zigzag[n])
        www[n] = -6 + 6 * (n / (h - 1)) ** (1 + 1 * ratio_0_to_1 ** 0.3)
        ddd[n] = n / h
    for name, power in {"x_r": 0.2, "x_w": 0.9, "x_k": 0.7, "x_v": 0.7, "x_a": 0.9, "x_g": 0.2}.items():
        np.testing.assert_allclose(got[name], 1.0 - ddd ** (power * ratio_1_to_almost0), rtol=1e-6)
    np.testing.assert_allclose(got["w_0"], www + 0.5 + zigzag * 2.5, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["a_0"], -0.19 + zigzag * 0.3 + linear * 0.4, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["k_k"], 0.71 - linear * 0.1, rtol=1e-6)
    assert np.all(got["k_a"] == np.float32(1.02)) and np.all(got["r_k"] == np.float32(-0.04))
    for name in ("W_o", "w_1", "a_1", "g_1"):
        assert not got[name].any(), name
    np.testing.assert_allclose(got["W_k"].T @ got["W_k"], 0.01 * np.eye(h), atol=1e-6)  # orthogonal, gain 0.1
    w2 = got["w_2"]  # [rank, H] with rank < H: orthonormal rows times 0.1
    np.testing.assert_allclose(w2 @ w2.T, 0.01 * np.eye(w2.shape[0]), atol=1e-6)


def numpy_channel_mix(p, x):
    """RWKV-7's channel mix: relu((x + (x_{t-1} - x) * mu) W_up)^2 W_down, float64, time-major."""
    prev = np.concatenate([np.zeros_like(x[:1]), x[:-1]])
    return np.maximum((x + (prev - x) * p["mu"]) @ p["up"]["kernel"], 0) ** 2 @ p["down"]["kernel"]


def test_channel_mix_matches_numpy():
    x = np.random.default_rng(0).normal(size=(7, B, 6)).astype(np.float32)
    mlp = ChannelMLP("rwkv", 4, False)
    params = mlp.init(jax.random.key(0), x)["params"]
    assert params["up"]["kernel"].shape == (6, 24) and not params["down"]["kernel"].any()
    np.testing.assert_allclose(params["mu"], 1 - np.arange(6) / 6, rtol=1e-6)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * rng.normal(size=a.shape).astype(np.float32), params)
    f64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    assert_close(mlp.apply({"params": params}, x), numpy_channel_mix(f64, x.astype(np.float64)), rtol=1e-5)


# --- the authors' references (full tier) ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch():
    return require("torch")


@pytest.fixture(scope="module")
def dplr_naive():
    require("fla")
    import fla.ops.generalized_delta_rule.dplr.naive as naive

    return naive


def to_fla(torch, x):
    """[T, B, h, d] float64 -> a float32 leaf [B, h, T, d] that takes a gradient."""
    return torch.tensor(np.ascontiguousarray(np.transpose(x, (1, 2, 0, 3))), dtype=torch.float32, requires_grad=True)


@pytest.mark.slow("extra")
@pytest.mark.parametrize("length, max_iclr", [(16, 1.0), (37, 1.0), (37, 2.0)])
@pytest.mark.parametrize("reference, form", [("dplr_recurrence", "recurrent"), ("dplr_chunkwise", "chunked"),
                                             ("dplr_recurrence", "fused")])
def test_forms_match_fla(torch, dplr_naive, reference, form, length, max_iclr):
    """Outputs and every input's gradient (one random cotangent) against fla's naive functions, float32; the
    in-context learning rate also in allow_neg_eigval's (0, 2). fla scales q by dk^-1/2: it gets q dk^1/2.
    dplr_chunkwise needs whole chunks: padded with zeros (w = 1)."""
    d, chunk = 8, 8
    args = rwkv_inputs(length, seed=9, d=d, max_iclr=max_iclr)
    cotangent = np.random.default_rng(10).normal(size=args[2].shape)
    fn, key = {"recurrent": (dplr_recurrent, "checkpoint_every"), "chunked": (dplr_chunked, "chunk_size"),
               "fused": (fused.dplr, None)}[form]
    out, vjp = jax.vjp(functools.partial(fn, **{key: chunk} if key else {}), *f32(args))
    ours = vjp(jnp.float32(cotangent))
    padded = -(-length // chunk) * chunk
    pad = lambda x: np.pad(x, [(0, padded - length)] + [(0, 0)] * 3)  # noqa: E731
    leaves = [to_fla(torch, pad(x)) for x in args]
    q, k, v, a, b, gk = leaves
    fn = getattr(dplr_naive, reference)
    kwargs = {"chunk_size": chunk} if reference == "dplr_chunkwise" else {}
    o, _ = fn(q * math.sqrt(d), k, v, a, b, gk, **kwargs)
    o = o[:, :, :length]
    (o * torch.tensor(np.transpose(cotangent, (1, 2, 0, 3)), dtype=torch.float32)).sum().backward()
    assert_close(out, np.transpose(o.detach().numpy(), (2, 0, 1, 3)), rtol=1e-5)
    for i, leaf in enumerate(leaves):
        assert_close(ours[i], np.transpose(leaf.grad.numpy(), (2, 0, 1, 3))[:length], rtol=1e-5)


def fla_rwkv7_attention(torch, p, x, heads, layer_idx=0):
    """fla's RWKV7Attention.forward (fla/layers/rwkv7.py, bc3b101) for layer 0 (v_first = v), no cache or mask,
    in torch: its own torch references for the fused pieces, `dplr_recurrence` for chunk_rwkv7 (which calls
    chunk_dplr_delta_rule(q=r, gk=w, a, b, scale=1)). x: [B, T, H]; p: our parameters as torch tensors."""
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
    from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
    from fla.ops.rwkv7.fused_k_update import k_update_ref
    from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref
    from fla.modules.token_shift import token_shift_ref

    F = torch.nn.functional
    batch, seq_len, h = x.shape
    d = h // heads
    lora = lambda z, w1, act, w2, bias=None: F.linear(act(F.linear(z, w1.T)), w2.T, bias)  # noqa: E731
    delta = token_shift_ref(x)
    xr, xw, xk, xv, xa, xg = torch_addcmul_rwkv7(x, delta, *(p[f"x_{c}"].view(1, 1, h) for c in "rwkvag"))
    r = F.linear(xr, p["W_r"].T)
    w = -0.6065306597126334 * lora(xw, p["w_1"], torch.tanh, p["w_2"], p["w_0"]).sigmoid()
    k = F.linear(xk, p["W_k"].T)
    v = F.linear(xv, p["W_v"].T)
    a = lora(xa, p["a_1"], lambda z: z, p["a_2"], p["a_0"]).sigmoid()
    g = lora(xg, p["g_1"], torch.sigmoid, p["g_2"])
    kk = F.normalize((k * p["k_k"]).view(batch, seq_len, heads, d), dim=-1, p=2.0)
    k = k_update_ref(k, a, p["k_a"])
    r, w, k, a = (z.view(batch, seq_len, heads, d) for z in (r, w, k, a))
    v = v.view(batch, seq_len, heads, d)
    bhtd = lambda z: z.transpose(1, 2)  # noqa: E731  (the naive function's [B, h, T, d])
    o, _ = dplr_recurrence(bhtd(r) * math.sqrt(d), bhtd(k), bhtd(v), bhtd(-kk), bhtd(kk * a), bhtd(w))
    o = o.transpose(1, 2)
    norm = torch.nn.GroupNorm(heads, h, eps=d * 1e-5)
    with torch.no_grad():
        norm.weight.copy_(p["norm"])
        norm.bias.copy_(p["norm_bias"])
    o = norm(o.reshape(batch * seq_len, h)).view(batch, seq_len, -1)
    o = gate_output_correction_ref(o, r, k, p["r_k"], v, g)
    return F.linear(o, p["W_o"].T)


@pytest.mark.slow("extra")
def test_layer_matches_fla(torch):
    require("fla")
    cell, params = cell_and_params(hidden=16, heads=2, decay_rank=3, iclr_rank=4, gate_rank=5)
    x = np.random.default_rng(3).normal(size=(9, B, 16))
    ours = cell.mix(jax.tree_util.tree_map(jnp.float32, params), jnp.zeros((9, B, 0)), jnp.float32(x), "chunked", 1,
                    "autodiff")
    p = {name: torch.tensor(value, dtype=torch.float32) for name, value in params.items()}
    theirs = fla_rwkv7_attention(torch, p, torch.tensor(np.swapaxes(x, 0, 1), dtype=torch.float32), heads=2)
    assert_close(ours, np.swapaxes(theirs.detach().numpy(), 0, 1), rtol=2e-5)


@pytest.mark.slow("extra")
def test_channel_mix_matches_fla(torch):
    require("fla")
    from fla.ops.rwkv7.channel_mixing import channel_mixing_rwkv7_torch

    x = np.random.default_rng(0).normal(size=(7, B, 6)).astype(np.float32)
    mlp = ChannelMLP("rwkv", 4, False)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * rng.normal(size=a.shape).astype(np.float32),
                                    mlp.init(jax.random.key(0), x)["params"])
    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    theirs, _ = channel_mixing_rwkv7_torch(t(np.swapaxes(x, 0, 1)), torch.zeros(B, 6), t(params["mu"]),
                                           t(params["up"]["kernel"]), t(params["down"]["kernel"]))
    assert_close(mlp.apply({"params": params}, x), np.swapaxes(theirs.numpy(), 0, 1), rtol=1e-5)
