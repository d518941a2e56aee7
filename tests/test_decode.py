"""Decoding (`rnnlab.decode`): the tokens decoded one at a time from a prefilled state are the greedy tokens
of the training form run over the whole sequence (prompt and decoded tokens), and the logits agree."""

import jax
import numpy as np
import pytest

from conftest import compose_config, fast_first
from rnnlab.decode import decode, prefill
from rnnlab.models import build_model, initial_state

VOCAB = 7


@pytest.mark.parametrize("overrides", fast_first([(tuple(o.split()),) for o in (
    "model=gru", "model=mamba", "model=attention", "model=rwkv7", "model=gated_deltanet", "model=mlstm", "model=slstm",
    "model=attention model.window=5", "model=lru")], why="cross-product"))
def test_decoded_tokens_are_the_training_forms_greedy_tokens(overrides):
    config = compose_config(["hidden_dim=16", "num_layers=2", *overrides])
    model = build_model(config.model, output_dim=VOCAB, input_dim=VOCAB)
    prompt = jax.random.randint(jax.random.key(1), (3, 13), 0, VOCAB)
    params = jax.jit(model.init)(jax.random.key(0), prompt)["params"]  # one program, not one a primitive
    steps = 6
    logits, state = prefill(model, params, prompt, initial_state(model, 3, 13 + steps), segment_len=5)
    tokens, _ = decode(model, params, state, logits[:, -1].argmax(-1), steps)
    # The whole sequence, prompt then the decoded tokens, in the training form: each decoded token after the
    # first is the argmax at the position before it.
    whole = jax.jit(model.apply)({"params": params}, np.concatenate([prompt, tokens], axis=1))
    np.testing.assert_array_equal(tokens[:, 0], whole[:, 12].argmax(-1))
    np.testing.assert_array_equal(tokens[:, 1:], whole[:, 13:-1].argmax(-1))
    np.testing.assert_allclose(logits[:, -1], whole[:, 12], rtol=1e-4, atol=1e-4)
