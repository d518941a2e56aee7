"""Training state, the pure train/eval steps, and the training loop (`train_and_evaluate`).

Inside the loop the state is always in the replicated layout of `parallel.DataParallel`
(pmap: leaves carry a leading device axis; shard_map: one replicated global array); the
checkpointer sees it unreplicated, as NumPy.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from rnnlab import config as cfg
from rnnlab import data, flops, parallel
from rnnlab.checkpoint import Checkpointer, PreemptionGuard
from rnnlab.metrics import MetricWriter, ThroughputClock, finite_or_none, write_results
from rnnlab.models import RecurrentModel, count_params, default_unroll, summary_table
from rnnlab.profiling import StepProfiler
from rnnlab.progress import ProgressBar

log = logging.getLogger(__name__)

# pmap over simulated CPU devices aborts (all-reduce timeout) with ~50 steps queued
# without a host sync; the loop never queues more than this many, on every backend.
MAX_STEPS_IN_FLIGHT = 16
assert 2 * cfg.MAX_STEPS_PER_DISPATCH <= MAX_STEPS_IN_FLIGHT
DEVICES_USED_KEY = "device.num_devices_used"  # in checkpoints/run_config.json: what a resumed run keeps
DISPATCH_USED_KEY = "device.steps_per_dispatch_used"  # in checkpoints/run_config.json: recorded only (any count resumes alike)
PARAMS_STREAM = 2
DROPOUT_STREAM = 3


class NonFiniteLossError(RuntimeError):
    """The training loss or gradient norm became NaN or Inf at `step`."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def make_optimizer(config: cfg.OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping -> optimizer, with a learning-rate schedule over `total_steps`.

    `schedule(s)` is the learning rate of the update that takes the state from step s-1
    to s: linear warm-up reaches `lr` at s = warmup_steps (the first update already
    moves, at lr / warmup_steps), then cosine decay to `end_lr_ratio * lr` at the
    last step, or constant.
    """
    warmup = min(config.warmup_steps, total_steps)
    if config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(config.lr, max(total_steps - warmup, 1), alpha=config.end_lr_ratio)
    else:
        decay = optax.constant_schedule(config.lr)
    if warmup:
        schedule = optax.join_schedules([optax.linear_schedule(0.0, config.lr, warmup), decay], [warmup])
    else:
        schedule = decay
    # Optax calls the schedule with the number of updates applied so far.
    lr = lambda count: schedule(count + 1)  # noqa: E731
    if config.name == "adam":
        opt = optax.chain(optax.add_decayed_weights(config.weight_decay), optax.adam(lr, config.b1, config.b2))
    elif config.name == "adamw":
        opt = optax.adamw(lr, config.b1, config.b2, weight_decay=config.weight_decay)
    elif config.name == "sgd":
        opt = optax.chain(optax.add_decayed_weights(config.weight_decay), optax.sgd(lr, momentum=config.momentum or None))
    else:
        raise ValueError(f"unknown optimizer {config.name!r}")
    clip = optax.clip_by_global_norm(config.clip_norm) if config.clip_norm > 0 else optax.identity()
    return optax.chain(clip, opt), schedule


def create_train_state(
    key: jax.Array, model: nn.Module, example_inputs: jax.Array, tx: optax.GradientTransformation
) -> train_state.TrainState:
    """Unreplicated initial state. example_inputs: f32[B, T, I] (only shapes matter)."""
    params = jax.jit(model.init)(key, example_inputs)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # A strongly typed step: a weakly typed Python 0 would make the second step recompile.
    return state.replace(step=jnp.zeros((), jnp.int32))


def train_step(
    state: train_state.TrainState,
    batch: data.Batch,
    task: data.Task,
    schedule: optax.Schedule,
    skip_nonfinite: bool = False,
    seed: int = 0,
) -> tuple[train_state.TrainState, dict[str, jax.Array]]:
    """One optimizer update on this device's shard; gradients and metrics averaged over `AXIS`.

    skip_nonfinite: if the loss or gradient norm is NaN/Inf, keep the old parameters and
    optimizer state (the step counter still advances, so the data stream moves on) and
    report `skipped` = 1.
    """

    # Dropout masks from (seed, step, device index): a resumed run draws the same ones.
    dropout_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), DROPOUT_STREAM), state.step)
    dropout_key = jax.random.fold_in(dropout_key, jax.lax.axis_index(parallel.AXIS))

    def loss_fn(params):
        outputs = state.apply_fn({"params": params}, batch.inputs, train=True, rngs={"dropout": dropout_key})
        return task.loss_and_metric(outputs, batch.targets)

    (loss, metric), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = jax.lax.pmean(grads, parallel.AXIS)
    metrics = jax.lax.pmean({"loss": loss, task.metric_name: metric}, parallel.AXIS)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = schedule(state.step + 1)
    new_state = state.apply_gradients(grads=grads)
    if skip_nonfinite:
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        keep_old = state.replace(step=new_state.step)
        new_state = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old), new_state, keep_old)
        metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
    return new_state, metrics


def eval_step(state: train_state.TrainState, batch: data.Batch, task: data.Task) -> dict[str, jax.Array]:
    outputs = state.apply_fn({"params": state.params}, batch.inputs)
    loss, metric = task.loss_and_metric(outputs, batch.targets)
    return jax.lax.pmean({"loss": loss, task.metric_name: metric}, parallel.AXIS)


def make_sampler(task: data.Task, stream: jax.Array, per_device: int, dp: parallel.DataParallel) -> Callable:
    """`step -> Batch` on every device: each device draws its own slice of the global batch."""

    def sample(step):
        first = jax.lax.axis_index(parallel.AXIS) * per_device
        return data.sample_batch(task, stream, step, first, per_device)

    return dp.map(sample, (parallel.REPLICATED,), parallel.SHARDED)


def pmap_sampler(task: data.Task, stream: jax.Array, per_device: int, devices: list) -> Callable:
    """`make_sampler` with pmap: `step[num_devices] -> Batch` with a leading device axis."""
    return make_sampler(task, stream, per_device, parallel.DataParallel(devices, "pmap"))


def train_metric_names(task: data.Task, skip_nonfinite: bool) -> tuple[str, ...]:
    """The keys of `train_step`'s metrics, in the order `_p_train_steps` stacks them."""
    return ("loss", task.metric_name, "grad_norm", "lr") + (("skipped",) if skip_nonfinite else ())


