"""log.histograms_every: parameter and gradient histograms and per-layer gradient norms, read back with
TensorBoard's reader and checked against the checkpoint Orbax restores at the same step and the
gradient of the loss on that step's batch, computed here without the trainer."""

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import compose_config, saved_state, tiny_config
from rnnlab import param_stats, tasks
from rnnlab.config import ConfigError
from rnnlab.loop import next_stop
from rnnlab.models import build_model
from rnnlab.trainer import train_and_evaluate

EVERY = ("log.histograms_every=5",)


def test_by_layer_splits_the_scanned_stack_along_its_layer_axis():
    w, b = np.arange(24.0).reshape(2, 3, 4), np.arange(8.0).reshape(2, 4)
    params = {"input_proj": {"kernel": np.ones((2, 3))}, "readout": {"bias": np.zeros(1)},
              "stack": {"layer_0": {"W_xh": np.full((3, 4), 7.0), "cell": {"W_hh": np.eye(3)}},
                        "layers": {"W_xh": w, "cell": {"b": b}}}}
    layers = param_stats.by_layer(params)
    assert sorted(layers) == ["input_proj", "layer_0", "layer_1", "layer_2", "readout"]
    assert sorted(layers["layer_0"]) == ["W_xh", "cell/W_hh"]
    np.testing.assert_array_equal(layers["layer_2"]["W_xh"], w[1])
    np.testing.assert_array_equal(layers["layer_1"]["cell/b"], b[0])
    norms = param_stats.layer_norms(params)
    assert norms["grad_norm/layer_2"] == pytest.approx(np.sqrt(np.sum(w[1] ** 2) + np.sum(b[1] ** 2)))
    assert norms["grad_norm/layer_0"] == pytest.approx(np.sqrt(49 * 12 + 3))


@pytest.mark.slow("long")
def test_layers_are_named_alike_whether_the_stack_is_scanned_or_a_loop():
    def layers(*overrides):
        config = tiny_config("model=gru", "num_layers=3", *overrides)
        params = build_model(config.model, 1, "cpu").init(jax.random.key(0), np.zeros((2, 5, 2), np.float32))["params"]
        return {layer: {path: leaf.shape for path, leaf in leaves.items()}
                for layer, leaves in param_stats.by_layer(params).items()}

    assert layers() == layers("model.scan_layers=false")
    assert sorted(layers()) == ["input_proj", "layer_0", "layer_1", "layer_2", "readout"]


def reference_gradients(config, params, step):
    """d loss / d params on the global batch of the update from `step`, straight from the model and the task."""
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, "cpu")
    batch = tasks.sample_batch(task, tasks.stream_key(config.seed, tasks.TRAIN_STREAM), step, 0, config.batch_size)

    def loss(p):
        return task.loss_and_metrics(model.apply({"params": p}, batch.inputs), batch.targets)[0]

    return jax.tree_util.tree_map(np.asarray, jax.jit(jax.grad(loss))(params))  # one program, not one a primitive


@pytest.mark.parametrize("devices", [("device.num_devices=1",),
                                     ("device.num_devices=2", "device.strategy=pmap"),
                                     ("device.num_devices=2", "device.strategy=shard_map")])
