"""The xLSTM's mLSTM layer (Beck et al. 2024, "xLSTM: Extended Long Short-Term Memory", Sec. 2.3 and
Fig. 10; the reference's `xlstm/blocks/mlstm/layer.py`), a pre-up-projection block: the layer's input term
is the up-projection, the cell does the rest. Inner width D = round(`model.proj_factor` * H), heads of
d = D / `model.num_heads`, per-head matrix memory C: [d, d] (`rnnlab.cells.mlstm_forms` has the recurrence):

    [x_m, z] = u_t = x_t W_xh                       (the up-projection, [H, 2D], no bias: D each)
    c_t = silu(conv(x_m)_t)                         (causal depthwise conv of `model.conv_size` taps, with bias)
    q_t = c_t W_q,  k_t = c_t W_k,  v_t = x_m,t W_v (block-diagonal: blocks of `model.qkv_proj_blocksize`)
    i~_t = [q_t, k_t, v_t] W_i + b_i,   f~_t = [q_t, k_t, v_t] W_f + b_f          (one of each per head)
    h~_t = mLSTM(q, k, v, i~, log sigmoid(f~))_t    (per head: C_t = f_t C_{t-1} + i_t k_t^T v_t, ...)
    y_t = ((GroupNorm(h~_t) * w + s * c_t) * silu(z_t)) W_o     (a LayerNorm per head, no bias; s: the skip)

The xLSTM's mLSTM block is x + layer(LayerNorm(x)) with no MLP after it (conf/model/mlstm.yaml:
`block: residual`, `mlp: none`; rnnlab's pre-norm is an RMSNorm). Forms (`model.time_scan`): `parallel`
(the stabilised [T, T] form), `chunked` (chunkwise, memory linear in T) and `sequential` (one step at a
time, the state checkpointed once per `model.chunk_size` steps), all by autodiff. Each carries a state
(`initial_state`: C, n, m and the conv's last inputs); `parallel` given one runs as one chunk of the
chunkwise form, which adds the state's read to the [T, T] scores (`rnnlab.cells.mlstm_forms`).

Initialisation as the reference's (`mLSTMLayer.reset_parameters`, `mLSTMCell.reset_parameters`), with
`model.init=default`: W_xh and W_q, W_k, W_v small-init N(0, 2 / (5 H)); W_o Wang's N(0, (2 / (L sqrt(H)))^2),
L = `model.num_blocks` (the stack's depth); W_i = W_f = 0, b_f = linspace(3, 6) over heads, b_i ~ N(0, 0.1^2);
the conv as PyTorch's Conv1d; the norm's weight and the skip 1. Left out: rounding D up to a multiple of 64
(`round_proj_up_to_multiple_of`; widths here are small), biases on the projections (off there too) and dropout
inside the layer.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rnnlab import fused
from rnnlab.cells.common import causal_conv, conv_tail, fan_in_uniform
from rnnlab.cells.gla_forms import F32, mm
from rnnlab.cells.matrix import padded_length
from rnnlab.cells.mlstm_forms import EPS, mlstm_chunked, mlstm_parallel, mlstm_recurrent
from rnnlab.cells.registry import SequenceCell, register_cell
from rnnlab.options import allowed

NORM_EPS = 1e-5  # the reference's MultiHeadLayerNorm
INNER = "inner = round(proj_factor * hidden_dim)"  # what the heads and q, k, v blocks divide
MAX_PROJ_FACTOR = 16.0  # xLSTM's blocks use 2 (mLSTM) and 4/3 (sLSTM)


def _normal(std: float):
    def init(key, shape, dtype=jnp.float32):
        return std * jax.random.normal(key, shape, dtype)

    return init


def _linspace(start: float, stop: float):
    def init(key, shape, dtype=jnp.float32):
        del key
        return jnp.linspace(start, stop, shape[0], dtype=dtype)

    return init


@register_cell
@dataclasses.dataclass(frozen=True)
class MLSTM(SequenceCell):
    num_heads: int = allowed(4, divides="inner", note=INNER)  # heads of width D / num_heads
    # taps of the causal depthwise conv before q and k; 0 = none (SiLU still applies)
    conv_size: int = allowed(4, low=0)
    chunk_size: int = allowed(64, low=1)  # steps per chunk (chunked form) and per checkpointed block (sequential form)
    proj_factor: float = 2.0  # inner width D = round(proj_factor * hidden_dim)
    qkv_proj_blocksize: int = allowed(4, divides="inner", note=INNER)  # the block-diagonal q, k, v maps' blocks are [b, b]
    num_blocks: int = allowed(1, low=1)  # the stack's depth, for W_o's init (Wang's: std 2 / (num_blocks sqrt(H)))

    name = "mlstm"
    # [T, T] scores | chunkwise | one step at a time | fused: one step at a time in gated linear attention's CPU
    # kernel (`rnnlab.fused.mlstm`)
    time_scans = ("parallel", "chunked", "sequential", "fused")
    # model.time_scan=auto: parallel up to T=64, the chunked form beyond (measured: docs/benchmarks.md,
    # "Forms by length")
    default_time_scan = "auto"
    # auto keeps the JAX forms: the train step measured slower fused (0.7x at S3's shape, 0.9x at MQAR's;
    # docs/benchmarks.md, "Fused kernels")
    auto_fused = False
    auto_forms = ((64, "parallel"),)
    long_form = "chunked"
    input_bias = False  # the reference's up-projection has no bias

    @property
    def inner(self) -> int:
        return round(self.proj_factor * self.hidden_dim)

    @property
    def head_dim(self) -> int:
        return self.inner // self.num_heads

    @property
    def input_width(self) -> int:
        return 2 * self.inner  # x_m, z

    def input_init(self):
        """The up-projection as the reference's (small init, `model.init=default`), else the named scheme's."""
        if self.init != "default":
            return super().input_init()
        return _normal(math.sqrt(2 / (5 * self.hidden_dim)))

    def param_specs(self):
        d, heads, blk = self.inner, self.num_heads, self.qkv_proj_blocksize
        small = _normal(math.sqrt(2 / (5 * self.hidden_dim)))  # the reference's, with H (not D) as the dim
        specs = {name: ((d // blk, blk, blk), small) for name in ("W_q", "W_k", "W_v")}  # [blocks, in, out]
        if self.conv_size:
            specs["conv_w"] = ((self.conv_size, d), fan_in_uniform(self.conv_size))
            specs["conv_b"] = ((d,), fan_in_uniform(self.conv_size))
        zeros = jax.nn.initializers.zeros
        return {**specs,
                "W_i": ((3 * d, heads), zeros), "b_i": ((heads,), _normal(0.1)),
                "W_f": ((3 * d, heads), zeros), "b_f": ((heads,), _linspace(3.0, 6.0)),
                "norm": ((d,), jax.nn.initializers.ones), "skip": ((d,), jax.nn.initializers.ones),
                "W_o": ((d, self.hidden_dim), _normal(2 / self.num_blocks / math.sqrt(self.hidden_dim)))}

    def option_problem(self):
        if not (0 < self.proj_factor <= MAX_PROJ_FACTOR) or self.inner < 1:
            return (f"key 'model.proj_factor': got {self.proj_factor}, must be in (0, {MAX_PROJ_FACTOR:g}] with "
                    f"round(proj_factor * hidden_dim) >= 1")
        return super().option_problem()  # num_heads and qkv_proj_blocksize divide `inner`

    def headwise(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """The block-diagonal map: x [T, B, D] by w [D / b, b, b] -> [T, B, D]."""
        blocks = x.reshape(*x.shape[:-1], *w.shape[:2])
        return jnp.einsum("tbnd,ndo->tbno", blocks, w).reshape(x.shape)

    def initial_state(self, batch, dtype, cache_len=0):
        """{C: [B, heads, d, d], n: [B, heads, d], m: [B, heads]} float32 zeros (the forms' m_0 = 0), and with
        the conv its input's last K-1 steps, conv: [B, K-1, D] in `dtype`."""
        heads, d = self.num_heads, self.head_dim
        state = {"C": jnp.zeros((batch, heads, d, d), F32), "n": jnp.zeros((batch, heads, d), F32),
                 "m": jnp.zeros((batch, heads), F32)}
        if self.conv_size:
            state["conv"] = jnp.zeros((batch, self.conv_size - 1, self.inner), dtype)
        return state

    def mix_state(self, params, u, x, time_scan, unroll, recurrence, state):
        """u: [T, B, 2D] -> [T, B, H] by the form `time_scan`, from `state` (None: zeros, and no state
        returned); `unroll` and `recurrence` are unused."""
        length, batch, _ = u.shape
        d, heads = self.inner, self.num_heads
        x_m, z = u[..., :d], u[..., d:]
        tail = None if state is None else state.get("conv")
        carried = None if state is None else (state["C"], state["n"], state["m"])
        c = causal_conv(x_m, params["conv_w"], params["conv_b"], tail) if self.conv_size else x_m
        c = jax.nn.silu(c)
        q, k, v = self.headwise(c, params["W_q"]), self.headwise(c, params["W_k"]), self.headwise(x_m, params["W_v"])
        qkv = jnp.concatenate([q, k, v], axis=-1)
        log_i = mm("tbc,ch->tbh", qkv, params["W_i"], qkv.dtype) + params["b_i"].astype(F32)
        log_f = jax.nn.log_sigmoid(mm("tbc,ch->tbh", qkv, params["W_f"], qkv.dtype) + params["b_f"].astype(F32))
        q, k, v = (a.reshape(length, batch, heads, self.head_dim) for a in (q, k, v))
        if time_scan == "parallel":
            h = mlstm_parallel(q, k, v, log_i, log_f, state=carried)
        elif time_scan == "chunked":
            h = mlstm_chunked(q, k, v, log_i, log_f, min(self.chunk_size, length), state=carried)
        elif time_scan == "fused":
            h = fused.mlstm(q, k, v, log_i, log_f, EPS, state=carried)
        else:
            h = mlstm_recurrent(q, k, v, log_i, log_f, self.chunk_size, state=carried)
        after = None
        if state is not None:
            h, (c_mem, n, m) = h
            after = {"C": c_mem, "n": n, "m": m}
            if self.conv_size:
                after["conv"] = conv_tail(x_m, self.conv_size, tail)
        h = h.astype(F32)  # the per-head LayerNorm, in float32
        mean = jnp.mean(h, axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(jnp.var(h, axis=-1, keepdims=True) + NORM_EPS)
        h = h.reshape(length, batch, d) * params["norm"].astype(F32)
        y = (h.astype(u.dtype) + params["skip"] * c) * jax.nn.silu(z)
        return y @ params["W_o"], after

    def state_floats(self, seq_len):
        d = self.head_dim
        return self.num_heads * (d * d + d + 1)  # C, n and the stabiliser m per head (not the conv's inputs)

    def mixing_flops(self, seq_len, time_scan):
        d, heads, width = self.head_dim, self.num_heads, self.inner
        # Per token: the q, k, v block maps (2 D b each), the gates from [q, k, v] (2 * 3D * heads each), W_o.
        per_token = 3 * 2 * width * self.qkv_proj_blocksize + 2 * 2 * 3 * width * heads + 2 * width * self.hidden_dim
        if time_scan == "parallel":  # q k^T and the weights times V, over all T x T pairs (masked half included)
            mixing = heads * 4 * seq_len * seq_len * d
        elif time_scan in ("sequential", "fused"):  # k_t^T v_t, q_t C_t, q_t . n_t per step (sequential: whole blocks)
            mixing = heads * self._steps(seq_len, time_scan) * (4 * d * d + 2 * d)
        else:  # per chunk of L: K^T V (the outgoing state), Q K^T, S V, Q C, Q n
            chunk = min(self.chunk_size, seq_len)
            chunks = padded_length(seq_len, chunk) // chunk
            mixing = heads * chunks * (4 * chunk * chunk * d + 4 * chunk * d * d + 2 * chunk * d)
        return per_token * seq_len + mixing

    def mixing_recompute_flops(self, seq_len, time_scan):
        # The sequential and fused forms' backward reruns each checkpointed block's steps.
        if time_scan not in ("sequential", "fused"):
            return 0
        d = self.head_dim
        return self.num_heads * self._steps(seq_len, time_scan) * (4 * d * d + 2 * d)

    def _steps(self, seq_len, time_scan):
        """The steps a one-step-at-a-time form runs: the sequential form's whole blocks, the kernel's T."""
        return seq_len if time_scan == "fused" else padded_length(seq_len, self.chunk_size)
