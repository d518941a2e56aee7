"""The model's input map, shared by the model and its blocks: token ids are a gather of the projection's
rows (what their one-hot times the matrix is), float features a matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def is_token_ids(x: jax.Array) -> bool:
    """Whether a model input is token ids (integers) rather than float features."""
    return jnp.issubdtype(x.dtype, jnp.integer)


def embed(ids: jax.Array, table: jax.Array) -> jax.Array:
    """ids: int[...] in [0, K), table: [K, N] -> table[ids]: [..., N], zeros for an id out of range (a
    padded step's `Task.padding_id`, K): `one_hot(ids, K) @ table` as a gather, its gradient a scatter-add."""
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=0)


def project(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for float inputs x [..., K]; for token ids x int[...], the same as their one-hot's (`embed`)."""
    return embed(x, w) if is_token_ids(x) else x @ w


def apply_projection(x: jax.Array, projection: tuple[jax.Array, jax.Array], dtype) -> jax.Array:
    """The model's input projection (kernel [I, H], bias [H]) applied unfolded, in `dtype`: x P + c, a gather
    of P's rows for token ids."""
    kernel, bias = (a.astype(dtype) for a in projection)
    return project(x if is_token_ids(x) else x.astype(dtype), kernel) + bias
