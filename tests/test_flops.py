"""The analytic FLOP count against JAX's traced matmuls and XLA's cost analysis; peak cache; MFU."""

import contextlib
import json
import os
import subprocess
import sys

import jax
import pytest

from conftest import ROOT, compose_config, fast_first
from rnnlab import flops, fused, models, parallel, tasks
from rnnlab.cells import CELLS, LinearCell, SequenceCell
from rnnlab.models import build_model
from rnnlab.steps import create_train_state, make_optimizer, train_step


# The package's own cells (tests/test_extension.py registers one more, with a check of its own).
PACKAGE_CELLS = [name for name, cls in CELLS.items() if cls.__module__.startswith("rnnlab.")]


@pytest.fixture(autouse=True)
def jax_forms_only(monkeypatch):
    """The matmuls of the JAX forms are what this module counts: `model.time_scan=auto` builds them, not the fused
    CPU kernel, whose work XLA sees as one opaque call (its count: test_fused's)."""
    monkeypatch.setattr(fused, "available", lambda: (False, "counted as the JAX forms"))


def step_and_args(overrides):
    """(one-device train step with the pmean axis bound, its args, config, task) for a composed config."""
    config = compose_config(["device=cpu", *overrides])
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, input_dim=task.input_dim)
    tx, schedule = make_optimizer(config.optimizer, config.steps)
    example = task.input_spec(config.batch_size)
    # Shapes only: tracing and lowering need no values, and nothing here compiles.
    state = jax.eval_shape(lambda x: create_train_state(jax.random.key(0), model, x, tx), example)
    batch = jax.eval_shape(lambda: tasks.sample_batch(task, tasks.stream_key(0, 0), 0, 0, config.batch_size))

    def step(state, batch):
        return jax.vmap(
            lambda s, b: train_step(s, b, task, schedule), axis_name=parallel.AXIS, axis_size=1, in_axes=None
        )(state, batch)

    return step, (state, batch), config, task


def analytic(config, task):
    return flops.step_flops(config.model, task.input_dim, task.output_dim, config.batch_size * task.total_len,
                           task.total_len, task.token_inputs)


@contextlib.contextmanager
def unrolled_scans():
    """Every lax.scan traced inside is fully unrolled, so XLA's cost analysis sees each iteration."""
    original = jax.lax.scan

    def scan(*args, **kwargs):
        kwargs["unroll"] = True
        return original(*args, **kwargs)

    jax.lax.scan = scan
    try:
        yield
    finally:
        jax.lax.scan = original


SMALL = ["batch_size=4", "hidden_dim=8", "num_layers=2", "data.seq_len=5"]
# Options that reach a cell's own code (its recurrence, its time scans, its input projection and the fold) run with
# every cell they apply to in the full tier; those that only change what surrounds the cells (the layer stack, the
# MLP, a dtype, an unfolded embedding) with one cell of each kind of state (KINDS).
OPTIONS = [
    [],
    ["model.recurrence=autodiff"],
    ["model.recurrence=autodiff", "model.remat=true"],
    ["model.recurrence=custom_vjp", "model.unroll=2", "model.scan_layers=false"],
    ["data=copy", "data.seq_len=12"],  # token ids, I + 1 = 11 < B*T = 128: the embedding folded into W_xh
    ["data=copy", "data.seq_len=12", "hidden_dim=4"],  # I >= 2H, but token ids: folded all the same
    ["data=copy", "data.seq_len=12", "model.recurrence=autodiff"],  # the folded gather inside the time scan
    ["model.block=residual", "num_layers=3"],
    ["model.block=residual", "model.scan_layers=false", "model.recurrence=autodiff"],
    ["model.time_scan=associative"],  # linear cells only
    ["model.time_scan=associative", "model.recurrence=autodiff", "model.block=residual"],
    ["model.time_scan=chunked"],  # matrix-state cells and mamba
    ["model.time_scan=chunked", "++model.chunk_size=2"],  # T=5: the last chunk padded
    ["model.time_scan=blockwise", "++model.block_size=2"],  # attention only; T=5: the last block padded
    ["model.time_scan=blockwise", "++model.block_size=2", "++model.window=3"],  # attention: 5 of the 6 block pairs
]
AROUND_THE_CELLS = [
    ["model.scan_layers=false", "num_layers=3"],
    ["model.dtype=bfloat16", "model.unroll=2"],
    ["data=mqar", "data.seq_len=16", "data.vocab_size=64"],  # token ids, I + 1 = 65 >= B*T = 64: not folded
    ["model.block=residual", "model.mlp=gelu", "model.mlp_expand=4", "model.mlp_bias=true"],  # GPT-2's MLP
    ["model.block=residual", "model.mlp=swiglu", "model.mlp_expand=2.667"],  # an expansion that rounds
    ["model.block=residual", "model.mlp=none"],
]
# One cell of each kind of state: a carry, a linear recurrence, an SSM, a matrix state, attention's cache.
KINDS = ["rnn", "mingru", "mamba", "gated_deltanet", "attention"]


