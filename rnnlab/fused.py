"""Fused CPU kernels of the recurrences, forward and backward, as XLA FFI calls: `model.time_scan=fused`.

XLA's CPU code runs a recurrence's step as a handful of small operations inside a loop, each paying a fixed cost
and re-reading the state from memory (docs/performance-notes.md); flash-linear-attention's fused recurrent Triton
kernels keep the state in registers on a GPU instead. These are their CPU counterpart: one C++ loop per batch row
and head keeps the state in cache for the whole sequence, and the backward recomputes each block's states from a
checkpoint rather than storing every step. The kernels (rnnlab/native/*.cc) are compiled on first use
(`native_build`) and cached per machine. Where they cannot be built, `available()` is False with the reason.

The delta rule's kernel (`delta_rule`) runs DeltaNet, gated DeltaNet and DeltaProduct (n sub-steps a token):
the same equations and layouts as `rnnlab.cells.delta_rule_forms` and `rnnlab.cells.delta_product_forms`.
Gated linear attention's (`gated_linear`) runs GLA, linear attention and Mamba-2: `gla_forms.gla_recurrent`'s
equations, with the transitions given as values (one per key row, or one per head). The DPLR delta rule's (`dplr`)
runs RWKV-7: `dplr_forms.dplr_recurrent`'s equations. Mamba's selective scan (`selective_scan`): `mamba.selective_ssm`'s.
All compute in float32 (other dtypes are computed in float32
and cast back).
"""

from __future__ import annotations

import concurrent.futures
import math

import jax
import jax.numpy as jnp

from rnnlab import native_build

SOURCE = native_build.NATIVE / "delta_rule.cc"
FORWARD, BACKWARD = "rnnlab_delta_rule_forward", "rnnlab_delta_rule_backward"
GLA_SOURCE = native_build.NATIVE / "gated_linear.cc"
GLA_FORWARD, GLA_BACKWARD = "rnnlab_gated_linear_forward", "rnnlab_gated_linear_backward"
DPLR_SOURCE = native_build.NATIVE / "dplr.cc"
DPLR_FORWARD, DPLR_BACKWARD = "rnnlab_dplr_forward", "rnnlab_dplr_backward"
SCAN_SOURCE = native_build.NATIVE / "selective_scan.cc"
SCAN_FORWARD, SCAN_BACKWARD = "rnnlab_selective_scan_forward", "rnnlab_selective_scan_backward"
FLAGS = ["-O3", "-std=c++17", "-march=native", "-fno-math-errno"]
# The selective scan's exp per state element: vectorised (glibc's libmvec) only where the compiler may reorder math
SCAN_FLAGS = [*FLAGS, "-ffast-math"]
# Tokens between the states the forward keeps for the backward: the backward recomputes a block's states into a
# buffer of block x (n + 1) states per row and head, small enough to stay in cache at the zoo's head widths.
BLOCK = 16

_loaders = [
    native_build.Loader(lambda: native_build.build(SOURCE, FLAGS),
                        {FORWARD: "RnnlabDeltaRuleForward", BACKWARD: "RnnlabDeltaRuleBackward"}),
    native_build.Loader(lambda: native_build.build(GLA_SOURCE, FLAGS),
                        {GLA_FORWARD: "RnnlabGatedLinearForward", GLA_BACKWARD: "RnnlabGatedLinearBackward"}),
    native_build.Loader(lambda: native_build.build(DPLR_SOURCE, FLAGS),
                        {DPLR_FORWARD: "RnnlabDplrForward", DPLR_BACKWARD: "RnnlabDplrBackward"}),
    native_build.Loader(lambda: native_build.build(SCAN_SOURCE, SCAN_FLAGS),
                        {SCAN_FORWARD: "RnnlabSelectiveScanForward", SCAN_BACKWARD: "RnnlabSelectiveScanBackward"}),
]


def _load() -> tuple[bool, str]:
    # The four builds side by side (a few seconds of the compiler each, once per machine)
    with concurrent.futures.ThreadPoolExecutor(len(_loaders)) as pool:
        for lib, why in pool.map(lambda loader: loader.load(), _loaders):
            if lib is None:
                return False, why
    return True, ""


def available() -> tuple[bool, str]:
    """(True, "") where the fused kernels are built and loaded, else (False, the reason)."""
    return _load()


