"""The zoo's runner, records and page (rnnlab.zoo) against a stand-in train.py that writes results.json at once:
the protocol's order (seed 0's grid, then the other seeds at the lr the rule chose), resuming after a deadline, the
records, and a page that the same records regenerate byte for byte. The real train.py runs in
tests/zoo/test_end_to_end.py (full tier)."""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from rnnlab.zoo import cli, page, protocol, records, runner
from rnnlab.zoo.protocol import Setting, Table, choose_lr

KIND = "CPU"  # every CPU model is one kind of device
MACHINE = "CPU (Stand-in, 2 cores)"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Seed 0's score by (cell, lr): gru ties at 1e-3 and 3e-3 (the smaller wins); rnn diverges at 3e-3 and is best at
# 1e-2, the grid's top, so the edge rule trains 3e-2 (worse: 1e-2 is chosen).
SCORES = {("rnn", "0.0001"): 0.5, ("rnn", "0.0003"): 0.8,
          ("rnn", "0.001"): 0.6, ("rnn", "0.003"): None, ("rnn", "0.01"): 0.7, ("rnn", "0.03"): 0.65,
          ("gru", "0.001"): 0.9, ("gru", "0.003"): 0.9, ("gru", "0.01"): 0.5,
          ("deltanet", "0.001"): 0.95, ("deltanet", "0.003"): 0.95, ("deltanet", "0.01"): 0.5}

FAKE_TRAIN = '''
import json, os, signal, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
run_dir = args["hydra.run.dir"]
os.makedirs(run_dir, exist_ok=True)
with open(os.path.join(os.path.dirname(run_dir), "..", "..", "starts.log"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
scores = %(scores)r
cell, lr, seed = args["model"], repr(float(args["optimizer.lr"])), int(args["seed"])
score = scores[(cell, lr)]
status = "completed" if score is not None else "diverged"
def write(status, step):
    results = {"status": status, "step": step, "eval_loss": 0.1, "eval_metrics": {"accuracy": score},
               "eval_by_len": {"8": {"loss": 0.1, "accuracy": score}, "16": {"loss": 0.2, "accuracy": (score or 0) / 2}},
               "num_params": 10, "tokens_per_sec": 100.0, "wall_seconds": 1.0,
               "provenance": {"commit": %(commit)r, "machine": {"platform": "cpu", "cpu": "Stand-in", "cpu_cores": 2},
                              "started_utc": "2026-12-01T00:00:00Z"}}
    json.dump(results, open(os.path.join(run_dir, "results.json"), "w"))
signal.signal(signal.SIGTERM, lambda *a: (write("preempted", 1), sys.exit(75)))
time.sleep(float(os.environ.get("FAKE_SECONDS", "0")))
write(status, 6)
'''


def tiny_table(settings=("rnn", "gru")) -> Table:
    return Table("tiny", "Tiny parity", "zoo_parity", (), tuple(Setting(s) for s in settings), (1e-3, 3e-3, 1e-2), 3,
                 6, "accuracy", True, 8, (8, 16), "A stand-in table.")


@pytest.fixture
def code(tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "train.py").write_text(FAKE_TRAIN % {"scores": SCORES, "commit": COMMIT})
    return folder


def run_once(tmp_path, code, table, deadline=float("inf"), executor_class=runner.Executor, parallel=2):
    ledger = runner.Ledger([table], tmp_path / "out", tmp_path / "docs", COMMIT, KIND, MACHINE)
    lines = []

    def record(done):
        records.merge(tmp_path / "docs", table, done)

    code_ = runner.run(ledger, [table], executor_class(code, tmp_path / "out", [], pin=False), parallel, deadline,
                       grace=5.0, say=lines.append, on_done=record)
    return code_, lines


def starts(tmp_path):
    return [dict(a.split("=", 1) for a in line.split() if "=" in a)
            for line in (tmp_path / "out" / "starts.log").read_text().splitlines()]


def test_the_rule_chooses_on_seed_0_ties_to_the_smaller_lr_and_skips_failures():
    assert choose_lr({1e-3: 0.9, 3e-3: 0.9, 1e-2: 0.5}, True) == 1e-3
    assert choose_lr({1e-3: 0.6, 3e-3: None, 1e-2: 0.7}, True) == 1e-2
    assert choose_lr({1e-3: 2.1, 3e-3: 2.0}, False) == 3e-3  # lower is better (bits per character)
    assert choose_lr({1e-3: None, 3e-3: float("nan")}, True) is None


