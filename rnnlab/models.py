"""Recurrent models: an input projection, recurrent layers (the first apart, the rest stacked
with a scan), a readout.

Shapes use `B` batch, `T` time, `I` input features, `H` hidden units, `L` layers and
`W` the width of the cell's input term (`input_width` of the registered cell: G*H for G gates).

Parameter layout (`model.scan_layers=true`, the default)::

    input_proj/{kernel f32[I, H], bias f32[H]}
    stack/layer_0/{W_xh f32[H, G*H], b f32[G*H], cell/{the cell's param_specs, e.g. W_hh f32[H, G*H]}}
    stack/layers/{W_xh f32[L-1, H, G*H], b f32[L-1, G*H], cell/{... f32[L-1, ...]}}   <- stacked on axis 0
    readout/{kernel f32[H, O], bias f32[O]}

Layers 1 .. L-1 are one `nn.scan` (absent when L = 1). A hybrid (`model.pattern` of period
p > 1, `ModelConfig.layer_cells`) is laid out by groups of p layers instead (`LayerStack`):
`stack/groups/layer_<i>/...` for the pattern's i-th cell, stacked [L / p, ...]. The first layer stands apart
because it folds the input projection into its input weights (`fold_projection`):
the function is the same, the work much smaller. With `scan_layers=false` the stack is
a Python loop and layer i lives under `layer_{i}/` with the same leaves, unstacked;
`stack_layer_params` converts. Parameters are float32 whatever `model.dtype`; with
bfloat16 they are cast at use and the readout's output is cast back to float32 for the loss.

The input is floats f32[B, T, I] or, from a symbol task, token ids int32[B, T] (I symbols,
id I a padded step), which the projection embeds: a gather of its kernel's rows (`embed`),
the values a one-hot matmul gives, without the [B, T, I] one-hot.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rnnlab import fused, onednn
from rnnlab.blocks import ResidualBlock
from rnnlab.cells import Cell, SequenceCell, get_cell
from rnnlab.config import ConfigError, LayerCell, ModelConfig
from rnnlab.embedding import apply_projection, embed, is_token_ids, project  # noqa: F401  (embed: models.embed, as before)
from rnnlab.recurrence import linear, recurrence

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def default_unroll(platform: str) -> int:
    """`model.unroll=null`: time steps per iteration of the time scans' loops on `platform`.

    On CPU unrolling gained nothing; on a GPU every loop iteration has a fixed cost beyond
    its kernels' work, which unrolling spreads (docs/performance-notes.md). TPUs are
    untested and get the GPU's setting.
    """
    return 1 if platform == "cpu" else 8


def folds_projection(input_dim: int, hidden_dim: int, tokens: int | None = None) -> bool:
    """Whether the first layer folds the input projection into its input weights.

    The projection is linear and nothing stands between it and the first layer's
    input matmul, so `(x P + c) W_xh + b = x (P W_xh) + (c W_xh + b)`.

    Float inputs (`tokens` None): per token the folded form costs one [I, G*H] matmul
    forward and one backward (the gradient of `P W_xh`; x is data), against [I, H] +
    [H, G*H] forward and [I, H] + two [H, G*H]-sized ones backward; the fold's own products
    (`P W_xh`, their gradients) are per step, not per token. Per token that is 2 I G H
    against 2 I H + 3 G H^2 multiply-adds: folding is cheaper whenever
    I < 3GH / (2(G - 1)), always for a cell with G = 1, and the rule here, I < 2H, is
    within that bound for every cell (the continuous task here has I = 2).

    Token ids (`tokens`: how many ids a step embeds on one device, B * T): both forms gather
    rows, which is no matmul: of P (then x_1 W_xh per token) or of the folded P W_xh. So the
    fold saves per token the first layer's input matmul, 2 H G*H forward and twice that
    backward (its dx, which P's gradient needs, and dW_xh), and adds per step its products
    `P W_xh` and `c W_xh`, 2 (I + 1) H G*H forward and twice that backward. It folds where
    that is cheaper, I + 1 < tokens: a small vocabulary does, Zoology's 8,192 symbols at a
    step of 2,048 tokens does not.
    """
    if tokens is not None:
        return input_dim + 1 < tokens
    return input_dim < 2 * hidden_dim


def folds_first_layer(config: ModelConfig, input_dim: int, tokens: int | None = None) -> bool:
    """Whether this model's first layer folds the input projection (`folds_projection`; `tokens`:
    the token ids of a step on one device, None for float inputs): not where a residual block or
    the cell itself needs the projected input x P + c. A hybrid's never does: its stack applies the
    projection before the scan over its groups (`LayerStack`)."""
    if len(config.layer_cells()) > 1:
        return False
    cell = get_cell(config.cell)
    return (config.block == "plain" and not cell.uses_layer_input
            and folds_projection(input_dim, config.hidden_dim, tokens=tokens))


def fold_projection(projection: tuple[jax.Array, jax.Array], w_xh: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(P: [I, H], c: [H]), W_xh: [H, G*H], b: [G*H] -> (P W_xh: [I, G*H], c W_xh + b: [G*H]), in float32."""
    kernel, bias = projection
    return kernel @ w_xh, bias @ w_xh + b


