"""The run dirs of a zoo sweep or of scripts/zoo_queue.py as rows of docs/zoo_state_tracking.csv, the per-job CSV
scripts/results.py reads for the state-tracking protocol.

    python scripts/zoo_csv.py RUN_ROOT [RUN_ROOT ...] --out docs/zoo_state_tracking.csv \
        [--commit SHA] [--machine "2-core Intel Xeon VM"] [--date 2026-11-29]
    python scripts/results.py            # the page, with the S3 table from that CSV

Finds every job dir below each root as summarize.py does (a folder holding results.json, or `.hydra/overrides.yaml`
alone: a job still running or killed), and writes one row per job in results.py's layout: STATE_TRACKING_COLUMNS
(`task` as summarize.py names it, `word_problem group=s3`; the override `model`, else the config's model.cell; the
overrides `model.allow_neg_eigval` and `model.num_householder`, empty where the job left the config's value;
`steps` is results.json's `step`; `commit` from --commit), then `<metric>@<length>` for each length of results.json's `eval_by_len`, the task's headline metric
(summarize.headline_metric: sequence_accuracy for a word problem), then `machine` and `date` (empty: results.py says
"not recorded"). A job without a readable results.json keeps its row, status `missing` or `unreadable` and no
metrics, so a partial run shows. A job's id (`job`) is its dir relative to its root, e.g.
`zoo_state_tracking/state_tracking-s3_model-lstm/lr1e-3_seed0` under zoo_queue.py's --out: give the same root each
time. Where --out exists its rows of the same jobs are replaced and the others kept, rows sorted by job, so the
command can be rerun as a queue goes on. Exit code 0, or 1 if a root is not a folder, no job was found or --out has another layout
(nothing is written then).
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from pathlib import Path
from typing import Any

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # summarize.py, results.py and zoo_protocol.py beside this file, also when loaded by path
    sys.path.insert(0, HERE)

import results  # noqa: E402
import summarize  # noqa: E402
import zoo_protocol  # noqa: E402

OVERRIDE_COLUMNS = ("model.allow_neg_eigval", "model.num_householder")
WHERE_COLUMNS = ("machine", "date")  # results.py takes a row's own before its SOURCES table
METRIC_COLUMN = re.compile(r"(.+)@(\d+)")


def text(value: Any) -> str:
    """A CSV cell: None as empty, booleans as an override spells them, numbers as Python writes them."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def override(overrides: dict[str, str], key: str) -> str:
    """An override's value, booleans lower case: Hydra's sweeper writes a single value `True`, which would make
    another setting in results.py than `true`."""
    value = overrides.get(key, "")
    return value.lower() if value in ("True", "False") else value


def headline(result: dict[str, Any]) -> str | None:
    """The metric reported at each length, chosen as summarize.py's zoo table chooses it: the task's headline
    (summarize.headline_metric), else results.json's eval_metric_name, else the first metric that is not the loss."""
    seen = list(dict.fromkeys(k for v in (result.get("eval_by_len") or {}).values() for k in (v or {})))
    named = result.get("eval_metric_name")
    return (summarize.headline_metric(result.get("task"), seen) or (named if named in seen else None)
            or next((k for k in seen if k != "loss"), None))


def job_row(sweep: summarize.Sweep, i: int, commit: str, machine: str, date: str) -> dict[str, str]:
    """One job's row in results.py's state-tracking layout."""
    overrides, result = sweep.overrides[i], sweep.results[i]
    model = overrides.get("model") or summarize.lookup(sweep.configs[i], "model.cell") or ""
    row = {"job": sweep.name(i), "experiment": overrides.get("experiment", ""), "task": sweep.task_of(i) or "",
           "model": model, **{k: override(overrides, k) for k in OVERRIDE_COLUMNS},
           zoo_protocol.LR_KEY: overrides.get(zoo_protocol.LR_KEY, ""), zoo_protocol.SEED_KEY:
           overrides.get(zoo_protocol.SEED_KEY, ""), "status": text(result.get("status")) or "?",
           "steps": text(result.get("step")), "platform": text(result.get("platform")), "commit": commit,
           "num_params": text(result.get("num_params")), "tokens_per_sec": text(result.get("tokens_per_sec"))}
    metric = headline(result)
    if metric is not None:
        for n, values in (result.get("eval_by_len") or {}).items():
            row[f"{metric}@{n}"] = text((values or {}).get(metric))
    return row | {"machine": machine, "date": date}


