"""`hydra/launcher=population`: a sweep's jobs that differ only in the keys the compiled step takes as values
(`hydra.launcher.member_keys`, by default the lr and the seed) run as one program (`rnnlab.population`).

Each job keeps what Hydra's basic launcher gives it: its run dir and `.hydra/`, its callbacks (the sweep's
status line, one per finished job), its train.log (the lines of its own run, and those of the population it
trained in), its results.json and exit status; the program's own console (model summaries, XLA's lines)
goes to `population_<first job>.log` in the sweep dir. Jobs that differ in anything else, or that cannot resume
from one step (`_groups`), train in separate populations, one after another. A job's own fault (its run dir, its
checkpoints, its resume, a failed save) fails that job alone (`rnnlab.trainer.train_population`); a job whose run
completed with its config is reported done and left as it is; a run dir another process holds refuses the whole
launch before anything is written. The plugin class Hydra finds is in rnnlab/hydra_plugin_path/ (train.py puts it
on the path).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, setup_globals
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from rnnlab.metrics import JobFailed, write_failure
from rnnlab.sweep_status import job_output_to, varied_overrides

log = logging.getLogger(__name__)

# The exit codes, defined once, and what ended a job mapped to one as train.py maps it (rnnlab/exit_codes.py).
from rnnlab import exit_codes  # noqa: E402
from rnnlab.exit_codes import BAD_INPUT as EXIT_BAD_INPUT  # noqa: E402
from rnnlab.exit_codes import CANNOT_WRITE as EXIT_CANNOT_WRITE  # noqa: E402
from rnnlab.exit_codes import PREEMPTED as EXIT_PREEMPTED  # noqa: E402


class _Job:
    """One job of the sweep, set up as Hydra's `run_job` sets one up, up to calling the task."""

    def __init__(self, launcher: Any, overrides: Sequence[str], num: int):
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = num
            config.hydra.job.num = num
        HydraConfig.instance().set_config(config)
        output_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir"))) / str(OmegaConf.select(config, "hydra.sweep.subdir"))
        with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
            config.hydra.runtime.output_dir = os.path.abspath(output_dir)
        HydraConfig.instance().set_config(config)
        self.config, self.num, self.started = config, num, time.time()
        self.task_cfg = copy.deepcopy(config)
        with read_write(self.task_cfg), open_dict(self.task_cfg):
            del self.task_cfg["hydra"]
        self.hydra_cfg = copy.deepcopy(HydraConfig.instance().cfg)
        self.overrides = list(config.hydra.overrides.task)
        self.varied = varied_overrides(config.hydra)
        self.output_dir = Path(config.hydra.runtime.output_dir)
        self.log_file = self.output_dir / f"{config.hydra.job.name}.log"
        self.rnnlab_config: Any = None
        self.config_error: str | None = None  # why its config is refused (that job fails alone: `_ready_jobs`)
        self.error: JobFailed | None = None
        self.setup_error: tuple[str, int] | None = None  # (line, exit code) of a run dir that cannot be locked

    def write_hydra_files(self) -> None:
        """`.hydra/` (config.yaml, hydra.yaml, overrides.yaml), as Hydra's `run_job` writes it; OSError if it cannot."""
        if self.config.hydra.output_subdir is not None:
            hydra_output = self.output_dir / str(self.config.hydra.output_subdir)
            hydra_output.mkdir(parents=True, exist_ok=True)
            for node, name in ((self.task_cfg, "config.yaml"), (self.hydra_cfg, "hydra.yaml"),
                               (self.config.hydra.overrides.task, "overrides.yaml")):
                (hydra_output / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")

    def fail(self, message: str, code: int) -> None:
        """This job failed (before or while it trained): results.json says so (as far as its run dir can be
        written), and Hydra's sweeper gets JobFailed."""
        logging.getLogger("rnnlab").error("job %d failed (%s): %s", self.num, " ".join(self.overrides), message)
        try:
            write_failure(self.output_dir / "results.json", message, code, self.overrides, self.started)
        except OSError as e:
            logging.getLogger("rnnlab").error("job %d: cannot write its results.json (%s)", self.num, e.strerror or e)
        self.error = JobFailed(f"job {self.num} ({' '.join(self.overrides)}): {message}", code)

    def job_return(self, value: Any) -> JobReturn:
        ret = JobReturn(overrides=self.overrides, cfg=self.task_cfg, hydra_cfg=self.hydra_cfg,
                        working_dir=os.getcwd(), task_name=str(self.config.hydra.job.name))
        ret.status = JobStatus.FAILED if self.error is not None else JobStatus.COMPLETED
        ret.return_value = self.error if self.error is not None else value
        return ret


def max_members_value(value: Any) -> int | None:
    """`hydra.launcher.max_members`: null or an integer >= 1; anything else a HydraException (exit 2, one line)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HydraException(f"key 'hydra.launcher.max_members': got {value!r}, allowed: null or an integer >= 1")
    return value


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    """The population launcher's `launch`: every job set up in order, grouped into populations, each trained.

    Before it writes anything of a job (.hydra/, train.log, results.json, the callbacks' counts) it takes every
    job's run-dir lock: a run dir held by another process (another sweep on this sweep dir) refuses the whole
    launch (RunDirBusy, exit 2), touching nothing. A job whose run completed with its config (`rundir.final_record`)
    is reported done (its callbacks, its eval loss) and left out of every program."""
    from rnnlab.population import MEMBER_KEYS

    setup_globals()
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    member_keys = list(launcher.member_keys)
    unknown = [k for k in member_keys if k not in MEMBER_KEYS]
    if unknown:
        raise HydraException(f"key 'hydra.launcher.member_keys': got {unknown[0]!r}, allowed: {', '.join(MEMBER_KEYS)}")
    max_members = max_members_value(launcher.max_members)
    saved_hydra = HydraConfig.instance().cfg
    try:
        jobs = [_Job(launcher, overrides, initial_job_idx + i) for i, overrides in enumerate(job_overrides)]
    finally:
        HydraConfig.instance().cfg = saved_hydra
    _read_configs(jobs)
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    # With several JAX processes each takes its own lock index once JAX has started (`train_population`).
    distributed = any(OmegaConf.select(job.task_cfg, "distributed.enabled", default=False) is True for job in jobs)
    results: dict[int, Any] = {}
    with contextlib.ExitStack() as locks:
        if not distributed:
            _lock_run_dirs(jobs, locks)
        ready = _ready_jobs(launcher, jobs, results)
        groups = _groups(ready, member_keys, max_members)
        log.info("Launching %d jobs as %d population(s) (members differ in %s)", len(jobs), len(groups),
                 ", ".join(member_keys))
        for group in groups:
            results |= _run_population(launcher, group, locked=not distributed)
            configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    return [job.job_return(results.get(job.num)) for job in jobs]


def _read_configs(jobs: list[_Job]) -> None:
    """Every job's validated config (`_Job.rnnlab_config`), read before anything is written: one the config
    refuses is that job's failure (`_Job.config_error`, reported by `_ready_jobs`)."""
    from rnnlab.config import ConfigError, from_omegaconf

    for job in jobs:
        try:
            job.rnnlab_config = from_omegaconf(job.task_cfg)
        except ConfigError as e:
            job.config_error = str(e)


def _lock_run_dirs(jobs: list[_Job], locks: contextlib.ExitStack) -> None:
    """Every job's run-dir lock, held in `locks`. A lock another process holds: RunDirBusy for the whole launch,
    before anything of any job is written. A run dir that cannot be created or locked fails that job alone
    (`_Job.setup_error`)."""
    from rnnlab.rundir import RunDirBusy, RunDirLock

    for job in jobs:
        try:
            job.output_dir.mkdir(parents=True, exist_ok=True)
            locks.enter_context(RunDirLock(job.output_dir))
        except RunDirBusy as e:
            held = str(e).split("; wait", 1)[0]
            raise RunDirBusy(f"{held}; wait for that run or sweep to end, or choose another hydra.sweep.dir (nothing "
                             f"was started or written)") from None
        except OSError as e:
            job.setup_error = (f"cannot write the run dir {job.output_dir} ({e.strerror or e})", EXIT_CANNOT_WRITE)


def _ready_jobs(launcher: Any, jobs: list[_Job], results: dict[int, Any]) -> list[_Job]:
    """The jobs to train. The others are reported here, each counted by Hydra's callbacks: a job whose run dir
    cannot be written or whose config is refused fails (exit 74 or 2, in its results.json as far as its run dir
    allows), before anything compiles; a job whose run completed with its config is done (its eval loss in
    `results`), nothing of it written."""
    from rnnlab.rundir import final_record

    ready = []
    for job in jobs:
        if job.setup_error is not None:
            job.fail(*job.setup_error)
            _callbacks(launcher, job, None)
            continue
        if job.config_error is not None:  # `_read_configs`
            _write_hydra_files(job)
            job.fail(job.config_error, EXIT_BAD_INPUT)
            _callbacks(launcher, job, None)
            continue
        record = final_record(job.output_dir, job.rnnlab_config)
        if record is not None:
            results[job.num] = record.get("eval_loss")
            _callbacks(launcher, job, results[job.num])
            continue
        error = _write_hydra_files(job)
        if error is not None:
            job.fail(f"cannot write the run dir {job.output_dir} ({error.strerror or error})", EXIT_CANNOT_WRITE)
            _callbacks(launcher, job, None)
            continue
        ready.append(job)
    return ready


def _write_hydra_files(job: _Job) -> OSError | None:
    try:
        job.write_hydra_files()
    except OSError as e:
        return e
    return None


def _groups(jobs: list[_Job], member_keys: list[str], max_members: int | None) -> list[list[_Job]]:
    """The jobs whose configs are equal but for `member_keys`, in sweep order, at most `max_members` together.
    Jobs that all hold a checkpoint at the oldest of their newest steps train together from there (a rerun after
    a stop, even a SIGKILL between the members' saves: `train_population` takes the others back to it); else
    they split by their newest step (a grid grown by a seed, a member that diverged long ago), so that no job's
    checkpoints are left for a fresh start."""
    from rnnlab.checkpoint import saved_steps
    from rnnlab.population import population_key

    by_config: dict[Any, list[_Job]] = {}
    for job in jobs:
        by_config.setdefault(population_key(job.rnnlab_config, member_keys), []).append(job)
    size = max_members or max(len(jobs), 1)
    groups = []
    for group in by_config.values():
        steps = [saved_steps(job.output_dir / "checkpoints") if job.rnnlab_config.checkpoint.resume else set()
                 for job in group]
        oldest = min(max(s, default=0) for s in steps)
        if all(oldest in s for s in steps) or not any(steps):
            parts = [group]
        else:
            by_step: dict[int, list[_Job]] = {}
            for job, s in zip(group, steps):
                by_step.setdefault(max(s, default=0), []).append(job)
            parts = list(by_step.values())
        groups += [part[i:i + size] for part in parts for i in range(0, len(part), size)]
    return groups


def _callbacks(launcher: Any, job: _Job, value: Any, start: bool = True) -> None:
    """Hydra's job callbacks for `job` (the sweep's status line counts it): on_job_start (with `start`), on_job_end."""
    saved = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(job.config)
        if start:
            launcher.hydra_context.callbacks.on_job_start(config=job.config, task_function=launcher.task_function)
        launcher.hydra_context.callbacks.on_job_end(config=job.config, job_return=job.job_return(value))
    finally:
        HydraConfig.instance().cfg = saved


def _member_handlers(jobs: list[_Job]) -> list[logging.Handler]:
    """Each job's train.log, with the lines of its own member and those of the whole population."""
    from rnnlab.population import MemberFilter

    file_format = OmegaConf.select(jobs[0].config, "hydra.job_logging.formatters.file.format",
                                   default="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    handlers = []
    for i, job in enumerate(jobs):
        handler = logging.FileHandler(job.log_file)
        handler.setFormatter(logging.Formatter(file_format))
        handler.addFilter(MemberFilter(i))
        handlers.append(handler)
    return handlers


def _run_population(launcher: Any, jobs: list[_Job], locked: bool = True) -> dict[int, Any]:
    """Train one population; returns each job's eval loss by job number (its failure, if any, on the job: a member's
    own fault fails that job alone). `locked`: `launch` holds the jobs' run-dir locks."""
    from rnnlab.population import Member
    from rnnlab.trainer import train_population

    callbacks = launcher.hydra_context.callbacks
    saved = HydraConfig.instance().cfg
    for job in jobs:
        HydraConfig.instance().set_config(job.config)
        callbacks.on_job_start(config=job.config, task_function=launcher.task_function)
    HydraConfig.instance().cfg = saved
    root = logging.getLogger()
    handlers = _member_handlers(jobs)
    for handler in handlers:
        root.addHandler(handler)
    level, absl = root.level, logging.getLogger("absl")
    absl_level = absl.level
    root.setLevel(logging.INFO)
    absl.setLevel(logging.WARNING)  # Orbax: every file it writes at INFO
    members = [Member(job.rnnlab_config, job.output_dir, tuple(job.overrides), tuple(job.varied)) for job in jobs]
    outcome: list | BaseException
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    console = OmegaConf.select(jobs[0].config, "log.sweep_console", default=False) is True
    try:
        if console:
            outcome = _train(train_population, members, locked)
        else:
            with job_output_to(sweep_dir / f"population_{jobs[0].num}.log"):
                outcome = _train(train_population, members, locked)
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
        absl.setLevel(absl_level)
    values: dict[int, Any] = {}
    preempted = None
    if isinstance(outcome, BaseException):
        for job in jobs:
            job.fail(*reversed(exit_codes.of_error(outcome)))
    else:
        for job, (results, error) in zip(jobs, outcome):
            if results["status"] == "preempted":
                preempted = results["step"]
            elif isinstance(error, KeyboardInterrupt):
                raise error
            elif error is not None:
                job.fail(*reversed(exit_codes.of_error(error)))
            values[job.num] = results.get("eval_loss")
    if preempted is not None:  # train.py says how to resume the sweep (each member's train.log has the step)
        raise SystemExit(EXIT_PREEMPTED)
    flush_log_handlers()
    for job in jobs:
        _callbacks(launcher, job, values.get(job.num), start=False)
    return values


def _train(train_population: Any, members: list, locked: bool) -> list | BaseException:
    """`train_population(members)`, or what it raised for them all (a bug's traceback goes to every member's
    train.log; a member's own fault it reports as that member's)."""
    try:
        return train_population(members, locked=locked)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - every member fails with it; the sweeper re-raises the first
        if exit_codes.of_error(e)[0] != EXIT_BAD_INPUT:  # bad input is its one line; anything else, its traceback
            logging.getLogger("rnnlab").exception("the population crashed")
        return e


def flush_log_handlers() -> None:
    """Every logging handler's buffered lines written out (each job's train.log) before Hydra's callbacks run, as
    Hydra's own job runner does, through logging's public API."""
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for handler in {handler for logger in loggers for handler in logger.handlers}:
        with contextlib.suppress(Exception):  # a closed or broken handler: nothing to flush
            handler.flush()
