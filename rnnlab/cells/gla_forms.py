"""Gated linear attention (GLA; Yang, Wang, Shen, Panda and Kim 2023, "Gated Linear Attention
Transformers with Hardware-Efficient Training"): the time-mixing recurrence as plain JAX
functions, a sequential scan and the chunkwise-parallel form.

Row convention, per batch row and head; S: [dk, dv], S_0 = 0 or a given state; q_t, k_t: [dk], v_t: [dv] (rows):

    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,      o_t = q_t S_t,      alpha_t = exp(log_alpha_t) in (0, 1]^dk

log_alpha = 0 is plain (causal, unnormalised) linear attention.

Chunkwise form (paper, Sec. 4). Time is cut into chunks of C steps. In a chunk with incoming
state S and positions i, j = 1..C, let g_i = sum_{s <= i} log_alpha_s (summed within the
chunk, so g is nonincreasing and <= 0). Then

    o_i = (q_i * exp(g_i)) S + sum_{j <= i} A_ij v_j,     A_ij = sum_d q_id k_jd exp(g_id - g_jd)
    S'  = diag(exp(g_C)) S + sum_j (k_j * exp(g_C - g_j))^T v_j

Every exponent there is <= 0, except that A written as (q * exp(g)) (k * exp(-g))^T needs
exp(-g), which overflows float32 once a chunk's gates sum below about -88. Here A is
computed by recursive secondary chunking: the chunk is halved; the block of pairs with i in
the second half and j in the first is one matmul, split at the reference r = g at the last
step of the first half,

    A_ij = sum_d (q_id exp(g_id - r_d)) (k_jd exp(r_d - g_jd)),      g_i <= r <= g_j,

so both factors are <= 1; the two halves on the diagonal are halved again, down to single
steps (A_ii = q_i . k_i). Each entry of A is thus one product of two bounded factors: no
overflow for any gates (tiny terms underflow to zero, as their true value is as tiny), about
C^2 dk / 2 multiply-adds in log2(C) levels, and no [C, C, dk] tensor.

Arrays are time-major: q, k, log_alpha: [T, B, h, dk], v: [T, B, h, dv]; outputs [T, B, h, dv].
Matmuls take operands in the input dtype and accumulate in float32; gates and the state are
float32. Each form takes an optional initial state `state` (S_0: float32 [B, h, dk, dv]); given one,
it returns (o, the state after the last step) instead of o. The helpers (`mm`, `pad_time`,
`to_chunks`, `from_chunks`, `block_checkpoint_scan`, `pow2_ceil`, `scalar_decays`) are shared with
`rnnlab.cells.delta_rule_forms`.

With one gate per head instead of one per key dimension (alpha_t a scalar: Mamba-2's SSD, Dao and
Gu 2024), A_ij = (q_i . k_j) exp(g_i - g_j) is one matmul times a [C, C] matrix of decay ratios,
every exponent <= 0 (`scalar_decays`, `ssd_chunked`), with no secondary chunking.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

F32 = jnp.float32
TINY = 1e-30  # the least |alpha| `doubled_decay` returns


def mm(spec: str, a: jax.Array, b: jax.Array, dtype: Any) -> jax.Array:
    """einsum of a and b cast to `dtype`, accumulated and returned in float32."""
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=F32)


def pad_time(xs: list, length: int) -> list:
    """Zero-pad each array's leading (time) axis to `length`."""
    return [jnp.pad(x, [(0, length - x.shape[0])] + [(0, 0)] * (x.ndim - 1)) for x in xs]


