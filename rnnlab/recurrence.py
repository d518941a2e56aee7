"""The time recurrence of one layer with a hand-written backward pass (`model.recurrence=custom_vjp`).

Autodiff of `lax.scan` accumulates the weight gradient inside the reverse scan: at
every time step it forms `h_{t-1}^T da_t` (a [H, B] x [B, G*H] matmul) and adds it
to a carried [H, G*H] sum, beside the `da_t W_hh^T` the recurrence needs. Here the
reverse scan propagates only the deltas (`dh`, and `dc` for the LSTM) and emits the
pre-activation gradients `da_t`; the weight gradients are then one matmul over all
time steps at once,

    dW_hh = sum_t h_{t-1}^T da_t = H^T DA_next     H: [T*B, H] (h_0 .. h_{T-1}), DA_next: (da_1 .. da_{T-1}, 0)

which runs at full matmul efficiency instead of T small ones. The input term
`u = x W_xh` is computed before the recurrence (hoisted) by `linear`, so
`dW_xh = X^T DU` and `dx = DU W_xh^T` are also single matmuls; the bias `b` is added
inside the step and `db = sum DU`.

Shapes: `T` time, `B` batch, `H` hidden units, `G` gates. `u`: [T, B, G*H] (time-major),
`w_hh`: [H, G*H], `b_hn`: [H] (GRU only, else None), output `hs`: [T, B, H]. The cell
equations are those of `rnnlab.cells` (PyTorch's gate order); tests/test_cells.py checks
values and gradients against the autodiff path. The initial carry is zero.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def _shift_back(xs: jax.Array) -> jax.Array:
    """[T, ...] -> [T, ...] holding (0, xs_0, ..., xs_{T-2}): the value at t-1 for every t."""
    return jnp.concatenate([jnp.zeros_like(xs[:1]), xs[:-1]], axis=0)


def weight_grad(x: jax.Array, dy: jax.Array) -> jax.Array:
    """x^T dy over all leading axes: x [..., K], dy [..., N] -> [K, N].

    XLA's CPU backend forms such a product by transposing one operand, and left to
    itself it picked `dy` even where it is the wider one (a [T*B, G*H] copy of a gated
    cell's pre-activation gradients: 33 ms per layer and step at H=256, B=32, T=256).
    Where K < N, `x` is transposed explicitly (the barrier keeps XLA from folding the
    transpose back into the dot): a copy of the narrower operand, then a plain
    [K, T*B] x [T*B, N] matmul (291 against 341 ms at K=1024, N=4096). Where K >= N,
    XLA's own form measured faster (the Elman cell's dW_hh, K = N: 162 against 192 ms a
    step at H=256, L=2). These are CPU measurements; the H100 figures in the README were
    taken with this form too, but it was not compared with XLA's there.
    """
    x, dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if x.shape[-1] >= dy.shape[-1]:  # dy is no wider: XLA's own choice (measured faster for the Elman cell's K = N)
        return x.T @ dy
    return jax.lax.optimization_barrier(x.T) @ dy


@jax.custom_vjp
def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for x: [..., K], w: [K, N], with `weight_grad` for dw, and no dx where x is
    not differentiated (data: the first layer's input)."""
    return x @ w


def _linear_fwd(x, w):  # symbolic_zeros: each argument comes with its `perturbed` bit
    return x.value @ w.value, (x.value, w.value if x.perturbed else None)


def _linear_bwd(saved, dy):
    x, w = saved
    dx = None if w is None else dy @ w.T
    return dx, weight_grad(x, dy)


linear.defvjp(_linear_fwd, _linear_bwd, symbolic_zeros=True)


def _sigmoid_grad(s: jax.Array) -> jax.Array:
    return s * (1 - s)


