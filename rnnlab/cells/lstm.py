"""LSTM (PyTorch `nn.LSTM`, gate blocks i, f, g, o in this order). Carry (c, h): [B, H] each; u_t: [B, 4H].

    [i, f, g, o] = u_t + h W_hh;  i, f, o = sigma(i), sigma(f), sigma(o);  g = tanh(g)
    c_t = f * c + i * g;   h_t = o * tanh(c_t)

The input bias carries the sum of PyTorch's two biases; the forget block starts at
`model.forget_bias`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rnnlab.cells.registry import Cell, register_cell, shift_back, sigmoid_grad
from rnnlab.recurrence import recurrent_weight_grad, scan


@register_cell
class LSTM(Cell):
    name = "lstm"
    num_gates = 4
    prefetch = True
    torch_class = "LSTM"
    onednn_kernel = "lstm"
    default_init = "orthogonal"  # conf/model/lstm.yaml's init, recurrence, time_scan
    default_recurrence = "auto"
    default_time_scan = "sequential"

    def bias_init(self):
        def init(key, shape, dtype=jnp.float32):
            del key
            h = shape[0] // self.num_gates
            return jnp.zeros(shape, dtype).at[h : 2 * h].set(self.forget_bias)

        return init

    def initial_carry(self, like):
        zeros = jnp.zeros_like(like, shape=(like.shape[0], self.hidden_dim))
        return zeros, zeros

    def state_floats(self, seq_len):
        return 2 * self.hidden_dim  # c and h

    def step(self, params, carry, u):
        c, h = carry
        a = u + h @ params["W_hh"]
        i, f, g, o = jnp.split(a, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h, (a, c)

    def hidden_from_saved(self, saved):
        pre, cs = saved
        return jax.nn.sigmoid(jnp.split(pre, 4, axis=-1)[3]) * jnp.tanh(cs)

    def backward(self, params, u, b, hs, saved, g, unroll):
        pre, cs = saved
        i, f, gg, o = jnp.split(pre, 4, axis=-1)
        i, f, gg, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(gg), jax.nn.sigmoid(o)
        tanh_cs = jnp.tanh(cs)
        # dc = dh * dc_dh + dc_next;  da = [dc, dc, dc, dh] * da_factor;  dc_prev = dc * f
        dc_dh = o * (1 - tanh_cs * tanh_cs)
        da_factor = jnp.concatenate([
            gg * sigmoid_grad(i), shift_back(cs) * sigmoid_grad(f), i * (1 - gg * gg), tanh_cs * sigmoid_grad(o),
        ], axis=-1)
        w_t = params["W_hh"].T

        def step(carry, xs):
            dh_next, dc_next = carry
            g_t, dc_dh_t, f_t, da_factor_t = xs
            dh = g_t + dh_next
            dc = dh * dc_dh_t + dc_next
            da = jnp.concatenate([dc, dc, dc, dh], axis=-1) * da_factor_t
            return (da @ w_t, dc * f_t), da

        zeros = jnp.zeros_like(g[0])
        _, da = scan(step, (zeros, zeros), (g, dc_dh, f, da_factor), reverse=True, unroll=unroll)
        return da, {"W_hh": recurrent_weight_grad(hs, da)}