def to_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[N*C, B, h, ...] -> [N, B, h, C, ...]."""
    x = x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:])
    return jnp.moveaxis(x, 1, 3)


def from_chunks(x: jax.Array, length: int) -> jax.Array:
    """[N, B, h, C, ...] -> [T, B, h, ...], the first `length` steps."""
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape(-1, *x.shape[2:])[:length]


def block_checkpoint_scan(step: Callable, init: Any, xs: list, block: int, unroll: int = 1):
    """`lax.scan(step, init, xs)` over the time axis of xs (padded by the caller to a multiple
    of `block`), as an outer scan over blocks whose body is `jax.checkpoint` of the inner scan:
    autodiff keeps one carry per block, and recomputes a block's steps in its backward.
    `unroll`: the inner scan's steps per loop iteration."""

    def body(carry, xs_block):
        return jax.lax.scan(step, carry, xs_block, unroll=unroll)

    xs = [x.reshape(x.shape[0] // block, block, *x.shape[1:]) for x in xs]
    carry, ys = jax.lax.scan(jax.checkpoint(body, prevent_cse=False), init, xs)
    return carry, jax.tree_util.tree_map(lambda y: y.reshape(-1, *y.shape[2:]), ys)


def gla_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, log_alpha: jax.Array,
                  checkpoint_every: int = 64, negative: jax.Array | None = None, state: jax.Array | None = None) -> Any:
    """GLA one step at a time. q, k, log_alpha: [T, B, h, dk]; v: [T, B, h, dv] -> o: [T, B, h, dv]
    (given `state` S_0: [B, h, dk, dv], (o, S_T)). `negative` (bool, like log_alpha; None: all False)
    marks the gates that are -exp(log_alpha).

    Autodiff stores the state once per `checkpoint_every` steps (block_checkpoint_scan)."""
    length, batch, heads, dk = q.shape
    dtype = jnp.result_type(q, k, v)
    block = max(1, min(checkpoint_every, length))
    padded = -(-length // block) * block
    # Padded steps: alpha = 1, k = v = 0, so the state passes through them unchanged.
    xs = pad_time([q, k, v, log_alpha] + ([] if negative is None else [negative]), padded)

    def step(s, x):
        q_t, k_t, v_t, la_t = x[:4]
        alpha = jnp.exp(la_t.astype(F32))
        if negative is not None:
            alpha = jnp.where(x[4], -alpha, alpha)
        s = alpha[..., None] * s + mm("bhk,bhv->bhkv", k_t, v_t, dtype)
        return s, mm("bhk,bhkv->bhv", q_t, s, dtype).astype(dtype)

    init = jnp.zeros((batch, heads, dk, v.shape[-1]), F32) if state is None else state
    final, o = block_checkpoint_scan(step, init, xs, block)
    return o[:length] if state is None else (o[:length], final)


def decay(log_alpha: jax.Array, allow_neg_eigval: bool) -> jax.Array:
    """The transition itself: exp(log_alpha), or with `allow_neg_eigval` 2 exp(log_alpha) - 1 (Grazzi et al. 2025),
    exact near 1 (Mamba's scans, and the fused kernel's transitions for Mamba-2)."""
    return 1 + 2 * jnp.expm1(log_alpha) if allow_neg_eigval else jnp.exp(log_alpha)


def doubled_decay(log_alpha: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Grazzi et al.'s (ICLR 2025) switch for a decay alpha = exp(log_alpha) in (0, 1]: alpha' = 2 alpha - 1,
    in (-1, 1], as log |alpha'| and its sign (alpha' < 0) for the forms that work with log-decays.

    |alpha'| is floored at 1e-30 (log -69), so a gate at exactly 0 stays finite; its gradient there is 0."""
    shifted = 2 * jnp.expm1(log_alpha.astype(F32))  # alpha' - 1, in (-2, 0]: exact near alpha' = 1
    near_one = shifted > -0.5  # log1p there; elsewhere |alpha'| <= 1/2 is exact as 1 + shifted
    log_abs = jnp.where(near_one, jnp.log1p(jnp.maximum(shifted, -0.5)), jnp.log(jnp.maximum(jnp.abs(1 + shifted), TINY)))
    return log_abs, shifted < -1


def pow2_ceil(n: int) -> int:
    """The least power of two >= n."""
    return 1 << (n - 1).bit_length()


def intra_chunk_scores(q: jax.Array, k: jax.Array, g: jax.Array) -> jax.Array:
    """A[..., i, j] = sum_d q_id k_jd exp(g_id - g_jd) for j <= i, else 0, by recursive
    secondary chunking (module docstring). q, k: [..., C, dk]; g: float32 [..., C, dk],
    nonincreasing along C -> float32 [..., C, C]."""
    dtype = jnp.result_type(q, k)
    chunk, dk = q.shape[-2:]
    size = pow2_ceil(chunk)
    if size != chunk:  # pad to a power of two: q = k = 0 and g held at its last value
        pad = [(0, 0)] * (q.ndim - 2) + [(0, size - chunk), (0, 0)]
        q, k, g = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(g, pad, mode="edge")
    lead = q.shape[:-2]
    # Diagonal blocks of the current width, [..., size / width, width, width]; width 1 first.
    blocks = mm("...cd,...cd->...c", q, k, dtype)[..., None, None]
    width = 1
    while width < size:
        n = size // (2 * width)
        qb, kb, gb = (x.reshape(*lead, n, 2, width, dk) for x in (q, k, g))
        ref = gb[..., 0, width - 1:, :]  # g at the last step of each first half: [..., n, 1, dk]
        q_low = qb[..., 1, :, :] * jnp.exp(gb[..., 1, :, :] - ref)
        k_up = kb[..., 0, :, :] * jnp.exp(ref - gb[..., 0, :, :])
        off = mm("...nid,...njd->...nij", q_low, k_up, dtype)  # rows: second halves, columns: first
        diag = blocks.reshape(*lead, n, 2, width, width)
        top = jnp.concatenate([diag[..., 0, :, :], jnp.zeros_like(off)], axis=-1)
        bottom = jnp.concatenate([off, diag[..., 1, :, :]], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)
        width *= 2
    return blocks.reshape(*lead, size, size)[..., :chunk, :chunk]


def gla_chunked(q: jax.Array, k: jax.Array, v: jax.Array, log_alpha: jax.Array,
                chunk_size: int = 64, state: jax.Array | None = None) -> Any:
    """GLA, chunkwise-parallel, intra-chunk scores by recursive secondary chunking (overflow-free
    for any gates <= 0). q, k, log_alpha: [T, B, h, dk]; v: [T, B, h, dv] -> o: [T, B, h, dv]
    (given `state` S_0: [B, h, dk, dv], (o, S_T)).

    A `lax.scan` over chunks carries the state; autodiff keeps one state per chunk."""
    length, batch, heads, dk = q.shape
    dtype = jnp.result_type(q, k, v)
    padded = -(-length // chunk_size) * chunk_size
    # Padded steps (at the end): q = k = v = 0 and alpha = 1; they touch no real output.
    q, k, v, log_alpha = (to_chunks(x, chunk_size) for x in pad_time([q, k, v, log_alpha], padded))
    g = jnp.cumsum(log_alpha.astype(F32), axis=-2)  # [N, B, h, C, dk]
    g_last = g[..., -1:, :]
    o_intra = mm("...ij,...jv->...iv", intra_chunk_scores(q, k, g), v, dtype)
    q_in = q * jnp.exp(g)  # reads the chunk's incoming state
    k_out = k * jnp.exp(g_last - g)  # writes the chunk's outgoing state
    decay = jnp.exp(g_last[..., 0, :])[..., None]  # [N, B, h, dk, 1]

    def step(s, x):
        k_c, v_c, decay_c = x
        return decay_c * s + mm("bhck,bhcv->bhkv", k_c, v_c, dtype), s

    init = jnp.zeros((batch, heads, dk, v.shape[-1]), F32) if state is None else state
    final, states_in = jax.lax.scan(step, init, (k_out, v, decay))  # [N, B, h, dk, dv]
    o = from_chunks((o_intra + mm("nbhck,nbhkv->nbhcv", q_in, states_in, dtype)).astype(dtype), length)
    return o if state is None else (o, final)


def scalar_decays(log_alpha: jax.Array, negative: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The decays of a chunk with one gate per head. log_alpha: [..., C] -> with g_i = sum_{s <= i}
    log_alpha_s: (G [..., C, C], G_ij = exp(g_i - g_j) for j <= i else 0; exp(g_i) [..., C, 1], where
    step i reads the incoming state; exp(g_C - g_j) [..., C, 1], where step j writes the outgoing one;
    exp(g_C) [..., 1, 1], the incoming state's decay over the chunk). Every exponent is <= 0.

    `negative` (bool [..., C]; None: all False) marks the gates that are -exp(log_alpha): each product of
    gates then carries the sign (-1)^(negatives in it), s_i s_j for G_ij with s_i the sign of the first i."""
    chunk = log_alpha.shape[-1]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    g = jnp.cumsum(log_alpha.astype(F32), axis=-1)
    diff = g[..., :, None] - g[..., None, :]
    ratio = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    read, write, decay = jnp.exp(g)[..., None], jnp.exp(g[..., -1:] - g)[..., None], jnp.exp(g[..., -1])[..., None, None]
    if negative is None:
        return ratio, read, write, decay
    sign = 1 - 2 * (jnp.cumsum(negative.astype(jnp.int32), axis=-1) % 2).astype(F32)  # s_i = sign of the first i
    last = sign[..., -1:]
    return (ratio * sign[..., :, None] * sign[..., None, :], read * sign[..., None], write * (last * sign)[..., None],
            decay * last[..., None])


def ssd_chunked(q: jax.Array, k: jax.Array, v: jax.Array, log_alpha: jax.Array, chunk_size: int = 64,
                negative: jax.Array | None = None, state: jax.Array | None = None) -> Any:
    """GLA with one gate per head (Mamba-2's SSD, chunkwise): S_t = alpha_t S_{t-1} + k_t^T v_t, o_t = q_t S_t.

    q, k: [T, B, g, dk] with g = 1 (shared by every head: Mamba-2's C and B, one group) or g = h;
    v: [T, B, h, dv]; log_alpha: [T, B, h] -> o: [T, B, h, dv]; `negative` (bool, like log_alpha; None: all
    False) marks the gates that are -exp(log_alpha); given `state` S_0: [B, h, dk, dv], returns (o, S_T). Per
    chunk, q k^T is computed once per group; a `lax.scan` over chunks carries the state, and autodiff keeps one
    state per chunk."""
    length, batch, heads, dv = v.shape
    dk = q.shape[-1]
    dtype = jnp.result_type(q, k, v)
    padded = -(-length // chunk_size) * chunk_size
    # Padded steps (at the end): q = k = v = 0 and alpha = 1; they touch no real output.
    if negative is not None:
        negative = to_chunks(pad_time([negative], padded)[0], chunk_size)
    q, k, v, log_alpha = pad_time([q, k, v, log_alpha], padded)
    q, k, v, log_alpha = (to_chunks(x, chunk_size) for x in (q, k, v, log_alpha))  # [N, B, g or h, C, (d)]
    ratio, read, write, decay = scalar_decays(log_alpha, negative)
    scores = mm("...id,...jd->...ij", q, k, dtype) * ratio  # [N, B, h, C, C]
    o_intra = mm("...ij,...jv->...iv", scores, v, dtype)

    def step(s, x):
        k_c, v_c, decay_c = x
        return decay_c * s + mm("bhck,bhcv->bhkv", k_c, v_c, dtype), s

    init = jnp.zeros((batch, heads, dk, dv), F32) if state is None else state
    k_write = jnp.broadcast_to(k * write, (*write.shape[:-1], dk))  # exp(g_C - g_j) k_j: [N, B, h, C, dk]
    final, states_in = jax.lax.scan(step, init, (k_write, v, decay))  # [N, B, h, dk, dv]
    o = o_intra + mm("nbhck,nbhkv->nbhcv", jnp.broadcast_to(q * read, k_write.shape), states_in, dtype)
    o = from_chunks(o.astype(dtype), length)
    return o if state is None else (o, final)