def _scan(step, init, xs, reverse=False, unroll=1, prefetch=False):
    """`lax.scan(step, init, xs, reverse, unroll)`; with `prefetch` (forward only), each step's
    slice of xs is read one iteration ahead and carried.

    XLA's CPU fusion emitter fuses the per-step slice `xs[t]` into the elementwise fusion
    that consumes it, and such a fusion runs the step's transcendentals (sigmoid, tanh)
    slowly: an LSTM forward step (B=32, H=100) took 126 us, against 49 us with no slice at
    all. Carrying the slice from the previous iteration puts it in a fusion of its own (a
    [B, ...] copy): 85 us. The copy costs more than it saves where a step has little
    transcendental work (the Elman step, the backward steps), so only the gated cells'
    forward uses it. The slice of step t+1 is read by index from xs itself, not from a
    shifted copy of xs (a [T, B, G*H] copy: 18 ms per layer at H=256, B=32, T=256).
    """
    if not prefetch:
        return jax.lax.scan(step, init, xs, reverse=reverse, unroll=unroll)
    assert not reverse, "prefetch is implemented for forward scans only"
    length = jax.tree_util.tree_leaves(xs)[0].shape[0]

    def prefetched(carry, t):
        carry, x_t = carry
        t_next = jnp.minimum(t + 1, length - 1)
        x_next = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, t_next, keepdims=False), xs)
        carry, y = step(carry, x_t)
        return (carry, x_next), y

    first = jax.tree_util.tree_map(lambda x: x[0], xs)
    (carry, _), ys = jax.lax.scan(prefetched, (init, first), jnp.arange(length), unroll=unroll)
    return carry, ys


# Per cell: forward(u, b, w_hh, b_hn, activation, unroll) -> (hs, residuals) and
# backward(residuals, w_hh, b_hn, activation, g, unroll) -> (du, da, db_hn), where da is the
# gradient of the recurrent matmul's output (equal to du except for the GRU's n gate).
# Both loops do as little as they can per time step: the loop emits the pre-activations
# and the backward loop reads per-step factors computed beforehand for all time steps at
# once, because on CPU each extra operation inside a loop iteration costs a few us
# however small it is, while the same work vectorised over [T, B, ...] is nearly free.


def _elman_forward(u, b, w_hh, b_hn, activation, unroll):
    act = jnp.tanh if activation == "tanh" else jax.nn.relu

    def step(h, u_t):
        h = act(u_t + b + h @ w_hh)
        return h, h

    _, hs = _scan(step, jnp.zeros_like(u[0]), u, unroll=unroll)
    return hs, (hs,)


def _elman_backward(res, w_hh, b_hn, activation, g, unroll):
    (hs,) = res
    act_grad = 1 - hs * hs if activation == "tanh" else (hs > 0).astype(hs.dtype)
    w_t = w_hh.T

    def step(dh_next, xs):
        g_t, act_grad_t = xs
        da = (g_t + dh_next) * act_grad_t
        return da @ w_t, da

    _, da = _scan(step, jnp.zeros_like(g[0]), (g, act_grad), reverse=True, unroll=unroll)
    return da, da, None


