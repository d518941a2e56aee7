"""The zoo's records cannot be lost (rnnlab.zoo.records, the runner's recovery, the CLI's refusals): a job that ends
while no runner is there is recorded by the next `run`; a job an earlier runner left training is waited on, never
started twice; two writers lose nothing; a second runner on one out dir, a damaged records line, a missing docs dir
and bad cells or overrides are refused in one line (exit 2), unwritable folders exit 74. Against a stand-in
train.py that takes its run dir's lock as train.py does; the real train.py: tests/zoo/test_end_to_end.py."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rnnlab.zoo import cli, records, runner
from rnnlab.zoo.protocol import Setting, Table

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
KIND, MACHINE = "CPU", "CPU (Stand-in, 2 cores)"

# Holds <run dir>/.rnnlab.lock.0 while it "trains" (FAKE_SECONDS), as train.py does, then writes a final record.
FAKE_TRAIN = '''
import fcntl, json, os, signal, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
if os.environ.get("FAKE_REFUSE"):
    print("Error: key 'model': 'nosuch' is not a cell", file=sys.stderr)
    sys.exit(2)
run_dir = args["hydra.run.dir"]
os.makedirs(run_dir, exist_ok=True)
with open(os.path.join(run_dir, "..", "..", "..", "starts.log"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
lock = os.open(os.path.join(run_dir, ".rnnlab.lock.0"), os.O_RDWR | os.O_CREAT)
fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.pwrite(lock, f"{os.getpid()} host\\n".encode(), 0)
score = {"0.001": 0.5, "0.003": 0.9}[repr(float(args["optimizer.lr"]))]
def write(status, step):
    results = {"status": status, "step": step, "eval_loss": 0.1, "eval_metrics": {"accuracy": score},
               "eval_by_len": {"8": {"loss": 0.1, "accuracy": score}}, "wall_seconds": 1.0,
               "provenance": {"commit": %(commit)r, "machine": {"platform": "cpu", "cpu": "Stand-in", "cpu_cores": 2}}}
    json.dump(results, open(os.path.join(run_dir, "results.json"), "w"))
signal.signal(signal.SIGTERM, lambda *a: (write("preempted", 1), sys.exit(75)))
time.sleep(float(os.environ.get("FAKE_SECONDS", "0")))
write("completed", 6)
'''


def tiny_table(settings=("gru",)) -> Table:
    return Table("tiny", "Tiny parity", "zoo_parity", (), tuple(Setting(s) for s in settings), (1e-3, 3e-3), 2, 6,
                 "accuracy", True, 8, (8,), "A stand-in table.", lr_bounds=(1e-3, 3e-3))  # no edge-rule lrs here


@pytest.fixture
def zoo(tmp_path, monkeypatch):
    """`cli.main` on a tiny table, with the fake train.py as the pinned commit's code (no git, no JAX)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(FAKE_TRAIN % {"commit": COMMIT})
    (tmp_path / "docs").mkdir()
    monkeypatch.setattr(runner, "repo_root", lambda: tmp_path)
    monkeypatch.setattr(runner, "this_machine", lambda *a, **k: (KIND, MACHINE))
    monkeypatch.setattr(runner, "worktree", lambda root, commit, out: code)
    monkeypatch.setattr(runner, "resolve_commit", lambda root, ref: COMMIT)
    monkeypatch.setattr(cli, "warn_if_dirty", lambda root, commit: None, raising=False)
    monkeypatch.setenv("FAKE_SECONDS", "0")

    def main(*args, table=None):
        table = table or tiny_table()
        running = ["--parallel", "2"] + (["--grace", "5"] if args[0] == "run" else []) if args[0] != "collect" else []
        return cli.main([args[0], "t", "--out", str(tmp_path / "out"), "--docs", str(tmp_path / "docs"), *running,
                         *args[1:]], tables={"tiny": table}, suites={"t": ("tiny",)})

    return main


def starts(tmp_path) -> list[str]:
    log = tmp_path / "out" / "starts.log"
    return log.read_text().splitlines() if log.exists() else []


def start_job(tmp_path, lr, seconds):
    """A job started by a runner that is gone: train.py, in its own session, on its run dir."""
    job = runner.Job(tiny_table(), tiny_table().settings[0], lr, 0)
    run_dir = job.run_dir(tmp_path / "out").resolve()
    env = dict(os.environ, FAKE_SECONDS=str(seconds))
    proc = subprocess.Popen([sys.executable, str(tmp_path / "code" / "train.py"), *job.overrides(),
                             f"hydra.run.dir={run_dir}"], env=env, start_new_session=True)
    until = time.time() + (20 if seconds else 0)
    while not runner.lock_holder(run_dir / ".rnnlab.lock.0") and time.time() < until:
        time.sleep(0.05)
    return job, proc


