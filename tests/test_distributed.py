"""Multi-process JAX on one machine: two processes over loopback (gloo), two CPU devices each."""

import json
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import ROOT, TINY, require, run_train, saved_state, train_env

pytestmark = pytest.mark.slow("cluster")

STEPS = 20
RUN = [o for o in TINY if not o.startswith(("device", "steps", "checkpoint"))] + [
    f"steps={STEPS}", "log_every=5", "checkpoint.every=5", "device=cpu",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pair(run_dir, *extra):
    """Processes 0 and 1 of one run, each with 2 simulated CPU devices (4 in all)."""
    port = free_port()
    common = [*RUN, *extra, "device.num_devices=2", "distributed.enabled=true",
              f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
              f"hydra.run.dir={run_dir}"]
    return [
        subprocess.Popen([sys.executable, str(ROOT / "train.py"), *common, f"distributed.process_id={rank}"],
                         cwd=run_dir.parent, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
        for rank in (0, 1)
    ]


def finish(procs, timeout=600):
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


@pytest.fixture(scope="module")
def single_process_four_devices(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    proc = run_train([*RUN, "device.num_devices=4", f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return saved_state(run_dir, STEPS)


def test_two_processes_train_like_one_process_with_four_devices(tmp_path, single_process_four_devices):
    run_dir = tmp_path / "run"
    out0, out1 = finish(start_pair(run_dir))
    assert "4 cpu device(s) x batch 2" in out0
    assert f"step {STEPS}/{STEPS}" in out0 and f"step {STEPS}/{STEPS}" not in out1  # one voice
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and results["num_devices"] == 4
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1  # one writer
    pair = saved_state(run_dir, STEPS)
    for a, b in zip(jax.tree_util.tree_leaves(pair), jax.tree_util.tree_leaves(single_process_four_devices)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_killed_pair_resumes(tmp_path, single_process_four_devices):
    run_dir = tmp_path / "run"
    procs = start_pair(run_dir)
    deadline = time.time() + 300
    for line in procs[0].stdout:  # process 0 speaks for both
        if f"step 10/{STEPS}" in line or time.time() > deadline:
            break
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    assert (run_dir / "checkpoints" / "5").is_dir()
    out0, _ = finish(start_pair(run_dir))
    assert "resumed from" in out0
    pair = saved_state(run_dir, STEPS)
    for a, b in zip(jax.tree_util.tree_leaves(pair), jax.tree_util.tree_leaves(single_process_four_devices)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_sigterm_to_one_process_stops_both_after_a_joint_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    procs = start_pair(run_dir, "steps=400", "checkpoint.every=0")
    deadline = time.time() + 300
    for line in procs[0].stdout:
        if "step 20/400" in line or time.time() > deadline:
            break
    procs[1].send_signal(signal.SIGTERM)  # only process 1 is told
    for p in procs:
        p.communicate(timeout=300)
    assert [p.returncode for p in procs] == [75, 75]
    results = json.loads((run_dir / "results.json").read_text())
    # They agree at sync points: every 16 steps, and between an evaluation's chunks (eval_every=3).
    assert results["status"] == "preempted" and (results["step"] % 16 == 0 or results["step"] % 3 == 0)
    assert (run_dir / "checkpoints" / str(results["step"])).is_dir()


def test_process_id_out_of_range_is_refused(tmp_path):
    proc = run_train([*RUN, "distributed.enabled=true", "distributed.num_processes=2", "distributed.process_id=2",
                      f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "'distributed.process_id'" in proc.stderr


def test_slurm_launcher_preset_composes():
    require("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    from conftest import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "distributed.enabled=true"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.tasks_per_node == launcher.gpus_per_node
    assert cfg.distributed.enabled and cfg.distributed.coordinator_address is None  # SLURM auto-detection
