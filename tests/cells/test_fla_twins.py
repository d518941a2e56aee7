"""The matrix-state recurrences (rnnlab.cells.gla_forms, rnnlab.cells.delta_rule_forms) against the papers'
authors' own pure-PyTorch references, flash-linear-attention's `naive.py` functions (the `refs` extra,
which the full tier installs): outputs, and the gradients with respect to every input (jax.vjp against torch
autograd, one random cotangent), float32 in both.

flash-linear-attention's references, as used here (its arrays are batch-major, [B, T, H, D], except
`delta_rule_recurrence` and `delta_rule_chunkwise`, [B, H, T, D]; all keep the state S: [K, V] in the row
convention of rnnlab's forms, o_t = q_t S_t, and all compute in float32):

    fla.ops.delta_rule.naive        delta_rule_recurrence, delta_rule_chunkwise (T a multiple of its chunk:
                                    the twin pads with beta = k = 0)
    fla.ops.gated_delta_rule.naive  naive_recurrent_gated_delta_rule(q, k, v, beta, g), naive_chunk_..(q, k, v, g, beta)
    fla.ops.gla.naive               naive_recurrent_gla(q, k, v, gk): one gate per key channel
    fla.ops.simple_gla.naive        naive_recurrent_simple_gla, naive_chunk_simple_gla: one gate per head (SSD)
    fla.ops.gated_delta_product.naive  naive_recurrent_gated_delta_product(q, k, v, g, beta, scale, num_householder)

g is the log decay (rnnlab's log_alpha), applied to the state before the step's write. None L2-normalises
(the layers do, before); each multiplies q by a scale, K^-1/2 unless told: scale=1 where a reference takes
it, and where it does not (delta_rule_*, naive_recurrent_gla) the twin hands it q * K^1/2.

Gated DeltaProduct (Siems et al. 2025) in fla, per token t with n_h Householder steps j = 0..n_h-1:
S <- exp(g_t) S once, before the first step; then in order j = 0..n_h-1, S <- S + beta_tj k_tj^T (v_tj - k_tj S);
then o_t = q_t S, read after the last step. Its k, v, beta hold the steps of token t at rows t n_h + j. That is
the gated delta rule over T n_h sub-steps with g at each token's first sub-step and 0 at the others, q at its
last (fla's own chunk_ref builds it so): test_fla_delta_product_is_the_delta_rule_over_substeps states it.

`beta` up to 2 is Grazzi et al.'s `allow_neg_eigval` (beta = 2 sigmoid): the forms take beta as given.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require
from rnnlab import fused
from rnnlab.cells.delta_product_forms import delta_product_chunked, delta_product_recurrent
from rnnlab.cells.delta_rule_forms import delta_rule_chunked, delta_rule_recurrent
from rnnlab.cells.gla_forms import gla_chunked, gla_recurrent, ssd_chunked

pytestmark = pytest.mark.slow("extra")

B, H, DK, DV = 2, 2, 8, 16
# (length, chunk): shorter than its chunk (padded); several whole chunks; one whole chunk; whole chunks and a part.
# Each length and each chunk size is met; the forms treat every pair by the same padding and the same scan.
LENGTH_CHUNKS = ((5, 8), (16, 4), (16, 16), (37, 8))
BETAS = {"beta_lt1": (0.05, 0.95), "beta_lt2": (0.05, 1.95)}  # (0, 1); (0, 2): allow_neg_eigval
RTOL = 1e-5  # of the largest |value| of each compared array; float32 in both (seen: at most 1.2e-6)


@pytest.fixture(scope="module")
def fla():
    """flash-linear-attention's naive references (torch CPU); under CI a missing `refs` extra fails the tests."""
    require("fla")
    import fla.ops.delta_rule.naive as delta
    import fla.ops.gated_delta_product.naive as product
    import fla.ops.gated_delta_rule.naive as gated_delta
    import fla.ops.gla.naive as gla
    import fla.ops.simple_gla.naive as simple_gla

    return dict(delta=delta, gated_delta=gated_delta, gla=gla, simple_gla=simple_gla, product=product)


# --- inputs -------------------------------------------------------------------------------------------------------

