"""Time scans of a cell, and the hand-written backward pass (`model.recurrence=custom_vjp`).

Autodiff of `lax.scan` accumulates the weight gradient inside the reverse scan: at
every time step it forms `h_{t-1}^T da_t` (a [H, B] x [B, G*H] matmul) and adds it to
a carried [H, G*H] sum, beside the `da_t W_hh^T` the recurrence needs. With a cell's
hand-written `backward` (`rnnlab.cells.Cell.backward`) the reverse scan propagates only
the deltas and emits the pre-activation gradients `da_t`; the weight gradient is then
one matmul over all time steps at once (`recurrent_weight_grad`),

    dW_hh = sum_t h_{t-1}^T da_t = H^T DA_next     H: [T*B, H] (h_0 .. h_{T-1}), DA_next: (da_1 .. da_{T-1}, 0)

which runs at full matmul efficiency instead of T small ones. The input term
`u = x W_xh` is computed before the recurrence by `linear`, so `dW_xh = X^T DU` and
`dx = DU W_xh^T` are single matmuls too; the bias is added inside the step and
`db = sum DU`. The forward scans the cell's own `step`, the same function the autodiff
path scans. Shapes: `T` time, `B` batch, `H` hidden units, `G` gates; time-major.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

Params = dict[str, Any]


class SteppingCell(Protocol):
    """What the scans here need of a cell (`rnnlab.cells.Cell` has it; named structurally, so that this
    module, which the cells use, imports none of them)."""

    has_hidden_from_saved: bool
    prefetch: bool

    def step(self, params: Params, carry: Any, u_t: jax.Array) -> tuple[Any, jax.Array, Any]: ...

    def initial_carry(self, u_0: jax.Array) -> Any: ...

    def hidden_from_saved(self, saved: Any) -> jax.Array: ...

    def backward(self, params: Params, u: jax.Array, b: jax.Array, hs: jax.Array, saved: Any, g: jax.Array,
                 unroll: int) -> tuple[jax.Array, Params]: ...


def weight_grad(x: jax.Array, dy: jax.Array) -> jax.Array:
    """x^T dy over all leading axes: x [..., K], dy [..., N] -> [K, N].

    Where K < N, `x` is transposed explicitly (the barrier keeps XLA from folding the
    transpose back into the dot): XLA's CPU backend otherwise transposed the wider `dy`.
    Where K >= N, XLA's own form measured faster (docs/performance-notes.md).
    """
    x, dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if x.shape[-1] >= dy.shape[-1]:
        return x.T @ dy
    return jax.lax.optimization_barrier(x.T) @ dy


@jax.custom_vjp
def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for x: [..., K], w: [K, N], with `weight_grad` for dw, and no dx where x is
    not differentiated (data: the first layer's input)."""
    return x @ w


def _linear_fwd(x, w):  # symbolic_zeros: each argument comes with its `perturbed` bit
    return x.value @ w.value, (x.value, w.value if x.perturbed else None)


def _linear_bwd(saved, dy):
    x, w = saved
    dx = None if w is None else dy @ w.T
    return dx, weight_grad(x, dy)


linear.defvjp(_linear_fwd, _linear_bwd, symbolic_zeros=True)


def recurrent_weight_grad(hs: jax.Array, da: jax.Array) -> jax.Array:
    """dW_hh = sum_t h_{t-1}^T da_t for hs: [T, B, H] and da: [T, B, N] (the gradient of h_{t-1} W_hh).

    The time shift goes on da, not on hs: `weight_grad` transposes hs, and XLA fused a
    shift of hs into that transpose, which then ran several times slower."""
    da_next = jnp.concatenate([da[1:], jnp.zeros_like(da[:1])])  # da_{t+1}, 0 at t = T-1
    return weight_grad(hs, da_next)


def scan(step: Callable, init: Any, xs: Any, reverse: bool = False, unroll: int = 1, prefetch: bool = False):
    """`lax.scan(step, init, xs, reverse, unroll)`; with `prefetch` (forward only), each step's
    slice of xs is read one iteration ahead and carried.

    XLA's CPU fusion emitter fuses the per-step slice `xs[t]` into the elementwise fusion
    that consumes it, and such a fusion runs transcendentals slowly; carrying the slice
    from the previous iteration gives it a fusion of its own. The slice of step t+1 is read
    by index from xs itself, not from a shifted copy of xs.
    """
    if not prefetch:
        return jax.lax.scan(step, init, xs, reverse=reverse, unroll=unroll)
    assert not reverse, "prefetch is implemented for forward scans only"
    length = jax.tree_util.tree_leaves(xs)[0].shape[0]

    def prefetched(carry, t):
        carry, x_t = carry
        t_next = jnp.minimum(t + 1, length - 1)
        x_next = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, t_next, keepdims=False), xs)
        carry, y = step(carry, x_t)
        return (carry, x_next), y

    first = jax.tree_util.tree_map(lambda x: x[0], xs)
    (carry, _), ys = jax.lax.scan(prefetched, (init, first), jnp.arange(length), unroll=unroll)
    return carry, ys


