"""rnnlab.fused: the fused CPU kernels of the delta rule (DeltaNet, gated DeltaNet, DeltaProduct), of gated linear
attention (GLA, linear attention, Mamba-2), of the DPLR delta rule (RWKV-7) and Mamba's selective scan against the
JAX forms (itself checked against NumPy in test_matrix_forms and test_negative_eigenvalues): values, the
final state and the gradients of every input, state in and out, at lengths that are and are not multiples of the
kernel's checkpoint block; a model run with `model.time_scan=fused`; `auto`'s choice; the refusals."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config, fast_first
from rnnlab import fused, models, native_build
from rnnlab.cells.delta_product_forms import delta_product_recurrent
from rnnlab.cells.delta_rule_forms import delta_rule_recurrent
from rnnlab.cells.dplr_forms import dplr_recurrent
from rnnlab.cells.gla_forms import gla_recurrent
from rnnlab.cells.mamba import selective_ssm
from rnnlab.config import ConfigError

B, H, DK, DV = 2, 3, 8, 4


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def inputs(length, n=None, gated=True, top=2.0, seed=0):
    """q, k, v, beta, log_alpha (None where not gated), s0; beta in (0, top), a third near top (top = 2: the
    transition's eigenvalue along k near -1)."""
    rng = np.random.default_rng(seed)
    sub = () if n is None else (n,)
    beta = np.where(rng.random((length, B, H, *sub)) < 1 / 3, rng.uniform(top - 0.1, top - 0.02, (length, B, H, *sub)),
                    rng.uniform(0.05, top - 0.05, (length, B, H, *sub)))
    arrays = [unit(rng.normal(size=(length, B, H, DK))), unit(rng.normal(size=(length, B, H, *sub, DK))),
              rng.normal(size=(length, B, H, *sub, DV)), beta,
              rng.uniform(-2, 0, (length, B, H)) if gated else None, rng.normal(size=(B, H, DK, DV))]
    return [None if a is None else jnp.asarray(a, jnp.float32) for a in arrays]


def weighted(form):
    """A scalar of a form's outputs and final state, for gradients of every input."""
    def loss(*args):
        o, s = form(*args)
        shape_o, shape_s = o.shape, s.shape
        return (jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(shape_o)))
                + jnp.sum(s * jnp.sin(jnp.arange(s.size, dtype=jnp.float32).reshape(shape_s))))
    return loss


# The JAX references' checkpoint interval changes no value: one block of the whole sequence compiles fastest.
WHOLE = 64


def reference(n):
    if n is None:
        return lambda q, k, v, beta, la, s0: delta_rule_recurrent(q, k, v, beta, la, WHOLE, s0)
    return lambda q, k, v, beta, la, s0: delta_product_recurrent(q, k, v, beta, la, WHOLE, s0)


# (length, n sub-steps (None: the delta rule), gated): lengths around the kernel's block of 16 tokens.
# The fast tier: DeltaProduct's two sub-steps a token with the gate over a block and a part (the delta rule is its
# n = 1); the rest in the full tier.
CASES = [(21, 2, True), (37, None, True), (16, None, False), (1, 3, True), (33, 3, False), (48, None, True)]


@pytest.mark.parametrize("length, n, gated", fast_first(CASES, why="cross-product"))
def test_the_kernel_has_the_sequential_forms_values_state_and_gradients(length, n, gated):
    args = inputs(length, n, gated)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    theirs, ours = reference(n), fused.delta_rule
    (o_ref, s_ref), (o, s) = jax.jit(theirs)(*args), jax.jit(lambda *a: ours(*a[:5], state=a[5]))(*args)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, rtol=2e-5, atol=2e-5)
    grads_ref = jax.jit(jax.grad(weighted(theirs), argnums))(*args)
    grads = jax.jit(jax.grad(weighted(lambda *a: ours(*a[:5], state=a[5])), argnums))(*args)
    for name, got, want in zip([("q", "k", "v", "beta", "log_alpha", "s0")[i] for i in argnums], grads, grads_ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)
    # Without a state: from zeros, the outputs alone.
    o_zero = jax.jit(lambda *a: ours(*a))(*args[:5])
    np.testing.assert_allclose(o_zero, theirs(*args[:5], jnp.zeros_like(args[5]))[0], rtol=2e-5, atol=2e-5)


