"""A run dir under adversity: two writers, failing saves, stuck threads, resume changes, a
lost or damaged run_config.json, runs that cannot fit. Each case ends in seconds with its
documented exit code and one line, and nothing already written is lost."""

import json
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, TINY, run_train, saved_record, saved_state, tiny_config, train_env


RUN = [o for o in TINY if not o.startswith("steps")] + ["steps=12"]


def train(run_dir, *extra, timeout=300):
    return run_train([*RUN, *extra, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, timeout=timeout)


def one_error_line(proc):
    """The last stderr line, which must be rnnlab's one-line error; no traceback on the console."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("rnnlab: error: "), proc.stderr[-3000:]
    return lines[-1]


# 1. One writer per run dir.

@pytest.mark.slow("end-to-end")
def test_a_second_run_on_a_held_run_dir_stops_at_once_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *RUN, "steps=4000", "log_every=50",
                              "checkpoint.every=1000", f"hydra.run.dir={run_dir}"],
                             cwd=tmp_path, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:  # training has started: the lock is held, a save is due
            if "step 50/4000" in line:
                break
        started = time.time()
        second = train(run_dir, "steps=4000", "optimizer.lr=0.1")
        assert second.returncode == 2 and time.time() - started < 60
        line = one_error_line(second)
        assert f"run dir {run_dir} is in use by pid {first.pid} on host" in line
    finally:
        out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-2000:]
    # The first run's record and its checkpoints are its own, untouched by the second.
    assert json.loads((run_dir / "checkpoints" / "run_config.json").read_text())["optimizer.lr"] != 0.1
    assert saved_record(run_dir, 4000)["run_config"]["optimizer.lr"] != 0.1


def test_the_lock_dies_with_its_holder_even_on_sigkill(tmp_path):
    from rnnlab.rundir import RunDirBusy, RunDirLock

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from rnnlab.rundir import RunDirLock
        RunDirLock({str(tmp_path)!r}).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunDirBusy, match=f"pid {holder.pid} on host"):
        RunDirLock(tmp_path).acquire()
    RunDirLock(tmp_path, process_index=1).acquire().release()  # another process of the same run
    holder.kill()
    holder.wait()
    RunDirLock(tmp_path).acquire().release()


# 2. and 7. Failing saves: no hang, one line, results.json says why, the data holds.

INJECT = textwrap.dedent("""
    import runpy, sys, threading
    sys.path.insert(0, {root!r})
    from rnnlab import checkpoint

    real_save, failing_step = checkpoint.Checkpointer.save, {failing_step}

    def save(self, step, state, force=False):
        if step < failing_step:
            return real_save(self, step, state, force)
        if {stuck_thread}:  # what Orbax left behind in the field: a thread waiting forever
            threading.Thread(target=threading.Event().wait, name="stuck", daemon=False).start()
        raise self._save_failed(ValueError(
            "RESOURCE_EXHAUSTED: Error writing x in OCDBT database: Failed to write 9 bytes to file 16: "
            "No space left on device [os_error_code='28']"))

    checkpoint.Checkpointer.save = save
    sys.argv = ["train.py", *sys.argv[1:]]
    runpy.run_path({train!r}, run_name="__main__")
""")


def train_with_failing_saves(run_dir, failing_step, stuck_thread, *extra):
    code = INJECT.format(root=str(ROOT), train=str(ROOT / "train.py"), failing_step=failing_step,
                         stuck_thread=stuck_thread)
    return subprocess.run([sys.executable, "-c", code, *RUN, *extra, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                          env=train_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow("end-to-end")
def test_a_failed_save_with_a_stuck_thread_exits_within_seconds(tmp_path):
    started = time.time()
    proc = train_with_failing_saves(tmp_path / "run", 6, True)
    assert proc.returncode == 74 and time.time() - started < 100
    assert "No space left on device, errno 28" in one_error_line(proc)


@pytest.mark.slow("end-to-end")
def test_disk_full_mid_run_writes_results_then_the_rerun_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = train_with_failing_saves(run_dir, 6, False)
    assert proc.returncode == 74
    line = one_error_line(proc)
    assert f"cannot save a checkpoint in {run_dir / 'checkpoints'}" in line and "newest saved one is step 3" in line
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "failed" and "No space left on device" in results["error"]
    assert "No space left on device" in (run_dir / "train.log").read_text()  # the details went to the log
    # Space freed: the same command resumes from the last good checkpoint and completes.
    rerun = train(run_dir)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resumed from" in rerun.stdout + rerun.stderr
    assert json.loads((run_dir / "results.json").read_text())["status"] == "completed"


@pytest.fixture(scope="module")
def completed(tmp_path_factory):
    """`completed(run_dir, *extra)` puts a copy of a completed run of `extra` at `run_dir`: each run is trained once a
    module, and each test changes its own copy."""
    trained = {}

    def copy_to(run_dir, *extra):
        if extra not in trained:
            trained[extra] = tmp_path_factory.mktemp("completed") / "run"
            assert train(trained[extra], *extra).returncode == 0
        shutil.copytree(trained[extra], run_dir)

    return copy_to


# 3. Resume changes are explicit.

@pytest.mark.slow("end-to-end")
def test_a_resume_that_changes_the_trajectory_lists_each_change_and_stops(tmp_path, completed):
    run_dir = tmp_path / "run"
    completed(run_dir)
    before = saved_state(run_dir, 12)
    proc = train(run_dir, "steps=18", "optimizer.lr=0.001", "seed=3")
    assert proc.returncode == 2
    line = one_error_line(proc)
    for change in ("steps 12 -> 18", "optimizer.lr 0.003 -> 0.001", "seed 0 -> 3"):
        assert change in line
    assert "checkpoint.allow_changes=[optimizer.lr,seed,steps]" in line
    assert not (run_dir / "checkpoints" / "18").exists()
    assert json.loads((run_dir / "checkpoints" / "run_config.json").read_text())["steps"] == 12
    from conftest import assert_same_tree

    assert_same_tree(saved_state(run_dir, 12), before)


@pytest.mark.slow("end-to-end")
def test_accepted_changes_are_recorded_with_their_step_and_free_keys_pass(tmp_path, completed):
    run_dir = tmp_path / "run"
    completed(run_dir)
    proc = train(run_dir, "steps=18", "checkpoint.allow_changes=[steps]", "log_every=3", "eval_batches=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    history = [{"step": 12, "changes": {"steps": [12, 18]}}]
    assert json.loads((run_dir / "checkpoints" / "config_history.json").read_text()) == history
    record = saved_record(run_dir, 18)  # the checkpoint carries the new config and its history
    assert record["run_config"]["steps"] == 18 and record["config_history"] == history
    assert json.loads((run_dir / "checkpoints" / "run_config.json").read_text())["steps"] == 18


# 5. The config travels with the checkpoint.

@pytest.mark.slow("end-to-end")
@pytest.mark.parametrize("damage", ["delete", "garbage{"])
def test_a_lost_or_damaged_run_config_is_rewritten_from_the_checkpoint(tmp_path, damage, completed):
    run_dir = tmp_path / "run"
    completed(run_dir, "device.num_devices=2")
    path = run_dir / "checkpoints" / "run_config.json"
    original = json.loads(path.read_text())
    path.unlink() if damage == "delete" else path.write_text(damage)
    # The device count and the structure still come from the checkpoint's own record:
    refused = train(run_dir, "device.num_devices=2", "hidden_dim=16")
    assert refused.returncode == 2 and "key 'model.hidden_dim': this run dir was trained with 8, now 16" in refused.stderr
    changed = train(run_dir, "device.num_devices=1")
    assert changed.returncode == 2 and "device.num_devices 2 -> 1" in one_error_line(changed)
    proc = train(run_dir, "device.num_devices=2")  # a completed record is final: reported, nothing written
    assert proc.returncode == 0 and "already completed" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    (run_dir / "results.json").unlink()  # not completed: the run resumes from its checkpoint and repairs its record
    proc = train(run_dir, "device.num_devices=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(path.read_text()) == original


@pytest.mark.slow("end-to-end")
def test_a_run_config_without_checkpoints_never_refuses_a_new_config(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)  # as left by a run killed before its first checkpoint
    (run_dir / "checkpoints" / "run_config.json").write_text(json.dumps({"model.hidden_dim": 99, "steps": 1}))
    proc = train(run_dir, "hidden_dim=16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run_dir / "checkpoints" / "run_config.json").read_text())["model.hidden_dim"] == 16


# 4. and 6. Inputs in range; runs that cannot fit stop before they allocate.

@pytest.mark.parametrize("args,expected", [
    (["seed=4294967296"], "key 'seed': got 4294967296, allowed: 0 .. 4294967295"),
    (["seed=99999999999999999999"], "key 'seed'"),
    (["optimizer.lr=nan"], "key 'optimizer.lr': got nan, expected a finite number"),
    (["optimizer.lr=inf"], "key 'optimizer.lr'"),
    (["device.num_devices=1000"], "key 'device.num_devices': got 1000, allowed: null or 1 .. 64"),
    (["hidden_dim=50000"], "hidden_dim=50000"),
    (["hidden_dim=1000000000"], "hidden_dim=1000000000"),
    # refused by the shape check, before any init or compile: the layer outputs a backward keeps
    (["data.seq_len=100000000"], "with the layer outputs the backward keeps, would take about"),
    (["checkpoint.allow_changes=[lr]"], "key 'checkpoint.allow_changes': 'lr' is not a config key"),
])
@pytest.mark.slow("end-to-end")
def test_out_of_range_input_and_runs_that_cannot_fit_exit_2_at_once(tmp_path, args, expected):
    started = time.time()
    proc = train(tmp_path / "run", *args, timeout=120)
    assert proc.returncode == 2 and time.time() - started < 60
    line = one_error_line(proc)
    assert expected in line
    if "GiB" in line:  # the memory refusals name every key that sizes the run, and the estimate
        assert all(k in line for k in ("hidden_dim=", "batch_size=", "data.seq_len="))


@pytest.mark.slow("end-to-end")
def test_a_train_step_that_cannot_fit_is_refused_after_compiling_before_running(tmp_path, monkeypatch):
    from rnnlab import memory
    from rnnlab.trainer import train_and_evaluate

    monkeypatch.setattr(memory, "compiled_bytes", lambda stats: 1e18)
    with pytest.raises(memory.OutOfMemoryError, match="the train step would take about"):
        train_and_evaluate(tiny_config(), tmp_path)
    assert not (tmp_path / "checkpoints" / "3").exists()


@pytest.mark.slow("end-to-end")
def test_an_xla_allocation_failure_is_named_as_out_of_memory():
    import jax
    from rnnlab import memory

    try:
        jax.numpy.zeros((2**46,), jax.numpy.int8).block_until_ready()
    except Exception as e:  # noqa: BLE001
        error = e
    assert memory.is_out_of_memory(error)
    assert "out of memory" in str(memory.out_of_memory_error(error, tiny_config()))
    assert not memory.is_out_of_memory(ValueError("RESOURCE_EXHAUSTED: Error writing x: No space left on device"))
