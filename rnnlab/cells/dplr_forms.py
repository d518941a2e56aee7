"""The diagonal-plus-low-rank (DPLR) delta rule, RWKV-7's recurrence (Peng et al. 2025, "RWKV-7 Goose with
Expressive Dynamic State Evolution"; flash-linear-attention's `generalized_delta_rule.dplr`), as plain JAX
functions: a sequential scan and the chunkwise WY form.

Row convention of rnnlab's matrix-state forms and of fla's `dplr_recurrence`, per batch row and head;
S: [dk, dv], S_0 = 0; q_t, k_t, a_t, b_t, w_t: [dk], v_t: [dv] (rows):

    S_t = (diag(w_t) + b_t^T a_t) S_{t-1} + k_t^T v_t,      o_t = q_t S_t,      w_t = exp(log_w_t) in (0, 1]^dk

(fla's alpha is a, its beta is b, its gk is log_w; q unscaled: fla's naive functions scale it by dk^-1/2.)
RWKV-7 writes S_t = S_{t-1} (diag(w_t) - kappa_t^T (a_t * kappa_t)) + v_t^T k_t with S: [dv, dk]; its
transpose is this with a = -kappa, b = kappa * iclr.

Chunkwise form. In a chunk of C steps with incoming state S, positions i, j = 1..C, let g_i = sum_{s <= i}
log_w_s (within the chunk, per channel) and gx_i = g_i - log_w_i = g_{i-1}. With u_i = a_i S_{i-1} (the
low-rank read), S_i is linear in S and the rows u_j, v_j:

    S_i = diag(exp(g_i)) S + sum_{j <= i} diag(exp(g_i - g_j)) (b_j^T u_j + k_j^T v_j)

and u_i = a_i S_{i-1} gives a unit lower-triangular system for U = [u_i]:

    (I - A_ab) U = A_ak V + (a * exp(gx)) S,     A_xy[i, j] = sum_d x_id y_jd exp(gx_id - g_jd)  (j < i, else 0)

so with T = (I - A_ab)^-1 (`unit_lower_inverse`): U = U0 + W S, U0 = T A_ak V, W = T (a * exp(gx)), and

    O  = (Q * exp(g)) S + A_qk V + A_qb U,        A_qx[i, j] = sum_d q_id x_jd exp(g_id - g_jd)  (j <= i)
    S' = diag(exp(g_C)) S + (K * exp(g_C - g))^T V + (B * exp(g_C - g))^T U

Every exponent is <= 0. The four score matrices are `gla_forms.intra_chunk_scores` (recursive secondary
chunking: exact decay ratios, no exp(-g), so no overflow for any decay); the shifted A_ab and A_ak are its
scores of (a shifted up one step, b or k), shifted down one row. U0, W and the scores of all chunks are
computed at once; a `lax.scan` over chunks does only U and S'.

State: both forms take an optional `state`, S [B, h, dk, dv] float32 before the first step (zeros: S_0 = 0),
and then return (o, S after the last step); their padded steps leave S as it is.

Arrays are time-major: q, k, a, b, log_w: [T, B, h, dk], v: [T, B, h, dv]; outputs [T, B, h, dv]. Matmuls
take operands in the input dtype and accumulate in float32; decays, the WY factors and the state are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rnnlab.cells.delta_rule_forms import unit_lower_inverse
from rnnlab.cells.gla_forms import F32, block_checkpoint_scan, from_chunks, intra_chunk_scores, mm, pad_time, to_chunks


def dplr_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, log_w: jax.Array,
                   checkpoint_every: int = 64, state: jax.Array | None = None
                   ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The DPLR delta rule one step at a time. q, k, a, b, log_w: [T, B, h, dk]; v: [T, B, h, dv] -> o: [T, B, h, dv];
    given a `state` S, (o, S after).

    Autodiff stores the state once per `checkpoint_every` steps (block_checkpoint_scan)."""
    length, batch, heads, dk = q.shape
    dtype = jnp.result_type(q, k, v)
    block = max(1, min(checkpoint_every, length))
    padded = -(-length // block) * block
    # Padded steps: w = 1, a = b = k = v = 0, so the state passes through them unchanged.
    xs = pad_time([q, k, v, a, b, log_w], padded)

    def step(state, x):
        q_t, k_t, v_t, a_t, b_t, lw_t = x
        read = mm("bhk,bhkv->bhv", a_t, state, dtype)  # a_t S_{t-1}
        state = (jnp.exp(lw_t.astype(F32))[..., None] * state + mm("bhk,bhv->bhkv", b_t, read, dtype)
                 + mm("bhk,bhv->bhkv", k_t, v_t, dtype))
        return state, mm("bhk,bhkv->bhv", q_t, state, dtype).astype(dtype)

    init = jnp.zeros((batch, heads, dk, v.shape[-1]), F32) if state is None else state.astype(F32)
    final, o = block_checkpoint_scan(step, init, xs, block)
    return o[:length] if state is None else (o[:length], final)


def dplr_chunked(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, log_w: jax.Array,
                 chunk_size: int = 64, state: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The DPLR delta rule, chunkwise WY form (module docstring). q, k, a, b, log_w: [T, B, h, dk];
    v: [T, B, h, dv] -> o: [T, B, h, dv]; given a `state` S, (o, S after).

    A `lax.scan` over chunks carries the state; autodiff keeps one state per chunk."""
    length, batch, heads, dk = q.shape
    dv = v.shape[-1]
    dtype = jnp.result_type(q, k, v)
    padded = -(-length // chunk_size) * chunk_size
    # Padded steps (at the end): q = k = v = a = b = 0 and w = 1; they touch no real output.
    q, k, v, a, b, log_w = (to_chunks(x, chunk_size) for x in pad_time([q, k, v, a, b, log_w], padded))
    log_w = log_w.astype(F32)
    g = jnp.cumsum(log_w, axis=-2)  # [N, B, h, C, dk]
    a_next = jnp.concatenate([a[..., 1:, :], jnp.zeros_like(a[..., :1, :])], axis=-2)  # a_{i+1} at row i
    # One call for the four score matrices; rows of (a_next, .) are A_ab and A_ak one row early.
    scores = intra_chunk_scores(jnp.stack([q, q, a_next, a_next]).astype(dtype),
                                jnp.stack([k, b, b, k]).astype(dtype), jnp.broadcast_to(g, (4, *g.shape)))
    a_qk, a_qb = scores[0], scores[1]
    a_ab, a_ak = (jnp.concatenate([jnp.zeros_like(s[..., :1, :]), s[..., :-1, :]], axis=-2) for s in scores[2:])
    inverse = unit_lower_inverse(jnp.eye(chunk_size, dtype=F32) - a_ab)  # T = (I - A_ab)^-1
    rhs = jnp.concatenate([mm("...ij,...jv->...iv", a_ak, v, dtype), a * jnp.exp(g - log_w)], axis=-1)
    wy = jnp.einsum("...ij,...jd->...id", inverse, rhs)
    u0, w = wy[..., :dv], wy[..., dv:]  # U0 = T A_ak V, W = T (a * exp(gx))
    write = jnp.exp(g[..., -1:, :] - g)  # exp(g_C - g_j): [N, B, h, C, dk]
    kb_write = jnp.concatenate([k * write, b * write], axis=-2)  # [N, B, h, 2C, dk]
    decay = jnp.exp(g[..., -1, :])[..., None]  # [N, B, h, dk, 1]

    def step(state, x):
        u0_c, w_c, kb_c, v_c, decay_c = x
        u = u0_c + mm("bhck,bhkv->bhcv", w_c, state, dtype)  # U = U0 + W S
        vu = jnp.concatenate([v_c.astype(F32), u], axis=-2)
        return decay_c * state + mm("bhck,bhcv->bhkv", kb_c, vu, dtype), (state, u)

    init = jnp.zeros((batch, heads, dk, dv), F32) if state is None else state.astype(F32)
    final, (states_in, u) = jax.lax.scan(step, init, (u0, w, kb_write, v, decay))
    o = (mm("nbhck,nbhkv->nbhcv", q * jnp.exp(g), states_in, dtype) + mm("...ij,...jv->...iv", a_qk, v, dtype)
         + mm("...ij,...jv->...iv", a_qb, u, dtype))
    o = from_chunks(o.astype(dtype), length)
    return o if state is None else (o, final)


def unit_lower_inverse_flops(chunk: int) -> int:
    """Matmul FLOPs of one `unit_lower_inverse` of a [chunk, chunk] matrix: X22 L21 X11 per level past the 2x2s."""
    size = 1 << (chunk - 1).bit_length()
    return sum(2 * 2 * w**3 * (size // (2 * w)) for w in (2**i for i in range(1, size.bit_length() - 1)))


def dplr_flops(seq_len: int, heads: int, dk: int, dv: int, time_scan: str, chunk_size: int) -> int:
    """Forward matmul FLOPs of `dplr_recurrent` (`sequential`) or `dplr_chunked` (`chunked`, chunk
    min(chunk_size, T)) over one example of `seq_len` steps with `heads` heads."""
    if time_scan == "sequential":  # a_t S, b_t^T (a_t S), k_t^T v_t, q_t S_t per step, over whole blocks
        block = min(chunk_size, seq_len)
        return heads * (-(-seq_len // block) * block) * 8 * dk * dv
    if time_scan == "fused":  # the same per step (`rnnlab.fused.dplr`), no padding
        return heads * seq_len * 8 * dk * dv
    c = min(chunk_size, seq_len)
    s = 1 << (c - 1).bit_length()
    per_chunk = (4 * dk * s * (s + 1)  # the four score matrices (intra_chunk_scores)
                 + 2 * c * c * dv + unit_lower_inverse_flops(c) + 2 * c * c * (dv + dk)  # A_ak V, T, T [A_ak V | a]
                 + 2 * c * dk * dv + 2 * 2 * c * dk * dv  # W S; [K | B]^T [V | U]
                 + 2 * c * dk * dv + 2 * 2 * c * c * dv)  # (Q exp(g)) S, A_qk V + A_qb U
    return heads * -(-seq_len // c) * per_chunk


def dplr_recompute_flops(seq_len: int, heads: int, dk: int, dv: int, time_scan: str, chunk_size: int) -> int:
    """Matmul FLOPs the backward reruns: the sequential and fused forms' state updates of each checkpointed block."""
    if time_scan == "fused":
        return heads * seq_len * 6 * dk * dv
    if time_scan != "sequential":
        return 0
    block = min(chunk_size, seq_len)
    return heads * (-(-seq_len // block) * block) * 6 * dk * dv