class InputProjection(nn.Module):
    """The input projection's parameters, `kernel` [I, H] and `bias` [H] with `nn.Dense`'s names
    and initializers, returned rather than applied: the first layer folds them into its input
    weights (`fold_projection`), or, where that is not cheaper, applies them itself."""

    features: int

    @nn.compact
    def __call__(self, input_dim: int) -> tuple[jax.Array, jax.Array]:
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (input_dim, self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        return kernel, bias


class CellParams(nn.Module):
    """A cell's recurrent parameters, created as its `param_specs` declare them (under `cell/`)."""

    cell: Cell

    @nn.compact
    def __call__(self) -> dict[str, jax.Array]:
        return {name: self.param(name, init, shape) for name, (shape, init) in self.cell.param_specs().items()}


class RecurrentLayer(nn.Module):
    """One layer over a whole sequence: a registered cell (`rnnlab.cells`) scanned over time.

    Time-major, like the whole stack: the model transposes its small input and output
    once instead of each layer transposing the [B, T, H] sequence in and out. With
    `recurrence="custom_vjp"` the input term `x W_xh` is one matmul before the scan and the
    cell's hand-written backward differentiates the scan (`rnnlab.recurrence`); with
    "autodiff" the input term is computed inside the scan and `jax.grad` differentiates
    it. Call signature `(carry, unused) -> (carry, None)` so the layer itself can be
    scanned over the stack; the carry is the sequence. The first layer of a model gets the
    raw input and the input projection's `(kernel, bias)` as `projection`, and folds them
    into its input weights (`fold_projection`) where that is cheaper (`folds_projection`).
    Given token ids, its input term is a gather: of the folded table's rows, or of the
    kernel's, then `x_1 W_xh` as for any layer.
    """

    hidden_dim: int
    cell: str  # a registered cell's name
    cell_options: tuple[tuple[str, Any], ...] = ()  # the cell's own fields (`ModelConfig.options`)
    init_scheme: str = "uniform"  # see `rnnlab.cells.INITIALIZERS` (not `init`: that is Module.init)
    activation: str = "tanh"
    forget_bias: float = 1.0  # initial forget-gate bias, for cells that have one
    # autodiff: jax.grad of the scanned cell | custom_vjp: the cell's own backward | onednn: its oneDNN
    # kernel | auto: onednn where `onednn.prefers` the shape, else custom_vjp
    recurrence: str = "autodiff"
    remat: bool = False  # recompute each step in the backward pass instead of storing it (autodiff)
    unroll: int = 1  # time steps per iteration of the scan's loop
    time_scan: str = "sequential"  # linear cells: sequential | associative
    dtype: Any = jnp.float32  # compute dtype
    dropout: float = 0.0  # dropout rate on this layer's output (`dropout` rng)
    deterministic: bool = True  # no dropout (evaluation)

    @nn.compact
    def __call__(self, x: jax.Array, state: Any = None, projection: Any = None) -> tuple[jax.Array, Any]:
        """x: [T, B, I], or with `projection` token ids int32[T, B] -> ([T, B, H] in the compute dtype, the
        state after the last step, or None where no `state` came in).

        state: None (training: from zeros, no state returned), or the cell's state before the first step
        (`Cell.initial_state`; a segment after another: the state that one returned).
        projection: None, or the input projection's (kernel f32[I, H], bias f32[H]), which
        this layer applies before its own input weights W_xh: f32[H, G*H].
        """
        cell = get_cell(self.cell)(self.hidden_dim, self.init_scheme, self.activation, self.forget_bias,
                                   **dict(self.cell_options))
        width = cell.input_width
        fan_in = x.shape[-1] if projection is None else projection[0].shape[-1]
        # A cell with no input term (rwkv7 projects x itself) has no W_xh: Orbax saves no empty arrays.
        w_xh = self.param("W_xh", cell.input_init(), (fan_in, width)) if width else jnp.zeros((fan_in, 0), jnp.float32)
        b = self.param("b", cell.bias_init(), (width,)) if cell.input_bias else jnp.zeros((width,), jnp.float32)
        params = CellParams(cell, name="cell")()
        ids = is_token_ids(x)
        # oneDNN's layer takes the float input x and W_xh itself: no folded gather of token ids
        onednn_layer = self.recurrence == "onednn" or (
            self.recurrence == "auto" and self.dtype == jnp.float32 and onednn.prefers(x.shape[1], self.hidden_dim))
        if projection is not None and not cell.uses_layer_input and not (ids and onednn_layer) and folds_projection(
                projection[0].shape[0], self.hidden_dim, tokens=x.size if ids else None):
            w_xh, b = fold_projection(projection, w_xh, b)  # token ids: their input term is a gather of P W_xh
        elif projection is not None:
            x, ids = apply_projection(x, projection, self.dtype), False
        x = x if ids else x.astype(self.dtype)
        w_xh, b = w_xh.astype(self.dtype), b.astype(self.dtype)
        params = jax.tree_util.tree_map(lambda p: p.astype(self.dtype), params)
        # Every step's input term x W_xh at once. (A `mix` gets token ids as x only in a cell that never
        # reads x: one that does, `uses_layer_input`, gets x P + c.)
        input_term = embed if ids else linear
        if isinstance(cell, SequenceCell):  # every step's input term at once, then the cell's own form
            time_scan = cell.resolve_time_scan(self.time_scan, x.shape[0], stateful=state is not None)  # x: [T, B, ...]
            if state is None:
                return self._dropout(cell.mix(params, input_term(x, w_xh) + b, x, time_scan, self.unroll,
                                              self.recurrence)), None
            if not cell.carries_state(time_scan):
                raise ValueError(f"model.time_scan={time_scan} of cell {cell.name!r} carries no state; "
                                 f"allowed with a state: {', '.join(cell.state_forms or cell.time_scans)}, auto")
            hs, state = cell.mix_state(params, input_term(x, w_xh) + b, x, time_scan, self.unroll, self.recurrence,
                                       state)
            return self._dropout(hs), state
        if state is not None:  # a step cell's state is its carry: the scan of its step from it (every recurrence)
            def carried(carry, u_t):
                carry, h, _ = cell.step(params, carry, u_t + b)
                return carry, h

            state, hs = jax.lax.scan(carried, state, input_term(x, w_xh), unroll=self.unroll)
            return self._dropout(hs), state
        if onednn_layer:
            hs = onednn.KERNELS[cell.onednn_kernel](x, w_xh, b, params)
            return self._dropout(hs), None
        if self.recurrence in ("custom_vjp", "auto"):
            hs = recurrence(cell, self.unroll, input_term(x, w_xh), b, params)
            return self._dropout(hs), None

        def step(carry: Any, x_t: jax.Array) -> tuple[Any, jax.Array]:
            carry, h, _ = cell.step(params, carry, project(x_t, w_xh) + b)
            return carry, h

        if self.remat:
            step = jax.checkpoint(step, prevent_cse=False)  # CSE cannot undo remat inside a scan
        # Time-major: slicing step t off a leading axis is a contiguous read (and its
        # gradient a contiguous write), unlike a slice of axis 1.
        like = x[0].astype(self.dtype) if ids else x[0]  # the carry's batch, dtype (and device variance)
        _, hs = jax.lax.scan(step, cell.initial_carry(like), x, unroll=self.unroll)
        return self._dropout(hs), None

    def _dropout(self, hs: jax.Array) -> jax.Array:
        if self.dropout > 0:
            hs = nn.Dropout(self.dropout, deterministic=self.deterministic)(hs)
        return hs


class LayerGroup(nn.Module):
    """One period of a hybrid's pattern: its layers in order, `layer_<i>` the pattern's i-th cell, each its
    own class and fields (`members`: (class, fields as (name, value) pairs)). Call signature
    `(x, unused) -> (x, None)`, so that the stack scans it over the groups."""

    members: tuple[tuple[Any, tuple[tuple[str, Any], ...]], ...]

    @nn.compact
    def __call__(self, x: jax.Array, state: Any = None) -> tuple[jax.Array, Any]:
        """state: None, or {layer_<i>: the i-th layer's state} -> (x, the layers' states after, or None)."""
        after = {}
        for i, (layer_class, fields) in enumerate(self.members):
            x, after[f"layer_{i}"] = layer_class(**dict(fields), name=f"layer_{i}")(
                x, None if state is None else state[f"layer_{i}"])
        return x, None if state is None else after


class LayerStack(nn.Module):
    """`num_layers` `RecurrentLayer`s: the first, then the rest as one `nn.scan` or a Python loop.

    The scan traces and compiles one layer whatever the depth (compile time stays flat)
    and stores the parameters of layers 1 .. L-1 with a leading `[num_layers - 1]` axis
    under `layers/`; layer 0 lives under `layer_0/` in both forms, since it alone takes
    the input projection (`RecurrentLayer`'s `projection`). `stack_init="vmap"`
    initialises the scanned stack as `jax.vmap` of one layer's init over per-layer keys
    (Flax issue #1771) instead of running init through the scan; the parameters have the
    same layout. In that mode init returns the stack's input unchanged as the scanned
    part's output (same shape; `Module.init` keeps only the parameters).

    A hybrid (`pattern`: p > 1 entries, one per cell of the pattern's period, each the `RecurrentLayer`
    fields that cell's layers run with; `ModelConfig.layer_cells`) applies the input projection first
    (x P + c: no fold) and then scans ONE `LayerGroup` of its p layers over the `num_layers / p` groups,
    so it compiles p layers whatever the depth. Parameters: `groups/layer_<i>/...` (i < p, the
    pattern's i-th cell, in its block) stacked [num_layers / p, ...]; with `scan_layers=false`
    `layer_<j>/...` for every layer j, unstacked (layer j is the pattern's cell j mod p), as for one
    cell. With no pattern, or one of a single cell, the layout above, unchanged. `stack_init="vmap"`
    initialises the groups as `jax.vmap` of one group's init.
    """

    hidden_dim: int
    num_layers: int
    init_scheme: str = "uniform"
    activation: str = "tanh"
    scan_layers: bool = True
    stack_init: str = "scan"  # scan | vmap
    layer_options: tuple[tuple[str, Any], ...] = ()  # further RecurrentLayer fields, as (name, value) pairs
    block: str = "plain"  # plain: RecurrentLayer | residual: blocks.ResidualBlock around it
    block_fields: tuple[tuple[str, Any], ...] = ()  # residual only: its MLP (mlp, mlp_expand, mlp_bias)
    # A hybrid: per cell of the pattern's period, the RecurrentLayer fields its layers run with (cell,
    # cell_options, init_scheme, activation, forget_bias, recurrence, time_scan) over `layer_options`
    pattern: tuple[tuple[tuple[str, Any], ...], ...] = ()

    def _layer(self, i: int = 0) -> tuple[Any, dict[str, Any]]:
        """(module class, fields) of a layer of the pattern's i-th cell, in the model's block."""
        kwargs = dict(hidden_dim=self.hidden_dim, init_scheme=self.init_scheme, activation=self.activation,
                      **dict(self.layer_options))
        if self.pattern:
            kwargs.update(self.pattern[i])
        layer_class = RecurrentLayer
        if self.block == "residual":
            layer_class = ResidualBlock
            kwargs = dict(hidden_dim=kwargs.pop("hidden_dim"), cell=kwargs.pop("cell"), layer_class=RecurrentLayer,
                          layer_fields=tuple(kwargs.items()), **dict(self.block_fields))
        return layer_class, kwargs

    @nn.compact
    def __call__(self, x: jax.Array, projection: Any = None, state: Any = None) -> Any:
        """x: [T, B, H], or the raw input [T, B, I] or token ids int32[T, B] with `projection` (kernel
        [I, H], bias [H]) -> [T, B, H] (time-major); given `state` (the layers' states laid out as their
        parameters are, `initial_state`), ([T, B, H], the layers' states after the last step)."""
        if len(self.pattern) > 1:
            return self._groups(x, projection, state)
        part = (lambda name: None) if state is None else state.get  # noqa: E731  (a layer's part of `state`)
        after = {}
        layer_class, kwargs = self._layer()
        x, after["layer_0"] = layer_class(**kwargs, name="layer_0")(x, part("layer_0"), projection=projection)
        rest = self.num_layers - 1
        if rest == 0:
            return x if state is None else (x, after)
        if not self.scan_layers:
            for i in range(1, self.num_layers):
                x, after[f"layer_{i}"] = layer_class(**kwargs, name=f"layer_{i}")(x, part(f"layer_{i}"))
            return x if state is None else (x, after)
        if self.stack_init == "vmap" and self.is_initializing():
            stack = nn.vmap(
                layer_class, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=None, axis_size=rest,
            )
            stack(**kwargs, name="layers")(x, None)
            return x
        stack = nn.scan(  # the layers' states (stacked [L-1, ...]) are scanned over with their parameters
            layer_class, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=rest,
        )
        x, after["layers"] = stack(**kwargs, name="layers")(x, part("layers"))
        return x if state is None else (x, after)

    def _groups(self, x: jax.Array, projection: Any, state: Any) -> Any:
        """A hybrid: the projection, then one scan of a `LayerGroup` over the groups (or a Python loop)."""
        period = len(self.pattern)
        part = (lambda name: None) if state is None else state.get  # noqa: E731
        if projection is not None:  # x P + c here, once, so that the first group is the scan's body too
            x = apply_projection(x, projection, dict(self.layer_options).get("dtype", jnp.float32))
        if not self.scan_layers:
            after = {}
            for j in range(self.num_layers):
                layer_class, kwargs = self._layer(j % period)
                x, after[f"layer_{j}"] = layer_class(**kwargs, name=f"layer_{j}")(x, part(f"layer_{j}"))
            return x if state is None else (x, after)
        members = tuple((cls, tuple(kwargs.items())) for cls, kwargs in map(self._layer, range(period)))
        groups = self.num_layers // period
        if self.stack_init == "vmap" and self.is_initializing():
            stack = nn.vmap(LayerGroup, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None,
                            axis_size=groups)
            stack(members, name="groups")(x, None)
            return x
        stack = nn.scan(LayerGroup, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                        length=groups)
        x, after = stack(members, name="groups")(x, part("groups"))
        return x if state is None else (x, {"groups": after})


class RecurrentModel(nn.Module):
    """Input projection -> recurrent layer stack -> per-time-step linear readout.

    The input projection is a linear map the first layer applies (folded into its own
    input weights where that is cheaper: `folds_projection`); to token ids, an embedding
    of the same parameters."""

    config: ModelConfig
    output_dim: int
    input_dim: int | None = None  # the symbols of token-id inputs (needed for them); float inputs: I, if given
    # A hybrid's cells with their recurrence resolved for the platform (`build_model`); (): `config.layer_cells()`
    layer_cells: tuple[LayerCell, ...] = ()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False, state: Any = None) -> Any:
        """x: f32[B, T, I], or token ids int32[B, T] in [0, input_dim) (input_dim: a padded step, embedded
        as zero) -> f32[B, T, output_dim]. `train=True` turns on dropout (needs a `dropout` rng).

        state: None, or the model's state before x's first step (`initial_state`, or what a call on the
        segment before returned) -> (outputs, the state after x's last step): the model as an RNN."""
        c = self.config
        if c.unroll is None:
            raise ValueError("model.unroll is null: build the model with rnnlab.models.build_model, which resolves it")
        dtype = DTYPES[c.dtype]
        layer_options = (
            ("cell", c.cell), ("cell_options", c.options), ("forget_bias", c.forget_bias),
            ("recurrence", c.recurrence), ("remat", c.remat), ("unroll", c.unroll), ("time_scan", c.time_scan),
            ("dtype", dtype), ("dropout", c.dropout),
            ("deterministic", not train),
        )
        if is_token_ids(x) and self.input_dim is None:
            raise ValueError("token-id inputs need the number of symbols: build_model(..., input_dim=task.input_dim)")
        if not is_token_ids(x) and self.input_dim not in (None, x.shape[-1]):
            raise ValueError(f"inputs of width {x.shape[-1]}, but the model was built for input_dim={self.input_dim}")
        input_dim = self.input_dim or x.shape[-1]
        x = jnp.swapaxes(x, 0, 1)  # time-major [T, B, I] or [T, B]: the stack runs time-major throughout
        projection = InputProjection(c.hidden_dim, name="input_proj")(input_dim)
        block_fields = (("mlp", c.mlp), ("mlp_expand", c.mlp_expand), ("mlp_bias", c.mlp_bias))
        specs = self.layer_cells or c.layer_cells()
        pattern = () if len(specs) == 1 else tuple(
            (("cell", s.cell), ("cell_options", s.options), ("init_scheme", s.init), ("activation", s.activation),
             ("forget_bias", s.forget_bias), ("recurrence", s.recurrence), ("time_scan", s.time_scan))
            for s in specs)
        x = LayerStack(c.hidden_dim, c.num_layers, c.init, c.activation, c.scan_layers, c.stack_init,
                       layer_options, c.block, block_fields, pattern, name="stack")(x, projection, state)
        if state is not None:
            x, after = x
        if c.block == "residual":
            x = nn.RMSNorm(dtype=dtype, name="final_norm")(x)
        y = nn.Dense(self.output_dim, dtype=dtype, name="readout")(x)  # [T, B, O]
        y = jnp.swapaxes(y, 0, 1).astype(jnp.float32)
        return y if state is None else (y, after)


