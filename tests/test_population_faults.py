"""hydra/launcher=population under faults (issue 72): a member's own fault (its run dir, its checkpoints, its resume,
a save that fails mid-run) fails that member alone while the others train on; a finished member's record is final;
a second population on a running sweep dir is refused without touching it; bad launcher keys, an unwritable sweep
dir and a stopped sweep each end with train.py's documented exit code and one line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, TINY, run_train, tiny_config, train_env

BASE = ["model=gru", "data=parity", "steps=8", "checkpoint.every=4", "eval_every=4", "log_every=2"]
SWEEP = [o for o in TINY if not o.startswith(("steps", "checkpoint.every", "eval_every"))] + [
    "model=gru", "data=parity", "steps=8", "eval_every=4", "checkpoint.every=4", "hydra/launcher=population"]


def member(tmp_path, name, *extra):
    from rnnlab.population import Member

    overrides = tuple(extra)
    return Member(tiny_config(*BASE, *extra), tmp_path / name, overrides, overrides)


def one_error_line(proc):
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("rnnlab: error: "), proc.stderr[-3000:]
    return lines[-1]


def snapshot(folder):
    """Every file under `folder`: its bytes and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


# 1. hydra.launcher.max_members

@pytest.mark.parametrize("value", ["abc", 1.5, 0, -2, True, "3"])
def test_max_members_is_null_or_an_integer_of_at_least_1(value):
    from hydra.errors import HydraException

    from rnnlab.population_launch import max_members_value

    with pytest.raises(HydraException, match=r"key 'hydra.launcher.max_members': got .*, allowed: null or an integer "
                                             r">= 1"):
        max_members_value(value)
    assert max_members_value(None) is None and max_members_value(2) == 2


