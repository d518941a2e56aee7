"""What a run fixes before anything compiles, as one frozen value (`Setup`): the config, the run dir,
the task, the model, the optimizer and the devices it trains on. `plan` builds it and first refuses
what must not run: a batch that does not split over the devices, a resume the run dir does not
allow, a train state and batches that cannot fit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import optax

from rnnlab import config as cfg
from rnnlab import cpu, flops, memory, parallel, rundir, tasks
from rnnlab.checkpoint import Checkpointer
from rnnlab.models import build_model, initial_state
from rnnlab.steps import (MAX_STEPS_IN_FLIGHT, PARAMS_STREAM, Members, PopulationState, carries_state,
                          create_train_state, default_steps_per_dispatch, eval_block_len, make_dispatch, make_optimizer,
                          run_once_options)

# The run's lines come from one logger (as when trainer.py wrote them all): processes other than 0 quiet it.
log = logging.getLogger("rnnlab.trainer")


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: it holds devices, a model, a key
class Setup:
    """A run's fixed context: what `train_and_evaluate` builds before anything compiles."""

    config: cfg.Config
    workdir: Path  # the run dir
    task: tasks.Task
    model: nn.Module
    tx: optax.GradientTransformation  # steps.make_optimizer's
    params_key: jax.Array  # the initialisation's random key
    devices: tuple[jax.Device, ...]  # the devices it trains on (device.num_devices=null resolved)
    steps_per_dispatch: int  # device.steps_per_dispatch (null resolved)
    primary: bool  # process 0: the one voice (console, TensorBoard events, results.json, the summary)
    device_note: str = ""  # how the device count was chosen, for the start line

    @property
    def per_device(self) -> int:
        return self.config.batch_size // len(self.devices)

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.task.total_len

    @property
    def state_floats(self) -> int:
        """Floats of recurrent state per layer and example at the training length (`Cell.state_floats`); for a
        hybrid (`model.pattern`) the mean over its layers, rounded (`model_state_floats` / num_layers)."""
        model = self.config.model
        if len(model.layer_cells()) == 1:
            return model.make_cell().state_floats(self.task.total_len)
        return round(self.model_state_floats / model.num_layers)

    @property
    def model_state_floats(self) -> int:
        """Floats of recurrent state of the whole model per example at the training length: each layer's own
        cell's (`Cell.state_floats`), summed over the layers."""
        model = self.config.model
        specs = model.layer_cells()
        groups = model.num_layers // len(specs)
        return groups * sum(spec.make(model.hidden_dim).state_floats(self.task.total_len) for spec in specs)

    def step_flops(self, devices: int = 1) -> int:
        """Model FLOPs of one train step over the global batch (`flops.train_step_flops`), of the forms the model
        runs on this platform (its config as `build_model` resolved it)."""
        task = self.task
        return flops.train_step_flops(self.model.config, task.input_dim, task.output_dim, self.tokens_per_step,
                                      task.total_len, task.token_inputs, devices, self.model.layer_cells)

    def example_inputs(self) -> Any:
        """One device's batch of model inputs (zeros)."""
        return self.task.example_inputs(self.per_device)

    def init_state(self) -> Any:
        """The unreplicated initial train state."""
        return create_train_state(self.params_key, self.model, self.example_inputs(), self.tx,
                                  run_once_options(self.devices[0].platform), self.carry_batch)

    @property
    def carry_batch(self) -> int:
        """The streams whose model state the train state carries (`steps.carries_state`: the global batch); 0: none."""
        return self.config.batch_size if carries_state(self.task) else 0