def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def log_gates(rng, shape, low=-3.0):
    """Half the gates in [low, 0] (strong: a chunk of 16 decays by up to e^-48), half in [-0.1, 0]."""
    return np.where(rng.random(shape) < 0.5, rng.uniform(low, 0, shape), rng.uniform(-0.1, 0, shape))


def betas(rng, shape, kind):
    """Uniform in the kind's range; with beta < 2, a third of them in [1.9, 1.99] (near a reflection)."""
    low, high = BETAS[kind]
    beta = rng.uniform(low, high, shape)
    if high > 1:
        beta = np.where(rng.random(shape) < 1 / 3, rng.uniform(1.9, 1.99, shape), beta)
    return beta


def delta_inputs(length, beta_kind, gated, seed):
    """q, k (L2-normalised): [T, B, h, dk]; v: [T, B, h, dv]; beta (, log_alpha): [T, B, h]; float32."""
    rng = np.random.default_rng(seed)
    q, k = unit(rng.normal(size=(2, length, B, H, DK)))
    args = [q, k, rng.normal(size=(length, B, H, DV)), betas(rng, (length, B, H), beta_kind)]
    if gated:
        args.append(log_gates(rng, (length, B, H)))
    return [a.astype(np.float32) for a in args]


def gla_inputs(length, per_channel, seed, groups=H):
    """q, k: [T, B, groups, dk]; v: [T, B, h, dv]; log_alpha: [T, B, h, dk] or, one per head, [T, B, h]."""
    rng = np.random.default_rng(seed)
    q, k = 0.5 * rng.normal(size=(2, length, B, groups, DK))
    gates = log_gates(rng, (length, B, H, DK) if per_channel else (length, B, H))
    return [a.astype(np.float32) for a in (q, k, rng.normal(size=(length, B, H, DV)), gates)]


# --- the comparison -----------------------------------------------------------------------------------------------

def assert_close(actual, expected, what, rtol=RTOL):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = np.max(np.abs(expected))
    err = np.max(np.abs(actual - expected))
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3g}, max |ref| {scale:.3g}, ratio {err / scale:.3g}"


def jax_output_and_grads(fn, args, cotangent):
    @jax.jit
    def run(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cotangent)

    out, grads = run([jnp.asarray(a) for a in args], jnp.asarray(cotangent))
    return np.asarray(out), [np.asarray(g) for g in grads]


def torch_output_and_grads(fn, args, cotangent):
    import torch

    leaves = [torch.tensor(a, requires_grad=True) for a in args]
    out = fn(*leaves)
    out.backward(torch.tensor(cotangent))
    return out.detach().numpy(), [leaf.grad.numpy() for leaf in leaves]


def assert_twins(jax_fn, torch_fns, args, names, seed=99):
    """jax_fn and each of torch_fns (name: fn), on the same float32 args in rnnlab's layout: the same output and,
    for one random cotangent, the same gradient with respect to every argument."""
    shape = jax.eval_shape(jax_fn, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]).shape
    cotangent = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    out, grads = jax_output_and_grads(jax_fn, args, cotangent)
    for ref_name, torch_fn in torch_fns.items():
        ref_out, ref_grads = torch_output_and_grads(torch_fn, args, cotangent)
        assert_close(out, ref_out, f"output vs {ref_name}")
        for name, g, ref_g in zip(names, grads, ref_grads):
            assert_close(g, ref_g, f"d{name} vs {ref_name}")


# --- torch twins in rnnlab's layout (time-major [T, B, h, ...]) ------------------------------------------------------

def _bthd(x):
    """[T, B, h, ...] -> [B, T, h, ...]"""
    return x.transpose(0, 1)


def _bhtd(x):
    """[T, B, h, ...] -> [B, h, T, ...]"""
    return x.permute(1, 2, 0, *range(3, x.ndim))


def _pad_time(xs, multiple):
    """Zero-pad [B, h, T, ...] arrays along T to a multiple (beta = k = 0 there: the state passes unchanged)."""
    import torch.nn.functional as F

    length = xs[0].shape[2]
    pad = -length % multiple
    return [F.pad(x, [0, 0] * (x.ndim - 3) + [0, pad]) for x in xs]