def test_the_grid_runs_on_seed_0_then_the_seeds_at_the_chosen_lr_and_a_rerun_runs_nothing(tmp_path, code):
    table = tiny_table()
    exit_code, lines = run_once(tmp_path, code, table)
    assert exit_code == 0 and lines[-1].startswith("[11/11]") and "done" in lines[-1]
    jobs = starts(tmp_path)
    assert len(jobs) == 11
    # Every seed-0 job of a setting (the edge rule's 3e-2 for rnn too) starts before that setting's other seeds,
    # which run at the chosen lr only.
    for cell, chosen, grid in (("rnn", "1e-2", 4), ("gru", "1e-3", 3)):
        mine = [j for j in jobs if j["model"] == cell]
        assert [j["seed"] for j in mine[:grid]] == ["0"] * grid
        assert {(j["optimizer.lr"], j["seed"]) for j in mine[grid:]} == {(chosen, "1"), (chosen, "2")}
    assert [j["optimizer.lr"] for j in jobs if j["model"] == "rnn"][3] == "3e-2"
    recs = records.read_table(tmp_path / "docs", "tiny")
    assert len(recs) == 11 and {r["provenance"]["commit"] for r in recs} == {COMMIT}
    assert {r["status"] for r in recs} == {"completed", "diverged"}
    # Done jobs are not run again, from the run dirs or, on another machine, from the committed records alone.
    assert run_once(tmp_path, code, table)[0] == 0 and len(starts(tmp_path)) == 11
    import shutil

    shutil.rmtree(tmp_path / "out" / "tiny")
    assert run_once(tmp_path, code, table)[0] == 0 and len(starts(tmp_path)) == 11


def test_records_of_another_commit_or_device_do_not_count_but_another_cpu_model_does(tmp_path, code):
    """A job done at the commit on another CPU model is done (a later session may get another machine); one of
    another commit or on a GPU is not. Times are predicted from this machine's records first."""
    table = tiny_table(("gru",))

    def record(lr, commit, machine, seconds=10.0):
        return records.record_from_results(table, table.settings[0], lr, 0, {
            "status": "completed", "step": 6, "eval_metrics": {"accuracy": 0.9}, "wall_seconds": seconds,
            "provenance": {"commit": commit, "machine": machine}}, "x")

    stand_in = {"platform": "cpu", "cpu": "Stand-in", "cpu_cores": 2}
    other_cpu = {"platform": "cpu", "cpu": "Another CPU", "cpu_cores": 4}
    gpu = {"platform": "gpu", "cpu": "Stand-in", "cpu_cores": 2, "accelerator": "NVIDIA H200", "accelerator_count": 1}
    records.merge(tmp_path / "docs", table, [record(1e-3, "f" * 40, stand_in), record(3e-3, COMMIT, gpu),
                                             record(1e-2, COMMIT, other_cpu, seconds=50.0)])
    ledger = runner.Ledger([table], tmp_path / "out", tmp_path / "docs", COMMIT, KIND, MACHINE)
    assert [(j.lr, j.seed) for j in runner.make_plan(ledger, [table]).done] == [(1e-2, 0)]
    assert [records.kind_of(r) for r in records.read_table(tmp_path / "docs", "tiny")] == ["CPU", "NVIDIA H200 x1", "CPU"]
    predict = runner.job_seconds(ledger, [table])
    assert predict(runner.Job(table, table.settings[0], 3e-3, 0)) == 10.0  # this machine's record, not the other's


def test_the_plan_says_when_nothing_is_left_and_when_no_time_is_known(tmp_path):
    """A plan with no record to predict from says so; one with every job recorded says nothing is left."""
    table = tiny_table(("gru",))
    ledger = runner.Ledger([table], tmp_path / "out", tmp_path / "docs", COMMIT, KIND, MACHINE)
    lines = []
    runner.print_plan(ledger, [table], 2, say=lines.append)
    assert lines[-1].startswith("predicted: unknown")
    results = {"status": "completed", "step": 6, "eval_metrics": {"accuracy": 0.5}, "wall_seconds": 10.0,
               "provenance": {"commit": COMMIT, "machine": {"platform": "cpu", "cpu": "Stand-in", "cpu_cores": 2}}}
    records.merge(tmp_path / "docs", table, [records.record_from_results(table, table.settings[0], lr, seed, results, "x")
                                             for lr, seed in [*((lr, 0) for lr in table.lrs), (1e-3, 1), (1e-3, 2)]])
    lines.clear()
    ledger = runner.Ledger([table], tmp_path / "out", tmp_path / "docs", COMMIT, KIND, MACHINE)  # reads the records
    runner.print_plan(ledger, [table], 2, say=lines.append)
    assert lines[-2].startswith("5 jobs: 5 recorded, 0 ready") and lines[-1] == "predicted: nothing left to run"


