"""Causal multi-head softmax attention (Vaswani et al. 2017), the reference mixer every recurrent
paper compares against. Not a recurrent cell: it has no `step`; it mixes every position at once, in
one of two forms (`model.time_scan`). u_t: [B, 3H] holds q_t, k_t and v_t; heads of width d = H / num_heads.

    [q_t, k_t, v_t] = u_t = x_t W_xh + b                       (per head: q_t^h, k_t^h, v_t^h in R^d)
    q~_t = RoPE(q_t, t),   k~_s = RoPE(k_s, s)                  (rotary positions, below)
    p_ts = softmax_{s in S_t}( q~_t . k~_s / sqrt(d) )         (per head; float32 whatever model.dtype)
    o_t^h = sum_{s in S_t} p_ts v_s^h
    y_t = [o_t^1, ..., o_t^n] W_o                              (W_o: f32[H, H])

S_t, the keys query t sees: s <= t (full causal attention, `model.window=0`), or with a sliding window
of w >= 1 (`model.window=w`, local attention as Mistral, Griffin and Samba use it) the last w,
t - w < s <= t, itself included (w = 1: itself alone).

Positions are rotary embeddings (RoPE, Su et al. 2021) on q and k, base 10000, in the half-split
(GPT-NeoX) convention: feature i of a head is paired with feature i + d/2, and the pair is rotated
by the angle t * 10000^(-2i/d), i < d/2,

    RoPE(q, t)_i       = q_i cos(t theta_i) - q_{i+d/2} sin(t theta_i)
    RoPE(q, t)_{i+d/2} = q_i sin(t theta_i) + q_{i+d/2} cos(t theta_i)

so a score q~_t . k~_s depends on the positions through t - s alone. Positions count from 0 at the
first step. Where d is odd, its last feature is not rotated (d - 1 takes the place of d above).
No residual, norm or MLP here: `model.block=residual` puts the pre-norm block around it, which
makes it a (pre-norm, gated-MLP) transformer block. The state a causal decoder keeps after T steps
is its KV cache, 2 T H floats per layer and example (with a window, 2 min(T, w) H).

Forms (`model.time_scan`), the same function:

    parallel    `jax.nn.dot_product_attention(q~, k~, v, is_causal=True, local_window_size=(w - 1, 0))`:
                JAX's default implementation, XLA's T x T scores on every platform (JAX does not pick
                cuDNN's flash kernel unless asked, `implementation="cudnn"`, which this form does not
                ask: memory and work grow as T^2, window or not).
    blockwise   flash attention in plain JAX (Dao et al. 2022) over blocks of `model.block_size` steps:
                one scan over the (query block, key block) pairs that hold a visible key, an online
                softmax along each query block's row (running max m, normaliser l and output acc),
                with FlashAttention-2's hand-written backward, which recomputes each pair's
                probabilities from the saved log-sum-exp (the same pairs, by key block). Query block i
                visits key blocks j with i - K < j <= i, K = ceil((w - 1) / block) + 1 (no window: all
                j <= i): N (N + 1) / 2 pairs of the N^2 without a window (about half the T x T work of
                `parallel`), at most K N with one. No [T, T] array is stored: memory grows as T, and at
                a fixed window so does the work.

As an RNN (`mix_state` given a state), both forms run alike: the state is the KV cache (`initial_state`),
the rotated keys k~_s and values v_s of the steps seen so far in C slots, step s in slot s mod C (without
a window C must hold every step; with one it is a ring buffer of the last w), and the position of the
next step. A segment's queries, rotated at their absolute positions, attend over the cache, then over
the segment itself, in one online softmax over blocks of `model.block_size` keys (`cached_attention`: no
[T, C] scores); slot c holds step pos - 1 - ((pos - 1 - c) mod C), empty where that is negative, and is
visible to query t where it is not empty and, with a window, within it. The segment's last min(T, C)
steps are then written into their slots.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rnnlab.cells.gla_forms import F32, mm
from rnnlab.cells.registry import SequenceCell, register_cell
from rnnlab.options import allowed

ROPE_BASE = 10000.0


def key_blocks_per_query(window: int, block: int, num_blocks: int) -> int:
    """K, the key blocks a query block of `block` steps can attend into: all N (causal: those up to
    its own) without a window; with one, its own and the ceil((w - 1) / block) before it."""
    return num_blocks if window == 0 else min(num_blocks, -(-(window - 1) // block) + 1)


def block_pairs(num_blocks: int, span: int, by_key: bool = False) -> tuple:
    """The (query block i, key block j) pairs visited, i - span < j <= i: int32 arrays i, j and `first`
    (the pair opens its row, or with `by_key` its column). In rows (i, then j ascending) or columns (j, i)."""
    pairs = [(i, j) for i in range(num_blocks) for j in range(max(0, i - span + 1), i + 1)]
    if by_key:
        pairs.sort(key=lambda ij: (ij[1], ij[0]))
    i, j = (np.array(a, np.int32) for a in zip(*pairs))
    outer = j if by_key else i
    return i, j, np.concatenate([[1], outer[1:] != outer[:-1]]).astype(np.int32)


def num_block_pairs(length: int, block_size: int, window: int) -> tuple[int, int]:
    """(block, block pairs visited) of the blockwise form at `length` steps."""
    block = max(1, min(block_size, length))
    num_blocks = -(-length // block)
    span = key_blocks_per_query(window, block, num_blocks)
    return block, span * num_blocks - span * (span - 1) // 2


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int, window: int = 0) -> jax.Array:
    """Causal softmax attention by online softmax over blocks; `window` > 0: query t sees keys
    t - window < s <= t. q, k, v: [T, B, heads, d] (rotated) -> [T, B, heads, d] in v's dtype; scores,
    the softmax's statistics and the sums in float32.

    T is zero-padded to whole blocks: padded keys sit after every real query, so causality masks them."""
    length = q.shape[0]
    block = max(1, min(block_size, length))
    num_blocks = -(-length // block)
    pad = [(0, num_blocks * block - length)] + [(0, 0)] * 3
    q, k, v = (jnp.pad(a, pad).reshape(num_blocks, block, *a.shape[1:]) for a in (q, k, v))
    o = _flash(q, k, v, window)
    return o.reshape(-1, *o.shape[2:])[:length]


def _scores(q_i, k_j, i, j, zero, window):
    """Scaled scores of query block i against key block j, the future (and keys window or more steps
    back) masked: float32 [B, heads, C, C]. `zero`: an int 0 computed from the block's data
    (`_zero_from`), so that the mask is too."""
    block = q_i.shape[0]
    s = mm("tbnd,sbnd->bnts", q_i, k_j, q_i.dtype) / math.sqrt(q_i.shape[-1])
    offset = (i - j) * block + zero  # query t sees key s where s <= t + offset (positions within the blocks)
    visible = jnp.arange(block)[None, :] <= jnp.arange(block)[:, None] + offset
    if window:
        visible &= jnp.arange(block)[None, :] > jnp.arange(block)[:, None] + offset - window
    return jnp.where(visible, s, -jnp.inf)


def _flash_forward(q, k, v, window):
    """Blocked q, k, v: [N, C, B, heads, d] -> (o: [N, C, B, heads, d] in v's dtype, the log-sum-exp of
    each query's scores: float32 [N, B, heads, C]). One scan over the visited block pairs (`block_pairs`,
    by rows), carrying the row's online softmax and writing its state into the outputs each pair (the
    row's last write stands)."""
    num_blocks, block, batch, heads, d = q.shape
    span = key_blocks_per_query(window, block, num_blocks)
    start = (jnp.full((batch, heads, block), -jnp.inf), jnp.zeros((batch, heads, block)),
             jnp.zeros((batch, heads, block, d)))

    def pair(carry, ij):
        stats, (ms, ls, accs) = carry  # [B, heads, C] twice, [B, heads, C, d]; the same for every row
        i, j, first = ij
        m, l, acc = (jnp.where(first, a, b) for a, b in zip(start, stats))
        q_i, k_j, v_j = q[i], k[j], v[j]
        s = _scores(q_i, k_j, i, j, _zero_from(q_i), window)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # -inf only where a window masks all the row's keys so far
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if window else m_new
        p = jnp.exp(s - m_safe[..., None])
        rescale = jnp.exp(m - m_safe)
        acc = acc * rescale[..., None] + mm("bnts,sbnd->bntd", p, v_j, v.dtype)
        l = l * rescale + jnp.sum(p, axis=-1)
        rows = ms.at[i].set(m_new), ls.at[i].set(l), accs.at[i].set(acc)
        return ((m_new, l, acc), rows), None

    rows = tuple(jnp.zeros((num_blocks, *a.shape)) for a in start)
    (_, (m, l, acc)), _ = jax.lax.scan(pair, (start, rows), block_pairs(num_blocks, span))
    o = jnp.moveaxis(acc / l[..., None], 3, 1).astype(v.dtype)  # [N, C, B, heads, d]
    return o, m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, window):
    """Blocked causal attention (`_flash_forward`'s o), with FlashAttention-2's backward (Dao 2023): it keeps
    q, k, v, o and the log-sum-exp, and recomputes each block pair's probabilities from them, so no
    [T, T] array and no per-block history is stored. (Autodiff of a checkpointed query block would rerun
    two products, q k^T and p v, and keep each key block's scores while differentiating it.)"""
    return _flash_forward(q, k, v, window)[0]


