"""`plan` and `run`: a suite's jobs under the protocol, resumable, at one commit.

A job's run dir is <out>/<table>/<setting slug>/lr<lr>_seed<seed>. A job is done when its run dir or the committed
records (docs/zoo/records) hold a final record (`records.FINAL`) made at the pinned commit on this kind of device;
so a suite spread over sessions and machines goes on from what was committed. Each setting trains its lr grid on
seed 0 first; once the grid is done the protocol's rule (`protocol.choose_lr`) picks the lr, and the setting's other
seeds go to the front of the queue. The code runs from a git worktree of the pinned commit (`<out>/worktrees/`),
never from the checkout being edited. Two executors: `processes` (one train.py per job, `--parallel` side by side:
one per core, or several sharing a GPU) and `population` (hydra/launcher=population: a setting's grid as one
program, then its seeds as one program). Before `--deadline` a job starts only if the records predict that it ends
in time (a job stopped there resumes on this machine alone, and the next session may run on another); at the
deadline, or on SIGTERM or Ctrl-C to the runner, nothing new starts and running jobs get SIGTERM (they save and
end `preempted`; the next `run` resumes them), then SIGKILL after `--grace` seconds.
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

from rnnlab.sweep_status import duration, schedule_seconds, status_line
from rnnlab.zoo import records
from rnnlab.zoo.protocol import Setting, Table, choose_lr, job_dirname, lr_text

# Overrides the protocol fixes: `run`'s extra overrides may not set them.
PROTOCOL_KEYS = ("steps", "optimizer.lr", "seed", "data.seq_len", "data.eval_seq_lens", "experiment", "model",
                 "hybrid", "hydra.mode", "hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "state_tracking")


class ZooError(Exception):
    """Bad input to the zoo's CLI: one line, exit 2."""


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
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(root), "worktree", "prune"], capture_output=True)
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "--force", str(path), commit],
                       capture_output=True, text=True, check=True)
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
        self.committed = {t.key: [r for r in records.read_table(docs, t.key) if self._ours(r)] for t in tables}
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

    def started(self, job: Job) -> bool:
        """Whether the job has a run dir with a checkpoint or results (it resumes rather than starts)."""
        return (job.run_dir(self.out) / "results.json").exists()


def grid_jobs(table: Table, setting: Setting) -> list[Job]:
    return [Job(table, setting, lr, 0) for lr in table.lrs]


def chosen_lr(ledger: Ledger, table: Table, setting: Setting) -> tuple[bool, float | None]:
    """(whether the seed-0 grid is done, the lr the protocol chooses from it)."""
    grid = {job.lr: ledger.record(job) for job in grid_jobs(table, setting)}
    if any(r is None for r in grid.values()):
        return False, None
    return True, choose_lr({lr: records.score(r, table) for lr, r in grid.items()}, table.higher_is_better)


def seed_jobs(table: Table, setting: Setting, lr: float) -> list[Job]:
    return [Job(table, setting, lr, seed) for seed in range(1, table.seeds)]


def seeds_waiting(ledger: Ledger, tables: Sequence[Table]) -> list[Job]:
    """The seed jobs of each setting whose grid is not done yet, at its first lr (their lr is not chosen yet): what a
    prediction counts beside the ready jobs."""
    return [job for table in tables for setting in table.settings if not chosen_lr(ledger, table, setting)[0]
            for job in seed_jobs(table, setting, table.lrs[0])]


@dataclasses.dataclass
class Plan:
    """Each setting's jobs as far as they can be known: the grid, then the chosen lr's seeds (None: not yet)."""

    done: list[Job]
    todo_now: list[Job]  # ready to run, in the order they run: seeds of finished grids first, then grids
    later: int  # jobs that wait on a grid (its seeds)
    no_lr: list[tuple[Table, Setting]]  # settings whose every lr failed


