"""GRU (PyTorch `nn.GRU`, gate blocks r, z, n). Carry h: [B, H]; u_t: [B, 3H]; own bias b_hn: f32[H].

    [u_r, u_z, u_n] = u_t;  [a_r, a_z, a_n] = h W_hh
    r = sigma(u_r + a_r);  z = sigma(u_z + a_z)
    n = tanh(u_n + r * (a_n + b_hn))          (reset gate applied after W_hn, as PyTorch)
    h_t = (1 - z) * n + z * h

PyTorch keeps two biases per gate; the input bias carries their sum, except b_hn, which
sits inside `r * (...)` and so stays a parameter of its own.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rnnlab.cells.registry import Cell, register_cell, shift_back, sigmoid_grad
from rnnlab.recurrence import recurrent_weight_grad, scan


@register_cell
class GRU(Cell):
    name = "gru"
    num_gates = 3
    prefetch = True
    torch_class = "GRU"
    default_init = "orthogonal"  # conf/model/gru.yaml's init, recurrence, time_scan
    default_recurrence = "custom_vjp"
    default_time_scan = "sequential"

    def param_specs(self):
        return {"b_hn": ((self.hidden_dim,), nn.initializers.zeros_init()), **super().param_specs()}

    def step(self, params, h, u):
        u_r, u_z, u_n = jnp.split(u, 3, axis=-1)
        a = h @ params["W_hh"]
        a_r, a_z, a_n = jnp.split(a, 3, axis=-1)
        r = jax.nn.sigmoid(u_r + a_r)
        z = jax.nn.sigmoid(u_z + a_z)
        n = jnp.tanh(u_n + r * (a_n + params["b_hn"]))
        h = (1 - z) * n + z * h
        return h, h, a

    def backward(self, params, u, b, hs, saved, g, unroll):
        hidden = self.hidden_dim
        u_r, u_z, u_n = jnp.split(u + b, 3, axis=-1)
        a_r, a_z, a_n = jnp.split(saved, 3, axis=-1)
        r, z = jax.nn.sigmoid(u_r + a_r), jax.nn.sigmoid(u_z + a_z)
        hn = a_n + params["b_hn"]
        n = jnp.tanh(u_n + r * hn)
        # With dh the total gradient of h_t: du = [dh, dh, dh] * du_factor, and da (the
        # gradient of h_{t-1} W_hh) the same with the n block times r.
        dpre_n = (1 - z) * (1 - n * n)
        dpre_r = dpre_n * hn * sigmoid_grad(r)
        dpre_z = (shift_back(hs) - n) * sigmoid_grad(z)
        da_factor = jnp.concatenate([dpre_r, dpre_z, dpre_n * r], axis=-1)
        w_t = params["W_hh"].T

        def step(dh_next, xs):
            g_t, z_t, da_factor_t = xs
            dh = g_t + dh_next
            da = jnp.concatenate([dh, dh, dh], axis=-1) * da_factor_t
            return dh * z_t + da @ w_t, dh

        _, dh = scan(step, jnp.zeros_like(g[0]), (g, z, da_factor), reverse=True, unroll=unroll)
        dh3 = jnp.concatenate([dh, dh, dh], axis=-1)
        da = dh3 * da_factor
        du = dh3 * jnp.concatenate([dpre_r, dpre_z, dpre_n], axis=-1)
        return du, {"W_hh": recurrent_weight_grad(hs, da), "b_hn": jnp.sum(da[..., 2 * hidden:], axis=(0, 1))}

    @classmethod
    def from_torch(cls, weight_ih: Any, weight_hh: Any, bias_ih: Any, bias_hh: Any) -> dict:
        """As `Cell.from_torch`; b_hr and b_hz fold into b, b_hn stays inside the reset gate."""
        w_ih, w_hh, b_ih, b_hh = (np.asarray(a, np.float32) for a in (weight_ih, weight_hh, bias_ih, bias_hh))
        hidden = w_hh.shape[1]
        b = b_ih + np.concatenate([b_hh[: 2 * hidden], np.zeros(hidden, np.float32)])
        return {"W_xh": w_ih.T, "b": b, "cell": {"W_hh": w_hh.T, "b_hn": b_hh[2 * hidden :]}}
