"""Mamba's selective SSM block (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective
State Spaces", Algorithm 2 and Fig. 3). Inner width D = E*H (`model.expand` = E), state size N
(`model.state_size`), Delta's rank R (`model.dt_rank`; 0: ceil(H / 16)), conv width K (`model.conv_size`).

    [x_t, z_t] = u_t = x_in_t W_xh + b                 (x_t, z_t: [D]; the layer's input term, 2D wide)
    x'_t = silu(conv(x)_t),  conv(x)_t = sum_{k<K} w_k * x_{t-K+1+k} + c      (depthwise, causal; w: [K, D])
    [d_t, B_t, C_t] = x'_t W_x                          (W_x: [D, R + 2N]; d_t: [R], B_t, C_t: [N])
    Delta_t = softplus(d_t W_dt + dt_bias)              (W_dt: [R, D]; Delta_t: [D])
    A = -exp(A_log)                                     (A_log: [D, N])
    h_t = exp(Delta_t A) * h_{t-1} + (Delta_t B_t) * x'_t      (h_t: [D, N]; the discretisation of
                                                                 Mamba's code: zero-order hold for A,
                                                                 Euler for B)
    y_t = h_t C_t + D_skip * x'_t                       (D_skip: [D], the parameter `D`)
    out_t = (y_t * silu(z_t)) W_out                     (W_out: [D, H])

`model.allow_neg_eigval=true` (Grazzi et al., ICLR 2025, "Unlocking State-Tracking in Linear RNNs Through
Negative Eigenvalues"; their `deltaA * 2 - 1`) replaces exp(Delta_t A) by 2 exp(Delta_t A) - 1, in (-1, 1], in
every form: a transition that can flip the state's sign, which parity and modular counting need.

`conv_size=0` leaves the convolution out (x'_t = silu(x_t)). The recurrence is elementwise in (D, N),
run in float32 whatever `model.dtype`, as the reference implementation runs its scan. Its forms
(`model.time_scan`):

    sequential, associative   `rnnlab.recurrence.linear_recurrence` over a, b: [T, B, D, N] built in
                              full (`model.recurrence=custom_vjp`: its hand-written backward, autodiff:
                              `jax.grad` of the scan); step memory grows as T * B * D * N.
    chunked                   one `lax.scan` over time that discretises each step on the fly from
                              Delta_t, x'_t: [B, D] and B_t, C_t: [B, N] and emits y_t = h_t C_t, cut
                              into chunks of `model.chunk_size` steps; the backward keeps one h: [B, D, N]
                              per chunk and reruns a chunk's steps, so no [T, B, D, N] array exists in the
                              step (the selective scan of Mamba's CUDA kernel, which keeps h in SRAM,
                              written in JAX). `model.recurrence=custom_vjp`: each chunk's backward is
                              hand-written (`selective_ssm`), a reverse scan whose every step works on one
                              [B, D, N] state; autodiff: `jax.grad` of each `jax.checkpoint`ed chunk
                              (`gla_forms.block_checkpoint_scan`).

    fused                     the selective scan in one C++ loop per batch row on a CPU (`rnnlab.fused`:
                              the state kept in cache as [N, D], exp vectorised over the channels; the
                              backward recomputes 16-step blocks from checkpoints).

Every form carries a state (`initial_state`): h and the conv's last K-1 inputs.

Parameters and initialisation as in the reference code (`mamba_simple.py`): A = -(1, ..., N) for every
channel (S4D-real: A_log = log n); D_skip = 1; Delta's bias such that softplus(dt_bias) = dt, with dt
log-uniform in [1e-3, 1e-1]; W_dt uniform in +-R^-1/2; the conv (with its bias), W_x, W_out and the
in_proj as PyTorch's Conv1d and Linear default, uniform in +-fan_in^-1/2 (`model.init=default`). The
block's in_proj is the layer's W_xh, without a bias (`input_bias`), and W_out has none, as in the
reference. Mamba's model (conf/model/mamba.yaml) stacks residual blocks x + Mamba(RMSNorm(x)) with
no MLP (`model.block=residual`, `model.mlp=none`). Left out: the reference language model rescales
out_proj by 1/sqrt(num_layers) at init (`_init_weights`), which a cell, not knowing the depth, does not.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from rnnlab import fused
from rnnlab.cells.common import (a_log_s4d_real_init, causal_conv, conv_tail, dt_bias_init, fan_in_uniform,
                                 torch_linear_init)
from rnnlab.cells.gla_forms import block_checkpoint_scan, decay, pad_time
from rnnlab.cells.registry import SequenceCell, register_cell
from rnnlab.options import allowed
from rnnlab.recurrence import linear_recurrence, scan_linear


def _ssm_scan(delta, xs, b_in, c_out, a, h0, allow_neg_eigval, unroll, keep_states):
    """The scan of `selective_ssm`: y_t = h_t C_t, and every h_t too with `keep_states`."""

    def step(h, inp):
        d_t, x_t, b_t, c_t = inp
        h = decay(d_t[..., None] * a, allow_neg_eigval) * h + (d_t * x_t)[..., None] * b_t[:, None, :]
        y = jnp.sum(h * c_t[:, None, :], axis=-1)  # elementwise, as the other forms' h_t C_t
        return h, ((y, h) if keep_states else y)

    out, h = jax.lax.scan(step, h0, (delta, xs, b_in, c_out), unroll=unroll)[::-1]
    return out, h


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def selective_ssm(delta: jax.Array, xs: jax.Array, b_in: jax.Array, c_out: jax.Array, a: jax.Array, h0: jax.Array,
                  allow_neg_eigval: bool = False, unroll: int = 1) -> tuple[jax.Array, jax.Array]:
    """(y_t = h_t C_t for each t, h_T) with h_t = exp(Delta_t A) * h_{t-1} + (Delta_t x_t) B_t from `h0`, one step
    at a time, with a hand-written backward: a reverse scan whose every step works on [B, D, N] alone (it stores
    only the h_t of the forward, which it reruns), where autodiff of the scan reads and writes each of its
    per-step intermediates over the whole [T, B, D, N].

    delta (Delta, after its softplus), xs: f32[T, B, D]; b_in, c_out: f32[T, B, N]; a: f32[D, N]; h0: f32[B, D, N]
    -> (f32[T, B, D], f32[B, D, N]). `allow_neg_eigval`: the decay is 2 exp(Delta_t A) - 1."""
    return _ssm_scan(delta, xs, b_in, c_out, a, h0, allow_neg_eigval, unroll, False)


def _selective_ssm_fwd(delta, xs, b_in, c_out, a, h0, allow_neg_eigval, unroll):
    return _ssm_scan(delta, xs, b_in, c_out, a, h0, allow_neg_eigval, unroll, False), (delta, xs, b_in, c_out, a, h0)


def _selective_ssm_bwd(allow_neg_eigval, unroll, residuals, cotangents):
    delta, xs, b_in, c_out, a, h0 = residuals
    dy, dh_last = cotangents
    (_, hs), _ = _ssm_scan(delta, xs, b_in, c_out, a, h0, allow_neg_eigval, unroll, True)
    h_before = jnp.concatenate([h0[None], hs[:-1]])

    def step(carry, inp):
        dh, da = carry  # dL/dh_t from the steps after t; dL/dA so far
        d_t, x_t, b_t, c_t, dy_t, h_t, h_prev = inp
        g = dh + dy_t[..., None] * c_t[:, None, :]  # dL/dh_t
        e = jnp.exp(d_t[..., None] * a)
        # h_t = dec * h_{t-1} + (Delta x) B: d dec / d(Delta A) is e (2 e with the negative eigenvalues)
        s = g * h_prev * (2 * e if allow_neg_eigval else e)
        g_b = jnp.sum(g * b_t[:, None, :], axis=-1)  # [B, D]
        d_delta = jnp.sum(s * a, axis=-1) + x_t * g_b
        d_x = d_t * g_b
        d_b = jnp.sum(g * (d_t * x_t)[..., None], axis=1)
        d_c = jnp.sum(dy_t[..., None] * h_t, axis=1)
        dec = 2 * e - 1 if allow_neg_eigval else e
        return (g * dec, da + jnp.sum(s * d_t[..., None], axis=0)), (d_delta, d_x, d_b, d_c)

    (dh0, da), (d_delta, d_x, d_b, d_c) = jax.lax.scan(
        step, (dh_last, jnp.zeros_like(a)), (delta, xs, b_in, c_out, dy, hs, h_before), reverse=True, unroll=unroll)
    return d_delta, d_x, d_b, d_c, da, dh0


selective_ssm.defvjp(_selective_ssm_fwd, _selective_ssm_bwd)


def selective_scan_chunked(dt: jax.Array, xs: jax.Array, z: jax.Array, b_in: jax.Array, c_out: jax.Array,
                           a: jax.Array, d_skip: jax.Array, chunk_size: int, unroll: int = 1,
                           allow_neg_eigval: bool = False, h0: jax.Array | None = None,
                           recurrence: str = "custom_vjp") -> tuple[jax.Array, jax.Array]:
    """(h_t C_t + D x'_t) * silu(z_t), with Delta_t = softplus(dt_t) and h_t = exp(Delta_t A) * h_{t-1} +
    (Delta_t x'_t) B_t, from h = `h0` (f32[B, D, N]; None: 0): the whole layer between its two maps, one step
    at a time; returns it and the h after the last step.

    dt (Delta before its softplus, bias added), xs, z: f32[T, B, D]; b_in, c_out: f32[T, B, N]; a: f32[D, N] (A,
    negative); d_skip: f32[D] -> (f32[T, B, D], f32[B, D, N]). `allow_neg_eigval`: the decay is 2 exp(Delta_t A)
    - 1. A chunk of `chunk_size` steps is the unit of the backward: autodiff stores one h: [B, D, N] per chunk
    and the inputs. `recurrence="custom_vjp"`: each chunk is one `selective_ssm`, its backward hand-written;
    `"autodiff"`: each chunk is `jax.checkpoint`ed and `jax.grad` reruns its steps (softplus, gate and all)."""
    length = dt.shape[0]
    block = max(1, min(chunk_size, length))
    padded = -(-length // block) * block
    # Padded steps come after the last real one, with Delta = softplus(-inf) = 0: h passes through them unchanged.
    dt = jnp.pad(dt, [(0, padded - length), (0, 0), (0, 0)], constant_values=-jnp.inf)
    init = jnp.zeros((*dt.shape[1:], a.shape[-1]), dt.dtype) if h0 is None else h0
    if recurrence == "custom_vjp":
        delta, xs_p, b_p, c_p = jax.nn.softplus(dt), *pad_time([xs, b_in, c_out], padded)
        chunks = [v.reshape(padded // block, block, *v.shape[1:]) for v in (delta, xs_p, b_p, c_p)]
        h, y = jax.lax.scan(lambda h, c: selective_ssm(*c, a, h, allow_neg_eigval, unroll)[::-1], init, chunks)
        y = y.reshape(padded, *y.shape[2:])[:length]
        return (y + d_skip * xs) * jax.nn.silu(z), h
    inputs = [dt, *pad_time([xs, z, b_in, c_out], padded)]

    def step(h, inp):
        dt_t, x_t, z_t, b_t, c_t = inp
        delta = jax.nn.softplus(dt_t)
        h = decay(delta[..., None] * a, allow_neg_eigval) * h + (delta * x_t)[..., None] * b_t[:, None, :]
        y = jnp.sum(h * c_t[:, None, :], axis=-1) + d_skip * x_t  # elementwise, as the other forms' h_t C_t
        return h, y * jax.nn.silu(z_t)

    h, ys = block_checkpoint_scan(step, init, inputs, block, unroll)
    return ys[:length], h


@register_cell
@dataclasses.dataclass(frozen=True)
class Mamba(SequenceCell):
    state_size: int = allowed(16, low=1)  # N: the SSM state per channel
    conv_size: int = allowed(4, low=0)  # K: width of the short causal depthwise convolution; 0 = none
    expand: int = allowed(2, low=1)  # E: inner width E * hidden_dim
    dt_rank: int = allowed(0, low=0)  # R: rank of Delta's input map; 0 = ceil(hidden_dim / 16)
    # steps per checkpointed chunk of the chunked form (one [B, D, N] state kept per chunk)
    chunk_size: int = allowed(64, low=1)
    allow_neg_eigval: bool = False  # the decay 2 exp(Delta A) - 1 in (-1, 1) (Grazzi et al. 2025), not exp(Delta A)

    name = "mamba"
    time_scans = ("sequential", "associative", "chunked", "fused")  # fused: `rnnlab.fused.selective_scan`, CPU
    # custom_vjp: linear_recurrence's backward, the chunked form's `selective_ssm` (the fused kernel's: always)
    backward_forms = ("sequential", "associative", "chunked")
    default_recurrence = "custom_vjp"  # conf/model/mamba.yaml's (init: SequenceCell's default)
    # model.time_scan=auto: on a CPU where the kernel builds, fused (`rnnlab.models.build_model`); elsewhere the
    # chunked form at every length (its hand-written backward: the fastest JAX form at T=16 and 64 on CPU,
    # docs/benchmarks.md "Step time at the zoo's shapes")
    default_time_scan = "auto"
    long_form = "chunked"
    input_bias = False  # the reference's in_proj has no bias

    def input_init(self):
        """in_proj as the reference's nn.Linear (`model.init=default`), else the named scheme's."""
        if self.init != "default":
            return super().input_init()
        return torch_linear_init

    @property
    def inner(self) -> int:
        return self.expand * self.hidden_dim

    @property
    def rank(self) -> int:
        return self.dt_rank or math.ceil(self.hidden_dim / 16)

    @property
    def input_width(self) -> int:
        return 2 * self.inner  # the x branch and the gate z

    def param_specs(self):
        d, n, r = self.inner, self.state_size, self.rank
        specs = {}
        if self.conv_size:
            specs["conv_w"] = ((self.conv_size, d), fan_in_uniform(self.conv_size))
            specs["conv_b"] = ((d,), fan_in_uniform(self.conv_size))
        return {**specs,
                "W_x": ((d, r + 2 * n), fan_in_uniform(d)),
                "W_dt": ((r, d), fan_in_uniform(r)),  # U(+-R^-1/2): the reference's dt_init="random"
                "dt_bias": ((d,), dt_bias_init),
                "A_log": ((d, n), a_log_s4d_real_init),
                "D": ((d,), jax.nn.initializers.ones),
                "W_out": ((d, self.hidden_dim), fan_in_uniform(d))}

    def mix_state(self, params, u, x, time_scan, unroll, recurrence, state):
        """u: [T, B, 2D] -> [T, B, H], and the state after the last step (None without `state`)."""
        xs, z = jnp.split(u, 2, axis=-1)
        conv_in, tail = xs, None if state is None else state.get("conv")
        if self.conv_size:  # silu(conv(x)), rerun in the backward rather than storing the conv's [T, B, D] buffers
            xs = jax.checkpoint(lambda x, w, b, t: jax.nn.silu(causal_conv(x, w, b, t)))(
                xs, params["conv_w"], params["conv_b"], tail)
        else:
            xs = jax.nn.silu(xs)
        d_low, b_in, c_out = jnp.split(xs @ params["W_x"], [self.rank, self.rank + self.state_size], axis=-1)
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731  (the SSM runs in float32)
        dt = f32(d_low @ params["W_dt"]) + f32(params["dt_bias"])  # [T, B, D], Delta before its softplus
        h0 = None if state is None else state["ssm"]
        if time_scan == "fused":
            a = -jnp.exp(f32(params["A_log"]))
            y, h = fused.selective_scan(jax.nn.softplus(dt), f32(xs), f32(b_in), f32(c_out), a, h0, self.allow_neg_eigval)
            y = (y + f32(params["D"]) * f32(xs)) * jax.nn.silu(f32(z))
            out = y.astype(u.dtype) @ params["W_out"]
        elif time_scan == "chunked":
            y, h = selective_scan_chunked(dt, f32(xs), f32(z), f32(b_in), f32(c_out), -jnp.exp(f32(params["A_log"])),
                                          f32(params["D"]), self.chunk_size, unroll, self.allow_neg_eigval, h0,
                                          recurrence)
            out = y.astype(u.dtype) @ params["W_out"]
        else:
            delta = jax.nn.softplus(dt)
            a = decay(delta[..., None] * -jnp.exp(f32(params["A_log"])), self.allow_neg_eigval)  # [T, B, D, N]
            b = (delta * f32(xs))[..., None] * f32(b_in)[:, :, None, :]
            if h0 is not None:  # h_0 = a_0 h_{-1} + b_0: the state folds into the first step's b
                b = b.at[0].add(a[0] * h0)
            hs = (linear_recurrence if recurrence == "custom_vjp" else scan_linear)(a, b, time_scan, unroll)
            y = jnp.sum(hs * f32(c_out)[:, :, None, :], axis=-1)  # h_t C_t: elementwise
            y = y + f32(params["D"]) * f32(xs)
            out, h = (y.astype(u.dtype) * jax.nn.silu(z)) @ params["W_out"], hs[-1]
        if state is None:
            return out, None
        return out, {"ssm": h} | ({"conv": conv_tail(conv_in, self.conv_size, tail)} if self.conv_size else {})

    def initial_state(self, batch, dtype, cache_len=0):
        """h: f32[B, D, N] (the SSM runs in float32), and the conv's last K-1 inputs [B, K-1, D] in `dtype`."""
        state = {"ssm": jnp.zeros((batch, self.inner, self.state_size), jnp.float32)}
        return state | ({"conv": jnp.zeros((batch, self.conv_size - 1, self.inner), dtype)} if self.conv_size else {})

    def state_floats(self, seq_len):
        return self.inner * self.state_size  # h: [D, N] (the conv's last K-1 inputs are not counted)

    def mixing_flops(self, seq_len, time_scan):
        # x' W_x, d W_dt and the output map; the conv, the scan and h_t C_t are elementwise work (not counted),
        # so the chunked form's backward, which reruns only the scan, recomputes no matmul.
        d, n, r = self.inner, self.state_size, self.rank
        return seq_len * (2 * d * (r + 2 * n) + 2 * r * d + 2 * d * self.hidden_dim)  # per token, T per example