def _lstm_forward(u, b, w_hh, b_hn, activation, unroll):
    hidden = w_hh.shape[0]
    zeros = jnp.zeros_like(u[0, :, :hidden])

    def step(carry, u_t):
        c, h = carry
        a = u_t + b + h @ w_hh
        i, f, g, o = jnp.split(a, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), (a, c)

    _, (pre, cs) = _scan(step, (zeros, zeros), u, unroll=unroll, prefetch=True)
    i, f, g, o = jnp.split(pre, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    tanh_cs = jnp.tanh(cs)
    return o * tanh_cs, (i, f, g, o, cs, tanh_cs)


def _lstm_backward(res, w_hh, b_hn, activation, g, unroll):
    i, f, gg, o, cs, tanh_cs = res
    # dc = dh * dc_dh + dc_next;  da = [dc, dc, dc, dh] * da_factor;  dc_prev = dc * f
    dc_dh = o * (1 - tanh_cs * tanh_cs)
    da_factor = jnp.concatenate([
        gg * _sigmoid_grad(i), _shift_back(cs) * _sigmoid_grad(f), i * (1 - gg * gg), tanh_cs * _sigmoid_grad(o),
    ], axis=-1)
    w_t = w_hh.T

    def step(carry, xs):
        dh_next, dc_next = carry
        g_t, dc_dh_t, f_t, da_factor_t = xs
        dh = g_t + dh_next
        dc = dh * dc_dh_t + dc_next
        da = jnp.concatenate([dc, dc, dc, dh], axis=-1) * da_factor_t
        return (da @ w_t, dc * f_t), da

    zeros = jnp.zeros_like(g[0])
    _, da = _scan(step, (zeros, zeros), (g, dc_dh, f, da_factor), reverse=True, unroll=unroll)
    return da, da, None


def _gru_forward(u, b, w_hh, b_hn, activation, unroll):
    hidden = w_hh.shape[0]

    def step(h, u_t):
        u_r, u_z, u_n = jnp.split(u_t + b, 3, axis=-1)
        a = h @ w_hh
        a_r, a_z, a_n = jnp.split(a, 3, axis=-1)
        r = jax.nn.sigmoid(u_r + a_r)
        z = jax.nn.sigmoid(u_z + a_z)
        n = jnp.tanh(u_n + r * (a_n + b_hn))
        h = (1 - z) * n + z * h
        return h, (h, a)

    _, (hs, pre) = _scan(step, jnp.zeros_like(u[0, :, :hidden]), u, unroll=unroll, prefetch=True)
    u_r, u_z, u_n = jnp.split(u + b, 3, axis=-1)
    a_r, a_z, a_n = jnp.split(pre, 3, axis=-1)
    r, z = jax.nn.sigmoid(u_r + a_r), jax.nn.sigmoid(u_z + a_z)
    hn = a_n + b_hn
    n = jnp.tanh(u_n + r * hn)
    return hs, (hs, r, z, n, hn)


def _gru_backward(res, w_hh, b_hn, activation, g, unroll):
    hs, r, z, n, hn = res
    # With dh the total gradient of h_t: du = [dh, dh, dh] * du_factor, and da (the
    # gradient of h_{t-1} W_hh) the same with the n block times r.
    dpre_n = (1 - z) * (1 - n * n)
    dpre_r = dpre_n * hn * _sigmoid_grad(r)
    dpre_z = (_shift_back(hs) - n) * _sigmoid_grad(z)
    da_factor = jnp.concatenate([dpre_r, dpre_z, dpre_n * r], axis=-1)
    w_t = w_hh.T

    def step(dh_next, xs):
        g_t, z_t, da_factor_t = xs
        dh = g_t + dh_next
        da = jnp.concatenate([dh, dh, dh], axis=-1) * da_factor_t
        return dh * z_t + da @ w_t, dh

    _, dh = _scan(step, jnp.zeros_like(g[0]), (g, z, da_factor), reverse=True, unroll=unroll)
    hidden = w_hh.shape[0]
    dh3 = jnp.concatenate([dh, dh, dh], axis=-1)
    da = dh3 * da_factor
    du = dh3 * jnp.concatenate([dpre_r, dpre_z, dpre_n], axis=-1)
    return du, da, jnp.sum(da[..., 2 * hidden:], axis=(0, 1))


_CELLS = {
    "rnn": (_elman_forward, _elman_backward),
    "lstm": (_lstm_forward, _lstm_backward),
    "gru": (_gru_forward, _gru_backward),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def recurrence(cell: str, activation: str, unroll: int, u: jax.Array, b: jax.Array, w_hh: jax.Array,
               b_hn: Any) -> jax.Array:
    """hs: [T, B, H] of `cell` ('rnn' | 'lstm' | 'gru') over the input terms u + b (u: [T, B, G*H] = x W_xh,
    b: [G*H]). The bias is added inside the loop's step, where it costs nothing measurable,
    rather than in a pass of its own over [T, B, G*H] (18 ms per layer at H=256, B=32,
    T=256 for the LSTM, a pass that XLA did not fuse into the matmul making u)."""
    hs, _ = _CELLS[cell][0](u, b, w_hh, b_hn, activation, unroll)
    return hs


def _recurrence_fwd(cell, activation, unroll, u, b, w_hh, b_hn):
    hs, res = _CELLS[cell][0](u, b, w_hh, b_hn, activation, unroll)
    return hs, (res, hs, w_hh, b_hn)


def _recurrence_bwd(cell, activation, unroll, saved, g):
    res, hs, w_hh, b_hn = saved
    du, da, db_hn = _CELLS[cell][1](res, w_hh, b_hn, activation, g, unroll)
    # dW_hh = sum_t h_{t-1}^T da_t = sum_t h_t^T da_{t+1}. The time shift goes on da, not on
    # hs: `weight_grad` transposes hs, and XLA fused a shift of hs (zero padding) into that
    # transpose, which then ran 4-6x slower (38 against 7-10 ms per layer at H=256,
    # B=32, T=256); shifting da is a contiguous copy (7 ms). With the prefetch by index (`_scan`),
    # the LSTM step there went from 785 to 725 ms.
    da_next = jnp.concatenate([da[1:], jnp.zeros_like(da[:1])])  # da_{t+1}, 0 at t = T-1
    return du, jnp.sum(du, axis=(0, 1)), weight_grad(hs, da_next), db_hn


recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)
