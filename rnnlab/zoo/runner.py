"""`plan` and `run`: a suite's jobs under the protocol, resumable, at one commit.

A job's run dir is <out>/<table>/<setting slug>/lr<lr>_seed<seed>. A job is done when its run dir or the committed
records (docs/zoo/records) hold a final record (`records.FINAL`) made at the pinned commit on this kind of device;
so a suite spread over sessions and machines goes on from what was committed. Each setting trains its lr grid on
seed 0 first; once the grid is done the protocol's rule (`protocol.edge_choice`: the best lr, and the next lr out
while the best is an end of those tried) picks the lr, and the setting's other seeds go to the front of the queue. The code runs from a git worktree of the pinned commit (`<out>/worktrees/`),
never from the checkout being edited. Three executors: `processes` (one train.py per job, `--parallel` side by side:
one per core, or several sharing a GPU), `population` (hydra/launcher=population: a setting's grid as one
program, then its seeds as one program) and `slurm` (`rnnlab.zoo.slurm`: each job a SLURM job). Before `--deadline`
a job starts only if the records predict that it ends in time (a job stopped there resumes on this machine alone,
and the next session may run on another); at the deadline, or on SIGTERM or Ctrl-C to the runner, nothing new
starts and running jobs get SIGTERM (they save and end `preempted`; the next `run` resumes them), then SIGKILL
after `--grace` seconds. SLURM jobs are left in the queue instead: the next `run` waits for them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rnnlab import exit_codes
from rnnlab.files import exclusive_lock, lock_holder
from rnnlab.sweep_status import duration, schedule_seconds, status_line
from rnnlab.zoo import page, protocol, records
from rnnlab.zoo.protocol import Choice, Setting, Table, edge_choice, job_dirname, lr_text, same_lr

# Overrides the protocol fixes: `run`'s extra overrides may not set them.
PROTOCOL_KEYS = ("steps", "optimizer.lr", "seed", "data.seq_len", "data.eval_seq_lens", "experiment", "model",
                 "hybrid", "hydra.mode", "hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "state_tracking")


class ZooError(Exception):
    """Bad input to the zoo's CLI: one line, exit 2."""


class ZooUnwritable(Exception):
    """A folder the zoo must write (the run dirs' --out, the docs) cannot be written: one line, exit 74."""


RUNNER_LOCK = ".zoo-runner.lock"


class RunnerLock:
    """An exclusive `flock` on `<out>/.zoo-runner.lock` for a runner's life: one runner per out dir (a second would
    start the same jobs). The OS drops it when the runner ends, SIGKILL included; the file names the holder."""

    def __init__(self, out: Path):
        self.path = Path(out) / RUNNER_LOCK
        self._fd: int | None = None

    def acquire(self) -> "RunnerLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, who = exclusive_lock(self.path)
        except OSError as e:
            raise ZooUnwritable(f"option '--out': cannot write {self.path.parent} ({e.strerror or e}); choose a "
                                "writable --out") from None
        if fd is None:
            raise ZooError(f"option '--out': {self.path.parent} is in use by another zoo runner ({who}); wait for "
                           "it to end, or use another --out")
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunnerLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


@dataclasses.dataclass(frozen=True)
class Job:
    table: Table
    setting: Setting
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.table.key}/{self.setting.slug}/{job_dirname(self.lr, self.seed)}"

    def run_dir(self, out: Path) -> Path:
        return Path(out) / self.name

    def overrides(self) -> list[str]:
        return self.table.job_overrides(self.setting, self.lr, self.seed)


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


def repo_root() -> Path:
    """The git checkout this rnnlab runs from (the zoo runs its commits, so it needs one)."""
    here = Path(__file__).resolve().parents[2]
    try:
        return Path(git(here, "rev-parse", "--show-toplevel"))
    except (OSError, subprocess.CalledProcessError):
        raise ZooError(f"the zoo runs a commit of a git checkout, and {here} is none: clone the repository") from None


def resolve_commit(root: Path, ref: str) -> str:
    try:
        return git(root, "rev-parse", "--verify", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        raise ZooError(f"option '--commit': {ref!r} is no commit of {root}") from None


def worktree(root: Path, commit: str, out: Path) -> Path:
    """A checkout of `commit` at <out>/worktrees/<commit> (made once; the jobs run its train.py)."""
    path = (Path(out) / "worktrees" / commit[:12]).resolve()
    if not (path / "train.py").exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            probe = path.parent / f".write_test.{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ZooUnwritable(f"option '--out': cannot write {path.parent} ({e.strerror or e}); choose a writable "
                                "--out") from None
        subprocess.run(["git", "-C", str(root), "worktree", "prune"], capture_output=True)
        made = subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "--force", str(path), commit],
                              capture_output=True, text=True)
        if made.returncode:
            said = [line for line in made.stderr.splitlines() if line.strip()][-1:]
            raise ZooUnwritable(f"cannot check out commit {commit[:12]} at {path}: "
                                f"{said[0] if said else 'git worktree add failed'}")
    return path


