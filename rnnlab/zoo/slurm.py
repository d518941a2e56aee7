"""`python -m rnnlab.zoo run SUITE --executor slurm`: each job of the plan a SLURM job, through submitit (`.[cluster]`).

A job's SLURM job runs what the processes executor runs (`Executor.command`: the pinned worktree's train.py with the
job's overrides, its output appended to the run dir's stdout.log), so the out dir (its worktree and run dirs) must be
on storage the nodes share. The runner loop is `runner.run`'s: a unit here is one SLURM job, which has ended once
`squeue` no longer lists it as pending or running (`SlurmUnit.ended`); its record comes from the run dir's
results.json, written by the runner alone, as with the other executors.

What was submitted is kept beside the run dirs in `<out>/slurm_jobs.json` (job name -> SLURM job id), written as
soon as `sbatch` answers. A job whose SLURM job is still queued or running (by that id, or by its SLURM job name
`zoo-<out dir's hash>:<job name>`, for a runner killed between `sbatch` and the write) is waited on and never
submitted again; a job that ended without a final status is submitted again and resumes from its checkpoint. At
`--deadline`, SIGTERM or Ctrl-C the runner stops submitting and leaves the queue as it is: the next `run` waits for
those jobs and records them (and any that finished meanwhile, from their run dirs).

At SLURM's time limit (and on preemption) submitit's signal (SIGUSR2, `signal_delay_s` before the limit) reaches
the job: `TrainCommand.checkpoint` tells train.py to save (SIGTERM: it finishes the steps in progress, checkpoints
and ends `preempted`) and submitit requeues the job, which resumes from that step, up to `MAX_NUM_TIMEOUT` times.
train.py itself starts with that signal ignored (its training loop takes it over), so that one arriving during its
start cannot end it unsaved.

The device kind the records are kept under is that of the nodes, not of the machine the runner runs on: one short
SLURM job with the same resources asks JAX (`machine`), once per out dir and resources (`<out>/slurm_machine.json`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rnnlab import files
from rnnlab.zoo import runner
from rnnlab.zoo.runner import Executor, Job, Ledger, Unit, ZooError

STATE_FILE = "slurm_jobs.json"  # job name -> SLURM job id of what this out dir submitted
MACHINE_FILE = "slurm_machine.json"  # resources -> [device kind, machine name] of the nodes they get
LOGS = "slurm"  # <out>/slurm/<job id>/: submitit's files of each SLURM job (its script, pickles and logs)
MAX_NUM_TIMEOUT = 3  # requeues after a time limit (hydra's submitit launcher: max_num_timeout)
POLL_SECONDS = 2.0  # squeue is asked at most this often
# SLURM's states of a job that will not run again (squeue --states=all lists them for MinJobAge after the end).
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE"})


@dataclasses.dataclass(frozen=True)
class Resources:
    """Each job's SLURM request, named as hydra's submitit launcher names it (conf/hydra/launcher/slurm.yaml)."""

    partition: str | None = None
    timeout_min: int = 60
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None
    mem_gb: float | None = None
    account: str | None = None
    qos: str | None = None

    @property
    def signal_delay_s(self) -> int:
        """How long before the time limit submitit's signal comes: 120 s (the launcher's), at most half the limit."""
        return min(120, self.timeout_min * 30)

    def parameters(self) -> dict[str, Any]:
        """submitit.AutoExecutor's parameters."""
        given = {"timeout_min": self.timeout_min, "slurm_signal_delay_s": self.signal_delay_s}
        for key in ("cpus_per_task", "gpus_per_node", "mem_gb"):
            if getattr(self, key) is not None:
                given[key] = getattr(self, key)
        for key in ("partition", "account", "qos"):
            if getattr(self, key) is not None:
                given[f"slurm_{key}"] = getattr(self, key)
        return given

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def check_clients() -> None:
    missing = [p for p in ("sbatch", "squeue", "srun") if shutil.which(p) is None]
    if missing:
        raise ZooError(f"--executor slurm: {', '.join(missing)} not found; run where SLURM's client commands are "
                       "(a login node), with SLURM_CONF set if the cluster needs it")
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise ZooError("--executor slurm needs submitit: pip install -e \".[cluster]\"") from None


def user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


class QueueUnavailable(Exception):
    """squeue does not answer: nothing can be submitted safely (the runner exits 75; the queued jobs go on)."""


