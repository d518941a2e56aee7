"""The training loop: multi-step dispatches through a bounded queue, and when to log, evaluate,
save and stop.

Each dispatch runs up to `run.steps_per_dispatch` steps and ends at the next step where
the loop has work (`next_stop`), so logging, eval, histograms, checkpoints, SIGTERM and the profiler
window see the same step numbers whatever the dispatch size. The host reads the metrics
of finished dispatches while later ones run, with at most MAX_STEPS_IN_FLIGHT steps queued.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from rnnlab import config as cfg
from rnnlab.checkpoint import PreemptionGuard
from rnnlab.run import Run

# pmap over simulated CPU devices aborts (all-reduce timeout) with ~50 steps queued
# without a host sync; the loop never queues more than this many, on every backend.
MAX_STEPS_IN_FLIGHT = 16
assert 2 * cfg.MAX_STEPS_PER_DISPATCH <= MAX_STEPS_IN_FLIGHT


class MetricQueue:
    """Dispatches whose metrics the host has not read yet (oldest first), and the per-step host
    metrics of the open log window."""

    def __init__(self, run: Run):
        self.run = run
        self.in_flight: list[tuple[int, Any]] = []  # (steps, stacked metrics)
        self.rows: list[dict[str, float]] = []
        self.window = (0.0, 0)  # (clock reading, timed steps) when the window opened

    def push(self, steps: int, metrics: Any) -> None:
        self.in_flight.append((steps, metrics))

    def make_room(self, steps: int) -> None:
        """Before dispatching `steps` more: if the queue would exceed MAX_STEPS_IN_FLIGHT, read the
        oldest until half of it is left, so one dispatch keeps running while the host reads."""
        if sum(n for n, _ in self.in_flight) + steps > MAX_STEPS_IN_FLIGHT:
            self.read(keep=MAX_STEPS_IN_FLIGHT // 2)

    def read(self, keep: int = 0) -> None:
        """Bring the oldest dispatches' metrics to the host until at most `keep` steps stay queued.
        Reading a window's worth only at its end would keep thousands of live device arrays."""
        queued, take = sum(n for n, _ in self.in_flight), 0
        while queued > keep:
            queued -= self.in_flight[take][0]
            take += 1
        if take:
            self.rows.extend(self.run.host_metrics(self.in_flight[:take]))
            del self.in_flight[:take]

    def read_finite(self, step: int) -> None:
        """Read every queued step and stop a diverged run (`Run.check_finite`) before its state is
        used: histograms, checkpoints."""
        self.read()
        if self.rows:
            self.run.check_finite(step, self.rows)

    def open_window(self) -> None:
        self.window = (self.run.clock.elapsed(), self.run.timed_steps)

    def close_window(self, step: int) -> None:
        self.read()
        if self.rows:
            self.run.log_train(step, self.rows, self.window)
        self.rows.clear()
        self.open_window()


def train_loop(run: Run, state: Any, start_step: int) -> tuple[str, Any]:
    """Steps `start_step+1 .. config.steps`; returns ("completed" or "preempted", final state)."""
    config = run.config
    queue = MetricQueue(run)
    step, num_processes = start_step, jax.process_count()
    if config.log.histograms_every and start_step == 0:
        run.write_param_stats(0, state)  # the initialisation
    with PreemptionGuard() as guard:
        while step < config.steps:
            # The first dispatch of this process compiles: one step, timed apart.
            n = min(run.steps_per_dispatch, next_stop(config, step, num_processes) - step) if run.clock.running else 1
            queue.make_room(n)
            state, step = _dispatch(run, queue, state, step, n)
            stopping = stop_requested(guard, step)
            _between_dispatches(run, queue, state, step, stopping)  # ends with the queue read at the last step
            if stopping:
                run.clock.stop()
                return "preempted", state
    run.clock.stop()
    if start_step >= config.steps:  # nothing left to train: evaluate the restored state
        run.evaluate(start_step, state)
    return "completed", state


def _dispatch(run: Run, queue: MetricQueue, state: Any, step: int, n: int) -> tuple[Any, int]:
    """Dispatch steps step+1 .. step+n; the throughput clock starts after the first dispatch (which
    compiles, unless `dispatch.compile` did it before: its time counts as compile time either way)."""
    run.profiler.begin(step + 1)
    dispatched_at = time.perf_counter()
    state, metrics = run.dispatch(state, n)
    queue.push(n, metrics)
    step += n
    run.profiler.end(step, metrics)
    if run.clock.running:
        run.timed_steps += n
    else:
        jax.block_until_ready(metrics)
        run.compile_seconds = (run.compile_seconds or 0.0) + time.perf_counter() - dispatched_at
        run.clock.start()
        queue.open_window()
    run.final_step = step
    return state, step


def _between_dispatches(run: Run, queue: MetricQueue, state: Any, step: int, stopping: bool) -> None:
    """The work due after `step`: a log line, an eval, histograms, a checkpoint."""
    config, is_last = run.config, step == run.config.steps
    if step % config.log_every == 0 or is_last or stopping:
        queue.close_window(step)
    if step % config.eval_every == 0 or is_last:
        queue.read()  # queued steps count as training, not eval
        with run.clock.paused():
            run.evaluate(step, state)
    if config.log.histograms_every and step % config.log.histograms_every == 0:
        queue.read_finite(step)  # a diverged run stops as diverged, not in the histogram
        with run.clock.paused():
            run.write_param_stats(step, state)
    if config.checkpoint.enabled and (is_last or stopping or run.checkpointer.should_save(step)):
        queue.read_finite(step)  # never checkpoint a diverged state
        with run.clock.paused():
            run.writer.flush()  # events up to a checkpoint are on disk before the checkpoint is
            run.checkpointer.save(step, run.dp.to_host(state), force=True)


def next_stop(config: cfg.Config, step: int, num_processes: int = 1) -> int:
    """The first step after `step` where the loop has work between dispatches: a log line, an
    eval, histograms, a checkpoint, the profiler window's edges, the last step, and with several
    processes their stop check (every MAX_STEPS_IN_FLIGHT steps, `stop_requested`)."""
    periods = [config.log_every, config.eval_every] + ([MAX_STEPS_IN_FLIGHT] if num_processes > 1 else [])
    if config.log.histograms_every > 0:
        periods.append(config.log.histograms_every)
    if config.checkpoint.enabled and config.checkpoint.every > 0:
        periods.append(config.checkpoint.every)
    stops = [(step // p + 1) * p for p in periods] + [config.steps]
    if config.profile.num_steps > 0:
        first, last = config.profile.start_step, config.profile.start_step + config.profile.num_steps - 1
        stops += [s for s in (first - 1, last) if s > step]
    return min(stops)


def stop_requested(guard: PreemptionGuard, step: int) -> bool:
    """Whether to stop after `step`. With several processes, all must stop at the same step:
    they agree (a tiny all-gather) every MAX_STEPS_IN_FLIGHT steps, where a dispatch ends (`next_stop`)."""
    if jax.process_count() == 1:
        return guard.requested is not None
    if step % MAX_STEPS_IN_FLIGHT:
        return False
    from jax.experimental import multihost_utils

    return bool(multihost_utils.process_allgather(np.int32(guard.requested is not None)).any())