def default_steps_per_dispatch(platform: str) -> int:
    """`device.steps_per_dispatch=null`: 8 on CPU, where each dispatch has a fixed cost
    (`scripts/benchmark.py --rows 0 3 --dispatch 1 4 8`: 8 per dispatch took 0.5-1.8 ms less a
    step than 1, 1.09-1.22x faster, on 1 and 2 devices) and allocates XLA's temporary buffer
    afresh, which the kernel then faults in page by page (`--cells lstm --rows 1 --dispatch 1 8`:
    for the LSTM at H=256, L=2, 0.26 against 0.03 s of kernel time and 695 against 591 ms a
    step); 1 on GPU/TPU, where the device runs
    ahead of the host (H100, Elman H=100: the loop kept 0.80 of the bare step's tokens/s at 8
    per dispatch, 0.91-0.93 at 1)."""
    return 8 if platform == "cpu" else 1


def _p_train_steps(config: cfg.Config, task: data.Task, schedule: optax.Schedule, dp: parallel.DataParallel,
                   per_device: int, max_steps: int = 1) -> Callable:
    """`dispatch(state, n)`: n <= max_steps consecutive train steps in one dispatch, each with
    its batch drawn on the devices -> (state, f32[max_steps, len(train_metric_names)]),
    row i holding step i's metrics (rows >= n unused; with max_steps=1 one row, f32[len(names)]);
    state donated.

    Drawing the batch inside the step makes one dispatch per step instead of two: the loop
    kept 94% of the bare step's tokens/s with a separate sampler call at H=100
    (scripts/benchmark.py --loop). Stacking the metrics makes one device-to-host copy per
    dispatch instead of one per metric: on an H100 reading them one scalar at a time cost
    0.38 ms a step, half the step itself. With max_steps > 1 the steps run in a
    `fori_loop` whose trip count is an argument, so every n shares one compilation and the
    same loop body: a run resumed mid-way reaches the same numbers."""
    stream = data.stream_key(config.seed, data.TRAIN_STREAM)
    skip = config.on_nonfinite == "skip"
    update = functools.partial(train_step, task=task, schedule=schedule, skip_nonfinite=skip, seed=config.seed)
    names = train_metric_names(task, skip)

    def one_step(state):
        first = jax.lax.axis_index(parallel.AXIS) * per_device
        state, metrics = update(state, data.sample_batch(task, stream, state.step, first, per_device))
        return state, jnp.stack([metrics[k] for k in names])

    out_layouts = (parallel.REPLICATED, parallel.REPLICATED)
    if max_steps == 1:
        single = dp.map(one_step, (parallel.REPLICATED,), out_layouts, donate_argnums=(0,))

        def dispatch_one(state, n: int):
            if n != 1:
                raise ValueError(f"n={n} steps: this dispatch runs 1")
            return single(state)  # metrics f32[len(names)]: one row

        return dispatch_one

    def steps(state, n):
        def body(i, carry):
            state, rows = carry
            state, metrics = one_step(state)
            return state, rows.at[i].set(metrics)

        return jax.lax.fori_loop(0, n, body, (state, jnp.zeros((max_steps, len(names)), jnp.float32)))

    mapped = dp.map(steps, (parallel.REPLICATED, parallel.REPLICATED), out_layouts, donate_argnums=(0,))
    counts: dict[int, Any] = {}  # n -> its argument, built once

    def dispatch(state, n: int):
        if not 1 <= n <= max_steps:
            raise ValueError(f"n={n} steps: this dispatch runs 1 .. {max_steps}")
        if n not in counts:
            counts[n] = dp.host_scalar(n)
        return mapped(state, counts[n])

    return dispatch