def make_plan(ledger: Ledger, tables: Sequence[Table], running: Sequence[str] = ()) -> Plan:
    done, seeds_now, grids_now, later, no_lr = [], [], [], 0, []
    for table in tables:
        for setting in table.settings:
            for job in grid_jobs(table, setting):
                (done if ledger.record(job) else grids_now).append(job)
            finished, lr = chosen_lr(ledger, table, setting)
            if not finished:
                later += table.seeds - 1
            elif lr is None:
                no_lr.append((table, setting))
            else:
                for job in seed_jobs(table, setting, lr):
                    (done if ledger.record(job) else seeds_now).append(job)
    todo = [j for j in seeds_now + grids_now if j.name not in running]
    return Plan(done, todo, later, no_lr)


def job_seconds(ledger: Ledger, tables: Sequence[Table]) -> Callable[[Job], float | None]:
    """A job's predicted wall time on this machine from the records of this device kind (any commit); None with no
    record at all. A cell with no record yet is predicted from the cells that have one (an underestimate while
    only the fast ones have run: `plan --probe` times one job per table)."""
    by_cell: dict[tuple[str, str], list[float]] = {}
    here: dict[tuple[str, str], list[float]] = {}  # the same, from this machine's own records
    per_step: list[float] = []
    for table in tables:
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
    total = sum(len(t.settings) * t.jobs_per_setting() for t in tables)
    say(f"commit {ledger.commit or '(any)'} on {ledger.machine or ledger.kind}; run dirs in {ledger.out}")
    for table in tables:
        mine = [j for j in plan.done if j.table is table]
        jobs = len(table.settings) * table.jobs_per_setting()
        say(f"  {table.key}: {len(table.settings)} settings x ({len(table.lrs)} lrs + {table.seeds - 1} seeds) = "
            f"{jobs} jobs, {len(mine)} recorded, {table.steps} steps each")
    left = [unit_seconds(ledger, predict, [j]) for j in plan.todo_now]
    later_seconds = [unit_seconds(ledger, predict, [j]) for j in seeds_waiting(ledger, tables)]
    known = [s for s in left + later_seconds if s is not None]
    unknown = len(left) + len(later_seconds) - len(known)
    say(f"{total} jobs: {len(plan.done)} recorded, {len(plan.todo_now)} ready, {plan.later} waiting on their grid"
        + (f", {len(plan.no_lr)} settings with every lr failed" if plan.no_lr else ""))
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
    """What one executor call runs: one job (processes) or a setting's jobs as one program (population)."""

    jobs: list[Job]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    log: Any = None


