"""Recurrent models: the Elman cell scanned over time, layers stacked with a scan, a readout.

Shapes use `B` batch, `T` time, `I` input features, `H` hidden units, `L` layers.

Parameter layout (`model.scan_layers=true`, the default)::

    input_proj/{kernel f32[I, H], bias f32[H]}
    layers/{W_xh f32[L, H, H], b f32[L, H], cell/W_hh f32[L, H, H]}   <- stacked on axis 0
    readout/{kernel f32[H, O], bias f32[O]}

With `scan_layers=false` the stack is a Python loop and layer i lives under
`layer_{i}/` with the same leaves, unstacked; `stack_layer_params` converts.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from rnnlab.config import ModelConfig

Initializer = Callable[..., jax.Array]


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
    """
    if init == "uniform":
        return _uniform(0.1), _uniform(0.1)
    if init == "orthogonal":
        return nn.initializers.lecun_normal(), nn.initializers.orthogonal()
    if init == "identity":
        return nn.initializers.normal(1e-3), _identity
    if init == "default":
        return nn.initializers.lecun_normal(), nn.initializers.orthogonal()
    raise ValueError(f"unknown init {init!r}")


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {"tanh": jnp.tanh, "relu": jax.nn.relu}


class ElmanCell(nn.Module):
    """One time step with the input term precomputed: `h_t = act(h_{t-1} W_hh + u_t)`.

    `u_t = x_t W_xh + b` is computed for all time steps at once by `RecurrentLayer`
    (one large matmul outside the scan), so only the recurrent matmul stays in the loop.
    """

    hidden_dim: int
    init_scheme: str = "uniform"  # see `initializers` (not `init`: that is Module.init)
    activation: str = "tanh"

    @nn.compact
    def __call__(self, h: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h: f32[B, H], u: f32[B, H] -> (h_t, h_t)."""
        _, recurrent_init = initializers(self.init_scheme)
        w_hh = self.param("W_hh", recurrent_init, (self.hidden_dim, self.hidden_dim))
        h = ACTIVATIONS[self.activation](h @ w_hh + u)
        return h, h


class RecurrentLayer(nn.Module):
    """An Elman layer over a whole sequence, the cell scanned over time with `nn.scan`.

    Call signature is `(carry, unused) -> (carry, None)` so that the layer itself can
    be scanned over the layer stack; the carry is the sequence `f32[B, T, H]`.
    """

    hidden_dim: int
    init_scheme: str = "uniform"  # see `initializers` (not `init`: that is Module.init)
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x: jax.Array, unused: Any = None) -> tuple[jax.Array, None]:
        """x: f32[B, T, I] -> (f32[B, T, H], None)."""
        input_init, _ = initializers(self.init_scheme)
        w_xh = self.param("W_xh", input_init, (x.shape[-1], self.hidden_dim))
        b = self.param("b", nn.initializers.zeros_init(), (self.hidden_dim,))
        u = x @ w_xh + b  # f32[B, T, H], hoisted out of the time loop
        time_scan = nn.scan(
            ElmanCell,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=1,
            out_axes=1,
        )
        h0 = jnp.zeros((x.shape[0], self.hidden_dim), x.dtype)
        _, hs = time_scan(self.hidden_dim, self.init_scheme, self.activation, name="cell")(h0, u)
        return hs, None


class LayerStack(nn.Module):
    """`num_layers` identical `RecurrentLayer`s: one `nn.scan` over layers, or a Python loop.

    The scan traces and compiles one layer whatever the depth (compile time stays flat)
    and stores every parameter with a leading `[num_layers]` axis under `layers/`.
    """

    hidden_dim: int
    num_layers: int
    init_scheme: str = "uniform"
    activation: str = "tanh"
    scan_layers: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x: f32[B, T, H] -> f32[B, T, H]."""
        args = (self.hidden_dim, self.init_scheme, self.activation)
        if self.scan_layers:
            stack = nn.scan(
                RecurrentLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.num_layers,
            )
            x, _ = stack(*args, name="layers")(x, None)
        else:
            for i in range(self.num_layers):
                x, _ = RecurrentLayer(*args, name=f"layer_{i}")(x)
        return x


class RecurrentModel(nn.Module):
    """Input projection -> recurrent layer stack -> per-time-step linear readout."""

    config: ModelConfig
    output_dim: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x: f32[B, T, I] -> f32[B, T, output_dim]."""
        c = self.config
        x = nn.Dense(c.hidden_dim, name="input_proj")(x)
        x = LayerStack(c.hidden_dim, c.num_layers, c.init, c.activation, c.scan_layers, name="stack")(x)
        return nn.Dense(self.output_dim, name="readout")(x)


def stack_layer_params(params: dict, num_layers: int) -> dict:
    """Python-loop params (`stack/layer_{i}/...`) -> scanned layout (`stack/layers/...`, [L, ...])."""
    stack = params["stack"]
    layers = [stack[f"layer_{i}"] for i in range(num_layers)]
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *layers)
    return {**params, "stack": {"layers": stacked}}


def count_params(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def summary_table(model: RecurrentModel, example_input: jax.Array) -> str:
    """The `nn.tabulate` table of the model (parameters and shapes per module)."""
    table = nn.tabulate(model, jax.random.key(0), depth=3, console_kwargs={"width": 120, "force_terminal": False, "color_system": None})
    return table(example_input)
