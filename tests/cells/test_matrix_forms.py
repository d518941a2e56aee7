"""GLA and (gated) DeltaNet time-mixing forms (rnnlab.cells.gla_forms, rnnlab.cells.delta_rule_forms)
against float64 NumPy loops of the papers' equations: values, gradients (directional finite
differences of the loops), chunked gradients against recurrent ones, and gates strong enough to
overflow a naive chunked form."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first
from rnnlab.cells.delta_rule_forms import delta_rule_chunked, delta_rule_recurrent
from rnnlab.cells.gla_forms import gla_chunked, gla_recurrent

B, H, DK, DV, CHUNK = 2, 2, 4, 4, 4
LENGTHS = (11, 3, 12)  # not a multiple of CHUNK, shorter than it, a multiple


def numpy_gla(q, k, v, log_alpha):
    """S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,  o_t = q_t S_t; float64, one step at a time."""
    S = np.zeros(q.shape[1:3] + (q.shape[-1], v.shape[-1]))
    out = []
    for t in range(q.shape[0]):
        S = np.exp(log_alpha[t])[..., :, None] * S + k[t][..., :, None] * v[t][..., None, :]
        out.append(np.einsum("bhk,bhkv->bhv", q[t], S))
    return np.stack(out)


def numpy_delta(q, k, v, beta, log_alpha=None):
    """S_t = alpha_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,  o_t = q_t S_t; float64."""
    dk = q.shape[-1]
    S = np.zeros(q.shape[1:3] + (dk, v.shape[-1]))
    out = []
    for t in range(q.shape[0]):
        alpha = np.ones(beta.shape[1:]) if log_alpha is None else np.exp(log_alpha[t])
        b = beta[t][..., None, None]
        kk = k[t][..., :, None] * k[t][..., None, :]
        S = alpha[..., None, None] * ((np.eye(dk) - b * kk) @ S) + b * (k[t][..., :, None] * v[t][..., None, :])
        out.append(np.einsum("bhk,bhkv->bhv", q[t], S))
    return np.stack(out)


# name: (JAX form, NumPy reference, input kind). Recurrent forms checkpoint every CHUNK steps,
# so that their block padding is exercised too.
FORMS = {
    "gla_recurrent": (functools.partial(gla_recurrent, checkpoint_every=CHUNK), numpy_gla, "gla"),
    "gla_chunked": (functools.partial(gla_chunked, chunk_size=CHUNK), numpy_gla, "gla"),
    "delta_recurrent": (functools.partial(delta_rule_recurrent, checkpoint_every=CHUNK), numpy_delta, "delta"),
    "delta_chunked": (functools.partial(delta_rule_chunked, chunk_size=CHUNK), numpy_delta, "delta"),
    "gated_delta_recurrent": (functools.partial(delta_rule_recurrent, checkpoint_every=CHUNK), numpy_delta, "gated"),
    # the sequential form's backward by autodiff of each checkpointed block, against which its hand-written one is held
    "gated_delta_recurrent_autodiff": (functools.partial(delta_rule_recurrent, checkpoint_every=CHUNK, custom_backward=False),
                                       numpy_delta, "gated"),
    "gated_delta_chunked": (functools.partial(delta_rule_chunked, chunk_size=CHUNK), numpy_delta, "gated"),
}


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(kind, length, seed=0, gates=True, min_log_alpha=-5.0, weak=0.5):
    """float64 arguments of a form, in its positional order. Gates (GLA: per channel; gated
    delta: per head) uniform in [min_log_alpha, 0], except a fraction `weak` in [-0.1, 0]."""
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, length, B, H, DK))
    v = rng.normal(size=(length, B, H, DV))
    if kind == "gla":
        shape = (length, B, H, DK)
        strong = rng.uniform(min_log_alpha, 0, size=shape)
        near_one = rng.uniform(-0.1, 0, size=shape)
        log_alpha = np.where(rng.random(shape) < weak, near_one, strong) if gates else np.zeros(shape)
        return [0.5 * q, 0.5 * k, v, log_alpha]
    beta = rng.uniform(0.05, 0.95, size=(length, B, H))
    args = [unit(q), unit(k), v, beta]
    if kind == "gated":
        shape = (length, B, H)
        near_one, strong = rng.uniform(-0.1, 0, shape), rng.uniform(min_log_alpha, 0, shape)
        args.append(np.where(rng.random(shape) < weak, near_one, strong))
    return args


@functools.cache
def jitted(name):
    return jax.jit(FORMS[name][0])


def f32(args):
    return [jnp.asarray(a, jnp.float32) for a in args]


def assert_close(actual, expected, tol=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    err = np.max(np.abs(actual - expected))
    assert err <= tol * max(1.0, np.max(np.abs(expected))), (err, np.max(np.abs(expected)))


@pytest.mark.parametrize("name", list(FORMS))
def test_values_match_numpy_loop(name):
    _, reference, kind = FORMS[name]
    for length in LENGTHS:
        for gates in (True, False) if kind == "gla" else (True,):
            args = make_inputs(kind, length, seed=length, gates=gates)
            assert_close(jitted(name)(*f32(args)), reference(*args))


def linear_functional(length, seed=7):
    return np.random.default_rng(seed).normal(size=(length, B, H, DV))


@functools.cache
def grads(name, length=11):
    """jax.grad of sum(o * R) wrt every argument, float32, and the float64 arguments."""
    args = make_inputs(FORMS[name][2], length, seed=3)
    weights = jnp.asarray(linear_functional(length), jnp.float32)

    def loss(*a):
        return jnp.sum(jitted(name)(*a) * weights)

    g = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*f32(args))
    return args, [np.asarray(x, np.float64) for x in g]


def assert_grads_match_finite_differences(reference, args, g, weights, tol=2e-5, directions=2):
    """jax.grad `g` of sum(form(*args) * weights) along random directions, one argument at a time, against
    central differences of the float64 loop `reference`."""
    rng = np.random.default_rng(11)
    eps = 1e-5
    for i in range(len(args)):
        for _ in range(directions):
            direction = rng.normal(size=args[i].shape)
            plus, minus = list(args), list(args)
            plus[i], minus[i] = args[i] + eps * direction, args[i] - eps * direction
            fd = np.sum((reference(*plus) - reference(*minus)) * weights) / (2 * eps)
            ad = np.sum(g[i] * direction)
            scale = np.linalg.norm(g[i]) * np.linalg.norm(direction)  # bounds |ad|
            assert abs(ad - fd) <= tol * scale, (i, ad, fd, scale)


@pytest.mark.parametrize("name", list(FORMS))
def test_grads_match_finite_differences(name):
    args, g = grads(name)
    assert_grads_match_finite_differences(FORMS[name][1], args, g, linear_functional(args[0].shape[0]))


@pytest.mark.parametrize("family", ["gla", "delta", "gated_delta"])
def test_chunked_grads_match_recurrent(family):
    _, g_rec = grads(f"{family}_recurrent")
    _, g_chunk = grads(f"{family}_chunked")
    for a, b in zip(g_chunk, g_rec):
        assert_close(a, b)


@pytest.mark.slow("long")
def test_strong_gates_do_not_overflow():
    """Gates down to -30 per step with chunk 6 (not a power of two): a chunk's gates sum to about
    -90 and below, where exp(-g) of a naive chunked form overflows float32. Values still match the
    float64 loop, and gradients are finite and match the recurrent form's."""
    length, chunk = 13, 6
    for kind, chunked, recurrent, reference in [
        ("gla", gla_chunked, gla_recurrent, numpy_gla),
        ("gated", delta_rule_chunked, delta_rule_recurrent, numpy_delta),
    ]:
        args = make_inputs(kind, length, seed=5, min_log_alpha=-30.0, weak=0.0)
        assert np.sum(args[-1][:chunk], axis=0).min() < -90
        chunk_fn = functools.partial(chunked, chunk_size=chunk)
        weights = jnp.asarray(linear_functional(length), jnp.float32)
        argnums = tuple(range(len(args)))

        @jax.jit
        def run(*a):
            out = chunk_fn(*a)
            g_chunk = jax.grad(lambda *a: jnp.sum(chunk_fn(*a) * weights), argnums)(*a)
            g_rec = jax.grad(lambda *a: jnp.sum(recurrent(*a) * weights), argnums)(*a)
            return out, g_chunk, g_rec

        out, g_chunk, g_rec = run(*f32(args))
        assert_close(out, reference(*args))
        for a, b in zip(g_chunk, g_rec):
            assert np.all(np.isfinite(a))
            assert_close(a, b)


@pytest.mark.parametrize("length", fast_first(LENGTHS, why="cross-product"))
def test_the_hand_written_backward_of_the_sequential_delta_rule_is_autodiffs(length):
    """`delta_rule_block`'s backward against jax.grad of the same steps: every argument's gradient."""
    _, hand = grads("gated_delta_recurrent", length)
    _, auto = grads("gated_delta_recurrent_autodiff", length)
    for h, a in zip(hand, auto):
        np.testing.assert_allclose(h, a, rtol=2e-5, atol=2e-6)
