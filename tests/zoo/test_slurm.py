"""SLURM for real (full tier): a single-node SLURM started on this host (`slurm_cluster`: munged, slurmctld and
slurmd from config files in a temporary directory), then the zoo's `--executor slurm` and `hydra/launcher=slurm`
sweeps against it. Where slurm-wlm or munge is missing the tests fail with one line saying
`apt-get install slurm-wlm munge` (.ci/run installs them first): a test skipped in CI tests nothing."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, assert_same_tree, saved_state, train_env
from slurm_cluster import Cluster, ClusterError, missing

pytestmark = pytest.mark.slow("cluster")


@pytest.fixture(scope="module")
def slurm():
    """A SLURM of this host for the module's tests; stopped (its jobs cancelled, its daemons by pid) after."""
    why = missing()
    if why:
        pytest.fail(why, pytrace=False)
    cluster = Cluster()
    try:
        cluster.start()
    except ClusterError as e:
        pytest.fail(f"the test SLURM did not start: {e}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


def env(cluster):
    return train_env(cluster.env)


# --- the zoo ------------------------------------------------------------------------------------------------------

# The tiny table of tests/zoo/test_end_to_end.py: one cell, 2 lrs, 2 seeds, 60 steps (3 jobs: the grid on seed 0,
# then seed 1 at the chosen lr). One device per job, so that a job pinned to a core (processes) and one that is not
# (SLURM) compute alike.
EXTRA = ["hidden_dim=8", "batch_size=8", "eval_batches=1", "checkpoint.every=20", "log_every=20", "eval_every=60",
         "device.compile_cache=false", "device.num_devices=1"]
SCRIPT = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_end_to_end import TABLE
from rnnlab.zoo import cli
raise SystemExit(cli.main(sys.argv[1:], tables={{"tiny": TABLE}}, suites={{"t": ("tiny",)}}))
"""
SLURM_FLAGS = ["--executor", "slurm", "--partition", "debug", "--cpus-per-task", "1", "--timeout-min", "10"]


def zoo(tmp_path, cluster, *args, popen=False):
    script = tmp_path / "zoo.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, str(script), *args]
    if popen:
        return subprocess.Popen(cmd, cwd=tmp_path, env=env(cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(cmd, cwd=tmp_path, env=env(cluster), capture_output=True, text=True, timeout=600)


def by_job(docs):
    from rnnlab.zoo import records

    found = {}
    for r in records.read_table(docs, "tiny"):
        assert (r["lr"], r["seed"]) not in found, f"recorded twice: {r['lr']}, {r['seed']}"
        found[(r["lr"], r["seed"])] = r
    return found


def test_a_zoo_suite_on_slurm_killed_and_rerun_submits_nothing_twice_and_records_what_processes_record(tmp_path,
                                                                                                     slurm):
    """The runner is SIGKILLed once it has submitted the grid; a rerun with `--deadline 1s` submits nothing and
    leaves the queue alone (exit 75); the next waits for the queued jobs, submits the seed and ends with every
    record once, each with the metrics the processes executor records for the same job at the same commit."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs_processes").mkdir()
    out, docs = tmp_path / "out", tmp_path / "docs"
    common = ["--out", str(out), "--docs", str(docs), *SLURM_FLAGS, "--", *EXTRA]
    # the processes executor, side by side with the SLURM runs (what runs where changes their speed, not their sums)
    processes = zoo(tmp_path, slurm, "run", "t", "--out", str(tmp_path / "out_processes"), "--docs",
                    str(tmp_path / "docs_processes"), "--parallel", "2", "--", *EXTRA, popen=True)

    first = zoo(tmp_path, slurm, "run", "t", *common, popen=True)
    state = out / "slurm_jobs.json"
    until = time.time() + 300
    while time.time() < until and len(json.loads(state.read_text()) if state.exists() else {}) < 2:
        assert first.poll() is None, first.stdout.read()
        time.sleep(0.2)
    first.kill()  # SIGKILL: no handler runs; its two SLURM jobs go on
    said = first.communicate()[0]
    assert "asking SLURM job" in said, said
    submitted = json.loads(state.read_text())
    assert sorted(submitted) == ["tiny/rnn/lr0.001_seed0", "tiny/rnn/lr0.003_seed0"], said

    stopped = zoo(tmp_path, slurm, "run", "t", *common[:-len(EXTRA) - 1], "--deadline", "1s", "--", *EXTRA)
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    assert json.loads(state.read_text()) == submitted

    again = zoo(tmp_path, slurm, "run", "t", *common)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "[3/3] 0 running, 0 left, 0 failed, done" in again.stdout
    # the grid's jobs were waited on (still queued or running) or recorded from their run dirs (ended meanwhile)
    assert "already in the SLURM queue" in again.stdout or "now recorded" in again.stdout, again.stdout
    final = json.loads(state.read_text())
    assert {k: v for k, v in final.items() if k in submitted} == submitted and len(final) == 3

    ours = [j for j in slurm.jobs() if j["name"].startswith("zoo-") and not j["name"].endswith(":probe")]
    names = sorted(j["name"].split(":", 1)[1] for j in ours)
    assert names == sorted(final), ours  # each job submitted once
    assert {j["state"] for j in ours} == {"COMPLETED"}
    assert sum(j["name"].endswith(":probe") for j in slurm.jobs()) == 1  # the nodes' device kind, asked once

    assert processes.wait(timeout=600) == 0, processes.stdout.read()
    on_slurm, alone = by_job(docs), by_job(tmp_path / "docs_processes")
    assert set(on_slurm) == set(alone) and len(on_slurm) == 3
    for key, record in on_slurm.items():
        assert record["status"] == alone[key]["status"] == "completed"
        assert record["metrics"] == alone[key]["metrics"], key  # bit for bit: the same floats
        assert record["provenance"]["commit"] == alone[key]["provenance"]["commit"]

    rerun = zoo(tmp_path, slurm, "run", "t", *common)  # nothing left: nothing submitted
    assert rerun.returncode == 0 and "[3/3] 0 running, 0 left, 0 failed, done" in rerun.stdout
    assert len([j for j in slurm.jobs() if j["name"].startswith("zoo-")]) == len(ours) + 1