def this_machine(python: str = sys.executable, code: Path | None = None) -> tuple[str, str]:
    """This machine's kind of device and its name as records give them (`provenance.device_kind`,
    `machine_name`), asked of JAX in a child process (so that this one never holds an accelerator)."""
    script = ("import jax, json; from rnnlab.provenance import machine, device_kind, machine_name; "
              "m = machine(jax.devices()); print(json.dumps([device_kind(m), machine_name(m)]))")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if code is not None:
        env["PYTHONPATH"] = str(code)
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode:
        raise ZooError(f"cannot start JAX to name this machine: {done.stderr.strip().splitlines()[-1:]}")
    kind, name = json.loads(done.stdout.strip().splitlines()[-1])
    return kind, name


class Ledger:
    """What is known of each job: the committed records and the run dirs' results, at one commit and device kind."""

    def __init__(self, tables: Sequence[Table], out: Path, docs: Path, commit: str | None, kind: str,
                 machine: str | None = None):
        self.out, self.docs, self.commit, self.kind = Path(out), Path(docs), commit, kind
        self.machine = machine  # this machine's name: its own records predict its times best
        every = {t.key: t for t in tables} | {t.base.key: t.base for t in tables if t.base is not None}
        self.committed = {key: [r for r in records.read_table(docs, key) if self._ours(r)] for key in every}
        self._final: dict[str, dict[str, Any]] = {}

    def _ours(self, record: dict[str, Any]) -> bool:
        return (self.commit is None or records.commit_of(record) == self.commit) and records.kind_of(record) == self.kind

    def record(self, job: Job) -> dict[str, Any] | None:
        """The job's record if it is done (a final status), from its run dir or the committed records; else None."""
        if job.name in self._final:
            return self._final[job.name]
        results = records.results_of(job.run_dir(self.out))
        found = None
        if results.get("status") in records.FINAL and results.get("step") is not None:
            record = records.record_from_results(job.table, job.setting, job.lr, job.seed, results, job.name)
            if self._ours(record):
                found = record
        if found is None:
            done = [r for r in records.find(self.committed[job.table.key], job.setting.name, job.lr, job.seed)
                    if r.get("status") in records.FINAL]
            found = done[-1] if done else None
        if found is not None:
            self._final[job.name] = found
        return found

    def busy(self, job: Job) -> str | None:
        """Who trains the job in another process (its run dir's lock is held: a job an earlier runner started and
        that outlived it), else None. Such a job is waited on, never started twice."""
        return lock_holder(job.run_dir(self.out) / ".rnnlab.lock.0")

    def started(self, job: Job) -> bool:
        """Whether the job has a run dir with a checkpoint or results (it resumes rather than starts)."""
        return (job.run_dir(self.out) / "results.json").exists()


def grid_jobs(table: Table, setting: Setting) -> list[Job]:
    """The table's own lr grid on seed 0 (the edge rule may add lrs: `seed0_jobs`)."""
    return [Job(table, setting, lr, 0) for lr in table.lrs]


def choice_of(ledger: Ledger, table: Table, setting: Setting) -> Choice:
    """Where the setting's seed-0 lrs stand (`protocol.edge_choice`), from the records known: the grid, then each lr
    the edge rule added once its record is there."""
    scores: dict[float, float | None] = {}
    while True:
        choice = edge_choice(table, scores)
        found = {lr: ledger.record(Job(table, setting, lr, 0)) for lr in choice.pending}
        found = {lr: r for lr, r in found.items() if r is not None}
        if not found:
            return choice
        scores.update({lr: records.score(r, table) for lr, r in found.items()})


def seed0_jobs(choice: Choice, table: Table, setting: Setting) -> list[Job]:
    """Seed 0 at every lr the rule has asked for so far: the grid and its extensions."""
    return [Job(table, setting, lr, 0) for lr in choice.lrs]


def seed_jobs(table: Table, setting: Setting, lr: float) -> list[Job]:
    return [Job(table, setting, lr, seed) for seed in range(1, table.seeds)]