def _flash_fwd(q, k, v, window):
    o, lse = _flash_forward(q, k, v, window)
    return o, (q, k, v, o, lse)


def _zero_from(x: jax.Array) -> jax.Array:
    """int32 0 that depends on x's value. Inside the layer scan, JAX's partial evaluation computes
    what depends on constants alone once, ahead of the loops, and keeps it: the causal masks of
    every block pair (T^2 bytes, measured) unless they depend on the data (q forward, do backward)."""
    first = x.reshape(-1)[0]
    return jnp.where(first == first, 0, 0).astype(jnp.int32)


def _flash_bwd(window, residuals, do):
    """dq, dk, dv. Per block pair: p = exp(s - lse), dv_j += p^T do_i, dp = do_i v_j^T,
    ds = p * (dp - rowsum(do_i * o_i)), dq_i += ds k_j / sqrt(d), dk_j += ds^T q_i / sqrt(d).
    One scan over the forward's block pairs by columns: it carries dk_j, dv_j within a column, and dq."""
    q, k, v, o, lse = residuals
    num_blocks, block = q.shape[:2]
    span = key_blocks_per_query(window, block, num_blocks)
    dtype, scale = q.dtype, 1 / math.sqrt(q.shape[-1])
    delta = jnp.moveaxis(jnp.sum(do.astype(F32) * o.astype(F32), axis=-1), 1, -1)  # [N, B, heads, C], elementwise
    zeros = jnp.zeros(k.shape[1:], F32)

    def pair(carry, ij):
        (dk_j, dv_j), (dq, dk, dv) = carry
        i, j, first = ij
        dk_j, dv_j = (jnp.where(first, zeros, a) for a in (dk_j, dv_j))
        q_i, do_i, lse_i, delta_i, k_j, v_j = q[i], do[i], lse[i], delta[i], k[j], v[j]
        p = jnp.exp(_scores(q_i, k_j, i, j, _zero_from(do_i), window) - lse_i[..., None])  # 0 where masked
        dv_j = dv_j + mm("bnts,tbnd->sbnd", p, do_i, dtype)
        ds = p * (mm("tbnd,sbnd->bnts", do_i, v_j, dtype) - delta_i[..., None])
        dk_j = dk_j + mm("bnts,tbnd->sbnd", ds, q_i, dtype) * scale
        dq = dq.at[i].add(mm("bnts,sbnd->tbnd", ds, k_j, dtype) * scale)
        return ((dk_j, dv_j), (dq, dk.at[j].set(dk_j), dv.at[j].set(dv_j))), None

    grads = tuple(jnp.zeros(a.shape, F32) for a in (q, k, v))
    (_, (dq, dk, dv)), _ = jax.lax.scan(pair, ((zeros, zeros), grads), block_pairs(num_blocks, span, by_key=True))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)