def fla_delta_recurrence(fla):
    def run(q, k, v, beta):
        o, _ = fla["delta"].delta_rule_recurrence(_bhtd(q) * DK ** 0.5, _bhtd(k), _bhtd(v), _bhtd(beta))
        return o.permute(2, 0, 1, 3)  # [B, h, T, dv] -> [T, B, h, dv]
    return run


def fla_delta_chunkwise(fla, chunk):
    def run(q, k, v, beta):
        length = q.shape[0]
        xs = _pad_time([_bhtd(q) * DK ** 0.5, _bhtd(k), _bhtd(v), _bhtd(beta)], chunk)
        o, _ = fla["delta"].delta_rule_chunkwise(*xs, chunk_size=chunk)
        return o.permute(2, 0, 1, 3)[:length]
    return run


def fla_gated_delta_recurrent(fla):
    def run(q, k, v, beta, log_alpha):
        o, _ = fla["gated_delta"].naive_recurrent_gated_delta_rule(
            _bthd(q), _bthd(k), _bthd(v), _bthd(beta), _bthd(log_alpha), scale=1.0)
        return _bthd(o)
    return run


def fla_gated_delta_chunk(fla, chunk):
    def run(q, k, v, beta, log_alpha):
        o, _ = fla["gated_delta"].naive_chunk_gated_delta_rule(
            _bthd(q), _bthd(k), _bthd(v), _bthd(log_alpha), _bthd(beta), chunk_size=chunk, scale=1.0)
        return _bthd(o)
    return run


def fla_gla_recurrent(fla):
    def run(q, k, v, log_alpha):
        o, _ = fla["gla"].naive_recurrent_gla(_bthd(q) * DK ** 0.5, _bthd(k), _bthd(v), _bthd(log_alpha))
        return _bthd(o)
    return run


def _heads(x):
    """[T, B, g, dk] with g = 1 or h -> [T, B, h, dk] (Mamba-2's one group, shared by the heads)."""
    return x.expand(*x.shape[:2], H, x.shape[-1])


def fla_simple_gla_recurrent(fla):
    def run(q, k, v, log_alpha):
        o, _ = fla["simple_gla"].naive_recurrent_simple_gla(
            _bthd(_heads(q)), _bthd(_heads(k)), _bthd(v), _bthd(log_alpha), scale=1.0)
        return _bthd(o)
    return run


def fla_simple_gla_chunk(fla, chunk):
    def run(q, k, v, log_alpha):
        o, _ = fla["simple_gla"].naive_chunk_simple_gla(
            _bthd(_heads(q)), _bthd(_heads(k)), _bthd(v), _bthd(log_alpha), chunk_size=chunk, scale=1.0)
        return _bthd(o)
    return run


# --- DeltaNet and gated DeltaNet ------------------------------------------------------------------------------------

def delta_rule_form(form, chunk):
    """The delta rule's form `form` (recurrent, chunked or the fused CPU kernel) with `chunk`."""
    if form == "fused":
        return fused.delta_rule
    return (functools.partial(delta_rule_recurrent, checkpoint_every=chunk) if form == "recurrent"
            else functools.partial(delta_rule_chunked, chunk_size=chunk))


@pytest.mark.parametrize("beta_kind", list(BETAS))
@pytest.mark.parametrize("length, chunk", LENGTH_CHUNKS)
@pytest.mark.parametrize("form", ["recurrent", "chunked", "fused"])
def test_delta_rule_matches_fla(fla, form, length, chunk, beta_kind):
    """DeltaNet (no gate) against fla's delta_rule_recurrence and delta_rule_chunkwise (same chunk size); `fused`:
    the CPU kernel (`rnnlab.fused`)."""
    fn = delta_rule_form(form, chunk)
    refs = {"delta_rule_recurrence": fla_delta_recurrence(fla), "delta_rule_chunkwise": fla_delta_chunkwise(fla, chunk)}
    assert_twins(fn, refs, delta_inputs(length, beta_kind, False, seed=length + chunk), "q k v beta".split())


