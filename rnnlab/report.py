"""How a run reports: TensorBoard, the console and its progress bar, the profiler's trace and
results.json, and the counters they read (the open window of train metrics, throughput, the last
metrics). A `Reporter` owns them and changes them only through its methods; the loop hands it
host values (`rnnlab.steps.StepFunctions` reads them from the devices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rnnlab import config as cfg
from rnnlab import exit_codes, flops, param_stats, tasks
from rnnlab.board import describe_run
from rnnlab.files import read_json_object
from rnnlab.provenance import provenance, utc_now
from rnnlab.metrics import MetricWriter, ThroughputClock, eval_tag, finite_or_none, hparam_metric_tags, write_results
from rnnlab.profiling import StepProfiler
from rnnlab.progress import ProgressBar
from rnnlab.setup import Setup
from rnnlab.steps import mean_rows

log = logging.getLogger("rnnlab.trainer")  # the run's lines, from one logger (rnnlab.setup)

EXAMPLES = 4  # eval examples `Reporter.log_examples` shows at each evaluation
# results.json's figures of the training itself, which a rerun that only evaluates keeps from the record it found.
TRAINING_FIELDS = ("train_loss", "tokens_per_sec", "flops_per_sec", "mfu", "compile_seconds", "compile_cache",
                   "skipped_updates", "wall_seconds", "peak_device_bytes")


def model_label(model: cfg.ModelConfig) -> str:
    """The cell, or a hybrid's pattern (`gated_deltanet+attention`), for the start line."""
    return "+".join(model.pattern) if len(model.layer_cells()) > 1 else model.cell


class NonFiniteLossError(RuntimeError):
    """The training loss or gradient norm became NaN or Inf at `step`."""

    exit_code = exit_codes.DIVERGED  # rnnlab.exit_codes.of_error

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def _is_finite(row: dict[str, float]) -> bool:
    return bool(np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]))


def window_means(rows: list[dict[str, float]], step: int, config: cfg.Config) -> dict[str, float]:
    """Mean of the per-step host metrics `rows` of the window of steps ending at `step`.

    on_nonfinite=stop: NonFiniteLossError naming the first step whose loss or gradient
    norm is NaN/Inf. on_nonfinite=skip: those steps' updates were dropped in train_step;
    they are counted (`skipped_updates`) and left out of the means.
    """
    first = step - len(rows) + 1
    bad = [first + i for i, row in enumerate(rows) if not _is_finite(row)]
    if config.on_nonfinite == "skip":
        skipped = sum(row["skipped"] for row in rows)
        rows = [{k: v for k, v in row.items() if k != "skipped"} for row in rows]
        metrics = mean_rows([row for row in rows if _is_finite(row)]) or {k: float("nan") for k in rows[0]}
        return metrics | {"skipped_updates": skipped}
    if bad:
        row = rows[bad[0] - first]
        raise NonFiniteLossError(
            f"non-finite training at step {bad[0]} (loss={row['loss']}, grad_norm={row['grad_norm']}); "
            f"no checkpoint at or after it was written. Lower optimizer.lr (now {config.optimizer.lr:g}), "
            f"keep optimizer.clip_norm > 0 (now {config.optimizer.clip_norm:g}), or set on_nonfinite=skip",
            step=bad[0],
        )
    return mean_rows(rows)


def _format_metrics(task: tasks.Task, metrics: dict[str, float]) -> str:
    """The task's metrics for a console line, but one that equals the loss (the adding task's mse)."""
    names = [*task.metric_names, *(k for k in eval_metric_names(task) if k not in task.metric_names and k in metrics)]
    return "".join(f" | {name} {metrics[name]:.4g}" for name in names if metrics[name] != metrics["loss"])


def eval_metric_names(task: tasks.Task) -> tuple[str, ...]:
    """The metrics an eval reports: the task's (`metric_names`), and for data=text `bpc_reset` too
    (`Task.eval_metric_names` where a task defines it)."""
    return tuple(getattr(task, "eval_metric_names", task.metric_names))


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def peak_device_bytes(devices: Sequence) -> int | None:
    """The most memory this process's first device has held (the allocator's peak, for the whole process: in a
    population, the program's), where the device reports one (GPU, TPU); None on CPU."""
    local = next((d for d in devices if d.process_index == jax.process_index()), None)
    try:
        stats = local.memory_stats() if local is not None else None
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