def test_the_train_command_has_train_py_save_before_submitit_requeues_it(tmp_path):
    """submitit's signal in a zoo job's SLURM job: submitit's handler calls `TrainCommand.checkpoint`, which tells
    train.py (a stand-in here) to save with SIGTERM, waits for it to exit, and hands submitit the same command to
    requeue; the job's function then returns train.py's exit code."""
    pytest.importorskip("submitit")
    from rnnlab.zoo.slurm import TrainCommand

    stand_in = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: (print('saved', flush=True), sys.exit(75)))\n"
                "print('training', flush=True)\ntime.sleep(60)\n")
    log = tmp_path / "run" / "stdout.log"
    command = TrainCommand([sys.executable, "-c", stand_in], str(tmp_path), str(log), grace=30)
    requeued = []

    def signal_once_training():
        until = time.time() + 60
        while time.time() < until and "training" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.1)
        os.kill(command._proc.pid, signal.SIGUSR2)  # SLURM signals every process of the job: train.py ignores it
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGUSR2)  # until submitit's handler (here the test's) has it save

    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: requeued.append(command.checkpoint()))
    try:
        threading.Thread(target=signal_once_training, daemon=True).start()
        assert command() == 75
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert log.read_text().split() == ["training", "saved"]
    again, = requeued
    assert isinstance(again.function, TrainCommand) and again.function.cmd == command.cmd
    assert again.function._proc is None


# --- sweeps: hydra/launcher=slurm ---------------------------------------------------------------------------------