def seeds_waiting(ledger: Ledger, tables: Sequence[Table]) -> list[Job]:
    """The seed jobs of each setting whose choice is not final yet, at the best lr so far (their lr is not chosen
    yet): what a prediction counts beside the ready jobs."""
    waiting = []
    for table in tables:
        for setting in table.settings if table.base is None else ():
            choice = choice_of(ledger, table, setting)
            if not choice.final:  # at the best lr so far; those already recorded there count as done
                waiting += [j for j in seed_jobs(table, setting, choice.best or table.lrs[0]) if not ledger.record(j)]
    return waiting


@dataclasses.dataclass
class Plan:
    """Each setting's jobs as far as they can be known: seed 0's lrs (the grid and what the edge rule added), then
    the chosen lr's seeds (not yet known while seed 0's lrs are pending)."""

    done: list[Job]
    todo_now: list[Job]  # ready to run, in the order they run: seeds of final choices first, then seed-0 lrs
    later: int  # jobs that wait on a choice (its seeds)
    no_lr: list[tuple[Table, Setting]]  # settings whose every lr failed
    extensions: list[Job] = dataclasses.field(default_factory=list)  # seed-0 jobs the edge rule added, done or not
    excluded: int = 0  # ready jobs left out of todo_now as running

    @property
    def total(self) -> int:
        return len(self.done) + len(self.todo_now) + self.later + self.excluded


def base_row(ledger: Ledger, base: Table, setting: Setting) -> "page.Row":
    """The setting's row of `base` from the records known (as the page draws it)."""
    recs = [r for j in known_jobs(ledger, base, setting) if (r := ledger.record(j)) is not None]
    return page.rows_of(base, recs, [setting.name])[0]


def budget_jobs(ledger: Ledger, table: Table, setting: Setting) -> list[Job] | None:
    """A budget check's jobs of a setting: every seed at the lr its base table chose, where the base row is complete
    and disagrees with its papers or agrees only partly (`page.needs_budget_check`); [] where it needs none; None
    while the base row is not complete."""
    row = base_row(ledger, table.base, setting)
    if not row.complete:
        return None
    if row.lr is None or not page.needs_budget_check(row, table.base):
        return []
    return [Job(table, setting, row.lr, seed) for seed in range(table.seeds)]


def make_plan(ledger: Ledger, tables: Sequence[Table], running: Sequence[str] = ()) -> Plan:
    done, seeds_now, grids_now, later, no_lr, extensions = [], [], [], 0, [], []
    for table in tables:
        if table.base is not None:  # a budget check: its settings' seeds, once their base rows are complete
            for setting in table.settings:
                jobs = budget_jobs(ledger, table, setting)
                for job in jobs or []:
                    (done if ledger.record(job) else seeds_now).append(job)
            continue
        for setting in table.settings:
            choice = choice_of(ledger, table, setting)
            for job in seed0_jobs(choice, table, setting):
                (done if ledger.record(job) else grids_now).append(job)
                if not any(same_lr(job.lr, lr) for lr in table.lrs):
                    extensions.append(job)
            if not choice.final:  # its seeds: those not recorded at the best lr so far (the choice may move)
                later += sum(not ledger.record(j) for j in seed_jobs(table, setting, choice.best or table.lrs[0]))
            elif choice.lr is None:
                no_lr.append((table, setting))
            else:
                for job in seed_jobs(table, setting, choice.lr):
                    (done if ledger.record(job) else seeds_now).append(job)
    running = set(running)
    todo = [j for j in seeds_now + grids_now if j.name not in running]
    excluded = sum(j.name in running for j in seeds_now + grids_now)
    return Plan(done, todo, later, no_lr, extensions, excluded)