@pytest.mark.parametrize("beta_kind", list(BETAS))
@pytest.mark.parametrize("length, chunk", LENGTH_CHUNKS)
@pytest.mark.parametrize("form", ["recurrent", "chunked", "fused"])
def test_gated_delta_rule_matches_fla(fla, form, length, chunk, beta_kind):
    """Gated DeltaNet (log_alpha down to -3) against fla's naive_recurrent_ and naive_chunk_gated_delta_rule."""
    fn = delta_rule_form(form, chunk)
    refs = {"naive_recurrent_gated_delta_rule": fla_gated_delta_recurrent(fla),
            "naive_chunk_gated_delta_rule": fla_gated_delta_chunk(fla, chunk)}
    assert_twins(fn, refs, delta_inputs(length, beta_kind, True, seed=length + chunk),
                 "q k v beta log_alpha".split())


# --- GLA, and one gate per head (Mamba-2's SSD) ---------------------------------------------------------------------

def fused_gla(q, k, v, log_alpha):
    """The fused CPU kernel (`rnnlab.fused.gated_linear`) with gla_recurrent's arguments (log-decays per key channel,
    or [T, B, h] one per head)."""
    return fused.gated_linear(q, k, v, jnp.exp(log_alpha))


@pytest.mark.parametrize("length, chunk", LENGTH_CHUNKS)
@pytest.mark.parametrize("form", ["recurrent", "chunked", "fused"])
def test_gla_matches_fla(fla, form, length, chunk):
    """GLA, a gate per key channel, against fla's naive_recurrent_gla."""
    fn = (functools.partial(gla_recurrent, checkpoint_every=chunk) if form == "recurrent"
          else fused_gla if form == "fused" else functools.partial(gla_chunked, chunk_size=chunk))
    assert_twins(fn, {"naive_recurrent_gla": fla_gla_recurrent(fla)},
                 gla_inputs(length, per_channel=True, seed=length + chunk), "q k v log_alpha".split())


def gla_recurrent_per_head(q, k, v, log_alpha, checkpoint_every):
    """gla_recurrent with one gate per head (log_alpha: [T, B, h]) and q, k of one group or one per head."""
    shape = (*v.shape[:3], q.shape[-1])
    return gla_recurrent(jnp.broadcast_to(q, shape), jnp.broadcast_to(k, shape), v,
                         jnp.broadcast_to(log_alpha[..., None], shape), checkpoint_every)


@pytest.mark.parametrize("groups", [H, 1])
@pytest.mark.parametrize("length, chunk", LENGTH_CHUNKS)
@pytest.mark.parametrize("form", ["ssd_chunked", "gla_recurrent", "fused"])
def test_scalar_gate_matches_fla_simple_gla(fla, form, length, chunk, groups):
    """One gate per head (SSD; q, k one per head, or one group shared by the heads as Mamba-2's C and B)
    against fla's naive_recurrent_ and naive_chunk_simple_gla."""
    fn = (functools.partial(ssd_chunked, chunk_size=chunk) if form == "ssd_chunked"
          else fused_gla if form == "fused" else functools.partial(gla_recurrent_per_head, checkpoint_every=chunk))
    refs = {"naive_recurrent_simple_gla": fla_simple_gla_recurrent(fla),
            "naive_chunk_simple_gla": fla_simple_gla_chunk(fla, chunk)}
    assert_twins(fn, refs, gla_inputs(length, per_channel=False, seed=length + chunk, groups=groups),
                 "q k v log_alpha".split())


# --- Gated DeltaProduct ---------------------------------------------------------------------------------------------

def _fla_gated_delta_product(q, k, v, beta, log_alpha, num_householder):
    """fla's naive_recurrent_gated_delta_product in rnnlab's layout, torch tensors: q: [T, B, h, dk];
    k: [T, B, h, n_h, dk]; v: [T, B, h, n_h, dv]; beta: [T, B, h, n_h]; log_alpha: [T, B, h] or None
    -> o: [T, B, h, dv] (scale 1: q as given)."""
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

    length, batch, heads = q.shape[:3]

    def steps(x):  # [T, B, h, n_h, ...] -> [B, T n_h, h, ...], token t's step j at row t n_h + j
        x = x.permute(1, 0, 3, 2, *range(4, x.ndim))  # [B, T, n_h, h, ...]
        return x.reshape(batch, length * num_householder, heads, *x.shape[4:])

    o, _ = naive_recurrent_gated_delta_product(
        _bthd(q), steps(k), steps(v), None if log_alpha is None else _bthd(log_alpha), steps(beta),
        scale=1.0, num_householder=num_householder)
    return _bthd(o)


