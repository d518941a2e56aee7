"""What TensorBoard shows of a run, read back with TensorBoard's own reader: the HParams subset and
status, the custom-scalars layout, the config as text, lr at the logged step, the baseline scalar."""

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import tiny_config
from rnnlab import board, config as cfg
from rnnlab.steps import make_optimizer
from rnnlab.trainer import train_and_evaluate

OVERRIDES = ["hidden_dim=8", "model=gru", "experiment=adding_lstm", "hydra.run.dir=x", "+model.r_min=0.5"]


def test_hparams_are_the_overridden_keys_then_the_fixed_set():
    flat = cfg.flatten(tiny_config("model=gru"))
    assert board.overridden_keys(OVERRIDES, flat) == ["hidden_dim", "model.cell"]
    assert list(board.run_hparams(flat, OVERRIDES)) == [
        "hidden_dim", "model.cell", "num_layers", "optimizer.lr", "batch_size", "data.task", "data.seq_len"]


def test_layout_puts_train_eval_and_baseline_on_one_chart():
    layout = board.scalars_layout(("accuracy",), (16, 32))["rnnlab"]
    assert layout["loss: train, eval, baseline"] == ["Multiline", ["^train/loss$", "^eval/loss$", "^eval/baseline_loss$"]]
    assert layout["accuracy: train, eval"] == ["Multiline", ["^train/accuracy$", "^eval/accuracy$"]]
    assert layout["accuracy by eval length"] == ["Multiline", ["^eval/accuracy@16$", "^eval/accuracy@32$"]]
    assert "gradient norm by layer" not in layout
    with_norms = board.scalars_layout(("accuracy",), (), layer_norms=True)["rnnlab"]
    assert with_norms["gradient norm by layer"] == ["Multiline", ["^grad_norm/"]]


@pytest.fixture(scope="module")
def board_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("board")
    config = tiny_config("model=gru", "optimizer.warmup_steps=4")
    results = train_and_evaluate(config, workdir, overrides=["model=gru", "optimizer.warmup_steps=4", "steps=6"],
                                 varied=["model=gru", "optimizer.warmup_steps=4"])
    return config, workdir, results, EventAccumulator(str(workdir / "tensorboard")).Reload()


def plugin_data(events, plugin, tag, proto):
    return proto.FromString(events.PluginTagToContent(plugin)[tag])


def test_hparams_session_holds_the_subset_the_metrics_and_the_status(board_run):
    _, _, results, events = board_run
    start = plugin_data(events, "hparams", "_hparams_/session_start_info", plugin_data_pb2.HParamsPluginData)
    assert set(start.session_start_info.hparams) == {  # a proto map: no order
        "model.cell", "optimizer.warmup_steps", "hidden_dim", "num_layers", "optimizer.lr", "batch_size",
        "data.task", "data.seq_len", "state_floats"}
    assert start.session_start_info.hparams["model.cell"].string_value == "gru"
    assert start.session_start_info.hparams["state_floats"].number_value == results["state_floats"]
    experiment = plugin_data(events, "hparams", "_hparams_/experiment", plugin_data_pb2.HParamsPluginData)
    assert [h.name for h in experiment.experiment.hparam_infos][:2] == ["model.cell", "optimizer.warmup_steps"]
    # The varied keys are marked as differing (TensorBoard lists them first); steps, set but not varied, is text only.
    assert [h.name for h in experiment.experiment.hparam_infos if h.differs] == ["model.cell", "optimizer.warmup_steps"]
    assert "steps" not in start.session_start_info.hparams
    assert [m.name.tag for m in experiment.experiment.metric_infos] == [
        "eval/loss", "eval/mse", "train/loss", "perf/tokens_per_sec"]
    end = plugin_data(events, "hparams", "_hparams_/session_end_info", plugin_data_pb2.HParamsPluginData)
    assert results["status"] == "completed" and end.session_end_info.status == 1  # STATUS_SUCCESS


def test_custom_scalars_layout_and_baseline_scalar(board_run):
    _, _, results, events = board_run
    layout = layout_pb2.Layout.FromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    assert charts["loss: train, eval, baseline"] == ["^train/loss$", "^eval/loss$", "^eval/baseline_loss$"]
    assert [e.value for e in events.Scalars("eval/baseline_loss")] == pytest.approx([results["baseline_loss"]] * 2)


def test_config_and_overrides_are_text(board_run):
    _, _, _, events = board_run
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]
             if tag.endswith("text_summary")}
    assert "cell: gru" in texts["config/text_summary"] and "seq_len: 6" in texts["config/text_summary"]
    assert texts["overrides/text_summary"].strip() == "model=gru optimizer.warmup_steps=4 steps=6"  # all of them


def test_lr_is_the_schedule_at_the_logged_step_not_a_window_mean(board_run):
    config, _, _, events = board_run
    _, schedule = make_optimizer(config.optimizer, config.steps)
    logged = events.Scalars("train/lr")
    assert [e.step for e in logged] == [2, 4, 6]
    assert [e.value for e in logged] == pytest.approx([float(schedule(e.step)) for e in logged], rel=1e-6)


def test_copy_examples_table_names_symbols_and_scores_the_recalled_steps():
    from rnnlab.tasks import make_task

    task = make_task(tiny_config("data=copy", "data.seq_len=11").data)
    rng = np.random.default_rng(0)
    symbols = rng.integers(0, 8, size=10)
    tokens = np.concatenate([symbols, [8] * 10, [9], [8] * 10])  # data, T-1 blanks, delimiter, blanks
    inputs = np.eye(10, dtype=np.float32)[tokens][None]
    targets = np.concatenate([[8] * 21, symbols])[None].astype(np.int32)
    predicted = np.concatenate([[8] * 21, symbols[:7], [0, 0, 0]])
    outputs = np.eye(10, dtype=np.float32)[predicted][None]
    table = task.describe_examples(inputs, targets, outputs).splitlines()
    assert table[0] == "| input | target | predicted | right |"
    shown = " ".join(map(str, symbols))
    assert table[2].startswith(f"| `{shown}" + " _" * 10 + " >" + " _" * 10 + "` | ") and f"| `{shown}` |" in table[2]
    assert table[2].endswith(f"{(symbols[7:] == 0).sum() + 7}/10 |")


@pytest.mark.slow("long")
def test_a_copy_run_shows_eval_examples_as_text(tmp_path):
    train_and_evaluate(tiny_config("data=copy", "data.seq_len=11"), tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    steps = [e.step for e in events.Tensors("eval/examples/text_summary")]
    assert steps == [3, 6]
    text = events.Tensors("eval/examples/text_summary")[-1].tensor_proto.string_val[0].decode()
    rows = text.splitlines()[2:]  # up to 4: the first device's share of the first eval batch
    assert 1 <= len(rows) <= 4 and all(row.startswith("| `") and row.endswith("/10 |") for row in rows)
