"""Nothing lost, nothing silent: kill/resume, corrupt checkpoints, divergence, bad input.

Every run here is `python train.py` in a fresh process, as a user or a cluster scheduler
would start and stop it. Interrupted runs must end bit-identical to an uninterrupted one.
"""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT, TINY, assert_same_tree, run_train, saved_state, train_env

pytestmark = pytest.mark.slow("end-to-end")

STEPS = 60
RUN = [o for o in TINY if not o.startswith(("device", "steps", "log_every", "checkpoint"))] + [
    f"steps={STEPS}", "log_every=5", "checkpoint.every=5", "eval_every=30",
]


def start(run_dir, *extra):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *RUN, *extra, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_for(proc, text, timeout=180):
    """Read the process's output until a line contains `text`; returns everything read."""
    seen, deadline = [], time.time() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text in line or time.time() > deadline:
            break
    return "".join(seen)


def rerun(run_dir, *extra):
    proc = run_train([*RUN, *extra, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def logged_steps(run_dir, tag="train/loss"):
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The run dir of the same run, never interrupted (a test that changes it works on a copy)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    rerun(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def reference(reference_run):
    """Its final state."""
    return saved_state(reference_run, STEPS)


@pytest.fixture(scope="module")
def five_step_run(tmp_path_factory):
    """A completed 5-step run dir (a test that changes it works on a copy)."""
    run_dir = tmp_path_factory.mktemp("five_steps") / "run"
    rerun(run_dir, "steps=5")
    return run_dir


def test_sigterm_at_a_random_step_then_rerun_is_bit_identical(tmp_path, reference, seeded_random):
    run_dir = tmp_path / "run"
    kill_after = seeded_random.choice(range(10, STEPS - 10, 5))  # seeded from the test's name: a failure reproduces
    proc = start(run_dir)
    wait_for(proc, f"step {kill_after}/{STEPS}")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, f"killed after step {kill_after}:\n{out[-2000:]}"
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "preempted" and results["step"] >= kill_after
    assert (run_dir / "checkpoints" / str(results["step"])).is_dir()  # saved on the way out

    output = rerun(run_dir)
    assert f"at step {results['step']}" in output
    assert json.loads((run_dir / "results.json").read_text())["status"] == "completed"
    assert_same_tree(saved_state(run_dir, STEPS), reference)
    # TensorBoard: every log step exactly once, none missing; the preempted step's partial
    # window was logged on the way out.
    expected = sorted(set(range(5, STEPS + 1, 5)) | {results["step"]})
    assert logged_steps(run_dir) == expected


def test_sigkill_at_random_moments_even_mid_save_then_rerun_is_bit_identical(tmp_path, reference, seeded_random):
    run_dir = tmp_path / "run"
    # Seeded from the test's name: the same delays on every run, so a failure reproduces (as far as the process's
    # own timing allows).
    delays = [seeded_random.uniform(0.0, 0.5) for _ in range(2)]
    for attempt, delay in enumerate(delays):  # two hard kills while a save starts every step (not checked: mid-save)
        proc = start(run_dir, "checkpoint.every=1")
        # Once step 20 is logged, earlier saves have completed (Orbax finishes one save before
        # starting the next), so a kill soon after always leaves something to resume from.
        wait_for(proc, f"step {20 + 20 * attempt}/{STEPS}")
        time.sleep(delay)
        proc.kill()
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, f"kill {attempt} {delay:.3f} s after step {20 + 20 * attempt}"
    output = rerun(run_dir, "checkpoint.every=1")
    assert "resumed from" in output, f"killed {delays} s after steps 20 and 40"
    assert_same_tree(saved_state(run_dir, STEPS), reference)
    assert not list((run_dir / "checkpoints").glob("*tmp*"))  # half-written saves were cleaned up
    assert logged_steps(run_dir) == list(range(5, STEPS + 1, 5))


def test_corrupt_newest_checkpoint_falls_back_and_says_so(tmp_path, reference_run, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run, run_dir)  # complete: checkpoints 50, 55, 60 (keep=3)
    newest = run_dir / "checkpoints" / str(STEPS)
    for f in newest.rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    (run_dir / "results.json").unlink()  # as a run killed after its last save leaves it (a completed record is final)
    output = rerun(run_dir)
    assert f"checkpoint {newest} cannot be restored" in output
    assert f"fell back from {newest} to step 55" in output
    assert (run_dir / "checkpoints" / f"{STEPS}.unreadable").is_dir()  # kept for inspection
    assert_same_tree(saved_state(run_dir, STEPS), reference)


def test_every_checkpoint_unreadable_is_a_clear_error(tmp_path):
    run_dir = tmp_path / "run"
    rerun(run_dir, "steps=10")
    (run_dir / "results.json").unlink()  # as a run killed after its last save leaves it (a completed record is final)
    for f in (run_dir / "checkpoints").rglob("*"):
        if f.is_file() and f.name != "run_config.json":
            f.write_bytes(b"garbage")
    proc = run_train([*RUN, "steps=10", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "can be restored" in proc.stderr and str(run_dir / "checkpoints") in proc.stderr


def test_absurd_learning_rate_stops_with_the_step_named(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train([*RUN, "optimizer.lr=1e30", "optimizer.warmup_steps=0", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    assert "non-finite training at step 2 " in proc.stderr and "optimizer.lr" in proc.stderr
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "diverged" and results["step"] == 2
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]


def test_resuming_with_another_model_shape_names_the_key(tmp_path, five_step_run):
    run_dir = tmp_path / "run"
    shutil.copytree(five_step_run, run_dir)
    proc = run_train([*RUN, "steps=10", "hidden_dim=16", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "key 'model.hidden_dim': this run dir was trained with 8, now 16" in proc.stderr


def test_resume_false_refuses_to_overwrite(tmp_path, five_step_run):
    run_dir = tmp_path / "run"
    shutil.copytree(five_step_run, run_dir)
    proc = run_train([*RUN, "checkpoint.resume=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 2 and "'checkpoint.resume'" in proc.stderr
    assert saved_state(run_dir, 5)["step"] == 5


BAD_INPUTS = [
    (["hidden_dim=0"], "'hidden_dim'"),
    (["hidden_dim=abc"], "'hidden_dim'"),
    (["steps=-1"], "'steps'"),
    (["batch_size=0"], "'batch_size'"),
    (["num_layers=0"], "'num_layers'"),
    (["log_every=0"], "'log_every'"),
    (["model=transformer"], "'model'"),
    (["model.cell=transformer"], "'model.cell'"),
    (["model.init=xavier"], "'model.init'"),
    (["data=sorting"], "'data'"),
    (["data=copy", "data.seq_len=5"], "'data.seq_len'"),
    (["optimizer=rmsprop"], "'optimizer'"),
    (["optimizer.lr=-0.1"], "'optimizer.lr'"),
    (["optimizer.schedule=step"], "'optimizer.schedule'"),
    (["device.num_devices=0"], "'device.num_devices'"),
    (["device=gpu"], "'device.platform'"),
    (["device.num_devices=4", "batch_size=30"], "'batch_size'"),
    (["hidden_dimm=3"], "'hidden_dimm'"),
    (["+model.depth=2"], "'model.depth'"),
    (["on_nonfinite=ignore"], "'on_nonfinite'"),
    (["checkpoint.keep=0"], "'checkpoint.keep'"),
    (["seed=1.5"], "'seed'"),
]


# Through `python train.py`: one of each kind of refusal (a value, a group's option, an unknown key), and those only a
# started run can see (the platform, the batch against the devices found); every case in process just below.
CLI_BAD_INPUTS = [(["hidden_dim=0"], "'hidden_dim'"), (["model=transformer"], "'model'"),
                  (["+model.depth=2"], "'model.depth'"), (["device=gpu"], "'device.platform'"),
                  (["device.num_devices=4", "batch_size=30"], "'batch_size'")]


def test_bad_config_input_is_refused_in_one_line_naming_the_key():
    """train.config_exit is the check `python train.py` runs on its config before anything starts."""
    import train

    for args, key in BAD_INPUTS:
        if (args, key) in CLI_BAD_INPUTS[3:]:
            continue
        code, line = train.config_exit([*RUN, *args])
        assert code == 2 and key in line and "\n" not in line, (args, code, line)


@pytest.mark.parametrize("args,key", CLI_BAD_INPUTS, ids=[" ".join(a) for a, _ in CLI_BAD_INPUTS])
def test_bad_input_exits_2_naming_the_key(tmp_path, args, key):
    proc = run_train([*RUN, *args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert lines and lines[-1].startswith("rnnlab: error: ") and key in lines[-1]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not any(p.name.isdigit() for p in checkpoints.iterdir())


def test_unwritable_run_dir_is_reported(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_train([*RUN, f"hydra.run.dir={blocker / 'run'}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 74 and "Traceback" not in proc.stderr  # README: 74 an unwritable run dir
    assert "hydra.run.dir" in proc.stderr and str(blocker) in proc.stderr