@pytest.mark.slow("end-to-end")
def test_a_bad_max_members_exits_2_with_one_line(tmp_path):
    proc = run_train(["-m", *SWEEP, "optimizer.lr=1e-3,3e-3", "hydra.launcher.max_members=abc",
                      f"hydra.sweep.dir={tmp_path / 's'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "key 'hydra.launcher.max_members': got 'abc', allowed: null or an integer >= 1" in one_error_line(proc)


@pytest.mark.slow("end-to-end")
def test_a_text_sweep_trains_as_one_population(tmp_path):
    """data=text's train state carries each stream's model state: a population carries each member's own (the text
    the members share is one input), and every job ends as its run would, its test text evaluated."""
    from conftest import TEXT_FIXTURE_DATA

    sweep = tmp_path / "s"
    proc = run_train(["-m", *TINY, *TEXT_FIXTURE_DATA, "model=lstm", "num_layers=1", "batch_size=4",
                      "optimizer.lr=1e-3,3e-3", "hydra/launcher=population", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    results = [json.loads((run / "results.json").read_text()) for run in runs]
    assert [r["status"] for r in results] == ["completed", "completed"]
    assert all(np.isfinite(r["test_bpc"]) for r in results) and results[0]["train_loss"] != results[1]["train_loss"]
    assert "population of 2 members" in (runs[0] / "train.log").read_text()


# 2. A member's own fault fails it alone.

@pytest.mark.slow("long")
def test_a_members_unwritable_run_dir_or_failing_save_fails_that_member_alone(tmp_path, monkeypatch):
    from rnnlab import checkpoint
    from rnnlab.trainer import train_population

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    population = [member(tmp_path, "ok", "optimizer.lr=1e-3"), member(blocker, "run", "optimizer.lr=3e-3"),
                  member(tmp_path, "full", "optimizer.lr=1e-2")]
    save = checkpoint.Checkpointer.save

    def disk_full_at_step_8(self, step, state, force=False):
        if self.directory == population[2].workdir / "checkpoints" and step >= 8:
            raise self._save_failed(OSError(28, "No space left on device"))
        return save(self, step, state, force)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", disk_full_at_step_8)
    (ok, ok_error), (unwritable, unwritable_error), (full, full_error) = train_population(population)
    assert ok_error is None and ok["status"] == "completed" and ok["step"] == 8 and ok["eval_loss"] is not None
    assert (population[0].workdir / "checkpoints" / "8").is_dir()
    assert unwritable["status"] == "failed" and "is not writable" in unwritable["error"]
    assert full["status"] == "failed" and full["step"] == 8 and "No space left on device" in full["error"]
    assert isinstance(full_error, checkpoint.CheckpointSaveError)
    written = json.loads((population[2].workdir / "results.json").read_text())
    assert written["status"] == "failed" and "No space left on device" in written["error"]
    assert sorted(p.name for p in (population[2].workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]


@pytest.mark.slow("long")
def test_a_refused_or_unreadable_resume_fails_that_member_alone_and_a_finished_one_stays_as_it_is(tmp_path):
    """Issue 72, parts 2 and 6: rerun beside a grown grid, one member with another lr (refused), one whose
    checkpoints are garbage, one finished with its config (final: not retrained, re-evaluated or rewritten)."""
    from rnnlab.checkpoint import CheckpointError
    from rnnlab.config import ConfigError
    from rnnlab.trainer import train_population

    first = [member(tmp_path, f"m{i}", f"optimizer.lr={lr}") for i, lr in enumerate(("1e-3", "3e-3", "1e-2"))]
    assert all(r["status"] == "completed" for r, _ in train_population(first))
    for f in (first[2].workdir / "checkpoints").rglob("*"):
        if f.is_file() and f.parent.name != "checkpoints":
            f.write_bytes(b"garbage")
    stopped = json.loads((first[2].workdir / "results.json").read_text()) | {"status": "preempted"}
    (first[2].workdir / "results.json").write_text(json.dumps(stopped))  # not final: it resumes
    finished = snapshot(first[0].workdir)
    refused = snapshot(first[1].workdir / "checkpoints")
    rerun = [first[0], member(tmp_path, "m1", "optimizer.lr=5e-3"), first[2], member(tmp_path, "new", "seed=1")]
    (done, done_error), (changed, changed_error), (garbage, garbage_error), (new, new_error) = train_population(rerun)
    assert done_error is None and done == json.loads((first[0].workdir / "results.json").read_text())
    assert snapshot(first[0].workdir) == finished  # nothing of it rewritten: results.json, events, checkpoints
    assert changed["status"] == "failed" and isinstance(changed_error, ConfigError)
    assert "checkpoint.allow_changes" in changed["error"]
    assert snapshot(first[1].workdir / "checkpoints") == refused
    assert garbage["status"] == "failed" and isinstance(garbage_error, CheckpointError)
    assert new_error is None and new["status"] == "completed" and new["step"] == 8


# 3. A refused population touches nothing of the running one.

@pytest.fixture
def running_sweep(tmp_path):
    """A sweep dir as a running population leaves it: a job dir with its files, the status folder."""
    sweep = tmp_path / "sweep"
    job = sweep / "0_optimizer.lr=0.001"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=0.001\n")
    (job / "train.log").write_text("step 2/8 | loss 0.69\n")
    (job / "results.json").write_text(json.dumps({"status": "preempted", "step": 4}))
    (sweep / ".sweep_status").mkdir()
    (sweep / ".sweep_status" / "sweep.json").write_text(json.dumps({"total": 2, "workers": 1, "started": 0}))
    (sweep / ".sweep_status" / "0.start").write_text(json.dumps({"started": 0}))
    (sweep / "multirun.yaml").write_text("the running sweep's\n")
    return sweep


@pytest.mark.slow("end-to-end")
def test_a_second_population_on_a_running_sweep_dir_is_refused_and_touches_nothing(running_sweep, tmp_path):
    import fcntl
    import socket

    from rnnlab.rundir import RunDirLock

    # This process runs the sweep: it holds the sweep dir's lock (rnnlab.sweep_status.hold_sweep_lock) and its jobs'.
    with open(running_sweep / ".sweep.lock", "w") as lock, RunDirLock(running_sweep / "0_optimizer.lr=0.001"):
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(f"{os.getpid()} {socket.gethostname()}\n")
        lock.flush()
        before = snapshot(running_sweep)
        proc = run_train(["-m", *SWEEP, "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={running_sweep}"], cwd=tmp_path)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert f"sweep dir {running_sweep} is in use by pid {os.getpid()}" in line
    assert snapshot(running_sweep) == before
    assert "failed" not in proc.stdout  # no status line of the running sweep's counts


@pytest.mark.slow("end-to-end")
def test_without_the_status_callback_the_launcher_refuses_on_the_run_dir_lock(running_sweep, tmp_path):
    from rnnlab.rundir import RunDirLock

    job = running_sweep / "0_optimizer.lr=0.001"
    before = {p: v for p, v in snapshot(running_sweep).items() if p != "multirun.yaml"}  # Hydra's sweeper's file
    with RunDirLock(job):
        proc = run_train(["-m", *SWEEP, "optimizer.lr=1e-3,3e-3", "~hydra.callbacks.sweep_status",
                          f"hydra.sweep.dir={running_sweep}"], cwd=tmp_path)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert f"run dir {job} is in use by pid {os.getpid()}" in line and "hydra.sweep.dir" in line
    assert {p: v for p, v in snapshot(running_sweep).items() if p != "multirun.yaml" and ".rnnlab.lock" not in p} \
        == {p: v for p, v in before.items() if ".rnnlab.lock" not in p}
    assert not (running_sweep / "1_optimizer.lr=0.003").exists()


# 5. The exit codes and lines the README gives.

@pytest.mark.slow("end-to-end")
def test_a_sweep_dir_that_cannot_be_written_exits_74_with_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # a read-only dir would do, but the tests may run as root
    proc = run_train(["-m", *SWEEP, "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={blocker / 'sweep'}"], cwd=tmp_path)
    assert proc.returncode == 74
    assert f"cannot write the sweep dir {blocker / 'sweep'}" in one_error_line(proc)
    assert "warn" not in proc.stderr.lower()


def test_a_stopped_sweep_with_a_named_dir_says_how_to_resume(monkeypatch, capsys):
    """The population launcher ends a SIGTERM'd sweep with SystemExit(75); with `hydra.sweep.dir=` given (nothing
    resolves the sweep dir) train.py still prints the README's line."""
    monkeypatch.syspath_prepend(str(ROOT))
    import train

    def preempted():
        raise SystemExit(75)

    args = ["-m", "optimizer.lr=1e-3,3e-3", "hydra/launcher=population", "hydra.sweep.dir=multirun/mine"]
    monkeypatch.setattr(train, "main", preempted)
    for key in (train.SWEPT_KEYS_ENV, train.SWEEP_DIR_ENV):  # run_cli sets them: restored after the test
        monkeypatch.setenv(key, "")
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    monkeypatch.setattr(train, "_sweep_dir_used", [])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            train.run_cli()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 75
    assert capsys.readouterr().err.strip() == (
        "rnnlab: error: sweep interrupted; resume it with: python train.py -m optimizer.lr=1e-3,3e-3 "
        "hydra/launcher=population hydra.sweep.dir=multirun/mine")


@pytest.mark.slow("end-to-end")
def test_a_stopped_population_then_a_members_broken_checkpoints_fail_that_member_alone(tmp_path):
    """The probe of issue 72: a 2-member population stopped by SIGTERM says how to resume (exit 75); member 0's
    checkpoints then cannot be written; the rerun fails member 0 alone (exit 74, its results.json and train.log say
    so) and member 1 completes."""
    sweep = tmp_path / "sweep"
    args = ["-m", *[o for o in SWEEP if not o.startswith(("steps", "checkpoint.every", "log_every"))], "steps=400",
            "checkpoint.every=10", "log_every=10", "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=train_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any(p.name.isdigit() for d in sweep.glob("*/checkpoints") for p in d.iterdir()):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert lines[-1] == f"rnnlab: error: sweep interrupted; resume it with: python train.py {' '.join(args)}"
    assert "preempted at step" not in stderr
    jobs = sorted(p for p in sweep.iterdir() if p.name[0].isdigit())
    assert [json.loads((j / "results.json").read_text())["status"] for j in jobs] == ["preempted", "preempted"]
    record = jobs[0] / "checkpoints" / "run_config.json"  # as root a read-only dir is writable: a dir in its way
    record.unlink()
    (record / "blocked").mkdir(parents=True)
    rerun = run_train(args[:-1] + ["steps=40", "checkpoint.allow_changes=[steps]", args[-1]], cwd=tmp_path)
    assert rerun.returncode == 74, rerun.stderr[-3000:]
    assert "job 0" in one_error_line(rerun)
    broken, healthy = (json.loads((j / "results.json").read_text()) for j in jobs)
    assert broken["status"] == "failed" and broken["exit_code"] == 74 and "IsADirectoryError" in broken["error"]
    assert healthy["status"] == "completed" and healthy["step"] == 40 and healthy["error"] is None
    assert "IsADirectoryError" in (jobs[0] / "train.log").read_text()
    assert "IsADirectoryError" not in (jobs[1] / "train.log").read_text()
    assert "[2/2] 0 running, 0 left, 1 failed" in rerun.stdout
