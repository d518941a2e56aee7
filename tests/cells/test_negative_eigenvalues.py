"""The state-tracking switches against float64 NumPy loops of the papers' equations: the delta rule with
beta in (0, 2) (Grazzi et al. 2025), gated DeltaProduct with n_h = 1..3 Householder steps per token
(Siems et al. 2025), and Mamba-2's scalar decay 2 exp(x) - 1 in (-1, 1] in its sequential and chunked
(SSD, signed log-decay) forms: values, gradients (directional finite differences of the loops), chunked
against sequential, transitions near -1 over long chunks, and n_h = 1 equal to gated DeltaNet."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first
from rnnlab.cells.delta_product_forms import delta_product_chunked, delta_product_recurrent
from rnnlab.cells.delta_rule_forms import delta_rule_chunked, delta_rule_recurrent
from rnnlab.cells.gla_forms import doubled_decay, gla_recurrent, ssd_chunked
from test_matrix_forms import assert_close, assert_grads_match_finite_differences, f32, numpy_delta, unit

B, H, DK, DV, CHUNK = 2, 2, 4, 4, 4
LENGTHS = (11, 3, 12)


def numpy_delta_product(q, k, v, beta, log_alpha):
    """Per token: S <- alpha S, then for j = 1..n: S <- (I - beta_j k_j^T k_j) S + beta_j k_j^T v_j; o = q S."""
    S = np.zeros((q.shape[1], q.shape[2], DK, v.shape[-1]))
    out = []
    for t in range(q.shape[0]):
        S = np.exp(log_alpha[t])[..., None, None] * S
        for j in range(k.shape[3]):
            kj, b = k[t, :, :, j], beta[t, :, :, j][..., None, None]
            S = S - b * kj[..., :, None] * np.einsum("bhk,bhkv->bhv", kj, S)[..., None, :] \
                + b * kj[..., :, None] * v[t, :, :, j][..., None, :]
        out.append(np.einsum("bhk,bhkv->bhv", q[t], S))
    return np.stack(out)


def numpy_signed_scalar(q, k, v, x):
    """S_t = (2 exp(x_t) - 1) S_{t-1} + k_t^T v_t per head (q, k shared by the heads), o_t = q_t S_t."""
    S = np.zeros(v.shape[1:3] + (q.shape[-1], v.shape[-1]))
    out = []
    for t in range(q.shape[0]):
        S = (2 * np.exp(x[t]) - 1)[..., None, None] * S + k[t][..., :, None] * v[t][..., None, :]
        out.append(np.einsum("bhk,bhkv->bhv", np.broadcast_to(q[t], v.shape[1:3] + (q.shape[-1],)), S))
    return np.stack(out)


def ssd_doubled(q, k, v, x, chunk_size):
    log_abs, negative = doubled_decay(x)
    return ssd_chunked(q, k, v, log_abs, chunk_size, negative)


def recurrent_doubled(q, k, v, x, checkpoint_every):
    shape = v.shape[:3] + (q.shape[-1],)
    log_abs, negative = (jnp.broadcast_to(a[..., None], shape) for a in doubled_decay(x))
    return gla_recurrent(jnp.broadcast_to(q, shape), jnp.broadcast_to(k, shape), v, log_abs, checkpoint_every, negative)


# name: (JAX form, NumPy reference, input kind)
FORMS = {
    "delta_neg_recurrent": (functools.partial(delta_rule_recurrent, checkpoint_every=CHUNK), numpy_delta, "delta"),
    "delta_neg_chunked": (functools.partial(delta_rule_chunked, chunk_size=CHUNK), numpy_delta, "delta"),
    "gated_delta_neg_recurrent": (functools.partial(delta_rule_recurrent, checkpoint_every=CHUNK), numpy_delta, "gated"),
    "gated_delta_neg_chunked": (functools.partial(delta_rule_chunked, chunk_size=CHUNK), numpy_delta, "gated"),
    "ssd_doubled_recurrent": (functools.partial(recurrent_doubled, checkpoint_every=CHUNK), numpy_signed_scalar, "ssd"),
    "ssd_doubled_chunked": (functools.partial(ssd_doubled, chunk_size=CHUNK), numpy_signed_scalar, "ssd"),
}
for _n in (1, 2, 3):
    for _beta in ("pos", "neg"):
        FORMS[f"product{_n}_{_beta}_recurrent"] = (
            functools.partial(delta_product_recurrent, checkpoint_every=CHUNK), numpy_delta_product, f"product{_n}_{_beta}")
        FORMS[f"product{_n}_{_beta}_chunked"] = (
            functools.partial(delta_product_chunked, chunk_size=CHUNK), numpy_delta_product, f"product{_n}_{_beta}")


def make_inputs(kind, length, seed=0, min_x=-5.0):
    """float64 arguments of a form. Delta rules: beta in (0, 2), a third of them near 2 (eigenvalue near -1);
    gates log alpha in [-3, 0]. ssd: x in [min_x, 0], so 2 exp(x) - 1 in (-1, 1], a third of them near -1."""
    rng = np.random.default_rng(seed)
    if kind == "ssd":
        q, k = 0.5 * rng.normal(size=(2, length, B, 1, DK))
        v = rng.normal(size=(length, B, H, DV))
        x = np.where(rng.random((length, B, H)) < 1 / 3, rng.uniform(min_x, min_x + 0.5, (length, B, H)),
                     rng.uniform(min_x, 0, (length, B, H)))
        return [q, k, v, x]
    n = int(kind[7]) if kind.startswith("product") else None
    top = 1.0 if kind.endswith("pos") else 2.0
    per_step = (length, B, H) + ((n,) if n else ())
    beta = np.where(rng.random(per_step) < 1 / 3, rng.uniform(top - 0.1, top - 0.02, per_step),
                    rng.uniform(0.05, top - 0.05, per_step))
    q = unit(rng.normal(size=(length, B, H, DK)))
    k = unit(rng.normal(size=per_step + (DK,)))
    v = rng.normal(size=per_step + (DV,))
    log_alpha = rng.uniform(-3, 0, (length, B, H))
    if n:
        return [q, k, v, beta, log_alpha]
    return [q, k, v, beta] + ([log_alpha] if kind == "gated" else [])


@functools.cache
def jitted(name):
    return jax.jit(FORMS[name][0])


# The fast tier: each shared implementation once, both forms where they differ (a delta rule with the switch, the
# gated one, Mamba-2's doubled decay, the product at n_h=2 with negative eigenvalues and at n_h=3 without); the
# other signs and n_h, in the full tier.
VALUE_FAST = ("delta_neg_recurrent", "delta_neg_chunked", "gated_delta_neg_chunked", "ssd_doubled_recurrent",
              "product2_neg_recurrent", "product2_neg_chunked", "product3_pos_chunked")


@pytest.mark.parametrize("name", [name if name in VALUE_FAST else pytest.param(
    name, marks=pytest.mark.slow("cross-product")) for name in FORMS])
def test_values_match_numpy_loop(name):
    _, reference, kind = FORMS[name]
    for length in LENGTHS:
        args = make_inputs(kind, length, seed=length)
        assert_close(jitted(name)(*f32(args)), reference(*args))


def functional(length, seed=7):
    return np.random.default_rng(seed).normal(size=(length, B, H, DV))


@functools.cache
def grads(name, length=11):
    args = make_inputs(FORMS[name][2], length, seed=3)
    weights = jnp.asarray(functional(length), jnp.float32)
    g = jax.jit(jax.grad(lambda *a: jnp.sum(jitted(name)(*a) * weights), argnums=tuple(range(len(args)))))(*f32(args))
    return args, [np.asarray(x, np.float64) for x in g]


GRAD_CASES = [n for n in FORMS if not n.startswith("product") or n.startswith(("product2_neg", "product3_neg"))]


# The fast tier: each implementation once (DeltaProduct's code is one for every n_h: n_h=3's gradients in the full tier).
@pytest.mark.parametrize("name", fast_first(sorted(GRAD_CASES, key=lambda n: n.startswith("product3")),
                                            keep=len(GRAD_CASES) - 2, why="cross-product"))
def test_grads_match_finite_differences(name):
    args, g = grads(name)
    assert_grads_match_finite_differences(FORMS[name][1], args, g, functional(args[0].shape[0]), tol=5e-5, directions=1)


@pytest.mark.parametrize("family", ["delta_neg", "gated_delta_neg", "ssd_doubled", "product2_neg",
                                    pytest.param("product3_pos", marks=pytest.mark.slow("cross-product"))])
def test_chunked_grads_match_recurrent(family):
    _, g_rec = grads(f"{family}_recurrent")
    _, g_chunk = grads(f"{family}_chunked")
    for a, b in zip(g_chunk, g_rec):
        assert_close(a, b, tol=2e-5)


@pytest.mark.slow("long")
def test_transitions_near_minus_one_over_long_chunks():
    """Mamba-2's signed decays within 1e-4 of -1 over chunks of 32 and 64 steps (products of up to 64 signed
    gates, signs alternating): the chunked form equals the float64 loop and its gradients the sequential form's."""
    length = 100
    args = make_inputs("ssd", length, seed=9, min_x=-12.0)
    args[3] = np.where(np.random.default_rng(1).random(args[3].shape) < 0.7, -12.0, args[3])  # 2 e^-12 - 1
    assert (2 * np.exp(args[3]) - 1).min() < -1 + 1e-4
    weights = jnp.asarray(functional(length), jnp.float32)
    for chunk in (32, 64):
        chunked = functools.partial(ssd_doubled, chunk_size=chunk)
        recurrent = functools.partial(recurrent_doubled, checkpoint_every=chunk)

        @jax.jit
        def run(*a):
            g_chunk = jax.grad(lambda *a: jnp.sum(chunked(*a) * weights), argnums=(0, 1, 2, 3))(*a)
            g_rec = jax.grad(lambda *a: jnp.sum(recurrent(*a) * weights), argnums=(0, 1, 2, 3))(*a)
            return chunked(*a), g_chunk, g_rec

        out, g_chunk, g_rec = run(*f32(args))
        assert_close(out, numpy_signed_scalar(*args), tol=1e-4)
        for a, b in zip(g_chunk, g_rec):
            assert np.all(np.isfinite(a))
            assert_close(a, b, tol=1e-4)


