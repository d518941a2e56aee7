"""Causal multi-head softmax attention (Vaswani et al. 2017), the reference mixer every recurrent
paper compares against. Not a recurrent cell: it has no `step`; it mixes every position at once, in
one of two forms (`model.time_scan`). u_t: [B, 3H] holds q_t, k_t and v_t; heads of width d = H / num_heads.

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

Forms (`model.time_scan`), the same function:

    parallel    `jax.nn.dot_product_attention(q~, k~, v, is_causal=True)`: the framework's kernel, which
                picks cuDNN's flash attention on a GPU where it applies (bfloat16) and XLA's T x T
                scores elsewhere (memory grows as T^2 there).
    blockwise   flash attention in plain JAX (Dao et al. 2022): a scan over query blocks of
                `model.block_size` steps, each an online softmax over key blocks (running max m,
                normaliser l and output acc), with FlashAttention-2's hand-written backward, which
                recomputes each block pair's probabilities from the saved log-sum-exp: no [T, T]
                array is stored, memory grows as T. Every key block is visited (the future ones
                masked), so it does the T x T work of `parallel`, in blocks.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from rnnlab.cells.gla_forms import F32, mm
from rnnlab.cells.registry import SequenceCell, register_cell

ROPE_BASE = 10000.0


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int) -> jax.Array:
    """Causal softmax attention by online softmax over blocks. q, k, v: [T, B, heads, d] (rotated) ->
    [T, B, heads, d] in v's dtype; scores, the softmax's statistics and the sums in float32.

    T is zero-padded to whole blocks: padded keys sit after every real query, so causality masks them."""
    length = q.shape[0]
    block = max(1, min(block_size, length))
    num_blocks = -(-length // block)
    pad = [(0, num_blocks * block - length)] + [(0, 0)] * 3
    q, k, v = (jnp.pad(a, pad).reshape(num_blocks, block, *a.shape[1:]) for a in (q, k, v))
    o = _flash(q, k, v)
    return o.reshape(-1, *o.shape[2:])[:length]


def _scores(q_i, k_j, i, j, zero):
    """Scaled scores of query block i against key block j, the future masked: float32 [B, heads, C, C].
    `zero`: an int 0 computed from the block's data (`_zero_from`), so that the mask is too."""
    block = q_i.shape[0]
    s = mm("tbnd,sbnd->bnts", q_i, k_j, q_i.dtype) / math.sqrt(q_i.shape[-1])
    offset = (i - j) * block + zero  # query t sees key s where s <= t + offset (positions within the blocks)
    visible = jnp.arange(block)[None, :] <= jnp.arange(block)[:, None] + offset
    return jnp.where(visible, s, -jnp.inf)