def cell_overrides(cell, options=()):
    """model.cell=<cell>, and its first time scan where the config's default (sequential) is not one of its
    forms and `options` name none (attention: parallel)."""
    scans = CELLS[cell].time_scans
    default = [] if "sequential" in scans or any(o.startswith("model.time_scan=") for o in options) else [
        f"model.time_scan={scans[0]}"]
    # The default config's recurrence is custom_vjp (rnn's); a form without a hand-written backward refuses it.
    form = next((o.split("=", 1)[1] for o in [*options, *default] if o.startswith("model.time_scan=")), "sequential")
    if not any(o.startswith("model.recurrence=") for o in options) and not _backward_in(cell, form):
        default.append("model.recurrence=autodiff")
    return [f"model.cell={cell}", *default]


def _backward_in(cell, form):
    """Whether `model.recurrence=custom_vjp` runs a hand-written backward for `cell` in `form` (else it is refused)."""
    return form in CELLS[cell](hidden_dim=8).custom_vjp_forms()


def _applies(cell, options):
    """remat is for cells run step by step; a time scan for the cells that have that form."""
    cls = CELLS[cell]
    scans = [o.split("=", 1)[1] for o in options if o.startswith("model.time_scan=")]
    vjp = "model.recurrence=custom_vjp" not in options or _backward_in(cell, (scans or ["sequential"])[0])
    return (not (issubclass(cls, SequenceCell) and "model.remat=true" in options) and all(t in cls.time_scans for t in scans)
            and vjp)


# The fast tier: each cell with the default options, and each option with the first cell it applies to.
FAST_OPTIONS = [(c, []) for c in PACKAGE_CELLS] + [
    (c, o) for o in OPTIONS + AROUND_THE_CELLS if o
    for c in [next((c for c in ["rnn", *PACKAGE_CELLS] if _applies(c, o)), None)] if c]
FULL_OPTIONS = [(c, o) for o in OPTIONS for c in PACKAGE_CELLS if _applies(c, o)] + [
    (c, o) for o in AROUND_THE_CELLS for c in KINDS if _applies(c, o)]


@pytest.mark.parametrize("cell, options", FAST_OPTIONS + fast_first(
    [(c, o) for c, o in FULL_OPTIONS if (c, o) not in FAST_OPTIONS], keep=0, why="cross-product"),
                         ids=lambda v: v if isinstance(v, str) else ",".join(v) or "default")
def test_analytic_count_equals_the_traced_matmuls(cell, options):
    """Exact: every dot_general of the traced step (scan bodies times their length), remat included."""
    step, args, config, task = step_and_args([*SMALL, *cell_overrides(cell, options), *options])
    assert flops.jaxpr_matmul_flops(step, *args) == analytic(config, task).executed


@pytest.mark.parametrize("cell", fast_first(sorted(PACKAGE_CELLS, key=lambda c: c not in ("rnn", "mingru")), keep=2,
                                             why="cross-product"))
