"""A sweep you can watch: one status line per finished job, each job's own output in its train.log.

    [12/72] 2 running, 58 left, 0 failed, about 1 h 40 min left

`SweepStatus` is a Hydra callback (conf/config.yaml `hydra.callbacks`) for every launcher: the basic one
runs the job callbacks in the sweep's process, the joblib one in its worker processes, so the counts
live on disk, in `<sweep dir>/.sweep_status/` (the plan at the start, a marker per started and per
finished job). `job_output_to(train.log)` (train.py, around each sweep job) sends the job's stdout,
stderr and console log lines to its train.log, unless `log.sweep_console=true`. `python -m rnnlab.zoo run`
prints the same line (`status_line`, `seconds_left`).
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rnnlab.board import override_key

SWEPT_KEYS_ENV = "RNNLAB_SWEPT_KEYS"  # train.py -> the sweep's jobs (launcher workers inherit it): the swept keys
STATUS_DIR = ".sweep_status"  # in the sweep dir; rewritten at each start of the sweep (a rerun resumes)


def varied_overrides(hydra_node: DictConfig) -> list[str]:
    """The overrides of a sweep job that its sweep varies (`model=gru`, not the `steps=600` every job
    shares): keys the command line sweeps (SWEPT_KEYS_ENV, which the launchers' worker processes
    inherit) or hydra.sweeper.params lists. Outside a sweep, or if none is found, all of them."""
    overrides = list(hydra_node.overrides.task)
    if hydra_node.mode != RunMode.MULTIRUN:
        return overrides
    swept = {*filter(None, os.environ.get(SWEPT_KEYS_ENV, "").split(",")),
             *map(override_key, OmegaConf.select(hydra_node, "sweeper.params") or {})}
    varied = [o for o in overrides if override_key(o) in swept]
    return varied or overrides


def time_left(seconds: float | None) -> str:
    """6000 -> "about 1 h 40 min left", 170 -> "about 3 min left", 30 -> "less than a minute left"."""
    if seconds is None:
        return "time left unknown"
    if seconds < 60:
        return "less than a minute left"
    hours, minutes = divmod(round(seconds / 60), 60)
    if not hours:
        return f"about {minutes} min left"
    return f"about {hours} h {minutes} min left" if minutes else f"about {hours} h left"


def duration(seconds: float) -> str:
    """A sweep's wall time for its last line: "45 s", "3 min", "1 h 40 min"."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min"


def seconds_left(durations: Sequence[float], left: int, running_for: Sequence[float], workers: int) -> float | None:
    """When the last job should end: the `left` jobs queued behind the running ones (running for
    `running_for` seconds) on `workers` slots, each job taking the finished jobs' mean duration;
    None before any job has finished."""
    if not durations:
        return None
    mean = sum(durations) / len(durations)
    return schedule_seconds([max(mean - t, 0.0) for t in running_for], [mean] * left, workers)


def schedule_seconds(running_left: Sequence[float], queued: Sequence[float], workers: int) -> float:
    """When the last job should end: jobs of `queued` seconds each started in order on the first free of `workers`
    slots, behind running jobs with `running_left` seconds to go."""
    slots = list(running_left) + [0.0] * max(workers - len(running_left), 0)
    heapq.heapify(slots)
    for seconds in queued:
        heapq.heapreplace(slots, slots[0] + seconds)
    return max(slots, default=0.0)


def status_line(done: int, total: int | None, running: int, failed: int, seconds: float | None,
                elapsed: float | None = None) -> str:
    """`[12/72] 2 running, 58 left, 0 failed, about 1 h 40 min left`; once nothing runs or waits,
    `..., done in 1 h 40 min` (`elapsed`: the sweep's wall time so far)."""
    left = None if total is None else max(total - done - running, 0)
    head = f"[{done}/{'?' if total is None else total}] {running} running, {'?' if left is None else left} left, " \
           f"{failed} failed, "
    if left == 0 and running == 0:
        return head + (f"done in {duration(elapsed)}" if elapsed is not None else "done")
    return head + time_left(seconds)