def initial_state(model: RecurrentModel, batch: int, cache_len: int = 0) -> dict:
    """The state of `model` before the first step for `batch` examples: every layer's (`Cell.initial_state`,
    and in a residual block with the RWKV MLP its token shift's last input), zeros, laid out as the layers'
    parameters are (`stack/...`: `layer_0`, `layers` stacked [L-1, ...]; a hybrid's `groups/layer_<i>` stacked
    [L / p, ...]; unstacked `layer_<j>` with `model.scan_layers=false`). `cache_len`: the steps attention's
    cache must hold (every step the state will see; with a window, at most the window's)."""
    c = model.config
    specs = model.layer_cells or c.layer_cells()
    dtype = DTYPES[c.dtype]

    def layer(spec: LayerCell) -> Any:
        cell = spec.make(c.hidden_dim)
        state = cell.initial_state(batch, dtype, cache_len)
        if c.block != "residual":
            return state
        return {"mixer": state} | ({"mlp": jnp.zeros((batch, c.hidden_dim), dtype)} if c.mlp == "rwkv" else {})

    def stacked(state: Any, n: int) -> Any:
        return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), state)

    period = len(specs)
    if not c.scan_layers:
        return {f"layer_{j}": layer(specs[j % period]) for j in range(c.num_layers)}
    if period > 1:
        return {"groups": {f"layer_{i}": stacked(layer(spec), c.num_layers // period) for i, spec in enumerate(specs)}}
    first = layer(specs[0])
    return {"layer_0": first} | ({"layers": stacked(first, c.num_layers - 1)} if c.num_layers > 1 else {})


def state_bytes(state: Any) -> int:
    """Bytes of a state (`initial_state`) for all its examples."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(state))


def build_model(config: ModelConfig, output_dim: int, platform: str | None = None,
                input_dim: int | None = None) -> RecurrentModel:
    """The model of `config` for a task with `output_dim` outputs and `input_dim` inputs (the task's;
    needed where the inputs are token ids), trained on `platform` (default: JAX's default backend),
    with `model.unroll=null` resolved for that platform (`default_unroll`)."""
    platform = platform or jax.default_backend()
    unroll = config.unroll or default_unroll(platform)
    config = dataclasses.replace(config, unroll=unroll, recurrence=resolve_recurrence(config, platform),
                                 time_scan=resolve_form(config.time_scan, config.cell, platform))
    specs = config.layer_cells()
    if len(specs) > 1:  # each cell's own recurrence and form resolved alike (the LSTM's default is auto)
        specs = tuple(s if s.cell == config.cell else dataclasses.replace(
            s, recurrence=_resolve(s.recurrence, config.hidden_dim, platform, f"model.pattern_keys.{s.cell}.recurrence"),
            time_scan=resolve_form(s.time_scan, s.cell, platform, f"model.pattern_keys.{s.cell}.time_scan"))
            for s in specs)
        return RecurrentModel(config, output_dim, input_dim, specs)
    return RecurrentModel(config, output_dim, input_dim)


def resolve_recurrence(config: ModelConfig, platform: str) -> str:
    """`model.recurrence`, or "custom_vjp" where an "onednn" or "auto" layer cannot run oneDNN's kernel
    (not on CPU, or the kernel not built); a one-line notice where that changes an explicit "onednn",
    or an "auto" whose width would take it."""
    return _resolve(config.recurrence, config.hidden_dim, platform)


def _resolve(recurrence: str, hidden_dim: int, platform: str, key: str = "model.recurrence") -> str:
    if recurrence not in ("onednn", "auto"):
        return recurrence
    if recurrence == "auto" and (platform != "cpu" or not onednn.prefers(onednn.MIN_BATCH, hidden_dim)):
        return "custom_vjp"  # no layer of this width would take the kernel: do not build or load it
    ok, why = onednn.available() if platform == "cpu" else (False, f"oneDNN's kernel runs on CPU, not {platform}")
    if not ok:
        _notice_once(f"{key}={recurrence}: {why}; running {key}=custom_vjp (XLA) instead")
        return "custom_vjp"
    return recurrence


def resolve_form(time_scan: str, cell: str, platform: str, key: str = "model.time_scan") -> str:
    """`model.time_scan`, with `auto` taken to the cell's fused CPU kernel (`rnnlab.fused`) on a CPU where the
    kernel builds and the cell's train step measured faster with it (`Cell.auto_fused`; docs/benchmarks.md, "Fused
    kernels"). Where it cannot be built, `auto` keeps the JAX forms after a one-line notice."""
    kind = get_cell(cell)
    if time_scan == "fused" and platform != "cpu":  # device.platform=auto found an accelerator
        raise ConfigError(fused.refusal(key, cell, kind.time_scans, platform))
    if time_scan != "auto" or platform != "cpu" or "fused" not in kind.time_scans or not kind.auto_fused:
        return time_scan
    ok, why = fused.available()
    if not ok:
        _notice_once(f"{key}=auto: {why}; running the JAX forms instead of the fused kernel")
        return time_scan
    return "fused"


@functools.cache
def _notice_once(message: str) -> None:
    log.warning(message)


def stack_layer_params(params: dict, num_layers: int, period: int = 1) -> dict:
    """Python-loop params (`stack/layer_{i}/...`) -> scanned layout (`stack/layer_0/...` and
    `stack/layers/...` with layers 1 .. L-1 stacked, [L-1, ...]); a hybrid's of pattern period p > 1 ->
    `stack/groups/layer_<i>/...`, its layers i, p + i, 2p + i, ... stacked [L / p, ...]."""
    if period > 1:
        groups = {f"layer_{i}": jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves),
                                                       *[params["stack"][f"layer_{j}"] for j in range(i, num_layers, period)])
                  for i in range(period)}
        return {**params, "stack": {"groups": groups}}
    stack = {"layer_0": params["stack"]["layer_0"]}
    if num_layers > 1:
        layers = [params["stack"][f"layer_{i}"] for i in range(1, num_layers)]
        stack["layers"] = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *layers)
    return {**params, "stack": stack}


def count_params(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def summary_table(model: RecurrentModel, example_input: jax.Array) -> str:
    """The `nn.tabulate` table of the model (parameters and shapes per module); `example_input` as the
    model takes it (`Task.example_inputs`: token ids or floats)."""
    table = nn.tabulate(model, jax.random.key(0), depth=3, console_kwargs={"width": 120, "force_terminal": False, "color_system": None})
    return table(example_input)
