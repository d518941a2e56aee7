"""The training loop: multi-step dispatches through a bounded queue, and when to log, evaluate,
save and stop.

Each dispatch runs up to `fns.steps_per_dispatch` steps and ends at the next step where
the loop has work (`next_stop`), so logging, eval, histograms, checkpoints, SIGTERM and the profiler
window see the same step numbers whatever the dispatch size. The host reads the metrics
of finished dispatches while later ones run, with at most MAX_STEPS_IN_FLIGHT steps queued.
The loop passes the train state along; the reporter and the checkpointer change only through
their methods; `train_loop` returns what happened (`Outcome`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from rnnlab import config as cfg
from rnnlab import memory
from rnnlab.checkpoint import Checkpointer, CheckpointSaveError, PreemptionGuard
from rnnlab.report import NonFiniteLossError, Reporter
from rnnlab.steps import MAX_STEPS_IN_FLIGHT, EvalInterrupted, EvalTooLongError, StepFunctions

@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a training loop came to."""

    status: str  # results.json's: "completed", "preempted", "diverged", "aborted" or "failed"
    error: BaseException | None = None  # what stopped it early (raised again once results.json is written)
    step: int | None = None  # where a diverged run stopped (None: the last step dispatched)


class MetricQueue:
    """Dispatches whose metrics the host has not read yet (oldest first). Reading turns them into
    per-step host rows (`read_rows`: `StepFunctions.host_rows`) and hands those to `sink`
    (`Reporter.add_rows`)."""

    def __init__(self, read_rows: Callable[[list], list[dict[str, float]]], sink: Callable[[list], None]):
        self.in_flight: list[tuple[int, Any]] = []  # (steps, stacked metrics)
        self._read_rows, self._sink = read_rows, sink

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
            self._sink(self._read_rows(self.in_flight[:take]))
            del self.in_flight[:take]


def train_loop(config: cfg.Config, fns: StepFunctions, reporter: Reporter, checkpointer: Checkpointer, state: Any,
               start_step: int) -> Outcome:
    """Steps `start_step+1 .. config.steps` from `state` (replicated layout of `fns.dp`), then the save in
    flight waited for. Whatever happened is returned, not raised, so that results.json can say it:
    "completed", "preempted" (SIGTERM/first SIGINT), "diverged", "aborted" (second SIGINT) or "failed"."""
    try:
        status, state = _Loop(config, fns, reporter, checkpointer).run(state, start_step)
        _check_processes_agree(fns, state)
        outcome = Outcome(status)
    except NonFiniteLossError as e:
        outcome = Outcome("diverged", e, e.step)
    except KeyboardInterrupt as e:
        outcome = Outcome("aborted", e)
    except Exception as e:  # noqa: BLE001 - recorded in results.json, then raised again
        outcome = Outcome("failed", memory.out_of_memory_error(e, config) if memory.is_out_of_memory(e) else e)
    reporter.end_loop()
    try:
        checkpointer.wait()  # an async save in flight completes whatever happened
    except CheckpointSaveError as e:
        if outcome.error is None:
            outcome = Outcome("failed", e)
    return outcome


