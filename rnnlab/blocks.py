"""The residual block a whole-sequence mixer trains in, and the channel MLP after it.

`model.block=residual` wraps each layer as a pre-norm block: x + mixer(norm(x)), then, unless
`model.mlp=none`, x + MLP(norm(x)), with RMS norms. Which MLP follows the mixer is part of each
family's model (its paper's block), so it is a key of the model config, not a constant:

    none     no channel mixer (Mamba's blocks; Zoology's MQAR models)
    gelu     GELU(x W_up + b_up) W_down + b_down             (GPT-2's and Zoology's transformer MLP)
    geglu    (GELU(x W_gate) * (x W_up)) W_down              (Griffin's gated MLP; the LRU's GLU)
    swiglu   (SiLU(x W_gate) * (x W_up)) W_down              (LLaMA's; flash-linear-attention's models)
    rwkv     relu(x' W_up)^2 W_down,  x' = x + (x_{t-1} - x) * mu   (RWKV-7's channel mixing: a token shift,
             then a squared ReLU; fla's RWKV7FeedForward, its init: mu = 1 - n/H, W_up orthogonal, W_down 0)

The hidden width is `mlp_width(model.mlp_expand, H)`; `model.mlp_bias` adds a bias to every dense
layer of the MLP. Parameter names: `mlp/{gate,up,down}/{kernel[, bias]}` (gelu has no `gate`; rwkv has
`mlp/mu` [H] instead). The MLPs see time-major [T, B, H], as the block does (the token shift's axis 0).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from rnnlab.cells.common import shift_in
from rnnlab.embedding import apply_projection

MLPS = ("none", "gelu", "geglu", "swiglu", "rwkv")
GATES: dict[str, Callable[[jax.Array], jax.Array]] = {"geglu": nn.gelu, "swiglu": nn.silu}


def mlp_width(expand: float, hidden_dim: int) -> int:
    """The MLP's hidden width: `expand` x H, rounded to the nearest unit (at least one)."""
    return max(1, round(expand * hidden_dim))


def mlp_matmuls(mlp: str) -> int:
    """Matmuls of width [H, mlp_width] one token passes through in the MLP (FLOPs: 2 H W each)."""
    return {"none": 0, "gelu": 2, "geglu": 3, "swiglu": 3, "rwkv": 2}[mlp]


class ChannelMLP(nn.Module):
    """The block's channel mixer, applied to every position alike: x [..., H] -> [..., H] (see the module
    docstring for the kinds); rwkv's token shift reads the step before, x [T, B, H]. Dense layers with Flax's
    defaults (lecun_normal kernels, zero biases), rwkv's with its reference's."""

    kind: str  # one of MLPS other than none
    expand: float = 2.0
    bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, last: jax.Array | None = None) -> jax.Array:
        """x: [T, B, H] -> [T, B, H]; `last` [B, H]: rwkv's token shift's input before x's first step (None: zeros)."""
        width = mlp_width(self.expand, x.shape[-1])
        dense = functools.partial(nn.Dense, use_bias=self.bias, dtype=self.dtype)
        if self.kind == "gelu":
            hidden = nn.gelu(dense(width, name="up")(x))
        elif self.kind == "rwkv":
            h = x.shape[-1]
            mu = self.param("mu", lambda key, shape: 1 - jnp.arange(h, dtype=jnp.float32) / h, (h,))
            delta = shift_in(x, last) - x  # x_{t-1} - x_t, x_{-1} = `last` or 0
            up = dense(width, kernel_init=nn.initializers.orthogonal(), name="up")
            hidden = jnp.square(nn.relu(up(x + delta * mu.astype(x.dtype))))
            return dense(x.shape[-1], kernel_init=nn.initializers.zeros_init(), name="down")(hidden)
        elif self.kind in GATES:
            hidden = GATES[self.kind](dense(width, name="gate")(x)) * dense(width, name="up")(x)
        else:
            raise ValueError(f"unknown MLP {self.kind!r}; allowed: {', '.join(m for m in MLPS if m != 'none')}")
        return dense(x.shape[-1], name="down")(hidden)


class ResidualBlock(nn.Module):
    """A pre-norm residual block around one layer: x + layer(norm(x)), then x + MLP(norm(x)) unless
    `mlp` is none. Takes the layer's fields and call signature (`layer_class`: the model's
    `RecurrentLayer`); given the input projection, it applies it first (a residual needs x in H; to
    token ids, as the gather of their kernel rows)."""

    hidden_dim: int
    cell: str
    layer_class: Any  # the layer module's class (rnnlab.models.RecurrentLayer)
    layer_fields: tuple[tuple[str, Any], ...] = ()  # further layer fields, as (name, value) pairs
    mlp: str = "geglu"
    mlp_expand: float = 2.0
    mlp_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, state: Any = None, projection: Any = None) -> tuple[jax.Array, Any]:
        """state: None, or {mixer: the layer's state, mlp: rwkv's token shift's last input [B, H] (rwkv only)}
        -> (x, the block's state after x, or None)."""
        fields = dict(self.layer_fields)
        dtype = fields.get("dtype", jnp.float32)
        if projection is not None:
            x = apply_projection(x, projection, dtype)
        x = x.astype(dtype)
        y, mixer = self.layer_class(self.hidden_dim, self.cell, **fields, name="recurrence")(
            nn.RMSNorm(dtype=dtype, name="norm_0")(x), None if state is None else state["mixer"])
        after = None if state is None else {"mixer": mixer}
        x = x + y
        if self.mlp == "none":
            return x, after
        mlp = ChannelMLP(self.mlp, self.mlp_expand, self.mlp_bias, dtype, name="mlp")
        normed = nn.RMSNorm(dtype=dtype, name="norm_1")(x)
        if self.mlp == "rwkv":
            out = mlp(normed, None if state is None else state["mlp"])
            if after is not None:
                after["mlp"] = normed[-1]
            return x + out, after
        return x + mlp(normed), after