class Queue:
    """This user's SLURM jobs as `squeue` lists them (id -> (name, state)), asked at most every POLL_SECONDS."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[str, str]] | None = None
        self._asked = float("-inf")
        self.error: str | None = None  # squeue's last failure, while it fails

    def jobs(self, fresh: bool = False) -> dict[str, tuple[str, str]] | None:
        """id -> (name, state); None while squeue fails (a listing from before would miss the jobs submitted since)."""
        if fresh or time.time() - self._asked >= POLL_SECONDS:
            self._asked = time.time()
            try:
                done = subprocess.run(["squeue", "--noheader", "--states=all", f"--user={user()}",
                                       "--format=%i|%T|%j"], capture_output=True, text=True, timeout=120)
                said = [line for line in done.stderr.splitlines() if line.strip()][-1:]
                self.error = (said[0] if said else f"squeue exited with {done.returncode}") if done.returncode else None
            except (OSError, subprocess.TimeoutExpired) as e:
                self.error = str(e)
            if self.error is not None:
                self._jobs = None
                return None
            jobs = {}
            for line in done.stdout.splitlines():
                parts = line.strip().split("|", 2)
                if len(parts) == 3:
                    jobs[parts[0]] = (parts[2], parts[1].split()[0])
            self._jobs = jobs
        return self._jobs

    def alive(self, job_id: str, name: str) -> bool | None:
        """Whether SLURM job `job_id`, named `name`, is still queued or running (None: squeue cannot say). A job no
        longer listed has ended (SLURM forgets ended jobs after MinJobAge); one listed under another name is
        another job (a controller started afresh numbers its jobs from 1 again)."""
        jobs = self.jobs()
        if jobs is None:
            return None
        found = jobs.get(str(job_id))
        return found is not None and found[0] == name and found[1] not in ENDED

    def find(self, name: str) -> str | None:
        """The id of a job named `name` still queued or running, if any."""
        jobs = self.jobs() or {}
        return next((i for i, (n, state) in jobs.items() if n == name and state not in ENDED), None)


@dataclasses.dataclass
class SlurmUnit(Unit):
    """One job as one SLURM job: ended once the queue no longer has it queued or running."""

    job_id: str = ""
    slurm_name: str = ""
    queue: Queue | None = None
    folder: Path | None = None  # submitit's folder of the job (<out>/slurm/<id>)

    def ended(self) -> bool:
        if self.queue.alive(self.job_id, self.slurm_name) is not False:
            return False
        if self.log_path is not None and not Path(self.log_path).exists():  # it never reached train.py
            self.log_path = self.folder / f"{self.job_id}_0_log.err"
        return True

    @property
    def returncode(self) -> int | None:
        """train.py's exit code, as the job's function returned it (None if it returned none)."""
        try:
            from submitit.core.utils import pickle_load

            outcome, value = pickle_load(self.folder / f"{self.job_id}_0_result.pkl")
        except Exception:  # noqa: BLE001 - no result (killed, requeued for good) or not one of ours
            return None
        return value if outcome == "success" and isinstance(value, int) else None


class TrainCommand:
    """A SLURM job's function (submitit pickles it): the job's train.py as a process on the node, its output
    appended to the run dir's stdout.log; returns train.py's exit code. On submitit's signal (a time limit, a
    preemption) `checkpoint` has train.py save first (SIGTERM; it ends `preempted`), then submitit requeues the job
    and the rerun resumes from that step."""

    def __init__(self, cmd: Sequence[str], code: str, log_path: str, grace: float):
        self.cmd, self.code, self.log_path, self.grace = list(cmd), code, log_path, grace
        self._proc: subprocess.Popen | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_proc": None}

    def __call__(self) -> int:
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            self._proc = subprocess.Popen(self.cmd, cwd=self.code, stdout=log, stderr=subprocess.STDOUT,
                                          env=runner.job_env(Path(self.code)), preexec_fn=_ignore_requeue_signal)
        while not self._ended():
            time.sleep(0.5)
        return self._proc.returncode

    def _ended(self) -> bool:
        """Whether train.py has exited (reaped here: `checkpoint` runs inside a signal handler that may interrupt
        `__call__`'s own check, so neither uses Popen's locks)."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return proc is not None
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by the check this handler interrupted (which sets its code)
            if proc.returncode is None:
                proc.returncode = -1
            return True
        if pid == 0:
            return False
        proc.returncode = os.waitstatus_to_exitcode(status)
        return True

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's signal: train.py saves and exits (at most `grace` seconds), then the job is requeued."""
        from submitit.helpers import DelayedSubmission

        if self._proc is not None and not self._ended():
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
            until = time.time() + self.grace
            while not self._ended() and time.time() < until:
                time.sleep(0.2)
        return DelayedSubmission(TrainCommand(self.cmd, self.code, self.log_path, self.grace))


