"""DeltaNet (Schlag, Irie and Schmidhuber 2021; chunkwise training: Yang, Wang, Zhang, Shen and
Kim 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length") and
gated DeltaNet (Yang, Kautz and Hatamizadeh 2025, "Gated Delta Networks"): the time-mixing
recurrence as plain JAX functions, a sequential scan and the chunkwise WY form.

The papers write S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t
(columns). In the row convention used here, per batch row and head, S: [dk, dv], S_0 = 0 or a given state:

    S_t = alpha_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,      o_t = q_t S_t

beta_t in (0, 1), alpha_t = exp(log_alpha_t) in (0, 1] one scalar per head; alpha = 1 is DeltaNet.
q and k come L2-normalised (by the caller). Equivalently S_t = alpha_t S_{t-1} + k_t^T u_t
with u_t = beta_t (v_t - alpha_t k_t S_{t-1}).

Chunkwise WY form (Yang et al. 2024, Sec. 3; gated: Yang et al. 2025). In a chunk of C steps
with incoming state S, positions i, j = 1..C, g_i = sum_{s <= i} log_alpha_s (within the chunk)
and G_ij = exp(g_i - g_j) for j <= i, 0 above the diagonal (all exponents <= 0). Unrolling the
recurrence from S gives S_i = exp(g_i) S + sum_{j <= i} G_ij k_j^T u_j, and substituting it
into u_i gives a unit lower-triangular system for the rows u_i:

    (I + A) U = diag(beta) V - diag(beta exp(g)) K S,       A = tril(diag(beta) (K K^T * G), -1)

so with T = (I + A)^{-1} diag(beta) (T K and T V are the WY factors):

    W = T diag(exp(g)) K,     U = T V,     U' = U - W S                      (U' = the rows u_i)
    O  = diag(exp(g)) Q S + (Q K^T * G) U'                                    (G lower incl. diagonal)
    S' = exp(g_C) S + (diag(exp(g_C - g)) K)^T U'

The decays enter once each: the ratios G inside A and in the intra-chunk scores, exp(g_i)
where step i reads the chunk's incoming state (W and the Q S term), exp(g_C - g_j) where
step j writes the outgoing one, and exp(g_C) on S itself. W, U and the scores of all
chunks are computed at once; a `lax.scan` over chunks does only U' and S'.

(I + A)^{-1} is formed by recursive 2x2 blocks (`unit_lower_inverse`, matmuls only) rather
than `jax.scipy.linalg.solve_triangular`: on CPU that lowers to LAPACK trsm through SciPy's
OpenBLAS, whose calls inside XLA's thread pool here took up to 30x their usual time at random
and once never returned.

Arrays are time-major: q, k: [T, B, h, dk], v: [T, B, h, dv], beta, log_alpha: [T, B, h];
outputs [T, B, h, dv]. Matmuls take operands in the input dtype and accumulate in float32;
gates, the WY factors and the state are float32. Each form takes an optional initial state `state`
(S_0: float32 [B, h, dk, dv]); given one, it returns (o, the state after the last step) instead of o.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from rnnlab.cells.gla_forms import (F32, block_checkpoint_scan, from_chunks, mm, pad_time, pow2_ceil, scalar_decays,
                                    to_chunks)


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """Inverse of unit lower-triangular matrices [..., C, C] (their strict upper part must be 0),
    by recursive 2x2 blocks: inv [[L11, 0], [L21, L22]] = [[X11, 0], [-X22 L21 X11, X22]]."""
    chunk = lower.shape[-1]
    size = pow2_ceil(chunk)
    if size != chunk:  # pad with the identity
        lower = jnp.pad(lower, [(0, 0)] * (lower.ndim - 2) + [(0, size - chunk)] * 2)
        lower = lower + jnp.diag(jnp.arange(size) >= chunk).astype(lower.dtype)
    lead = lower.shape[:-2]
    if size == 1:
        return jnp.ones_like(lower)
    # The 2x2 diagonal blocks [[1, 0], [l, 1]] invert to [[1, 0], [-l, 1]]: no product needed.
    pairs = jnp.diagonal(lower.reshape(*lead, size // 2, 2, size // 2, 2), axis1=-4, axis2=-2)
    inv = jnp.eye(2, dtype=lower.dtype) - jnp.moveaxis(pairs, -1, -3) * jnp.array([[0, 0], [1, 0]], lower.dtype)
    width = 2
    while width < size:
        n = size // (2 * width)
        blocks = jnp.diagonal(lower.reshape(*lead, n, 2 * width, n, 2 * width), axis1=-4, axis2=-2)
        l21 = jnp.moveaxis(blocks, -1, -3)[..., width:, :width]  # [..., n, width, width]
        halves = inv.reshape(*lead, n, 2, width, width)
        x11, x22 = halves[..., 0, :, :], halves[..., 1, :, :]
        x21 = -(x22 @ l21 @ x11)
        top = jnp.concatenate([x11, jnp.zeros_like(x21)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([x21, x22], axis=-1)], axis=-2)
        width *= 2
    return inv.reshape(*lead, size, size)[..., :chunk, :chunk]


def _delta_scan(q, k, v, beta, log_alpha, s0, dtype, keep_states):
    """The steps of `delta_rule_block`: o_t, and with `keep_states` the state before each step too."""

    def step(s, x):
        q_t, k_t, v_t, beta_t, la_t = x
        s_in = s
        s = jnp.exp(la_t.astype(F32))[..., None, None] * s
        err = v_t.astype(F32) - mm("bhk,bhkv->bhv", k_t, s, dtype)
        s = s + mm("bhk,bhv->bhkv", k_t, beta_t.astype(F32)[..., None] * err, dtype)
        o = mm("bhk,bhkv->bhv", q_t, s, dtype).astype(dtype)
        return s, ((o, s_in) if keep_states else o)

    out, s = jax.lax.scan(step, s0, (q, k, v, beta, log_alpha))[::-1]
    return out, s


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def delta_rule_block(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, log_alpha: jax.Array, s0: jax.Array,
                     dtype: Any) -> tuple[jax.Array, jax.Array]:
    """(o, S after the last step): the gated delta rule one step at a time from S = `s0` (shapes: module docstring;
    log_alpha given), with a hand-written backward: it reruns the steps once to keep the state before each, then a
    reverse scan whose every step works on one [B, h, dk, dv] state, where autodiff of the scan stores and reads
    each step's intermediates over the whole block. Matmuls as `mm` in `dtype`; the backward in float32."""
    return _delta_scan(q, k, v, beta, log_alpha, s0, dtype, False)