def table_records(tmp_path):
    return records.read_table(tmp_path / "docs", "tiny")


def test_a_job_that_ended_with_no_runner_there_is_recorded_by_the_next_run_and_not_run_again(tmp_path, zoo, capsys):
    job, proc = start_job(tmp_path, 1e-3, 0)
    assert proc.wait(20) == 0 and table_records(tmp_path) == []  # finished with nobody to record it
    assert zoo("run") == 0
    recs = table_records(tmp_path)
    assert len(recs) == 3 and sorted((r["lr"], r["seed"]) for r in recs) == [(1e-3, 0), (3e-3, 0), (3e-3, 1)]
    assert "1 record(s) of jobs that ended after their runner was gone, now recorded" in capsys.readouterr().out
    assert len(starts(tmp_path)) == 3  # the orphan's own start, then the two the runner started


def test_a_job_an_earlier_runner_left_training_is_waited_on_and_recorded_once(tmp_path, zoo, capsys):
    job, proc = start_job(tmp_path, 1e-3, 3)
    assert zoo("run") == 0
    proc.wait(20)
    out = capsys.readouterr().out
    assert f"{job.name}: still trained by pid {proc.pid}" in out and "waiting for it to end" in out
    assert [line.count("optimizer.lr=1e-3") for line in starts(tmp_path)].count(1) == 1  # never started twice
    recs = table_records(tmp_path)
    assert len(recs) == 3 and len({records.key(r) for r in recs}) == 3