def _ignore_requeue_signal() -> None:
    """In train.py's process before it starts: SLURM sends submitit's signal to every process of the job, and one
    that arrived before train.py's training loop handles it (or at a train.py of a commit that does not) would end it
    unsaved. Ignored until then; `TrainCommand.checkpoint`'s SIGTERM has it save. The signal as submitit names it
    (`rnnlab.checkpoint.requeue_signal`, not imported here: this runs between fork and exec)."""
    found = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper(), None)
    signal.signal(found if isinstance(found, signal.Signals) else signal.SIGUSR2, signal.SIG_IGN)


class Submitter:
    """sbatch through submitit: functions as SLURM jobs of `resources`, their files in <out>/slurm/<job id>/."""

    def __init__(self, out: Path, resources: Resources):
        self.out, self.resources = Path(out), resources
        self._executor: Any = None

    def submit(self, name: str, function: Callable[[], Any]) -> str:
        """sbatch `function` as SLURM job `name`; its id. A ZooError with sbatch's own line if it refuses."""
        if self._executor is None:
            import submitit

            self._executor = submitit.AutoExecutor(folder=self.out.resolve() / LOGS / "%j", cluster="slurm",
                                                   slurm_max_num_timeout=MAX_NUM_TIMEOUT)
            self._executor.update_parameters(**self.resources.parameters())
        self._executor.update_parameters(name=name)
        try:
            return self._executor.submit(function).job_id
        except Exception as e:  # noqa: BLE001 - sbatch's refusal (submitit's FailedJobError holds its stderr)
            said = [line.strip() for line in str(e).splitlines() if line.strip()]
            lines = [line for line in said if "error" in line.lower()] or said
            raise ZooError(f"sbatch refused job {name}: {lines[-1][:300] if lines else type(e).__name__} (check "
                           "--partition, --account, --qos and the other SLURM flags)") from None

    def folder(self, job_id: str) -> Path:
        return self.out.resolve() / LOGS / job_id


