"""Gated DeltaProduct (Siems et al. 2025; flash-linear-attention's `GatedDeltaProduct` layer), a
matrix-state cell (`rnnlab.cells.matrix`): gated DeltaNet with `model.num_householder` = n keys, values
and strengths per token, whose n delta-rule steps compose the token's transition
(`rnnlab.cells.delta_product_forms` has the recurrence). Per head, S: [dk, dv]:

    [q | k_1..k_n | v_1..v_n] = silu(conv(...)),  q, k_j L2-normalised per head, q scaled by 1/sqrt(dk)
    beta_{t,j} = sigmoid(u_beta,t,j)  (2 sigmoid(.) with `model.allow_neg_eigval`; one per head and step j)
    alpha_t = exp(-exp(A_log) softplus(u_alpha,t + dt_bias))           (one per head and token)
    S_t = alpha_t prod_j (I - beta_{t,j} k_{t,j}^T k_{t,j}) S_{t-1} + ...,   o_t = q_t S_t
    y = (RMSNorm(o) * silu(g)) W_o

The input term's layout is fla's, [q | (n, heads, d) keys | (n, heads, d) values | (n, heads) betas |
alpha's logits per head | gate], so n = 1 is `gated_deltanet` parameter for parameter, with its
initialisation (A ~ U[1, 16], Mamba's dt_bias); conf/model/deltaproduct.yaml gives it fla's block.
`model.chunk_size` counts interleaved steps (n per token) in both forms.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rnnlab import fused
from rnnlab.cells.delta_product_forms import delta_product_chunked, delta_product_recurrent
from rnnlab.cells.deltanet import GatedDeltaNet
from rnnlab.cells.matrix import l2_normalize, with_state
from rnnlab.cells.registry import register_cell
from rnnlab.options import allowed


@register_cell
@dataclasses.dataclass(frozen=True)
class DeltaProduct(GatedDeltaNet):
    # n_h: delta-rule steps (keys, values, betas) per token; 1 is gated DeltaNet
    num_householder: int = allowed(2, low=1)

    name = "deltaproduct"

    def qkv_width(self):
        return (1 + 2 * self.num_householder) * self.hidden_dim

    def split_qkv(self, qkv):
        """-> q: [T, B, heads, d]; k, v: [T, B, heads, n, d] (fla's layout: (n, heads, d) per token)."""
        h, n, heads, d = self.hidden_dim, self.num_householder, self.num_heads, self.head_dim
        q, k, v = jnp.split(qkv, [h, (1 + n) * h], axis=-1)
        per_step = lambda a: jnp.moveaxis(a.reshape(*a.shape[:2], n, heads, d), 2, 3)  # noqa: E731
        return q.reshape(*q.shape[:2], heads, d), per_step(k), per_step(v)

    def extra_width(self):
        return self.num_heads * (self.num_householder + 1)  # betas (n per head), alpha's logit per head

    def mix_heads(self, params, q, k, v, extra, time_scan, unroll, recurrence, state):
        n, heads = self.num_householder, self.num_heads
        q = l2_normalize(q) / math.sqrt(self.head_dim)
        k = l2_normalize(k)
        logits = extra[..., :n * heads].astype(jnp.float32)
        beta = jnp.moveaxis(jax.nn.sigmoid(logits).reshape(*logits.shape[:2], n, heads), 2, 3)  # [T, B, heads, n]
        if self.allow_neg_eigval:
            beta = 2 * beta
        step = jax.nn.softplus(extra[..., n * heads:].astype(jnp.float32) + params["dt_bias"])
        log_alpha = -jnp.exp(params["A_log"]) * step
        if time_scan == "chunked":
            return with_state(delta_product_chunked(q, k, v, beta, log_alpha, self.chunk_size, state), state)
        if time_scan == "fused":  # the n steps of each token in the kernel, not interleaved
            return with_state(fused.delta_rule(q, k, v, beta, log_alpha, state), state)
        return with_state(delta_product_recurrent(q, k, v, beta, log_alpha, self.chunk_size, state), state)

    @property
    def substeps(self):
        return self.num_householder

    def recurrence_flops(self, seq_len, time_scan):
        if time_scan == "fused":
            return super().recurrence_flops(seq_len, time_scan)
        return super().recurrence_flops(self.num_householder * seq_len, time_scan)  # the interleaved steps

    def mixing_recompute_flops(self, seq_len, time_scan):
        if time_scan == "fused":
            return super().mixing_recompute_flops(seq_len, time_scan)
        return super().mixing_recompute_flops(self.num_householder * seq_len, time_scan)
