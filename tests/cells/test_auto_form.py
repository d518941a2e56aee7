"""`model.time_scan=auto`: a layer runs the form its cell's `auto_forms` names for the sequence length, the
same program as that form written out; FLOPs are counted for the form that runs."""

import jax
import numpy as np
import pytest

from conftest import tiny_config
from rnnlab import cells, flops, models
from rnnlab.config import ConfigError
from rnnlab.models import build_model


@pytest.mark.parametrize("cell", ["rwkv7", "mlstm", "deltanet", "gated_deltanet", "deltaproduct"])
def test_auto_is_a_short_form_up_to_64_steps_and_the_chunked_beyond(cell):
    kind = cells.get_cell(cell)(16)
    short = dict(kind.auto_forms)[64]
    assert short in kind.time_scans and short != "chunked"
    assert [kind.resolve_time_scan("auto", t) for t in (1, 16, 64, 65, 10_000)] == [short] * 3 + ["chunked"] * 2
    assert kind.resolve_time_scan("chunked", 16) == "chunked"  # a form written out is run as written


def test_mambas_auto_is_the_chunked_form_at_every_length():
    kind = cells.get_cell("mamba")(16)
    assert [kind.resolve_time_scan("auto", t, stateful) for t in (1, 16, 64, 10_000) for stateful in (False, True)] == [
        "chunked"] * 8


def test_a_cell_without_auto_forms_runs_its_default_form():
    for name in cells.cell_names():
        kind = cells.get_cell(name)(16)
        if not kind.auto_forms:  # its default form, or where that is `auto` (a fused kernel's), its long form
            default = kind.default_form()
            assert kind.resolve_time_scan("auto", 16) == (kind.long_form if default == "auto" else default) != "auto"


@pytest.mark.slow("long")
@pytest.mark.parametrize("cell, length", [("deltanet", 8), ("deltanet", 70), ("mlstm", 8)])
def test_auto_builds_the_program_of_the_form_it_resolves_to(cell, length):
    x = np.random.default_rng(0).normal(size=(2, length, 3)).astype(np.float32)
    outputs = {}
    runs = models.resolve_form("auto", cell, "cpu")  # on a CPU where the kernel builds: its fused form
    runs = cells.get_cell(cell)(8).resolve_time_scan("auto", length) if runs == "auto" else runs
    for form in ("auto", runs):
        config = tiny_config(f"model={cell}", f"model.time_scan={form}", "model.num_heads=2", "model.chunk_size=64")
        model = build_model(config.model, 3, "cpu")
        params = jax.jit(model.init)(jax.random.key(0), x)
        outputs[form] = jax.jit(model.apply)(params, x)
    auto, explicit = outputs.values()
    np.testing.assert_array_equal(auto, explicit)


@pytest.mark.parametrize("seq_len", [16, 128])
def test_flops_count_the_form_that_runs(seq_len):
    auto = tiny_config("model=deltanet", "model.time_scan=auto").model
    form = cells.get_cell("deltanet")(auto.hidden_dim).resolve_time_scan("auto", seq_len)
    explicit = tiny_config("model=deltanet", f"model.time_scan={form}").model
    count = lambda model: flops.train_step_flops(model, 3, 3, 4 * seq_len, seq_len)  # noqa: E731
    assert count(auto) == count(explicit)


def test_auto_is_allowed_for_every_cell_and_a_bad_form_names_it():
    for name in ("gru", "mamba", "attention"):
        assert tiny_config(f"model={name}", "model.time_scan=auto").model.time_scan == "auto"
    with pytest.raises(ConfigError, match=r"model.time_scan.*allowed for cell 'gru': sequential, auto"):
        tiny_config("model=gru", "model.time_scan=chunked")
