"""DeltaNet (Schlag, Irie and Schmidhuber 2021; trained in chunks by Yang et al. 2024) and gated
DeltaNet (Yang, Kautz and Hatamizadeh 2025), matrix-state cells (`rnnlab.cells.matrix`). Per head,
S: [dk, dv], in the row convention of `rnnlab.cells.delta_rule_forms`:

    S_t = alpha_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,      o_t = q_t S_t / sqrt(dk)
    q_t, k_t L2-normalised per head;  beta_t = sigmoid(u_beta,t)  (one per head)
    deltanet:        alpha_t = 1
    gated_deltanet:  alpha_t = exp(-exp(A_log) softplus(u_alpha,t + dt_bias))  (one per head, Mamba-2's
                     decay), and an output gate: y = (RMSNorm(o) * silu(g)) W_o

`model.allow_neg_eigval=true` (Grazzi et al., ICLR 2025, "Unlocking State-Tracking in Linear RNNs Through
Negative Eigenvalues"; flash-linear-attention's `allow_neg_eigval`) takes beta_t = 2 sigmoid(u_beta,t), so
that I - beta_t k_t^T k_t, whose eigenvalue along k_t is 1 - beta_t, reaches (-1, 1]: a reflection, which
parity needs. The forms are unchanged (the WY system stays unit lower-triangular for any beta).

The write replaces the value stored under k_t by beta_t of the way to v_t (the delta rule), where
linear attention only adds. The transition is not diagonal, so there is no cheap associative form:
`sequential` runs it one step at a time (`delta_rule_recurrent`, its backward a hand-written reverse scan),
`chunked` is the chunkwise WY form (`delta_rule_chunked`), `fused` the sequential steps in one C++ loop on a
CPU (`rnnlab.fused.delta_rule`: the state kept in cache, the backward recomputing blocks from checkpoints).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rnnlab.cells.common import a_log_uniform_init, dt_bias_init
from rnnlab import fused
from rnnlab.cells.delta_rule_forms import delta_rule_chunked, delta_rule_recurrent
from rnnlab.cells.gla_forms import pow2_ceil
from rnnlab.cells.matrix import MatrixCell, l2_normalize, padded_length, with_state
from rnnlab.cells.registry import register_cell


@register_cell
@dataclasses.dataclass(frozen=True)
class DeltaNet(MatrixCell):
    allow_neg_eigval: bool = False  # beta in (0, 2), not (0, 1): eigenvalues of the transition in (-1, 1] (Grazzi et al.)

    name = "deltanet"
    time_scans = ("sequential", "chunked", "fused")
    # model.time_scan=auto: on a CPU where the kernel builds, fused (`rnnlab.models.build_model`); elsewhere
    # sequential up to T=64, the chunked form beyond (measured: docs/benchmarks.md, "Forms by length")
    default_time_scan = "auto"
    auto_forms = ((64, "sequential"),)
    long_form = "chunked"
    gated = False

    def extra_width(self):
        return self.num_heads * (2 if self.gated else 1)  # beta (and alpha's logit) per head

    def param_specs(self):
        specs = super().param_specs()
        if self.gated:
            specs |= {"A_log": ((self.num_heads,), a_log_uniform_init), "dt_bias": ((self.num_heads,), dt_bias_init)}
        return specs

    def mix_heads(self, params, q, k, v, extra, time_scan, unroll, recurrence, state):
        q = l2_normalize(q) / math.sqrt(self.head_dim)
        k = l2_normalize(k)
        heads = self.num_heads
        beta = jax.nn.sigmoid(extra[..., :heads].astype(jnp.float32))
        if self.allow_neg_eigval:
            beta = 2 * beta
        log_alpha = None
        if self.gated:
            step = jax.nn.softplus(extra[..., heads:].astype(jnp.float32) + params["dt_bias"])
            log_alpha = -jnp.exp(params["A_log"]) * step
        if time_scan == "chunked":
            return with_state(delta_rule_chunked(q, k, v, beta, log_alpha, min(self.chunk_size, q.shape[0]), state),
                              state)
        if time_scan == "fused":
            return with_state(fused.delta_rule(q, k, v, beta, log_alpha, state), state)
        return with_state(delta_rule_recurrent(q, k, v, beta, log_alpha, self.chunk_size, state), state)

    # Delta-rule steps a token (DeltaProduct's n_h); the fused kernel runs them without interleaving.
    substeps = 1

    def recurrence_flops(self, seq_len, time_scan):
        d, heads = self.head_dim, self.num_heads
        if time_scan == "fused":  # per token: n (k S, the rank-one write), then q S once
            return heads * seq_len * (4 * self.substeps + 2) * d * d
        if time_scan == "sequential":  # k_t S, the rank-one write k_t^T u_t, q_t S_t per step
            return heads * padded_length(seq_len, self.chunk_size) * 6 * d * d
        c = min(self.chunk_size, seq_len)
        s = pow2_ceil(c)
        widths = [2**i for i in range(1, s.bit_length() - 1)]  # the inverse's levels past the 2x2 blocks
        inverse = sum(2 * 2 * w**3 * (s // (2 * w)) for w in widths)  # X22 L21 X11 per level
        per_chunk = (2 * c * c * d  # K K^T
                     + inverse + 2 * c * c * 2 * d  # (I + A)^-1, then times [V | K]
                     + 2 * c * c * d  # Q K^T
                     + 2 * c * d * d * 3  # W S, K^T U', Q S
                     + 2 * c * c * d)  # scores U'
        return heads * (padded_length(seq_len, c) // c) * per_chunk

    def mixing_recompute_flops(self, seq_len, time_scan):
        d = self.head_dim  # the sequential and fused forms' backward reruns each block's state updates
        if time_scan == "fused":
            return self.num_heads * seq_len * 4 * self.substeps * d * d
        return self.num_heads * padded_length(seq_len, self.chunk_size) * 4 * d * d if time_scan == "sequential" else 0


@register_cell
@dataclasses.dataclass(frozen=True)
class GatedDeltaNet(DeltaNet):
    name = "gated_deltanet"
    output_gate = True
    gated = True