def job_seconds(ledger: Ledger, tables: Sequence[Table]) -> Callable[[Job], float | None]:
    """A job's predicted wall time on this machine from the records of this device kind (any commit); None with no
    record at all. A cell with no record yet is predicted from the cells that have one (an underestimate while
    only the fast ones have run: `plan --probe` times one job per table). A table `like` another is predicted from
    that one's records too (scaled by the cells both ran, else by their steps)."""
    by_cell: dict[tuple[str, str], list[float]] = {}
    here: dict[tuple[str, str], list[float]] = {}  # the same, from this machine's own records
    per_step: list[float] = []
    known = {t.key for t in tables}
    tables = [*tables, *(protocol.TABLES[t.like] for t in tables if t.like in protocol.TABLES and t.like not in known)]
    for table in dict.fromkeys(tables):
        for record in records.read_table(ledger.docs, table.key):
            seconds = record.get("wall_seconds")
            if record.get("status") == "completed" and seconds and records.kind_of(record) == ledger.kind:
                by_cell.setdefault((table.key, record["setting"].split()[0]), []).append(seconds)
                if records.machine_of(record) == ledger.machine:
                    here.setdefault((table.key, record["setting"].split()[0]), []).append(seconds)
                per_step.append(seconds / table.steps)

    steps = {t.key: t.steps for t in tables}

    def median(key: tuple[str, str], mine_first: bool = True) -> float:
        return statistics.median((here.get(key) if mine_first else None) or by_cell[key])

    def scale(table: str, other: str) -> float:
        """How much longer a job of `table` takes than one of `other`: the median ratio over the cells that ran
        both (their lengths, batches and evals differ), else the ratio of their steps."""
        shared = [c for (t, c) in by_cell if t == table and (other, c) in by_cell]
        if not shared:
            return steps[table] / steps[other]
        return statistics.median(median((table, c), False) / median((other, c), False) for c in shared)

    def predict(job: Job) -> float | None:
        """The cell's median in this table on this machine, else on this kind; else its median in each other
        table, scaled to this one (`scale`); else the table's median; else the median per step of every record."""
        key = (job.table.key, job.setting.cell)
        if key in by_cell:
            return median(key)
        elsewhere = [median((t, c)) * scale(job.table.key, t) for (t, c) in by_cell if c == job.setting.cell]
        if elsewhere:
            return statistics.median(elsewhere)
        table = [s for (t, _), v in by_cell.items() if t == job.table.key for s in v]
        if table:
            return statistics.median(table)
        return statistics.median(per_step) * job.table.steps if per_step else None

    return predict


def seconds_from_here(ledger: Ledger, job: Job, seconds: float | None) -> float | None:
    """A job's predicted time less the part its run dir already trained (a stopped job resumes there)."""
    if seconds is None:
        return None
    step = records.results_of(job.run_dir(ledger.out)).get("step")
    done = min(step / job.table.steps, 1.0) if isinstance(step, int) and job.table.steps else 0.0
    return seconds * (1.0 - done)


def unit_seconds(ledger: Ledger, predict: Callable[[Job], float | None], jobs: Sequence[Job],
                 fallback: float | None = None) -> float | None:
    """What a unit of these jobs should take from here: its slowest job's time; None if some job has none."""
    times = [seconds_from_here(ledger, job, predict(job) or fallback) for job in jobs]
    return None if None in times else max(times)


def print_plan(ledger: Ledger, tables: Sequence[Table], parallel: int, say: Callable[[str], None] = print) -> Plan:
    plan = make_plan(ledger, tables)
    predict = job_seconds(ledger, tables)
    say(f"commit {ledger.commit or '(any)'} on {ledger.machine or ledger.kind}; run dirs in {ledger.out}")
    for table in tables:
        mine = [j for j in plan.done if j.table is table]
        if table.base is not None:
            todo = [j for j in plan.todo_now if j.table is table]
            settings = len({j.setting for j in mine + todo})
            say(f"  {table.key}: budget check of {table.base.key}: {settings} settings that disagree with their papers "
                f"or agree partly x {table.seeds} seeds at {table.steps} steps = {len(mine) + len(todo)} jobs, "
                f"{len(mine)} recorded")
            continue
        jobs = len(table.settings) * table.jobs_per_setting()
        added = [j for j in plan.extensions if j.table is table]
        say(f"  {table.key}: {len(table.settings)} settings x ({len(table.lrs)} lrs + {table.seeds - 1} seeds) = "
            f"{jobs} jobs" + (f" + {len(added)} the edge rule added" if added else "")
            + f", {len(mine)} recorded, {table.steps} steps each")
        for job in [j for j in added if not ledger.record(j)]:
            seconds = unit_seconds(ledger, predict, [job])
            say(f"    edge rule: {job.setting.name} at lr {lr_text(job.lr)}, seed 0"
                + (f" (about {duration(seconds)})" if seconds is not None else ""))
    left = [unit_seconds(ledger, predict, [j]) for j in plan.todo_now]
    later_seconds = [unit_seconds(ledger, predict, [j]) for j in seeds_waiting(ledger, tables)]
    known = [s for s in left + later_seconds if s is not None]
    unknown = len(left) + len(later_seconds) - len(known)
    say(f"{plan.total} jobs: {len(plan.done)} recorded, {len(plan.todo_now)} ready, {plan.later} waiting on their "
        "seed-0 lrs" + (f", {len(plan.no_lr)} settings with every lr failed" if plan.no_lr else ""))
    if not left and not later_seconds:
        say("predicted: nothing left to run")
    elif known:
        say(f"predicted: {duration(sum(known) / max(parallel, 1))} with {parallel} side by side "
            f"({duration(sum(known))} of job time" + (f"; {unknown} jobs with no time to go by" if unknown else "")
            + "), from the records' own times on this kind of machine")
    else:
        say("predicted: unknown (no record on this kind of machine yet: `plan --probe` times one short job per table)")
    return plan