def test_a_cell_new_to_a_table_is_predicted_from_its_other_tables_scaled_by_the_cells_that_ran_both(tmp_path):
    """rnn took 10 s a job in one table and 40 s in a longer one (same steps): gru, at 100 s in the first and not yet
    run in the second, is predicted at 400 s there (not at 100 s, as the steps alone would say)."""
    short = tiny_table()
    long = Table("tiny2", "Longer", "zoo_parity", (), short.settings, short.lrs, 3, 6, "accuracy", True, 32, (32,), "")

    def record(table, cell, seconds):
        setting = next(s for s in table.settings if s.cell == cell)
        return records.record_from_results(table, setting, 1e-3, 0, {
            "status": "completed", "step": 6, "eval_metrics": {"accuracy": 0.5}, "wall_seconds": seconds,
            "provenance": {"commit": COMMIT, "machine": {"platform": "cpu", "cpu": "Stand-in", "cpu_cores": 2}}}, "x")

    records.merge(tmp_path / "docs", short, [record(short, "rnn", 10.0), record(short, "gru", 100.0)])
    records.merge(tmp_path / "docs", long, [record(long, "rnn", 40.0)])
    ledger = runner.Ledger([short, long], tmp_path / "out", tmp_path / "docs", COMMIT, KIND, MACHINE)
    predict = runner.job_seconds(ledger, [short, long])
    assert predict(runner.Job(long, long.settings[1], 1e-3, 0)) == 400.0
    assert predict(runner.Job(long, long.settings[0], 3e-3, 0)) == 40.0


def test_the_time_left_is_predicted_from_the_records_own_times_as_the_plan_predicts(tmp_path, code):
    """Before any job of this call has finished, the status line predicts from the records on this kind of
    machine: rnn's grid took 100 s a job, so its 2 seeds and gru's 3 + 2 jobs (no record of gru: the table's
    median) take 700 s on one slot, and 400 s on two (gru's grid beside rnn's seeds, then gru's seeds)."""
    table = tiny_table()
    results = {"status": "completed", "step": 6, "eval_metrics": {"accuracy": 0.5}, "wall_seconds": 100.0,
               "provenance": {"commit": COMMIT, "machine": {"platform": "cpu", "cpu": "Stand-in", "cpu_cores": 2}}}
    records.merge(tmp_path / "docs", table, [records.record_from_results(table, table.settings[0], lr, 0, results, "x")
                                             for lr in table.lrs])
    ledger = runner.Ledger([table], tmp_path / "out", tmp_path / "docs", COMMIT, KIND, MACHINE)
    plan = runner.make_plan(ledger, [table])
    for parallel, expected in ((1, 700.0), (2, 400.0)):
        assert runner.seconds_to_go(ledger, [table], plan, runner.Executor(code, tmp_path / "out", [], pin=False), [],
                                    parallel, []) == expected
    exit_code, lines = run_once(tmp_path, code, table, parallel=1)
    assert exit_code == 0 and lines[0] == "[3/10] 0 running, 7 left, 0 failed, about 12 min left"


@pytest.mark.slow("end-to-end")
def test_a_deadline_stops_jobs_with_sigterm_and_the_next_run_resumes(tmp_path, code, monkeypatch):
    monkeypatch.setenv("FAKE_SECONDS", "30")
    table = tiny_table(("gru",))
    started = time.time()
    exit_code, lines = run_once(tmp_path, code, table, deadline=time.time() + 3)
    assert exit_code == 75 and time.time() - started < 20
    assert any(line.startswith("deadline: stopping 2 running jobs") for line in lines)
    stopped = [json.loads(p.read_text())["status"] for p in (tmp_path / "out" / "tiny").glob("*/*/results.json")]
    assert stopped == ["preempted", "preempted"]
    assert records.read_table(tmp_path / "docs", "tiny") == []  # a preempted job is no record
    monkeypatch.setenv("FAKE_SECONDS", "0")
    assert run_once(tmp_path, code, table)[0] == 0
    assert len(records.read_table(tmp_path / "docs", "tiny")) == 5


def test_before_a_deadline_only_jobs_predicted_to_end_in_time_start(tmp_path, code):
    """Records of another commit on this kind of machine say an rnn job takes 1 s and a gru job 1,000 s: with a
    minute to go, rnn's grid and seeds run, gru's jobs are left (nothing started is stopped), and the runner says so
    and ends as a deadline does. A gru job stopped at step 3 of 6 is predicted at half its time from there (with the margin)."""
    table = tiny_table()
    for cell, seconds in (("rnn", 1.0), ("gru", 1000.0)):
        setting = next(s for s in table.settings if s.cell == cell)
        results = {"status": "completed", "step": 6, "eval_metrics": {"accuracy": 0.5}, "wall_seconds": seconds,
                   "provenance": {"commit": "f" * 40, "machine": {"platform": "cpu", "cpu": "Stand-in",
                                                                  "cpu_cores": 2}}}
        records.merge(tmp_path / "docs", table, [records.record_from_results(table, setting, lr, 0, results, "x")
                                                 for lr in table.lrs])
    exit_code, lines = run_once(tmp_path, code, table, deadline=time.time() + 60)
    assert exit_code == 75
    assert {j["model"] for j in starts(tmp_path)} == {"rnn"} and len(starts(tmp_path)) == 6  # the edge rule's 3e-2 too
    assert lines[-1].startswith("deadline in ") and "the 3 ready jobs are predicted to end after it" in lines[-1]
    assert not any("stopping" in line for line in lines)

    ledger = runner.Ledger([table], tmp_path / "out", tmp_path / "docs", COMMIT, KIND, MACHINE)
    stopped = runner.Job(table, table.settings[1], 1e-3, 0)
    stopped.run_dir(tmp_path / "out").mkdir(parents=True)
    (stopped.run_dir(tmp_path / "out") / "results.json").write_text(json.dumps({"status": "preempted", "step": 3}))
    assert runner.seconds_from_here(ledger, stopped, 1000.0) == 500.0
    units = [runner.Unit([stopped])]
    assert runner.split_by_deadline(ledger, [table], units, 500.0 * runner.DEADLINE_MARGIN) == (units, [])
    assert runner.split_by_deadline(ledger, [table], units, 499.0 * runner.DEADLINE_MARGIN) == ([], units)


