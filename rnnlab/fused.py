"""Fused CPU kernels of the matrix-state recurrences, forward and backward, as XLA FFI calls: `model.time_scan=fused`.

XLA's CPU code runs a recurrence's step as a handful of small operations inside a loop, each paying a fixed cost
and re-reading the state from memory (docs/performance-notes.md); flash-linear-attention's fused recurrent Triton
kernels keep the state in registers on a GPU instead. These are their CPU counterpart: one C++ loop per batch row
and head keeps the state in cache for the whole sequence, and the backward recomputes each block's states from a
checkpoint rather than storing every step. The kernels (rnnlab/native/*.cc) are compiled on first use
(`native_build`) and cached per machine. Where they cannot be built, `available()` is False with the reason.

The delta rule's kernel (`delta_rule`) runs DeltaNet, gated DeltaNet and DeltaProduct (n sub-steps a token):
the same equations and layouts as `rnnlab.cells.delta_rule_forms` and `rnnlab.cells.delta_product_forms`.
Gated linear attention's (`gated_linear`) runs GLA, linear attention and Mamba-2: `gla_forms.gla_recurrent`'s
equations, with the transitions given as values (one per key row, or one per head). Both compute in float32 (other
dtypes are computed in float32 and cast back).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rnnlab import native_build

SOURCE = native_build.NATIVE / "delta_rule.cc"
FORWARD, BACKWARD = "rnnlab_delta_rule_forward", "rnnlab_delta_rule_backward"
GLA_SOURCE = native_build.NATIVE / "gated_linear.cc"
GLA_FORWARD, GLA_BACKWARD = "rnnlab_gated_linear_forward", "rnnlab_gated_linear_backward"
FLAGS = ["-O3", "-std=c++17", "-march=native", "-fno-math-errno"]
# Tokens between the states the forward keeps for the backward: the backward recomputes a block's states into a
# buffer of block x (n + 1) states per row and head, small enough to stay in cache at the zoo's head widths.
BLOCK = 16

_loaders = [
    native_build.Loader(lambda: native_build.build(SOURCE, FLAGS),
                        {FORWARD: "RnnlabDeltaRuleForward", BACKWARD: "RnnlabDeltaRuleBackward"}),
    native_build.Loader(lambda: native_build.build(GLA_SOURCE, FLAGS),
                        {GLA_FORWARD: "RnnlabGatedLinearForward", GLA_BACKWARD: "RnnlabGatedLinearBackward"}),
]


def _load() -> tuple[bool, str]:
    for loader in _loaders:
        lib, why = loader.load()
        if lib is None:
            return False, why
    return True, ""


def available() -> tuple[bool, str]:
    """(True, "") where the fused kernels are built and loaded, else (False, the reason)."""
    return _load()


def _require() -> None:
    ok, why = available()
    if not ok:
        raise RuntimeError(f"model.time_scan=fused: {why}")


def _forward(q, k, v, beta, log_alpha, s0):
    _require()
    length, batch, heads, _, dv = v.shape
    blocks = -(-length // BLOCK)
    outputs = (jax.ShapeDtypeStruct((length, batch, heads, dv), jnp.float32),
               jax.ShapeDtypeStruct(s0.shape, jnp.float32),
               jax.ShapeDtypeStruct((blocks, *s0.shape), jnp.float32))
    return jax.ffi.ffi_call(FORWARD, outputs, vmap_method="sequential")(q, k, v, beta, log_alpha, s0, block=BLOCK)


@jax.custom_vjp
def _delta_rule(q, k, v, beta, log_alpha, s0):
    return _forward(q, k, v, beta, log_alpha, s0)[:2]


def _delta_rule_fwd(q, k, v, beta, log_alpha, s0):
    o, s_last, checkpoints = _forward(q, k, v, beta, log_alpha, s0)
    return (o, s_last), (q, k, v, beta, log_alpha, checkpoints)


def _delta_rule_bwd(saved, cotangents):
    q, k, v, beta, log_alpha, checkpoints = saved
    d_o, ds_last = cotangents
    outputs = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (q, k, v, beta, log_alpha, checkpoints[0]))
    return tuple(jax.ffi.ffi_call(BACKWARD, outputs, vmap_method="sequential")(
        q, k, v, beta, log_alpha, checkpoints, d_o, ds_last, block=BLOCK))


_delta_rule.defvjp(_delta_rule_fwd, _delta_rule_bwd)


def delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, log_alpha: jax.Array | None = None,
               state: jax.Array | None = None):
    """The (gated) delta rule, or DeltaProduct with n sub-steps a token, in the fused kernel.

    q: [T, B, h, dk]; k: [T, B, h, dk] or [T, B, h, n, dk]; v: [T, B, h, dv] or [T, B, h, n, dv]; beta: [T, B, h]
    or [T, B, h, n]; log_alpha (None: alpha = 1): [T, B, h] -> o: [T, B, h, dv] in q's dtype, or given `state`
    (S_0: float32 [B, h, dk, dv]), (o, S_T)."""
    product = k.ndim == 5
    if not product:
        k, v, beta = k[:, :, :, None], v[:, :, :, None], beta[..., None]
    length, batch, heads, _, dk = k.shape
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    if log_alpha is None:
        log_alpha = jnp.zeros((length, batch, heads), jnp.float32)
    s0 = jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32) if state is None else state
    o, s_last = _delta_rule(f32(q), f32(k), f32(v), f32(beta), f32(log_alpha), f32(s0))
    o = o.astype(jnp.result_type(q, k, v))
    return o if state is None else (o, s_last)


def _gla_forward(q, k, v, a, s0):
    _require()
    length = q.shape[0]
    outputs = (jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct(s0.shape, jnp.float32),
               jax.ShapeDtypeStruct((-(-length // BLOCK), *s0.shape), jnp.float32))
    return jax.ffi.ffi_call(GLA_FORWARD, outputs, vmap_method="sequential")(q, k, v, a, s0, block=BLOCK)


@jax.custom_vjp
def _gated_linear(q, k, v, a, s0):
    return _gla_forward(q, k, v, a, s0)[:2]


def _gated_linear_fwd(q, k, v, a, s0):
    o, s_last, checkpoints = _gla_forward(q, k, v, a, s0)
    return (o, s_last), (q, k, v, a, checkpoints)


def _gated_linear_bwd(saved, cotangents):
    q, k, v, a, checkpoints = saved
    d_o, ds_last = cotangents
    outputs = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v, a, checkpoints[0]))
    return tuple(jax.ffi.ffi_call(GLA_BACKWARD, outputs, vmap_method="sequential")(
        q, k, v, a, checkpoints, d_o, ds_last, block=BLOCK))


_gated_linear.defvjp(_gated_linear_fwd, _gated_linear_bwd)


def gated_linear(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, state: jax.Array | None = None):
    """S_t = diag(a_t) S_{t-1} + k_t^T v_t, o_t = q_t S_t, in the fused kernel. q, k: [T, B, h, dk] (a head axis of 1
    is shared by the heads); v: [T, B, h, dv]; a, the transitions: [T, B, h, dk] or [T, B, h] (one per head)
    -> o: [T, B, h, dv] in q's dtype, or given `state` (S_0: float32 [B, h, dk, dv]), (o, S_T)."""
    length, batch, heads, dv = v.shape
    dk = q.shape[-1]
    shape = (length, batch, heads, dk)
    f32 = lambda x: jnp.broadcast_to(x.astype(jnp.float32), shape)  # noqa: E731
    a = a[..., None] if a.ndim == 3 else a
    s0 = jnp.zeros((batch, heads, dk, dv), jnp.float32) if state is None else state
    o, s_last = _gated_linear(f32(q), f32(k), v.astype(jnp.float32), a.astype(jnp.float32), s0.astype(jnp.float32))
    o = o.astype(jnp.result_type(q, k, v))
    return o if state is None else (o, s_last)
