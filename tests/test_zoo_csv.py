"""scripts/zoo_csv.py turns zoo_queue.py's run dirs into rows of docs/zoo_state_tracking.csv that scripts/results.py
reads into its S3 and parity tables: the columns results.py expects, a job without results.json kept as `missing`,
and a rerun that replaces its jobs' rows and keeps the others. The run dirs are a few small files; no training."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from conftest import ROOT

S3_SLUG = "state_tracking-s3_model-deltaproduct_model.allow_neg_eigval-true"
PARITY_SLUG = "model-mamba_model.allow_neg_eigval-true"
LENGTHS = (16, 32, 64, 128)


@pytest.fixture
def scripts(monkeypatch):
    """scripts/zoo_csv.py and scripts/results.py as modules (results.py is the reader the CSV is for)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import results
    import zoo_csv

    return zoo_csv, results


def run_dir(out, experiment, slug, lr, seed, cell, extra, data, result=None):
    """A job dir as zoo_queue.py leaves it: <out>/<experiment>/<slug>/lr<lr>_seed<seed> with .hydra/overrides.yaml
    and config.yaml, and results.json (in train.py's keys) once the job has ended; None: still running."""
    job = out / experiment / slug / f"lr{lr}_seed{seed}"
    (job / ".hydra").mkdir(parents=True)
    overrides = [f"experiment={experiment}", f"model={cell}", *extra, f"optimizer.lr={lr}", f"seed={seed}",
                 "steps=4000"]
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    config = {"model": {"cell": cell}, "data": data, "optimizer": {"lr": float(lr)}}
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    if result is not None:
        (job / "results.json").write_text(json.dumps(result))
    return job


def result(task, metrics, by_len, tokens_per_sec=1234.5):
    """results.json as rnnlab/report.py writes it, the keys zoo_csv.py and summarize.py read."""
    return {"status": "completed", "error": None, "step": 4000, "task": task, "eval_loss": 0.1,
            "eval_metric_name": "accuracy", "eval_metrics": {m: by_len[min(by_len)][m] for m in metrics},
            "eval_by_len": {str(n): v for n, v in by_len.items()}, "num_params": 33000, "platform": "cpu",
            "tokens_per_sec": tokens_per_sec}


def s3_result(values):
    """A word problem's results: per-step accuracy above the headline sequence accuracy at every length."""
    by_len = {n: {"loss": 0.5, "accuracy": 0.9, "sequence_accuracy": v} for n, v in zip(LENGTHS, values)}
    return result("word_problem", ["accuracy", "sequence_accuracy"], by_len)


def s3_job(out, lr, seed, values):
    # Hydra's sweeper writes a single value as `True`: the CSV spells it `true`, as the other settings do.
    return run_dir(out, "zoo_state_tracking", S3_SLUG, lr, seed, "deltaproduct",
                   ["state_tracking=s3", "model.allow_neg_eigval=True"],
                   {"task": "word_problem", "group": "s3", "seq_len": 16},
                   None if values is None else s3_result(values))


def read(path):
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, {r["job"]: r for r in reader}


