"""Elman RNN (PyTorch `nn.RNN`): `h_t = act(u_t + h_{t-1} W_hh)`, act = tanh | relu (`model.activation`).

With relu and the identity initialisation (`model.init=identity`) this is the IRNN of
Le, Jaitly & Hinton (2015). Carry h: [B, H]; u_t: [B, H].
"""

from __future__ import annotations

import jax.numpy as jnp

from rnnlab.cells.registry import ACTIVATIONS, Cell, register_cell
from rnnlab.recurrence import recurrent_weight_grad, scan


@register_cell
class Elman(Cell):
    name = "rnn"
    num_gates = 1
    torch_class = "RNN"
    default_recurrence = "custom_vjp"  # conf/model/rnn.yaml's init, recurrence, time_scan
    default_time_scan = "sequential"

    def step(self, params, h, u):
        act, _ = ACTIVATIONS[self.activation]
        h = act(u + h @ params["W_hh"])
        return h, h, None

    def backward(self, params, u, b, hs, saved, g, unroll):
        _, act_grad = ACTIVATIONS[self.activation]
        dact = act_grad(hs)  # per-step factors for all time steps at once, outside the loop
        w_t = params["W_hh"].T

        def step(dh_next, xs):
            g_t, dact_t = xs
            da = (g_t + dh_next) * dact_t
            return da @ w_t, da

        _, da = scan(step, jnp.zeros_like(g[0]), (g, dact), reverse=True, unroll=unroll)
        return da, {"W_hh": recurrent_weight_grad(hs, da)}
