"""TensorBoard scalars, histograms, text and hyper-parameters, the throughput clock, and results.json."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import rnnlab.tbx  # noqa: F401  (first: tensorboardX without torch and boto3)
from tensorboardX import SummaryWriter
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import hparams as hparams_summaries

from rnnlab import files
from rnnlab.board import mark_differing, session_end


HISTOGRAM_BINS = 64


def eval_tag(name: str, length: int) -> str:
    """The TensorBoard tag of eval metric (or loss) `name` at length `length` (`data.eval_seq_lens`)."""
    return f"eval/{name}@{length}"


def hparam_metric_tags(metric_names: tuple[str, ...], eval_seq_lens: tuple[int, ...] = ()) -> tuple[str, ...]:
    """The scalars the HParams dashboard shows beside each run's hyper-parameters: eval loss,
    every eval metric of the task (`metric_names`), each of them at every further eval length,
    train loss and tokens/s."""
    at_lengths = (eval_tag(name, n) for n in eval_seq_lens for name in metric_names)
    return ("eval/loss", *(f"eval/{name}" for name in metric_names), *at_lengths, "train/loss", "perf/tokens_per_sec")


class MetricWriter:
    """tensorboardX writer for one run directory's `tensorboard/` folder.

    `purge_step`: when resuming at step s, pass s + 1 so TensorBoard drops the events
    that the interrupted run wrote after its last checkpoint instead of doubling them.
    """

    def __init__(self, logdir: Path, purge_step: int | None = None, enabled: bool = True):
        # Disabled (processes other than 0): nothing is written or created on disk.
        self._writer = SummaryWriter(logdir=str(logdir), purge_step=purge_step, flush_secs=30, write_to_disk=enabled)
        self._closed = False

    def write_scalars(self, step: int, scalars: Mapping[str, float | None]) -> None:
        for tag, value in scalars.items():
            if value is None:
                continue
            if "@" in tag:  # eval_tag's: tensorboardX's add_scalar would rename the '@' to '_'
                summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
                self._writer._get_file_writer().add_summary(summary, global_step=step)
            else:
                self._writer.add_scalar(tag, float(value), global_step=step)

    def write_hparams(self, hparams: Mapping[str, Any], metric_tags: tuple[str, ...], differs: Sequence[str] = ()) -> None:
        """Register the run with the HParams plugin, its metrics the scalars `metric_tags`; the keys
        `differs` are marked as those that tell the runs apart (TensorBoard shows them first)."""
        values = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
        experiment, session_start, _ = hparams_summaries(values, {tag: 0.0 for tag in metric_tags})
        file_writer = self._writer._get_file_writer()
        file_writer.add_summary(mark_differing(experiment, differs))
        file_writer.add_summary(session_start)

    def write_layout(self, layout: Mapping[str, Any]) -> None:
        """The custom-scalars layout (`rnnlab.board.scalars_layout`)."""
        self._writer.add_custom_scalars(dict(layout))

    def write_histograms(self, step: int, values: Mapping[str, Any]) -> int:
        """HISTOGRAM_BINS equal bins from each array's min to its max (tensorboardX's default,
        TensorFlow's exponential buckets, takes ~7 KB per histogram). NaN and Inf entries are left
        out, as a diverging run has them; returns how many were."""
        left_out = 0
        for tag, array in values.items():
            flat = np.asarray(array, np.float64).ravel()
            finite = flat[np.isfinite(flat)]
            left_out += flat.size - finite.size
            if not finite.size:
                continue
            try:
                self._writer.add_histogram(tag, finite, global_step=step, bins=HISTOGRAM_BINS)
            except ValueError:  # equal values too large for HISTOGRAM_BINS bins of finite width: one bin
                low, high = float(finite.min()), float(finite.max())
                self._writer.add_histogram_raw(tag, low, high, finite.size, float(finite.sum()), float(finite @ finite),
                                               [low, high], [0, finite.size], global_step=step)
        return left_out

    def write_text(self, texts: Mapping[str, str], step: int = 0) -> None:
        for tag, text in texts.items():
            self._writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self, status: str | None = None) -> None:
        """End the HParams session with the run's `status` (results.json's; None: unknown), and close.
        Idempotent: the trainer's failure paths may close it again."""
        if self._closed:
            return
        self._closed = True
        self._writer._get_file_writer().add_summary(session_end(status or "unknown"))
        self._writer.close()


class ThroughputClock:
    """Wall time spent training in steady state.

    Started after the first (compiling) step has finished; `paused()` excludes eval
    and checkpoint saves. Callers must make sure queued device work is finished
    (a host sync) before they read, pause or resume the clock.
    """

    def __init__(self) -> None:
        self._started_at: float | None = None
        self._accumulated = 0.0

    def start(self) -> None:
        self._started_at = time.perf_counter()

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def elapsed(self) -> float:
        running = time.perf_counter() - self._started_at if self._started_at is not None else 0.0
        return self._accumulated + running

    def stop(self) -> None:
        """The loop is over: what follows (the last async save's completion, closing files) is not training."""
        self._accumulated = self.elapsed()
        self._started_at = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        was_running = self.running
        if was_running:
            self._accumulated = self.elapsed()
            self._started_at = None
        try:
            yield
        finally:
            if was_running:
                self.start()


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN/Inf: such values become null."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def write_results(path: Path, results: Mapping[str, Any]) -> None:
    """Write results.json atomically: a reader never sees half a file."""
    files.write_json(path, dict(results))


class JobFailed(RuntimeError):
    """A job of a sweep failed; its record is in its results.json (status "failed").

    Raised instead of exiting so that Hydra's launcher marks the job FAILED and runs
    the others. Picklable (joblib sends it back from its worker process).
    """

    def __init__(self, message: str, exit_code: int):
        super().__init__(message, exit_code)
        self.message, self.exit_code = message, exit_code

    def __str__(self) -> str:
        return self.message


def write_failure(path: Path, error: str, exit_code: int, overrides: list[str], started: float) -> None:
    """Mark a sweep job's results.json failed: what went wrong, with which overrides.

    Keeps what the trainer already wrote there for this job (e.g. status "diverged" with
    its last metrics); `started` is the job's start (time.time()). A results.json older than
    that is an earlier run's (a rerun refused before it trained, e.g. a resume it may not make):
    a completed one stays, and this attempt's failure goes beside it, `results.failed_attempt.json`;
    an unfinished one (preempted, failed) is this job's record to date, and says "failed" now.
    """
    results: dict[str, Any] = {"status": "failed"}
    earlier = path.exists() and path.stat().st_mtime < started
    if path.exists():
        with contextlib.suppress(ValueError, OSError):
            found = json.loads(path.read_text())
            results = found if isinstance(found, dict) else results
    if earlier and results.get("status") == "completed":
        path, results = path.with_name("results.failed_attempt.json"), {"status": "failed"}
    if earlier or results.get("status") == "completed":  # its rerun failed, or it failed after writing its results
        results["status"] = "failed"
    results.update(error=error, exit_code=exit_code, overrides=overrides)
    results.setdefault("wall_seconds", time.time() - started)
    write_results(path, results)
