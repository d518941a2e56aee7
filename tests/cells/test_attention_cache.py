"""Attention as an RNN, beyond tests/cells/test_carried_state.py: with a sliding window the cache is a ring buffer of
exactly w slots (segments longer and shorter than the window), and a cache much longer than the sequence
is read in many blocks (empty slots masked, a last block not whole)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config, fast_first
from rnnlab.models import build_model, initial_state
from test_carried_state import run_segments

B, H = 2, 8


def check(overrides, cuts, cache_len):
    config = compose_config([f"hidden_dim={H}", "num_layers=2", "model=attention", *overrides])
    model = build_model(config.model, output_dim=3, input_dim=5)
    x = jax.random.randint(jax.random.key(1), (B, sum(cuts)), 0, 5)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    whole = jax.jit(model.apply)({"params": params}, x)
    got, state = run_segments(model, params, x, cuts, cache_len)
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole), rtol=2e-5, atol=2e-5)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(initial_state(model, B, cache_len))
    return state


@pytest.mark.parametrize("time_scan", fast_first(["blockwise", "parallel"], why="cross-product", first_why="long"))
def test_window_ring_buffer_of_w_slots(time_scan):
    # w = 5 slots in blocks of 4 (the last block overlaps); segments of 1 to 9 steps, past the ring's end
    state = check([f"model.time_scan={time_scan}", "model.window=5", "model.block_size=4"], (1, 7, 3, 9, 2, 5), 27)
    cache = state["layer_0"]["mixer"]
    assert cache["k"].shape == (B, 5, 4, H // 4) and cache["v"].shape == cache["k"].shape
    np.testing.assert_array_equal(np.asarray(cache["pos"]), [27, 27])


@pytest.mark.slow("long")
def test_long_cache_in_blocks():
    # 64 slots in blocks of 4, 35 of them filled; the segments' own blocks not whole either
    state = check(["model.block_size=4"], (5, 9, 1, 20), 64)
    assert state["layer_0"]["mixer"]["k"].shape == (B, 64, 4, H // 4)
    assert state["layer_0"]["mixer"]["pos"].dtype == jnp.int32
