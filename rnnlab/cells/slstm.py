"""sLSTM, the scalar-memory xLSTM cell (Beck et al. 2024, "xLSTM: Extended Long Short-Term Memory", Sec. 2.2
and App. A; the authors' `xlstm` package: `blocks/slstm/{layer,cell}.py`, `src/vanilla/slstm.py`). Heads K
(`model.num_heads`), head width d = H / K, conv width (`model.conv_size`). The layer, as `sLSTMLayer`:

    x'_t = silu(conv(x)_t)                      depthwise causal convolution of the layer input (with a
                                                bias), `rnnlab.cells.common.causal_conv`; conv_size=0: x' = x
    [z~, o~] = x_t W_xh,   [i~, f~] = x'_t W_if   the input gates (the layer's W_xh: [H, 2H]; the cell's
                                                W_if: [H, 2H]; conv_size=0: all four from W_xh: [H, 4H])
    a_t = [i~, f~, z~, o~] + h_{t-1} R + b       R block-diagonal: one [d, 4d] block per head
    m_t = max(log sigma(f~) + m_{t-1}, i~)       the stabiliser (m_0 = -inf: m_1 = i~, as the reference)
    i_t = exp(i~ - m_t),  f_t = exp(log sigma(f~) + m_{t-1} - m_t),  z_t = tanh(z~),  o_t = sigma(o~)
    c_t = f_t c_{t-1} + i_t z_t,   n_t = f_t n_{t-1} + i_t,   h_t = o_t c_t / n_t
    y_t = GroupNorm(h_t) * w                     a layer norm per head (eps 1e-5), weight w: [H], no bias

Carry (c, n, m, h): [B, H] each. h_t is invariant to the stabiliser (c_t and n_t both carry exp(-m_t)),
so the hand-written `backward` treats m as a constant; n_t >= 1 from the first step on. The recurrence
is `step` (scanned by `rnnlab.recurrence`); the convolution, W_if and the group norm around it are this
`SequenceCell`'s `mix`, the one hook that sees the whole sequence and the layer input. Its state
(`initial_state`) is the carry and the convolution's last K-1 inputs.

Layouts: the step's input term a, the bias b and the recurrent kernel W_hh: [K, d, 4d] are head-major,
each head's 4d columns gates i, f, z, o of d units (the reference's bias [K, 4, d] and kernel
[K, d, 4, d], flattened); h is [K, d] head-major as the reference's. Initialisation as the reference's
defaults: R = 0, the forget bias `powerlaw_blockdependent` of the first block (per head, unit j of d:
-(-5 + 12 (j / (d-1))^0.3), from +5 to -7), the other biases 0; input weights normal with std
sqrt(2 / (5 H)) (`small_init`); the conv as torch's Conv1d; the norm weight 1. Unlike the reference the
input weights are dense (its block-diagonal headwise projections are a special case) and every layer's
forget bias is the first block's (a cell does not know its depth).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from rnnlab.cells.common import causal_conv, conv_tail, fan_in_uniform
from rnnlab.cells.registry import SequenceCell, register_cell, shift_back
from rnnlab.options import allowed
from rnnlab.recurrence import linear, scan, scan_cell
from rnnlab.recurrence import recurrence as custom_recurrence

NORM_EPS = 1e-5  # the reference's MultiHeadLayerNorm


def small_init(key, shape, dtype=jnp.float32):
    """Normal with std sqrt(2 / (5 fan_in)) (Nguyen & Salazar 2019), xlstm's `small_init_init_`."""
    return jax.random.normal(key, shape, dtype) * math.sqrt(2 / (5 * shape[0]))


def group_norm(h: jax.Array, w: jax.Array, heads: int) -> jax.Array:
    """A layer norm over each head's units of h: [..., H] (float32), times w: [H]."""
    h32 = h.astype(jnp.float32).reshape(*h.shape[:-1], heads, -1)
    centred = h32 - jnp.mean(h32, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + NORM_EPS)
    return (normed.reshape(h.shape) * w).astype(h.dtype)


