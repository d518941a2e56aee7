"""Every model as an RNN: a sequence cut into segments of any lengths, each run from the state the one
before returned (`RecurrentModel(..., state=)`, `models.initial_state`), gives the outputs of the whole
sequence run at once, for every cell in every form that carries a state, in its paper's block, and for
the hybrids; a zero state is no state. The fast tier runs one cell of each kind of state in its default form;
the full tier every cell in every form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, compose_config, fast_first
from rnnlab import cells, models
from rnnlab.models import build_model, initial_state

from test_fuzz_config import group_options  # noqa: E402

B, T, H = 2, 23, 8
# A lone step and a chunk and more (7 = 4 + 3 with SMALL's chunk and block of 4), so that segments start and end
# inside a chunk; two segment lengths, so two programs besides the whole sequence's (each one is a compile).
CUTS = (1, 7, 7, 1, 7)


# The fast tier: a vector state (lstm's carry) and a matrix state across chunks and segments (deltanet's chunked
# form); every cell's each form that carries a state, in the full tier. Attention's cache:
# tests/cells/test_attention_cache.py.
FAST_CASES = {("lstm", "sequential"), ("deltanet", "chunked")}


def auto_resolves_to(cell, cuts=CUTS):
    """The forms `model.time_scan=auto` runs in `check_segments`, as the layer resolves it
    (`Cell.resolve_time_scan`, called by `models.RecurrentLayer` with T and whether a state is carried): each
    segment's length with a state, the whole sequence's without one and from the zero state."""
    whole = sum(cuts)
    return {cell.resolve_time_scan("auto", t, stateful) for t, stateful in [*((c, True) for c in cuts), (whole, False),
                                                                             (whole, True)]}


def cell_forms():
    """(model config, form) for every cell's yaml and each form of its cell that carries a state; the cases
    of `FAST_CASES` in the fast tier, the rest in the full tier. An `auto` that resolves to one form at every length
    `check_segments` runs is that form's case again, the same programs: left out
    (test_the_auto_cases_left_out_are_their_forms_cases)."""
    cases = []
    for model in group_options("model"):
        cell_name, time_scan = yaml_cell_and_form(model)
        cell = cells.get_cell(cell_name)(1)
        forms = list(dict.fromkeys(f for f in (time_scan, *cell.time_scans) if cell.carries_state(f)))
        for i, form in enumerate(forms):
            if form == "auto" and len(resolved := auto_resolves_to(cell)) == 1 and resolved <= set(forms):
                continue
            marks = () if (model, form) in FAST_CASES else pytest.mark.slow("cross-product")
            cases.append(pytest.param(model, form, id=f"{model}-{form}", marks=marks))
    return cases


def yaml_cell_and_form(model):
    """conf/model/<model>.yaml's own `cell` and `time_scan` (None where it sets none), read without composing: each
    process collects this module, and Hydra's 18 compositions made a third of the suite's collection time.
    test_the_auto_cases_left_out_are_their_forms_cases holds them to the composed configs."""
    import yaml

    own = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    return own["cell"], own.get("time_scan")


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


# The yamls whose `auto` resolves to one form at every length `check_segments` runs, and that form.
AUTO_IS = {"deltanet": "sequential", "gated_deltanet": "sequential", "deltaproduct": "sequential",
           "rwkv7": "sequential", "mlstm": "parallel", "gla": "chunked", "linear_attention": "chunked",
           "mamba2": "chunked", "mamba": "chunked"}


def test_the_auto_cases_left_out_are_their_forms_cases():
    """`AUTO_IS`'s cells run one form for `auto` at every length of `check_segments`, with a state and without: their
    `-auto` cases would repeat that form's, so `cell_forms` leaves them out. The layer builds the program of the form
    `auto` resolves to (tests/cells/test_auto_form.py, without a state); here, one segment with a state carried."""
    ids = {case.id for case in cell_forms()}
    yamls = {model: compose_config([f"model={model}"]).model for model in group_options("model")}
    for model, m in yamls.items():  # what cell_forms reads from the yaml files is what Hydra composes
        cell_name, time_scan = yaml_cell_and_form(model)
        assert cell_name == m.cell and time_scan in (m.time_scan, None), model
        assert time_scan == m.time_scan or m.time_scan in cells.get_cell(m.cell)(1).time_scans, model
    left_out = {model for model, m in yamls.items() if m.time_scan == "auto" and f"{model}-auto" not in ids}
    assert left_out == set(AUTO_IS)
    for model, form in AUTO_IS.items():
        assert auto_resolves_to(cells.get_cell(yamls[model].cell)(1)) == {form} and f"{model}-{form}" in ids
    for model in ("deltanet", "mlstm"):
        # On a CPU where the kernel builds, build_model takes deltanet's auto to its fused form (a case of its own)
        runs = models.resolve_form("auto", yamls[model].cell, "cpu")
        runs = AUTO_IS[model] if runs == "auto" else runs
        programs = {}
        for form in ("auto", runs):
            config = compose_config([f"hidden_dim={H}", "num_layers=2", f"model={model}", f"model.time_scan={form}",
                                     *small_overrides(model)])
            net = build_model(config.model, output_dim=3, input_dim=5)
            x = jnp.zeros((B, CUTS[1]), jnp.int32)
            params = jax.eval_shape(net.init, jax.random.key(0), x)["params"]
            state = initial_state(net, B, sum(CUTS))
            programs[form] = str(jax.make_jaxpr(net.apply)({"params": params}, x, state=state))
        assert programs["auto"] == programs[runs], model


@pytest.mark.parametrize("model", fast_first(["rnn", "lstm", "mamba"], why="cross-product"))
def test_segments_of_float_inputs_and_unstacked_layers(model):
    check_segments([f"model={model}", "model.scan_layers=false", "num_layers=3", *small_overrides(model)],
                   tokens=False)


@pytest.mark.slow("cross-product")  # the layers' states in a hybrid's groups; each cell's own: the fast tier above
@pytest.mark.parametrize("pattern", ["[gated_deltanet,attention]", "[mamba,mlstm,slstm]", "[rwkv7,lstm]"])
def test_segments_of_a_hybrid(pattern):
    first = pattern.strip("[]").split(",")[0]
    check_segments([f"model={first}", f"model.pattern={pattern}", "num_layers=" + str(2 * len(pattern.split(",")))])


def test_one_step_at_a_time_equals_the_whole_sequence():
    """Decoding's step: T segments of one step each."""
    check_segments(["model=gru"], cuts=(1,) * 9)
