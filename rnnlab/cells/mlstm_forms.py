"""The xLSTM's mLSTM (Beck, Poeppel, Spanring, Auer, Prudnikova, Kopp, Klambauer, Brandstetter and
Hochreiter 2024, "xLSTM: Extended Long Short-Term Memory", Sec. 2.3 and App. B.3): the time-mixing
recurrence as plain JAX functions, in the three forms of the authors' mlstm-kernels (`mlstm_kernels.torch`:
`parallel.native`, `chunkwise.native`, `recurrent.native_sequence`).

Row convention, per batch row and head; C: [dk, dv], n: [dk], C_0 = 0, n_0 = 0; q_t, k_t: [dk], v_t: [dv]
(rows); i~_t, f~_t the gate pre-activations, scalars:

    C_t = f_t C_{t-1} + i_t k_t^T v_t,      n_t = f_t n_{t-1} + i_t k_t,      i_t = exp(i~_t), f_t = sigmoid(f~_t)
    h_t = (q_t / sqrt(dk)) C_t / (max(|(q_t / sqrt(dk)) . n_t|, 1) + eps)                   (eps = 1e-6)

Stabiliser: i_t = exp(i~_t) overflows, so C and n are kept scaled by exp(-m_t), m_t = max(log f_t + m_{t-1}, i~_t),
and max(|q . n|, 1) becomes max(|q . n_scaled|, exp(-m_t)). The scaling cancels except in eps: the forms read
h_t = q C~ / (max(|q . n~|, exp(-m_t)) + eps) with C~, n~ the scaled states, as the references do. Where m_t
starts differs by form, as in the references:

    recurrent, chunked   m_0 = 0 (the zero initial state counts as a term), m_t = max(log f_t + m_{t-1}, i~_t)
    parallel             m_t = max_{j <= t} (i~_j + sum_{j < s <= t} log f_s)   (no initial term)

They agree except where the initial term wins, sum_{s <= t} log f_s > every other term: then m_t <= 0 and eps
exp(m_t) <= eps shifts the denominator (>= 1 before scaling) by at most 1e-6 of itself.

Parallel form (the paper's Eq. 79-81): with g_t = sum_{s <= t} log f_s, log D_tj = g_t - g_j + i~_j (j <= t),
m_t = max_j log D_tj, C~_tj = (q_t . k_j / sqrt(dk)) exp(log D_tj - m_t), h_t = sum_j C~_tj v_j /
(max(|sum_j C~_tj|, exp(-m_t)) + eps): [T, T] scores, memory quadratic in T.

Chunkwise form (mlstm-kernels' `chunkwise.native`). Chunks of L steps; within a chunk b_i = sum_{s <= i} log f_s
(positions i, j = 1..L). A scan over chunks carries the scaled (C, n) and its stabiliser m (m_0 = 0):

    a_j = b_L - b_j + i~_j,    m' = max(b_L + m, max_j a_j)
    C' = exp(b_L + m - m') C + sum_j (exp(a_j - m') k_j)^T v_j,     n' likewise with k_j for k_j^T v_j

and each step of a chunk reads the state it came in with and the chunk's own steps:

    m_i = max(b_i + m, max_{j <= i} (b_i - b_j + i~_j))                          (the recurrent form's m_i)
    h_i = (q~_i C + sum_{j <= i} S_ij v_j) / (max(|q~_i . n + sum_{j <= i} S_ij|, exp(-m_i)) + eps)
    q~_i = exp(b_i + m - m_i) q_i / sqrt(dk),     S_ij = (q_i . k_j / sqrt(dk)) exp(b_i - b_j + i~_j - m_i)

Every exponent is <= 0. Memory is linear in T: one (C, n, m) per chunk and [L, L] scores per chunk.

State: every form takes an optional `state`, the scaled (C, n, m) before the first step (float32 [B, h, dk, dv],
[B, h, dk], [B, h]; zeros are the zero state, m_0 = 0 as above), and then returns (h, the state after the last
step). The recurrent and chunked forms start their scan from it; their padded steps get i~ = -inf (no write,
m unchanged), so the state leaves the last block as it left the last real step. The parallel form given a
state is the chunkwise form with one chunk of T steps: its [T, T] scores plus the state's read, m_t counting
the incoming term b_t + m.

Arrays are time-major: q, k: [T, B, h, dk], v: [T, B, h, dv], log_i (= i~) and log_f (= log sigmoid f~):
[T, B, h]; outputs [T, B, h, dv] in v's dtype. mlstm-kernels' are batch-major per head, q: [B, h, T, dk] and
the gates [B, h, T], and take f~ itself (they apply log sigmoid): ours(q, k, v, i, log_sigmoid(f)) reads
theirs(q, k, v, i, f) with every array's axes (T, B, h) <-> (B, h, T). Matmuls take operands in the input
dtype and accumulate in float32; gates, stabilisers and states are float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rnnlab.cells.gla_forms import (
    F32,
    block_checkpoint_scan,
    from_chunks,
    mm,
    pad_time,
    to_chunks,
)

EPS = 1e-6  # added to the normaliser, as mlstm-kernels' native forms
State = tuple[jax.Array, jax.Array, jax.Array]  # the scaled (C, n, m), float32 [B, h, dk, dv], [B, h, dk], [B, h]


def _causal_log_decays(log_f: jax.Array, log_i: jax.Array) -> jax.Array:
    """log D_ij = b_i - b_j + i~_j for j <= i, else -inf. log_f, log_i: float32 [..., L] -> [..., L, L],
    b the cumulative sum of log_f along the last axis."""
    length = log_f.shape[-1]
    b = jnp.cumsum(log_f, axis=-1)
    causal = jnp.tril(jnp.ones((length, length), bool))
    return jnp.where(causal, b[..., :, None] - b[..., None, :] + log_i[..., None, :], -jnp.inf)


def _initial(state: State | None, batch: int, heads: int, dk: int, dv: int) -> State:
    """The scan's initial (C, n, m): `state` in float32, or zeros."""
    if state is not None:
        return tuple(a.astype(F32) for a in state)
    return jnp.zeros((batch, heads, dk, dv), F32), jnp.zeros((batch, heads, dk), F32), jnp.zeros((batch, heads), F32)


