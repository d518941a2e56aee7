"""Every model as an RNN: a sequence cut into segments of any lengths, each run from the state the one
before returned (`RecurrentModel(..., state=)`, `models.initial_state`), gives the outputs of the whole
sequence run at once, for every cell in every form that carries a state, in its paper's block, and for
the hybrids; a zero state is no state. The fast tier runs one cell of each kind of state in its default form;
the full tier every cell in every form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config, fast_first
from rnnlab import cells
from rnnlab.models import build_model, initial_state

from test_fuzz_config import group_options  # noqa: E402

B, T, H = 2, 23, 8
# A lone step and a chunk and more (7 = 4 + 3 with SMALL's chunk and block of 4), so that segments start and end
# inside a chunk; two segment lengths, so two programs besides the whole sequence's (each one is a compile).
CUTS = (1, 7, 7, 1, 7)


# The fast tier: one cell of each kind of state, in its yaml's own form (a carry; a linear recurrence's h; an SSM's
# state and conv tail; a matrix state; mLSTM's (C, n, m); RWKV-7's state and token shift). Attention's cache:
# tests/test_attention_cache.py.
FAST = ("lstm", "lru", "mamba", "deltanet", "mlstm", "rwkv7")


def cell_forms():
    """(model config, form) for every cell's yaml and each form of its cell that carries a state; `FAST`'s
    own forms in the fast tier, the rest in the full tier."""
    cases = []
    for model in group_options("model"):
        m = compose_config([f"model={model}"]).model
        cell = cells.get_cell(m.cell)(1)
        forms = [f for f in (m.time_scan, *cell.time_scans) if cell.carries_state(f)]
        for i, form in enumerate(dict.fromkeys(forms)):
            fast = i == 0 and model in FAST
            cases.append(pytest.param(model, form, id=f"{model}-{form}", marks=() if fast else pytest.mark.slow))
    return cases


SMALL = {"model.chunk_size": 4, "model.block_size": 4}  # several chunks and blocks within a segment


def small_overrides(model: str) -> list[str]:
    m = compose_config([f"model={model}"]).model
    fields = cells.get_cell(m.cell).__dataclass_fields__
    return [f"{key}={value}" for key, value in SMALL.items() if key.split(".")[1] in fields]


def run_segments(model, params, x, cuts, cache_len):
    state = initial_state(model, x.shape[0], cache_len)
    ys, start = [], 0
    apply = jax.jit(model.apply)  # one program a segment length, not one a primitive
    for length in cuts:
        y, state = apply({"params": params}, x[:, start:start + length], state=state)
        ys.append(y)
        start += length
    return jnp.concatenate(ys, axis=1), state


def check_segments(overrides, cuts=CUTS, tokens=True, rtol=2e-5, atol=2e-5):
    config = compose_config([f"hidden_dim={H}", "num_layers=2", *overrides])
    model = build_model(config.model, output_dim=3, input_dim=5 if tokens else None)
    length = sum(cuts)
    x = (jax.random.randint(jax.random.key(1), (B, length), 0, 5) if tokens
         else jax.random.normal(jax.random.key(1), (B, length, 5)))
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    whole = jax.jit(model.apply)({"params": params}, x)
    got, state = run_segments(model, params, x, cuts, length)
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole), rtol=rtol, atol=atol)
    # The whole sequence from the zero state: its outputs and the state the segments ended in.
    y0, state0 = jax.jit(model.apply)({"params": params}, x, state=initial_state(model, B, length))
    np.testing.assert_allclose(np.asarray(y0), np.asarray(whole), rtol=rtol, atol=atol)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4),
                           state, state0)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(initial_state(model, B, length))
    return config


@pytest.mark.parametrize("model,form", cell_forms())
def test_segments_with_the_state_carried_equal_the_whole_sequence(model, form):
    check_segments([f"model={model}", f"model.time_scan={form}", *small_overrides(model)])


@pytest.mark.parametrize("model", fast_first(["rnn", "lstm", "mamba"]))
def test_segments_of_float_inputs_and_unstacked_layers(model):
    check_segments([f"model={model}", "model.scan_layers=false", "num_layers=3", *small_overrides(model)],
                   tokens=False)


@pytest.mark.slow  # the layers' states in a hybrid's groups; each cell's own: the fast tier above
@pytest.mark.parametrize("pattern", ["[gated_deltanet,attention]", "[mamba,mlstm,slstm]", "[rwkv7,lstm]"])
def test_segments_of_a_hybrid(pattern):
    first = pattern.strip("[]").split(",")[0]
    check_segments([f"model={first}", f"model.pattern={pattern}", "num_layers=" + str(2 * len(pattern.split(",")))])


def test_one_step_at_a_time_equals_the_whole_sequence():
    """Decoding's step: T segments of one step each."""
    check_segments(["model=gru"], cuts=(1,) * 9)
