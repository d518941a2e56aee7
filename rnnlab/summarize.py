"""Summarise a sweep: one table row per job, and plots that compare them.

    python -m rnnlab.summarize multirun/2026-01-01/12-00-00       # one sweep
    python -m rnnlab.summarize outputs                             # every run under a folder

(`python scripts/summarize.py ...` runs the same.)

Finds every job dir below the given folder (a folder holding `.hydra/overrides.yaml` or
`results.json`), reads its overrides, results.json and TensorBoard event files (with
TensorBoard's own EventAccumulator), and
  - prints a markdown table: the swept overrides, status, final eval loss and metric,
    the task's baseline loss, tokens/s, MFU and wall time; failed jobs (and jobs with
    no results.json: still running, or killed) are marked;
  - writes summary.md and summary.csv (every override, every result) to --out;
  - writes PNG plots to --out when matplotlib is installed (pip install -e ".[plots]"), drawn by
    rnnlab.summary_plots: loss_curves.png (train and eval loss of every job against step), and for each
    swept parameter P sweep_P.png (final eval metric and tokens/s against P).
--out defaults to the folder given. Exit code 0, or 2 (bad input) if no job was found.

The zoo's tables (each cell at its lr chosen under the protocol, by eval length) are `python -m rnnlab.zoo`'s:
its `page` writes docs/results.md.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from rnnlab.exit_codes import BAD_INPUT

OK = "completed"
SKIP_DIRS = {".hydra", "tensorboard", "checkpoints"}


def find_jobs(root: Path) -> list[Path]:
    """Job dirs below `root` (root itself for a single run), in job-number order."""
    found = [p.parent for p in root.rglob("results.json") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    found += [p.parent.parent for p in root.rglob(".hydra/overrides.yaml")]
    # A sweep's top level also has .hydra/ only when it is a run dir; multirun.yaml marks a sweep dir.
    jobs = {p for p in found if not (p / "multirun.yaml").exists()}

    def order(p: Path) -> tuple:
        num = re.match(r"(\d+)_", p.name)
        return (str(p.parent), int(num.group(1)) if num else math.inf, p.name)

    return sorted(jobs, key=order)


def parse_overrides(job: Path) -> dict[str, str]:
    """{'optimizer.lr': '0.001', ...} from .hydra/overrides.yaml (empty if there is none)."""
    path = job / ".hydra" / "overrides.yaml"
    if not path.exists():
        return {}
    items = yaml.safe_load(path.read_text()) or []
    pairs = (item.lstrip("+~").split("=", 1) for item in items if "=" in item)
    return {k: v for k, v in pairs if not k.startswith("hydra.")}


def read_results(job: Path) -> dict[str, Any]:
    path = job / "results.json"
    if not path.exists():
        return {"status": "missing"}
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {"status": "unreadable"}


def read_curves(job: Path) -> dict[str, list[tuple[int, float]]]:
    """{'train/loss': [(step, value), ...], 'eval/loss': ...} from the job's event files."""
    logdir = job / "tensorboard"
    if not logdir.is_dir():
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    tags = set(events.Tags().get("scalars", []))
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in ("train/loss", "eval/loss") if tag in tags}


def as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def short(text: str) -> str:
    """An override value for display: long floats to 4 significant digits (0.0039807 -> 0.003981)."""
    number = as_number(text)
    return format(number, ".4g") if number is not None and "." in text and len(text) > 7 else text


def natural(text: str) -> tuple:
    """Sort key: numbers by value, before other strings."""
    number = as_number(text)
    return (number is None, number or 0.0, text)


def fmt(value: Any, spec: str = ".4g") -> str:
    """A table cell: None as n/a, floats by `spec`; "," groups thousands of any number (tokens/s, params)."""
    if value is None:
        return "n/a"
    if spec == "," and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:,.0f}"
    return format(value, spec) if isinstance(value, float) else str(value)


