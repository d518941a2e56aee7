"""What a training run holds beyond its state, and how it reports: metrics to the host, the
non-finite policy, TensorBoard and console lines, evaluation and results.json's dict."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from rnnlab import config as cfg
from rnnlab import flops, param_stats, parallel, tasks
from rnnlab.checkpoint import Checkpointer
from rnnlab.metrics import MetricWriter, ThroughputClock, eval_tag, finite_or_none
from rnnlab.profiling import StepProfiler
from rnnlab.progress import ProgressBar
from rnnlab.steps import train_metric_names

log = logging.getLogger("rnnlab.trainer")


EXAMPLES = 4  # eval examples `write_examples` shows at each evaluation


class NonFiniteLossError(RuntimeError):
    """The training loss or gradient norm became NaN or Inf at `step`."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} if rows else {}


def _is_finite(row: dict[str, float]) -> bool:
    return bool(np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]))


def _format_metrics(task: tasks.Task, metrics: dict[str, float]) -> str:
    """The task's metrics for a console line, but one that equals the loss (the adding task's mse)."""
    return "".join(f" | {name} {metrics[name]:.4g}" for name in task.metric_names if metrics[name] != metrics["loss"])


@dataclasses.dataclass
class Run:
    """Compiled functions, sinks and counters of one training run. The state is not here: the
    loop passes it along (replicated layout of `dp`)."""

    config: cfg.Config
    workdir: Path
    task: tasks.Task
    devices: list
    dp: parallel.DataParallel
    dispatch: Callable  # steps.make_dispatch: (state, n) -> (state, stacked metrics)
    steps_per_dispatch: int
    evaluator: tuple[Callable, list]  # steps.make_evaluator: (p_eval_step, eval batches) at data.seq_len
    length_evaluators: dict[int, tuple[Callable, list]]  # the same at each data.eval_seq_lens length but seq_len
    checkpointer: Checkpointer
    writer: MetricWriter
    tokens_per_step: int
    flops_per_step: int
    peak_flops: float | None = None  # one device's matmul FLOP/s for the compute dtype (flops.peak_flops)
    profiler: StepProfiler | None = None  # jax.profiler window (config.profile), off by default
    progress: ProgressBar | None = None  # a live bar on a terminal, else nothing
    clock: ThroughputClock = dataclasses.field(default_factory=ThroughputClock)
    timed_steps: int = 0
    compile_seconds: float | None = None
    last_train: dict[str, float] = dataclasses.field(default_factory=dict)
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    last_eval_by_len: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    final_step: int = 0
    skipped_updates: int = 0
    predict: Callable | None = None  # the jitted forward pass of `write_examples`
    gradient_probe: Callable | None = None  # steps.make_gradient_probe, with log.histograms_every > 0

    @property
    def state_floats(self) -> int:
        """Floats of recurrent state per layer and example at the training length (`Cell.state_floats`)."""
        return self.config.model.make_cell().state_floats(self.task.total_len)

    def host_metrics(self, dispatches: list[tuple[int, jax.Array]]) -> list[dict[str, float]]:
        """(n, stacked metrics) of dispatches (replicated layout) -> one dict of host floats per
        step, in order. Waits for those dispatches; the copies all start at once."""
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
            metrics = mean_rows([row for row in rows if _is_finite(row)]) or {k: float("nan") for k in rows[0]}
            return metrics | {"skipped_updates": skipped}
        if bad:
            row = rows[bad[0] - first]
            raise NonFiniteLossError(
                f"non-finite training at step {bad[0]} (loss={row['loss']}, grad_norm={row['grad_norm']}); "
                f"no checkpoint at or after it was written. Lower optimizer.lr (now {self.config.optimizer.lr:g}), "
                f"keep optimizer.clip_norm > 0 (now {self.config.optimizer.clip_norm:g}), or set on_nonfinite=skip",
                step=bad[0],
            )
        return mean_rows(rows)

    def throughput(self, elapsed: float, steps: int) -> dict[str, float | None]:
        """perf/* scalars of `steps` timed steps in `elapsed` seconds ({} if none)."""
        if steps <= 0 or elapsed <= 0:
            return {}
        return {
            "perf/tokens_per_sec": steps * self.tokens_per_step / elapsed,
            "perf/steps_per_sec": steps / elapsed,
            "perf/flops_per_sec": steps * self.flops_per_step / elapsed,
            "perf/mfu": flops.mfu(steps * self.flops_per_step / elapsed, self.peak_flops, self.devices),
        }

    def log_train(self, step: int, rows: list[dict[str, float]], window: tuple[float, int]) -> None:
        """Write the window's mean metrics and throughput to TensorBoard and the console; `lr`, a
        function of the step, is the value at `step`, not a mean."""
        metrics = self.check_finite(step, rows) | {"lr": rows[-1]["lr"]}
        self.skipped_updates += int(metrics.get("skipped_updates", 0))
        perf = self.throughput(self.clock.elapsed() - window[0], self.timed_steps - window[1])
        self.writer.write_scalars(step, {f"train/{k}": v for k, v in metrics.items()} | perf)
        self.last_train = metrics
        rate = f" | {perf['perf/tokens_per_sec']:,.0f} tokens/s" if perf else " | compiling step excluded"
        rate += f" | mfu {perf['perf/mfu']:.3g}" if perf.get("perf/mfu") else ""
        log.info("step %d/%d | loss %.4g%s | grad_norm %.4g | lr %.4g%s", step, self.config.steps, metrics["loss"],
                 _format_metrics(self.task, metrics), metrics["grad_norm"], metrics["lr"], rate)
        if self.progress is not None:
            self.progress.update(step, metrics["loss"], perf.get("perf/tokens_per_sec"))

    def evaluate(self, step: int, state: Any) -> None:
        """Evaluate at data.seq_len and at every data.eval_seq_lens length: all dispatched, then one host read."""
        lengths = list(self.length_evaluators)
        dispatched = [[p_eval_step(state, batch) for batch in batches]
                      for p_eval_step, batches in [self.evaluator, *self.length_evaluators.values()]]
        means = [mean_rows([{k: float(v) for k, v in m.items()} for m in rows]) for rows in self.dp.to_host(dispatched)]
        metrics = means[0]
        self.writer.write_scalars(step, {f"eval/{k}": v for k, v in metrics.items()}
                                  | {"eval/baseline_loss": self.task.baseline_loss})
        self.last_eval = metrics
        log.info("eval step %d | loss %.4g%s | baseline loss %.4g", step, metrics["loss"],
                 _format_metrics(self.task, metrics), self.task.baseline_loss)
        by_len = dict(zip(lengths, means[1:])) | {self.task.seq_len: metrics}
        self.last_eval_by_len = {n: by_len[n] for n in self.config.data.eval_seq_lens}
        for n, at_n in self.last_eval_by_len.items():
            self.writer.write_scalars(step, {eval_tag(k, n): v for k, v in at_n.items()})
            log.info("eval step %d at length %d | loss %.4g%s | baseline loss %.4g", step, n, at_n["loss"],
                     _format_metrics(self.task, at_n), self.task.with_seq_len(n).baseline_loss)
        self.write_examples(step, state)

    def write_examples(self, step: int, state: Any) -> None:
        """The first eval examples with the model's predictions, as a text summary (tasks whose targets
        are a symbol per step: `Task.describe_examples`); the forward pass compiles on first use."""
        batch = self.dp.to_host(self.evaluator[1][0])
        inputs, targets = np.asarray(batch.inputs[:EXAMPLES]), np.asarray(batch.targets[:EXAMPLES])
        if targets.ndim != 2:
            return
        if self.predict is None:
            self.predict = jax.jit(lambda params, x, apply_fn=state.apply_fn: apply_fn({"params": params}, x))
        outputs = np.asarray(self.predict(self.dp.to_host(state.params), inputs))
        text = self.task.describe_examples(inputs, targets, outputs)
        if text:
            self.writer.write_text({"eval/examples": text}, step)

    def write_param_stats(self, step: int, state: Any) -> None:
        """Histograms of the parameters at `step` and of the gradients the next update applies (before
        clipping), and each layer's gradient norm (`rnnlab.param_stats`). Every process computes the
        gradients (a collective); the probe compiles on its first call."""
        params, grads = self.dp.to_host((state.params, self.gradient_probe(state)))
        self.writer.write_scalars(step, param_stats.layer_norms(grads))
        left_out = self.writer.write_histograms(step, param_stats.histograms(params, grads))
        if left_out:
            log.warning("histograms at step %d: %d NaN or Inf values left out", step, left_out)

    def results(self, status: str, step: int, num_params: int, wall_start: float,
                error: str | None = None) -> dict[str, Any]:
        """results.json's dict. `eval_metric` is the task's first metric (`eval_metrics` has them all);
        `error` says why a run that did not complete stopped."""
        elapsed = self.clock.elapsed()
        tokens_per_sec = self.timed_steps * self.tokens_per_step / elapsed if self.timed_steps and elapsed else None
        flops_per_sec = tokens_per_sec * self.flops_per_step / self.tokens_per_step if tokens_per_sec else None
        headline = self.task.metric_names[0] if self.task.metric_names else None
        return {
            "status": status, "error": error, "step": step, "task": self.task.name,
            "train_loss": finite_or_none(self.last_train.get("loss")),
            "eval_loss": finite_or_none(self.last_eval.get("loss")),
            "eval_metric": finite_or_none(self.last_eval.get(headline)) if headline else None,
            "eval_metric_name": headline,
            "eval_metrics": {name: finite_or_none(self.last_eval.get(name)) for name in self.task.metric_names},
            # {"<length>": {"loss": x, "<metric>": y, ...}} for each data.eval_seq_lens length (null: not evaluated)
            "eval_by_len": {str(n): {name: finite_or_none(self.last_eval_by_len.get(n, {}).get(name))
                                     for name in ("loss", *self.task.metric_names)}
                            for n in self.config.data.eval_seq_lens},
            "baseline_loss": self.task.baseline_loss,
            "num_params": num_params, "state_floats": self.state_floats, "num_devices": len(self.devices), "steps_per_dispatch": self.steps_per_dispatch,
            "platform": self.devices[0].platform, "tokens_per_step": self.tokens_per_step,
            "tokens_per_sec": tokens_per_sec, "flops_per_step": self.flops_per_step, "flops_per_sec": flops_per_sec,
            "mfu": flops.mfu(flops_per_sec, self.peak_flops, self.devices),
            "compile_seconds": self.compile_seconds, "skipped_updates": self.skipped_updates,
            "wall_seconds": time.perf_counter() - wall_start,
        }