def _delta_rule_block_fwd(q, k, v, beta, log_alpha, s0, dtype):
    return _delta_scan(q, k, v, beta, log_alpha, s0, dtype, False), (q, k, v, beta, log_alpha, s0)


def _delta_rule_block_bwd(dtype, residuals, cotangents):
    q, k, v, beta, log_alpha, s0 = residuals
    do, ds_last = cotangents
    (_, before), _ = _delta_scan(q, k, v, beta, log_alpha, s0, dtype, True)
    f32 = lambda x: x.astype(F32)  # noqa: E731

    def step(ds, x):
        q_t, k_t, v_t, beta_t, la_t, do_t, s_prev = x
        a = jnp.exp(la_t)
        s_a = a[..., None, None] * s_prev  # S after the gate
        err = v_t - jnp.einsum("bhk,bhkv->bhv", k_t, s_a)
        u = beta_t[..., None] * err  # S_t = S_a + k^T u
        g = ds + q_t[..., None] * do_t[..., None, :]  # dL/dS_t
        d_q = jnp.einsum("bhkv,bhv->bhk", s_a + k_t[..., None] * u[..., None, :], do_t)
        d_u = jnp.einsum("bhk,bhkv->bhv", k_t, g)
        d_err = beta_t[..., None] * d_u
        d_k = jnp.einsum("bhkv,bhv->bhk", g, u) - jnp.einsum("bhkv,bhv->bhk", s_a, d_err)
        ds_a = g - k_t[..., None] * d_err[..., None, :]
        d_la = a * jnp.sum(ds_a * s_prev, axis=(-2, -1))
        return a[..., None, None] * ds_a, (d_q, d_k, d_err, jnp.sum(d_u * err, axis=-1), d_la)

    ds0, grads = jax.lax.scan(step, f32(ds_last), (f32(q), f32(k), f32(v), f32(beta), f32(log_alpha), f32(do), before),
                              reverse=True)
    return (*(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, beta, log_alpha))), ds0.astype(s0.dtype))


delta_rule_block.defvjp(_delta_rule_block_fwd, _delta_rule_block_bwd)


