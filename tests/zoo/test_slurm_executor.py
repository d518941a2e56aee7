"""The SLURM executor's parts that need no cluster (rnnlab.zoo.slurm): what `squeue` says is read as the runner needs
it (a stand-in `squeue` on PATH prints SLURM's own format), the flags become submitit's parameters, missing client
commands are refused in one line, and a job's function returns train.py's exit code and, on submitit's signal, has
it save (SIGTERM) before the requeue. The executor against a real single-node SLURM: tests/zoo/test_slurm.py (full
tier)."""

import os
import stat
import sys
import textwrap
import threading
import time

import pytest

from conftest import require
from rnnlab.zoo import slurm
from rnnlab.zoo.runner import ZooError


def fake_squeue(tmp_path, monkeypatch, stdout="", stderr="", code=0):
    """A `squeue` first on PATH that prints `stdout` (and `stderr`) and exits `code`; it logs its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "squeue"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        open({str(tmp_path / 'squeue.args')!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
        sys.stdout.write({stdout!r}); sys.stderr.write({stderr!r}); sys.exit({code})
    """))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "squeue.args"


LISTING = ("11|RUNNING|zoo-ab12:parity-gru-lr1e-3-s0\n"
           "12|PENDING|zoo-ab12:parity-gru-lr3e-3-s0\n"
           "13|COMPLETED|zoo-ab12:parity-lstm-lr1e-3-s0\n"
           "14|CANCELLED by 0|zoo-ab12:parity-lstm-lr3e-3-s0\n")


def test_a_job_is_alive_while_squeue_lists_it_queued_or_running_under_its_own_name(tmp_path, monkeypatch):
    args = fake_squeue(tmp_path, monkeypatch, stdout=LISTING)
    queue = slurm.Queue()
    assert queue.alive("11", "zoo-ab12:parity-gru-lr1e-3-s0") is True
    assert queue.alive("12", "zoo-ab12:parity-gru-lr3e-3-s0") is True
    assert queue.alive("13", "zoo-ab12:parity-lstm-lr1e-3-s0") is False  # ended
    assert queue.alive("14", "zoo-ab12:parity-lstm-lr3e-3-s0") is False  # "CANCELLED by 0": its first word
    assert queue.alive("11", "zoo-ab12:another-job") is False  # the id reused by a controller started afresh
    assert queue.alive("99", "zoo-ab12:parity-gru-lr1e-3-s0") is False  # no longer listed: ended
    assert queue.find("zoo-ab12:parity-gru-lr3e-3-s0") == "12"
    assert queue.find("zoo-ab12:parity-lstm-lr1e-3-s0") is None
    # Asked once for all of that (at most every POLL_SECONDS), for this user's jobs in every state.
    asked = args.read_text().splitlines()
    assert len(asked) == 1 and "--states=all" in asked[0] and f"--user={slurm.user()}" in asked[0]
    assert queue.jobs(fresh=True) is not None and len(args.read_text().splitlines()) == 2


def test_a_failing_squeue_says_it_cannot_tell_and_keeps_its_line(tmp_path, monkeypatch):
    fake_squeue(tmp_path, monkeypatch, stderr="slurm_load_jobs error: Unable to contact slurm controller\n", code=1)
    queue = slurm.Queue()
    assert queue.alive("11", "zoo-ab12:x") is None and queue.jobs(fresh=True) is None
    assert queue.error == "slurm_load_jobs error: Unable to contact slurm controller"
    assert queue.find("zoo-ab12:x") is None


def test_the_flags_become_submitits_parameters_with_the_signal_before_the_limit():
    given = slurm.Resources(partition="debug", timeout_min=60, cpus_per_task=2, mem_gb=8.0, account="lab").parameters()
    assert given == {"timeout_min": 60, "slurm_signal_delay_s": 120, "cpus_per_task": 2, "mem_gb": 8.0,
                     "slurm_partition": "debug", "slurm_account": "lab"}
    assert slurm.Resources(timeout_min=2).parameters()["slurm_signal_delay_s"] == 60  # at most half the limit
    assert slurm.Resources().key() != slurm.Resources(qos="high").key()


def test_missing_client_commands_are_refused_in_one_line_naming_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with pytest.raises(ZooError) as refused:
        slurm.check_clients()
    assert str(refused.value).startswith("--executor slurm: sbatch, squeue, srun not found")
    assert "\n" not in str(refused.value)


def test_a_jobs_function_returns_train_pys_exit_code_and_appends_its_output(tmp_path):
    log = tmp_path / "run" / "stdout.log"
    log.parent.mkdir()
    log.write_text("earlier\n")
    command = slurm.TrainCommand([sys.executable, "-c", "print('trained'); raise SystemExit(3)"], str(tmp_path),
                                 str(log), grace=5)
    assert command() == 3
    assert log.read_text() == "earlier\ntrained\n"


def test_submitits_signal_has_train_py_save_then_requeues_the_same_command(tmp_path):
    DelayedSubmission = require("submitit.helpers").DelayedSubmission

    saved = tmp_path / "saved"
    # A stand-in train.py: on SIGTERM (and only on it) it "saves" and exits 75 (train.py's preempted), as rnnlab.checkpoint does.
    script = textwrap.dedent(f"""
        import signal, sys, time
        def save(*_):
            open({str(saved)!r}, "w").write("step 7"); sys.exit(75)
        signal.signal(signal.SIGTERM, save)
        print("training", flush=True)
        time.sleep(60)
    """)
    log = tmp_path / "stdout.log"
    command = slurm.TrainCommand([sys.executable, "-c", script], str(tmp_path), str(log), grace=20)
    ended = []
    thread = threading.Thread(target=lambda: ended.append(command()))
    thread.start()
    until = time.time() + 30
    while "training" not in (log.read_text() if log.exists() else "") and time.time() < until:
        time.sleep(0.05)
    requeued = command.checkpoint()
    thread.join(timeout=30)
    assert saved.read_text() == "step 7" and ended == [75]
    assert isinstance(requeued, DelayedSubmission)
    again = requeued.function
    assert (again.cmd, again.code, again.log_path, again.grace) == (command.cmd, command.code, command.log_path, 20)