def refusal(key: str, cell: str, forms: tuple[str, ...], platform: str) -> str | None:
    """Why `key`=fused cannot run for `cell` (its forms `forms`) on `platform` (`auto`: not known yet), in the
    config's one line; None where it can. The config check and `models.build_model` both ask."""
    others = ", ".join(f for f in forms if f != "fused")
    if platform not in ("cpu", "auto"):
        return (f"key '{key}': got 'fused', a CPU kernel, but the platform is {platform}; allowed: auto, {others} "
                f"(cell {cell!r})")
    ok, why = available()
    if not ok:
        return f"key '{key}': got 'fused', but its kernel cannot be built here ({why}); allowed: auto, {others}"
    return None


def _require() -> None:
    ok, why = available()
    if not ok:
        raise RuntimeError(f"model.time_scan=fused: {why}")


def _kernel(forward: str, backward: str, out_shape, per_row: tuple[int, ...] = (), **attrs):
    """The differentiable call `(*inputs, s0) -> (out, s_last)` of a kernel pair: the forward FFI target returns
    (out, of shape `out_shape(*inputs)`, s_last, the state every BLOCK steps), the backward target takes the inputs, those
    checkpoints and the two cotangents and returns every input's gradient and s0's. `per_row`: the inputs whose
    gradient comes per batch row (a leading axis of s0's batch, summed here: a parameter shared by the rows)."""

    def run_forward(*args):
        _require()
        *inputs, s0 = args
        outputs = (jax.ShapeDtypeStruct(out_shape(*inputs), jnp.float32),
                   jax.ShapeDtypeStruct(s0.shape, jnp.float32),
                   jax.ShapeDtypeStruct((-(-inputs[0].shape[0] // BLOCK), *s0.shape), jnp.float32))
        return jax.ffi.ffi_call(forward, outputs, vmap_method="sequential")(*args, block=BLOCK, **attrs)

    @jax.custom_vjp
    def call(*args):
        return tuple(run_forward(*args)[:2])

    def call_fwd(*args):
        out, s_last, checkpoints = run_forward(*args)
        return (out, s_last), (*args[:-1], checkpoints)

    def call_bwd(saved, cotangents):
        *inputs, checkpoints = saved
        batch = checkpoints.shape[1]
        shapes = [((batch,) if i in per_row else ()) + x.shape for i, x in enumerate(inputs)] + [checkpoints.shape[1:]]
        grads = jax.ffi.ffi_call(backward, tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes),
                                 vmap_method="sequential")(*inputs, checkpoints, *cotangents, block=BLOCK, **attrs)
        return tuple(jnp.sum(g, axis=0) if i in per_row else g for i, g in enumerate(grads))

    call.defvjp(call_fwd, call_bwd)
    return call


# Each kernel's call, its inputs in its FFI handler's order (rnnlab/native/*.cc).
_delta_rule = _kernel(FORWARD, BACKWARD, lambda q, k, v, *_: (*q.shape[:3], v.shape[-1]))  # q, k, v, beta, log_alpha
_gated_linear = _kernel(GLA_FORWARD, GLA_BACKWARD, lambda q, k, v, a: v.shape)  # q, k, v, a
_dplr = _kernel(DPLR_FORWARD, DPLR_BACKWARD, lambda q, k, a, b, w, v: v.shape)  # q, k, a, b, w, v
# delta, x, b, c, a (dA comes per row); Grazzi et al.'s decay is the kernel's `negative` attribute
_selective_scan = {negative: _kernel(SCAN_FORWARD, SCAN_BACKWARD, lambda delta, *_: delta.shape, per_row=(4,),
                                     negative=negative) for negative in (False, True)}


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


def mlstm(q: jax.Array, k: jax.Array, v: jax.Array, log_i: jax.Array, log_f: jax.Array, eps: float,
          state: tuple[jax.Array, jax.Array, jax.Array] | None = None):
    """The xLSTM's mLSTM (`mlstm_forms.mlstm_recurrent`'s arguments and stabilised equations) in gated linear
    attention's kernel. Its scaled states are one: with m_t = max(log f_t + m_{t-1}, i~_t), [C~ | n~]_t =
    exp(log f_t + m_{t-1} - m_t) [C~ | n~]_{t-1} + (exp(i~_t - m_t) k_t)^T [v_t | 1], a gated linear recurrence with one
    transition per head and a value column of ones for the normaliser; the stabiliser m (a max-plus scan over the
    heads' scalars) and the normalisation around the kernel stay in JAX, as do their gradients.
    q, k: [T, B, h, dk]; v: [T, B, h, dv]; log_i, log_f: [T, B, h] -> h: [T, B, h, dv] in v's dtype, or given
    `state` (the scaled C, n, m: float32 [B, h, dk, dv], [B, h, dk], [B, h]), (h, the state after)."""
    length, batch, heads, dk = q.shape
    dv = v.shape[-1]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    if state is None:
        c0, n0, m0 = (jnp.zeros((batch, heads, dk, dv), jnp.float32), jnp.zeros((batch, heads, dk), jnp.float32),
                      jnp.zeros((batch, heads), jnp.float32))
    else:
        c0, n0, m0 = (f32(a) for a in state)
    log_i, log_f = f32(log_i), f32(log_f)

    # Step t maps m to max(log f_t + m, i~_t); (a, b) stands for m -> max(a + m, b), and two steps compose to
    # (a1 + a2, max(a2 + b1, b2)): every m_t from m_0 in one associative scan, its sums over the terms themselves.
    def compose(first, second):
        return first[0] + second[0], jnp.maximum(second[0] + first[1], second[1])

    shift, floor = jax.lax.associative_scan(compose, (log_f, log_i))
    m = jnp.maximum(shift + m0, floor)  # [T, B, h]
    m_before = jnp.concatenate([m0[None], m[:-1]])
    forget = jnp.exp(log_f + m_before - m)
    keys = jnp.exp(log_i - m)[..., None] * f32(k)
    values = jnp.concatenate([f32(v), jnp.ones((length, batch, heads, 1), jnp.float32)], axis=-1)
    s0 = jnp.concatenate([c0, n0[..., None]], axis=-1)
    o, s_last = gated_linear(q / math.sqrt(dk), keys, values, forget, s0)  # one transition per head
    h = o[..., :dv] / (jnp.maximum(jnp.abs(o[..., dv]), jnp.exp(-m)) + eps)[..., None]
    h = h.astype(v.dtype)
    return h if state is None else (h, (s_last[..., :dv], s_last[..., dv], m[-1]))


def dplr(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, log_w: jax.Array,
         state: jax.Array | None = None):
    """S_t = (diag(exp(log_w_t)) + b_t^T a_t) S_{t-1} + k_t^T v_t, o_t = q_t S_t (`dplr_forms.dplr_recurrent`'s
    arguments) in the fused kernel. q, k, a, b, log_w: [T, B, h, dk]; v: [T, B, h, dv] -> o: [T, B, h, dv] in the
    inputs' dtype, or given `state` (S_0: float32 [B, h, dk, dv]), (o, S_T)."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    length, batch, heads, dk = q.shape
    s0 = jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32) if state is None else state
    o, s_last = _dplr(f32(q), f32(k), f32(a), f32(b), jnp.exp(f32(log_w)), f32(v), f32(s0))
    o = o.astype(jnp.result_type(q, k, v))
    return o if state is None else (o, s_last)


def selective_scan(delta: jax.Array, xs: jax.Array, b_in: jax.Array, c_out: jax.Array, a: jax.Array,
                   h0: jax.Array | None = None, allow_neg_eigval: bool = False) -> tuple[jax.Array, jax.Array]:
    """(y_t = h_t C_t for each t, h_T), h_t = dec(Delta_t A) * h_{t-1} + (Delta_t x_t) B_t from `h0` (None: zeros),
    dec = exp, or 2 exp - 1 with `allow_neg_eigval`, in the fused kernel (`rnnlab.cells.mamba.selective_ssm`'s
    arguments): delta, xs: f32[T, B, D]; b_in, c_out: f32[T, B, N]; a: f32[D, N]; h0: f32[B, D, N]."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    h0 = jnp.zeros((*delta.shape[1:], a.shape[-1]), jnp.float32) if h0 is None else h0
    return _selective_scan[bool(allow_neg_eigval)](f32(delta), f32(xs), f32(b_in), f32(c_out), f32(a), f32(h0))
