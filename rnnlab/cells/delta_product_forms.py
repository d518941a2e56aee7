"""Gated DeltaProduct (Siems, Carstensen, Zela, Hutter, Pontil and Grazzi 2025, "DeltaProduct: Improving
State-Tracking in Linear RNNs via Householder Products"): n_h delta-rule steps per token, as plain JAX
functions over the delta rule's forms (`rnnlab.cells.delta_rule_forms`).

Per batch row and head, S: [dk, dv], S_0 = 0 or a given state, in the row convention of the delta rule's
forms; at token t, with keys k_{t,1..n}, values v_{t,1..n}, strengths beta_{t,1..n} and one gate alpha_t:

    S_{t,0} = alpha_t S_{t-1}
    S_{t,j} = (I - beta_{t,j} k_{t,j}^T k_{t,j}) S_{t,j-1} + beta_{t,j} k_{t,j}^T v_{t,j}      j = 1..n
    S_t = S_{t,n},      o_t = q_t S_t

so the transition of a token is alpha_t times a product of n generalised Householder matrices: with
beta in (0, 2) (`allow_neg_eigval`) n reflections, which compose to the rotations and permutations that
group word problems need (one reflection cannot). This is flash-linear-attention's
`naive_recurrent_gated_delta_product`: the gate once per token, before its first step; the output after
its last.

Both forms run the delta rule over the n T interleaved steps (k_{1,1}, .., k_{1,n}, k_{2,1}, ..): the gate
at each token's first step (alpha = 1 at the others), q at its last (0 at the others, whose outputs are
dropped). `delta_product_recurrent` is the sequential scan, `delta_product_chunked` the chunkwise WY form
with chunks of `chunk_size` interleaved steps.

Arrays are time-major: q: [T, B, h, dk]; k: [T, B, h, n, dk]; v: [T, B, h, n, dv]; beta: [T, B, h, n];
log_alpha: [T, B, h] or None (alpha = 1); outputs [T, B, h, dv]. Given an initial state `state` (S_0: float32
[B, h, dk, dv]), a form returns (o, the state after the last token) instead of o.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rnnlab.cells.delta_rule_forms import delta_rule_chunked, delta_rule_recurrent


def interleave(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, log_alpha: jax.Array | None):
    """The n T-step delta-rule sequence of a DeltaProduct (module docstring): q, k: [n T, B, h, dk],
    v: [n T, B, h, dv], beta, log_alpha: [n T, B, h] (log_alpha None stays None)."""
    length, batch, heads, n = beta.shape

    def steps(x):  # [T, B, h, n, ...] -> [n T, B, h, ...]
        return jnp.moveaxis(x, 3, 1).reshape(length * n, batch, heads, *x.shape[4:])

    def at(x, sub):  # x: [T, ...] placed at sub-step `sub` of each token, zeros at the others
        parts = [jnp.zeros_like(x) if j != sub else x for j in range(n)]
        return jnp.stack(parts, axis=1).reshape(length * n, *x.shape[1:])

    return (at(q, n - 1), steps(k), steps(v), steps(beta[..., None])[..., 0],
            None if log_alpha is None else at(log_alpha, 0))


def per_token(out: Any, n: int, state: jax.Array | None) -> Any:
    """A delta-rule form's result over the interleaved steps (o, or (o, S_T) given a `state`) -> the same with
    o at each token's last step."""
    return out[n - 1::n] if state is None else (out[0][n - 1::n], out[1])


def delta_product_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array,
                            log_alpha: jax.Array | None = None, checkpoint_every: int = 64,
                            state: jax.Array | None = None) -> Any:
    """Gated DeltaProduct one delta-rule step at a time (n per token); autodiff stores the state once per
    `checkpoint_every` steps. Shapes: module docstring."""
    out = delta_rule_recurrent(*interleave(q, k, v, beta, log_alpha), checkpoint_every, state)
    return per_token(out, k.shape[3], state)


def delta_product_chunked(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array,
                          log_alpha: jax.Array | None = None, chunk_size: int = 64,
                          state: jax.Array | None = None) -> Any:
    """Gated DeltaProduct, chunkwise WY form over chunks of `chunk_size` interleaved steps (at most n T).
    Shapes: module docstring."""
    n = k.shape[3]
    out = delta_rule_chunked(*interleave(q, k, v, beta, log_alpha), min(chunk_size, n * q.shape[0]), state)
    return per_token(out, n, state)