@pytest.mark.slow("end-to-end")
def test_sigterm_to_the_runner_stops_its_jobs_as_a_deadline_does(tmp_path, code, monkeypatch):
    """A runner killed politely (a scheduler's SIGTERM, Ctrl-C) leaves no job running unseen: they save, and the
    next run resumes them."""
    import signal
    import threading

    monkeypatch.setenv("FAKE_SECONDS", "30")
    table = tiny_table(("gru",))
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.time()
    exit_code, lines = run_once(tmp_path, code, table)
    assert exit_code == 75 and time.time() - started < 20
    assert any(line.startswith("SIGTERM: stopping 2 running jobs") for line in lines)
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler again
    stopped = [json.loads(p.read_text())["status"] for p in (tmp_path / "out" / "tiny").glob("*/*/results.json")]
    assert stopped == ["preempted", "preempted"]


def test_a_runner_that_fails_stops_its_jobs_and_restores_the_signal_handlers(tmp_path, code, monkeypatch):
    """An error in the runner's loop (here: its third plan) leaves no job running unseen and the caller's
    handlers in place: the jobs get SIGTERM, save and end preempted, and the error reaches the caller."""
    import signal

    monkeypatch.setenv("FAKE_SECONDS", "30")
    plans, make_plan = [], runner.make_plan

    def failing_plan(*args, **kwargs):
        plans.append(1)
        if len(plans) == 3:  # the status line's, the first round's (which starts the jobs), then this
            raise RuntimeError("planted")
        return make_plan(*args, **kwargs)

    monkeypatch.setattr(runner, "make_plan", failing_plan)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="planted"):
        run_once(tmp_path, code, tiny_table(("gru",)))
    assert signal.getsignal(signal.SIGTERM) is before
    deadline = time.time() + 20
    results = lambda: [p for p in (tmp_path / "out" / "tiny").glob("*/*/results.json")]  # noqa: E731
    while time.time() < deadline and len(results()) < 2:
        time.sleep(0.2)
    assert sorted(json.loads(p.read_text())["status"] for p in results()) == ["preempted", "preempted"]


def test_the_population_executor_runs_a_settings_grid_then_its_seeds_as_one_program_each(tmp_path):
    table = tiny_table(("gru",))
    job = runner.Job(table, table.settings[0], 1e-3, 0)
    executor = runner.PopulationExecutor(tmp_path, tmp_path / "out", ["hidden_dim=8"], pin=False)
    grid, = executor.units(runner.grid_jobs(table, table.settings[0]))
    cmd, _ = executor.command(grid)
    assert "-m" in cmd and "optimizer.lr=1e-3,3e-3,1e-2" in cmd and "seed=0" in cmd and "hidden_dim=8" in cmd
    assert "hydra/launcher=population" in cmd and f"hydra.sweep.dir={job.run_dir(tmp_path / 'out').parent.resolve()}" in cmd
    seeds, = executor.units(runner.seed_jobs(table, table.settings[0], 3e-3))
    cmd, _ = executor.command(seeds)
    assert "optimizer.lr=3e-3" in cmd and "seed=1,2" in cmd
    # Hydra names each member's run dir as the processes executor does.
    assert "hydra.sweep.subdir=lr${optimizer.lr}_seed${seed}" in cmd and protocol.job_dirname(3e-3, 1) == "lr0.003_seed1"


