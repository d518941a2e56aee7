"""Gated linear attention (Yang, Wang, Shen, Panda and Kim 2023) and plain linear attention
(Katharopoulos et al. 2020), matrix-state cells (`rnnlab.cells.matrix`). Per head, S: [dk, dv]:

    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,      o_t = q_t S_t / sqrt(dk)
    alpha_t = sigmoid(u_alpha,t)^(1/16)                (per key dimension; the paper's normaliser 16)

with an output gate, y = (RMSNorm(o) * silu(g)) W_o. `linear_attention` is the same layer with
alpha = 1 and no gates, y = RMSNorm(o) W_o. Forms (`model.time_scan`): `sequential` (one step at a time,
`gla_forms.gla_recurrent`), `associative` (the elementwise recurrence of the [dk, dv] states through
`rnnlab.recurrence`, every step's state materialised: short sequences only) and `chunked` (the
chunkwise-parallel form, `gla_forms.gla_chunked`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rnnlab import fused
from rnnlab.cells.gla_forms import gla_chunked, gla_recurrent, pow2_ceil
from rnnlab.cells.matrix import MatrixCell, padded_length, with_state
from rnnlab.cells.registry import register_cell
from rnnlab.recurrence import linear_recurrence, scan_linear

GATE_NORMALIZER = 16.0


@register_cell
@dataclasses.dataclass(frozen=True)
class GLA(MatrixCell):
    name = "gla"
    output_gate = True
    time_scans = ("sequential", "associative", "chunked", "fused")  # fused: `rnnlab.fused.gated_linear`, CPU
    backward_forms = ("associative",)  # custom_vjp: linear_recurrence's backward; the others by autodiff
    # model.time_scan=auto: fused on a CPU where the kernel builds (`rnnlab.models.build_model`), else chunked
    default_time_scan = "auto"
    long_form = "chunked"
    gated = True

    def extra_width(self):
        return self.hidden_dim if self.gated else 0  # alpha's logits, one per key dimension

    def log_alpha(self, extra, like):
        if not self.gated:
            return jnp.zeros(like.shape, jnp.float32)
        return jax.nn.log_sigmoid(extra.astype(jnp.float32)).reshape(like.shape) / GATE_NORMALIZER

    def mix_heads(self, params, q, k, v, extra, time_scan, unroll, recurrence, state):
        q = q / math.sqrt(self.head_dim)
        log_alpha = self.log_alpha(extra, q)
        if time_scan == "chunked":
            return with_state(gla_chunked(q, k, v, log_alpha, min(self.chunk_size, q.shape[0]), state), state)
        if time_scan == "sequential":
            return with_state(gla_recurrent(q, k, v, log_alpha, self.chunk_size, state=state), state)
        if time_scan == "fused":
            return with_state(fused.gated_linear(q, k, v, jnp.exp(log_alpha), state), state)
        a = jnp.broadcast_to(jnp.exp(log_alpha)[..., None], (*k.shape, v.shape[-1]))
        b = (k[..., :, None] * v[..., None, :]).astype(jnp.float32)
        if state is not None:  # S_0 = a_0 S_{-1} + b_0: the state folds into the first step's b
            b = b.at[0].add(a[0] * state)
        scan = linear_recurrence if recurrence == "custom_vjp" else scan_linear
        states = scan(a, b, "associative", unroll)  # [T, B, heads, dk, dv]
        return jnp.einsum("tbhk,tbhkv->tbhv", q.astype(jnp.float32), states).astype(q.dtype), states[-1]

    def recurrence_flops(self, seq_len, time_scan):
        d, heads = self.head_dim, self.num_heads
        if time_scan == "associative":
            return heads * seq_len * 2 * d * d  # q_t S_t
        if time_scan == "sequential":  # k_t^T v_t and q_t S_t per step, over whole blocks
            return heads * padded_length(seq_len, self.chunk_size) * 4 * d * d
        if time_scan == "fused":  # the same per step, no padding
            return heads * seq_len * 4 * d * d
        c = min(self.chunk_size, seq_len)
        s = pow2_ceil(c)  # the scores: s diagonal entries, then (s - 1) s / 2 pairs, each a d-long product
        per_chunk = d * s * (s + 1) + 2 * c * c * d + 4 * c * d * d  # scores, A V, K^T V, Q S
        return heads * (padded_length(seq_len, c) // c) * per_chunk

    def mixing_recompute_flops(self, seq_len, time_scan):
        d = self.head_dim  # the sequential and fused forms' backward reruns each block's state updates k_t^T v_t
        if time_scan == "fused":
            return self.num_heads * seq_len * 2 * d * d
        return self.num_heads * padded_length(seq_len, self.chunk_size) * 2 * d * d if time_scan == "sequential" else 0


@register_cell
@dataclasses.dataclass(frozen=True)
class LinearAttention(GLA):
    name = "linear_attention"
    gated = False
    output_gate = False