def scan_cell(cell: SteppingCell, params: Params, u: jax.Array, b: jax.Array, unroll: int = 1,
              prefetch: bool = False) -> tuple[jax.Array, Any]:
    """The cell's `step` over u + b (u: [T, B, G*H], b: [G*H]) from a zero carry -> (hs: [T, B, H], saved)."""
    from_saved = cell.has_hidden_from_saved

    def step(carry, u_t):
        carry, h, saved = cell.step(params, carry, u_t + b)
        return carry, saved if from_saved else (h, saved)

    _, ys = scan(step, cell.initial_carry(u[0]), u, unroll=unroll, prefetch=prefetch)
    return (cell.hidden_from_saved(ys), ys) if from_saved else ys


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def recurrence(cell: SteppingCell, unroll: int, u: jax.Array, b: jax.Array, params: Params) -> jax.Array:
    """hs: [T, B, H] of `cell` over the input terms u + b (u: [T, B, G*H] = x W_xh, b: [G*H]),
    differentiated by the cell's hand-written `backward`."""
    return scan_cell(cell, params, u, b, unroll, cell.prefetch)[0]


def _recurrence_fwd(cell, unroll, u, b, params):
    hs, saved = scan_cell(cell, params, u, b, unroll, cell.prefetch)
    return hs, (u, b, params, hs, saved)


def _recurrence_bwd(cell, unroll, residuals, g):
    u, b, params, hs, saved = residuals
    du, dparams = cell.backward(params, u, b, hs, saved, g, unroll)
    return du, jnp.sum(du, axis=(0, 1)), dparams


recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


# --- Recurrences linear in the state: h_t = a_t * h_{t-1} + b_t (elementwise) ------------------------


def _combine(earlier: tuple[jax.Array, jax.Array], later: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Two steps of h -> a * h + b composed: first `earlier`, then `later` (an associative operation)."""
    a1, b1 = earlier
    a2, b2 = later
    return a1 * a2, a2 * b1 + b2


def scan_linear(a: jax.Array, b: jax.Array, time_scan: str = "sequential", unroll: int = 1,
                reverse: bool = False) -> jax.Array:
    """hs with h_t = a_t * h_{t-1} + b_t from h = 0, over axis 0 (a, b: [T, ...], real or complex).

    `sequential` is one `lax.scan` (T steps of depth 1); `associative` is `lax.associative_scan`
    over the pairs (a_t, b_t) (depth O(log T), about twice the work). `reverse` runs from the end:
    h_t = a_t * h_{t+1} + b_t.
    """
    if time_scan == "associative":
        return jax.lax.associative_scan(_combine, (a, b), reverse=reverse)[1]

    def step(h, ab):
        h = ab[0] * h + ab[1]
        return h, h

    return jax.lax.scan(step, jnp.zeros_like(b[0]), (a, b), reverse=reverse, unroll=unroll)[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def linear_recurrence(a: jax.Array, b: jax.Array, time_scan: str = "sequential", unroll: int = 1) -> jax.Array:
    """`scan_linear` with its backward written by hand: the same recurrence run in reverse,

        dh_t = g_t + a_{t+1} * dh_{t+1},   da_t = dh_t * h_{t-1},   db_t = dh_t

    (JAX's transpose convention: no conjugation for complex a, b). It keeps a and hs, O(T*B*H),
    where autodiff of `associative_scan` keeps every level's partial products."""
    return scan_linear(a, b, time_scan, unroll)


def _linear_recurrence_fwd(a, b, time_scan, unroll):
    hs = scan_linear(a, b, time_scan, unroll)
    return hs, (a, hs)


def _linear_recurrence_bwd(time_scan, unroll, residuals, g):
    a, hs = residuals
    a_next = jnp.concatenate([a[1:], jnp.zeros_like(a[:1])])  # a_{t+1}, 0 past the end
    dh = scan_linear(a_next, g.astype(hs.dtype), time_scan, unroll, reverse=True)
    h_prev = jnp.concatenate([jnp.zeros_like(hs[:1]), hs[:-1]])
    return dh * h_prev, dh


linear_recurrence.defvjp(_linear_recurrence_fwd, _linear_recurrence_bwd)