def test_rows_read_by_results_and_a_rerun_replaces_its_jobs(scripts, tmp_path):
    """An S3 setting's grid and a seed still running, and a parity job beside them: results.py reads each row's lr,
    seed, setting, metric by length, machine, date and commit; the seed's result, from another machine's copy of the
    folder, replaces its row alone, and the S3 table then holds the setting under the protocol."""
    zoo_csv, results = scripts
    queue, out = tmp_path / "zq", tmp_path / "docs" / results.STATE_TRACKING_CSV
    s3_job(queue, "1e-3", 0, (0.5, 0.25, 0.0, 0.0))
    s3_job(queue, "3e-3", 0, (1.0, 0.75, 0.5, 0.25))
    s3_job(queue, "3e-3", 1, None)  # started, no results.json yet
    by_len = {n: {"loss": 0.2, "accuracy": a} for n, a in zip(LENGTHS, (1.0, 0.9, 0.8, 0.7))}
    run_dir(queue, "zoo_parity", PARITY_SLUG, "1e-3", 0, "mamba", ["model.allow_neg_eigval=true"],
            {"task": "parity", "seq_len": 16}, result("parity", ["accuracy"], by_len))
    assert zoo_csv.main([str(queue), "--out", str(out), "--commit", "abc1234", "--machine", "2-core Intel Xeon VM",
                         "--date", "2026-11-29"]) == 0

    fields, rows = read(out)
    metrics = [f"{m}@{n}" for m in ("accuracy", "sequence_accuracy") for n in LENGTHS]
    assert fields == [*results.STATE_TRACKING_COLUMNS, *metrics, "machine", "date"]
    assert list(rows) == sorted(rows) and len(rows) == 4
    first = rows[f"zoo_state_tracking/{S3_SLUG}/lr1e-3_seed0"]
    expected = {
        "experiment": "zoo_state_tracking", "task": "word_problem group=s3", "model": "deltaproduct",
        "model.allow_neg_eigval": "true", "model.num_householder": "", "optimizer.lr": "1e-3", "seed": "0",
        "status": "completed", "steps": "4000", "platform": "cpu", "commit": "abc1234", "num_params": "33000",
        "tokens_per_sec": "1234.5", "sequence_accuracy@32": "0.25", "accuracy@32": "",
        "machine": "2-core Intel Xeon VM", "date": "2026-11-29"}
    assert {k: first[k] for k in expected} == expected
    missing = rows[f"zoo_state_tracking/{S3_SLUG}/lr3e-3_seed1"]
    assert missing["status"] == "missing" and missing["task"] == "word_problem group=s3"
    assert all(missing[m] == "" for m in metrics) and missing["steps"] == ""
    parity = rows[f"zoo_parity/{PARITY_SLUG}/lr1e-3_seed0"]
    assert parity["task"] == "parity" and parity["accuracy@128"] == "0.7" and parity["sequence_accuracy@16"] == ""

    jobs = results.read_csv(out)
    s3 = sorted((j for j in jobs if j.task == "s3"), key=lambda j: (j.lr, j.seed))
    assert [(j.lr, j.seed, j.status) for j in s3] == [(1e-3, "0", "completed"), (3e-3, "0", "completed"),
                                                      (3e-3, "1", "missing")]
    setting = (("model", "deltaproduct"), ("model.allow_neg_eigval", "true"), ("experiment", "zoo_state_tracking"))
    assert {j.setting for j in s3} == {setting}
    assert s3[1].by_len == {16: 1.0, 32: 0.75, 64: 0.5, 128: 0.25} and s3[2].by_len == {}
    assert {(j.machine, j.date, j.commit) for j in s3} == {("2-core Intel Xeon VM", "2026-11-29", "abc1234")}
    assert [j.task for j in jobs if dict(j.setting)["experiment"] == "zoo_parity"] == ["parity"]
    # The job still running fails its lr (zoo_protocol): 1e-3 is chosen until seed 1 at 3e-3 completes.
    (row,) = results.rows_of(s3, results.TASKS["s3"])
    assert row.choice.lr == 1e-3

    # The job ends on another machine; its copy of the queue's folder holds it alone. Its row is replaced, the
    # others (and their machine and commit) are kept.
    other = tmp_path / "copy"
    s3_job(other, "3e-3", 1, (1.0, 0.5, 0.5, 0.0))
    assert zoo_csv.main([str(other), "--out", str(out), "--commit", "def5678"]) == 0
    fields, again = read(out)
    done = again[f"zoo_state_tracking/{S3_SLUG}/lr3e-3_seed1"]
    assert done["status"] == "completed" and done["sequence_accuracy@32"] == "0.5" and done["commit"] == "def5678"
    assert done["machine"] == "" and list(again) == list(rows)
    assert {k: again[k] for k in rows if k != done["job"]} == {k: v for k, v in rows.items() if k != done["job"]}
    s3 = [j for j in results.read_csv(out) if j.task == "s3"]
    assert [j.machine for j in s3 if j.seed == "1"] == [results.NOT_RECORDED]
    (row,) = results.rows_of(s3, results.TASKS["s3"])
    assert row.choice.lr == 3e-3 and row.stats(32)[0] == pytest.approx(0.625) and row.outside is None
    text, plotted = results.page(results.read_jobs(out.parent), out.parent)  # the page, as results.py makes it
    assert "s3" in plotted and "| deltaproduct allow_neg_eigval=true | 1 ± 0 | 0.625 ± 0.18 |" in text


def test_another_layout_is_not_overwritten(scripts, tmp_path):
    """--out that is another CSV (a summary.csv given by mistake) is left as it is; a root without jobs, or one
    that is not there, writes nothing."""
    zoo_csv, _ = scripts
    s3_job(tmp_path / "zq", "1e-3", 0, (1.0, 0.5, 0.25, 0.0))
    out = tmp_path / "zoo_parity_grid.csv"
    out.write_text("job,experiment,model,optimizer.lr,seed,status,eval_loss\n")
    assert zoo_csv.main([str(tmp_path / "zq"), "--out", str(out)]) == 1
    assert out.read_text() == "job,experiment,model,optimizer.lr,seed,status,eval_loss\n"
    (tmp_path / "empty").mkdir()
    assert zoo_csv.main([str(tmp_path / "empty"), "--out", str(tmp_path / "new.csv")]) == 1
    assert zoo_csv.main([str(tmp_path / "absent"), "--out", str(tmp_path / "new.csv")]) == 1
    assert not (tmp_path / "new.csv").exists()