@contextlib.contextmanager
def job_output_to(log_file: str | os.PathLike) -> Iterator[None]:
    """A sweep job's console, to the end of `log_file` (its train.log) while it runs: sys.stdout and
    sys.stderr (prints, Python warnings), file descriptors 1 and 2 (XLA's C++ lines) and its console
    log handlers (the file handler already writes there). Restored on the way out, whatever the way."""
    root = logging.getLogger()
    consoles = [h for h in root.handlers if type(h) is logging.StreamHandler]  # FileHandler is a subclass: kept
    streams = sys.stdout, sys.stderr
    for stream in streams:
        stream.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(log_file, "a", buffering=1) as log:  # appends, as the file handler does: lines keep their order
            for handler in consoles:
                root.removeHandler(handler)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            sys.stdout = sys.stderr = log
            try:
                yield
            finally:
                log.flush()
                sys.stdout, sys.stderr = streams
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for handler in consoles:
                    if handler not in root.handlers:
                        root.addHandler(handler)
    finally:
        os.close(saved[0])
        os.close(saved[1])


def planned_jobs(config: DictConfig) -> int | None:
    """How many jobs the sweep will launch: Optuna's n_trials, or the size of the basic sweeper's grid
    (hydra.sweeper.params and the command line's overrides, as BasicSweeper.sweep combines them)."""
    sweeper = config.hydra.sweeper
    if "n_trials" in sweeper:
        return int(sweeper.n_trials)
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    try:
        params = sweeper.get("params")
        params = OmegaConf.to_container(params, resolve=True) if params is not None else {}
        lines = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
        # The basic sweeper's grid: one axis a key, the last override of a key replacing the ones before; a discrete
        # sweep's values, else one value (a range or interval sweep it refuses: no count)
        axes = {}
        for override in OverridesParser.create(loader).parse_overrides(lines):
            if override.is_sweep_override() and not override.is_discrete_sweep():
                return None
            axes[override.get_key_element()] = (len(list(override.sweep_string_iterator()))
                                                if override.is_sweep_override() else 1)
        return math.prod(axes.values())
    except Exception:  # noqa: BLE001 - a count we cannot make is shown as "?", never a failed sweep
        return None