def _flash_forward(q, k, v):
    """Blocked q, k, v: [N, C, B, heads, d] -> (o: [N, C, B, heads, d] in v's dtype, the log-sum-exp of
    each query's scores: float32 [N, B, heads, C])."""
    num_blocks, block, batch, heads, d = q.shape

    def query_block(_, query):
        q_i, i = query

        def key_block(stats, key):
            m, l, acc = stats  # [B, heads, C] twice, [B, heads, C, d]
            k_j, v_j, j = key
            s = _scores(q_i, k_j, i, j, _zero_from(q_i))
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # finite from block 0 on: key 0 is never masked
            p = jnp.exp(s - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            acc = acc * rescale[..., None] + mm("bnts,sbnd->bntd", p, v_j, v.dtype)
            return (m_new, l * rescale + jnp.sum(p, axis=-1), acc), None

        init = (jnp.full((batch, heads, block), -jnp.inf), jnp.zeros((batch, heads, block)),
                jnp.zeros((batch, heads, block, d)))
        (m, l, acc), _ = jax.lax.scan(key_block, init, (k, v, jnp.arange(num_blocks)))
        o = jnp.moveaxis(acc / l[..., None], 2, 0).astype(v.dtype)  # [C, B, heads, d]
        return None, (o, m + jnp.log(l))

    _, (o, lse) = jax.lax.scan(query_block, None, (q, jnp.arange(num_blocks)))
    return o, lse


@jax.custom_vjp
def _flash(q, k, v):
    """Blocked causal attention (`_flash_forward`'s o), with FlashAttention-2's backward (Dao 2023): it keeps
    q, k, v, o and the log-sum-exp, and recomputes each block pair's probabilities from them, so no
    [T, T] array and no per-block history is stored. (Autodiff of a checkpointed query block would rerun
    two products, q k^T and p v, and keep each key block's scores while differentiating it.)"""
    return _flash_forward(q, k, v)[0]


def _flash_fwd(q, k, v):
    o, lse = _flash_forward(q, k, v)
    return o, (q, k, v, o, lse)


def _zero_from(x: jax.Array) -> jax.Array:
    """int32 0 that depends on x's value. Inside the layer scan, JAX's partial evaluation computes
    what depends on constants alone once, ahead of the loops, and keeps it: the causal masks of
    every block pair (T^2 bytes, measured) unless they depend on the data (q forward, do backward)."""
    first = x.reshape(-1)[0]
    return jnp.where(first == first, 0, 0).astype(jnp.int32)


def _flash_bwd(residuals, do):
    """dq, dk, dv. Per block pair: p = exp(s - lse), dv_j += p^T do_i, dp = do_i v_j^T,
    ds = p * (dp - rowsum(do_i * o_i)), dq_i += ds k_j / sqrt(d), dk_j += ds^T q_i / sqrt(d).
    A scan over key blocks carries dq; each runs a scan over query blocks that carries its dk_j, dv_j."""
    q, k, v, o, lse = residuals
    num_blocks = q.shape[0]
    dtype, scale = q.dtype, 1 / math.sqrt(q.shape[-1])
    delta = jnp.moveaxis(jnp.sum(do.astype(F32) * o.astype(F32), axis=-1), 1, -1)  # [N, B, heads, C], elementwise

    def key_block(dq, key):
        k_j, v_j, j = key

        def query_block(grads, query):
            dk_j, dv_j = grads
            q_i, do_i, lse_i, delta_i, i = query
            p = jnp.exp(_scores(q_i, k_j, i, j, _zero_from(do_i)) - lse_i[..., None])  # 0 where masked
            dv_j = dv_j + mm("bnts,tbnd->sbnd", p, do_i, dtype)
            ds = p * (mm("tbnd,sbnd->bnts", do_i, v_j, dtype) - delta_i[..., None])
            dk_j = dk_j + mm("bnts,tbnd->sbnd", ds, q_i, dtype) * scale
            return (dk_j, dv_j), mm("bnts,sbnd->tbnd", ds, k_j, dtype) * scale

        zeros = jnp.zeros(k_j.shape, F32)
        (dk_j, dv_j), dq_j = jax.lax.scan(query_block, (zeros, zeros), (q, do, lse, delta, jnp.arange(num_blocks)))
        return dq + dq_j, (dk_j, dv_j)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, F32), (k, v, jnp.arange(num_blocks)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)


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
    block_size: int = 128  # steps per query and key block of the blockwise form

    name = "attention"
    num_gates = 3  # q, k, v: the input term is 3H wide, one initializer block each
    time_scans = ("parallel", "blockwise")  # jax.nn.dot_product_attention | flash-style blocks (module docstring)

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    def param_specs(self):
        return {"W_o": ((self.hidden_dim, self.hidden_dim), nn.initializers.lecun_normal())}

    def option_problem(self):
        if self.num_heads < 1 or self.hidden_dim % self.num_heads:
            return (f"key 'model.num_heads': got {self.num_heads}, must be a positive divisor of "
                    f"hidden_dim={self.hidden_dim} (heads of width hidden_dim / num_heads)")
        if self.block_size < 1:
            return f"key 'model.block_size': got {self.block_size}, must be >= 1"
        return None

    def mix(self, params, u, x, time_scan, unroll, recurrence):
        """u: [T, B, 3H] -> [T, B, H] by the form `time_scan`; `unroll` and `recurrence` are unused."""
        length, batch, _ = u.shape
        q, k, v = (a.reshape(length, batch, self.num_heads, self.head_dim) for a in jnp.split(u, 3, axis=-1))
        q, k = rope(q), rope(k)
        if time_scan == "blockwise":
            o = blockwise_attention(q, k, v, self.block_size)
        else:  # the kernel's layout is batch-major, [B, T, heads, d]
            o = jax.nn.dot_product_attention(*(jnp.swapaxes(a, 0, 1) for a in (q, k, v)), is_causal=True)
            o = jnp.swapaxes(o, 0, 1)
        return o.reshape(length, batch, self.hidden_dim) @ params["W_o"]

    def state_floats(self, seq_len):
        return 2 * seq_len * self.hidden_dim  # the KV cache: k_s and v_s of every step s < T

    def padded_length(self, seq_len, time_scan):
        """The length the scores are computed over: whole blocks in the blockwise form."""
        if time_scan != "blockwise":
            return seq_len
        block = min(self.block_size, seq_len)
        return -(-seq_len // block) * block

    def mixing_flops(self, seq_len, time_scan):
        # Per token: q_t against all T keys (2 T d per head: 2 T H), the same for p_t V (the full T x T,
        # masked half included, as computed; blockwise: over whole blocks), and o_t W_o (2 H^2).
        t = self.padded_length(seq_len, time_scan)
        return t * 4 * t * self.hidden_dim + seq_len * 2 * self.hidden_dim * self.hidden_dim

    def mixing_recompute_flops(self, seq_len, time_scan):
        # The blockwise backward recomputes the scores q k^T (p V it does not need).
        t = self.padded_length(seq_len, time_scan)
        return t * 2 * t * self.hidden_dim if time_scan == "blockwise" else 0