def test_analytic_count_agrees_with_xla_cost_analysis(cell, num_layers=2):
    """XLA counts a loop body once: unroll the scans so it counts every iteration, then compare.

    XLA also counts elementwise ops and the optimizer (not in the analytic count), a few
    percent at these sizes, so the analytic count is at most 4% below XLA's; a cell linear in its
    state has no recurrent matmul, so its elementwise share is larger (measured 5-12%): 15% there.
    Attention's softmax and rotary embeddings measured 6%: 10% there. Mamba's selective scan is
    elementwise work on an [E*H, N] state per token (measured 23%), and the matrix-state cells'
    convolution, norms, gates and decays at T=4 (measured 13-24%): 28% there. Mamba-2's decays and gated norm
    over its [heads, P, N] state and its [T, B, D + 2N] convolution at T=4 measured 34%: 40% there.
    """
    overrides = ["batch_size=32", "hidden_dim=128", f"num_layers={num_layers}", "data.seq_len=4", *cell_overrides(cell)]
    step, args, config, task = step_and_args(overrides)
    with unrolled_scans():
        compiled = jax.jit(step).lower(*args).compile()
    xla = flops.xla_flops(compiled)
    model = analytic(config, task).model
    kind = CELLS[cell]
    low = (0.96 if not issubclass(kind, SequenceCell) else 0.85 if issubclass(kind, LinearCell)
           else 0.90 if cell == "attention" else 0.60 if cell == "mamba2" else 0.72)
    assert low * xla <= model <= 1.005 * xla, f"analytic {model:.4g} vs XLA {xla:.4g} ({model / xla:.3f})"


def test_backward_is_twice_forward_less_the_data_gradient():
    """Per token, backward = 2 x forward less the first layer's data gradient (x is data); the
    fold's per-step products cost twice as much backward as forward."""
    config = compose_config(["model.cell=lstm"])
    i, gh = 2, 4 * config.hidden_dim
    f10, f20 = (flops.step_flops(config.model, input_dim=i, output_dim=1, tokens=n, seq_len=5) for n in (10, 20))
    forward_token, backward_token = (f20.forward - f10.forward) // 10, (f20.backward - f10.backward) // 10
    assert backward_token == 2 * forward_token - 2 * i * gh
    per_step = f10.forward - 10 * forward_token
    assert per_step == 2 * i * config.hidden_dim * gh + 2 * config.hidden_dim * gh
    assert f10.backward - 10 * backward_token == 2 * per_step
    assert f10.recompute == 0 and f10.executed == f10.model == flops.train_step_flops(config.model, i, 1, 10, 5)


def test_folding_the_input_projection_halves_a_one_layer_step(monkeypatch):
    """The traced matmuls of a one-layer step, folded and (forced) not: the fold leaves the
    recurrent matmuls, 3 of the 6 [H, G*H]-sized ones per token, and the analytic count follows."""
    overrides = ["model.cell=lstm", "hidden_dim=64", "num_layers=1", "batch_size=8", "data.seq_len=16"]
    step, args, config, task = step_and_args(overrides)
    folded = flops.jaxpr_matmul_flops(step, *args)
    monkeypatch.setattr(models, "folds_projection", lambda input_dim, hidden_dim, tokens=None: False)
    step, args, config, task = step_and_args(overrides)
    unfolded = flops.jaxpr_matmul_flops(step, *args)
    assert unfolded == analytic(config, task).executed  # the count follows the model either way
    assert 0.49 < folded / unfolded < 0.53