def test_a_failed_records_write_loses_nothing_the_next_run_records_it(tmp_path, zoo, monkeypatch, capsys):
    """The records dir cannot be written when the first job ends: the runner says so in one line, exits 74, and its
    jobs save; once it is writable again the next run records every job exactly once."""
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):  # os.replace is the process's: fail only the first write of the table's records
        if Path(dst).name == "tiny.jsonl":
            calls.append(dst)
            if len(calls) == 1:
                raise PermissionError(13, "Permission denied", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(records.os, "replace", failing_replace)
    assert zoo("run") == 74
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zoo: error: cannot write ") and "tiny.jsonl" in err[0]
    assert not list((tmp_path / "docs" / "zoo" / "records").glob("*.tmp"))
    assert zoo("run") == 0
    recs = table_records(tmp_path)
    assert len(recs) == 3 and len({records.key(r) for r in recs}) == 3 and len(starts(tmp_path)) == 3


def test_a_second_runner_on_the_same_out_dir_is_refused_in_one_line(tmp_path, zoo, capsys):
    with runner.RunnerLock(tmp_path / "out"):
        assert zoo("run") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is in use by another zoo runner (pid" in err[0] and starts(tmp_path) == []
    assert zoo("run") == 0  # the lock went with its holder


def test_concurrent_merges_lose_nothing(tmp_path):
    """Two processes merging 60 records each, one at a time, into one table: all 120 are there."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_records import tiny_table
from rnnlab.zoo import records
table, who = tiny_table(), int(sys.argv[1])
for seed in range(60):
    records.merge({str(tmp_path / 'docs')!r}, table, [{{"table": "tiny", "setting": "gru", "lr": 0.001,
                  "seed": who * 1000 + seed, "status": "completed", "provenance": {{"commit": "c"}}}}])
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(who)], stderr=subprocess.PIPE, text=True)
             for who in (1, 2)]
    assert [p.wait(120) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    assert len(table_records(tmp_path)) == 120


@pytest.mark.parametrize("damage", ['{"table": "tiny", "setting": "gr', "<<<<<<< HEAD", '{"lr": 0.001}'])
def test_a_damaged_records_line_is_refused_naming_the_file_and_line(tmp_path, zoo, capsys, damage):
    path = tmp_path / "docs" / "zoo" / "records" / "tiny.jsonl"
    path.parent.mkdir(parents=True)
    good = json.dumps({"table": "tiny", "setting": "gru", "lr": 0.001, "seed": 0, "status": "completed"})
    path.write_text(f"{good}\n{damage}\n{good}\n")
    for command in ("plan", "run", "collect"):
        assert zoo(command) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{path} line 2: not " in err[0], err
    assert cli.main(["page", "--docs", str(tmp_path / "docs")], tables={"tiny": tiny_table()}, suites={}) == 2
    assert f"{path} line 2" in capsys.readouterr().err
    assert path.read_text() == f"{good}\n{damage}\n{good}\n" and starts(tmp_path) == []  # never written over


def test_a_missing_docs_dir_and_an_unwritable_page_are_one_line_each(tmp_path, capsys):
    assert cli.main(["page", "--docs", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "option '--docs':" in err[0] and "is not a folder" in err[0]
    docs = tmp_path / "docs"
    (docs / "results.md").mkdir(parents=True)  # what the page writes cannot be written (as root: no read-only dir)
    assert cli.main(["page", "--docs", str(docs), "--no-plots"], tables={"tiny": tiny_table()}, suites={}) == 74
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zoo: error: cannot write ") and "results.md" in err[0]


def test_an_unwritable_out_dir_exits_74_in_one_line(tmp_path, zoo, capsys):
    (tmp_path / "out").write_text("a file, not a folder")
    assert zoo("run") == 74
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "option '--out': cannot write" in err[0]


def test_bad_cells_and_overrides_are_refused_before_any_job_starts(tmp_path, capsys):
    """The pinned commit's train.py composes one job of each setting first (its config check, no JAX)."""
    table = tiny_table(("gru", "nosuchcell"))
    with pytest.raises(runner.ZooError, match=r"tiny, setting 'nosuchcell': train.py refuses it: .*model"):
        runner.check_configs(ROOT, [table], [])
    with pytest.raises(runner.ZooError, match=r"setting 'gru': train.py refuses it: .*hidden_dim"):
        runner.check_configs(ROOT, [tiny_table()], ["hidden_dim=wide"])
    runner.check_configs(ROOT, [tiny_table()], ["hidden_dim=8"])  # a good one passes


def test_the_options_that_mean_nothing_are_refused_and_a_repeated_cell_runs_once(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "core", "--commit", ""])
    assert e.value.code == 2 and "--commit: got ''" in capsys.readouterr().err
    args = cli.parser({"tiny": tiny_table()}, {}).parse_args(["plan", "tiny", "--cell", "gru", "--cell", "gru"])
    assert [s.name for s in cli.selected(args, {"tiny": tiny_table()}, {})[0].settings] == ["gru"]


def test_records_at_a_commit_this_clone_lacks_name_the_cause(tmp_path):
    docs = tmp_path / "docs"
    table = tiny_table()
    records.merge(docs, table, [{"table": "tiny", "setting": "gru", "lr": 0.001, "seed": 0, "status": "completed",
                                 "provenance": {"commit": "f" * 40, "machine": {"platform": "cpu", "cpu": "X"}}}])
    with pytest.raises(runner.ZooError, match=r"made at commit ffffffffffff, which .* does not hold \(a shallow "
                                              r"clone\?\): `git fetch --unshallow`"):
        cli.pinned_commit(ROOT, docs, [table], KIND, None)


def test_plan_probe_runs_with_the_overrides_and_the_callers_path(tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text('''
import json, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
os.makedirs(args["hydra.run.dir"], exist_ok=True)
json.dump({"status": "completed", "tokens_per_step": 100, "tokens_per_sec": 1000.0, "wall_seconds": 14.0,
           "argv": sys.argv[1:], "path": os.environ["PYTHONPATH"]},
          open(os.path.join(args["hydra.run.dir"], "results.json"), "w"))
''')
    monkeypatch.setenv("PYTHONPATH", "/my/cells")
    seconds = runner.probe_seconds(code, tiny_table(), tmp_path / "out", ["imports=[mycells]"], steps=40)
    assert seconds == pytest.approx(14.0 - 0.1 * 40 + 0.1 * 6)
    results = json.loads((tmp_path / "out" / "probes" / "tiny" / "results.json").read_text())
    assert "imports=[mycells]" in results["argv"] and results["path"].split(os.pathsep) == [str(code), "/my/cells"]


def test_a_job_that_fails_to_start_is_reported_with_its_own_line_and_log(tmp_path, zoo, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_REFUSE", "1")
    assert zoo("run") == 1
    out = capsys.readouterr().out
    assert "no results.json (exit 2): Error: key 'model': 'nosuch' is not a cell (see " in out
    assert "stdout.log)" in out and "ended without a final status" in out