def _check_processes_agree(fns: StepFunctions, state: Any) -> None:
    """With several processes, every one must end holding the same parameters."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.assert_equal(fns.dp.to_host(state.params), "processes ended with different parameters")


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: it holds a reporter, a checkpointer, functions
class _Loop:
    """What the loop works with; the train state and the step are passed along, not kept."""

    config: cfg.Config
    fns: StepFunctions
    reporter: Reporter
    checkpointer: Checkpointer

    def run(self, state: Any, start_step: int) -> tuple[str, Any]:
        """Steps `start_step+1 .. config.steps`; returns ("completed" or "preempted", final state)."""
        config, reporter = self.config, self.reporter
        queue = MetricQueue(self.fns.host_rows, reporter.add_rows)
        step, k, num_processes = start_step, self.fns.steps_per_dispatch, jax.process_count()
        if config.log.histograms_every and start_step == 0:
            reporter.log_param_stats(0, *self.fns.param_stats(state))  # the initialisation
        with PreemptionGuard() as guard:
            while step < config.steps:
                # The first dispatch of this process compiles: one step, timed apart.
                n = min(k, next_stop(config, step, num_processes) - step) if step > start_step else 1
                queue.make_room(n)
                state, step = self._dispatch(queue, state, step, n)
                stopping = stop_requested(guard, step)
                # ends with the queue read at the last step; a stop during an eval stops here too
                stopping = self._between_dispatches(queue, state, step, stopping, guard)
                if stopping:
                    reporter.stop_clock()
                    return "preempted", state
            reporter.stop_clock()
            if start_step >= config.steps and not self._evaluate(start_step, state, guard):
                return "preempted", state  # nothing left to train: the restored state evaluated, or stopped
        return "completed", state

    def _dispatch(self, queue: MetricQueue, state: Any, step: int, n: int) -> tuple[Any, int]:
        """Dispatch steps step+1 .. step+n (the reporter times them: `Throughput.dispatched`)."""
        self.reporter.dispatching(step + 1)
        state, metrics = self.fns.dispatch(state, n)
        queue.push(n, metrics)
        self.reporter.dispatched(step + n, n, metrics)
        return state, step + n

    def _between_dispatches(self, queue: MetricQueue, state: Any, step: int, stopping: bool,
                            guard: PreemptionGuard) -> bool:
        """The work due after `step`: a log line, an eval, histograms, a checkpoint; returns whether to stop (as
        `stopping` said, or a stop requested during the eval, which then ends unreported). An eval refused as too
        long (EvalTooLongError) is raised once the checkpoint of this step is saved."""
        config, reporter, is_last = self.config, self.reporter, step == self.config.steps
        logged = step % config.log_every == 0 or is_last or stopping
        if logged:
            queue.read()
            reporter.close_window(step)
        refused = None
        if (step % config.eval_every == 0 or is_last) and not stopping:
            queue.read()  # queued steps count as training, not eval
            with reporter.paused():
                try:
                    stopping = not self._evaluate(step, state, guard)
                except EvalTooLongError as e:
                    refused, stopping = e, True
            if stopping and not logged:  # the preempted step's partial window, logged on the way out
                reporter.close_window(step)
        if config.log.histograms_every and step % config.log.histograms_every == 0 and refused is None:
            queue.read()
            reporter.check_finite(step)  # a diverged run stops as diverged, not in the histogram
            with reporter.paused():
                reporter.log_param_stats(step, *self.fns.param_stats(state))
        if config.checkpoint.enabled and (is_last or stopping or self.checkpointer.should_save(step)):
            queue.read()
            reporter.check_finite(step)  # never checkpoint a diverged state
            with reporter.paused():
                reporter.flush()  # events up to a checkpoint are on disk before the checkpoint is
                self.checkpointer.save(step, self.fns.dp.to_host(state), force=True)
        if refused is not None:
            raise refused
        return stopping

    def _evaluate(self, step: int, state: Any, guard: PreemptionGuard) -> bool:
        """Every evaluated length, and the eval examples of tasks with a symbol per step; False if a stop was
        requested (SIGTERM, a first Ctrl-C) before or during it: then nothing of it is logged. Checked before
        each length and between the chunks of one run in segments (`StepFunctions.evaluate`). An allocation failure
        in it is named by the keys that size the evaluation (`memory.out_of_memory_error`)."""
        try:
            return self._evaluate_all(step, state, guard)
        except Exception as e:
            if memory.is_out_of_memory(e):
                raise memory.out_of_memory_error(e, self.config, evaluating=True) from None
            raise

    def _evaluate_all(self, step: int, state: Any, guard: PreemptionGuard) -> bool:
        try:
            by_length, examples = self.fns.evaluate(state, lambda: guard.requested is not None)
        except EvalInterrupted:
            return False
        self.reporter.log_eval(step, by_length)
        if examples is not None:
            self.reporter.log_examples(step, *examples)
        if self.fns.samples is not None:  # data=text: a few sampled texts
            self.reporter.log_text(step, {"eval/samples": self.fns.samples(state)})
        if step >= self.config.steps and self.fns.final_evaluators:  # data=text: the test text, once, at the end
            try:
                self.reporter.log_final_eval(step, self.fns.evaluate_final(state, lambda: guard.requested is not None))
            except EvalInterrupted:
                return False
        return True


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