@pytest.mark.slow("long")
def test_histograms_and_layer_norms_match_the_checkpoint_and_its_gradient(tmp_path, devices):
    config = tiny_config("model=gru", "num_layers=3", "steps=10", "checkpoint.every=5", *EVERY, *devices)
    train_and_evaluate(config, tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0}).Reload()
    params = saved_state(tmp_path, 5)["params"]  # Orbax alone
    stacked_w = params["stack"]["layers"]["cell"]["W_hh"]  # [2, H, 3H]: layers 1 and 2
    hist = {e.step: e.histogram_value for e in events.Histograms("params/layer_2/cell/W_hh")}
    assert sorted(hist) == [0, 5, 10]  # the initialisation, then every 5 steps
    assert hist[5].num == stacked_w[1].size
    assert (hist[5].min, hist[5].max) == (float(stacked_w[1].min()), float(stacked_w[1].max()))
    assert hist[5].sum == pytest.approx(float(np.sum(stacked_w[1], dtype=np.float64)), rel=1e-5, abs=1e-6)

    grads = reference_gradients(config, params, 5)
    expected = {"input_proj": grads["input_proj"], "readout": grads["readout"], "layer_0": grads["stack"]["layer_0"],
                **{f"layer_{i + 1}": jax.tree_util.tree_map(lambda g, i=i: g[i], grads["stack"]["layers"]) for i in range(2)}}
    for layer, tree in expected.items():
        norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree_util.tree_leaves(tree)))
        logged = {e.step: e.value for e in events.Scalars(f"grad_norm/{layer}")}
        assert sorted(logged) == [0, 5, 10]
        assert logged[5] == pytest.approx(norm, rel=2e-4), layer
    g = grads["stack"]["layers"]["cell"]["W_hh"][0]
    grad_hist = [e.histogram_value for e in events.Histograms("grads/layer_1/cell/W_hh") if e.step == 5][0]
    assert grad_hist.num == g.size and grad_hist.max == pytest.approx(float(g.max()), rel=2e-4, abs=1e-7)


@pytest.mark.slow("long")
def test_histograms_are_off_by_default_and_their_steps_are_dispatch_ends(tmp_path):
    config = tiny_config()
    assert config.log.histograms_every == 0
    train_and_evaluate(config, tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert not events.Tags()["histograms"] and not [t for t in events.Tags()["scalars"] if t.startswith("grad_norm/")]
    on = tiny_config("steps=40", "log_every=40", "eval_every=40", "checkpoint.enabled=false", "log.histograms_every=7")
    assert [next_stop(on, s) for s in (0, 7, 13, 35)] == [7, 14, 14, 40]


def test_a_negative_histogram_period_is_refused():
    with pytest.raises(ConfigError, match="log.histograms_every"):
        compose_config(["log.histograms_every=-1"])


@pytest.mark.slow("long")
def test_a_diverging_run_stops_as_diverged_and_skip_mode_still_writes_its_histograms(tmp_path):
    from rnnlab.trainer import NonFiniteLossError

    # Step 1 makes the parameters huge, step 2 overflows; the histogram step 3 is not a log step.
    diverging = ("steps=12", "log_every=12", "eval_every=12", "optimizer.lr=1e30", "optimizer.warmup_steps=0",
                 "log.histograms_every=3")
    with pytest.raises(NonFiniteLossError) as info:
        train_and_evaluate(tiny_config(*diverging), tmp_path / "stop")
    assert info.value.step == 2

    results = train_and_evaluate(tiny_config(*diverging, "on_nonfinite=skip"), tmp_path / "skip")
    assert results["status"] == "completed" and results["skipped_updates"] == 11
    events = EventAccumulator(str(tmp_path / "skip" / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    kernel = saved_state(tmp_path / "skip", 12)["params"]["readout"]["kernel"]  # unchanged since step 1
    hist = {e.step: e.histogram_value for e in events.Histograms("params/readout/kernel")}
    assert sorted(hist) == [0, 3, 6, 9, 12]
    assert hist[12].num == kernel.size and (hist[12].min, hist[12].max) == (float(kernel.min()), float(kernel.max()))


def test_histograms_leave_out_nan_and_inf_and_bin_equal_huge_values_once(tmp_path):
    from rnnlab.metrics import MetricWriter

    writer = MetricWriter(tmp_path)
    left_out = writer.write_histograms(1, {"mixed": np.array([np.nan, 1.0, 2.0, np.inf]), "nan": np.full(3, np.nan),
                                           "huge": np.full(10, 1e30, np.float32)})
    writer.close("completed")
    assert left_out == 5
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0}).Reload()
    assert sorted(events.Tags()["histograms"]) == ["huge", "mixed"]  # an all-NaN array has no histogram
    mixed = events.Histograms("mixed")[0].histogram_value
    assert (mixed.num, mixed.min, mixed.max, mixed.sum) == (2, 1.0, 2.0, 3.0)
    huge = events.Histograms("huge")[0].histogram_value  # np.histogram cannot split it into 64 finite bins
    assert huge.num == 10 and huge.min == huge.max == pytest.approx(1e30) and sum(huge.bucket) == 10
