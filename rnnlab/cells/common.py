"""What several cell families share: the short causal convolution over time, the initialisers of the
papers' reference code (PyTorch's Linear/Conv1d default, Mamba's step and decay; an option's range is
declared on its field, `rnnlab.options`). One definition each, so that a cell states which reference it
follows by the name it imports."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4  # Mamba's initial step range, and its floor (the reference's)


def causal_conv(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, tail: jax.Array | None = None) -> jax.Array:
    """Depthwise causal convolution over time: x [T, B, C], w [K, C], bias [C] or None -> [T, B, C] with
    out_t = sum_k w_k * x_{t-K+1+k} (+ bias); x before step 0 is `tail` ([B, K-1, C], the K-1 inputs before
    the segment: `conv_tail`), or zero. Elementwise: K shifted products."""
    width, length = w.shape[0], x.shape[0]
    before = jnp.zeros_like(x, shape=(width - 1, *x.shape[1:])) if tail is None else jnp.swapaxes(tail, 0, 1).astype(x.dtype)
    padded = jnp.concatenate([before, x])
    out = sum(padded[k:k + length] * w[k] for k in range(width))
    return out if bias is None else out + bias


def conv_tail(x: jax.Array, width: int, tail: jax.Array | None = None) -> jax.Array:
    """The last `width` - 1 inputs of a causal convolution after x [T, B, C] (`tail` [B, K-1, C] before it, or
    zeros) -> [B, K-1, C]: the state the convolution carries into the next segment."""
    before = jnp.zeros_like(x, shape=(x.shape[1], width - 1, x.shape[2])) if tail is None else tail.astype(x.dtype)
    return jnp.concatenate([before, jnp.swapaxes(x, 0, 1)], axis=1)[:, x.shape[0]:]


def shift_in(xs: jax.Array, last: jax.Array | None) -> jax.Array:
    """[T, B, ...] -> [T, B, ...] holding (last, xs_0, ..., xs_{T-2}): the value at t-1 for every t, `last`
    [B, ...] (the step before the segment; None: zeros) at t = 0. A token shift that carries its state."""
    first = jnp.zeros_like(xs[:1]) if last is None else last[None].astype(xs.dtype)
    return jnp.concatenate([first, xs[:-1]], axis=0)


def uniform(bound: float):
    """U(-bound, bound)."""
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def fan_in_uniform(fan_in: int):
    """PyTorch's default for Linear and Conv1d weights and biases: U(-fan_in^-1/2, fan_in^-1/2)."""
    return uniform(1 / math.sqrt(fan_in))


def torch_linear_init(key, shape, dtype=jnp.float32):
    """A [fan_in, fan_out] weight as PyTorch's nn.Linear draws it (`fan_in_uniform` of its first axis)."""
    return fan_in_uniform(shape[0])(key, shape, dtype)


def dt_bias_init(key, shape, dtype=jnp.float32):
    """Mamba's step bias: softplus^-1(dt), dt log-uniform in [DT_MIN, DT_MAX] (floored at DT_FLOOR); also
    Mamba-2's and gated DeltaNet's."""
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, math.log(DT_MIN), math.log(DT_MAX)))
    dt = jnp.maximum(dt, DT_FLOOR)
    return dt + jnp.log(-jnp.expm1(-dt))  # softplus^-1(dt) = log(exp(dt) - 1)


def a_log_uniform_init(key, shape, dtype=jnp.float32):
    """log A with A ~ U[1, 16]: one decay rate per head (Mamba-2's and gated DeltaNet's initialisation)."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def a_log_s4d_real_init(key, shape, dtype=jnp.float32):
    """log A with A = (1, ..., N) along the last axis for every channel (Mamba's S4D-real): shape [D, N]."""
    del key
    return jnp.broadcast_to(jnp.log(jnp.arange(1, shape[-1] + 1, dtype=dtype)), shape)