@dataclasses.dataclass
class Unit:
    """What one executor call runs: one job (processes, slurm) or a setting's jobs as one program (population). The
    run loop asks it whether it has ended and with what exit code; a SLURM job's unit answers from the queue
    (`rnnlab.zoo.slurm.SlurmUnit`)."""

    jobs: list[Job]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    log: Any = None
    log_path: Path | None = None

    def ended(self) -> bool:
        """Whether what runs the unit has ended (polled every 50 ms while the run loop waits: `_pause`)."""
        return self.proc is not None and self.proc.poll() is not None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None


def job_env(code: Path) -> dict[str, str]:
    """A job's environment: the worktree's rnnlab first, the caller's own path after it (a new cell's module,
    `imports=[...]`)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH")) if p),
                HYDRA_FULL_ERROR="1")


class Executor:
    """Starts a unit's train.py in the pinned worktree, as a process of this machine. The run loop (`run`) asks an
    executor five things, which `rnnlab.zoo.slurm.SlurmExecutor` answers for jobs in a SLURM queue: the units of
    some jobs, whether a job is trained elsewhere (`busy`), which units to start before the deadline (`in_time`),
    how to start one (`start`), and what to do with the running units when the run stops (`stop`) or fails
    (`abandon`)."""

    name = "processes"

    def __init__(self, code: Path, out: Path, extra: Sequence[str], pin: bool):
        self.code, self.out, self.extra, self.pin = Path(code), Path(out), list(extra), pin

    def units(self, jobs: Sequence[Job]) -> list[Unit]:
        return [Unit([job]) for job in jobs]

    def busy(self, ledger: Ledger, job: Job) -> str | None:
        """Who trains the job outside this runner (to wait on, never to start twice), else None."""
        return ledger.busy(job)

    def in_time(self, ledger: Ledger, tables: Sequence[Table], units: Sequence[Unit], seconds_left: float
                ) -> tuple[list[Unit], list[Unit]]:
        """(the units to start now, those that would not end before the deadline): a unit still running at the
        deadline is stopped there, so one predicted to end after it does not start."""
        return split_by_deadline(ledger, tables, units, seconds_left)

    def stop(self, running: list[Unit], why: str, grace: float, finish: Callable[[Unit], None],
             say: Callable[[str], None]) -> None:
        """The run stops (deadline, SIGTERM, Ctrl-C): SIGTERM to each running job (it saves and ends `preempted`;
        the next run resumes it), SIGKILL after `grace` seconds; each unit `finish`ed as it ends."""
        say(f"{why}: stopping {sum(len(u.jobs) for u in running)} running jobs (SIGTERM: they save and resume "
            "at the next run)")
        _terminate(running)
        until = time.time() + grace
        while running and time.time() < until:
            for unit in [u for u in running if u.ended()]:
                finish(unit)
            time.sleep(0.5)
        for unit in list(running):
            with _suppress():
                os.killpg(unit.proc.pid, signal.SIGKILL)
            unit.proc.wait()
            finish(unit)

    def abandon(self, running: Sequence[Unit]) -> None:
        """The runner fails: it leaves no job running unseen (each saves; the next run resumes it)."""
        _terminate(running)

    def command(self, unit: Unit) -> tuple[list[str], Path]:
        job = unit.jobs[0]
        run_dir = job.run_dir(self.out).resolve()
        return ([sys.executable, str(self.code / "train.py"), *job.overrides(), *self.extra, "hydra.mode=RUN",
                 f"hydra.run.dir={run_dir}"], run_dir / "stdout.log")

    def start(self, unit: Unit) -> None:
        cmd, log_path = self.command(unit)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        unit.log_path = log_path
        unit.log = open(log_path, "a")
        env = job_env(self.code)
        if self.pin:
            env["RNNLAB_PIN_CPU"] = "1"
        unit.proc = subprocess.Popen(cmd, cwd=self.code, stdout=unit.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        unit.started = time.time()


class PopulationExecutor(Executor):
    """hydra/launcher=population: the jobs of one setting that wait together (its grid, or its seeds) as one program."""

    name = "population"

    def units(self, jobs: Sequence[Job]) -> list[Unit]:
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            groups.setdefault((job.table.key, job.setting.name, job.seed == 0), []).append(job)
        return [Unit(group) for group in groups.values()]

    def command(self, unit: Unit) -> tuple[list[str], Path]:
        first = unit.jobs[0]
        base = [o for o in first.overrides() if not o.startswith(("optimizer.lr=", "seed="))]
        lrs = ",".join(dict.fromkeys(lr_text(j.lr) for j in unit.jobs))
        seeds = ",".join(dict.fromkeys(str(j.seed) for j in unit.jobs))
        sweep_dir = first.run_dir(self.out).parent.resolve()
        return ([sys.executable, str(self.code / "train.py"), "-m", *base, f"optimizer.lr={lrs}", f"seed={seeds}",
                 *self.extra, "hydra/launcher=population", f"hydra.sweep.dir={sweep_dir}",
                 "hydra.sweep.subdir=lr${optimizer.lr}_seed${seed}"],
                sweep_dir / f"population_{'grid' if first.seed == 0 else 'seeds'}.stdout.log")


def check_extra(extra: Sequence[str]) -> None:
    for override in extra:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in PROTOCOL_KEYS or key.startswith("hydra/launcher"):
            raise ZooError(f"override '{override}': the protocol sets '{key}' (allowed: other keys, e.g. "
                           "checkpoint.enabled=false, imports=[mycells], hydra.searchpath=[file://conf_dir])")
        if "=" not in override:
            raise ZooError(f"override '{override}': expected key=value")


def run(ledger: Ledger, tables: Sequence[Table], executor: Executor, parallel: int, deadline: float,
        grace: float = 30.0, say: Callable[[str], None] = print, on_done: Callable[[list[dict]], None] | None = None
        ) -> int:
    """Run every job the protocol still needs, `parallel` units side by side, until done or `deadline` (time.time());
    `on_done` gets the records of each finished unit's jobs. Exit code 0 when nothing is left, 75 when the deadline
    stopped it (the next run goes on), 1 if a job ended without a final status."""
    start = time.time()
    running: list[Unit] = []
    attempted: set[str] = set()  # a job runs at most once a call: one that ends without a final record waits for the next
    finished_here: list[float] = []
    waiting: dict[str, str] = {}  # jobs that another process trains (an earlier runner's, outliving it): name -> holder
    failed = 0
    incomplete = 0

    def status() -> None:
        plan = make_plan(ledger, tables, [j.name for u in running for j in u.jobs] + list(waiting))
        total_now = plan.total
        seconds = seconds_to_go(ledger, tables, plan, executor, running, parallel, finished_here)
        say(status_line(len(plan.done), total_now, sum(len(u.jobs) for u in running) + len(waiting), failed,
                        seconds, time.time() - start)
            + (f" ({incomplete} ended without a final status: the next run goes on with them)" if incomplete else ""))

    def finish(unit: Unit) -> None:
        nonlocal failed, incomplete
        running.remove(unit)
        unit.close()
        done = []
        for job in unit.jobs:
            record = ledger.record(job)
            if record is None:
                incomplete += 1
                say(f"{job.name}: {ended_without_record(ledger, job, unit)}")
                continue
            done.append(record)
            failed += record["status"] != "completed"
            finished_here.append((time.time() - unit.started) / len(unit.jobs))
        if on_done and done:
            on_done(done)
        status()

    def adopt(name: str) -> None:
        """A job another process trained has ended: record it if it reached a final status (else it resumes)."""
        nonlocal failed
        waiting.pop(name)
        job = next(j for t in tables for s in t.settings for j in known_jobs(ledger, t, s) if j.name == name)
        record = ledger.record(job)
        if record is None:
            return
        failed += record["status"] != "completed"
        if on_done:
            on_done([record])
        status()

    stopped = False
    signalled: list[int] = []
    previous = _on_stop_signals(signalled.append)
    try:
        status()
        while True:
            for unit in [u for u in running if u.ended()]:
                finish(unit)
            for name in [n for n in waiting if not lock_holder(ledger.out / n / ".rnnlab.lock.0")]:
                adopt(name)
            if time.time() >= deadline or signalled:
                stopped = True
                break
            plan = make_plan(ledger, tables, attempted | set(waiting))
            for job in plan.todo_now:
                holder = executor.busy(ledger, job)
                if holder:
                    waiting[job.name] = holder
                    say(f"{job.name}: still trained by {holder} (started by an earlier runner); waiting for it to end")
            todo = [j for j in plan.todo_now if j.name not in waiting]
            if not todo and not running and not waiting:
                break
            free = max(parallel - len(running), 0)
            if free and todo:
                in_time, late = executor.in_time(ledger, tables, executor.units(todo), deadline - time.time())
                for unit in in_time[:free]:
                    executor.start(unit)
                    running.append(unit)
                    attempted.update(j.name for j in unit.jobs)
                if late and not in_time and not running and not waiting:
                    say(f"deadline in {duration(deadline - time.time())}: the {sum(len(u.jobs) for u in late)} ready "
                        "jobs are predicted to end after it; the next run starts them")
                    stopped = True
                    break
            _pause(running)
        if stopped and waiting:
            say(f"{len(waiting)} jobs of an earlier runner are still training; the next run records them")
        if stopped and running:
            executor.stop(running, signal.Signals(signalled[0]).name if signalled else "deadline", grace, finish, say)
    except BaseException:  # a runner that fails leaves no job running unseen: each saves, the next run resumes it
        executor.abandon(running)
        raise
    finally:
        _restore_signals(previous)
    plan = make_plan(ledger, tables)
    if plan.todo_now or plan.later or waiting:
        return exit_codes.PREEMPTED if stopped else exit_codes.BUG
    return exit_codes.OK


def known_jobs(ledger: Ledger, table: Table, setting: Setting) -> list[Job]:
    """A setting's jobs known so far: seed 0's lrs, and its seeds once the choice is final (a budget check's: its
    seeds at the base table's choice)."""
    if table.base is not None:
        return budget_jobs(ledger, table, setting) or []
    choice = choice_of(ledger, table, setting)
    seeds = seed_jobs(table, setting, choice.lr) if choice.final and choice.lr is not None else []
    return seed0_jobs(choice, table, setting) + seeds


def ended_without_record(ledger: Ledger, job: Job, unit: Unit) -> str:
    """Why a job that ended has no final record, in words: stopped where it resumes, stopped before anything was
    saved, or failed to start (with its output's last line)."""
    run_dir = job.run_dir(ledger.out)
    results = records.results_of(run_dir)
    code = unit.returncode
    step = results.get("step")
    if results.get("status") == "preempted" and isinstance(step, int) and step > 0:
        return f"stopped at step {step} (exit {code}); the next run resumes it"
    if results.get("status") == "preempted" or code in (exit_codes.PREEMPTED, -signal.SIGTERM, -signal.SIGKILL):
        return f"stopped before its first checkpoint (exit {code}); the next run starts it again"
    log = unit.log_path or run_dir / "stdout.log"
    try:
        last = [line for line in Path(log).read_text(errors="replace").splitlines() if line.strip()][-1:]
    except OSError:
        last = []
    said = last[0].strip()[:200] if last else "no output"
    return f"{results.get('status') or 'no results.json'} (exit {code}): {said} (see {log})"


# Before a deadline a job starts only if this times its predicted time is left: in the zoo's records most jobs
# take under 1.25 times their cell's median.
DEADLINE_MARGIN = 1.25


def split_by_deadline(ledger: Ledger, tables: Sequence[Table], units: Sequence[Unit], seconds_left: float
                      ) -> tuple[list[Unit], list[Unit]]:
    """(the units predicted to end before the deadline, those predicted to end after it). A unit takes its slowest
    job's time; one with no time to go by counts as ending in time (the deadline still stops it)."""
    if math.isinf(seconds_left):
        return list(units), []
    predict = job_seconds(ledger, tables)
    in_time, late = [], []
    for unit in units:
        seconds = unit_seconds(ledger, predict, unit.jobs)
        ends_in_time = seconds is None or seconds * DEADLINE_MARGIN <= seconds_left
        (in_time if ends_in_time else late).append(unit)
    return in_time, late


def seconds_to_go(ledger: Ledger, tables: Sequence[Table], plan: Plan, executor: Executor, running: Sequence[Unit],
                  parallel: int, finished_here: Sequence[float]) -> float | None:
    """When the last unit should end, as `print_plan` predicts a job (`job_seconds`: the records' own times on this
    kind of machine; where none tells, the mean of the jobs finished in this call): the running units' rest, then
    the ready jobs and the seeds of each setting whose grid is not done, as the executor groups them, on `parallel`
    slots. A unit takes its slowest job's time. None while some unit has no time to go by."""
    predict = job_seconds(ledger, tables)
    fallback = statistics.mean(finished_here) if finished_here else None

    units = executor.units(plan.todo_now) + executor.units(seeds_waiting(ledger, tables))
    queued = [unit_seconds(ledger, predict, u.jobs, fallback) for u in units]
    now, in_flight = time.time(), [unit_seconds(ledger, predict, u.jobs, fallback) for u in running]
    if None in queued or None in in_flight:
        return None
    return schedule_seconds([max(s - (now - u.started), 0.0) for s, u in zip(in_flight, running)], queued, parallel)


def _pause(running: list[Unit], seconds: float = 1.0) -> None:
    """The run loop's wait: `seconds`, or less once a running unit ends, so that the next job starts at once (the
    loop's own work, the plan from the records, runs about once a second while nothing ends)."""
    until = time.time() + seconds
    while time.time() < until and not any(unit.ended() for unit in running):
        time.sleep(0.05)


def _terminate(units: Sequence[Unit]) -> None:
    """SIGTERM to each unit's job: it saves, ends preempted, and the next run resumes it."""
    for unit in units:
        with _suppress():
            unit.proc.send_signal(signal.SIGTERM)


def _on_stop_signals(handler: Callable[[int], None]) -> dict[int, Any]:
    """SIGTERM and SIGINT stop a run as its deadline does (jobs told to save, their records collected), so that
    a killed runner leaves no job running unseen; the handlers before, to restore. Off the main thread: none."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, lambda signum, frame: handler(signum)) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], (ProcessLookupError, PermissionError))


def probe_seconds(code: Path, table: Table, out: Path, extra: Sequence[str] = (), steps: int = 40) -> float:
    """One short job of `table`'s first setting, with the run's own overrides and path, to scale a per-step time to the
    table's steps: the predicted wall time of one of its jobs (compile and evaluation counted once each)."""
    job = Job(table, table.settings[0], table.lrs[0], 0)
    run_dir = (Path(out) / "probes" / table.key).resolve()
    overrides = [o if not o.startswith("steps=") else f"steps={steps}" for o in job.overrides()]
    cmd = [sys.executable, str(Path(code) / "train.py"), *overrides, *extra, "hydra.mode=RUN",
           f"hydra.run.dir={run_dir}", "checkpoint.enabled=false", f"eval_every={steps}", f"log_every={steps}",
           "device.compile_cache=false"]
    done = subprocess.run(cmd, cwd=code, capture_output=True, text=True, env=job_env(code), check=False)
    results = records.results_of(run_dir)
    if results.get("status") != "completed" or not results.get("tokens_per_sec"):
        said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()][-1:]
        raise ZooError(f"plan --probe: the probe job of {table.key} ended with exit {done.returncode}: "
                       f"{said[0].strip() if said else 'no output'}")
    per_step = results["tokens_per_step"] / results["tokens_per_sec"]
    fixed = results["wall_seconds"] - per_step * steps
    return fixed + per_step * table.steps


