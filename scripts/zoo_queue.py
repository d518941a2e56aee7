"""The zoo's protocol as a job queue on one machine: each setting's lr grid on seed 0, then its other
seeds at the lr the grid chose, many `train.py` jobs side by side (one GPU shared by processes, or a
CPU), stopped cleanly at a deadline.

Hydra's multirun sweeps a fixed product, so it runs every seed at every lr; the protocol
(scripts/zoo_protocol.py) needs only the chosen lr's seeds, and that choice exists only once the grid
has finished. Here a setting's seeds go to the front of the queue as soon as its grid is done, so a
deadline leaves whole settings rather than a thin slice of all of them.

    python scripts/zoo_queue.py --out /tmp/zq --parallel 24 --deadline 420 \
        --setting "experiment=zoo_hybrid hybrid=attention data.num_pairs=16" \
        --setting "experiment=zoo_hybrid hybrid=gated_deltanet data.num_pairs=16" \
        -- checkpoint.enabled=false device.steps_per_dispatch=8
    python scripts/summarize.py /tmp/zq/zoo_hybrid        # the table, with the lr each setting chose

A job's run dir is <out>/<experiment>/<setting>/lr<lr>_seed<seed> (Hydra's run mode, its overrides
recorded as a multirun's are, so summarize.py reads the folder as one sweep). The grid's lr is chosen
by zoo_protocol.choose on the training-length metric summarize.py reports (ties to the smaller lr).
A job whose run dir already holds a completed results.json is not run again, so the same command
after a deadline goes on where it stopped (on this machine or another: copy the folder). At the
deadline no job starts; running ones get SIGTERM (train.py stops at its next step and writes
results.json with status `preempted`; its compiler's subprocesses are left to finish), then SIGKILL
after `--grace` seconds. Exit 0, or 1 if any job did not complete.

The terminal gets the lr each setting chose and, per finished job, the status line `train.py -m` prints
(rnnlab.sweep_status: `[12/72] 2 running, 58 left, 0 failed, about 1 h 40 min left`; a job that did not
complete counts as failed); <out>/queue.log keeps those and every job's start and end, a job's own
output is in its run dir's stdout.log.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import summarize  # noqa: E402
import zoo_protocol  # noqa: E402

ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from rnnlab.sweep_status import seconds_left, status_line  # noqa: E402


def slug(overrides: list[str]) -> str:
    """A folder name for a setting: its overrides but the experiment, e.g. hybrid-attention_data.num_pairs-16."""
    parts = [o.replace("=", "-") for o in overrides if not o.startswith("experiment=")]
    return re.sub(r"[^A-Za-z0-9_.,-]+", "_", "_".join(parts)) or "default"


class Job:
    def __init__(self, setting: int, overrides: list[str], lr: str, seed: int, out: Path):
        self.setting, self.lr, self.seed = setting, lr, seed
        experiment = next((o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")), "runs")
        self.dir = out / experiment / slug(overrides) / f"lr{lr}_seed{seed}"
        self.overrides = [*overrides, f"optimizer.lr={lr}", f"seed={seed}"]
        self.proc: subprocess.Popen | None = None
        self.started = self.ended = 0.0

    def start(self, train: Path, common: list[str]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(train), *self.overrides, *common, "hydra.mode=RUN", f"hydra.run.dir={self.dir}"]
        log = open(self.dir / "stdout.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.time()

    def results(self) -> dict:
        return summarize.read_results(self.dir)

    def metric(self) -> str:
        """The metric summarize.py's table reports for the job's task (a loss where it reports none)."""
        results = self.results()
        metrics = list(results.get("eval_metrics") or {})
        return summarize.headline_metric(results.get("task"), metrics) or (metrics[0] if metrics else "loss")

    def score(self) -> float | None:
        return zoo_protocol.training_length_score(self.results(), self.metric())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--setting", action="append", required=True,
                        help="one setting's overrides, space-separated (repeat the flag for each setting)")
    parser.add_argument("--lrs", nargs="+", default=["3e-4", "1e-3", "3e-3", "1e-2"])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..n-1 (the grid runs seed 0)")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=float("inf"), help="seconds from the start")
    parser.add_argument("--grace", type=float, default=20.0)
    parser.add_argument("--train", type=Path, default=ROOT / "train.py", help="the training script (tests: a stand-in)")
    parser.add_argument("common", nargs="*", help="overrides for every job (after --)")
    args = parser.parse_args(argv)

    settings = [s.split() for s in args.setting]
    queue = collections.deque(Job(i, s, lr, 0, args.out) for i, s in enumerate(settings) for lr in args.lrs)
    grid: dict[int, list[Job]] = collections.defaultdict(list)
    for job in queue:
        grid[job.setting].append(job)
    running: list[Job] = []
    done: list[Job] = []
    total = len(settings) * (len(args.lrs) + args.seeds - 1)  # each setting's grid, then its other seeds
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    events = open(args.out / "queue.log", "a")

    def say(text: str, console: bool = True) -> None:
        line = f"{time.time() - start:7.1f}s {text}"
        if console:
            print(line, flush=True)
        events.write(line + "\n")
        events.flush()

    def status() -> None:
        """The sweep's status line (rnnlab.sweep_status, as train.py -m prints it), on the terminal and in queue.log."""
        now = time.time()
        ok = [j for j in done if j.results().get("status") == zoo_protocol.OK]
        durations = [j.ended - j.started for j in ok if j.proc is not None]  # jobs run here, not kept from earlier
        running_for = [now - j.started for j in running]
        left = max(total - len(done) - len(running), 0)
        line = status_line(len(done), total, len(running), len(done) - len(ok),
                           seconds_left(durations, left, running_for, args.parallel), now - start)
        print(line, flush=True)
        say(line, console=False)

    def finish(job: Job) -> None:
        nonlocal total
        job.ended = time.time()
        if job in running:
            running.remove(job)
        done.append(job)
        say(f"end  {job.dir.relative_to(args.out)} {job.results().get('status')} score={job.score()} "
            f"({job.ended - job.started:.0f}s)", console=False)
        chosen = job.seed == 0 and all(j.ended for j in grid[job.setting]) and not late
        best = None
        if chosen:
            lrs = [zoo_protocol.LrResult(float(j.lr), [k], [j.score()]) for k, j in enumerate(grid[job.setting])]
            best = zoo_protocol.choose(lrs, job.metric())
            if best is None:
                total -= args.seeds - 1
        status()
        if chosen:
            if best is None:
                say(f"setting {job.setting}: every lr failed; no seeds")
                return
            lr = grid[job.setting][best.jobs[0]].lr
            say(f"setting {job.setting} {' '.join(settings[job.setting])}: lr {lr} ({best.mean}); seeds queued")
            for seed in reversed(range(1, args.seeds)):
                queue.appendleft(Job(job.setting, settings[job.setting], lr, seed, args.out))

    late = False
    while queue or running:
        late = time.time() - start >= args.deadline
        while queue and len(running) < args.parallel and not late:
            job = queue.popleft()
            if job.results().get("status") == zoo_protocol.OK:
                job.started = time.time()
                finish(job)  # an earlier run's: kept, and counted in its setting's grid
                continue
            job.start(args.train, args.common)
            running.append(job)
            say(f"start {job.dir.relative_to(args.out)}", console=False)
        for job in [j for j in running if j.proc.poll() is not None]:
            finish(job)
        if late:
            say(f"deadline: {len(queue)} jobs not started, {len(running)} stopped")
            total = len(done) + len(running)  # the jobs not started leave the count
            queue.clear()
            for job in running:
                job.proc.send_signal(signal.SIGTERM)  # train.py alone: a compiler subprocess killed fails the job
            until = time.time() + args.grace
            while running and time.time() < until:
                for job in [j for j in running if j.proc.poll() is not None]:
                    finish(job)
                time.sleep(0.5)
            for job in list(running):
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()
                finish(job)
            break
        time.sleep(1.0)

    statuses = collections.Counter(j.results().get("status") for j in done)
    say(f"done: {dict(statuses)} in {time.time() - start:.0f}s")
    (args.out / "queue.json").write_text(json.dumps(
        [{"dir": str(j.dir.relative_to(args.out)), "status": j.results().get("status"), "score": j.score(),
          "seconds": round(j.ended - j.started, 1)} for j in done], indent=1))
    return 0 if statuses and set(statuses) == {zoo_protocol.OK} else 1


if __name__ == "__main__":
    sys.exit(main())
