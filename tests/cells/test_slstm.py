"""The sLSTM cell (rnnlab/cells/slstm.py): its scan against a NumPy loop of the paper's equations, the
hand-written backward against autodiff, the whole layer (convolution, W_if, group norm) against NumPy;
in the full tier, against the authors' own code (`xlstm`, the `refs` extra).

xlstm's vanilla sLSTM (`xlstm.blocks.slstm.src.vanilla.slstm_forward` with the `slstm` pointwise function)
takes, for K heads of d units (H = K d):

    x: [T, B, 4H]      the input term, gate-major: [i | f | z | o], each H wide, head-major within
    states: [4, B, H]  (h, c, n, m), zeros; at the first step (n all zero) m_1 = i~
    R: [K, 4d, d]      per head, Ry_k = h_k R_k^T, [4d] gate-major (i, f, z, o of d units)
    b: [4H]            gate-major, as x

and returns states_all: [4, T+1, B, H]. rnnlab keeps the input term and b head-major ([K, 4, d]: xlstm's
external bias layout) and W_hh: [K, d, 4d], so the mapping is

    x = u.reshape(T, B, K, 4, d).transpose(0, 1, 3, 2, 4),   R = W_hh.transpose(0, 2, 1),
    b_ref = b.reshape(K, 4, d).transpose(1, 0, 2)             (each reshaped flat)

and rnnlab's m_0 = -inf gives the reference's m_1 = i~, so h, c, n and m all agree. xlstm's `sLSTMLayer`
(conv, headwise projections, cell, `MultiHeadLayerNorm`) is `SLSTM.mix` with block-diagonal dense weights:
W_xh = [blockdiag(zgate) | blockdiag(ogate)], W_if = [blockdiag(fgate) | blockdiag(igate)] (the reference
feeds `fgate` to i and `igate` to f), conv weight [H, 1, K] -> [K, H], norm weight 1 + w.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require

from rnnlab.cells import get_cell
from rnnlab.cells.slstm import NORM_EPS
from rnnlab.recurrence import recurrence, scan_cell

T, B, H, K = 6, 3, 8, 2
D = H // K
RTOL = 2e-5  # of the largest |value| of each compared array, float32


def close(got, want, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * max(np.abs(want).max(), 1e-30))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def numpy_slstm(u, b, w, heads):
    """The paper's sLSTM over u + b: [T, B, 4H] head-major ([K, 4, d]) with R: [K, d, 4d] -> h, c, n, m: [T, B, H]."""
    t_len, batch, width = u.shape
    hidden = width // 4
    d = hidden // heads
    c, n, h = (np.zeros((batch, hidden)) for _ in range(3))
    m = np.full((batch, hidden), -np.inf)
    out = {k: [] for k in "hcnm"}
    for t in range(t_len):
        a = (u[t] + b).reshape(batch, heads, 4, d).copy()
        for k in range(heads):
            a[:, k] += (h[:, k * d:(k + 1) * d] @ w[k]).reshape(batch, 4, d)
        i_pre, f_pre, z_pre, o_pre = (a[:, :, j].reshape(batch, hidden) for j in range(4))
        log_f = np.log(sigmoid(f_pre))
        m_new = np.maximum(log_f + m, i_pre)
        i_gate, f_gate = np.exp(i_pre - m_new), np.exp(log_f + m - m_new)
        c = f_gate * c + i_gate * np.tanh(z_pre)
        n = f_gate * n + i_gate
        m = m_new
        h = sigmoid(o_pre) * c / n
        for key, value in zip("hcnm", (h, c, n, m)):
            out[key].append(value)
    return {k: np.stack(v) for k, v in out.items()}


def numpy_layer(x, u, params, heads, conv_size):
    """`SLSTM.mix` in NumPy: x, the layer input [T, B, H]; u = x W_xh: [T, B, 2H] ([z | o])."""
    t_len = x.shape[0]
    padded = np.concatenate([np.zeros((conv_size - 1, *x.shape[1:])), x])
    conv = sum(padded[k:k + t_len] * params["conv"][k] for k in range(conv_size)) + params["conv_bias"]
    xc = conv * sigmoid(conv)
    i, f = np.split(xc @ params["W_if"], 2, axis=-1)
    z, o = np.split(u, 2, axis=-1)
    pre = np.stack([g.reshape(*g.shape[:-1], heads, -1) for g in (i, f, z, o)], axis=-2).reshape(*u.shape[:-1], -1)
    h = numpy_slstm(pre, params["b"], params["W_hh"], heads)["h"]
    g = h.reshape(*h.shape[:-1], heads, -1)
    g = (g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + NORM_EPS)
    return g.reshape(h.shape) * params["norm"]