def parallel_jobs(config: DictConfig) -> int:
    """How many jobs the launcher runs at once: joblib's n_jobs (-1: every core), submitit's
    array_parallelism, else one at a time."""
    launcher = config.hydra.launcher
    if "n_jobs" in launcher:
        try:
            import joblib

            return max(int(joblib.effective_n_jobs(int(launcher.n_jobs))), 1)
        except Exception:  # noqa: BLE001
            return max(os.cpu_count() or 1, 1)
    return max(int(launcher.get("array_parallelism") or 1), 1)


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One process at a time (the joblib launcher's workers finish side by side): lines counted in order."""
    from rnnlab.files import waited_lock

    with waited_lock(folder / "lock"):
        yield


from rnnlab.exit_codes import BAD_INPUT as EXIT_BAD_INPUT  # noqa: E402  (a sweep dir in use)
from rnnlab.exit_codes import CANNOT_WRITE as EXIT_CANNOT_WRITE  # noqa: E402  (one that cannot be written)
SWEEP_LOCK = ".sweep.lock"  # in the sweep dir: held by the process that runs the sweep, for its life


class SweepRefused(SystemExit):
    """A sweep that must not start: its sweep dir is another live sweep's, or cannot be written. A SystemExit with
    the exit code, so that it passes Hydra's callback wrapper (which turns an Exception into a warning) and stops
    the sweep before anything is written; train.py prints `message` as its one line."""

    def __init__(self, message: str, code: int):
        super().__init__(code)
        self.message = message


_held: dict[str, int] = {}  # sweep dir -> the fd of its lock, held by this process


def hold_sweep_lock(sweep_dir: Path) -> None:
    """An exclusive `flock` on `<sweep dir>/.sweep.lock` for this process (again: nothing; `release_sweep_lock` ends
    it, or the process's end, SIGKILL included). SweepRefused (exit 2) while another live process holds it."""
    from rnnlab.files import exclusive_lock

    path = Path(sweep_dir) / SWEEP_LOCK
    if str(path) in _held:
        return
    fd, who = exclusive_lock(path)
    if fd is None:
        raise SweepRefused(f"sweep dir {Path(sweep_dir)} is in use by {who} (lock {SWEEP_LOCK}); wait for that sweep "
                           f"to end, or choose another hydra.sweep.dir (nothing was started or written)",
                           EXIT_BAD_INPUT)
    _held[str(path)] = fd


def release_sweep_lock(sweep_dir: Path) -> None:
    fd = _held.pop(str(Path(sweep_dir) / SWEEP_LOCK), None)
    if fd is not None:
        os.close(fd)


class SweepStatus(Callback):
    """Hydra callback: `[done/total] R running, L left, F failed, about T left` on stdout per finished job.

    It also guards the sweep dir, before anything of the sweep is written (Hydra calls it first): a sweep dir held
    by another live sweep (`hold_sweep_lock`; not with distributed.enabled, whose processes each run the sweep)
    or one that cannot be written stops the sweep with `SweepRefused` (exit 2 or 74)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        folder = sweep_dir / STATUS_DIR
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            if OmegaConf.select(config, "distributed.enabled", default=False) is not True:
                hold_sweep_lock(sweep_dir)
            shutil.rmtree(folder, ignore_errors=True)  # a rerun's (resume's) counts start over
            folder.mkdir(parents=True, exist_ok=True)
            plan = {"total": planned_jobs(config), "workers": parallel_jobs(config), "started": time.time()}
            (folder / "sweep.json").write_text(json.dumps(plan))
        except OSError as e:
            raise SweepRefused(f"cannot write the sweep dir {sweep_dir} ({e.strerror or e}); choose another "
                               f"hydra.sweep.dir", EXIT_CANNOT_WRITE) from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        release_sweep_lock(Path(str(config.hydra.sweep.dir)))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = self._folder(config)
        if folder is None:
            return
        results = _read(Path(config.hydra.runtime.output_dir) / "results.json")
        marker = {"started": time.time(), "was_done": results.get("status") == "completed"}
        (folder / f"{config.hydra.job.num}.start").write_text(json.dumps(marker))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        folder = self._folder(config)
        if folder is None:
            return
        num = config.hydra.job.num
        start = _read(folder / f"{num}.start")
        now = time.time()
        failed = job_return.status == JobStatus.FAILED
        end = {"seconds": now - start.get("started", now), "failed": failed,
               "timed": not start.get("was_done") and not failed}  # a finished job resumed, a failure: no measure
        with _locked(folder):
            (folder / f"{num}.end").write_text(json.dumps(end))
            line = self.line(folder, now)
            if failed:
                line += f"; job {num} failed: see {Path(config.hydra.runtime.output_dir) / 'train.log'}"
            print(line, flush=True)

    @staticmethod
    def line(folder: Path, now: float) -> str:
        """The status line from the markers in `folder`."""
        plan = _read(folder / "sweep.json")
        ends = {p.stem: _read(p) for p in folder.glob("*.end")}
        running_for = [now - _read(p).get("started", now) for p in folder.glob("*.start") if p.stem not in ends]
        total = plan.get("total")
        left = None if total is None else max(total - len(ends) - len(running_for), 0)
        seconds = seconds_left([e["seconds"] for e in ends.values() if e.get("timed")], left or 0, running_for,
                               plan.get("workers", 1))
        elapsed = now - plan["started"] if "started" in plan else None
        return status_line(len(ends), total, len(running_for), sum(bool(e.get("failed")) for e in ends.values()),
                           seconds, elapsed)

    @staticmethod
    def _folder(config: DictConfig) -> Path | None:
        """The sweep's status folder; None outside a multirun (a single run prints no status)."""
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return None
        folder = Path(str(config.hydra.sweep.dir)) / STATUS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        return folder
