"""The cell interface and the registry of cells by name.

A cell is one time step of a recurrent layer given its *input term*. The layer
(`rnnlab.models.RecurrentLayer`) owns the input weights W_xh: f32[I, W] and bias
b: f32[W] (W = `input_width`, G*H for a cell of G gates) and computes `u_t = x_t W_xh + b`;
the cell owns its recurrent parameters (`param_specs`) and does the rest in `step`. A
`SequenceCell` instead takes the whole sequence at once (`mix`): the cells linear in their
state, the matrix-state cells and attention, the layer's one other kind of time mixer.
Shapes: `B` batch, `T` time, `H` hidden units.

Everything the rest of rnnlab needs of a cell is declared on its class, so a new cell is
one file: subclass `Cell`, decorate it with `@register_cell`, and every part of the code
(config choices, model, FLOP count, `from_torch`) finds it by name. `step` is the one
statement of the equations: the autodiff path scans it, and so does the forward of the
hand-written backward (`model.recurrence=custom_vjp`, `rnnlab.recurrence`), which a cell
may add by overriding `backward`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rnnlab.options import declared_problem
from rnnlab.recurrence import linear_recurrence, scan_linear
from rnnlab.registry import Registry

Initializer = Callable[..., jax.Array]
Params = dict[str, jax.Array]  # a cell's recurrent parameters by name, as `param_specs` declares them
Carry = Any  # a pytree of [B, ...] arrays
State = Any  # a pytree of [B, ...] arrays: what a layer of the cell carries from one segment of a sequence to the next


def _uniform(scale: float) -> Initializer:
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, minval=-scale, maxval=scale)

    return init


def _identity(key, shape, dtype=jnp.float32):
    del key
    return jnp.eye(shape[0], shape[1], dtype=dtype)


# Named schemes -> (input initializer for W_xh, recurrent initializer for W_hh):
#   uniform:    U[-0.1, 0.1] for both (the classic setting for simple RNNs)
#   orthogonal: lecun_normal input, orthogonal recurrent matrix (Saxe et al. 2014)
#   identity:   N(0, 1e-3) input, identity recurrent matrix (IRNN, Le et al. 2015)
#   default:    Flax's `SimpleCell` defaults: lecun_normal input, orthogonal recurrent
INITIALIZERS: dict[str, tuple[Initializer, Initializer]] = {
    "uniform": (_uniform(0.1), _uniform(0.1)),
    "orthogonal": (nn.initializers.lecun_normal(), nn.initializers.orthogonal()),
    "identity": (nn.initializers.normal(1e-3), _identity),
    "default": (nn.initializers.lecun_normal(), nn.initializers.orthogonal()),
}

# Elementwise activations a cell may offer through `model.activation`: (function, its
# derivative written in terms of the function's output y, as a backward pass has it).
ACTIVATIONS: dict[str, tuple[Callable[[jax.Array], jax.Array], Callable[[jax.Array], jax.Array]]] = {
    "tanh": (jnp.tanh, lambda y: 1 - y * y),
    "relu": (jax.nn.relu, lambda y: (y > 0).astype(y.dtype)),
}


def initializers(init: str) -> tuple[Initializer, Initializer]:
    """(input initializer for W_xh, recurrent initializer for W_hh) of a scheme in INITIALIZERS."""
    if init not in INITIALIZERS:
        raise ValueError(f"unknown init {init!r}")
    return INITIALIZERS[init]


def per_gate(init: Initializer, num_gates: int) -> Initializer:
    """An initializer of f32[fan_in, G*H] that fills each [fan_in, H] gate block with `init`."""
    if num_gates == 1:
        return init

    def gated(key, shape, dtype=jnp.float32):
        fan_in, width = shape
        keys = jax.random.split(key, num_gates)
        return jnp.concatenate([init(k, (fan_in, width // num_gates), dtype) for k in keys], axis=1)

    return gated


def sigmoid_grad(s: jax.Array) -> jax.Array:
    """d sigmoid / d x in terms of s = sigmoid(x)."""
    return s * (1 - s)


def shift_back(xs: jax.Array) -> jax.Array:
    """[T, ...] -> [T, ...] holding (0, xs_0, ..., xs_{T-2}): the value at t-1 for every t."""
    return jnp.concatenate([jnp.zeros_like(xs[:1]), xs[:-1]], axis=0)


# The form a cell without a declared `default_time_scan` runs by default: the first of these it has.
DEFAULT_FORMS = ("chunked", "blockwise", "sequential")


@dataclasses.dataclass(frozen=True)
class Cell:
    """A recurrent cell of `hidden_dim` units with the model config's cell options.

    Subclasses set `name` and `num_gates` and define `step`; the other members have
    defaults that suit a cell whose only recurrent parameter is W_hh: f32[H, G*H].
    Instances are immutable and hashable (they are static arguments of jitted code).
    """

    hidden_dim: int
    init: str = "uniform"  # a key of INITIALIZERS
    activation: str = "tanh"  # a key of ACTIVATIONS, for cells that offer a choice
    forget_bias: float = 1.0  # for cells with a forget gate

    name: ClassVar[str]
    num_gates: ClassVar[int] = 1  # the input term is G*H wide
    # custom_vjp forward: read each step's input one iteration ahead (`rnnlab.recurrence.scan`).
    prefetch: ClassVar[bool] = False
    torch_class: ClassVar[str | None] = None  # torch.nn.<torch_class> computes the same layer, if any
    time_scans: ClassVar[tuple[str, ...]] = ("sequential",)  # `model.time_scan` choices (associative: linear cells; parallel: attention)
    uses_layer_input: ClassVar[bool] = False  # reads the layer's input x itself (so layer 0 gets x P + c, unfolded)
    input_bias: ClassVar[bool] = True  # the layer adds a bias b to its input term (Mamba's in_proj has none)
    onednn_kernel: ClassVar[str | None] = None  # `model.recurrence=onednn`: the `rnnlab.onednn.KERNELS` layer it runs, if any
    # The keys a layer of this cell runs with where the model config holds another cell's (a layer of
    # `model.pattern` other than `model.cell`): its conf/model/<name>.yaml's `init`, `recurrence` and
    # `time_scan`, declared once here (tests/test_hybrid.py checks that each yaml agrees). A cell that
    # declares no `default_time_scan` gets the first of DEFAULT_FORMS it has (`default_form`).
    default_init: ClassVar[str] = "uniform"
    default_recurrence: ClassVar[str] = "autodiff"
    default_time_scan: ClassVar[str | None] = None
    # `model.time_scan=auto`: the form a layer runs at each sequence length, chosen by measuring every form at
    # the zoo's shapes (docs/benchmarks.md, "Forms by length"): (longest length, form) pairs in increasing length,
    # the first that covers T; past them `long_form` (the form whose memory grows least with T).
    auto_forms: ClassVar[tuple[tuple[int, str], ...]] = ()
    long_form: ClassVar[str | None] = None
    # Whether `model.time_scan=auto` runs the cell's `fused` form (`rnnlab.fused`) on a CPU where the kernel builds:
    # where the train step measured faster with it at the zoo's shapes (docs/benchmarks.md, "Fused kernels").
    auto_fused: ClassVar[bool] = True

    @classmethod
    def default_form(cls) -> str:
        """The `time_scan` a layer of this cell runs where the model config holds another cell's keys:
        `default_time_scan`, else the first of DEFAULT_FORMS it has (the memory-linear one), else its first."""
        if cls.default_time_scan is not None:
            return cls.default_time_scan
        return next((form for form in DEFAULT_FORMS if form in cls.time_scans), cls.time_scans[0])

    def resolve_time_scan(self, time_scan: str, seq_len: int, stateful: bool = False) -> str:
        """The form a layer runs for `time_scan` on sequences of `seq_len` steps: `auto` resolved by `auto_forms`
        (the forms are equal in value, so the choice is only about speed), any other form as it is. `stateful`:
        a state is carried, so `auto` picks among the forms that carry one (`state_forms`)."""
        if time_scan != "auto":
            return time_scan
        form = next((form for longest, form in self.auto_forms if seq_len <= longest), None)
        form = form or self.long_form or self.default_form()
        form = form if form != "auto" else self.time_scans[0]
        if stateful and not self.carries_state(form):
            form = next(f for f in (self.long_form, *self.time_scans) if f is not None and self.carries_state(f))
        return form

    @property
    def input_width(self) -> int:
        """W, the width of the input term u = x W_xh + b the layer computes for this cell."""
        return self.num_gates * self.hidden_dim

    def state_floats(self, seq_len: int) -> int:
        """Floats of recurrent state one layer keeps per example after `seq_len` steps (what a
        recurrent model remembers its past in; Zoology plots recall against it)."""
        return self.hidden_dim

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], Initializer]]:
        """The recurrent parameters: name -> (shape, initializer). Created under the layer's `cell/`."""
        _, recurrent = initializers(self.init)
        return {"W_hh": ((self.hidden_dim, self.num_gates * self.hidden_dim), per_gate(recurrent, self.num_gates))}

    def input_init(self) -> Initializer:
        """Initializer of the layer's input weights W_xh: f32[fan_in, G*H]."""
        return per_gate(initializers(self.init)[0], self.num_gates)

    def bias_init(self) -> Initializer:
        """Initializer of the layer's input bias b: f32[G*H]."""
        return nn.initializers.zeros_init()

    def initial_carry(self, like: jax.Array) -> Carry:
        """Zeros of [B, H] with the dtype (and, under shard_map, the device variance) of `like`: [B, ...]."""
        return jnp.zeros_like(like, shape=(like.shape[0], self.hidden_dim))

    # The forms that carry a state in and out (`mix_state`); `model.time_scan=auto` picks among them when a
    # state is carried. None: every form in `time_scans`.
    state_forms: ClassVar[tuple[str, ...] | None] = None

    def carries_state(self, time_scan: str) -> bool:
        """Whether the form `time_scan` takes an initial state and returns its final state."""
        return time_scan == "auto" or time_scan in (self.state_forms or self.time_scans)

    def initial_state(self, batch: int, dtype: Any, cache_len: int = 0) -> State:
        """The state of one layer before the first step, for `batch` examples in the compute `dtype`: zeros
        (a step cell's carry). `cache_len`: the steps a cache that grows with the sequence (attention's) must
        hold; a recurrence's state does not depend on it."""
        return self.initial_carry(jnp.zeros((batch, 1), dtype))

    def step(self, params: Params, carry: Carry, u: jax.Array) -> tuple[Carry, jax.Array, Any]:
        """(params, carry, u_t: [B, G*H]) -> (carry, h_t: [B, H], saved_t).

        `saved_t` is what `backward` needs of this step beyond h_t (a pytree of [B, ...]
        arrays, or None); the autodiff path drops it and XLA removes what only it used."""
        raise NotImplementedError

    def hidden_from_saved(self, saved: Any) -> jax.Array:
        """Optional: hs [T, B, H] from the stacked `saved` of all steps, for a custom_vjp forward that
        then emits only `saved` from its loop (one output fewer per step, which short steps feel)."""
        raise NotImplementedError

    @property
    def has_hidden_from_saved(self) -> bool:
        return type(self).hidden_from_saved is not Cell.hidden_from_saved

    # The forms (`time_scans`) that run a hand-written backward under `model.recurrence=custom_vjp`; in any other
    # form the layer differentiates by autodiff, so the config refuses custom_vjp there. None: every form of a cell
    # that overrides `backward` (its step's, scanned by `rnnlab.recurrence`), none of one that does not. A
    # `SequenceCell` whose forms call a hand-written backward (`rnnlab.recurrence.linear_recurrence`, its own
    # custom_vjp) names them.
    backward_forms: ClassVar[tuple[str, ...] | None] = None

    def custom_vjp_forms(self) -> tuple[str, ...]:
        """The forms in which `model.recurrence=custom_vjp` runs a hand-written backward (`backward_forms`), and the
        fused form of a cell that has one (`rnnlab.fused`: its backward is the kernel's, whatever the recurrence)."""
        forms = self.backward_forms if self.backward_forms is not None else (
            self.time_scans if type(self).backward is not Cell.backward else ())
        return forms + (("fused",) if "fused" in self.time_scans and "fused" not in forms else ())

    @property
    def has_backward(self) -> bool:
        """Whether this cell has a hand-written backward (`model.recurrence=custom_vjp`) in any of its forms."""
        return bool(self.custom_vjp_forms())

    def has_backward_in(self, time_scan: str) -> bool:
        """Whether `model.recurrence=custom_vjp` runs a hand-written backward in the form `time_scan` (`auto`: in
        every form, since it may pick any)."""
        forms = self.custom_vjp_forms()
        return all(f in forms for f in self.time_scans) if time_scan == "auto" else time_scan in forms

    def backward(self, params: Params, u: jax.Array, b: jax.Array, hs: jax.Array, saved: Any, g: jax.Array,
                 unroll: int) -> tuple[jax.Array, Params]:
        """The gradients of a layer's recurrence, given the forward's inputs and outputs.

        u: [T, B, G*H] the input terms without b: [G*H]; hs: [T, B, H] and `saved` (stacked
        over T) as `step` returned them; g: [T, B, H] the gradient of hs. Returns (du, the
        gradients of `params`); db is sum(du). `rnnlab.recurrence` has the helpers."""
        raise NotImplementedError

    def option_problem(self) -> str | None:
        """A one-line message naming the `model.<key>` of a cell option out of range, or None: the options'
        declared ranges (`rnnlab.options.allowed`); a cell adds its checks across keys around this one."""
        return declared_problem(self, "model.")

    def mixing_flops(self, seq_len: int, time_scan: str) -> int:
        """Forward matmul FLOPs, for one example of `seq_len` steps mixed by `time_scan`, of the cell's
        work outside `step` and the layer's input term (a `SequenceCell`'s `mix`: output maps,
        attention scores, chunk products); each has a backward of twice its size."""
        return 0

    def mixing_recompute_flops(self, seq_len: int, time_scan: str) -> int:
        """Matmul FLOPs the backward reruns of that work (forms that checkpoint their state), per example."""
        return 0

    def recurrent_flops(self) -> int:
        """Matmul FLOPs of one `step` for one example (h_{t-1} W_hh: 2 H G H)."""
        return 2 * self.hidden_dim * self.num_gates * self.hidden_dim

    @classmethod
    def from_torch(cls, weight_ih: Any, weight_hh: Any, bias_ih: Any, bias_hh: Any) -> dict:
        """One layer of `torch.nn.<torch_class>`: weight_ih [G*H, I], weight_hh [G*H, H], bias_ih and
        bias_hh [G*H] (NumPy) -> this layer's params {W_xh, b, cell: {W_hh}}, biases summed."""
        if cls.torch_class is None:
            raise ValueError(f"cell {cls.name!r} has no PyTorch counterpart")
        w_ih, w_hh, b_ih, b_hh = (np.asarray(a, np.float32) for a in (weight_ih, weight_hh, bias_ih, bias_hh))
        return {"W_xh": w_ih.T, "b": b_ih + b_hh, "cell": {"W_hh": w_hh.T}}