class Sweep:
    def __init__(self, root: Path):
        self.root = root
        self.jobs = find_jobs(root)
        self.overrides = [parse_overrides(j) for j in self.jobs]
        self.results = [read_results(j) for j in self.jobs]
        self.curves: list[dict] | None = None
        keys = sorted({k for o in self.overrides for k in o})
        values = {k: {o.get(k) for o in self.overrides} for k in keys}
        self.swept = [k for k in keys if len(values[k]) > 1]  # keys whose value differs between jobs
        self.fixed = {k: next(iter(values[k])) for k in keys if len(values[k]) == 1 and None not in values[k]}
        # Jobs of more than one sweep (a folder of sweeps, or outputs/): labels then name the sweep dir.
        self.multi = len({self.sweep_of(i) for i in range(len(self.jobs))}) > 1

    def name(self, i: int) -> str:
        return str(self.jobs[i].relative_to(self.root)) if self.jobs[i] != self.root else self.root.name

    def sweep_of(self, i: int) -> str:
        """The job's sweep dir relative to the root ('.' for the root itself)."""
        return str(self.jobs[i].parent.relative_to(self.root)) if self.jobs[i] != self.root else "."

    def title(self) -> str:
        """The root for a figure title: its last two parts (multirun/DATE/TIME -> DATE/TIME)."""
        return "/".join(self.root.parts[-2:]) or self.root.resolve().name

    def completed(self, i: int) -> bool:
        return self.results[i].get("status") == OK

    @staticmethod
    def describe(pairs: Any) -> str:
        """'hidden_dim=64 lr=0.001' from (key, value) pairs: short keys and values for legends."""
        return " ".join(f"{k.split('.')[-1]}={short(v)}" for k, v in pairs)

    def label(self, i: int) -> str:
        """A short legend label: the swept overrides (with the sweep dir when there are several
        sweeps), else the job dir's name, which already names its sweep dir."""
        parts = self.describe((k, self.overrides[i][k]) for k in self.swept if k in self.overrides[i])
        if not parts:
            return self.name(i)
        return f"{self.sweep_of(i)}: {parts}" if self.multi else parts

    def param_axis(self, param: str, jobs: list[int]) -> tuple[bool, dict[str, float], list[tuple[float, str]]]:
        """How `param` is drawn: (numeric, x of each value, ticks as (x, label)). Numbers sit at
        their value with a tick at each swept value; anything else (model=rnn,lstm) is a category
        at 0, 1, ..., in natural order."""
        values = sorted({self.overrides[i][param] for i in jobs}, key=natural)
        numeric = bool(values) and all(as_number(v) is not None for v in values)
        x_of = {v: as_number(v) if numeric else float(n) for n, v in enumerate(values)}
        ticks = {x_of[v]: short(v) for v in reversed(values)}  # 1e-3 and 0.001: one tick
        return numeric, x_of, sorted(ticks.items())

    def headline(self) -> str:
        """The metric the figures compare: the task's first metric, else the eval loss."""
        return (self.metric_names() or ["loss"])[0]

    def final(self, i: int, metric: str) -> float | None:
        results = self.results[i]
        return results.get("eval_loss") if metric == "loss" else (results.get("eval_metrics") or {}).get(metric)

    def metric_names(self) -> list[str]:
        """The eval metrics the jobs' tasks report (results.json's `eval_metrics`), in order."""
        names: dict[str, None] = {}
        for r in self.results:
            names.update(dict.fromkeys(r.get("eval_metrics") or {}))
        return list(names)

    def rows(self) -> list[dict[str, Any]]:
        """Table rows (display strings) in job order; the best completed eval loss is starred."""
        done = [(r["eval_loss"], i) for i, r in enumerate(self.results) if r.get("status") == OK and r.get("eval_loss") is not None]
        best = min(done)[1] if done else None
        rows = []
        for i, r in enumerate(self.results):
            status = r.get("status", "?")
            if status != OK:
                status = f"**{status.upper()}**" + (f": {r['error']}" if r.get("error") else "")
            loss = fmt(r.get("eval_loss")) + (" (best)" if i == best else "")
            job, number = self.name(i), re.match(r"(\d+)_", self.jobs[i].name)
            if number and self.swept:  # <num>_<overrides>: the overrides are columns
                job = f"{self.sweep_of(i)}/{number.group(1)}" if self.multi else number.group(1)
            rows.append({
                "job": job,
                **{k: short(self.overrides[i].get(k, "")) for k in self.swept},
                "status": status, "eval loss": loss,
                **{f"eval {m}": fmt((r.get("eval_metrics") or {}).get(m)) for m in self.metric_names()},
                "baseline": fmt(r.get("baseline_loss")), "tokens/s": fmt(r.get("tokens_per_sec"), ","),
                "MFU": fmt(r.get("mfu"), ".2%"), "wall s": fmt(r.get("wall_seconds"), ".1f"),
            })
        return rows

    def markdown(self) -> str:
        rows = self.rows()
        head = list(rows[0])
        cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(cell(r[h]) for h in head) + " |" for r in rows]
        failed = sum(r.get("status") != OK for r in self.results)
        title = f"{len(self.jobs)} job(s) under {self.root}, {failed} not completed"
        common = " ".join(f"{k}={v}" for k, v in self.fixed.items())
        return "\n".join([title, *([f"common overrides: {common}"] if common else []), "", *lines])

    def csv(self) -> str:
        """Every job, every override and result."""
        keys = sorted({k for o in self.overrides for k in o})
        fields = ["status", "error", "eval_loss", "baseline_loss", "tokens_per_sec",
                  "mfu", "wall_seconds", "step", "num_params", "state_floats", "compile_seconds", "platform"]
        metrics = self.metric_names()
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["job", *keys, *fields, *(f"eval_{m}" for m in metrics)])
        for i, r in enumerate(self.results):
            writer.writerow([self.name(i), *(self.overrides[i].get(k, "") for k in keys), *(r.get(f, "") for f in fields),
                             *((r.get("eval_metrics") or {}).get(m, "") for m in metrics)])
        return out.getvalue()

    def read_curves(self) -> list[dict]:
        if self.curves is None:
            try:
                self.curves = [read_curves(j) for j in self.jobs]
            except ImportError:
                print("summarize: tensorboard is not installed, no loss curves", file=sys.stderr)
                self.curves = [{} for _ in self.jobs]
        return self.curves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="a sweep dir (multirun/DATE/TIME), a run dir, or a folder of them")
    parser.add_argument("--out", type=Path, help="where summary.md/csv and the PNGs go (default: ROOT)")
    parser.add_argument("--csv", action="store_true", help="print CSV instead of markdown")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    sweep = Sweep(args.root)
    if not sweep.jobs:
        print(f"summarize: no job dirs (with results.json or .hydra/overrides.yaml) under {args.root}", file=sys.stderr)
        return BAD_INPUT
    out = args.out or args.root
    out.mkdir(parents=True, exist_ok=True)
    table, table_csv = sweep.markdown(), sweep.csv()
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.csv").write_text(table_csv)
    print(table_csv if args.csv else table)
    optuna = args.root / "optimization_results.yaml"
    if optuna.exists() and not args.csv:
        best = yaml.safe_load(optuna.read_text())
        print(f"\nOptuna best: {best.get('best_value')} with {best.get('best_params')}")
    if not args.no_plots:
        try:
            from rnnlab.summary_plots import plot

            written = plot(sweep, out)
        except ImportError:
            print('summarize: matplotlib is not installed (pip install -e ".[plots]"): tables only', file=sys.stderr)
        else:
            print("\nplots: " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