def plan(config: cfg.Config, workdir: Path, devices: list, checkpointer: Checkpointer) -> Setup:
    """The run's `Setup` on `devices` (with `device.num_devices=null` on CPU: 1 or all of them,
    `_device_count`). Refuses a batch that does not divide, a run dir it must not resume (its
    record in `checkpointer`), and a run that cannot fit."""
    primary = parallel.is_primary()
    if not primary:  # one voice: process 0 logs, writes events, results.json and the summary
        log.setLevel(logging.WARNING)
    _log_pinning(devices)
    parallel.check_batch_divides(config.batch_size, len(devices))
    task = tasks.make_task(config.data)
    if carries_state(task):
        check_stream_task(config, task)
    saved = rundir.saved_run_config(checkpointer, config.checkpoint.resume)
    recorded = saved.get(rundir.DEVICES_USED_KEY) if saved is not None else None
    if saved is not None:  # the device count is compared once it is chosen (trainer's restore)
        rundir.resume_changes(saved, rundir.run_record(config, task, recorded, None), config.checkpoint.allow_changes)
    tx, _ = make_optimizer(config.optimizer, config.steps)
    platform = devices[0].platform
    setup = Setup(config=config, workdir=Path(workdir), task=task, tx=tx,
                  model=build_model(config.model, task.output_dim, platform, task.input_dim),
                  params_key=jax.random.fold_in(jax.random.key(config.seed), PARAMS_STREAM), devices=tuple(devices),
                  steps_per_dispatch=config.device.steps_per_dispatch or default_steps_per_dispatch(platform),
                  primary=primary)
    _check_fits(setup)
    if not cpu.device_count_is_open(config.device.num_devices, devices):
        return setup
    count, note = _device_count(setup, recorded)
    return dataclasses.replace(setup, devices=setup.devices[:count], device_note=note)


def check_stream_task(config: cfg.Config, task: tasks.Task) -> None:
    """data=text: read the corpus and lay out its streams (a corpus that cannot be had, or a training text too short
    for the batch: ConfigError, one line, exit 2). What its streams cannot do at all (a full attention cache,
    data.eval_seq_lens) the config refuses (`rnnlab.config`), before any I/O."""
    from rnnlab import corpora  # noqa: PLC0415 - only data=text reads a corpus

    try:
        task.splits
        task.train_layout(config.batch_size)
        task.eval_layout("valid")
    except corpora.CorpusError as e:
        raise cfg.ConfigError(str(e)) from None
    except ValueError as e:
        raise cfg.ConfigError(f"key 'batch_size': {e}") from None


def _check_fits(setup: Setup) -> None:
    """Before anything is allocated: the train state and the batches, as shapes (`memory.check_state_fits`), then
    the evaluation beside them: a stream task's streams (`memory.check_stream_eval_fits`: data.eval_streams), or
    the further lengths evaluated whole, with the forward of the longest (`memory.check_eval_batches_fit`), and
    the model's state at the longest one run in segments with a segment's forward (`memory.check_eval_state_fits`)."""
    config, task = setup.config, setup.task
    state = jax.eval_shape(lambda x: create_train_state(setup.params_key, setup.model, x, setup.tx,
                                                        carry_batch=setup.carry_batch), task.input_spec(1))
    stream = tasks.stream_key(config.seed, tasks.TRAIN_STREAM)
    shape = lambda t: jax.eval_shape(lambda: tasks.sample_batch(t, stream, 0, 0, config.batch_size))  # noqa: E731
    kept = memory.layer_outputs_bytes(config, setup.per_device, task.total_len)
    if carries_state(task):  # no eval batches: the held-out text through data.eval_streams streams
        batches = [shape(task)]
        memory.check_state_fits(state, batches, setup.devices, config, kept)
        _check_stream_eval_fits(setup, state, batches, kept)
        return
    evaluated = {task.seq_len: task} | {n: task.with_seq_len(n) for n in config.data.eval_seq_lens if n != task.seq_len}
    segment = config.data.eval_segment_len
    whole = {n: t for n, t in evaluated.items() if segment is None or t.total_len <= segment}  # the rest never exist whole
    batches = [shape(task)] + ([shape(task)] if task.seq_len in whole else [])
    longest = max((t.total_len for t in evaluated.values() if t not in whole.values()), default=0)
    if longest:  # the model's state at the longest length run in segments (attention's cache grows with it)
        block = eval_block_len(segment, setup.per_device)
        memory.check_eval_state_fits(
            memory.tree_bytes(jax.eval_shape(lambda: initial_state(setup.model, setup.per_device, longest))), longest,
            setup.devices, config, memory.forward_bytes(config, task.output_dim, setup.per_device, block), block)
    memory.check_state_fits(state, batches, setup.devices, config, kept)
    extra = {n: shape(t) for n, t in whole.items() if n != task.seq_len}
    forward = max((memory.forward_bytes(config, task.output_dim, setup.per_device, t.total_len)
                   for n, t in whole.items() if n != task.seq_len), default=0.0)
    memory.check_eval_batches_fit(state, batches, extra, setup.devices, config, kept, forward, task.segmentable())