# (model, its overrides): one model in the fast tier (the kernels themselves: the tests above), every cell with a
# fused form in the full tier.
MODELS = [("mamba2", ["num_layers=1", "model.head_dim=8", "model.state_size=4", "model.allow_neg_eigval=true"]),
          ("gated_deltanet", ["num_layers=1", "model.num_heads=2", "model.allow_neg_eigval=true"]),
          ("deltanet", ["model.num_heads=2"]), ("deltaproduct", ["model.num_heads=2", "model.allow_neg_eigval=true"]),
          ("gla", ["model.num_heads=2"]), ("linear_attention", ["model.num_heads=2"]),
          ("mamba2", ["model.head_dim=8", "model.state_size=4"]), ("rwkv7", ["model.num_heads=2"]),
          ("rwkv7", ["model.num_heads=2", "model.allow_neg_eigval=true"]), ("mamba", ["model.state_size=4"]),
          ("mamba", ["model.state_size=4", "model.allow_neg_eigval=true"]), ("mlstm", ["model.num_heads=2"])]


@pytest.mark.parametrize("model, overrides", fast_first(MODELS, why="cross-product"),
                         ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_a_model_run_fused_equals_the_sequential_form(model, overrides):
    """The whole model (its convolution, gates, norms and readout around the kernel), in values and parameter
    gradients."""
    results = {}
    for form in ("sequential", "fused"):
        config = compose_config([f"model={model}", f"model.time_scan={form}", "hidden_dim=16", "num_layers=2",
                                 "model.chunk_size=8", *overrides])
        net = models.build_model(config.model, output_dim=3, input_dim=5)
        x = jax.random.randint(jax.random.key(1), (2, 19), 0, 5)
        params = net.init(jax.random.key(0), x)["params"]
        results[form] = jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(net.apply({"params": p}, x)))))(params)
    (value, grads), (value_ref, grads_ref) = results["fused"], results["sequential"]
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_ref)):
        # float32 sums over 19 steps and 2 layers: an entry near 0 beside entries near 30 is off by their scale's
        # rounding (3.2e-4 at 1.0 beside 28.8 on a 2-core AMD EPYC VM), so the absolute tolerance scales with the leaf
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * scale)


# (length, per head: one transition per head and one q, k group shared by the heads, as Mamba-2's) around the block.
GLA_CASES = [(21, True), (37, False), (16, False), (1, True)]


