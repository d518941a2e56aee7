"""Mamba-2's SSD layer (Dao and Gu 2024, "Transformers are SSMs: Generalized Models and Efficient
Algorithms Through Structured State Space Duality", Sec. 7 and Listing 1; the reference's
`mamba_ssm/modules/mamba2.py`). Inner width D = E*H (`model.expand` = E), heads of P channels
(`model.head_dim`; heads = D / P), state size N (`model.state_size`), one group (B and C shared by
every head), conv width K (`model.conv_size`):

    [z_t, x_t, B_t, C_t, dt_t] = u_t = x_in_t W_xh     (z, x: [D]; B, C: [N]; dt: [heads]; no bias)
    [x'_t, B'_t, C'_t] = silu(conv([x, B, C])_t)        (depthwise, causal, with a bias, as Mamba's)
    Delta_t = softplus(dt_t + dt_bias)                  ([heads])
    h_t = exp(Delta_t A) h_{t-1} + (Delta_t x'_t) B'_t^T      (per head: h: [P, N]; A = -exp(A_log), a
                                                               scalar per head: the SSD restriction)
    y_t = h_t C'_t + D_skip x'_t                        (D_skip: one per head)
    out_t = RMSNorm(y_t * silu(z_t)) W_out              (the gated norm after the gate, eps 1e-5; no bias)

In the matrix-state cells' row convention (`rnnlab.cells.gla_forms`), per head S = h^T: [N, P] is GLA
with one gate per head: q = C', k = B', v = Delta x', log alpha = Delta A. Forms (`model.time_scan`):
`sequential` (one step at a time, `gla_forms.gla_recurrent`, autodiff keeps one state per chunk) and
`chunked` (SSD's chunkwise matmul form, `gla_forms.ssd_chunked`); both run in float32 whatever
`model.dtype`, as the reference's scan does. Both carry a state (`initial_state`): S per head and the
conv's last K-1 inputs.

`model.allow_neg_eigval=true` (Grazzi et al., ICLR 2025, "Unlocking State-Tracking in Linear RNNs Through
Negative Eigenvalues") makes the decay 2 exp(Delta_t A) - 1, in (-1, 1]: the chunked form works with log
|alpha| and carries each product's sign (`gla_forms.scalar_decays`).

Initialisation as the reference's: A = U[1, 16] per head through A_log; D_skip = 1; softplus(dt_bias) =
dt, log-uniform in [1e-3, 1e-1]; the conv (weight and bias), in_proj and out_proj as PyTorch's Conv1d
and Linear default (`model.init=default`); the norm's weight 1. Mamba-2's model stacks residual blocks
x + Mamba2(RMSNorm(x)) with no MLP (the reference's `d_intermediate=0`; conf/model/mamba2.yaml). Left out:
several groups (`ngroups`), `dt_limit` (the reference's default, (0, inf), clips nothing) and the
learnable initial state (off by default there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rnnlab import fused
from rnnlab.cells.common import (a_log_uniform_init, causal_conv, conv_tail, dt_bias_init, fan_in_uniform,
                                 torch_linear_init)
from rnnlab.cells.gla_forms import decay, doubled_decay, gla_recurrent, ssd_chunked
from rnnlab.cells.matrix import padded_length
from rnnlab.cells.registry import SequenceCell, register_cell
from rnnlab.options import allowed

NORM_EPS = 1e-5  # the reference's gated RMSNorm


@register_cell
@dataclasses.dataclass(frozen=True)
class Mamba2(SequenceCell):
    state_size: int = allowed(128, low=1)  # N: state per channel (the reference's d_state)
    head_dim: int = allowed(64, low=1)  # P: channels per head; an inner width below it is one head
    conv_size: int = allowed(4, low=0)  # K: width of the short causal depthwise convolution over x, B and C; 0 = none
    expand: int = allowed(2, low=1)  # E: inner width E * hidden_dim
    chunk_size: int = allowed(64, low=1)  # steps per chunk (chunked form) and per checkpointed block (sequential form)
    allow_neg_eigval: bool = False  # the decay 2 exp(Delta A) - 1 in (-1, 1) (Grazzi et al. 2025), not exp(Delta A)

    name = "mamba2"
    time_scans = ("sequential", "chunked", "fused")  # fused: `rnnlab.fused.gated_linear`, CPU
    # conf/model/mamba2.yaml's (init, recurrence: SequenceCell's): the chunked form. Not the fused one: its train
    # step measured 0.8x the chunked form's at S3's shape on a CPU, though the recurrence alone ran 1.2x faster
    # (docs/benchmarks.md, "Fused kernels"); `model.time_scan=fused` runs it by name.
    default_time_scan = "auto"
    long_form = "chunked"
    auto_fused = False
    input_bias = False  # the reference's in_proj has no bias

    @property
    def inner(self) -> int:
        return self.expand * self.hidden_dim

    @property
    def head_width(self) -> int:
        return min(self.head_dim, self.inner)

    @property
    def num_heads(self) -> int:
        return self.inner // self.head_width

    @property
    def input_width(self) -> int:
        return 2 * self.inner + 2 * self.state_size + self.num_heads  # z, x, B, C, dt

    def input_init(self):
        """in_proj as the reference's nn.Linear (`model.init=default`), else the named scheme's."""
        if self.init != "default":
            return super().input_init()
        return torch_linear_init

    def param_specs(self):
        conv_width = self.inner + 2 * self.state_size
        specs = {}
        if self.conv_size:
            specs["conv_w"] = ((self.conv_size, conv_width), fan_in_uniform(self.conv_size))
            specs["conv_b"] = ((conv_width,), fan_in_uniform(self.conv_size))
        return {**specs,
                "dt_bias": ((self.num_heads,), dt_bias_init),
                "A_log": ((self.num_heads,), a_log_uniform_init),  # A ~ U[1, 16]
                "D": ((self.num_heads,), jax.nn.initializers.ones),
                "norm": ((self.inner,), jax.nn.initializers.ones),
                "W_out": ((self.inner, self.hidden_dim), fan_in_uniform(self.inner))}

    def option_problem(self):
        problem = super().option_problem()
        if problem:
            return problem
        if self.inner % self.head_width:
            return (f"key 'model.head_dim': got {self.head_dim}, must divide the inner width expand * hidden_dim "
                    f"({self.inner}) or exceed it")
        return None

    def mix_state(self, params, u, x, time_scan, unroll, recurrence, state):
        """u: [T, B, 2D + 2N + heads] -> [T, B, H], and the state after the last step (None without `state`)."""
        d, n, heads = self.inner, self.state_size, self.num_heads
        z, xbc, dt = jnp.split(u, [d, 2 * d + 2 * n], axis=-1)
        conv_in, tail = xbc, None if state is None else state.get("conv")
        if self.conv_size:
            xbc = causal_conv(xbc, params["conv_w"], params["conv_b"], tail)
        xs, b_in, c_out = jnp.split(jax.nn.silu(xbc).astype(jnp.float32), [d, d + n], axis=-1)
        delta = jax.nn.softplus(dt.astype(jnp.float32) + params["dt_bias"])  # [T, B, heads]
        delta_a = delta * -jnp.exp(params["A_log"])
        log_alpha, negative = delta_a, None
        if self.allow_neg_eigval:
            log_alpha, negative = doubled_decay(log_alpha)
        xs = xs.reshape(*xs.shape[:2], heads, self.head_width)  # [T, B, heads, P]
        v = delta[..., None] * xs
        q, k = c_out[:, :, None, :], b_in[:, :, None, :]  # one group: [T, B, 1, N]
        s0 = None if state is None else state["ssm"]
        if time_scan == "chunked":
            y = ssd_chunked(q, k, v, log_alpha, min(self.chunk_size, u.shape[0]), negative, state=s0)
        elif time_scan == "fused":  # one group of q and k, shared by the heads; one transition per head
            y = fused.gated_linear(q, k, v, decay(delta_a, self.allow_neg_eigval), s0)
        else:
            shape = (*v.shape[:3], n)
            per_key = lambda a: None if a is None else jnp.broadcast_to(a[..., None], shape)  # noqa: E731
            y = gla_recurrent(jnp.broadcast_to(q, shape), jnp.broadcast_to(k, shape), v, per_key(log_alpha),
                              self.chunk_size, per_key(negative), state=s0)
        if state is not None:  # given a state, the forms return (y, S after the last step)
            y, s = y
        y = (y + params["D"][:, None] * xs).reshape(*u.shape[:2], d)
        y = y * jax.nn.silu(z.astype(jnp.float32))
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + NORM_EPS) * params["norm"]
        out = y.astype(u.dtype) @ params["W_out"]
        if state is None:
            return out, None
        return out, {"ssm": s} | ({"conv": conv_tail(conv_in, self.conv_size, tail)} if self.conv_size else {})

    def initial_state(self, batch, dtype, cache_len=0):
        """S = h^T per head: f32[B, heads, N, P] (gla_forms' row convention; the SSM runs in float32), and the
        conv's last K-1 inputs [B, K-1, D + 2N] (x, B, C) in `dtype`."""
        state = {"ssm": jnp.zeros((batch, self.num_heads, self.state_size, self.head_width), jnp.float32)}
        width = self.inner + 2 * self.state_size
        return state | ({"conv": jnp.zeros((batch, self.conv_size - 1, width), dtype)} if self.conv_size else {})

    def state_floats(self, seq_len):
        return self.inner * self.state_size  # h: [heads, P, N] (the conv's last K-1 inputs are not counted)

    def mixing_flops(self, seq_len, time_scan):
        d, n, p, heads = self.inner, self.state_size, self.head_width, self.num_heads
        out = 2 * d * self.hidden_dim * seq_len
        if time_scan == "sequential":  # k_t^T v_t and q_t S_t per head and step, over whole blocks
            return out + heads * padded_length(seq_len, self.chunk_size) * 4 * n * p
        if time_scan == "fused":  # the same per step, no padding
            return out + heads * seq_len * 4 * n * p
        c = min(self.chunk_size, seq_len)
        chunks = padded_length(seq_len, c) // c
        per_chunk = 2 * c * c * n + heads * (2 * c * c * p + 4 * c * n * p)  # C B^T once; scores x, B^T x, C S
        return out + chunks * per_chunk

    def mixing_recompute_flops(self, seq_len, time_scan):
        # the sequential form's backward reruns each block's state updates k_t^T v_t
        if time_scan == "fused":
            return self.num_heads * seq_len * 2 * self.state_size * self.head_width
        if time_scan != "sequential":
            return 0
        return self.num_heads * padded_length(seq_len, self.chunk_size) * 2 * self.state_size * self.head_width

