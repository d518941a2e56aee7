"""scripts/zoo_queue.py runs the zoo protocol as a queue: the grid on seed 0, the other seeds at the lr the grid
chose (ties to the smaller), jobs already completed kept, and a clean stop at the deadline. The jobs are a
stand-in for train.py that writes results.json as train.py does, so these run in seconds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

from conftest import ROOT

QUEUE = ROOT / "scripts" / "zoo_queue.py"

# Accuracy at the training length by lr (ties at 1e-3 and 3e-3: the smaller wins); a run with `hang=1` waits for
# SIGTERM with a child in its process group that records any SIGTERM it gets.
STAND_IN = textwrap.dedent("""
    import json, os, pathlib, signal, subprocess, sys, time
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    run = pathlib.Path(args["hydra.run.dir"])
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {a}\\n" for a in sys.argv[1:] if not a.startswith("hydra.")))
    with open(run.parent.parent.parent / "calls.txt", "a") as calls:
        calls.write(run.name + "\\n")
    score = {"3e-4": 0.5, "1e-3": 0.9, "3e-3": 0.9, "1e-2": 0.2}[args["optimizer.lr"]] + 0.01 * int(args["seed"])
    status = "completed"
    if args.get("hang") == "1":
        child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time, pathlib; "
            "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path(sys.argv[1]).write_text('TERM'), sys.exit(0))); "
            "time.sleep(60)", str(run / "child_term")])
        stop = []
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
        while not stop:
            time.sleep(0.05)
        status = "preempted"
        child.kill()
    (run / "results.json").write_text(json.dumps(
        {"status": status, "task": "mqar", "eval_metrics": {"accuracy": score}, "eval_loss": 1.0 - score}))
""")


def queue(tmp_path, *extra, settings=("experiment=zoo_x cell=a", "experiment=zoo_x cell=b")):
    train = tmp_path / "stand_in.py"
    train.write_text(STAND_IN)
    flags = [f for s in settings for f in ("--setting", s)]
    cmd = [sys.executable, str(QUEUE), "--out", str(tmp_path / "out"), "--train", str(train), "--parallel", "3",
           *flags, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_the_grid_runs_on_seed_0_then_the_seeds_at_its_best_lr(tmp_path):
    done = queue(tmp_path, "--seeds", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    runs = sorted(p.parent.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("results.json"))
    expected = [f"zoo_x/cell-{c}/lr{lr}_seed0" for c in "ab" for lr in ("1e-2", "1e-3", "3e-3", "3e-4")]
    expected += [f"zoo_x/cell-{c}/lr1e-3_seed{s}" for c in "ab" for s in (1, 2)]
    assert runs == sorted(expected)
    assert "lr 1e-3 (0.9)" in done.stdout  # the tie with 3e-3 goes to the smaller lr
    # The terminal gets train.py -m's status line per finished job (rnnlab.sweep_status), not each start and end.
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == [f"[{k}/12" for k in range(1, 13)]
    assert all(re.fullmatch(r"\[\d+/12\] \d running, \d+ left, 0 failed, (less than a minute left|about \d+ min left|"
                            r"done in \d+ s)", line) for line in lines), lines
    assert lines[-1].startswith("[12/12] 0 running, 0 left, 0 failed, done in ")
    assert " start " not in done.stdout and " end " not in done.stdout
    assert "end  zoo_x/cell-a/lr1e-2_seed0 completed" in (tmp_path / "out" / "queue.log").read_text()

    again = queue(tmp_path, "--seeds", "3")  # everything completed: nothing runs twice
    assert again.returncode == 0, again.stdout + again.stderr
    assert len((tmp_path / "out" / "calls.txt").read_text().split()) == 12


def test_a_deadline_stops_the_jobs_with_sigterm_to_the_job_alone(tmp_path):
    done = queue(tmp_path, "--deadline", "3", "--grace", "20", "--", "hang=1", settings=("experiment=zoo_x cell=a",))
    assert done.returncode == 1, done.stdout + done.stderr  # preempted jobs are not completed ones
    assert "deadline: 1 jobs not started, 3 stopped" in done.stdout
    assert "seeds queued" not in done.stdout  # no lr is chosen from stopped jobs
    assert "[3/3] 0 running, 0 left, 3 failed, done in " in done.stdout  # stopped jobs did not complete
    results = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("results.json")]
    assert [r["status"] for r in results] == ["preempted"] * 3
    assert not list((tmp_path / "out").rglob("child_term"))  # the job's subprocesses did not get its SIGTERM