@dataclasses.dataclass(frozen=True)
class SequenceCell(Cell):
    """A time mixer the layer hands the whole sequence at once (`mix`): it has no `step`, and the
    layer never runs one step at a time. Its forms (`time_scans`) are its own; it differentiates
    by autodiff through them or, in the forms it names in `backward_forms`, by a backward they write by hand."""

    default_init: ClassVar[str] = "default"

    def param_specs(self):
        return {}

    def mix(self, params: Params, u: jax.Array, x: jax.Array, time_scan: str, unroll: int,
            recurrence: str) -> jax.Array:
        """(params, u = x W_xh + b: [T, B, W], x: the layer input [T, B, I]) -> the layer's output
        [T, B, H] (real), by the form `time_scan`; `recurrence` is the layer's `model.recurrence`.
        From a zero state, the final state dropped (training): `mix_state` with no state."""
        return self.mix_state(params, u, x, time_scan, unroll, recurrence, None)[0]

    def mix_state(self, params: Params, u: jax.Array, x: jax.Array, time_scan: str, unroll: int, recurrence: str,
                  state: State | None) -> tuple[jax.Array, State]:
        """`mix` from `state` (as `initial_state` builds it; None: zeros, and the final state may be None)
        -> (output [T, B, H], the state after the last step). A sequence cut into segments, each run from the
        state the one before returned, gives the outputs of the whole sequence."""
        raise NotImplementedError

    def initial_state(self, batch, dtype, cache_len=0):
        raise NotImplementedError

    def recurrent_flops(self) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class LinearCell(SequenceCell):
    """A cell linear in its state, `h_t = a_t * h_{t-1} + b_t` elementwise, with a_t and b_t functions of
    the input alone: the whole time recurrence is one `rnnlab.recurrence.linear_recurrence`, which runs
    as a sequential or an associative scan (`model.time_scan`) and has its backward written by hand.

    Subclasses define `coefficients` (a, b for all time steps at once) and may define `output`
    (what the layer emits from the states; default the states).
    """

    time_scans: ClassVar[tuple[str, ...]] = ("sequential", "associative")
    backward_forms: ClassVar[tuple[str, ...] | None] = ("sequential", "associative")  # linear_recurrence's
    default_recurrence: ClassVar[str] = "custom_vjp"
    default_time_scan: ClassVar[str | None] = "sequential"

    def mix_state(self, params, u, x, time_scan, unroll, recurrence, state):
        a, b = self.coefficients(params, u, x)
        if state is not None:  # h_0 = a_0 h_{-1} + b_0: the state folds into the first step's b
            b = b.at[0].add(a[0] * state.astype(b.dtype))
        if recurrence == "custom_vjp":
            hs = linear_recurrence(a, b, time_scan, unroll)
        else:
            hs = scan_linear(a, b, time_scan, unroll)
        return self.output(params, hs, x), hs[-1]

    def initial_state(self, batch, dtype, cache_len=0):
        """h: zeros [B, H] in the dtype of the recurrence (`state_dtype`)."""
        return jnp.zeros((batch, self.hidden_dim), self.state_dtype(dtype))

    def state_dtype(self, dtype: Any) -> Any:
        """The dtype of h for the compute `dtype` (a complex recurrence's is complex)."""
        return dtype

    def coefficients(self, params: Params, u: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(params, u = x W_xh + b: [T, B, G*H], x: the layer input [T, B, I]) -> (a, b): [T, B, H] each."""
        raise NotImplementedError

    def output(self, params: Params, hs: jax.Array, x: jax.Array) -> jax.Array:
        """hs: [T, B, H] states -> the layer's output [T, B, H] (real)."""
        return hs


CELLS: Registry[type[Cell]] = Registry("cell")
register_cell = CELLS.register  # class decorator: make a Cell subclass available as `model.cell=<its name>`
get_cell = CELLS.get_class
cell_names = CELLS.names


def from_torch(cell: str, weight_ih: Any, weight_hh: Any, bias_ih: Any, bias_hh: Any) -> dict:
    """One PyTorch layer's `weight_ih_l{k}`, `weight_hh_l{k}`, `bias_ih_l{k}`, `bias_hh_l{k}` -> this
    layer's params, for the registered cell named `cell` (see `Cell.from_torch`)."""
    return get_cell(cell).from_torch(weight_ih, weight_hh, bias_ih, bias_hh)