@register_cell
@dataclasses.dataclass(frozen=True)
class SLSTM(SequenceCell):
    name = "slstm"
    num_gates = 4
    prefetch = True
    input_bias = False  # the cell owns b: [4H], head-major, with the reference's forget-gate init
    uses_layer_input = True  # the convolution reads x itself

    # heads; R is block-diagonal with one [d, 4d] block per head (d = H / num_heads)
    num_heads: int = allowed(4, divides="hidden_dim")
    # taps of the causal convolution feeding i and f; 0 = off
    conv_size: int = allowed(4, low=0, note="0 = no convolution")

    time_scans: ClassVar[tuple[str, ...]] = ("sequential",)
    backward_forms: ClassVar[tuple[str, ...] | None] = ("sequential",)  # `backward`, through rnnlab.recurrence
    default_recurrence: ClassVar[str] = "custom_vjp"  # conf/model/slstm.yaml's (init: SequenceCell's)
    default_time_scan: ClassVar[str | None] = "sequential"

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def input_width(self) -> int:
        return (2 if self.conv_size else 4) * self.hidden_dim  # z, o (and i, f without the conv)

    def state_floats(self, seq_len):
        return 4 * self.hidden_dim  # c, n, m, h

    def input_init(self):
        return small_init

    def param_specs(self):
        h, k, d = self.hidden_dim, self.num_heads, self.head_dim
        specs = {"W_hh": ((k, d, 4 * d), nn.initializers.zeros_init()),
                 "b": ((4 * h,), self._bias_init),
                 "norm": ((h,), nn.initializers.ones_init())}
        if self.conv_size:
            specs["conv"] = ((self.conv_size, h), fan_in_uniform(self.conv_size))  # torch's depthwise Conv1d
            specs["conv_bias"] = ((h,), fan_in_uniform(self.conv_size))
            specs["W_if"] = ((h, 2 * h), small_init)
        return specs

    def _bias_init(self, key, shape, dtype=jnp.float32):
        """The reference's `powerlaw_blockdependent` for block 0: f from +5 to -7 across each head, others 0."""
        del key
        d = self.head_dim
        forget = -(-5.0 + 12.0 * (jnp.arange(d, dtype=dtype) / max(d - 1, 1)) ** 0.3)
        b = jnp.zeros((self.num_heads, 4, d), dtype).at[:, 1].set(forget)
        return b.reshape(shape)

    def _gates(self, a: jax.Array) -> tuple[jax.Array, ...]:
        """[..., 4H] head-major -> i, f, z, o: [..., H] each (head-major units)."""
        g = a.reshape(*a.shape[:-1], self.num_heads, 4, self.head_dim)
        return tuple(g[..., j, :].reshape(*a.shape[:-1], self.hidden_dim) for j in range(4))

    def _heads(self, *gates: jax.Array) -> jax.Array:
        """i, f, z, o: [..., H] each -> [..., 4H] head-major (the inverse of `_gates`)."""
        shape = gates[0].shape[:-1]
        stacked = jnp.stack([g.reshape(*shape, self.num_heads, self.head_dim) for g in gates], axis=-2)
        return stacked.reshape(*shape, 4 * self.hidden_dim)

    def _recurrent(self, h: jax.Array, w: jax.Array) -> jax.Array:
        """h: [B, H] -> h R: [B, 4H] head-major, one [d, 4d] block per head."""
        out = jnp.einsum("bkd,kde->bke", h.reshape(h.shape[0], self.num_heads, self.head_dim), w)
        return out.reshape(h.shape[0], 4 * self.hidden_dim)

    def initial_carry(self, like):
        zeros = jnp.zeros_like(like, shape=(like.shape[0], self.hidden_dim))
        return zeros, zeros, jnp.full_like(zeros, -jnp.inf), zeros  # c, n, m, h

    def step(self, params, carry, u):
        c, n, m, h = carry
        a = u + self._recurrent(h, params["W_hh"])
        i, f, z, o = self._gates(a)
        log_f = jax.nn.log_sigmoid(f) + m
        m = jnp.maximum(log_f, i)
        i, f = jnp.exp(i - m), jnp.exp(log_f - m)
        c = f * c + i * jnp.tanh(z)
        n = f * n + i
        h = jax.nn.sigmoid(o) * c / n
        return (c, n, m, h), h, (a, c, n, m)

    def hidden_from_saved(self, saved):
        a, cs, ns, _ = saved
        return jax.nn.sigmoid(self._gates(a)[3]) * cs / ns

    def backward(self, params, u, b, hs, saved, g, unroll):
        a, cs, ns, ms = saved
        i, f_pre, z, o = self._gates(a)
        m_prev = jnp.concatenate([jnp.full_like(ms[:1], -jnp.inf), ms[:-1]])
        i = jnp.exp(i - ms)
        f = jnp.exp(jax.nn.log_sigmoid(f_pre) + m_prev - ms)  # 0 at t = 0
        z, o = jnp.tanh(z), jax.nn.sigmoid(o)
        # Per step: dc = dh o / n + dc_next, dn = dn_next - dh h / n; then da_i = (dc z + dn) i,
        # da_f = (dc c_prev + dn n_prev) f sigma(-f~), da_z = dc i (1 - z^2), da_o = dh (c / n) o (1 - o).
        f_grad = f * jax.nn.sigmoid(-f_pre)
        xs = (g, o / ns, hs / ns, z, i, shift_back(cs) * f_grad, shift_back(ns) * f_grad, i * (1 - z * z),
              cs / ns * o * (1 - o), f)
        w = params["W_hh"]

        def step(carry, xs):
            dh_next, dc_next, dn_next = carry
            g_t, o_n, h_n, z_t, i_t, fc, fn, iz, oc, f_t = xs
            dh = g_t + dh_next
            dc = dh * o_n + dc_next
            dn = dn_next - dh * h_n
            da = self._heads((dc * z_t + dn) * i_t, dc * fc + dn * fn, dc * iz, dh * oc)
            dh_prev = jnp.einsum("bke,kde->bkd", da.reshape(da.shape[0], self.num_heads, -1), w)
            return (dh_prev.reshape(dh.shape), dc * f_t, dn * f_t), da

        zeros = jnp.zeros_like(g[0])
        _, da = scan(step, (zeros, zeros, zeros), xs, reverse=True, unroll=unroll)
        # dR = sum_t h_{t-1}^T da_t per head: one batched matmul over all steps (the shift on da, as
        # `rnnlab.recurrence.recurrent_weight_grad` has it).
        da_next = jnp.concatenate([da[1:], jnp.zeros_like(da[:1])])
        k, d = self.num_heads, self.head_dim
        dw = jnp.einsum("nkd,nke->kde", hs.reshape(-1, k, d), da_next.reshape(-1, k, 4 * d))
        return da, {"W_hh": dw}

    def initial_state(self, batch, dtype, cache_len=0):
        """{carry: (c, n, m, h) [B, H] each as `initial_carry` (m = -inf), conv: the conv's last K-1 inputs
        [B, K-1, H] (with the conv)}, in `dtype`."""
        state = {"carry": self.initial_carry(jnp.zeros((batch, 1), dtype))}
        if self.conv_size:
            state["conv"] = jnp.zeros((batch, self.conv_size - 1, self.hidden_dim), dtype)
        return state

    def mix_state(self, params, u, x, time_scan, unroll, recurrence, state):
        """Given a `state`: the conv from its tail, and `step` scanned from its carry, by autodiff for every
        `recurrence` (`rnnlab.recurrence`'s scans start from zeros)."""
        tail = None if state is None else state.get("conv")
        if self.conv_size:
            xc = jax.nn.silu(causal_conv(x, params["conv"].astype(x.dtype), params["conv_bias"].astype(x.dtype), tail))
            i, f = jnp.split(linear(xc, params["W_if"]), 2, axis=-1)
            z, o = jnp.split(u, 2, axis=-1)
        else:
            i, f, z, o = jnp.split(u, 4, axis=-1)
        pre = self._heads(i, f, z, o)
        cell_params = {"W_hh": params["W_hh"]}
        if state is not None:
            def step(carry, u_t):
                carry, h, _ = self.step(cell_params, carry, u_t + params["b"])
                return carry, h

            carry, hs = jax.lax.scan(step, state["carry"], pre, unroll=unroll)
            after = {"carry": carry} | ({"conv": conv_tail(x, self.conv_size, tail)} if self.conv_size else {})
            return group_norm(hs, params["norm"], self.num_heads), after
        if recurrence == "custom_vjp":
            hs = custom_recurrence(self, unroll, pre, params["b"], cell_params)
        else:
            hs = scan_cell(self, cell_params, pre, params["b"], unroll)[0]
        return group_norm(hs, params["norm"], self.num_heads), None

    def recurrent_flops(self):
        return 2 * self.hidden_dim * 4 * self.head_dim  # h R, block-diagonal: 2 H 4H / K

    def mixing_flops(self, seq_len, time_scan):
        return 2 * self.hidden_dim * 2 * self.hidden_dim * seq_len if self.conv_size else 0  # x' W_if