def test_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(flops, "QUICK_N", 64)
    device = jax.devices()[0]
    assert flops.peak_flops(device, "float32", measure=False) is None
    first = flops.peak_flops(device, "float32")
    assert first > 0
    cached = json.loads((tmp_path / "rnnlab" / "peak_flops.json").read_text())
    assert cached[flops.device_key(device)]["float32"]["flops_per_sec"] == first

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(flops, "measure_matmul_flops", no_measuring)
    assert flops.peak_flops(device, "float32") == first
    flops.save_peak(device, "bfloat16", 2.0e9, source="test")
    assert flops.peak_flops(device, "bfloat16") == 2.0e9 and flops.peak_flops(device, "float32") == first


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_a_process_pinned_to_one_core_has_a_peak_of_its_own(tmp_path):
    """A pinned process (RNNLAB_PIN_CPU=1, taskset) reaches about half a 2-core host's matmul peak:
    it must neither divide by the whole host's cached peak nor cache its own in that entry."""
    script = ("import os, jax; from rnnlab import flops; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
              "flops.save_peak(jax.devices()[0], 'float32', 1.0e9, source='pinned'); print(flops.device_key(jax.devices()[0]))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    pinned_key = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                                timeout=120).stdout.strip()
    assert pinned_key.endswith(":1 cores")
    assert flops.device_key(jax.devices()[0]) == f"{pinned_key.rsplit(':', 1)[0]}:{len(os.sched_getaffinity(0))} cores"
    cached = json.loads((tmp_path / "rnnlab" / "peak_flops.json").read_text())
    assert list(cached) == [pinned_key]  # saved under the 1-core key, not the host's


def test_mfu():
    cpu = jax.devices("cpu")
    assert flops.mfu(5e9, 1e10, cpu) == 0.5
    assert flops.mfu(5e9, 1e10, cpu[:2]) == 0.5  # simulated CPU devices share the process's peak
    assert flops.mfu(None, 1e10, cpu) is None and flops.mfu(5e9, None, cpu) is None


def test_an_mfu_above_the_peak_is_not_reported_but_named(caplog):
    """A cached peak measured on a busy core (16 GFLOP/s where the core reaches 80) gave MFUs of 278%: the
    run outpaces the peak, so the peak is wrong, and the MFU is left out with one warning naming the fix."""
    cpu = jax.devices("cpu")
    with caplog.at_level("WARNING", logger="rnnlab.flops"):
        assert flops.mfu(4.5e10, 1.6e10, cpu) is None and flops.mfu(4.6e10, 1.6e10, cpu) is None
        assert flops.mfu(1.0e10, 1.0e10, cpu) == 1.0  # at the peak: reported
    assert len(caplog.records) == 1 and "python -m rnnlab.peak_flops" in caplog.records[0].getMessage()


@pytest.mark.slow("long")
def test_training_reports_mfu_against_the_cached_peak(tmp_path, monkeypatch, tiny):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rnnlab.trainer import train_and_evaluate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    flops.save_peak(jax.devices()[0], "float32", 1.0e9, source="test")
    results = train_and_evaluate(tiny(), tmp_path / "run")
    assert results["mfu"] == pytest.approx(results["flops_per_sec"] / 1.0e9)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert "perf/mfu" in events.Tags()["scalars"]


def test_the_peak_is_asked_for_at_the_first_rate_not_before_the_first_step_and_off_the_clock():
    import time

    from rnnlab.report import Throughput

    asked = []

    def slow_peak():
        asked.append(True)
        time.sleep(0.2)  # a measurement: must not count as training time
        return 1.0e18

    meter = Throughput(tokens_per_step=10, flops_per_step=1e6, peak_flops=slow_peak, devices=jax.devices()[:1])
    meter.dispatching()
    meter.dispatched(1, jax.numpy.zeros(()))  # the first dispatch: the clock starts
    assert not asked
    meter.dispatched(4, None)
    rates = meter.window_rates()
    meter.open_window()
    meter.dispatched(4, None)
    assert len(asked) == 1 and rates["perf/mfu"] == pytest.approx(rates["perf/flops_per_sec"] / 1.0e18)
    assert meter.window_rates()["perf/steps_per_sec"] > 4 / 0.2  # the 0.2 s measurement is not in this window
    assert meter.totals()[2] is not None and len(asked) == 1


HYBRIDS = [
    ["model=gated_deltanet", "model.pattern=[gated_deltanet,attention]", "num_layers=4"],
    ["model=rnn", "model.pattern=[rnn,lstm,gru]", "num_layers=3"],  # plain block: a hybrid never folds
    ["model=mamba", "model.pattern=[mamba,attention]", "data=copy", "data.seq_len=12"],  # token ids
    ["model=rnn", "model.pattern=[rnn,mingru]", "num_layers=4", "model.scan_layers=false", "model.block=residual"],
]


@pytest.mark.parametrize("overrides", fast_first(HYBRIDS, keep=2, why="cross-product"), ids=lambda o: "+".join(o[:2]))
def test_hybrid_pattern_count_equals_the_traced_matmuls(overrides):
    """Each layer's own cell (its input width, step, mixing with its own time_scan), summed over the layers."""
    step, args, config, task = step_and_args([*SMALL, *overrides])
    assert len(config.model.layer_cells()) > 1
    assert flops.jaxpr_matmul_flops(step, *args) == analytic(config, task).executed