CONFIG_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import train
print(json.dumps([train.config_exit(overrides) for overrides in json.loads(sys.stdin.read())]))
"""


def check_configs(code: Path, tables: Sequence[Table], extra: Sequence[str]) -> None:
    """Compose one job's config of every setting, with the run's overrides, in the pinned worktree's train.py
    (its `config_exit`: Hydra and rnnlab's validation, no JAX) before any job starts: a ZooError naming the first
    setting that train.py would refuse and its own line. A worktree whose train.py has no `config_exit` is not
    checked (its jobs refuse bad input themselves)."""
    if "def config_exit" not in (Path(code) / "train.py").read_text():
        return
    cases = [(t, s) for t in tables for s in t.settings]
    overrides = [[*Job(t, s, t.lrs[0], 0).overrides(), *extra] for t, s in cases]
    done = subprocess.run([sys.executable, "-c", CONFIG_CHECK, str(code)], input=json.dumps(overrides),
                          capture_output=True, text=True, env=job_env(code), cwd=code, timeout=600)
    if done.returncode:
        said = [line for line in done.stderr.splitlines() if line.strip()][-1:]
        raise ZooError(f"cannot check the jobs' configs in {code}: {said[0] if said else 'no output'}")
    for (table, setting), (exit_code, line) in zip(cases, json.loads(done.stdout.strip().splitlines()[-1])):
        if exit_code:
            raise ZooError(f"{table.key}, setting '{setting.name}': train.py refuses it: {line}")