def random_inputs(seed=0, scale=1.0):
    """u: [T, B, 4H], b: [4H], W_hh: [K, d, 4d], a cotangent [T, B, H]; R nonzero (the init's is 0)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (T, B, 4 * H)) * scale, jax.random.normal(ks[1], (4 * H,)),
            jax.random.normal(ks[2], (K, D, 4 * D)) * 0.5, jax.random.normal(ks[3], (T, B, H)))


CELL = get_cell("slstm")(H, num_heads=K)


def test_the_scan_is_the_papers_recurrence():
    u, b, w, _ = random_inputs(scale=3.0)  # wide pre-activations: the stabiliser takes both branches
    hs, (_, cs, ns, ms) = scan_cell(CELL, {"W_hh": w}, u, b)
    want = numpy_slstm(*(np.asarray(a, np.float64) for a in (u, b, w)), K)
    for got, key in ((hs, "h"), (cs, "c"), (ns, "n"), (ms, "m")):
        close(got, want[key])
    assert np.all(np.asarray(ns) >= 1 - 1e-6)  # the denominator never falls below 1


@pytest.mark.slow("long")
def test_the_hand_written_backward_is_autodiff():
    u, b, w, cot = random_inputs(1, scale=3.0)

    def loss(run):
        return lambda u, b, w: jnp.sum(run(u, b, w) * cot)

    custom = jax.jit(jax.grad(loss(lambda u, b, w: recurrence(CELL, 1, u, b, {"W_hh": w})), (0, 1, 2)))(u, b, w)
    auto = jax.jit(jax.grad(loss(lambda u, b, w: scan_cell(CELL, {"W_hh": w}, u, b)[0]), (0, 1, 2)))(u, b, w)
    for got, want in zip(custom, auto):
        close(got, want)


def layer_params(seed=2):
    specs = CELL.param_specs()
    keys = jax.random.split(jax.random.key(seed), len(specs) + 2)
    params = {name: jax.random.normal(k, shape) * 0.5 for k, (name, (shape, _)) in zip(keys, specs.items())}
    x = jax.random.normal(keys[-2], (T, B, H))
    w_xh = jax.random.normal(keys[-1], (H, 2 * H)) * 0.5
    return params, x, w_xh


def test_the_layer_is_conv_gates_recurrence_and_group_norm():
    params, x, w_xh = layer_params()
    got = CELL.mix(params, x @ w_xh, x, "sequential", 1, "custom_vjp")
    as_np = {k: np.asarray(v, np.float64) for k, v in params.items()}
    close(got, numpy_layer(np.asarray(x, np.float64), np.asarray(x @ w_xh, np.float64), as_np, K, CELL.conv_size))


@pytest.mark.slow("long")
def test_the_layers_gradients_agree_between_custom_vjp_and_autodiff():
    params, x, w_xh = layer_params(3)
    cot = jax.random.normal(jax.random.key(4), (T, B, H))

    def loss(recurrence_kind):
        return lambda p, x, w: jnp.sum(CELL.mix(p, x @ w, x, "sequential", 1, recurrence_kind) * cot)

    custom = jax.jit(jax.grad(loss("custom_vjp"), (0, 1, 2)))(params, x, w_xh)
    auto = jax.jit(jax.grad(loss("autodiff"), (0, 1, 2)))(params, x, w_xh)
    for got, want in zip(jax.tree_util.tree_leaves(custom), jax.tree_util.tree_leaves(auto)):
        close(got, want)


def test_init_and_options():
    b = np.asarray(CELL.param_specs()["b"][1](None, (4 * H,))).reshape(K, 4, D)
    np.testing.assert_allclose(b[:, 1], np.broadcast_to(-(-5 + 12 * (np.arange(D) / (D - 1)) ** 0.3), (K, D)), rtol=1e-6)
    assert not b[:, [0, 2, 3]].any()
    assert CELL.state_floats(10) == 4 * H and CELL.recurrent_flops() == 2 * H * 4 * H // K
    assert get_cell("slstm")(H, num_heads=3).option_problem().startswith("key 'model.num_heads': got 3, must")
    assert get_cell("slstm")(H, conv_size=-1).option_problem().startswith("key 'model.conv_size'")
    assert get_cell("slstm")(H, conv_size=0).input_width == 4 * H


# --- The authors' reference (full tier) ---------------------------------------------------------------


def to_reference(u, b, w):
    """rnnlab's (u [T, B, 4H], b [4H] head-major, W_hh [K, d, 4d]) -> xlstm vanilla's (x, b, R); see the docstring."""
    x = u.reshape(T, B, K, 4, D).transpose(0, 1, 3, 2, 4).reshape(T, B, 4 * H)
    return x, b.reshape(K, 4, D).transpose(1, 0, 2).reshape(4 * H), w.transpose(0, 2, 1)


@pytest.mark.slow("extra")
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_the_cell_is_xlstms_vanilla_slstm(scale):
    torch = require("torch")
    vanilla = require("xlstm.blocks.slstm.src.vanilla")
    u, b, w, cot = random_inputs(5, scale)
    ref_in = [torch.tensor(np.asarray(a), requires_grad=True) for a in to_reference(u, b, w)]
    states = vanilla.slstm_forward(ref_in[0], torch.zeros(4, B, H), ref_in[2], ref_in[1],
                                   vanilla.slstm_pointwise_function_registry["slstm"])[0][:, 1:]
    (states[0] * torch.tensor(np.asarray(cot))).sum().backward()
    hs, (_, cs, ns, ms) = scan_cell(CELL, {"W_hh": w}, u, b)
    for got, want in zip((hs, cs, ns, ms), states.detach().numpy()):
        close(got, want)
    for recurrence_kind in ("custom_vjp", "autodiff"):
        def run(u, b, w, recurrence_kind=recurrence_kind):
            if recurrence_kind == "custom_vjp":
                return recurrence(CELL, 1, u, b, {"W_hh": w})
            return scan_cell(CELL, {"W_hh": w}, u, b)[0]

        _, vjp = jax.vjp(run, u, b, w)
        grads = to_reference(*vjp(cot))
        for got, want in zip(grads, ref_in):
            close(got, want.grad.numpy())


@pytest.mark.slow("extra")
def test_the_layer_is_xlstms_slstm_layer():
    torch = require("torch")
    layer_module = require("xlstm.blocks.slstm.layer")
    torch.manual_seed(0)
    ref = layer_module.sLSTMLayer(layer_module.sLSTMLayerConfig(
        embedding_dim=H, num_heads=K, conv1d_kernel_size=4, backend="vanilla", dtype="float32"))
    with torch.no_grad():  # every parameter away from its init (R and the norm weight start at 0)
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = np.asarray(jax.random.normal(jax.random.key(6), (B, T, H)))
    x_ref = torch.tensor(x, requires_grad=True)
    y_ref = ref(x_ref)
    cot = np.asarray(jax.random.normal(jax.random.key(7), (B, T, H)))
    (y_ref * torch.tensor(cot)).sum().backward()

    def blockdiag(module):  # headwise weight [K, d_out, d_in] -> dense [H, H] acting as x @ W
        return jax.scipy.linalg.block_diag(*[jnp.asarray(wk.detach().numpy()).T for wk in module.weight])

    cell = ref.slstm_cell
    params = {"W_hh": jnp.asarray(cell._recurrent_kernel.detach().numpy()).transpose(0, 2, 1),
              "b": jnp.asarray(cell._bias.detach().numpy()).reshape(4, K, D).transpose(1, 0, 2).reshape(4 * H),
              "norm": 1 + jnp.asarray(ref.group_norm.weight.detach().numpy()),
              "conv": jnp.asarray(ref.conv1d.conv.weight.detach().numpy())[:, 0].T,
              "conv_bias": jnp.asarray(ref.conv1d.conv.bias.detach().numpy()),
              "W_if": jnp.concatenate([blockdiag(ref.fgate), blockdiag(ref.igate)], axis=1)}
    w_xh = jnp.concatenate([blockdiag(ref.zgate), blockdiag(ref.ogate)], axis=1)
    xt = jnp.swapaxes(jnp.asarray(x), 0, 1)
    for recurrence_kind in ("custom_vjp", "autodiff"):
        def layer(xt, p, w, recurrence_kind=recurrence_kind):
            return CELL.mix(p, xt @ w, xt, "sequential", 1, recurrence_kind)

        y, vjp = jax.vjp(layer, xt, params, w_xh)
        close(jnp.swapaxes(y, 0, 1), y_ref.detach().numpy())
        dx, dp, dw_xh = vjp(jnp.swapaxes(jnp.asarray(cot), 0, 1))
        close(jnp.swapaxes(dx, 0, 1), x_ref.grad.numpy())
        close(dp["conv_bias"], ref.conv1d.conv.bias.grad.numpy())
        close(dp["conv"], ref.conv1d.conv.weight.grad.numpy()[:, 0].T)
        close(dp["norm"], ref.group_norm.weight.grad.numpy())
        close(dp["W_hh"], cell._recurrent_kernel.grad.numpy().transpose(0, 2, 1))
        close(dp["b"], cell._bias.grad.numpy().reshape(4, K, D).transpose(1, 0, 2).reshape(4 * H))
        for dw, gates in ((dp["W_if"], (ref.fgate, ref.igate)), (dw_xh, (ref.zgate, ref.ogate))):
            for j, gate in enumerate(gates):  # the diagonal blocks: head k at rows and columns k d
                for k in range(K):
                    block = dw[k * D:(k + 1) * D, j * H + k * D:j * H + (k + 1) * D]
                    close(block.T, gate.weight.grad.numpy()[k])