@pytest.mark.slow("long")
def test_doubled_decay_is_exact_near_one_and_finite_at_zero():
    x = jnp.array([-1e-7, -1e-3, -0.5, -0.7, -3.0, -40.0], jnp.float32)
    log_abs, negative = doubled_decay(x)
    want = 2 * np.exp(np.asarray(x, np.float64)) - 1
    assert list(np.asarray(negative)) == list(want < 0)
    np.testing.assert_allclose(np.asarray(log_abs), np.log(np.abs(want)), rtol=1e-5, atol=1e-7)
    at_zero = jnp.array([np.log(0.5)], jnp.float32)  # 2 exp(x) - 1 = 0 (to float32)
    for value in (doubled_decay(at_zero)[0], jax.grad(lambda x: jnp.sum(doubled_decay(x)[0]))(at_zero)):
        assert np.all(np.isfinite(np.asarray(value)))


@pytest.mark.parametrize("form", [delta_product_recurrent, delta_product_chunked])
def test_one_householder_step_is_the_gated_delta_rule(form):
    q, k, v, beta, log_alpha = f32(make_inputs("product1_neg", 11, seed=4))
    single = delta_rule_recurrent if form is delta_product_recurrent else delta_rule_chunked
    product = jax.jit(lambda *a: form(*a, CHUNK))(q, k, v, beta, log_alpha)
    delta = jax.jit(lambda *a: single(*a, CHUNK))(q, k[:, :, :, 0], v[:, :, :, 0], beta[..., 0], log_alpha)
    np.testing.assert_array_equal(np.asarray(product), np.asarray(delta))