def _fastest_devices(config, task, model, tx, schedule, params_key, devices, recorded: int | None,
                     steps_per_dispatch: int) -> tuple[list, str]:
    """`device.num_devices=null` on CPU: 1 device or all of `devices`, whichever trains faster.

    A resumed run keeps the count its run dir recorded (`recorded`; 1 for a run dir from
    before counts were recorded), so that it continues with the same numerics. Otherwise the
    count is measured once per machine and model and then read from the cache
    (`parallel.choose_device_count`)."""
    if recorded is not None:
        count = recorded if recorded <= len(devices) and config.batch_size % recorded == 0 else 1
        return devices[:count], f" (device.num_devices=null: {count}, as this run dir was trained)"

    def seconds_per_step(n: int) -> float:
        dp = parallel.DataParallel(devices[:n], config.device.strategy)
        per_device = config.batch_size // n
        example = jnp.zeros((per_device, task.total_len, task.input_dim), jnp.float32)
        state = dp.replicate(create_train_state(params_key, model, example, tx))
        dispatch = _p_train_steps(config, task, schedule, dp, per_device, steps_per_dispatch)
        for _ in range(3):  # compile, then warm up (the first runs after a compile are slower)
            state, metrics = dispatch(state, steps_per_dispatch)
            jax.block_until_ready(metrics)
        start = time.perf_counter()
        state, metrics = dispatch(state, steps_per_dispatch)
        jax.block_until_ready(metrics)
        # Windows of d dispatches (at most MAX_STEPS_IN_FLIGHT steps, about 50 ms): median of up to 5, within ~2 s.
        d = int(min(MAX_STEPS_IN_FLIGHT // steps_per_dispatch, max(1, 0.05 / (time.perf_counter() - start))))
        times: list[float] = []
        budget_end = time.perf_counter() + 2.0
        while len(times) < 5 and (not times or time.perf_counter() < budget_end):
            start = time.perf_counter()
            for _ in range(d):
                state, metrics = dispatch(state, steps_per_dispatch)
            jax.block_until_ready(metrics)
            times.append((time.perf_counter() - start) / (d * steps_per_dispatch))
        return float(np.median(times))

    candidates = [1, len(devices)]
    key = json.dumps({"device": flops.device_key(devices[0]), "candidates": candidates,
                      "xla_flags": parallel.with_cpu_xla_flags(os.environ.get("XLA_FLAGS", "")), "batch": config.batch_size,
                      "data": dataclasses.asdict(config.data), "model": dataclasses.asdict(config.model),
                      "strategy": config.device.strategy, "steps_per_dispatch": steps_per_dispatch}, sort_keys=True)
    cache_file = flops.cache_path().with_name("device_count.json")
    count, timings, cached = parallel.choose_device_count(key, candidates, seconds_per_step, cache_file)
    measured = ", ".join(f"{n}: {1e3 * t:.1f} ms/step" for n, t in sorted(timings.items()))
    note = f" (device.num_devices=null: fastest of {measured}{', cached' if cached else ''})"
    return devices[:count], note


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} if rows else {}


def _is_finite(row: dict[str, float]) -> bool:
    return bool(np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]))