def rope(x: jax.Array, base: float = ROPE_BASE, start: jax.Array | None = None) -> jax.Array:
    """Rotary embedding of x: [T, B, heads, d] at positions 0 .. T-1, or with `start` (int32[B]) at
    start_b .. start_b + T-1 (half-split pairs (i, i + d//2), an odd last feature unrotated). Elementwise:
    the angles in float32, the result in x's dtype."""
    length, half = x.shape[0], x.shape[-1] // 2
    if half == 0:
        return x
    theta = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # 10000^(-2i/d'), d' = 2 * half
    positions = jnp.arange(length)[:, None] + (0 if start is None else start[None, :])  # [T, 1] or [T, B]
    angle = positions.astype(jnp.float32)[..., None] * theta  # [T, 1 or B, half]
    cos, sin = (f(angle)[:, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], axis=-1)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: dict, block_size: int,
                     window: int = 0) -> jax.Array:
    """A segment's causal attention over the KV cache and itself: q, k, v: [T, B, heads, d] rotated at the
    positions pos .. pos + T-1 (`cache`: `Attention.initial_state`'s) -> [T, B, heads, d] in v's dtype.
    One online softmax (running max m, normaliser l, output acc: float32) over blocks of `block_size`
    keys, the cache's then the segment's, so no score array is wider than a block."""
    length, batch, heads, d = q.shape
    start = cache["pos"]  # [B]
    qpos = start[:, None] + jnp.arange(length)  # [B, T]
    carry = (jnp.full((batch, heads, length), -jnp.inf), jnp.zeros((batch, heads, length)),
             jnp.zeros((batch, heads, length, d)))
    capacity = cache["k"].shape[1]
    if capacity:  # slot c holds the last step s < pos with s = c mod C; none (s < 0) before the cache fills
        slots = jnp.arange(capacity)
        kpos = start[:, None] - 1 - jnp.mod(start[:, None] - 1 - slots, capacity)  # [B, C]
        carry = _online_blocks(carry, q, qpos, cache["k"], cache["v"], kpos, block_size, window)
    own = (jnp.swapaxes(a, 0, 1) for a in (k, v))  # batch-major [B, T, heads, d], as the cache
    m, l, acc = _online_blocks(carry, q, qpos, *own, qpos, block_size, window)
    return jnp.moveaxis(acc / l[..., None], 2, 0).astype(v.dtype)  # every query sees itself: l > 0


