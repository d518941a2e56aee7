"""Recurrent cells behind one interface: Elman (`rnn`), LSTM (`lstm`) and GRU (`gru`).

A cell is one time step of a layer with the *input term already computed*. A cell
class with `G = num_gates` gates owns only its recurrent parameters; the layer
(`rnnlab.models.RecurrentLayer`) owns the input weights and bias of width G*H and
computes, for all time steps at once or inside the scan (`model.hoist_input`),

    u_t = x_t W_xh + b          u: f32[B, G*H], gate blocks side by side in the order below

and the cell does the rest, `(carry, u_t) -> (carry, h_t)`, with `h_{t-1} W_hh`
(W_hh: f32[H, G*H]) its only matmul. Shapes: `B` batch, `H` hidden units.

Gate order and equations follow PyTorch's `nn.RNN`/`nn.LSTM`/`nn.GRU`, so weights
are portable (`from_torch` converts one layer; tests/test_cells.py checks against
torch). sigma is the logistic sigmoid, * the elementwise product:

    rnn   (G=1)  h_t = act(u_t + h W_hh)                      act = tanh | relu
    lstm  (G=4)  [i, f, g, o] = u_t + h W_hh                 (blocks of H, in this order)
                 i, f, o = sigma(i), sigma(f), sigma(o);  g = tanh(g)
                 c_t = f * c + i * g;   h_t = o * tanh(c_t)
    gru   (G=3)  [u_r, u_z, u_n] = u_t;  [a_r, a_z, a_n] = h W_hh
                 r = sigma(u_r + a_r);  z = sigma(u_z + a_z)
                 n = tanh(u_n + r * (a_n + b_hn))             (reset gate applied after W_hn, as PyTorch)
                 h_t = (1 - z) * n + z * h

PyTorch keeps two biases per gate; here the input-side `b` carries their sum, except
the GRU's `b_hn`, which sits inside `r * (...)` and so stays a separate parameter.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Initializer = Callable[..., jax.Array]
Carry = Any  # f32[B, H] for rnn and gru; (c, h), each f32[B, H], for lstm


def _uniform(scale: float) -> Initializer:
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, minval=-scale, maxval=scale)

    return init


def _identity(key, shape, dtype=jnp.float32):
    del key
    return jnp.eye(shape[0], shape[1], dtype=dtype)


def initializers(init: str) -> tuple[Initializer, Initializer]:
    """(input initializer for W_xh, recurrent initializer for W_hh) of a named scheme.

    uniform:    U[-0.1, 0.1] for both matrices (the classic Elman setting).
    orthogonal: lecun_normal input, orthogonal recurrent matrix (Saxe et al. 2014).
    identity:   N(0, 1e-3) input, identity recurrent matrix (IRNN, Le et al. 2015).
    default:    Flax's `SimpleCell` defaults: lecun_normal input, orthogonal recurrent.
    Gated cells apply the scheme to each gate's [fan_in, H] block (`per_gate`).
    """
    if init == "uniform":
        return _uniform(0.1), _uniform(0.1)
    if init in ("orthogonal", "default"):
        return nn.initializers.lecun_normal(), nn.initializers.orthogonal()
    if init == "identity":
        return nn.initializers.normal(1e-3), _identity
    raise ValueError(f"unknown init {init!r}")


def per_gate(init: Initializer, num_gates: int) -> Initializer:
    """An initializer of f32[fan_in, G*H] that fills each [fan_in, H] gate block with `init`."""
    if num_gates == 1:
        return init

    def gated(key, shape, dtype=jnp.float32):
        fan_in, width = shape
        keys = jax.random.split(key, num_gates)
        return jnp.concatenate([init(k, (fan_in, width // num_gates), dtype) for k in keys], axis=1)

    return gated


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {"tanh": jnp.tanh, "relu": jax.nn.relu}


class Cell(nn.Module):
    """The interface: `num_gates`, `bias_init`, `initial_carry`, `__call__(carry, u_t)`."""

    hidden_dim: int
    init_scheme: str = "uniform"  # see `initializers` (not `init`: that is Module.init)
    activation: str = "tanh"  # Elman only; the gated cells use sigmoid/tanh as above
    dtype: Any = jnp.float32  # compute dtype; parameters stay float32
    num_gates: ClassVar[int] = 1

    @classmethod
    def bias_init(cls, forget_bias: float) -> Initializer:
        """Initializer of the layer's input bias b: f32[G*H] (zeros unless a cell says otherwise)."""
        del forget_bias
        return nn.initializers.zeros_init()

    @classmethod
    def initial_carry(cls, like: jax.Array, hidden_dim: int) -> Carry:
        """Zeros of [B, H] with the dtype (and, under shard_map, the device variance) of `like`: [B, ...]."""
        return jnp.zeros_like(like, shape=(like.shape[0], hidden_dim))

    def recurrent(self, h: jax.Array) -> jax.Array:
        """h: [B, H] -> h W_hh: [B, G*H], W_hh a float32 parameter cast to the compute dtype."""
        _, recurrent_init = initializers(self.init_scheme)
        shape = (self.hidden_dim, self.num_gates * self.hidden_dim)
        w_hh = self.param("W_hh", per_gate(recurrent_init, self.num_gates), shape)
        return h @ w_hh.astype(self.dtype)