def _pad_no_write(log_i: jax.Array, length: int) -> jax.Array:
    """log_i [T, ...] padded to `length` steps with -inf: padded steps write nothing and leave m as it is."""
    return jnp.pad(log_i.astype(F32), [(0, length - log_i.shape[0])] + [(0, 0)] * (log_i.ndim - 1),
                   constant_values=-jnp.inf)


def _normalise(numerator: jax.Array, denominator: jax.Array, m: jax.Array, eps: float) -> jax.Array:
    """numerator [..., dv] / (max(|denominator|, exp(-m)) + eps), denominator and m [...]."""
    return numerator / (jnp.maximum(jnp.abs(denominator), jnp.exp(-m)) + eps)[..., None]


def mlstm_parallel(q: jax.Array, k: jax.Array, v: jax.Array, log_i: jax.Array, log_f: jax.Array,
                   eps: float = EPS, state: State | None = None) -> jax.Array | tuple[jax.Array, State]:
    """The stabilised quadratic form (`mlstm_kernels.torch.parallel.native`). q, k: [T, B, h, dk];
    v: [T, B, h, dv]; log_i, log_f: [T, B, h] -> h: [T, B, h, dv]. Memory grows as T^2.
    Given a `state`: the chunkwise form in one chunk (module docstring) -> (h, the state after)."""
    if state is not None:
        return mlstm_chunked(q, k, v, log_i, log_f, q.shape[0], eps, state)
    dtype = jnp.result_type(q, k, v)
    gates = [jnp.moveaxis(a.astype(F32), 0, -1) for a in (log_f, log_i)]  # [B, h, T]
    log_d = _causal_log_decays(*gates)
    m = jnp.max(log_d, axis=-1)  # [B, h, T]: the diagonal is finite
    scores = mm("tbhd,sbhd->bhts", q, k, dtype) / math.sqrt(q.shape[-1]) * jnp.exp(log_d - m[..., None])
    weights = scores / (jnp.maximum(jnp.abs(jnp.sum(scores, axis=-1)), jnp.exp(-m)) + eps)[..., None]
    return mm("bhts,sbhv->tbhv", weights, v, dtype).astype(v.dtype)


