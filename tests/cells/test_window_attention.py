"""Sliding-window attention (`model.window`): both forms against the float64 NumPy loop with the window's
mask (values, and gradients by directional finite differences), window 0 as full attention, the
blockwise form's block visiting (work and compiled memory linear in T at a fixed window), state size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config
from rnnlab.cells import attention as attention_module
from rnnlab.cells import get_cell
from rnnlab.flops import jaxpr_matmul_flops
from test_attention_mamba import (ATTENTION, B, T, apply_fn, assert_close, assert_forms_agree, f32, get_leaf, inputs,
                                  make_layer, numpy_attention, params_of, with_leaf)

# T=7, blocks of 3: window 1 (the diagonal only), 4 (not a multiple of the block), 5 and 9 (>= T: full).
WINDOWS = [1, 4, 5, 9]


def windowed(window, **fields):
    return {**ATTENTION, **fields, "window": window}


@pytest.mark.parametrize("time_scan", ["parallel", "blockwise"])
@pytest.mark.parametrize("window", WINDOWS)
def test_window_matches_numpy(window, time_scan):
    params, x = params_of("attention"), inputs()
    fields = windowed(window)
    got = jax.jit(apply_fn(make_layer("attention", fields, time_scan=time_scan)))(f32(params), f32(x))
    assert_close(got, numpy_attention(x, params, ATTENTION["num_heads"], window))


@pytest.mark.parametrize("time_scan", ["parallel", "blockwise"])
@pytest.mark.parametrize("window", [1, 4])
def test_window_gradients_match_finite_differences(window, time_scan):
    """jax.grad of sum(out * R) in x, W_xh and W_o along random directions, against central differences
    of the float64 loop with the window."""
    params, x = params_of("attention"), inputs()
    weights = np.random.default_rng(7).normal(size=(B, T, ATTENTION["hidden_dim"]))
    apply = apply_fn(make_layer("attention", windowed(window), time_scan=time_scan))
    loss = lambda p, x: jnp.sum(apply(p, x) * jnp.asarray(weights, jnp.float32))
    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(f32(params), f32(x))
    reference = lambda x, p: np.sum(numpy_attention(x, p, ATTENTION["num_heads"], window) * weights)
    rng, eps = np.random.default_rng(11), 1e-5
    for path in [None, ("W_xh",), ("cell", "W_o")]:
        value = x if path is None else get_leaf(params, path)
        grad = np.asarray(g_x if path is None else get_leaf(g_params, path), np.float64)
        f = (lambda v: reference(v, params)) if path is None else (lambda v, path=path: reference(x, with_leaf(params, path, v)))
        direction = rng.normal(size=value.shape)
        fd = (f(value + eps * direction) - f(value - eps * direction)) / (2 * eps)
        ad = np.sum(grad * direction)
        assert abs(ad - fd) <= 2e-5 * np.linalg.norm(grad) * np.linalg.norm(direction), (path, ad, fd)


@pytest.mark.slow("long")
@pytest.mark.parametrize("window", [2, 4])
def test_window_forms_agree_values_and_gradients(window):
    """blockwise (blocks of 3, 2 and 1) against parallel, every parameter's gradient and x's."""
    params, x = f32(params_of("attention")), f32(inputs())
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, ATTENTION["hidden_dim"])), jnp.float32)
    layers = [make_layer("attention", windowed(window, block_size=block), time_scan=time_scan)
              for time_scan, block in [("parallel", 3), ("blockwise", 3), ("blockwise", 2), ("blockwise", 1)]]
    assert_forms_agree(layers, params, x, weights)


@pytest.mark.parametrize("time_scan", ["parallel", "blockwise"])
def test_a_window_of_the_whole_sequence_is_full_attention_bit_for_bit(time_scan):
    """window 0 and a window >= T mask nothing more than causality: the same values and gradients exactly."""
    params, x = f32(params_of("attention")), f32(inputs())
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, ATTENTION["hidden_dim"])), jnp.float32)

    applies = [apply_fn(make_layer("attention", windowed(w), time_scan=time_scan)) for w in (0, T, 3 * T)]

    @jax.jit
    def run(params, x):
        return [jax.value_and_grad(lambda p, x, f=f: jnp.sum(f(p, x) * weights), argnums=(0, 1))(params, x)
                for f in applies]

    (want, *others) = (jax.tree_util.tree_leaves(r) for r in run(params, x))
    for got in others:
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("num_blocks, window, block, pairs", [
    (8, 0, 4, 36),  # full: the lower triangle and the diagonal, N (N + 1) / 2
    (8, 1, 4, 8),  # the diagonal alone
    (8, 4, 4, 15),  # key blocks i - 1, i (from the second on)
    (8, 5, 4, 15),  # t - 4 is still in block i - 1
    (8, 6, 4, 21),  # t - 5 reaches block i - 2 for the first query of a block
    (3, 100, 4, 6),  # a window past the start: all blocks up to the diagonal
])
def test_blocks_visited(num_blocks, window, block, pairs):
    span = attention_module.key_blocks_per_query(window, block, num_blocks)
    i, j, first = attention_module.block_pairs(num_blocks, span)
    assert len(i) == pairs == attention_module.num_block_pairs(num_blocks * block, block, window)[1]
    assert np.all(j <= i)
    if window:  # each visited key block holds a key that the block's first query sees; the one before it holds none
        assert np.all(j * block + block - 1 > i * block - window)
        assert np.all((j == 0) | ((j - 1) * block + block - 1 <= i * block - window) | ~first.astype(bool))
    assert list(np.flatnonzero(first)) == [np.flatnonzero(i == r)[0] for r in range(num_blocks)]  # rows open in order
    by_key = attention_module.block_pairs(num_blocks, span, by_key=True)
    assert sorted(zip(*by_key[:2])) == sorted(zip(i, j)) and np.all(np.diff(by_key[1]) >= 0)


def blockwise_grad(length, window, block=64, batch=2, heads=2, d=16):
    """The blockwise form's gradient function at `length`, and its arguments' shapes."""
    x = jax.ShapeDtypeStruct((length, batch, heads, d), jnp.float32)
    f = jax.grad(lambda q, k, v: jnp.sum(attention_module.blockwise_attention(q, k, v, block, window) ** 2),
                 argnums=(0, 1, 2))
    return f, (x, x, x)


def test_blockwise_work_is_linear_in_length_at_a_fixed_window_and_about_half_the_square_without():
    """The traced matmuls of forward and backward: doubling T doubles them with a window of 64 (blocks of 64),
    and nearly quadruples them without (the triangle of N (N + 1) / 2 block pairs, not N^2)."""
    flops = {}
    for t in (512, 1024):
        for w in (0, 64):
            f, args = blockwise_grad(t, w)
            flops[t, w] = jaxpr_matmul_flops(f, *args)
    pair = 7 * 2 * 2 * 64 * 64 * 2 * 16  # per block pair, batch 2, heads 2: 2 products of [64, 64] x [64, d] forward, 5 backward
    assert flops[512, 64] == (8 + 7) * pair and flops[1024, 64] == (16 + 15) * pair
    assert flops[512, 0] == 8 * 9 // 2 * pair and flops[1024, 0] == 16 * 17 // 2 * pair


@pytest.mark.slow("long")
def test_blockwise_compiled_memory_is_linear_in_length_at_a_fixed_window():
    """XLA's temp bytes of forward and backward at T=512 and 1024 (blocks of 64, window 64): about twice,
    not four times (measured 442656 and 852256 bytes: 1.93)."""
    temp = [jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes
            for f, args in (blockwise_grad(t, 64) for t in (512, 1024))]
    assert 1.5 < temp[1] / temp[0] < 2.5, temp


def test_state_floats_counts_the_window():
    """Zoology's count per layer and example: attention 2 T H, a window 2 min(T, w) H."""
    cell = get_cell("attention")
    assert cell(hidden_dim=8, window=0).state_floats(100) == 2 * 100 * 8
    assert cell(hidden_dim=8, window=16).state_floats(100) == 2 * 16 * 8
    assert cell(hidden_dim=8, window=160).state_floats(100) == 2 * 100 * 8


def test_window_is_a_config_key():
    assert compose_config(["model=attention"]).model.make_cell().window == 0
    assert compose_config(["model=attention", "model.window=8"]).model.make_cell().window == 8