def collect(roots: list[Path], commit: str, machine: str, date: str) -> list[dict[str, str]]:
    """Every job's row under the roots. A job id met under two roots (a queue's folder copied between machines)
    keeps the completed one, else the later root's: a copy where the job never finished does not hide its result."""
    rows: dict[str, dict[str, str]] = {}
    for root in roots:
        sweep = summarize.Sweep(root)
        for i in range(len(sweep.jobs)):
            row = job_row(sweep, i, commit, machine, date)
            kept = rows.get(row["job"])
            if kept is not None:
                print(f"zoo_csv: {row['job']} under more than one root", file=sys.stderr)
                if kept["status"] == zoo_protocol.OK and row["status"] != zoo_protocol.OK:
                    continue
            rows[row["job"]] = row
    return list(rows.values())


def read_existing(path: Path) -> list[dict[str, str]]:
    """The rows --out already holds; ValueError if its columns are not the state-tracking layout (another CSV)."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        missing = [c for c in results.STATE_TRACKING_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"{path} lacks the columns {', '.join(missing)}: not a {results.STATE_TRACKING_CSV}")
    return rows


def columns(rows: list[dict[str, str]]) -> list[str]:
    """STATE_TRACKING_COLUMNS, the metric columns by metric then length, any other column an earlier file had
    (kept, not dropped), then machine and date."""
    seen = list(dict.fromkeys(k for r in rows for k in r))
    metrics = sorted((k for k in seen if METRIC_COLUMN.fullmatch(k)),
                     key=lambda k: (METRIC_COLUMN.fullmatch(k)[1], int(METRIC_COLUMN.fullmatch(k)[2])))
    known = {*results.STATE_TRACKING_COLUMNS, *metrics, *WHERE_COLUMNS}
    return [*results.STATE_TRACKING_COLUMNS, *metrics, *(k for k in seen if k not in known), *WHERE_COLUMNS]


def write(path: Path, rows: list[dict[str, str]]) -> None:
    """The CSV, rows sorted by job, written whole at once: a rerun stopped midway leaves the old file."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns(rows), restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(sorted(rows, key=lambda r: r["job"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(out.getvalue())
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", type=Path, help="zoo_queue.py's --out, a sweep dir, or a folder of them")
    parser.add_argument("--out", type=Path, required=True, help="the CSV (docs/zoo_state_tracking.csv)")
    parser.add_argument("--commit", default="", help="the commit the jobs ran (default: empty, 'not recorded')")
    parser.add_argument("--machine", default="", help="where they ran (default: empty, 'not recorded')")
    parser.add_argument("--date", default="", help="when they ran (default: empty, 'not recorded')")
    args = parser.parse_args(argv)
    absent = [str(r) for r in args.roots if not r.is_dir()]
    if absent:  # a mistyped root would otherwise read as a root without jobs
        print(f"zoo_csv: not a folder: {', '.join(absent)}", file=sys.stderr)
        return 1
    try:
        existing = read_existing(args.out)
    except ValueError as e:
        print(f"zoo_csv: {e}", file=sys.stderr)
        return 1
    rows = collect(args.roots, args.commit, args.machine, args.date)
    if not rows:
        print(f"zoo_csv: no job dirs (with results.json or .hydra/overrides.yaml) under "
              f"{', '.join(map(str, args.roots))}", file=sys.stderr)
        return 1
    new = {r["job"] for r in rows}
    merged = [r for r in existing if r["job"] not in new] + rows
    write(args.out, merged)
    unfinished = sum(r["status"] != zoo_protocol.OK for r in rows)
    print(f"zoo_csv: {len(rows)} job(s), {unfinished} not completed; {args.out} holds {len(merged)} row(s) "
          f"({len(merged) - len(existing)} new)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