@dataclasses.dataclass
class _Run:
    """What the loop needs beyond the state: compiled functions, sinks and counters."""

    config: cfg.Config
    workdir: Path
    task: data.Task
    devices: list
    dp: parallel.DataParallel
    p_train_steps: Callable  # _p_train_steps: (state, n) -> (state, stacked metrics)
    steps_per_dispatch: int
    p_eval_step: Callable
    eval_batches: list
    checkpointer: Checkpointer
    writer: MetricWriter
    tokens_per_step: int
    flops_per_step: int
    peak_flops: float | None = None  # one device's matmul FLOP/s for the compute dtype (flops.peak_flops)
    profiler: StepProfiler | None = None  # jax.profiler window (config.profile), off by default
    clock: ThroughputClock = dataclasses.field(default_factory=ThroughputClock)
    timed_steps: int = 0
    compile_seconds: float | None = None
    last_train: dict[str, float] = dataclasses.field(default_factory=dict)
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    final_step: int = 0
    skipped_updates: int = 0
    progress: ProgressBar | None = None  # a live bar on a terminal, else nothing

    def host_metrics(self, dispatches: list[tuple[int, jax.Array]]) -> list[dict[str, float]]:
        """(n, stacked metrics) of `_p_train_steps` dispatches (replicated layout) -> one dict of
        host floats per step, in order. Waits for those dispatches; the copies all start at once."""
        names = train_metric_names(self.task, self.config.on_nonfinite == "skip")
        host = self.dp.to_host([metrics for _, metrics in dispatches])
        return [dict(zip(names, map(float, row), strict=True))
                for (n, _), rows in zip(dispatches, host) for row in rows.reshape(-1, len(names))[:n]]

    def check_finite(self, step: int, rows: list[dict[str, float]]) -> dict[str, float]:
        """Mean of the per-step host metrics `rows` of the window of steps ending at `step`.

        on_nonfinite=stop: NonFiniteLossError naming the first step whose loss or gradient
        norm is NaN/Inf. on_nonfinite=skip: those steps' updates were dropped in train_step;
        they are counted (`skipped_updates`) and left out of the means.
        """
        first = step - len(rows) + 1
        bad = [first + i for i, row in enumerate(rows) if not _is_finite(row)]
        if self.config.on_nonfinite == "skip":
            skipped = sum(row["skipped"] for row in rows)
            rows = [{k: v for k, v in row.items() if k != "skipped"} for row in rows]
            metrics = _mean([row for row in rows if _is_finite(row)]) or {k: float("nan") for k in rows[0]}
            return metrics | {"skipped_updates": skipped}
        if bad:
            row = rows[bad[0] - first]
            raise NonFiniteLossError(
                f"non-finite training at step {bad[0]} (loss={row['loss']}, grad_norm={row['grad_norm']}); "
                f"no checkpoint at or after it was written. Lower optimizer.lr (now {self.config.optimizer.lr:g}), "
                f"keep optimizer.clip_norm > 0 (now {self.config.optimizer.clip_norm:g}), or set on_nonfinite=skip",
                step=bad[0],
            )
        return _mean(rows)

    def log_train(self, step: int, rows: list[dict[str, float]], window: tuple[float, int]) -> None:
        """Write the window's mean metrics and throughput to TensorBoard and the console."""
        metrics = self.check_finite(step, rows)
        self.skipped_updates += int(metrics.get("skipped_updates", 0))
        elapsed, steps = self.clock.elapsed() - window[0], self.timed_steps - window[1]
        perf = {}
        if steps > 0 and elapsed > 0:
            perf = {
                "perf/tokens_per_sec": steps * self.tokens_per_step / elapsed,
                "perf/steps_per_sec": steps / elapsed,
                "perf/flops_per_sec": steps * self.flops_per_step / elapsed,
                "perf/mfu": flops.mfu(steps * self.flops_per_step / elapsed, self.peak_flops, self.devices),
            }
        self.writer.write_scalars(step, {f"train/{k}": v for k, v in metrics.items()} | perf)
        self.last_train = metrics
        rate = f" | {perf['perf/tokens_per_sec']:,.0f} tokens/s" if perf else " | compiling step excluded"
        rate += f" | mfu {100 * perf['perf/mfu']:.3g}%" if perf.get("perf/mfu") else ""
        log.info(
            "step %d/%d | loss %.4f | %s %.4f | grad_norm %.3f | lr %.2e%s",
            step, self.config.steps, metrics["loss"], self.task.metric_name, metrics[self.task.metric_name],
            metrics["grad_norm"], metrics["lr"], rate,
        )
        if self.progress is not None:
            self.progress.update(step, metrics["loss"], perf.get("perf/tokens_per_sec"))

    def evaluate(self, step: int, state: Any) -> None:
        batches = self.dp.to_host([self.p_eval_step(state, batch) for batch in self.eval_batches])
        metrics = _mean([{k: float(v) for k, v in m.items()} for m in batches])
        self.writer.write_scalars(step, {f"eval/{k}": v for k, v in metrics.items()})
        self.last_eval = metrics
        log.info(
            "eval step %d | loss %.4f | %s %.4f | baseline loss %.4f",
            step, metrics["loss"], self.task.metric_name, metrics[self.task.metric_name], self.task.baseline_loss,
        )

    def results(self, status: str, step: int, num_params: int, wall_start: float) -> dict[str, Any]:
        elapsed = self.clock.elapsed()
        tokens_per_sec = self.timed_steps * self.tokens_per_step / elapsed if self.timed_steps and elapsed else None
        return {
            "status": status,
            "step": step,
            "train_loss": finite_or_none(self.last_train.get("loss")),
            "eval_loss": finite_or_none(self.last_eval.get("loss")),
            "eval_metric": finite_or_none(self.last_eval.get(self.task.metric_name)),
            "eval_metric_name": self.task.metric_name,
            "baseline_loss": self.task.baseline_loss,
            "num_params": num_params,
            "num_devices": len(self.devices),
            "steps_per_dispatch": self.steps_per_dispatch,
            "platform": self.devices[0].platform,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_sec": tokens_per_sec,
            "flops_per_step": self.flops_per_step,
            "flops_per_sec": tokens_per_sec * self.flops_per_step / self.tokens_per_step if tokens_per_sec else None,
            "mfu": flops.mfu(tokens_per_sec and tokens_per_sec * self.flops_per_step / self.tokens_per_step,
                             self.peak_flops, self.devices),
            "compile_seconds": self.compile_seconds,
            "skipped_updates": self.skipped_updates,
            "wall_seconds": time.perf_counter() - wall_start,
        }