def mlstm_chunked(q: jax.Array, k: jax.Array, v: jax.Array, log_i: jax.Array, log_f: jax.Array,
                  chunk_size: int = 64, eps: float = EPS, state: State | None = None
                  ) -> jax.Array | tuple[jax.Array, State]:
    """The chunkwise form (`mlstm_kernels.torch.chunkwise.native`, module docstring). q, k: [T, B, h, dk];
    v: [T, B, h, dv]; log_i, log_f: [T, B, h] -> h: [T, B, h, dv]; given a `state`, (h, the state after).

    A `lax.scan` over chunks carries (C, n, m); autodiff keeps one of each per chunk."""
    length, batch, heads, dk = q.shape
    dv = v.shape[-1]
    dtype = jnp.result_type(q, k, v)
    padded = -(-length // chunk_size) * chunk_size
    if state is not None:
        log_i = _pad_no_write(log_i, padded)
    # Padded steps (at the end) come after every real output: zeros, which no real output reads.
    q, k, v, log_i, log_f = (to_chunks(x, chunk_size) for x in pad_time([q, k, v, log_i, log_f], padded))
    log_i, log_f = log_i.astype(F32), log_f.astype(F32)  # [N, B, h, L]
    b = jnp.cumsum(log_f, axis=-1)
    b_last = b[..., -1]
    a = b_last[..., None] - b + log_i  # log weight of step j's write into the chunk's outgoing state

    def step(state, x):
        c, n, m = state
        k_c, v_c, a_c, b_last_c = x
        m_next = jnp.maximum(b_last_c + m, jnp.max(a_c, axis=-1))
        keep = jnp.exp(b_last_c + m - m_next)
        k_gated = k_c * jnp.exp(a_c - m_next[..., None])[..., None]  # [B, h, L, dk], float32
        c_next = keep[..., None, None] * c + mm("bhlk,bhlv->bhkv", k_gated, v_c, dtype)
        return (c_next, keep[..., None] * n + jnp.sum(k_gated, axis=-2), m_next), (c, n, m)

    init = _initial(state, batch, heads, dk, dv)
    final, (c_in, n_in, m_in) = jax.lax.scan(step, init, (k, v, a, b_last))  # [N, B, h, ...]: entering each chunk

    log_d = _causal_log_decays(log_f, log_i)  # [N, B, h, L, L]
    m_inter = b + m_in[..., None]
    m_comb = jnp.maximum(m_inter, jnp.max(log_d, axis=-1))  # [N, B, h, L]
    scale = 1 / math.sqrt(dk)
    scores = mm("...id,...jd->...ij", q, k, dtype) * scale * jnp.exp(log_d - m_comb[..., None])
    q_in = q * (jnp.exp(m_inter - m_comb) * scale)[..., None]  # reads the incoming state
    numerator = mm("nbhlk,nbhkv->nbhlv", q_in, c_in, dtype) + mm("...ij,...jv->...iv", scores, v, dtype)
    denominator = mm("nbhlk,nbhk->nbhl", q_in, n_in, dtype) + jnp.sum(scores, axis=-1)
    h = from_chunks(_normalise(numerator, denominator, m_comb, eps).astype(v.dtype), length)
    return h if state is None else (h, final)


def mlstm_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, log_i: jax.Array, log_f: jax.Array,
                    checkpoint_every: int = 64, eps: float = EPS, state: State | None = None
                    ) -> jax.Array | tuple[jax.Array, State]:
    """One step at a time (`mlstm_kernels.torch.recurrent.native_sequence`). q, k: [T, B, h, dk];
    v: [T, B, h, dv]; log_i, log_f: [T, B, h] -> h: [T, B, h, dv]; given a `state`, (h, the state after).

    Autodiff stores (C, n, m) once per `checkpoint_every` steps (block_checkpoint_scan)."""
    length, batch, heads, dk = q.shape
    dv = v.shape[-1]
    dtype = jnp.result_type(q, k, v)
    block = max(1, min(checkpoint_every, length))
    padded = -(-length // block) * block
    if state is not None:
        log_i = _pad_no_write(log_i, padded)
    # Padded steps (at the end) come after every real output: zeros, which no real output reads.
    xs = pad_time([q, k, v, log_i, log_f], padded)
    scale = 1 / math.sqrt(dk)

    def step(state, x):
        c, n, m = state
        q_t, k_t, v_t, li_t, lf_t = x
        li_t, lf_t = li_t.astype(F32), lf_t.astype(F32)
        m_new = jnp.maximum(lf_t + m, li_t)
        f_act, i_act = jnp.exp(lf_t + m - m_new), jnp.exp(li_t - m_new)
        k_t = i_act[..., None] * k_t.astype(F32)  # the input gate on k: d products, not d^2 on k^T v
        c = f_act[..., None, None] * c + mm("bhk,bhv->bhkv", k_t, v_t, dtype)
        n = f_act[..., None] * n + k_t
        q_t = q_t * scale
        h = _normalise(mm("bhk,bhkv->bhv", q_t, c, dtype), mm("bhk,bhk->bh", q_t, n, dtype), m_new, eps)
        return (c, n, m_new), h.astype(v.dtype)

    final, h = block_checkpoint_scan(step, _initial(state, batch, heads, dk, dv), xs, block)
    return h[:length] if state is None else (h[:length], final)