STEPS, FIRST_LOG = 60000, 1000
SWEEP_RUN = ["model=gru", "hidden_dim=8", "num_layers=1", "batch_size=8", "data.seq_len=6", f"steps={STEPS}",
             f"log_every={FIRST_LOG}", f"eval_every={STEPS}", "eval_batches=1", "checkpoint.every=0", "device=cpu",
             "device.num_devices=1"]
LAUNCHER = ["hydra/launcher=slurm", "hydra.launcher.partition=debug", "hydra.launcher.gpus_per_node=0",
            "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]


def wait_for(path, text, proc, timeout=300):
    until = time.time() + timeout
    while time.time() < until:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, f"the sweep ended before {path} said {text!r}"
        time.sleep(0.2)
    raise AssertionError(f"{path} never said {text!r}")


def test_sweep_jobs_past_their_time_limit_or_requeued_resume_to_the_uninterrupted_state(tmp_path, slurm):
    """Two jobs of one `hydra/launcher=slurm` sweep, mid-training: job 0 gets submitit's signal as SLURM sends it at
    a time limit (`scancel --signal=USR2`: train.py saves at once, then submitit requeues it), job 1 is requeued
    with `scontrol requeue` (SIGTERM: it saves; SLURM requeues it). Each resumes from the step it saved (no
    periodic checkpoint: checkpoint.every=0) and ends `completed` with the final loss and parameters of an
    uninterrupted run."""
    sweep_dir = tmp_path / "sweep"
    sweep = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "-m", *SWEEP_RUN, *LAUNCHER, "seed=0,1",
                              f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, env=env(slurm),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    references = {seed: subprocess.Popen([sys.executable, str(ROOT / "train.py"), *SWEEP_RUN, f"seed={seed}",
                                          f"hydra.run.dir={tmp_path / f'alone{seed}'}"], cwd=tmp_path,
                                         env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                  for seed in (0, 1)}
    logs = {seed: sweep_dir / f"{seed}_seed={seed}" / "train.log" for seed in (0, 1)}
    # Both signalled as soon as both are training (their first log line), so that each has most of its steps left
    # while SLURM delivers the signal: on a quick machine the rest of a run takes seconds
    for seed in (0, 1):
        wait_for(logs[seed], f"step {FIRST_LOG}/{STEPS}", sweep)
    job = {j["id"].split("_")[-1]: j["id"] for j in slurm.jobs() if j["name"] == "train" and "_" in j["id"]}
    subprocess.run(["scancel", "--signal=USR2", job["0"]], env=env(slurm), check=True)
    subprocess.run(["scontrol", "requeue", job["1"]], env=env(slurm), check=True)
    out = sweep.communicate(timeout=600)[0]
    assert sweep.returncode == 0, out[-3000:]
    for seed, signal_name in ((0, "SIGUSR2"), (1, "SIGTERM")):
        assert references[seed].wait(timeout=600) == 0
        text = logs[seed].read_text()
        assert f"{signal_name} received" in text, text[-3000:]
        resumed = [line for line in text.splitlines() if "resumed from" in line]
        assert len(resumed) == 1, text[-3000:]
        step = int(resumed[0].rsplit("at step ", 1)[1].split()[0])
        assert FIRST_LOG <= step < STEPS  # the step it saved on the signal: no periodic checkpoint was written
        results = json.loads((logs[seed].parent / "results.json").read_text())
        alone = json.loads((tmp_path / f"alone{seed}" / "results.json").read_text())
        assert results["status"] == alone["status"] == "completed" and results["step"] == STEPS
        assert (results["train_loss"], results["eval_loss"]) == (alone["train_loss"], alone["eval_loss"])
        assert_same_tree(saved_state(logs[seed].parent, STEPS), saved_state(tmp_path / f"alone{seed}", STEPS))
    assert {j["state"] for j in slurm.jobs() if j["name"] == "train"} == {"COMPLETED"}
