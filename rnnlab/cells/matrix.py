"""What the matrix-state cells share: heads, the short causal convolution on q, k and v, the
per-head output norm with its optional gate, and the output map.

A matrix-state cell keeps, per layer, example and head, a state S: [dk, dv] (dk = dv = H /
`num_heads`) that its recurrence (`mix_heads`, one file per model) writes with k and v and
reads with q. Around it, as the papers' layers have it (flash-linear-attention's too):

    [q | k | v | extra] = u_t = x_t W_xh + b                          (extra: the model's gates)
    q, k, v = silu(conv(q | k | v))            short causal depthwise convolution of `conv_size`
                                               taps over time (Mamba's), 0 = neither
    o_t = the recurrence's output per head:    [B, heads, dv]
    y_t = (RMSNorm(o_t) * w) [* silu(g_t)]  W_o                        (w: [dv] shared by heads;
                                               g: the output gate, for the cells that have one)

`model.chunk_size` is the chunk of the chunkwise-parallel form (`model.time_scan=chunked`) and the
block the sequential form checkpoints its state at (autodiff keeps one state per block, not one per step).

A layer's state (`initial_state`): {S: float32 [B, heads, dk, dv], conv: the convolution's last K-1 inputs
[B, K-1, qkv_width] (with a convolution)}; every form starts from S and returns it after the last step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from rnnlab.cells.common import causal_conv, conv_tail, uniform
from rnnlab.cells.registry import SequenceCell
from rnnlab.options import allowed

NORM_EPS = 1e-6


def padded_length(seq_len: int, block: int) -> int:
    """The length the blocked forms run over: whole blocks of min(block, seq_len) steps."""
    block = min(block, seq_len)
    return -(-seq_len // block) * block


def rms_norm(o: jax.Array, w: jax.Array) -> jax.Array:
    """RMSNorm over the last axis, in float32, with weight w."""
    o32 = o.astype(jnp.float32)
    return (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + NORM_EPS) * w).astype(o.dtype)


def with_state(out, state):
    """A form's result (o, or (o, S) given a `state`) -> (o, S or None): `mix_heads`'s."""
    return (out, None) if state is None else out


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / |x| over the last axis (float32 norm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + NORM_EPS)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class MatrixCell(SequenceCell):
    """A cell with a [dk, dv] state per head. Subclasses set `name`, `extra_width` (the input term's
    width beyond q, k and v), `output_gate`, `time_scans`, and define `mix_heads`."""

    num_heads: int = allowed(4, divides="hidden_dim")  # heads; head width H / num_heads
    # taps of the short causal convolution on q, k, v; 0 = off
    conv_size: int = allowed(4, low=0, note="0 = no convolution")
    chunk_size: int = allowed(64, low=1)  # steps per chunk (chunked form) and per checkpointed block (sequential form)

    output_gate: ClassVar[bool] = False
    default_time_scan: ClassVar[str | None] = "chunked"  # conf/model_base/matrix_cell.yaml's (init, recurrence: SequenceCell's)

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    def extra_width(self) -> int:
        """Width of the model's own gates in the input term, after q, k and v."""
        return 0

    def qkv_width(self) -> int:
        """Width of q, k and v in the input term (the convolution's channels)."""
        return 3 * self.hidden_dim

    def split_qkv(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """[T, B, qkv_width] -> q, k, v: [T, B, heads, d] each."""
        return tuple(a.reshape(*a.shape[:2], self.num_heads, self.head_dim) for a in jnp.split(qkv, 3, axis=-1))

    @property
    def input_width(self) -> int:
        return self.qkv_width() + self.extra_width() + (self.hidden_dim if self.output_gate else 0)

    def state_floats(self, seq_len):
        return self.num_heads * self.head_dim * self.head_dim

    def param_specs(self):
        h = self.hidden_dim
        specs = {"norm": ((self.head_dim,), nn.initializers.ones_init()),
                 "W_o": ((h, h), nn.initializers.lecun_normal())}
        if self.conv_size:
            bound = 1 / math.sqrt(self.conv_size)  # torch's Conv1d default for a depthwise kernel
            specs["conv"] = ((self.conv_size, self.qkv_width()), uniform(bound))
        return specs

    def input_init(self):
        return nn.initializers.lecun_normal()

    def mix_heads(self, params, q, k, v, extra, time_scan, unroll, recurrence, state):
        """q, k, v: [T, B, heads, d] after the convolution; extra: [T, B, extra_width]; state: S_0 float32
        [B, heads, dk, dv] or None (zeros) -> (o [T, B, heads, d], S after the last step, or None without a state)."""
        raise NotImplementedError

    def mix_state(self, params, u, x, time_scan, unroll, recurrence, state):
        h, width = self.hidden_dim, self.qkv_width()
        qkv, extra = u[..., :width], u[..., width:]
        after = {}
        if self.conv_size:
            tail = None if state is None else state["conv"]
            if state is not None:
                after["conv"] = conv_tail(qkv, self.conv_size, tail)
            qkv = jax.nn.silu(causal_conv(qkv, params["conv"].astype(qkv.dtype), tail=tail))
        q, k, v = self.split_qkv(qkv)
        gate = None
        if self.output_gate:
            extra, gate = extra[..., :-h], extra[..., -h:]
        o, after["S"] = self.mix_heads(params, q, k, v, extra, time_scan, unroll, recurrence,
                                       None if state is None else state["S"])
        o = rms_norm(o, params["norm"])
        o = o.reshape(*o.shape[:2], h)
        if gate is not None:
            o = o * jax.nn.silu(gate)
        return o @ params["W_o"], None if state is None else after

    def initial_state(self, batch, dtype, cache_len=0):
        """S: zeros float32 [B, heads, dk, dv]; with the convolution, conv: its last K-1 inputs [B, K-1, qkv_width]
        in `dtype`."""
        state = {"S": jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), jnp.float32)}
        if self.conv_size:
            state["conv"] = jnp.zeros((batch, self.conv_size - 1, self.qkv_width()), dtype)
        return state

    def mixing_flops(self, seq_len, time_scan):
        return 2 * self.hidden_dim * self.hidden_dim * seq_len + self.recurrence_flops(seq_len, time_scan)

    def recurrence_flops(self, seq_len: int, time_scan: str) -> int:
        """Forward matmul FLOPs of `mix_heads` in the form `time_scan`, per example of `seq_len` steps."""
        raise NotImplementedError

