"""A live progress bar for the training loop, when a person is watching.

On a terminal the loop shows a rich bar (step, loss, tokens/s, elapsed, ETA) and the
periodic log lines scroll above it; when stdout is not a terminal (CI, a log file,
a joblib worker) there is no bar and the log lines are all there is. Either way
Hydra's job log (train.log) gets the same lines: only console handlers are touched.

The bar moves only when the loop logs (every `log_every` steps), where the loop
already waits for the device: it adds no host syncs.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class ConsoleFormatter(logging.Formatter):
    """`14:03:27 message` on the console (conf/hydra/job_logging/rnnlab.yaml), and for warnings and
    errors `14:03:27 WARNING [logger] message`: Hydra's default prefix took 50 of 80 columns."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno < logging.WARNING:
            return text
        stamp, _, message = text.partition(" ")
        return f"{stamp} {record.levelname} [{record.name}] {message}"


def wants_bar(stream: IO[str] | None = None) -> bool:
    """A bar only for an interactive terminal, and only in the main process (parallel jobs would fight over it)."""
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and multiprocessing.parent_process() is None


class ProgressBar:
    """`phase(text)` before a long wait (the bar appears at the run's first step, naming the phase, e.g.
    compiling); `update(step, loss, tokens_per_sec)` at each log line (phase: training); `close()`
    when the loop ends (idempotent).

    enabled: None decides with `wants_bar()`; False makes every call a no-op.
    console: where to draw (tests pass a Console writing to a buffer).
    """

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool | None = None,
                 console: Console | None = None):
        self.total_steps, self.start_step = total_steps, start_step
        self.enabled = wants_bar() if enabled is None else enabled
        self._console = console
        self._progress: Progress | None = None
        self._task = None
        self._swapped: list[tuple[logging.StreamHandler, IO[str]]] = []

    def _start(self) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.fields[phase]:<9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} tokens/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self._console or Console(file=sys.stdout),
            transient=False,
        )
        self._task = self._progress.add_task("train", total=self.total_steps, completed=self.start_step,
                                             loss="-", rate="-", phase="starting")
        originals = (sys.stdout, sys.stderr)
        self._progress.start()  # from here sys.stdout/stderr print above the bar
        # Console log handlers keep the stream they were configured with: point them at the
        # redirected one so that log lines scroll above the bar instead of tearing it.
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler and handler.stream in originals:
                redirected = sys.stdout if handler.stream is originals[0] else sys.stderr
                self._swapped.append((handler, handler.setStream(redirected)))

    def phase(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            self._start()
        self._progress.update(self._task, phase=text)

    def update(self, step: int, loss: float, tokens_per_sec: float | None) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            self._start()
        rate = f"{tokens_per_sec:,.0f}" if tokens_per_sec else "-"
        self._progress.update(self._task, completed=step, loss=f"{loss:.4g}", rate=rate, phase="training")

    def close(self) -> None:
        if self._progress is None:
            return
        for handler, stream in self._swapped:
            handler.setStream(stream)
        self._swapped = []
        self._progress.stop()
        self._progress = None