@pytest.mark.parametrize("length, per_head", fast_first(GLA_CASES, why="cross-product"))
def test_the_gated_linear_kernel_has_the_sequential_forms_values_state_and_gradients(length, per_head):
    rng = np.random.default_rng(length)
    group = 1 if per_head else H
    q, k = (jnp.asarray(rng.normal(size=(length, B, group, DK)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(length, B, H, DV)), jnp.float32)
    log_alpha = jnp.asarray(rng.uniform(-2, 0, (length, B, H) if per_head else (length, B, H, DK)), jnp.float32)
    s0 = jnp.asarray(rng.normal(size=(B, H, DK, DV)), jnp.float32)
    shape = (length, B, H, DK)

    def theirs(q, k, v, la, s0):
        la = jnp.broadcast_to(la[..., None], shape) if per_head else la
        return gla_recurrent(jnp.broadcast_to(q, shape), jnp.broadcast_to(k, shape), v, la, WHOLE, state=s0)

    def ours(q, k, v, la, s0):
        return fused.gated_linear(q, k, v, jnp.exp(la), s0)

    args = (q, k, v, log_alpha, s0)
    for got, want in zip(jax.jit(ours)(*args), jax.jit(theirs)(*args)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    grads = jax.jit(jax.grad(weighted(ours), range(5)))(*args)
    for name, got, want in zip(("q", "k", "v", "log_alpha", "s0"), grads,
                               jax.jit(jax.grad(weighted(theirs), range(5)))(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("length", fast_first([21, 16, 1], why="cross-product"))
def test_the_dplr_kernel_has_the_sequential_forms_values_state_and_gradients(length):
    """RWKV-7's arguments: a = -kappa, b = kappa * iclr with iclr up to 2 (its eigenvalues reach -1)."""
    rng = np.random.default_rng(length)
    kappa = unit(rng.normal(size=(length, B, H, DK)))
    args = [jnp.asarray(x, jnp.float32) for x in (
        rng.normal(size=(length, B, H, DK)), rng.normal(size=(length, B, H, DK)), rng.normal(size=(length, B, H, DK)),
        -kappa, kappa * rng.uniform(0, 2, (length, B, H, DK)), rng.uniform(-1, 0, (length, B, H, DK)),
        rng.normal(size=(B, H, DK, DK)))]

    def theirs(*a):
        return dplr_recurrent(*a[:6], WHOLE, state=a[6])

    def ours(*a):
        return fused.dplr(*a[:6], state=a[6])

    for got, want in zip(jax.jit(ours)(*args), jax.jit(theirs)(*args)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    grads = jax.jit(jax.grad(weighted(ours), range(7)))(*args)
    for name, got, want in zip(("q", "k", "v", "a", "b", "log_w", "s0"), grads,
                               jax.jit(jax.grad(weighted(theirs), range(7)))(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("length, negative", fast_first([(21, True), (16, False), (1, False)], why="cross-product"))
def test_the_selective_scan_kernel_has_the_sequential_forms_values_state_and_gradients(length, negative):
    """Mamba's `selective_ssm` (hand-written backward, itself against NumPy and autodiff in test_attention_mamba)."""
    rng = np.random.default_rng(length)
    d, n = 6, 4
    args = [jnp.asarray(x, jnp.float32) for x in (
        rng.uniform(0.01, 0.5, (length, B, d)), rng.normal(size=(length, B, d)), rng.normal(size=(length, B, n)),
        rng.normal(size=(length, B, n)), -rng.uniform(0.5, 3, (d, n)), rng.normal(size=(B, d, n)))]

    def theirs(*a):
        return selective_ssm(*a, negative)

    def ours(*a):
        return fused.selective_scan(*a, negative)

    for got, want in zip(jax.jit(ours)(*args), jax.jit(theirs)(*args)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    grads = jax.jit(jax.grad(weighted(ours), range(6)))(*args)
    for name, got, want in zip(("delta", "x", "b", "c", "a", "h0"), grads,
                               jax.jit(jax.grad(weighted(theirs), range(6)))(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_bfloat16_inputs_run_in_float32_and_come_back_in_bfloat16():
    q, k, v, beta, log_alpha, s0 = inputs(9)
    o = fused.delta_rule(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), beta, log_alpha)
    assert o.dtype == jnp.bfloat16
    want = delta_rule_recurrent(*(a.astype(jnp.bfloat16).astype(jnp.float32) for a in (q, k, v)), beta, log_alpha, WHOLE)
    np.testing.assert_allclose(o.astype(jnp.float32), want, rtol=2e-2, atol=2e-2)


def test_auto_runs_the_kernel_on_a_cpu_and_the_jax_forms_elsewhere_or_without_it(monkeypatch, caplog):
    assert fused.available() == (True, "")  # CI builds it: a test skipped where it cannot tests nothing
    assert models.resolve_form("auto", "deltaproduct", "cpu") == "fused"
    assert models.resolve_form("auto", "deltanet", "gpu") == "auto"
    assert models.resolve_form("auto", "mlstm", "cpu") == "auto"  # its step measured slower fused
    assert models.resolve_form("auto", "mamba2", "cpu") == "auto"  # its step measured slower fused
    assert models.resolve_form("fused", "mamba2", "cpu") == "fused"
    assert models.resolve_form("chunked", "deltanet", "cpu") == "chunked"
    with pytest.raises(ConfigError) as info:  # device.platform=auto found an accelerator: refused at build time
        models.resolve_form("fused", "deltanet", "gpu")
    assert str(info.value) == ("key 'model.time_scan': got 'fused', a CPU kernel, but the platform is gpu; allowed: "
                               "auto, sequential, chunked (cell 'deltanet')")
    monkeypatch.setattr(fused, "available", lambda: (False, "no C++ compiler (g++) on PATH"))
    models._notice_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger=models.log.name):
        assert models.resolve_form("auto", "gated_deltanet", "cpu") == "auto"
        assert models.resolve_form("auto", "gated_deltanet", "cpu") == "auto"
    assert [r.getMessage() for r in caplog.records] == [
        "model.time_scan=auto: no C++ compiler (g++) on PATH; running the JAX forms instead of the fused kernel"]


def test_fused_by_name_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    with pytest.raises(ConfigError) as info:
        compose_config(["model=deltanet", "model.time_scan=fused", "device.platform=gpu"])
    assert str(info.value) == ("key 'model.time_scan': got 'fused', a CPU kernel, but the platform is gpu; allowed: "
                               "auto, sequential, chunked (cell 'deltanet')")
    monkeypatch.setattr(fused, "available", lambda: (False, "no C++ compiler (g++) on PATH"))
    with pytest.raises(ConfigError) as info:
        compose_config(["model=deltaproduct", "model.time_scan=fused"])
    assert str(info.value) == ("key 'model.time_scan': got 'fused', but its kernel cannot be built here (no C++ "
                               "compiler (g++) on PATH); allowed: auto, sequential, chunked")
    with pytest.raises(ConfigError, match=r"^key 'model.pattern_keys.gated_deltanet.time_scan': got 'fused'"):
        compose_config(["model=attention", "model.pattern=[attention,gated_deltanet]", "num_layers=2",
                        "+model.pattern_keys.gated_deltanet.time_scan=fused"])


def test_a_kernel_that_cannot_compile_says_why_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="^compiling delta_rule.cc failed"):
        native_build.build(fused.SOURCE, fused.FLAGS)
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize("model", ["deltanet", "gated_deltanet", "gla", "linear_attention", "mamba2", "rwkv7", "mlstm"])
def test_the_fused_forms_flops_are_the_sequential_forms_where_they_do_the_same_steps(model):
    """A length that is a whole number of the sequential form's blocks (no padded steps): the fused kernel runs the
    same steps, so its FLOPs (each cell's own `fused` formula) equal the sequential form's, forward and recomputed."""
    config = compose_config([f"model={model}", "hidden_dim=32", "model.chunk_size=8"])
    cell = config.model.make_cell()
    for length in (8, 32):
        assert cell.mixing_flops(length, "fused") == cell.mixing_flops(length, "sequential") > 0
        assert cell.mixing_recompute_flops(length, "fused") == cell.mixing_recompute_flops(length, "sequential") > 0


def test_deltaproducts_fused_flops_leave_out_the_reads_the_interleaved_form_throws_away():
    """The sequential form runs n_h interleaved delta-rule steps a token, each reading q S (2 d^2 a head), of which
    n_h - 1 are thrown away; the kernel reads once a token."""
    config = compose_config(["model=deltaproduct", "hidden_dim=32", "model.num_heads=2", "model.num_householder=3",
                             "model.chunk_size=6"])
    cell, heads, d, n, length = config.model.make_cell(), 2, 16, 3, 10
    wasted = heads * length * (n - 1) * 2 * d * d
    assert cell.mixing_flops(length, "fused") == cell.mixing_flops(length, "sequential") - wasted
    assert cell.mixing_recompute_flops(length, "fused") == cell.mixing_recompute_flops(length, "sequential")