def train_and_evaluate(config: cfg.Config, workdir: Path | str) -> dict[str, Any]:
    """Train `config` in run dir `workdir` (resuming there if it holds checkpoints); returns results.json's dict.

    Raises ConfigError for bad input (before anything compiles), CheckpointError if no
    checkpoint of the run dir can be restored, NonFiniteLossError if training diverges
    (with on_nonfinite=stop). results.json is written in every case: `status` is
    "completed", "preempted" (SIGTERM/first SIGINT), "diverged", "aborted" (second SIGINT)
    or "failed".
    """
    wall_start = time.perf_counter()
    workdir = Path(workdir)
    _check_writable(workdir)
    parallel.configure_backend(config.device, config.batch_size, config.distributed.enabled)
    parallel.initialize_distributed(config.distributed, config.device.platform)
    devices = parallel.select_devices(config.device, config.batch_size)
    primary = parallel.is_primary()
    if not primary:  # one voice: process 0 logs, writes events, results.json and the summary
        log.setLevel(logging.WARNING)
    if os.environ.get(parallel.PIN_CPU_ENV) == "1" and devices[0].platform == "cpu":
        if parallel.pinned_core() is None:
            log.warning("%s=1, but every core is held by another pinned process: this one is not pinned",
                        parallel.PIN_CPU_ENV)
        else:
            log.info("pinned to CPU core %d (%s=1)", parallel.pinned_core(), parallel.PIN_CPU_ENV)
    parallel.check_batch_divides(config.batch_size, len(devices))
    task = data.make_task(config.data)
    flat_config = cfg.flatten(config)
    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint.every, config.checkpoint.keep)
    latest = checkpointer.latest_step()
    if latest is not None and not config.checkpoint.resume:
        raise cfg.ConfigError(
            f"key 'checkpoint.resume': false, but {checkpointer.directory} already holds step {latest}; "
            f"use a new hydra.run.dir, or checkpoint.resume=true to continue it"
        )
    checkpointer.check_compatible(flat_config)

    # model.unroll=null: chosen for the platform this run trains on (JAX's default backend may be another).
    model_config = dataclasses.replace(config.model, unroll=config.model.unroll or default_unroll(devices[0].platform))
    model = RecurrentModel(model_config, task.output_dim)
    tx, schedule = make_optimizer(config.optimizer, config.steps)
    params_key = jax.random.fold_in(jax.random.key(config.seed), PARAMS_STREAM)
    steps_per_dispatch = config.device.steps_per_dispatch or default_steps_per_dispatch(devices[0].platform)
    device_note = ""
    if parallel.device_count_is_open(config.device, devices):
        recorded = None
        if latest is not None:  # resuming: the count this run dir trained with (1 if not recorded)
            recorded = int(checkpointer.saved_run_config().get(DEVICES_USED_KEY) or 1)
        devices, device_note = _fastest_devices(config, task, model, tx, schedule, params_key, devices, recorded,
                                                steps_per_dispatch)
    per_device = parallel.check_batch_divides(config.batch_size, len(devices))
    example = jnp.zeros((per_device, task.total_len, task.input_dim), jnp.float32)
    if primary:
        summary = summary_table(model, example)
        (workdir / "model_summary.txt").write_text(summary)
        print(summary)

    # Restore order: this run dir's newest restorable checkpoint, else a fresh initialisation.
    state = create_train_state(params_key, model, example, tx)
    restored = checkpointer.restore_latest(state)
    if restored is not None:
        state, _ = restored
        log.info("resumed from %s at step %d", checkpointer.directory, int(state.step))
    elif primary:
        checkpointer.write_run_config({**flat_config, DEVICES_USED_KEY: len(devices), DISPATCH_USED_KEY: steps_per_dispatch})
    start_step = int(state.step)
    num_params = count_params(state.params)

    tokens_per_step = config.batch_size * task.total_len
    # The peak of the devices this run trains on (with device=cpu on a GPU machine, not JAX's default backend's).
    local_device = next(d for d in devices if d.process_index == jax.process_index())
    dp = parallel.DataParallel(devices, config.device.strategy)
    replicated, sharded = parallel.REPLICATED, parallel.SHARDED
    run = _Run(
        config=config,
        workdir=workdir,
        task=task,
        devices=devices,
        dp=dp,
        p_train_steps=_p_train_steps(config, task, schedule, dp, per_device, steps_per_dispatch),
        steps_per_dispatch=steps_per_dispatch,
        p_eval_step=dp.map(functools.partial(eval_step, task=task), (replicated, sharded), replicated),
        eval_batches=[],
        checkpointer=checkpointer,
        writer=MetricWriter(workdir / "tensorboard", purge_step=start_step + 1 if start_step else None, enabled=primary),
        tokens_per_step=tokens_per_step,
        flops_per_step=flops.train_step_flops(config.model, task.input_dim, task.output_dim, tokens_per_step),
        peak_flops=flops.peak_flops(local_device, flops.model_peak_kind(config.model.dtype)),  # cached, else ~1 s
        profiler=StepProfiler(config.profile, workdir / "tensorboard"),
        progress=ProgressBar(config.steps, start_step),
    )
    p_eval_batch = make_sampler(task, data.stream_key(config.seed, data.EVAL_STREAM), per_device, dp)
    run.eval_batches = [p_eval_batch(dp.host_scalar(i)) for i in range(config.eval_batches)]
    run.writer.write_hparams(flat_config)
    log.info(
        "%s task (T=%d, baseline loss %.4f) | %d params | %d %s device(s)%s x batch %d | %d tokens/step | "
        "%.3g FLOPs/step | up to %d steps per dispatch",
        task.name, task.seq_len, task.baseline_loss, num_params, len(devices), devices[0].platform,
        device_note, per_device, tokens_per_step, run.flops_per_step, steps_per_dispatch,
    )

    state = dp.replicate(state)
    status, step = "failed", None  # what results.json says if the loop raises something unexpected
    try:
        status, state = _train_loop(run, state, start_step)
        if jax.process_count() > 1:  # every process must end holding the same parameters
            from jax.experimental import multihost_utils

            multihost_utils.assert_equal(dp.to_host(state.params), "processes ended with different parameters")
    except NonFiniteLossError as e:
        status, step = "diverged", e.step
        raise
    except KeyboardInterrupt:
        status = "aborted"
        raise
    finally:
        run.progress.close()
        run.profiler.stop()
        checkpointer.wait()  # an async save in flight completes whatever happened
        checkpointer.close()
        results = run.results(status, step or max(start_step, run.final_step), num_params, wall_start)
        if primary:
            write_results(workdir / "results.json", results)
        run.writer.close()
    log.info(
        "%s at step %d | eval loss %.4f (baseline %.4f) | %s %s | %s tokens/s | compile %.1fs | wall %.1fs",
        status, results["step"], results["eval_loss"] or float("nan"), task.baseline_loss, task.metric_name,
        results["eval_metric"], f"{results['tokens_per_sec']:,.0f}" if results["tokens_per_sec"] else "n/a",
        results["compile_seconds"] or 0.0, results["wall_seconds"],
    )
    return results