class SlurmExecutor(Executor):
    """Each job a SLURM job of the `resources` (the processes executor's command, run by `TrainCommand`)."""

    name = "slurm"

    def __init__(self, code: Path, out: Path, extra: Sequence[str], resources: Resources,
                 say: Callable[[str], None] = print):
        super().__init__(code, out, extra, pin=False)
        check_clients()
        self.resources, self.say = resources, say
        self.queue = Queue()
        self.state_path = self.out / STATE_FILE
        self.tag = out_tag(self.out)
        self.submitter = Submitter(self.out, resources)

    def slurm_name(self, job: Job) -> str:
        return f"zoo-{self.tag}:{job.name}"

    def submitted(self) -> dict[str, str]:
        return {k: str(v) for k, v in files.read_json_object(self.state_path).items()}

    def remember(self, job: Job, job_id: str) -> None:
        state = self.submitted()
        if state.get(job.name) != job_id:
            state[job.name] = job_id
            try:
                files.write_json(self.state_path, state)
            except OSError as e:
                raise runner.ZooUnwritable(f"cannot write {self.state_path} ({e.strerror or e}); SLURM job "
                                           f"{job_id} ({job.name}) is queued") from None

    def in_queue(self, job: Job) -> str | None:
        """The job's SLURM job still queued or running, if any: the one slurm_jobs.json names, else one by its
        SLURM job name. QueueUnavailable while squeue cannot tell (nothing is submitted blind)."""
        if self.queue.jobs() is None:
            raise QueueUnavailable(f"cannot ask SLURM which jobs are queued (squeue: {self.queue.error}); the queued "
                                   "jobs go on: run again once squeue answers")
        known = self.submitted().get(job.name)
        if known and self.queue.alive(known, self.slurm_name(job)):
            return known
        return self.queue.find(self.slurm_name(job))

    def units(self, jobs: Sequence[Job]) -> list[Unit]:
        return [SlurmUnit([job], queue=self.queue) for job in jobs]

    def busy(self, ledger: Ledger, job: Job) -> str | None:
        """A job in the queue is waited on as a unit of this run (`start` finds it); else the run dir's lock."""
        return None if self.in_queue(job) else ledger.busy(job)

    def in_time(self, ledger: Ledger, tables: Sequence[Any], units: Sequence[Unit], seconds_left: float
                ) -> tuple[list[Unit], list[Unit]]:
        """Every unit: a SLURM job goes on after the runner stops, so the deadline stops the submitting alone."""
        return list(units), []

    def start(self, unit: Unit) -> None:
        job = unit.jobs[0]
        cmd, log_path = self.command(unit)
        unit.log_path, unit.started = log_path, time.time()
        unit.slurm_name = self.slurm_name(job)
        found = self.in_queue(job)
        if found:
            self.say(f"{job.name}: already in the SLURM queue as job {found} (submitted by an earlier runner); "
                     "waiting for it")
            unit.job_id = found
        else:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            grace = max(self.resources.signal_delay_s - 20, 10)
            unit.job_id = self.submitter.submit(unit.slurm_name, TrainCommand(cmd, str(self.code), str(log_path),
                                                                              grace))
            self.queue.jobs(fresh=True)
        self.remember(job, unit.job_id)
        unit.folder = self.submitter.folder(unit.job_id)

    def stop(self, running: list[Unit], why: str, grace: float, finish: Callable[[Unit], None],
             say: Callable[[str], None]) -> None:
        """The runner stops submitting; the queue is left as it is, and the next run waits for these jobs."""
        ids = ", ".join(u.job_id for u in running)
        say(f"{why}: leaving {len(running)} SLURM jobs queued or running ({ids}); the next run waits for them "
            "and records them")

    def abandon(self, running: Sequence[Unit]) -> None:
        """Nothing to do: the jobs stay in the queue, slurm_jobs.json names them for the next run."""


def out_tag(out: Path) -> str:
    """A short hash of the out dir: SLURM job names say whose job they are."""
    return hashlib.sha1(str(Path(out).resolve()).encode()).hexdigest()[:8]


class ProbeWaiting(Exception):
    """The deadline came while the probe job (`machine`) waited in the queue."""


def machine(out: Path, resources: Resources, deadline: float = float("inf"), ask: bool = True,
            say: Callable[[str], None] = print) -> tuple[str, str] | None:
    """The nodes' kind of device and machine name, as the records give them (`runner.this_machine`), asked by one
    SLURM job of `resources` and kept in <out>/slurm_machine.json; None where it is not kept and `ask` is false."""
    path = Path(out) / MACHINE_FILE
    known = files.read_json_object(path)
    if resources.key() in known:
        kind, name = known[resources.key()]
        return kind, name
    if not ask:
        return None
    check_clients()
    Path(out).mkdir(parents=True, exist_ok=True)
    submitter, name = Submitter(out, resources), f"zoo-{out_tag(out)}:probe"
    job_id = submitter.submit(name, ProbeMachine(sys.executable))
    say(f"asking SLURM job {job_id} which device the jobs run on (once for these resources)")
    queue, result = Queue(), submitter.folder(job_id) / f"{job_id}_0_result.pkl"
    while not result.exists() and queue.alive(job_id, name) is not False:
        if time.time() >= deadline:
            raise ProbeWaiting(job_id)
        time.sleep(1.0)
    time.sleep(0.5)  # a result written as the job ended
    from submitit.core.utils import pickle_load

    try:
        outcome, value = pickle_load(result)
    except (OSError, EOFError):
        outcome, value = "error", f"no result; see {result.parent}"
    if outcome != "success":
        last = [line for line in str(value).splitlines() if line.strip()][-1:]
        raise ZooError(f"the probe job {job_id} failed: {last[0].strip()[:300] if last else 'no output'}")
    kind, name = value
    known[resources.key()] = [kind, name]
    files.write_json(path, known)
    return kind, name


class ProbeMachine:
    """The probe job's function: `runner.this_machine` on the node."""

    def __init__(self, python: str):
        self.python = python

    def __call__(self) -> tuple[str, str]:
        return runner.this_machine(self.python)
