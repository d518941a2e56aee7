"""Causal multi-head softmax attention (Vaswani et al. 2017), the reference mixer every recurrent
paper compares against. Not a recurrent cell: it has no `step`, and its one form (`time_scan=parallel`)
mixes every position at once. u_t: [B, 3H] holds q_t, k_t and v_t; heads of width d = H / num_heads.

    [q_t, k_t, v_t] = u_t = x_t W_xh + b                       (per head: q_t^h, k_t^h, v_t^h in R^d)
    q~_t = RoPE(q_t, t),   k~_s = RoPE(k_s, s)                  (rotary positions, below)
    p_ts = softmax_{s <= t}( q~_t . k~_s / sqrt(d) )           (per head; float32 whatever model.dtype)
    o_t^h = sum_{s <= t} p_ts v_s^h
    y_t = [o_t^1, ..., o_t^n] W_o                              (W_o: f32[H, H])

Positions are rotary embeddings (RoPE, Su et al. 2021) on q and k, base 10000, in the half-split
(GPT-NeoX) convention: feature i of a head is paired with feature i + d/2, and the pair is rotated
by the angle t * 10000^(-2i/d), i < d/2,

    RoPE(q, t)_i       = q_i cos(t theta_i) - q_{i+d/2} sin(t theta_i)
    RoPE(q, t)_{i+d/2} = q_i sin(t theta_i) + q_{i+d/2} cos(t theta_i)

so a score q~_t . k~_s depends on the positions through t - s alone. Positions count from 0 at the
first step. Where d is odd, its last feature is not rotated (d - 1 takes the place of d above).
No residual, norm or MLP here: `model.block=residual` puts the pre-norm block around it, which
makes it a (pre-norm, gated-MLP) transformer block. The state a causal decoder keeps after T steps
is its KV cache, 2 T H floats per layer and example.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from rnnlab.cells.registry import SequenceCell, register_cell

ROPE_BASE = 10000.0


def rope(x: jax.Array, base: float = ROPE_BASE) -> jax.Array:
    """Rotary embedding of x: [T, B, heads, d] at positions 0 .. T-1 (half-split pairs (i, i + d//2),
    an odd last feature unrotated). Elementwise: the angles in float32, the result in x's dtype."""
    length, half = x.shape[0], x.shape[-1] // 2
    if half == 0:
        return x
    theta = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # 10000^(-2i/d'), d' = 2 * half
    angle = jnp.arange(length, dtype=jnp.float32)[:, None] * theta  # [T, half]
    cos, sin = (f(angle)[:, None, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], axis=-1)


@register_cell
@dataclasses.dataclass(frozen=True)
class Attention(SequenceCell):
    num_heads: int = 4  # heads of width hidden_dim / num_heads

    name = "attention"
    num_gates = 3  # q, k, v: the input term is 3H wide, one initializer block each
    time_scans = ("parallel",)  # every position at once (a T x T score matrix per head)

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    def param_specs(self):
        return {"W_o": ((self.hidden_dim, self.hidden_dim), nn.initializers.lecun_normal())}

    def option_problem(self):
        if self.num_heads < 1 or self.hidden_dim % self.num_heads:
            return (f"key 'model.num_heads': got {self.num_heads}, must be a positive divisor of "
                    f"hidden_dim={self.hidden_dim} (heads of width hidden_dim / num_heads)")
        return None

    def mix(self, params, u, x, time_scan, unroll, recurrence):
        """u: [T, B, 3H] -> [T, B, H]; `time_scan`, `unroll` and `recurrence` have one choice here."""
        length, batch, _ = u.shape
        q, k, v = (a.reshape(length, batch, self.num_heads, self.head_dim) for a in jnp.split(u, 3, axis=-1))
        q, k = rope(q), rope(k)
        scores = jnp.einsum("tbnd,sbnd->bnts", q, k, preferred_element_type=jnp.float32) / math.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((length, length), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(v.dtype)
        o = jnp.einsum("bnts,sbnd->tbnd", probs, v).reshape(length, batch, self.hidden_dim)
        return o @ params["W_o"]

    def state_floats(self, seq_len):
        return 2 * seq_len * self.hidden_dim  # the KV cache: k_s and v_s of every step s < T

    def mixing_flops(self, seq_len, time_scan):
        # Per token: q_t against all T keys (2 T d per head: 2 T H), the same for p_t V (the full T x T,
        # masked half included, as computed), and o_t W_o (2 H^2); T tokens per example.
        return seq_len * (4 * seq_len * self.hidden_dim + 2 * self.hidden_dim * self.hidden_dim)