def _online_blocks(carry, q, qpos, k, v, kpos, block_size, window):
    """The online softmax `carry` (m, l: [B, heads, T], acc: [B, heads, T, d]) of queries q: [T, B, heads, d]
    at positions qpos: [B, T], extended over the keys k, v: [B, S, heads, d] at positions kpos: [B, S]
    (negative: an empty slot), a block of keys at a time. Query t sees key s where 0 <= kpos_s <= qpos_t,
    and with a window kpos_s > qpos_t - window. Blocks are cut out in place (no padded copy): the last
    starts at S - block, and masks the keys the block before it covered."""
    size = k.shape[1]
    block = min(block_size, size)
    scale = 1 / math.sqrt(q.shape[-1])

    def step(carry, j):
        m, l, acc = carry
        first = jnp.minimum(j * block, size - block)
        k_j, v_j, kpos_j = (jax.lax.dynamic_slice_in_dim(a, first, block, axis=1) for a in (k, v, kpos))
        s = mm("tbnd,bsnd->bnts", q, k_j, q.dtype) * scale
        kp, qp = kpos_j[:, None, :], qpos[:, :, None]  # [B, 1, S], [B, T, 1]
        visible = (kp >= 0) & (kp <= qp) & (first + jnp.arange(block) >= j * block)
        if window:
            visible &= kp > qp - window
        s = jnp.where(visible[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # -inf while a query has seen no key
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        rescale = jnp.exp(m - m_safe)
        acc = acc * rescale[..., None] + mm("bnts,bsnd->bntd", p, v_j, v.dtype)
        return (m_new, l * rescale + jnp.sum(p, axis=-1), acc), None

    return jax.lax.scan(step, carry, jnp.arange(-(-size // block)))[0]


@register_cell
@dataclasses.dataclass(frozen=True)
class Attention(SequenceCell):
    num_heads: int = allowed(4, divides="hidden_dim")  # heads of width hidden_dim / num_heads
    block_size: int = allowed(128, low=1)  # steps per query and key block of the blockwise form
    # 0: full causal attention; w >= 1: query t attends to keys t - w < s <= t (the last w, itself included)
    window: int = allowed(0, low=0, note="0 = full attention")

    name = "attention"
    num_gates = 3  # q, k, v: the input term is 3H wide, one initializer block each
    time_scans = ("parallel", "blockwise")  # jax.nn.dot_product_attention | flash-style blocks (module docstring)
    default_time_scan = "blockwise"  # conf/model/attention.yaml's: memory linear in T

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    def param_specs(self):
        return {"W_o": ((self.hidden_dim, self.hidden_dim), nn.initializers.lecun_normal())}

    def mix_state(self, params, u, x, time_scan, unroll, recurrence, state):
        """u: [T, B, 3H] -> [T, B, H], and the cache after the last step (None without `state`). Without a
        state, by the form `time_scan`; with one, every form by `cached_attention`. `unroll`, `recurrence`: unused."""
        length, batch, _ = u.shape
        q, k, v = (a.reshape(length, batch, self.num_heads, self.head_dim) for a in jnp.split(u, 3, axis=-1))
        if state is not None:
            q, k = rope(q, start=state["pos"]), rope(k, start=state["pos"])
            o = cached_attention(q, k, v, state, self.block_size, self.window)
            state = self._write(state, k, v)
        else:
            q, k = rope(q), rope(k)
            if time_scan == "blockwise":
                o = blockwise_attention(q, k, v, self.block_size, self.window)
            else:  # the kernel's layout is batch-major, [B, T, heads, d]; its window (left, right): keys besides t
                local = {"local_window_size": (self.window - 1, 0)} if self.window else {}
                o = jax.nn.dot_product_attention(*(jnp.swapaxes(a, 0, 1) for a in (q, k, v)), is_causal=True, **local)
                o = jnp.swapaxes(o, 0, 1)
        return o.reshape(length, batch, self.hidden_dim) @ params["W_o"], state

    def initial_state(self, batch, dtype, cache_len=0):
        """The KV cache: rotated keys k and values v, [B, C, heads, d] in `dtype`, step s in slot s mod C, and
        pos: int32[B], the next step's position (the same for every example). C = `cache_len`, every step
        the state will see (a step past it overwrites the oldest: the caller's error); with a window w,
        min(w, cache_len), or w where cache_len is 0 (a ring buffer of the last w steps)."""
        capacity = min(self.window, cache_len or self.window) if self.window else cache_len
        kv = jnp.zeros((batch, capacity, self.num_heads, self.head_dim), dtype)
        return {"k": kv, "v": kv, "pos": jnp.zeros((batch,), jnp.int32)}

    @staticmethod
    def _write(cache, k, v):
        """`cache` after the segment's rotated keys and values k, v: [T, B, heads, d]: its last min(T, C)
        steps in their slots (distinct, so no write order matters), pos advanced by T."""
        length, batch = k.shape[:2]
        capacity = cache["k"].shape[1]
        kept = min(length, capacity)
        slots = jnp.mod(cache["pos"][:, None] + jnp.arange(length - kept, length), max(capacity, 1))  # [B, kept]
        rows = jnp.arange(batch)[:, None]
        new = {name: cache[name].at[rows, slots].set(jnp.swapaxes(a[length - kept:], 0, 1).astype(cache[name].dtype))
               for name, a in (("k", k), ("v", v))}
        return new | {"pos": cache["pos"] + length}

    def state_floats(self, seq_len):
        # The KV cache: k_s and v_s of every step s < T, or of the last w steps with a window.
        return 2 * (min(seq_len, self.window) if self.window else seq_len) * self.hidden_dim

    def mixing_flops(self, seq_len, time_scan):
        # Per token o_t W_o (2 H^2); the scores q k^T and the sum p V, 2 H per query-key pair each, over the
        # pairs computed: parallel, all T x T (masked ones included); blockwise, the block pairs visited.
        return 2 * self._score_pairs(seq_len, time_scan) * 2 * self.hidden_dim + seq_len * 2 * self.hidden_dim ** 2

    def mixing_recompute_flops(self, seq_len, time_scan):
        # The blockwise backward recomputes the scores q k^T (p V it does not need).
        return self._score_pairs(seq_len, time_scan) * 2 * self.hidden_dim if time_scan == "blockwise" else 0

    def _score_pairs(self, seq_len, time_scan):
        """The (query, key) pairs whose scores the form computes, masked ones included."""
        if time_scan != "blockwise":
            return seq_len * seq_len
        block, pairs = num_block_pairs(seq_len, self.block_size, self.window)
        return pairs * block * block