def test_the_page_is_built_from_the_records_alone_and_again_byte_for_byte(tmp_path, code):
    table = tiny_table()
    assert run_once(tmp_path, code, table)[0] == 0
    docs = tmp_path / "docs"
    first = page.build(docs, {"tiny": table})[0]
    assert first == page.build(docs, {"tiny": table})[0]
    assert f"Commit `{COMMIT[:12]}` on {KIND}" in first and "2 of 2 settings under the protocol" in first
    row = next(line for line in first.splitlines() if line.startswith("| gru |") and "±" in line)
    assert "| 0.9 ± 0 |" in row and "| 1e-3 | 3 | 1e-3 **0.9** / 3e-3 0.9 / 1e-2 0.5 |" in row
    rnn = next(line for line in first.splitlines() if line.startswith("| rnn |") and "±" in line)
    # rnn's 1e-2 beat a diverged 3e-3 at the grid's top: the edge rule tried 3e-2 (worse), so 1e-2 is inner now; gru's
    # 1e-3 is a tie, chosen by the rule, not a slope.
    assert "1e-3 0.6 / 3e-3 diverged / 1e-2 **0.7** / 3e-2 0.65" in rnn
    assert "| rnn | ✓ |" in first  # the coverage matrix
    assert "Stopped at the edge rule's bound" not in first and "Not final" not in first

    # gru's seeds 1 and 2 ran on another CPU model (a later session's machine): the table keeps them, names both
    # machines in its header, and each row's tokens/s says on which it was measured.
    path = records.records_dir(docs) / "tiny.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for r in lines:
        if r["setting"] == "gru" and r["seed"] > 0:
            r["provenance"]["machine"] = {"platform": "cpu", "cpu": "Other", "cpu_cores": 4}
            r["tokens_per_sec"] = 300.0
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    mixed = page.build(docs, {"tiny": table})[0]
    assert (f"Commit `{COMMIT[:12]}` on CPU, 2 machines (A = CPU (Stand-in, 2 cores), 9 jobs; B = CPU (Other, 4 cores), 2 jobs)"
            in mixed and "2 of 2 settings under the protocol" in mixed)
    assert "| 300 (B) |" in next(line for line in mixed.splitlines() if line.startswith("| gru |") and "±" in line)
    assert "| 100 (A) |" in next(line for line in mixed.splitlines() if line.startswith("| rnn |") and "±" in line)


def test_the_page_names_the_settings_stopped_at_the_bound_and_those_waiting_on_the_edge_rule():
    table = tiny_table(("rnn", "gru", "lstm"))

    def row(setting, scores):  # seed 0's score by lr (None: diverged); seeds 1 and 2 done at the best so far
        grid = {lr: {"lr": lr, "seed": 0, "status": "completed" if s is not None else "diverged",
                     "metrics": {"8": {"accuracy": s}}} for lr, s in scores.items()}
        seeds = [{"lr": lr, "seed": seed, "status": "completed", "metrics": {"8": {"accuracy": 0.5}}}
                 for seed in (1, 2) for lr in (max(scores, key=lambda k: scores[k] or 0),)]
        return page.rows_of(table, [dict(r, setting=setting) for r in [*grid.values(), *seeds]], [setting])[0]

    rows = [row("rnn", {1e-3: 0.9, 3e-3: 0.8, 1e-2: 0.1}), row("gru", {1e-3: 0.1, 3e-3: 0.5, 1e-2: 0.6, 3e-2: 0.7}),
            row("lstm", {1e-3: 0.1, 3e-3: 0.5, 1e-2: 0.6})]
    assert [(r.complete, r.provisional, r.lr) for r in rows] == [(False, True, 1e-3), (True, False, 3e-2),
                                                                 (False, True, 1e-2)]
    assert page.grid_ends(rows, table) == (
        "Stopped at the edge rule's bound (1e-4 to 3e-2): 1 of 3 settings chose an end of the lrs tried and scored "
        "better there than one lr in (gru); their best lr may lie beyond the bound.")
    assert page.edge_waiting(rows, table).endswith(
        ": rnn (best so far 1e-3, next 3e-4), lstm (best so far 1e-2, next 3e-2).")
    assert page.grid_ends(rows[2:], table) is None and page.edge_waiting(rows[1:2], table) is None
    # A row whose own grid is not done is in progress, neither final nor marked.
    partial = row("rnn", {1e-3: 0.9, 3e-3: 0.8})
    assert (partial.complete, partial.provisional, partial.lr, partial.choice.pending) == (False, False, None, (1e-2,))


def test_the_edge_rule_extends_stops_inside_stops_at_the_bound_keeps_ties_and_moves_the_choice():
    table = tiny_table()  # grid 1e-3, 3e-3, 1e-2 (higher is better), bound 1e-4 to 3e-2
    edge = protocol.edge_choice
    # The best is the top and strictly better than its neighbour: the next half decade out, then nothing else.
    assert edge(table, {1e-3: 0.1, 3e-3: 0.5, 1e-2: 0.6}).pending == (3e-2,)
    assert edge(table, {1e-3: 0.1, 3e-3: 0.5, 1e-2: 0.6}).lr is None  # no choice (and no seeds) until it has run
    # ... it ran and is worse: the choice is the now inner 1e-2; better: it is the bound, so the choice stops there.
    inner = edge(table, {1e-3: 0.1, 3e-3: 0.5, 1e-2: 0.6, 3e-2: 0.55})
    assert (inner.lr, inner.final, inner.at_bound, inner.lrs) == (1e-2, True, False, (1e-3, 3e-3, 1e-2, 3e-2))
    bound = edge(table, {1e-3: 0.1, 3e-3: 0.5, 1e-2: 0.6, 3e-2: 0.7})
    assert (bound.lr, bound.final, bound.at_bound) == (3e-2, True, True)
    # Downward, twice, to the bound: 1e-3 -> 3e-4 -> 1e-4.
    assert edge(table, {1e-3: 0.9, 3e-3: 0.5, 1e-2: 0.1}).pending == (3e-4,)
    assert edge(table, {1e-3: 0.9, 3e-3: 0.5, 1e-2: 0.1, 3e-4: 0.95}).pending == (1e-4,)
    low = edge(table, {1e-3: 0.9, 3e-3: 0.5, 1e-2: 0.1, 3e-4: 0.95, 1e-4: 0.97})
    assert (low.lr, low.at_bound) == (1e-4, True)
    # A tie at an end chose the smaller lr by rule, not by a slope: no extension. An inner best: none either.
    assert edge(table, {1e-3: 0.9, 3e-3: 0.9, 1e-2: 0.1}).lr == 1e-3
    assert edge(table, {1e-3: 0.5, 3e-3: 0.9, 1e-2: 0.1}).lrs == (1e-3, 3e-3, 1e-2)
    # A neighbour that diverged scores nothing: an end that converged is better than it.
    assert edge(table, {1e-3: 0.6, 3e-3: None, 1e-2: 0.7}).pending == (3e-2,)
    # The spacing is the grid's own: a two-point grid on the 1-3 ladder goes 3e-3 -> 1e-2; another grid, its ratio.
    assert protocol.lr_outward((1e-3, 3e-3), 3e-3, True) == 1e-2
    assert protocol.lr_outward((2e-3, 4e-3), 4e-3, True) == 8e-3 and protocol.lr_outward((2e-3, 4e-3), 2e-3, False) == 1e-3