class Throughput:
    """Honest speed: the steps timed on a `ThroughputClock` that starts once the first dispatch (which
    compiles) is done and pauses for eval and saves, the compile seconds, and the open log window's start.
    `peak_flops` (one device's matmul FLOP/s, for MFU) is asked for at the first rate, not before the first
    step: a device without a cached peak measures it then, with the clock paused and no step in flight."""

    def __init__(self, tokens_per_step: int, flops_per_step: int, peak_flops: Callable[[], float | None],
                 devices: Sequence):
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self._peak_flops, self._devices = peak_flops, devices
        self._peak: float | None = None
        self._peak_known = False
        self._clock = ThroughputClock()
        self._timed_steps = 0
        self._compile_seconds: float | None = None
        self._window = (0.0, 0)  # (clock reading, timed steps) when the log window opened
        self._dispatched_at = 0.0

    @property
    def compile_seconds(self) -> float | None:
        return self._compile_seconds

    def compiled(self, seconds: float) -> None:
        self._compile_seconds = seconds

    def dispatching(self) -> None:
        self._dispatched_at = time.perf_counter()

    def dispatched(self, steps: int, outputs: Any) -> None:
        """After a dispatch of `steps`: timed once the clock runs; the first one (which compiles, unless
        `dispatch.compile` did: its time counts as compile time either way) is waited for, then the clock starts."""
        if self._clock.running:
            self._timed_steps += steps
            return
        jax.block_until_ready(outputs)
        self._compile_seconds = (self._compile_seconds or 0.0) + time.perf_counter() - self._dispatched_at
        self._clock.start()
        self.open_window()

    def open_window(self) -> None:
        self._window = (self._clock.elapsed(), self._timed_steps)

    def window_rates(self) -> dict[str, float | None]:
        """perf/* scalars of the steps timed since the window opened ({} if none)."""
        return self._rates(self._clock.elapsed() - self._window[0], self._timed_steps - self._window[1])

    def _rates(self, elapsed: float, steps: int) -> dict[str, float | None]:
        if steps <= 0 or elapsed <= 0:
            return {}
        return {
            "perf/tokens_per_sec": steps * self.tokens_per_step / elapsed,
            "perf/steps_per_sec": steps / elapsed,
            "perf/flops_per_sec": steps * self.flops_per_step / elapsed,
            "perf/mfu": flops.mfu(steps * self.flops_per_step / elapsed, self.peak(), self._devices),
        }

    def peak(self) -> float | None:
        """One device's peak matmul FLOP/s, asked once; callers hold no step in flight (a log step)."""
        if not self._peak_known:
            with self._clock.paused():
                self._peak, self._peak_known = self._peak_flops(), True
        return self._peak

    def paused(self) -> contextlib.AbstractContextManager:
        return self._clock.paused()

    def stop(self) -> None:
        self._clock.stop()

    def totals(self) -> tuple[float | None, float | None, float | None]:
        """(tokens/s, FLOP/s, MFU) over every timed step; None where nothing was timed."""
        elapsed = self._clock.elapsed()
        tokens_per_sec = self._timed_steps * self.tokens_per_step / elapsed if self._timed_steps and elapsed else None
        flops_per_sec = tokens_per_sec * self.flops_per_step / self.tokens_per_step if tokens_per_sec else None
        return tokens_per_sec, flops_per_sec, flops.mfu(flops_per_sec, self.peak() if flops_per_sec else None,
                                                       self._devices)