class ElmanCell(Cell):
    """`h_t = act(u_t + h_{t-1} W_hh)`; carry h: [B, H]; u_t: [B, H]."""

    num_gates: ClassVar[int] = 1

    @nn.compact
    def __call__(self, h: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = ACTIVATIONS[self.activation](u + self.recurrent(h))
        return h, h


class LSTMCell(Cell):
    """PyTorch `nn.LSTM` step, gates i, f, g, o; carry (c, h): [B, H] each; u_t: [B, 4H]."""

    num_gates: ClassVar[int] = 4

    @classmethod
    def bias_init(cls, forget_bias: float) -> Initializer:
        def init(key, shape, dtype=jnp.float32):
            del key
            h = shape[0] // cls.num_gates
            return jnp.zeros(shape, dtype).at[h : 2 * h].set(forget_bias)

        return init

    @classmethod
    def initial_carry(cls, like: jax.Array, hidden_dim: int) -> Carry:
        zeros = jnp.zeros_like(like, shape=(like.shape[0], hidden_dim))
        return zeros, zeros

    @nn.compact
    def __call__(self, carry: Carry, u: jax.Array) -> tuple[Carry, jax.Array]:
        c, h = carry
        i, f, g, o = jnp.split(u + self.recurrent(h), 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h


class GRUCell(Cell):
    """PyTorch `nn.GRU` step, gates r, z, n; carry h: [B, H]; u_t: [B, 3H]; own bias b_hn: f32[H]."""

    num_gates: ClassVar[int] = 3

    @nn.compact
    def __call__(self, h: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        b_hn = self.param("b_hn", nn.initializers.zeros_init(), (self.hidden_dim,))
        u_r, u_z, u_n = jnp.split(u, 3, axis=-1)
        a_r, a_z, a_n = jnp.split(self.recurrent(h), 3, axis=-1)
        r = jax.nn.sigmoid(u_r + a_r)
        z = jax.nn.sigmoid(u_z + a_z)
        n = jnp.tanh(u_n + r * (a_n + b_hn.astype(self.dtype)))
        h = (1.0 - z) * n + z * h
        return h, h


class RecurrentWeights(nn.Module):
    """A cell's recurrent parameters, created as the cell creates them (same names, order and
    initializers), for `rnnlab.recurrence`, which computes the cell's step itself.
    Returns (W_hh: f32[H, G*H], b_hn: f32[H] for the GRU, else None)."""

    hidden_dim: int
    cell: str = "rnn"
    init_scheme: str = "uniform"

    @nn.compact
    def __call__(self) -> tuple[jax.Array, Any]:
        gates = CELLS[self.cell].num_gates
        b_hn = self.param("b_hn", nn.initializers.zeros_init(), (self.hidden_dim,)) if self.cell == "gru" else None
        _, recurrent_init = initializers(self.init_scheme)
        w_hh = self.param("W_hh", per_gate(recurrent_init, gates), (self.hidden_dim, gates * self.hidden_dim))
        return w_hh, b_hn


CELLS: dict[str, type[Cell]] = {"rnn": ElmanCell, "lstm": LSTMCell, "gru": GRUCell}


def from_torch(cell: str, weight_ih: Any, weight_hh: Any, bias_ih: Any, bias_hh: Any) -> dict:
    """One PyTorch layer's `weight_ih_l{k}` [G*H, I], `weight_hh_l{k}` [G*H, H], `bias_ih_l{k}`,
    `bias_hh_l{k}` [G*H] (NumPy arrays) -> this layer's params {W_xh, b, cell: {W_hh[, b_hn]}}."""
    w_ih, w_hh, b_ih, b_hh = (np.asarray(a, np.float32) for a in (weight_ih, weight_hh, bias_ih, bias_hh))
    hidden = w_hh.shape[1]
    if cell == "gru":  # b_hr, b_hz fold into b; b_hn stays inside the reset gate
        b = b_ih + np.concatenate([b_hh[: 2 * hidden], np.zeros(hidden, np.float32)])
        return {"W_xh": w_ih.T, "b": b, "cell": {"W_hh": w_hh.T, "b_hn": b_hh[2 * hidden :]}}
    return {"W_xh": w_ih.T, "b": b_ih + b_hh, "cell": {"W_hh": w_hh.T}}