def test_a_choice_the_edge_rule_moves_reruns_the_seeds_at_the_new_lr(tmp_path, code):
    """A table whose grid (1e-3, 3e-3) chose rnn's 1e-3 (3e-3 diverged) and ran its seeds there before the edge rule:
    1e-3 is an end and better than its neighbour, so seed 0 trains 3e-4 (better: the choice moves), then 1e-4 (worse:
    3e-4 is inner); seeds 1 and 2 run again at 3e-4, and the page reports those. The old seeds keep their records."""
    table = dataclasses.replace(tiny_table(("rnn",)), lrs=(1e-3, 3e-3))
    done = {"status": "completed", "step": 6, "wall_seconds": 1.0,
            "provenance": {"commit": COMMIT, "machine": {"platform": "cpu", "cpu": "Stand-in", "cpu_cores": 2}}}
    old = [records.record_from_results(table, table.settings[0], lr, seed, dict(done, eval_metrics={"accuracy": a}),
                                       "x") for lr, seed, a in ((1e-3, 0, 0.6), (3e-3, 0, None), (1e-3, 1, 0.6),
                                                                (1e-3, 2, 0.6))]
    old[1]["status"] = "diverged"
    records.merge(tmp_path / "docs", table, old)
    assert run_once(tmp_path, code, table)[0] == 0
    ran = [(j["optimizer.lr"], j["seed"]) for j in starts(tmp_path)]
    assert ran[:2] == [("3e-4", "0"), ("1e-4", "0")] and sorted(ran[2:]) == [("3e-4", "1"), ("3e-4", "2")]
    assert len(records.read_table(tmp_path / "docs", "tiny")) == 8  # every job kept, the old seeds too
    rnn = next(line for line in page.build(tmp_path / "docs", {"tiny": table})[0].splitlines()
               if line.startswith("| rnn |") and "±" in line)
    assert "| 3e-4 | 3 | 1e-4 0.5 / 3e-4 **0.8** / 1e-3 0.6 / 3e-3 diverged |" in rnn


def test_the_cli_refuses_bad_input_in_one_line(capsys):
    assert cli.main(["run", "core", "--", "steps=10"]) == 2
    assert "the protocol sets 'steps'" in capsys.readouterr().err
    assert cli.main(["run", "text", "--executor", "population"]) == 2
    assert "--executor population: text trains on text streams" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "core", "--deadline", "soon"])
    assert e.value.code == 2 and "--deadline: got 'soon'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "nosuch"])
    assert e.value.code == 2
    assert cli.main(["run", "core", "--partition", "debug"]) == 2  # a SLURM flag without --executor slurm
    assert "option '--partition' belongs to --executor slurm" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "core", "--executor", "slurm", "--gpus-per-node", "-1"])
    assert e.value.code == 2 and "--gpus-per-node: got '-1'" in capsys.readouterr().err


def test_the_core_suite_is_every_cell_on_four_tables_with_the_fixed_protocols():
    from rnnlab.cells import CELLS

    tables = protocol.suite_tables("core")
    assert [t.key for t in tables] == ["parity", "selective_copy", "mqar8", "s3", "parity_x4", "s3_x4"]
    checks, tables = tables[4:], tables[:4]
    assert [(c.base.key, c.steps) for c in checks] == [("parity", 8000), ("s3", 16000)]
    package_cells = {n for n, c in CELLS.items() if c.__module__.startswith("rnnlab.")}
    for table in tables:
        assert {s.cell for s in table.settings} == package_cells
        assert table.seeds == 3 and table.eval_lens[0] == table.train_len
    s3 = protocol.TABLES["s3"]
    assert s3.lrs == (1e-3, 3e-3) and s3.steps == 4000 and s3.metric == "sequence_accuracy"
    assert all(t.lrs == protocol.ZOOLOGY_LRS for t in tables if t.key != "s3")
    assert sum(len(t.settings) * t.jobs_per_setting() for t in tables) == 476