class Reporter:
    """The sinks of one run (TensorBoard writer, console and progress bar, profiler, results.json) and
    the counters they read. The loop calls, in order: `dispatching` and `dispatched` around each
    dispatch, `add_rows` with the host metrics of finished ones, `close_window` at a log step,
    `log_eval`, `log_examples`, `log_param_stats` (within `paused`), `check_finite` before a save;
    then `end_loop`, `results`, `finish`."""

    def __init__(self, setup: Setup, start_step: int, overrides: Sequence[str] = (), varied: Sequence[str] = (),
                 first: bool = True, started_utc: str | None = None):
        self.setup = setup
        workdir, config = setup.workdir, setup.config
        self._started_utc = started_utc or utc_now()
        self._overrides = list(overrides)
        # The record of the run that trained up to `start_step` (a rerun that only evaluates keeps its training's
        # figures: `results`).
        previous = read_json_object(workdir / "results.json") if start_step else {}
        self._previous = previous if previous.get("step") == start_step else {}
        self._start_step = start_step
        self._writer = MetricWriter(workdir / "tensorboard", purge_step=start_step + 1 if start_step else None,
                                    enabled=setup.primary)
        # The peak of the devices this run trains on (with device=cpu on a GPU machine, not JAX's default backend's).
        local_device = next(d for d in setup.devices if d.process_index == jax.process_index())
        peak = functools.partial(flops.peak_flops, local_device, flops.model_peak_kind(config.model.dtype))
        self._throughput = Throughput(setup.tokens_per_step, setup.step_flops(len(setup.devices)), peak, setup.devices)
        # The jax.profiler window (off by default); in a population (`first` False for all members but the first)
        # the first member's reporter traces the program and draws the bar.
        self._profiler = StepProfiler(config.profile if first else dataclasses.replace(config.profile, num_steps=0),
                                      workdir / "tensorboard")
        self._progress = ProgressBar(config.steps, start_step, None if first else False)  # a bar on a terminal
        self._rows: list[dict[str, float]] = []  # per-step host metrics of the open log window
        self._last_train: dict[str, float] = {}
        self._last_eval: dict[str, float] = {}
        self._final_eval: dict[str, dict[str, float]] = {}  # {"test": metrics} of the held-out test text, at the end
        self._last_eval_by_len: dict[int, dict[str, float]] = {}
        self._skipped_updates = 0
        self._compile_cache: str | None = None  # how the train step was compiled (`compiled`); None: not yet
        self._step = start_step  # the last step dispatched
        flat = cfg.flatten(config) | {"state_floats": setup.state_floats, "model_state_floats": setup.model_state_floats}
        describe_run(self._writer, cfg.to_dict(config), flat, overrides, varied, hparam_metric_tags(
            setup.task.metric_names, config.data.eval_seq_lens), setup.task.metric_names, config.data.eval_seq_lens,
            layer_norms=config.log.histograms_every > 0)

    # Before the loop.

    def phase(self, text: str) -> None:
        self._progress.phase(text)

    def compiled(self, seconds: float, cache: str = "off") -> None:
        """The train step compiled in `seconds`; `cache`: "hit" (loaded from the persistent compilation cache),
        "miss" (compiled and stored), "off"."""
        self._throughput.compiled(seconds)
        self._compile_cache = cache

    def log_start(self, num_params: int) -> None:
        setup, task, devices = self.setup, self.setup.task, self.setup.devices
        log.info("%s task (T=%d, baseline loss %.4f) | %s, %s params | %s tokens/step, %.3g FLOPs/step", task.name,
                 task.seq_len, task.baseline_loss, model_label(setup.config.model), f"{num_params:,}",
                 f"{self._throughput.tokens_per_step:,}", self._throughput.flops_per_step)
        log.info("%d %s device(s) x batch %d | %d steps/dispatch%s", len(devices), devices[0].platform,
                 setup.per_device, setup.steps_per_dispatch, setup.device_note)

    # In the loop.

    def dispatching(self, first_step: int) -> None:
        """Before dispatching steps `first_step` ..."""
        self._profiler.begin(first_step)
        self._throughput.dispatching()

    def dispatched(self, step: int, steps: int, metrics: Any) -> None:
        """After dispatching `steps` steps up to `step`, whose stacked `metrics` are still on the devices."""
        self._profiler.end(step, metrics)
        self._throughput.dispatched(steps, metrics)
        self._step = step

    def add_rows(self, rows: list[dict[str, float]]) -> None:
        """Per-step host metrics of the open log window, in step order (`StepFunctions.host_rows`)."""
        self._rows.extend(rows)

    def check_finite(self, step: int) -> None:
        """Stop a diverged run (`window_means`) before its state is used: histograms, checkpoints."""
        if self._rows:
            window_means(self._rows, step, self.setup.config)

    def close_window(self, step: int) -> None:
        """Log the open window (ending at `step`), then open the next."""
        if self._rows:
            self._log_train(step)
        self._rows.clear()
        self._throughput.open_window()

    def _log_train(self, step: int) -> None:
        """The window's mean metrics and throughput to TensorBoard, the console and the bar; `lr`, a
        function of the step, is the value at `step`, not a mean."""
        config, task = self.setup.config, self.setup.task
        metrics = window_means(self._rows, step, config) | {"lr": self._rows[-1]["lr"]}
        self._skipped_updates += int(metrics.get("skipped_updates", 0))
        perf = self._throughput.window_rates()
        self._writer.write_scalars(step, {f"train/{k}": v for k, v in metrics.items()} | perf)
        self._last_train = metrics
        rate = f" | {perf['perf/tokens_per_sec']:,.0f} tokens/s" if perf else " | compiling step excluded"
        rate += f" | mfu {perf['perf/mfu']:.3g}" if perf.get("perf/mfu") else ""
        log.info("step %d/%d | loss %.4g%s | grad_norm %.4g | lr %.4g%s", step, config.steps, metrics["loss"],
                 _format_metrics(task, metrics), metrics["grad_norm"], metrics["lr"], rate)
        self._progress.update(step, metrics["loss"], perf.get("perf/tokens_per_sec"))

    def paused(self) -> contextlib.AbstractContextManager:
        """The throughput clock stands still within (eval, histograms, saves)."""
        return self._throughput.paused()

    def log_eval(self, step: int, by_len: dict[int, dict[str, float]]) -> None:
        """Eval metrics by length (`StepFunctions.evaluate`) to TensorBoard and the console: data.seq_len's
        as the usual eval, then each data.eval_seq_lens length's."""
        task, lengths = self.setup.task, self.setup.config.data.eval_seq_lens
        metrics = by_len[task.seq_len]
        self._writer.write_scalars(step, {f"eval/{k}": v for k, v in metrics.items()}
                                   | {"eval/baseline_loss": task.baseline_loss}
                                   | {f"eval/{k}": v for k, v in getattr(task, "baselines", {}).items()})
        self._last_eval = metrics
        log.info("eval step %d | loss %.4g%s | baseline loss %.4g", step, metrics["loss"],
                 _format_metrics(task, metrics), task.baseline_loss)
        self._last_eval_by_len = {n: by_len[n] for n in lengths}
        for n, at_n in self._last_eval_by_len.items():
            self._writer.write_scalars(step, {eval_tag(k, n): v for k, v in at_n.items()})
            log.info("eval step %d at length %d | loss %.4g%s | baseline loss %.4g", step, n, at_n["loss"],
                     _format_metrics(task, at_n), task.with_seq_len(n).baseline_loss)

    def log_final_eval(self, step: int, by_split: dict[str, dict[str, float]]) -> None:
        """The evaluations made once, at the last step (data=text: the test text, `StepFunctions.final_evaluators`):
        TensorBoard `<split>/<metric>`, a console line, results.json `<split>_<metric>`."""
        task = self.setup.task
        for split, metrics in by_split.items():
            self._writer.write_scalars(step, {f"{split}/{k}": v for k, v in metrics.items()})
            log.info("%s step %d | loss %.4g%s | baseline loss %.4g", split, step, metrics["loss"],
                     _format_metrics(task, metrics), task.baseline_loss)
        self._final_eval = dict(by_split)

    def log_text(self, step: int, texts: dict[str, str]) -> None:
        """Text summaries (TensorBoard's text tab), e.g. `eval/samples`."""
        self._writer.write_text(texts, step)

    def log_examples(self, step: int, inputs: np.ndarray, targets: np.ndarray, outputs: np.ndarray) -> None:
        """Eval examples with the model's outputs as a text summary (`Task.describe_examples`)."""
        text = self.setup.task.describe_examples(inputs, targets, outputs)
        if text:
            self._writer.write_text({"eval/examples": text}, step)

    def log_param_stats(self, step: int, params: Any, grads: Any) -> None:
        """Histograms of the parameters at `step` and of the gradients the next update applies (before
        clipping), and each layer's gradient norm (`rnnlab.param_stats`)."""
        self._writer.write_scalars(step, param_stats.layer_norms(grads))
        left_out = self._writer.write_histograms(step, param_stats.histograms(params, grads))
        if left_out:
            log.warning("histograms at step %d: %d NaN or Inf values left out", step, left_out)

    def flush(self) -> None:
        """Events so far to disk (before a checkpoint is)."""
        self._writer.flush()

    def stop_clock(self) -> None:
        self._throughput.stop()

    # After the loop.

    def end_loop(self) -> None:
        self._progress.close()
        self._profiler.stop()

    def results(self, status: str, step: int | None, num_params: int, wall_start: float,
                error: BaseException | None = None) -> dict[str, Any]:
        """results.json's dict at `step` (None: the last step dispatched). `eval_metric` is the task's first
        metric (`eval_metrics` has them all); `error` says why a run that did not complete stopped."""
        setup, task, last_eval = self.setup, self.setup.task, self._last_eval
        tokens_per_sec, flops_per_sec, mfu = self._throughput.totals()
        headline = task.metric_names[0] if task.metric_names else None
        results = {
            "status": status, "error": _one_line(error) if error is not None else None, "step": step or self._step,
            "task": task.name,
            "train_loss": finite_or_none(self._last_train.get("loss")),
            "eval_loss": finite_or_none(last_eval.get("loss")),
            "eval_metric": finite_or_none(last_eval.get(headline)) if headline else None,
            "eval_metric_name": headline,
            "eval_metrics": {name: finite_or_none(last_eval.get(name)) for name in eval_metric_names(task)},
            # {"<length>": {"loss": x, "<metric>": y, ...}} for each data.eval_seq_lens length (null: not evaluated)
            "eval_by_len": {str(n): {name: finite_or_none(self._last_eval_by_len.get(n, {}).get(name))
                                     for name in ("loss", *task.metric_names)}
                            for n in setup.config.data.eval_seq_lens},
            "baseline_loss": task.baseline_loss,
            "num_params": num_params, "state_floats": setup.state_floats,
            "model_state_floats": setup.model_state_floats, "num_devices": len(setup.devices),
            "steps_per_dispatch": setup.steps_per_dispatch, "platform": setup.devices[0].platform,
            "tokens_per_step": self._throughput.tokens_per_step, "tokens_per_sec": tokens_per_sec,
            "flops_per_step": self._throughput.flops_per_step, "flops_per_sec": flops_per_sec, "mfu": mfu,
            "compile_seconds": self._throughput.compile_seconds, "compile_cache": self._compile_cache,
            "skipped_updates": self._skipped_updates,
            "peak_device_bytes": peak_device_bytes(setup.devices),
            "wall_seconds": time.perf_counter() - wall_start,
            "overrides": self._overrides,
            "config": json.loads(json.dumps(cfg.flatten(setup.config))),
            "provenance": provenance(setup.devices, self._started_utc),
        }
        for split, metrics in self._final_eval.items():  # data=text: test_loss, test_bpc, test_bpc_reset
            results |= {f"{split}_{k}": finite_or_none(v) for k, v in metrics.items()}
        if self._start_step >= setup.config.steps and self._previous:
            # Nothing was trained here (a rerun that evaluates again): the training's own figures stay.
            results |= {k: self._previous.get(k) for k in TRAINING_FIELDS if k in self._previous}
        return results

    def finish(self, results: dict[str, Any]) -> None:
        """results.json (process 0), then TensorBoard's HParams session ends with its status; a disk that
        refuses either is logged, not raised."""
        path = self.setup.workdir / "results.json"
        if self.setup.primary:
            try:
                write_results(path, results)
            except OSError as e:
                log.error("cannot write %s (%s)", path, e.strerror or e)
        try:
            self._writer.close(results["status"])
        except OSError as e:
            log.error("cannot write the TensorBoard events (%s)", e.strerror or e)

    def log_end(self, results: dict[str, Any]) -> None:
        metrics = "".join(f" | {k} {v:.4g}" for k, v in results["eval_metrics"].items()
                          if v not in (None, results["eval_loss"]))
        log.info(
            "%s at step %d | eval loss %.4g (baseline %.4g)%s | %s tokens/s | compile %.1fs%s | wall %.1fs",
            results["status"], results["step"], results["eval_loss"] or float("nan"), self.setup.task.baseline_loss,
            metrics, f"{results['tokens_per_sec']:,.0f}" if results["tokens_per_sec"] else "n/a",
            results["compile_seconds"] or 0.0, " (cache hit)" if results["compile_cache"] == "hit" else "",
            results["wall_seconds"],
        )

    def close(self) -> None:
        """On a failure path: the TensorBoard writer closes (idempotent; its status unknown)."""
        self._writer.close()