def _train_loop(run: _Run, state: Any, start_step: int) -> tuple[str, Any]:
    """Steps `start_step+1 .. config.steps`; returns ("completed" or "preempted", final state).

    Each dispatch runs up to `run.steps_per_dispatch` steps and ends at the next step where
    the loop has work (`_next_stop`), so logging, eval, checkpoints, SIGTERM and the profiler
    window see the same step numbers whatever the dispatch size. The host reads the metrics of
    finished dispatches while later ones run, with at most MAX_STEPS_IN_FLIGHT steps queued.
    """
    config, checkpointer = run.config, run.checkpointer
    in_flight: list[tuple[int, Any]] = []  # (steps, stacked metrics) of dispatches not read yet, oldest first
    rows: list[dict[str, float]] = []  # this log window's per-step metrics, on the host
    window = (0.0, 0)  # (clock reading, timed steps) when the window opened

    def read(keep: int = 0) -> None:
        """Bring the oldest dispatches' metrics to the host until at most `keep` steps stay queued.
        Reading a window's worth only at its end would keep thousands of live device arrays,
        which slowed every dispatch by up to 15% (log_every=1000)."""
        queued, take = sum(n for n, _ in in_flight), 0
        while queued > keep:
            queued -= in_flight[take][0]
            take += 1
        if take:
            rows.extend(run.host_metrics(in_flight[:take]))
            del in_flight[:take]

    def close_window(step: int) -> None:
        nonlocal window
        read()
        if rows:
            run.log_train(step, rows, window)
        rows.clear()
        window = (run.clock.elapsed(), run.timed_steps)

    step = start_step  # updates done so far
    num_processes = jax.process_count()
    with PreemptionGuard() as guard:
        while step < config.steps:
            # The first dispatch of this process compiles: one step, timed apart; the clock starts after it.
            n = min(run.steps_per_dispatch, _next_stop(config, step, num_processes) - step) if run.clock.running else 1
            queued = sum(k for k, _ in in_flight)
            if queued + n > MAX_STEPS_IN_FLIGHT:  # n <= 8: half the queue keeps running while the host reads
                read(keep=MAX_STEPS_IN_FLIGHT // 2)
            run.profiler.begin(step + 1)
            dispatched_at = time.perf_counter()
            state, metrics = run.p_train_steps(state, n)
            in_flight.append((n, metrics))
            step += n
            run.profiler.end(step, metrics)
            if run.clock.running:
                run.timed_steps += n
            else:
                jax.block_until_ready(metrics)
                run.compile_seconds = time.perf_counter() - dispatched_at
                run.clock.start()
                window = (run.clock.elapsed(), run.timed_steps)
            run.final_step = step
            is_last, stopping = step == config.steps, _stop_requested(guard, step)
            if step % config.log_every == 0 or is_last or stopping:
                close_window(step)
            if step % config.eval_every == 0 or is_last:
                read()  # queued steps count as training, not eval
                with run.clock.paused():
                    run.evaluate(step, state)
            if config.checkpoint.enabled and (is_last or stopping or checkpointer.should_save(step)):
                read()
                if rows:
                    run.check_finite(step, rows)  # never checkpoint a diverged state
                with run.clock.paused():
                    run.writer.flush()  # events up to a checkpoint are on disk before the checkpoint is
                    checkpointer.save(step, run.dp.to_host(state), force=True)
            if stopping:
                return "preempted", state
    if start_step >= config.steps:  # nothing left to train: evaluate the restored state
        run.evaluate(start_step, state)
    return "completed", state


def _next_stop(config: cfg.Config, step: int, num_processes: int = 1) -> int:
    """The first step after `step` where the loop has work between dispatches: a log line, an
    eval, a checkpoint, the profiler window's edges, the last step, and with several
    processes their stop check (every MAX_STEPS_IN_FLIGHT steps, `_stop_requested`)."""
    periods = [config.log_every, config.eval_every] + ([MAX_STEPS_IN_FLIGHT] if num_processes > 1 else [])
    if config.checkpoint.enabled and config.checkpoint.every > 0:
        periods.append(config.checkpoint.every)
    stops = [(step // p + 1) * p for p in periods] + [config.steps]
    if config.profile.num_steps > 0:
        first, last = config.profile.start_step, config.profile.start_step + config.profile.num_steps - 1
        stops += [s for s in (first - 1, last) if s > step]
    return min(stops)


def _stop_requested(guard: PreemptionGuard, step: int) -> bool:
    """Whether to stop after `step`. With several processes, all must stop at the same step:
    they agree (a tiny all-gather) every MAX_STEPS_IN_FLIGHT steps, where a dispatch ends (`_next_stop`)."""
    if jax.process_count() == 1:
        return guard.requested is not None
    if step % MAX_STEPS_IN_FLIGHT:
        return False
    from jax.experimental import multihost_utils

    return bool(multihost_utils.process_allgather(np.int32(guard.requested is not None)).any())


def _check_writable(workdir: Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test.{os.getpid()}"  # per process: several may share the run dir
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise cfg.ConfigError(f"run dir {workdir} is not writable ({e.strerror or e}); choose hydra.run.dir") from None