def s3_word(length, seed):
    """A random word of S3 as permutation matrices [T, 3, 3], and each one's two reflections: unit vectors
    u [T, 2, 3] and strengths beta [T, 2] (2: the reflection I - 2 u^T u; 0: the identity) with P_t = H_2 H_1."""
    rng = np.random.default_rng(seed)
    perms = [np.eye(3)[list(p)] for p in ((0, 1, 2), (1, 0, 2), (0, 2, 1), (2, 1, 0), (1, 2, 0), (2, 0, 1))]
    swap = {(0, 1): perms[1], (1, 2): perms[2], (0, 2): perms[3]}
    axis = {pair: (np.eye(3)[pair[0]] - np.eye(3)[pair[1]]) / np.sqrt(2) for pair in swap}
    steps = {0: [], 1: [(0, 1)], 2: [(1, 2)], 3: [(0, 2)]}
    for i in (4, 5):  # the 3-cycles: a product of two transpositions, the first applied first
        steps[i] = next([a, b] for a in swap for b in swap if np.allclose(swap[b] @ swap[a], perms[i]))
    word = rng.integers(0, 6, size=length)
    u, beta = np.zeros((length, 2, 3)), np.zeros((length, 2))
    for t, g in enumerate(word):
        for j, pair in enumerate(steps[g]):
            u[t, j], beta[t, j] = axis[pair], 2.0
        u[t, len(steps[g]):] = np.eye(3)[0]  # beta 0: any unit vector
    return np.stack([perms[g] for g in word]), u, beta


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_two_reflections_a_token_track_s3_over_long_words(form):
    """DeltaProduct with n_h = 2 and beta up to 2 (the switch) represents S3's word problem exactly: with keys on
    each element's two reflection axes (Siems et al.'s construction), the state after T = 300 tokens is the product
    of the T permutation matrices applied to the vector the first token writes, in both forms. With beta <= 1 the
    transition of a token has no eigenvalue -1, and a transposition needs one."""
    length, heads = 300, 3
    mats, u, beta = s3_word(length, seed=2)
    c = np.array([1.0, 2.0, 3.0])  # distinct entries: P c names P
    first = mats[0] @ c
    u[0] = [first / np.linalg.norm(first), np.eye(3)[0]]  # token 1 writes P_1 c: (I - k^T k) 0 + k^T |P_1 c|
    beta[0] = [1.0, 0.0]
    v = np.zeros((length, 2, 1))
    v[0, 0] = np.linalg.norm(first)
    q = np.broadcast_to(np.eye(3)[None, None], (length, 1, heads, 3))  # head i reads entry i of the state
    args = [q, np.broadcast_to(u[:, None, None], (length, 1, heads, 2, 3)),
            np.broadcast_to(v[:, None, None], (length, 1, heads, 2, 1)), np.broadcast_to(beta[:, None, None], (length, 1, heads, 2))]
    fn = jax.jit(lambda *a: (delta_product_recurrent(*a, None) if form == "recurrent"
                             else delta_product_chunked(*a, None, chunk_size=16))[:, 0, :, 0])  # [T, heads]
    want, state = [], c
    for m in mats:
        state = m @ state
        want.append(state)
    np.testing.assert_allclose(np.asarray(fn(*f32(args))), np.stack(want), atol=1e-4)
    clipped = np.asarray(fn(*f32(args[:3] + [np.minimum(args[3], 1.0)])))  # eigenvalues in [0, 1] only
    assert np.abs(clipped[-50:] - np.stack(want)[-50:]).max() > 0.5