@pytest.mark.slow("long")
def test_every_table_s_job_composes_with_the_preset_it_names():
    """Every setting of every table, through `Table.job_overrides`: the preset gives a job's shape, the protocol its
    cell, keys, steps, lengths, lr and seed (the presets list none of them: tests/zoo/test_presets.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import train

    for table in protocol.TABLES.values():
        for setting in table.settings:
            overrides = table.job_overrides(setting, table.lrs[-1], table.seeds - 1)
            assert train.config_exit(overrides) == (0, ""), overrides


def test_the_committed_page_is_what_the_records_generate():
    docs = Path(__file__).resolve().parents[2] / "docs"
    assert (docs / "results.md").read_text() == page.build(docs, protocol.TABLES)[0], \
        "docs/results.md is generated: run `python -m rnnlab.zoo page`"


def test_a_text_table_chooses_on_validation_bpc_lower_is_better_and_reports_the_test_plays(tmp_path):
    table = Table("tinytext", "Tiny text", "zoo_text", (), (Setting("lstm"),), (1e-3, 3e-3), 3, 6, "bpc", False, 16, (),
                  "A stand-in text table.", choose_on="valid",
                  split_columns=(("valid", "bpc"), ("test", "bpc"), ("test", "bpc_reset")))
    assert not any(o.startswith("data.eval_seq_lens") for o in table.job_overrides(table.settings[0], 1e-3, 0))
    valid = {(1e-3, 0): 2.5, (3e-3, 0): 2.2, (3e-3, 1): 2.3, (3e-3, 2): 2.4}  # 3e-3 is chosen: lower is better

    def results(lr, seed):
        bpc = valid[(lr, seed)]
        return {"status": "completed", "step": 6, "eval_loss": bpc * 0.69, "eval_metrics": {"bpc": bpc, "bpc_reset": bpc + 0.1},
                "test_loss": 1.0, "test_bpc": bpc + 0.05, "test_bpc_reset": bpc + 0.2,
                "provenance": {"commit": COMMIT, "machine": {"platform": "cpu", "cpu": "Stand-in", "cpu_cores": 2},
                               "started_utc": "2026-12-01T00:00:00Z"}}

    new = [records.record_from_results(table, table.settings[0], lr, seed, results(lr, seed), f"j{i}")
           for i, (lr, seed) in enumerate(valid)]
    assert new[0]["metrics"]["valid"]["bpc"] == 2.5 and new[0]["metrics"]["test"] == {
        "loss": 1.0, "bpc": 2.55, "bpc_reset": 2.7}
    assert records.score(new[0], table) == 2.5
    records.merge(tmp_path, table, new)
    text = page.build(tmp_path, {"tinytext": table})[0]
    assert "| setting | bpc@valid | bpc@test | bpc_reset@test | lr | seeds | seed 0 @valid: lr value |" in text
    row = next(line for line in text.splitlines() if line.startswith("| lstm |") and "±" in line)
    # 3e-3 is the top of the grid and better than 1e-3: shown, marked not final, until the edge rule's 1e-2 has run.
    assert row.startswith("| lstm | 2.3 ± 0.1 | 2.35 ± 0.1 | 2.5 ± 0.1 | 3e-3 † | 3 | 1e-3 2.5 / 3e-3 **2.2** / "
                          "1e-2 not run |"), row
    assert "![" not in text  # no plot against length for a table of splits
    assert "0 of 1 settings under the protocol" in text and "lstm (best so far 3e-3, next 1e-2)" in text
    records.merge(tmp_path, table, [records.record_from_results(table, table.settings[0], 1e-2, 0, results(3e-3, 2),
                                                                "j9")])  # 2.4 at 1e-2: 3e-3 stays, now inner
    text = page.build(tmp_path, {"tinytext": table})[0]
    row = next(line for line in text.splitlines() if line.startswith("| lstm |") and "±" in line)
    assert "| 3e-3 | 3 | 1e-3 2.5 / 3e-3 **2.2** / 1e-2 2.4 |" in row and "1 of 1 settings under the protocol" in text
    assert "Not final" not in text


def test_the_page_deletes_plots_it_no_longer_draws_and_links_only_tables_it_shows(tmp_path, code):
    table = tiny_table()
    assert run_once(tmp_path, code, table)[0] == 0
    docs = tmp_path / "docs"
    (docs / "results_gone.png").write_bytes(b"a plot no record draws")
    (docs / "history.png").write_bytes(b"not the page's")
    empty = dataclasses.replace(tiny_table(("lstm",)), key="empty", title="Empty")  # no records: not on the page
    written = page.write(docs, {"tiny": table, "empty": empty})
    assert [p.name for p in written] == ["results.md", "results_tiny.png"]
    assert not (docs / "results_gone.png").exists() and (docs / "history.png").exists()
    text = (docs / "results.md").read_text()
    assert "[Tiny parity](#tiny-parity)" in text and "| cell | [Tiny parity](#tiny-parity) | Empty |" in text


def test_a_row_that_disagrees_or_agrees_partly_is_checked_at_4x_steps_every_seed_and_shown_beside_it(tmp_path, code):
    """A stand-in parity table: DeltaNet with [-1, 1] eigenvalues "solves parity" in its paper; here it solves the
    training length only (0.95 at 8, half of it at 16): "partly", so its budget check trains every seed at its chosen
    lr with 4x the steps; DeltaNet with [0, 1] agrees ("not parity") and is not checked."""
    table = dataclasses.replace(tiny_table(("deltanet",)), key="parity",
                                settings=(Setting("deltanet"), Setting("deltanet", (protocol.NEG,))))
    check = protocol.budget_check(table)
    assert (check.key, check.steps, check.base) == ("parity_x4", 24, table)
    ledger = runner.Ledger([table, check], tmp_path / "out", tmp_path / "docs", COMMIT, KIND, MACHINE)
    executor = runner.Executor(code, tmp_path / "out", [], pin=False)
    merged = lambda done: [records.merge(tmp_path / "docs", t, [r for r in done if r["table"] == t.key])  # noqa: E731
                           for t in (table, check)]
    assert runner.run(ledger, [table, check], executor, 2, float("inf"), say=lambda line: None, on_done=merged) == 0
    ran = [j for j in starts(tmp_path) if j["steps"] == "24"]
    assert sorted((j["model"], j.get("model.allow_neg_eigval"), j["optimizer.lr"], j["seed"]) for j in ran) == [
        ("deltanet", "true", "1e-3", str(seed)) for seed in range(3)]
    assert len(records.read_table(tmp_path / "docs", "parity_x4")) == 3
    text = page.build(tmp_path / "docs", {"parity": table, "parity_x4": check})[0]
    assert "| agrees? at 24 steps |" in text and "## Tiny parity at 4x steps" not in text
    neg = next(line for line in text.splitlines() if line.startswith("| deltanet model.allow_neg_eigval=true |"))
    assert "| partly: solved to 8, 0.475 at 16 | partly: solved to 8, 0.475 at 16 (0.95 at 8, 0.475 at 16) |" in neg
    plain = next(line for line in text.splitlines() if line.startswith("| deltanet |") and "±" in line)
    assert "| agrees | - |" in plain
    # The plan counts the check's jobs once its base rows are complete.
    lines = []
    runner.print_plan(ledger, [table, check], 2, say=lines.append)
    assert any("parity_x4: budget check of parity: 1 settings" in line and "= 3 jobs, 3 recorded" in line
               for line in lines)


def test_mqar_over_width_is_one_section_of_every_setting_at_each_width_with_its_plot(tmp_path):
    """Two stand-in width tables (H=16, 32): each row of the section is a setting's accuracy at the training length at
    each width (its own lr grid per width), then its state floats; a width a setting has not finished shows -."""
    widths = [dataclasses.replace(tiny_table(("gru", "deltanet")), key=f"w{w}", width=w, overrides=(f"hidden_dim={w}",))
              for w in (16, 32)]
    assert protocol.suite_tables("width")[0].width == 16 and [t.width for t in protocol.suite_tables("width")] == [
        16, 32, 64, 128]
    docs = tmp_path / "docs"
    for table in widths:
        for setting in table.settings:
            if table.width == 32 and setting.cell == "deltanet":
                continue  # not run yet at this width
            score = 0.9 if setting.cell == "deltanet" else 0.3 + table.width / 100
            jobs = [(lr, 0) for lr in (1e-3, 3e-3, 1e-2)] + [(3e-3, 1), (3e-3, 2)]
            records.merge(docs, table, [records.record_from_results(table, setting, lr, seed, {
                "status": "completed", "step": 6, "state_floats": table.width * (8 if setting.cell == "deltanet" else 1),
                "eval_by_len": {"8": {"accuracy": score if lr == 3e-3 else score - 0.1}},
                "provenance": {"commit": COMMIT, "machine": {"platform": "cpu", "cpu": "Stand-in", "cpu_cores": 2}}},
                "x") for lr, seed in jobs])
    text = page.build(docs, {t.key: t for t in widths})[0]
    assert "## MQAR over width" in text and "## Tiny parity" not in text and "## Coverage" not in text
    assert "| setting | accuracy@8, H=16 | accuracy@8, H=32 | state floats, H=16 | state floats, H=32 |" in text
    assert "| gru | 0.46 ± 0 | 0.62 ± 0 | 16 | 32 |" in text and "| deltanet | 0.9 ± 0 | - | 128 | - |" in text
    assert "width 16: commit `0123456789ab`, 2 of 2 settings; width 32: commit `0123456789ab`, 1 of 2" in text
    written = page.write(docs, {t.key: t for t in widths})
    assert [p.name for p in written] == ["results.md", "results_mqar8_width.png"]