def delta_rule_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array,
                         log_alpha: jax.Array | None = None, checkpoint_every: int = 64,
                         state: jax.Array | None = None, custom_backward: bool = True) -> Any:
    """(Gated) delta rule one step at a time. q, k: [T, B, h, dk]; v: [T, B, h, dv];
    beta, log_alpha (None: alpha = 1): [T, B, h] -> o: [T, B, h, dv] (given `state`, (o, S_T)).

    The backward keeps the state once per `checkpoint_every` steps: each block of steps is one
    `delta_rule_block` (its backward hand-written), or with `custom_backward=False` autodiff of each
    `jax.checkpoint`ed block (block_checkpoint_scan)."""
    length, batch, heads, dk = q.shape
    dtype = jnp.result_type(q, k, v)
    if log_alpha is None:
        log_alpha = jnp.zeros(beta.shape, F32)
    block = max(1, min(checkpoint_every, length))
    padded = -(-length // block) * block
    # Padded steps: alpha = 1, beta = k = v = 0, so the state passes through them unchanged.
    xs = pad_time([q, k, v, beta, log_alpha], padded)
    init = jnp.zeros((batch, heads, dk, v.shape[-1]), F32) if state is None else state
    if custom_backward:
        blocks = [x.reshape(padded // block, block, *x.shape[1:]) for x in xs]
        final, o = jax.lax.scan(lambda s, b: delta_rule_block(*b, s, dtype)[::-1], init, blocks)
        o = o.reshape(padded, *o.shape[2:])
        return o[:length] if state is None else (o[:length], final)

    def step(s, x):
        q_t, k_t, v_t, beta_t, la_t = x
        s = jnp.exp(la_t.astype(F32))[..., None, None] * s
        err = v_t.astype(F32) - mm("bhk,bhkv->bhv", k_t, s, dtype)
        s = s + mm("bhk,bhv->bhkv", k_t, beta_t.astype(F32)[..., None] * err, dtype)
        return s, mm("bhk,bhkv->bhv", q_t, s, dtype).astype(dtype)

    final, o = block_checkpoint_scan(step, init, xs, block)
    return o[:length] if state is None else (o[:length], final)


def delta_rule_chunked(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array,
                       log_alpha: jax.Array | None = None, chunk_size: int = 64,
                       state: jax.Array | None = None) -> Any:
    """(Gated) delta rule, chunkwise WY form (module docstring). q, k: [T, B, h, dk]; v: [T, B, h, dv];
    beta, log_alpha (None: alpha = 1): [T, B, h] -> o: [T, B, h, dv] (given `state`, (o, S_T)).

    A `lax.scan` over chunks carries the state; autodiff keeps one state per chunk."""
    length, batch, heads, dk = q.shape
    dv = v.shape[-1]
    dtype = jnp.result_type(q, k, v)
    padded = -(-length // chunk_size) * chunk_size
    # Padded steps (at the end): q = k = v = beta = 0, alpha = 1; they touch no real output.
    gated = log_alpha is not None
    xs = pad_time([q, k, v, beta] + ([log_alpha] if gated else []), padded)
    q, k, v = (to_chunks(x, chunk_size) for x in xs[:3])  # [N, B, h, C, d]
    beta = to_chunks(xs[3], chunk_size).astype(F32)  # [N, B, h, C]

    if gated:  # G_ij = exp(g_i - g_j) (j <= i), exp(g_i), exp(g_C - g_j), exp(g_C): [N, B, h, ...]
        ratio, read, write, decay = scalar_decays(to_chunks(xs[4], chunk_size))
    else:
        ratio = jnp.tril(jnp.ones((chunk_size, chunk_size), F32))
        read = write = decay = None

    strict = jnp.tril(mm("...id,...jd->...ij", k, k, dtype) * ratio, -1)
    lower = jnp.eye(chunk_size, dtype=F32) + beta[..., :, None] * strict  # I + A
    k_read = k.astype(F32) if read is None else k * read
    rhs = beta[..., None] * jnp.concatenate([v.astype(F32), k_read.astype(F32)], axis=-1)
    wy = jnp.einsum("...ij,...jd->...id", unit_lower_inverse(lower), rhs)
    u, w = wy[..., :dv], wy[..., dv:]  # U = T V, W = T diag(exp(g)) K
    scores = mm("...id,...jd->...ij", q, k, dtype) * ratio  # (Q K^T * G), lower incl. diagonal
    k_write = k if write is None else k * write

    def step(s, x):
        u_c, w_c, k_c = x[:3]
        u_new = u_c - mm("bhck,bhkv->bhcv", w_c, s, dtype)  # U' = U - W S
        kept = s if decay is None else x[3] * s
        return kept + mm("bhck,bhcv->bhkv", k_c, u_new, dtype), (s, u_new)

    init = jnp.zeros((batch, heads, dk, dv), F32) if state is None else state
    xs = (u, w, k_write) + (() if decay is None else (decay,))
    final, (states_in, u_new) = jax.lax.scan(step, init, xs)
    q_read = q if read is None else q * read
    o = mm("nbhck,nbhkv->nbhcv", q_read, states_in, dtype) + mm("...ij,...jv->...iv", scores, u_new, dtype)
    o = from_chunks(o.astype(dtype), length)
    return o if state is None else (o, final)