def _check_stream_eval_fits(setup: Setup, state: Any, batches: list, kept: float) -> None:
    """A stream task's evaluation (`steps.make_stream_evaluator`) beside training: per device, a row per stream
    holding its model state (carried, fresh, the next) and two forwards of a segment (state carried and reset),
    and the held-out split replicated (the larger of validation and test)."""
    config, task = setup.config, setup.task
    row_state = memory.tree_bytes(jax.eval_shape(lambda: initial_state(setup.model, 1)))
    per_stream = 3 * row_state + 2 * memory.forward_bytes(config, task.output_dim, 1, task.seq_len)
    splits = [task.splits[name] for name in ("valid", "test")]
    windows = [len(split.window_starts(task.seq_len)) for split in splits]
    split_bytes = max(len(split) + 4.0 * (len(split.starts) + n) for split, n in zip(splits, windows))
    memory.check_stream_eval_fits(state, batches, setup.devices, config, kept, task.eval_streams, per_stream,
                                  split_bytes, max(windows))


def _log_pinning(devices: list) -> None:
    if os.environ.get(cpu.PIN_CPU_ENV) != "1" or devices[0].platform != "cpu":
        return
    if cpu.pinned_core() is None:
        log.warning("%s=1, but every core is held by another pinned process: this one is not pinned", cpu.PIN_CPU_ENV)
    else:
        log.info("pinned to CPU core %d (%s=1)", cpu.pinned_core(), cpu.PIN_CPU_ENV)


def _device_count(setup: Setup, recorded: int | None) -> tuple[int, str]:
    """`cpu.fastest_device_count` of this model shape: its measurements are cached by device, batch,
    data, model, strategy and dispatch size."""
    config = setup.config
    key = {"device": flops.device_key(setup.devices[0]), "batch": config.batch_size,
           "data": dataclasses.asdict(config.data), "model": dataclasses.asdict(config.model),
           "strategy": config.device.strategy, "steps_per_dispatch": setup.steps_per_dispatch}
    return cpu.fastest_device_count(len(setup.devices), config.batch_size, recorded, setup.step_flops(),
                                    setup.task.total_len, key, functools.partial(_seconds_per_step, setup))


def _seconds_per_step(setup: Setup, n: int) -> float:
    """Seconds per train step on the first `n` devices: the run's dispatch compiled (refused if it cannot
    fit), warmed up and timed (`cpu.seconds_per_step`)."""
    config, devices, k = setup.config, setup.devices[:n], setup.steps_per_dispatch
    dp = parallel.DataParallel(devices, config.device.strategy)
    per_device = config.batch_size // n
    example = setup.task.example_inputs(per_device)
    state = dp.replicate(PopulationState.stack([create_train_state(setup.params_key, setup.model, example, setup.tx,
                                                                   carry_batch=setup.carry_batch)]))
    dispatch = make_dispatch(config, setup.task, dp, per_device, k, Members.population([config]))  # what trains
    memory.check_step_fits(dispatch.compile(state), devices, config)
    return cpu.seconds_per_step(dispatch, state, k, MAX_STEPS_IN_FLIGHT)