class Executor:
    """Starts a unit's train.py in the pinned worktree."""

    name = "processes"

    def __init__(self, code: Path, out: Path, extra: Sequence[str], pin: bool):
        self.code, self.out, self.extra, self.pin = Path(code), Path(out), list(extra), pin

    def units(self, jobs: Sequence[Job]) -> list[Unit]:
        return [Unit([job]) for job in jobs]

    def command(self, unit: Unit) -> tuple[list[str], Path]:
        job = unit.jobs[0]
        run_dir = job.run_dir(self.out).resolve()
        return ([sys.executable, str(self.code / "train.py"), *job.overrides(), *self.extra, "hydra.mode=RUN",
                 f"hydra.run.dir={run_dir}"], run_dir / "stdout.log")

    def start(self, unit: Unit) -> None:
        cmd, log_path = self.command(unit)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        unit.log = open(log_path, "a")
        # The worktree's rnnlab first; the caller's own path after it (a new cell's module, `imports=[...]`).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(self.code), os.environ.get("PYTHONPATH"))
                                                         if p), HYDRA_FULL_ERROR="1")
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
    failed = 0
    incomplete = 0
    total = sum(len(t.settings) * t.jobs_per_setting() for t in tables)

    def status() -> None:
        plan = make_plan(ledger, tables, [j.name for u in running for j in u.jobs])
        total_now = total - sum(t.seeds - 1 for t, _ in plan.no_lr)
        seconds = seconds_to_go(ledger, tables, plan, executor, running, parallel, finished_here)
        say(status_line(len(plan.done), total_now, sum(len(u.jobs) for u in running), failed, seconds,
                        time.time() - start) + (f" ({incomplete} stopped, to resume)" if incomplete else ""))

    def finish(unit: Unit) -> None:
        nonlocal failed, incomplete
        running.remove(unit)
        if unit.log is not None:
            unit.log.close()
        done = []
        for job in unit.jobs:
            record = ledger.record(job)
            if record is None:
                incomplete += 1
                results = records.results_of(job.run_dir(ledger.out))
                say(f"{job.name}: {results.get('status') or 'no results.json'} (exit {unit.proc.returncode}; "
                    f"see {job.run_dir(ledger.out) / 'train.log'})")
                continue
            done.append(record)
            failed += record["status"] != "completed"
            finished_here.append((time.time() - unit.started) / len(unit.jobs))
        if on_done and done:
            on_done(done)
        status()

    stopped = False
    signalled: list[int] = []
    previous = _on_stop_signals(signalled.append)
    try:
        status()
        while True:
            for unit in [u for u in running if u.proc.poll() is not None]:
                finish(unit)
            if time.time() >= deadline or signalled:
                stopped = True
                break
            plan = make_plan(ledger, tables, attempted)
            if not plan.todo_now and not running:
                break
            free = max(parallel - len(running), 0)
            if free and plan.todo_now:
                in_time, late = split_by_deadline(ledger, tables, executor.units(plan.todo_now), deadline - time.time())
                for unit in in_time[:free]:
                    executor.start(unit)
                    running.append(unit)
                    attempted.update(j.name for j in unit.jobs)
                if late and not in_time and not running:
                    say(f"deadline in {duration(deadline - time.time())}: the {sum(len(u.jobs) for u in late)} ready "
                        "jobs are predicted to end after it; the next run starts them")
                    stopped = True
                    break
            time.sleep(1.0)
        if stopped and running:
            why = signal.Signals(signalled[0]).name if signalled else "deadline"
            say(f"{why}: stopping {sum(len(u.jobs) for u in running)} running jobs (SIGTERM: they save and resume "
                "at the next run)")
            _terminate(running)
            until = time.time() + grace
            while running and time.time() < until:
                for unit in [u for u in running if u.proc.poll() is not None]:
                    finish(unit)
                time.sleep(0.5)
            for unit in list(running):
                with _suppress():
                    os.killpg(unit.proc.pid, signal.SIGKILL)
                unit.proc.wait()
                finish(unit)
    except BaseException:  # a runner that fails leaves no job running unseen: each saves, the next run resumes it
        _terminate(running)
        raise
    finally:
        _restore_signals(previous)
    plan = make_plan(ledger, tables)
    if plan.todo_now or plan.later:
        return 75 if stopped else 1
    return 0


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


def probe_seconds(code: Path, table: Table, out: Path, steps: int = 40) -> float:
    """One short job of `table`'s first setting, to scale a per-step time to the table's steps: the predicted wall
    time of one of its jobs (compile and evaluation counted once each)."""
    job = Job(table, table.settings[0], table.lrs[0], 0)
    run_dir = (Path(out) / "probes" / table.key).resolve()
    overrides = [o if not o.startswith("steps=") else f"steps={steps}" for o in job.overrides()]
    cmd = [sys.executable, str(Path(code) / "train.py"), *overrides, "hydra.mode=RUN", f"hydra.run.dir={run_dir}",
           "checkpoint.enabled=false", f"eval_every={steps}", f"log_every={steps}", "device.compile_cache=false"]
    subprocess.run(cmd, cwd=code, capture_output=True, env=dict(os.environ, PYTHONPATH=str(code)), check=False)
    results = json.loads((run_dir / "results.json").read_text())
    per_step = results["tokens_per_step"] / results["tokens_per_sec"]
    fixed = results["wall_seconds"] - per_step * steps
    return fixed + per_step * table.steps