def product_inputs(length, n_h, beta_kind, gated, seed):
    """q: [T, B, h, dk]; k: [T, B, h, n_h, dk], v: [T, B, h, n_h, dv], beta: [T, B, h, n_h]; log_alpha: [T, B, h]."""
    rng = np.random.default_rng(seed)
    args = [unit(rng.normal(size=(length, B, H, DK))), unit(rng.normal(size=(length, B, H, n_h, DK))),
            rng.normal(size=(length, B, H, n_h, DV)), betas(rng, (length, B, H, n_h), beta_kind)]
    if gated:
        args.append(log_gates(rng, (length, B, H)))
    return [a.astype(np.float32) for a in args]


def delta_rule_over_substeps(q, k, v, beta, log_alpha=None, *, form):
    """DeltaProduct as rnnlab's delta rule over T n_h sub-steps: token t's Householder steps j at t n_h + j, its
    gate at j = 0 (0 at the others), its q at the last (0 at the others), its output read there."""
    length, batch, heads, n_h = beta.shape

    def steps(x):  # [T, B, h, n_h, ...] -> [T n_h, B, h, ...]
        return jnp.moveaxis(x, 3, 1).reshape(length * n_h, batch, heads, *x.shape[4:])

    def at(x, j):  # x at sub-step j of each token, 0 at the others: [T n_h, B, h, ...]
        spread = jnp.zeros((length, n_h, *x.shape[1:]), x.dtype).at[:, j].set(x)
        return spread.reshape(length * n_h, *x.shape[1:])

    gate = None if log_alpha is None else at(log_alpha, 0)
    o = form(at(q, n_h - 1), steps(k), steps(v), steps(beta), gate)
    return o[n_h - 1::n_h]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("beta_kind", list(BETAS))
@pytest.mark.parametrize("n_h", [1, 2, 3])
def test_fla_delta_product_is_the_delta_rule_over_substeps(fla, n_h, beta_kind, gated):
    """fla's DeltaProduct reference is the (gated) delta rule over n_h sub-steps a token (module docstring): it
    matches rnnlab's delta_rule_recurrent and delta_rule_chunked run so; n_h = 1 is the plain delta rule."""
    args = product_inputs(11, n_h, beta_kind, gated, seed=n_h)
    names = "q k v beta log_alpha".split()[:len(args)]
    ref = {"naive_recurrent_gated_delta_product": lambda *a: _fla_gated_delta_product(
        *a, *([] if gated else [None]), num_householder=n_h)}
    for form in (functools.partial(delta_rule_recurrent, checkpoint_every=4),
                 functools.partial(delta_rule_chunked, chunk_size=4)):
        assert_twins(functools.partial(delta_rule_over_substeps, form=form), ref, args, names)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("beta_kind", list(BETAS))
@pytest.mark.parametrize("length, chunk", [(5, 8), (16, 4), (37, 8)])
@pytest.mark.parametrize("n_h", [1, 2, 3])
@pytest.mark.parametrize("form", ["recurrent", "chunked", "fused"])
def test_delta_product_matches_fla(fla, form, n_h, length, chunk, beta_kind, gated):
    """rnnlab's DeltaProduct forms against fla's naive_recurrent_gated_delta_product."""
    if form == "recurrent":
        fn = functools.partial(delta_product_recurrent, checkpoint_every=chunk)
    elif form == "fused":
        fn = fused.delta_rule
    else:
        fn = functools.partial(delta_product_chunked, chunk_size=chunk)
    if not gated:
        fn = functools.partial(lambda f, *a: f(*a, None), fn)
    args = product_inputs(length, n_h, beta_kind, gated, seed=length + chunk + n_h)
    ref = {"naive_recurrent_gated_delta_product": lambda *a: _fla_gated_delta_product(
        *a, *([] if gated else [None]), num_householder=n_h)}
    assert_twins(fn, ref, args, "q k v beta log_alpha".split()[:len(args)])
