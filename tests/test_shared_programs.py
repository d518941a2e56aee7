"""tests/shared_programs.py: the suite's processes compile each distinct program once, and only an identical
program (constants, options and devices included) is ever given an executable compiled for another."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shared_programs

pytestmark = pytest.mark.skipif(os.environ.get("RNNLAB_TEST_SHARE_PROGRAMS") == "0",
                                reason="RNNLAB_TEST_SHARE_PROGRAMS=0: turned off for this run")
# A constant new to each run: the programs here are new to JAX's in-memory caches of other tests too.
FRESH = float(np.random.default_rng().uniform(1.0, 2.0))


@pytest.fixture(autouse=True)
def no_persistent_cache(monkeypatch):
    """A program found in JAX's persistent compilation cache (the suite's, RNNLAB_TEST_COMPILE_CACHE) is never
    compiled: the counts below would not move."""
    from jax._src import compilation_cache

    monkeypatch.setattr(compilation_cache, "is_cache_used", lambda backend: False)


def counts():
    return dict(shared_programs.stats)


def test_the_suite_shares_programs():
    from jax._src import compiler

    assert getattr(compiler.backend_compile_and_load, "shares_programs", False)


def test_the_same_program_built_twice_compiles_once_and_computes_as_compiled():
    x = jnp.arange(6.0).reshape(2, 3)

    def build():  # a new Python function each time, as each in-process run builds its steps
        return jax.jit(lambda v: jnp.tanh(v * FRESH + 0.25).sum(0))

    before = counts()
    first = build()(x)
    middle = counts()
    second = build()(x)
    after = counts()
    assert middle["compiled"] == before["compiled"] + 1 and after == {**middle, "shared": middle["shared"] + 1}
    np.testing.assert_allclose(second, np.tanh(np.arange(6.0).reshape(2, 3) * FRESH + 0.25).sum(0), rtol=1e-6)
    np.testing.assert_array_equal(first, second)


def test_programs_that_differ_in_a_constant_options_or_devices_compile_apart():
    x = jnp.ones(4096, jnp.float32)
    base = np.arange(4096, dtype=np.float32) * np.float32(FRESH)
    changed = base.copy()
    changed[-1] += 1  # the last element of a large constant: a printer that elided it would merge the two
    a, b = jax.jit(lambda v: v + base)(x), jax.jit(lambda v: v + changed)(x)
    assert float(b[-1] - a[-1]) == 1.0
    before = counts()
    optimizations_off = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", not optimizations_off)  # XLA's debug options change
    try:
        jax.jit(lambda v: v + base)(x).block_until_ready()
    finally:
        jax.config.update("jax_disable_most_optimizations", optimizations_off)
    on_device_1 = jax.jit(lambda v: v + base)(jax.device_put(x, jax.devices()[1]))
    assert on_device_1.devices() == {jax.devices()[1]}
    assert counts()["compiled"] == before["compiled"] + 2 and counts()["shared"] == before["shared"]


def test_a_program_that_calls_back_into_python_is_never_shared():
    seen = []

    def build(tag):
        def f(v):
            jax.debug.callback(lambda: seen.append(tag))
            return v + 1

        return jax.jit(f)

    before = counts()
    build("first")(jnp.ones(2)).block_until_ready()
    build("second")(jnp.ones(2)).block_until_ready()
    jax.effects_barrier()
    assert seen == ["first", "second"] and counts()["shared"] == before["shared"]
