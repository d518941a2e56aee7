"""A trained model as a generator: prefill a prompt with the training forms, then decode one token at a
time from the state, in one compiled loop (no Python per token).

    state = initial_state(model, batch, cache_len=P + N)     # cache_len: attention's cache; recurrences ignore it
    logits, state = prefill(model, params, prompt, state)     # prompt int32[B, P]
    tokens, state = decode(model, params, state, logits[:, -1].argmax(-1), N)   # greedy, int32[B, N]
    first = choose(logits[:, -1], key, temperature, top_k)                   # or sampled:
    tokens, state = sample(model, params, state, first, N, key2, temperature, top_k)

The prompt runs in segments of at most `segment_len` steps (the form `model.time_scan=auto` picks for that
length), so its memory does not grow with P; each decoded token is a segment of one step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from rnnlab.models import RecurrentModel

PREFILL_SEGMENT = 4096  # steps per prefill segment


def prefill(model: RecurrentModel, params: Any, prompt: jax.Array, state: Any,
            segment_len: int = PREFILL_SEGMENT) -> tuple[jax.Array, Any]:
    """prompt int32[B, P] (token ids) from `state` -> (the last segment's logits f32[B, <= segment_len, V], the
    state after the prompt). Each segment length compiles once (`_segment`)."""
    logits = None
    for start in range(0, prompt.shape[1], segment_len):
        logits, state = _segment(model, params, prompt[:, start:start + segment_len], state)
    return logits, state


@functools.partial(jax.jit, static_argnums=0)
def _segment(model: RecurrentModel, params: Any, tokens: jax.Array, state: Any) -> tuple[jax.Array, Any]:
    return model.apply({"params": params}, tokens, state=state)


@functools.partial(jax.jit, static_argnums=(0, 4))
def decode(model: RecurrentModel, params: Any, state: Any, first: jax.Array, steps: int) -> tuple[jax.Array, Any]:
    """Greedy decoding: `first` int32[B] is fed at the next position, then each step's argmax -> (the `steps`
    tokens fed, int32[B, steps], first included; the state after them). One `lax.scan`: compiled once per
    `steps`, nothing returns to the host until the end."""

    def step(carry, _):
        state, token = carry
        logits, state = model.apply({"params": params}, token[:, None], state=state)
        return (state, jnp.argmax(logits[:, -1], axis=-1).astype(token.dtype)), token

    (state, _), tokens = jax.lax.scan(step, (state, first.astype(jnp.int32)), None, length=steps)
    return jnp.swapaxes(tokens, 0, 1), state


def choose(logits: jax.Array, key: jax.Array, temperature: Any, top_k: int = 0) -> jax.Array:
    """A token per row of `logits` f32[B, V]: drawn from softmax(logits / temperature), among the `top_k` most
    likely only (0: all of them); temperature 0: the argmax (greedy). int32[B]."""
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    temperature = jnp.asarray(temperature, jnp.float32)
    drawn = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 4, 7))
def sample(model: RecurrentModel, params: Any, state: Any, first: jax.Array, steps: int, key: jax.Array,
           temperature: Any = 1.0, top_k: int = 0) -> tuple[jax.Array, Any]:
    """As `decode`, each next token drawn (`choose`: `temperature`, traced; `top_k`, static) with its own key
    of `key` -> (the `steps` tokens fed, int32[B, steps], first included; the state after them)."""

    def step(carry, key):
        state, token = carry
        logits, state = model.apply({"params": params}, token[:, None], state=state)
        return (state, choose(logits[:, -1], key, temperature, top_k)), token

    (state, _), tokens = jax.lax.scan(step, (state, first.astype(jnp.int32)), jax.random.split(key, steps))
    return jnp.swapaxes(tokens, 0, 1), state
