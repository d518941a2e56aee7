"""The training loop in-process: steps, pmap equivalence, compile-once, outputs, resume."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import assert_same_tree, compose_config, fast_first, saved_state, tiny_config, xla_optimizations
from rnnlab import parallel, tasks
from rnnlab.models import build_model
from rnnlab.steps import create_train_state, make_optimizer, pmap_sampler, train_metric_names, train_step
from rnnlab.trainer import train_and_evaluate

RESULT_KEYS = {
    "status", "step", "train_loss", "eval_loss", "eval_metric", "baseline_loss", "num_params", "num_devices",
    "tokens_per_sec", "flops_per_sec", "mfu", "compile_seconds", "compile_cache", "wall_seconds", "state_floats",
}
TB_TAGS = {
    "train/loss", "train/lr", "train/grad_norm", "eval/loss", "eval/mse",
    "perf/tokens_per_sec", "perf/steps_per_sec", "perf/flops_per_sec",
}


@pytest.mark.slow("long")
def test_one_train_step_changes_every_parameter():
    config = tiny_config()
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim)
    tx, schedule = make_optimizer(config.optimizer, config.steps)
    example = jnp.zeros((config.batch_size, task.total_len, task.input_dim))
    state = create_train_state(jax.random.key(0), model, example, tx)
    devices = jax.devices()[:1]
    batch = pmap_sampler(task, tasks.stream_key(0, 0), config.batch_size, devices)(np.zeros(1, np.int32))
    step = jax.pmap(lambda s, b: train_step(s, b, task, schedule), axis_name=parallel.AXIS, devices=devices)
    new_state, metrics = step(parallel.replicate(state, devices), batch)
    before = jax.tree_util.tree_leaves_with_path(state.params)
    after = jax.tree_util.tree_leaves(parallel.unreplicate_to_host(new_state.params))
    unchanged = [jax.tree_util.keystr(p) for (p, a), b in zip(before, after) if np.array_equal(np.asarray(a), b)]
    assert not unchanged, f"parameters not updated: {unchanged}"
    assert np.isfinite(float(metrics["loss"][0]))


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("task_name", ["adding", "copy"])
def test_the_loop_stacks_exactly_the_metrics_train_step_returns(skip, task_name):
    config = tiny_config(f"data={task_name}", "data.seq_len=12")
    task = tasks.make_task(config.data)
    tx, schedule = make_optimizer(config.optimizer, config.steps)
    model = build_model(config.model, task.output_dim, input_dim=task.input_dim)
    example = task.input_spec(2)
    state = jax.eval_shape(lambda x: create_train_state(jax.random.key(0), model, x, tx), example)
    batch = jax.eval_shape(lambda: tasks.sample_batch(task, tasks.stream_key(0, 0), 0, 0, 2))
    step = jax.vmap(lambda s, b: train_step(s, b, task, schedule, skip), axis_name=parallel.AXIS, axis_size=1, in_axes=None)
    _, metrics = jax.eval_shape(step, state, batch)
    assert sorted(metrics) == sorted(train_metric_names(task, skip))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    return workdir, train_and_evaluate(tiny_config(), workdir)


def test_results_json_has_the_documented_keys(tiny_run):
    workdir, results = tiny_run
    on_disk = json.loads((workdir / "results.json").read_text())
    assert RESULT_KEYS <= set(on_disk)
    assert on_disk["status"] == "completed" and on_disk["step"] == 6 and on_disk["num_devices"] == 1
    assert on_disk["baseline_loss"] == pytest.approx(1 / 6)
    assert on_disk["state_floats"] == 8  # the Elman cell's h, H = 8
    assert on_disk["tokens_per_sec"] > 0 and on_disk["compile_seconds"] > 0
    assert on_disk["eval_loss"] == pytest.approx(results["eval_loss"])


def test_tensorboard_events_carry_the_documented_tags(tiny_run):
    workdir, results = tiny_run
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    assert TB_TAGS <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    assert [e.step for e in events.Scalars("eval/loss")] == [3, 6]
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(results["eval_loss"], rel=1e-6)
    # The HParams plugin's experiment and session data are in the same run (KeyError if absent).
    assert len(events.PluginTagToContent("hparams")) >= 2


def test_model_summary_and_checkpoints_are_written(tiny_run):
    workdir, results = tiny_run
    summary = (workdir / "model_summary.txt").read_text()
    assert "RecurrentModel" in summary and "W_hh" in summary
    state = saved_state(workdir, 6)
    assert int(state["step"]) == 6
    assert state["params"]["stack"]["layer_0"]["W_xh"].shape == (8, 8)
    assert state["params"]["stack"]["layers"]["W_xh"].shape == (1, 8, 8)  # layers 1 .. L-1
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [3, 6]


def test_resumed_run_continues_from_the_saved_step_and_matches(tmp_path, caplog):
    import shutil

    config = tiny_config("steps=9")
    train_and_evaluate(config, tmp_path)
    uninterrupted = saved_state(tmp_path, 9)
    # As if the run had died between its checkpoints at steps 6 and 9.
    shutil.rmtree(tmp_path / "checkpoints" / "9")
    with caplog.at_level(logging.INFO, logger="rnnlab.trainer"):
        resumed = train_and_evaluate(config, tmp_path)
    assert "at step 6" in caplog.text and resumed["step"] == 9
    assert_same_tree(uninterrupted, saved_state(tmp_path, 9))
    # Steps 8 and 9, logged twice, are shown once: the resumed writer purges what followed step 6.
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8, 9]


@pytest.mark.slow("long")
def test_several_steps_per_dispatch_train_the_same_steps_as_one(tmp_path):
    """Dispatches of up to 8 or 5 steps end exactly at every log, eval and checkpoint step and
    run the same steps as one step per dispatch: the same parameters bit for bit between 5 and 8 (one loop body),
    and to float32 rounding against one step per dispatch (compiled as users compile: `xla_optimizations`;
    since the lr is an input of the step, XLA fuses the loop's body and the lone step apart: 1 ulp)."""
    runs = {}
    for k in (1, 5, 8):
        config = tiny_config("steps=40", "log_every=20", "eval_every=25", "checkpoint.every=30", "checkpoint.keep=5",
                             f"device.steps_per_dispatch={k}")
        with xla_optimizations():
            runs[k] = train_and_evaluate(config, tmp_path / str(k))
        assert runs[k]["step"] == 40
        events = EventAccumulator(str(tmp_path / str(k) / "tensorboard"))
        events.Reload()
        assert [e.step for e in events.Scalars("train/loss")] == [20, 40]
        assert [e.step for e in events.Scalars("eval/loss")] == [25, 40]
        runs[k] = {"loss": [e.value for e in events.Scalars("train/loss")], "state": saved_state(tmp_path / str(k), 40),
                   "at_30": saved_state(tmp_path / str(k), 30)}
    assert runs[5]["loss"] == runs[8]["loss"]
    assert_same_tree(runs[5]["state"], runs[8]["state"])
    assert_same_tree(runs[5]["at_30"], runs[8]["at_30"])
    np.testing.assert_allclose(runs[8]["loss"], runs[1]["loss"], rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(runs[8]["state"]), jax.tree_util.tree_leaves(runs[1]["state"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_dispatches_end_at_every_step_the_loop_has_work_and_cover_every_step(k):
    from rnnlab.loop import MAX_STEPS_IN_FLIGHT, next_stop as _next_stop

    cases = [("steps=100", "log_every=7", "eval_every=30", "checkpoint.every=25", "profile.start_step=40", "profile.num_steps=5",
              "log.histograms_every=11"),
             ("steps=50", "log_every=50", "eval_every=50", "checkpoint.enabled=false")]
    for overrides in cases:
        config = tiny_config(*overrides)
        for processes in (1, 2):
            for start in (0, 13):
                ends, step = [], start
                while step < config.steps:
                    step += min(k, _next_stop(config, step, processes) - step)
                    ends.append(step)
                ck = config.checkpoint
                must = {s for s in range(start + 1, config.steps + 1)
                        if s % config.log_every == 0 or s % config.eval_every == 0 or s == config.steps
                        or (ck.enabled and s % ck.every == 0) or (processes > 1 and s % MAX_STEPS_IN_FLIGHT == 0)
                        or (config.log.histograms_every and s % config.log.histograms_every == 0)}
                if config.profile.num_steps:
                    must |= {config.profile.start_step - 1, config.profile.start_step + config.profile.num_steps - 1}
                assert must <= set(ends), (overrides, processes, start, sorted(must - set(ends)))
                assert ends[-1] == config.steps and all(0 < b - a <= k for a, b in zip([start, *ends], ends))


@pytest.mark.slow("long")
def test_divergence_inside_a_multi_step_dispatch_names_its_step(tmp_path):
    from rnnlab.trainer import NonFiniteLossError

    for k in (1, 8):
        config = tiny_config("steps=16", "log_every=16", "eval_every=16", "optimizer.lr=1e30",
                             "optimizer.warmup_steps=0", f"device.steps_per_dispatch={k}")
        with pytest.raises(NonFiniteLossError) as info:  # step 1 is finite, step 2 overflows
            train_and_evaluate(config, tmp_path / str(k))
        assert info.value.step == 2
        assert json.loads((tmp_path / str(k) / "results.json").read_text())["step"] == 2


@pytest.mark.slow("long")
def test_several_steps_per_dispatch_under_shard_map_on_four_devices(tmp_path):
    """Across 4 devices the looped step is another XLA program than the single step: the same
    steps, the same numbers to float32 rounding (bit-identity is only promised per setting)."""
    runs = {}
    for k in (1, 8):
        config = tiny_config("steps=20", "log_every=10", "eval_every=20", "checkpoint.every=20", "batch_size=8",
                             "device.num_devices=4", "device.strategy=shard_map", f"device.steps_per_dispatch={k}")
        runs[k] = train_and_evaluate(config, tmp_path / str(k))
    assert runs[8]["train_loss"] == pytest.approx(runs[1]["train_loss"], rel=1e-5)
    p1, p8 = (saved_state(tmp_path / str(k), 20)["params"] for k in (1, 8))
    for x, y in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p8)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_pmap_over_two_devices_matches_one_device(tmp_path):
    one = train_and_evaluate(tiny_config("steps=4", "device.num_devices=1"), tmp_path / "one")
    two = train_and_evaluate(tiny_config("steps=4", "device.num_devices=2"), tmp_path / "two")
    assert two["num_devices"] == 2
    assert two["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    p1, p2 = saved_state(tmp_path / "one", 4)["params"], saved_state(tmp_path / "two", 4)["params"]
    for x, y in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", fast_first(["pmap", "shard_map"], why="cross-product", first_why="long"))
def test_train_step_compiles_once(tmp_path, caplog, strategy):
    config = tiny_config("steps=40", "log_every=5", "eval_every=10", "checkpoint.every=10", f"device.strategy={strategy}")
    with caplog.at_level(logging.WARNING, logger="jax._src.interpreters.pxla"):
        jax.config.update("jax_log_compiles", True)
        try:
            train_and_evaluate(config, tmp_path)
        finally:
            jax.config.update("jax_log_compiles", False)
    # The train step (which draws its own batch), the eval sampler and the eval step compile
    # once each (pmap logs them all as jit(_fun)); nothing more over 40 steps. (The quick peak FLOP/s
    # measurement, when nothing is cached, is jit(peak_matmul): not a program of the run.)
    names = ("jit(_fun)", "jit(steps)", "jit(one_step)", "jit(sample)", "jit(train_step)", "jit(eval_step)", "jit(<lambda>)",
             "jit(one)")  # one: a program over a member axis of one (`steps.over_members`)
    compiles = [r.getMessage()[:60] for r in caplog.records if r.getMessage().startswith(tuple(f"Compiling {n}" for n in names))]
    assert len(compiles) == 3, compiles


@pytest.mark.slow("long")
def test_default_job_learns(tmp_path):
    # The default config, only shorter: the loss must fall well below the trivial baseline.
    results = train_and_evaluate(compose_config(["steps=600", "eval_every=600"]), tmp_path)
    assert results["eval_loss"] < 0.5 * results["baseline_loss"]


def test_batch_that_does_not_divide_fails_before_compiling(tmp_path):
    from rnnlab.config import ConfigError

    with pytest.raises(ConfigError, match="'batch_size': got 30, must be divisible by the 4 devices"):
        train_and_evaluate(tiny_config("batch_size=30", "device.num_devices=4"), tmp_path)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


@pytest.mark.slow("long")
def test_same_seed_is_bit_identical_and_another_seed_differs(tmp_path):
    runs = {name: tiny_config("steps=4", f"seed={seed}") for name, seed in (("a", 0), ("b", 0), ("c", 1))}
    for name, config in runs.items():
        train_and_evaluate(config, tmp_path / name)
    a, b, c = (saved_state(tmp_path / name, 4)["params"] for name in "abc")
    assert_same_tree(a, b)
    assert not np.array_equal(a["readout"]["kernel"], c["readout"]["kernel"])


@pytest.mark.slow("long")
def test_skip_mode_drops_nonfinite_updates_and_counts_them(tmp_path):
    config = tiny_config("steps=4", "on_nonfinite=skip", "optimizer.lr=1e30", "optimizer.warmup_steps=0")
    results = train_and_evaluate(config, tmp_path)
    assert results["status"] == "completed" and results["step"] == 4
    # Step 1 is finite (it makes the parameters huge); every later update overflows and is dropped.
    assert results["skipped_updates"] == 3
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/skipped_updates")] == [1.0, 2.0]
    first = saved_state(tmp_path, 3)["params"]
    assert_same_tree(first, saved_state(tmp_path, 4)["params"])


@pytest.mark.slow("long")
def test_shard_map_strategy_matches_pmap_on_four_devices(tmp_path):
    runs = {}
    for strategy in ("pmap", "shard_map"):
        config = tiny_config("steps=4", "batch_size=8", "device.num_devices=4", f"device.strategy={strategy}")
        runs[strategy] = train_and_evaluate(config, tmp_path / strategy)
    assert runs["shard_map"]["num_devices"] == 4
    assert runs["shard_map"]["train_loss"] == pytest.approx(runs["pmap"]["train_loss"], rel=1e-5)
    assert runs["shard_map"]["eval_loss"] == pytest.approx(runs["pmap"]["eval_loss"], rel=1e-5)
    a, b = (saved_state(tmp_path / strategy, 4)["params"] for strategy in ("pmap", "shard_map"))
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_run_alone_whose_step_cannot_be_built_leaves_no_tensorboard_run(tmp_path, monkeypatch):
    """A run alone builds its step functions before its reporter (rnnlab.trainer's one orchestration): a step that
    cannot be built raises as it is and leaves no TensorBoard run with a session that never ends."""
    from rnnlab import config as cfg
    from rnnlab import population

    def refuse(*args, **kwargs):
        raise cfg.ConfigError("key 'data.eval_batches': a stand-in refusal")

    monkeypatch.setattr(population, "make_step_functions", refuse)
    with pytest.raises(cfg.ConfigError, match="stand-in"):
        train_and_evaluate(tiny_config(), tmp_path)
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "results.json").exists()


def test_a_run_alone_keeps_the_error_that_stopped_it_when_its_last_save_then_fails(tmp_path, monkeypatch, caplog):
    """A run alone trains as a population of one, but its end is its run's: an error in the loop (here an eval
    that fails) stays what ends it and what is raised, though the save in flight then fails too (`train_loop` keeps
    the first error), and the population's member lines ("the other members go on") are not written."""
    from rnnlab import checkpoint, steps

    def eval_fails(self, state, should_stop=None):
        raise RuntimeError("a stand-in eval failure")

    def wait_fails(self):
        raise self._save_failed(OSError(28, "No space left on device"))

    monkeypatch.setattr(steps.StepFunctions, "evaluate", eval_fails)
    monkeypatch.setattr(checkpoint.Checkpointer, "wait", wait_fails)
    with pytest.raises(RuntimeError, match="stand-in eval failure"):
        train_and_evaluate(tiny_config("steps=4", "eval_every=4", "checkpoint.every=4"), tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["status"] == "failed" and "stand-in eval failure" in results["error"]
    assert "cannot save a checkpoint" not in caplog.text and "other members" not in caplog.text
