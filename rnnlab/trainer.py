"""Setup of a training run and `train_and_evaluate`, the one call that runs a whole job.

Restore order: this run dir's newest restorable checkpoint, else a fresh initialisation.
The state is unreplicated (NumPy) for the checkpointer and replicated inside the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import jax

from rnnlab import config as cfg
from rnnlab import cpu, flops, memory, parallel, tasks
from rnnlab.board import describe_run
from rnnlab.checkpoint import CheckpointError, Checkpointer, CheckpointSaveError
from rnnlab.loop import MAX_STEPS_IN_FLIGHT, train_loop
from rnnlab.metrics import MetricWriter, hparam_metric_tags, write_results
from rnnlab.models import build_model, count_params, summary_table
from rnnlab.profiling import StepProfiler
from rnnlab.progress import ProgressBar
from rnnlab.run import NonFiniteLossError, Run
from rnnlab.rundir import DEVICES_USED_KEY, DISPATCH_USED_KEY, RunDirLock, resume_changes, task_widths
from rnnlab.steps import (PARAMS_STREAM, create_train_state, default_steps_per_dispatch, make_dispatch, make_evaluator,
                          make_gradient_probe, make_optimizer)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Setup:
    """What `train_and_evaluate` builds before the loop, all but the compiled functions."""

    config: cfg.Config
    workdir: Path
    task: tasks.Task
    model: Any
    tx: Any
    schedule: Any
    params_key: jax.Array
    checkpointer: Checkpointer
    devices: list
    steps_per_dispatch: int
    primary: bool
    device_note: str = ""  # how the device count was chosen, for the start line


def train_and_evaluate(config: cfg.Config, workdir: Path | str, overrides: Sequence[str] = (),
                       varied: Sequence[str] | None = None) -> dict[str, Any]:
    """Train `config` in run dir `workdir` (resuming there if it holds checkpoints); returns results.json's dict.
    `overrides`: the command line's `key=value`s, which TensorBoard shows as text; `varied`: those that tell
    this job apart from the others of its sweep (None: all of them), registered first as HParams.

    Raises ConfigError for bad input (before anything compiles: a held run dir, a refused
    resume change, a step that cannot fit in memory included), CheckpointError if no
    checkpoint of the run dir can be restored, CheckpointSaveError or OSError if the run dir
    cannot be written, NonFiniteLossError if training diverges (with on_nonfinite=stop).
    Once training has started, results.json is written in every case the disk allows:
    `status` is "completed", "preempted" (SIGTERM/first SIGINT), "diverged", "aborted"
    (second SIGINT) or "failed", and `error` says why it stopped early.
    """
    wall_start = time.perf_counter()
    workdir = Path(workdir)
    _check_writable(workdir)
    parallel.configure_backend(config.device, config.batch_size, config.distributed.enabled)
    parallel.initialize_distributed(config.distributed, config.device.platform)
    devices = parallel.select_devices(config.device, config.batch_size)
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(RunDirLock(workdir, jax.process_index()))
        checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint.every, config.checkpoint.keep)
        cleanup.callback(checkpointer.close)  # on any failure: Orbax's threads end, the process can exit
        try:
            setup = _set_up(config, workdir, devices, checkpointer)
            state, start_step = _restore_or_init(setup)
            run = _make_run(setup, start_step, overrides, overrides if varied is None else varied)
            cleanup.callback(run.writer.close)
            num_params = count_params(state.params)
            state = run.dp.replicate(state)
            _compile_and_check_memory(run, state)
        except Exception as e:
            if memory.is_out_of_memory(e):
                raise memory.out_of_memory_error(e, config) from None
            raise
        _log_start(run, num_params, setup.device_note)
        return _train(run, setup, state, start_step, num_params, wall_start)


def _set_up(config: cfg.Config, workdir: Path, devices: list, checkpointer: Checkpointer) -> _Setup:
    """Task, model, optimizer and the device count; refuses a run dir it must not resume, and a run that cannot fit."""
    primary = parallel.is_primary()
    if not primary:  # one voice: process 0 logs, writes events, results.json and the summary
        log.setLevel(logging.WARNING)
    _log_pinning(devices)
    parallel.check_batch_divides(config.batch_size, len(devices))
    task = tasks.make_task(config.data)
    latest = checkpointer.latest_step()
    saved = None
    if latest is not None:
        if not config.checkpoint.resume:
            raise cfg.ConfigError(
                f"key 'checkpoint.resume': false, but {checkpointer.directory} already holds step {latest}; "
                f"use a new hydra.run.dir, or checkpoint.resume=true to continue it"
            )
        saved = checkpointer.saved_record()
        if saved is None:
            raise CheckpointError(f"no checkpoint in {checkpointer.directory} can be restored (none has a readable "
                                  f"config item: damaged, or written before checkpoints carried their config); "
                                  f"move them away or use a new hydra.run.dir")
        recorded_config = saved[1]["run_config"]  # the device count is compared once it is chosen
        resume_changes(recorded_config, _now(config, recorded_config.get(DEVICES_USED_KEY), None),
                       config.checkpoint.allow_changes)
    tx, schedule = make_optimizer(config.optimizer, config.steps)
    model = build_model(config.model, task.output_dim, devices[0].platform, task.input_dim)
    setup = _Setup(config, workdir, task, model, tx, schedule,
                   jax.random.fold_in(jax.random.key(config.seed), PARAMS_STREAM), checkpointer, devices,
                   config.device.steps_per_dispatch or default_steps_per_dispatch(devices[0].platform), primary)
    _check_state_fits(setup)
    if cpu.device_count_is_open(config.device.num_devices, devices):
        recorded = saved[1]["run_config"].get(DEVICES_USED_KEY) if saved else None
        setup.devices, setup.device_note = _fastest_devices(setup, recorded)
    return setup


def _now(config: cfg.Config, num_devices: int | None, steps_per_dispatch: int | None) -> dict[str, Any]:
    """The run record's flat config: `config` with the resolved device count and dispatch size, as
    JSON gives it back (lists, not tuples), so that it compares equal to a saved one."""
    flat = {**cfg.flatten(config), **task_widths(tasks.make_task(config.data)), DISPATCH_USED_KEY: steps_per_dispatch}
    if num_devices is not None:
        flat[DEVICES_USED_KEY] = num_devices
    return json.loads(json.dumps(flat))


def _check_state_fits(setup: _Setup) -> None:
    """Before anything is allocated: the train state (on the host and on each local device) and
    the batches (train and eval) must fit in the free memory (shapes only, nothing computed)."""
    config, task = setup.config, setup.task
    example = task.input_spec(1)
    state = jax.eval_shape(lambda x: create_train_state(setup.params_key, setup.model, x, setup.tx), example)
    stream = tasks.stream_key(config.seed, tasks.TRAIN_STREAM)
    # A train batch and the eval batches of every evaluated length stay on the devices.
    evaluated = [task] + [task.with_seq_len(n) for n in config.data.eval_seq_lens if n != config.data.seq_len]
    sizes = [memory.tree_bytes(jax.eval_shape(lambda t=t: tasks.sample_batch(t, stream, 0, 0, config.batch_size)))
             for t in evaluated]
    local = parallel.local_count(setup.devices)
    batches = (sizes[0] + config.eval_batches * sum(sizes)) / max(1, jax.process_count())
    memory.check_fits("the train state and the batches", host_bytes=memory.tree_bytes(state),
                      device_bytes=memory.tree_bytes(state) + batches / local, devices=setup.devices, config=config)


def _log_pinning(devices: list) -> None:
    if os.environ.get(cpu.PIN_CPU_ENV) != "1" or devices[0].platform != "cpu":
        return
    if cpu.pinned_core() is None:
        log.warning("%s=1, but every core is held by another pinned process: this one is not pinned", cpu.PIN_CPU_ENV)
    else:
        log.info("pinned to CPU core %d (%s=1)", cpu.pinned_core(), cpu.PIN_CPU_ENV)


def _fastest_devices(setup: _Setup, recorded: int | None) -> tuple[list, str]:
    """`device.num_devices=null` on CPU: 1 device or all of them, whichever trains faster
    (`cpu.choose_device_count`), and 1 without timing for a step too small to gain from more
    (`cpu.device_count_needs_measuring`). A resumed run keeps the count its run dir recorded, so that
    it continues with the same numerics."""
    config, devices, k = setup.config, setup.devices, setup.steps_per_dispatch
    if recorded is not None:
        count = recorded if recorded <= len(devices) and config.batch_size % recorded == 0 else 1
        return devices[:count], f" (device.num_devices=null: {count}, as this run dir was trained)"
    task = setup.task
    step_flops = flops.train_step_flops(config.model, task.input_dim, task.output_dim,
                                        config.batch_size * task.total_len, task.total_len, task.token_inputs)
    if not cpu.device_count_needs_measuring(step_flops, task.total_len):
        return devices[:1], (f" (untimed: {step_flops / task.total_len / 1e6:.2g} MFLOP a time step"
                              f" < {cpu.MEASURE_ABOVE_FLOPS_PER_TIME_STEP / 1e6:g})")

    def seconds_per_step(n: int) -> float:
        dp = parallel.DataParallel(devices[:n], config.device.strategy)
        per_device = config.batch_size // n
        example = setup.task.example_inputs(per_device)
        state = dp.replicate(create_train_state(setup.params_key, setup.model, example, setup.tx))
        dispatch = make_dispatch(config, setup.task, setup.schedule, dp, per_device, k)
        _check_step_fits(dispatch.compile(state), devices[:n], config)
        return cpu.seconds_per_step(dispatch, state, k, MAX_STEPS_IN_FLIGHT)

    candidates = [1, len(devices)]
    key = json.dumps({"device": flops.device_key(devices[0]), "candidates": candidates,
                      "xla_flags": cpu.with_cpu_xla_flags(os.environ.get("XLA_FLAGS", "")), "batch": config.batch_size,
                      "data": dataclasses.asdict(config.data), "model": dataclasses.asdict(config.model),
                      "strategy": config.device.strategy, "steps_per_dispatch": k}, sort_keys=True)
    cache_file = flops.cache_path().with_name("device_count.json")
    count, timings, cached = cpu.choose_device_count(key, candidates, seconds_per_step, cache_file)
    measured = ", ".join(f"{n}: {1e3 * t:.1f}" for n, t in sorted(timings.items()))
    return devices[:count], f" (device.num_devices=null: fastest of {measured} ms{'; cached' if cached else ''})"


def _restore_or_init(setup: _Setup) -> tuple[Any, int]:
    """(unreplicated state, its step): this run dir's newest restorable checkpoint, else a fresh one.
    Either way the run record (config, accepted changes) that later checkpoints carry is kept."""
    config, task = setup.config, setup.task
    per_device = parallel.check_batch_divides(config.batch_size, len(setup.devices))
    example = task.example_inputs(per_device)
    if setup.primary:
        summary = summary_table(setup.model, example)
        (setup.workdir / "model_summary.txt").write_text(summary)
        print(summary)
    state = create_train_state(setup.params_key, setup.model, example, setup.tx)
    now = _now(config, len(setup.devices), setup.steps_per_dispatch)
    history: list = []
    restored = setup.checkpointer.restore_latest(state)
    if restored is not None:
        state, step, record = restored
        changes = resume_changes(record["run_config"], now, config.checkpoint.allow_changes)
        history = record["config_history"] + ([{"step": step, "changes": changes}] if changes else [])
        log.info("resumed from %s at step %d", setup.checkpointer.directory, step)
        if changes:
            log.warning("resuming at step %d with accepted changes: %s", step,
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    setup.checkpointer.keep_record({"run_config": now, "config_history": history}, write_files=setup.primary)
    return state, int(state.step)


def _make_run(setup: _Setup, start_step: int, overrides: Sequence[str] = (), varied: Sequence[str] = ()) -> Run:
    """The compiled dispatch and eval step, the eval batches, the writers and the throughput figures."""
    config, task, devices = setup.config, setup.task, setup.devices
    per_device = config.batch_size // len(devices)
    dp = parallel.DataParallel(devices, config.device.strategy)
    tokens_per_step = config.batch_size * task.total_len
    # The peak of the devices this run trains on (with device=cpu on a GPU machine, not JAX's default backend's).
    local_device = next(d for d in devices if d.process_index == jax.process_index())
    run = Run(
        config=config, workdir=setup.workdir, task=task, devices=devices, dp=dp,
        dispatch=make_dispatch(config, task, setup.schedule, dp, per_device, setup.steps_per_dispatch),
        steps_per_dispatch=setup.steps_per_dispatch,
        evaluator=make_evaluator(config, task, per_device, dp),
        # One eval step and its batches per further length (data.seq_len's own is the usual eval's).
        length_evaluators={n: make_evaluator(config, task.with_seq_len(n), per_device, dp)
                           for n in config.data.eval_seq_lens if n != config.data.seq_len},
        checkpointer=setup.checkpointer,
        writer=MetricWriter(setup.workdir / "tensorboard", purge_step=start_step + 1 if start_step else None,
                            enabled=setup.primary),
        tokens_per_step=tokens_per_step,
        flops_per_step=flops.train_step_flops(config.model, task.input_dim, task.output_dim, tokens_per_step,
                                              task.total_len, task.token_inputs, len(devices)),
        peak_flops=flops.peak_flops(local_device, flops.model_peak_kind(config.model.dtype)),  # cached, else ~1 s
        profiler=StepProfiler(config.profile, setup.workdir / "tensorboard"),
        progress=ProgressBar(config.steps, start_step),
        gradient_probe=make_gradient_probe(config, task, per_device, dp) if config.log.histograms_every else None,
    )
    flat = cfg.flatten(config) | {"state_floats": run.state_floats}
    describe_run(run.writer, cfg.to_dict(config), flat, overrides, varied, hparam_metric_tags(
        task.metric_names, config.data.eval_seq_lens), task.metric_names, config.data.eval_seq_lens,
        layer_norms=config.log.histograms_every > 0)
    return run


def _compile_and_check_memory(run: Run, state: Any) -> None:
    """Compile the train dispatch ahead of its first call, and refuse it if XLA's memory analysis
    says it cannot fit beside the (already resident) state. With several processes the first call
    compiles it (an ahead-of-time executable there rejects the processes' global arrays)."""
    if jax.process_count() > 1:
        return
    run.progress.phase("compiling")
    started = time.perf_counter()
    stats = run.dispatch.compile(state)
    run.compile_seconds = time.perf_counter() - started
    _check_step_fits(stats, run.devices, run.config)


def _check_step_fits(stats: Any, devices: list, config: cfg.Config) -> None:
    if stats is not None:
        memory.check_fits("the train step", host_bytes=0.0, device_bytes=memory.compiled_bytes(stats),
                          devices=devices, config=config)


def _log_start(run: Run, num_params: int, device_note: str) -> None:
    task, devices = run.task, run.devices
    log.info("%s task (T=%d, baseline loss %.4f) | %s, %s params | %s tokens/step, %.3g FLOPs/step", task.name,
             task.seq_len, task.baseline_loss, run.config.model.cell, f"{num_params:,}", f"{run.tokens_per_step:,}",
             run.flops_per_step)
    log.info("%d %s device(s) x batch %d | %d steps/dispatch%s", len(devices), devices[0].platform,
             run.config.batch_size // len(devices), run.steps_per_dispatch, device_note)


def _train(run: Run, setup: _Setup, state: Any, start_step: int, num_params: int, wall_start: float) -> dict[str, Any]:
    """The loop, then results.json whatever happened (as far as the disk allows); returns its dict."""
    status, step, error = "completed", None, None
    try:
        status, state = train_loop(run, state, start_step)
        if jax.process_count() > 1:  # every process must end holding the same parameters
            from jax.experimental import multihost_utils

            multihost_utils.assert_equal(run.dp.to_host(state.params), "processes ended with different parameters")
    except NonFiniteLossError as e:
        status, step, error = "diverged", e.step, e
    except KeyboardInterrupt as e:
        status, error = "aborted", e
    except Exception as e:  # noqa: BLE001 - recorded in results.json, then raised again
        status, error = "failed", memory.out_of_memory_error(e, run.config) if memory.is_out_of_memory(e) else e
    run.progress.close()
    run.profiler.stop()
    try:
        run.checkpointer.wait()  # an async save in flight completes whatever happened
    except CheckpointSaveError as e:
        status, error = ("failed", e) if error is None else (status, error)
    results = run.results(status, step or max(start_step, run.final_step), num_params, wall_start,
                          error=_one_line(error) if error is not None else None)
    if setup.primary:
        try:
            write_results(setup.workdir / "results.json", results)
        except OSError as e:
            log.error("cannot write %s (%s)", setup.workdir / "results.json", e.strerror or e)
    try:
        run.writer.close(status)
    except OSError as e:
        log.error("cannot write the TensorBoard events (%s)", e.strerror or e)
    if error is not None:
        raise error
    metrics = "".join(f" | {k} {v:.4g}" for k, v in results["eval_metrics"].items() if v not in (None, results["eval_loss"]))
    log.info(
        "%s at step %d | eval loss %.4g (baseline %.4g)%s | %s tokens/s | compile %.1fs | wall %.1fs",
        status, results["step"], results["eval_loss"] or float("nan"), run.task.baseline_loss, metrics,
        f"{results['tokens_per_sec']:,.0f}" if results["tokens_per_sec"] else "n/a",
        results["compile_seconds"] or 0.0, results["wall_seconds"],
    )
    return results


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def _check_writable(workdir: Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test.{os.getpid()}"  # per process: several may share the run dir
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise cfg.ConfigError(f"run dir {workdir} is not writable ({e.strerror or e}); choose hydra.run.dir") from None
