"""One results page for the zoo: docs/results.md and its plots, generated from the committed per-job CSVs.

    python scripts/results.py            # writes docs/results.md and docs/results_<table>.png

Reads every docs/zoo_*.csv, each column layout through its own reader into one record per job (`Job`: task,
setting, lr, seed, status, the headline metric by eval length, platform, commit, machine, tokens/s), and puts
each task's settings under the zoo's protocol (scripts/zoo_protocol.py, as summarize.py does): the lr grid on seed
0, the lr chosen on the training length's headline metric only (ties to the smaller lr), then the other seeds at
that lr; a table row is the mean ± sd over those seeds at every eval length, the grid's seed-0 values beside it.
A setting whose grid is not whole, or whose chosen lr has one seed, is outside the protocol: its row goes to a
separate, labelled table. Tables whose rows exist only as markdown in the benchmark history are listed, not
copied. The page is never edited by hand: tests/test_results_page.py regenerates it and fails if it differs.
Options: --docs (where the CSVs are, default docs/), --out (where the page and plots go, default --docs),
--no-plots. Exit code 0, or 1 if a CSV has a column layout no reader knows.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import math
import re
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # zoo_protocol.py and summarize.py beside this file, also when it is loaded by path
    sys.path.insert(0, HERE)

import zoo_protocol  # noqa: E402
from summarize import fmt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGE = "results.md"
HISTORY = "benchmarks-history.md"
NOT_RECORDED = "not recorded"
LR_GRID = (3e-4, 1e-3, 3e-3, 1e-2)  # the zoo presets' optimizer.lr sweep (conf/experiment/zoo_*.yaml)
STATE_TRACKING_CSV = "zoo_state_tracking.csv"
# The columns docs/zoo_state_tracking.csv will hold (S3 word problem and parity jobs), one row per job as its
# results.json and overrides give it: `task` as summarize.py names a task (`parity`, `word_problem group=s3`), the
# overrides that set a setting apart as their own columns (empty where the job left the config's value), then
# `<metric>@<eval length>` for every eval length (sequence_accuracy@16 ... @128 for a word problem, accuracy@16
# ... @128 for parity). `machine` and `date` may follow; a row without them says "not recorded".
STATE_TRACKING_COLUMNS = ("job", "experiment", "task", "model", "model.allow_neg_eigval", "model.num_householder",
                          "optimizer.lr", "seed", "status", "steps", "platform", "commit", "num_params",
                          "tokens_per_sec")


@dataclasses.dataclass(frozen=True)
class Task:
    """One table of the page: the jobs of one task (and pair count), trained at `train_len`."""

    key: str
    title: str
    metric: str  # the headline metric, chosen on and reported
    train_len: int
    about: str  # what the jobs are, in a sentence
    grid: tuple[float, ...] = LR_GRID  # the protocol's lr grid on seed 0


TASKS = {t.key: t for t in [
    Task("parity", "Parity", "accuracy", 16, "`experiment=zoo_parity`: trained on every length 2-16, evaluated at "
         "16, 32, 64 and 128; H=64, 2 layers, 2,000 steps. Chance 0.5."),
    Task("selective_copy", "Selective copying", "accuracy", 32, "`experiment=zoo_selective_copy`: 4 of 8 symbols "
         "among noise, trained at 32, evaluated at 32, 64 and 128; H=64, 2 layers, 3,000 steps."),
    *(Task(f"mqar{n}", f"MQAR, {n} pairs", "accuracy", 64, f"`experiment=zoo_mqar data.num_pairs={n}`: 64 symbols, "
           "trained at 64, evaluated at 64 and 128; H=64, 2 layers, no MLP, 2,000 steps. "
           f"Knowing the values without their keys scores 1/{n}.") for n in (4, 8, 16)),
    Task("s3", "S3 word problem", "sequence_accuracy", 16, "`experiment=zoo_state_tracking state_tracking=s3`: "
         "trained at 16, evaluated at 16, 32, 64 and 128; sequence accuracy (every prefix product right); 4,000 "
         "steps, the protocol fixed in issue 65: the lr grid 1e-3 / 3e-3.", (1e-3, 3e-3)),
    *(Task(f"hybrid_mqar{n}", f"Hybrid stacks: MQAR, {n} pairs", "accuracy", 64, "`experiment=zoo_hybrid "
           f"data.num_pairs={n}`: 4-layer stacks (`hybrid=`), H=64, no MLP, trained at 64, evaluated at 64, 128 "
           "and 256; 2,000 steps.") for n in (4, 8, 16)),
    Task("hybrid_selective_copy", "Hybrid stacks: selective copying", "accuracy", 32, "`experiment="
         "zoo_hybrid_selective_copy`: the hybrid zoo's 4-layer stacks, trained at 32, evaluated at 32, 64 and 128; "
         "3,000 steps."),
]}
# (experiment, task as summarize.py names it) -> a TASKS key; MQAR's key takes the pair count.
ROUTES = {("zoo_parity", ""): "parity", ("zoo_state_tracking", "parity"): "parity",
          ("zoo_selective_copy", ""): "selective_copy", ("zoo_mqar", ""): "mqar",
          ("zoo_state_tracking", "word_problem group=s3"): "s3", ("zoo_hybrid", ""): "hybrid_mqar",
          ("zoo_hybrid_selective_copy", ""): "hybrid_selective_copy"}


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a CSV's jobs ran, quoted from the benchmarks section that produced it (the CSVs record neither
    machine nor date): machine by the job's platform ("" for every platform), date by table key ("" for all)."""

    machines: dict[str, str]
    dates: dict[str, str]
    section: str  # its heading in benchmarks-history.md


SOURCES = {
    "zoo_parity_grid.csv": Source({"": "2-core Intel Xeon VM"}, {"": "2026-11-26"},
                                  "Zoo protocol: parity, 13 cells at their best lr (2026-11-26)"),
    "zoo_selective_copy_grid.csv": Source(
        {"cpu": "2-core Intel Xeon VM", "gpu": "NVIDIA H200"}, {"": "2026-11-26"},
        "Zoo protocol: selective copying, all 13 cells at their best lr (2026-11-26)"),
    "zoo_selective_copy_xlstm_rwkv7.csv": Source(
        {"": "2-core AMD EPYC VM"}, {"": "2026-11-27"},
        "Selective copying and MQAR: sLSTM, mLSTM and RWKV-7 under the protocol (2026-11-27, tenth session, issue 51)"),
    "zoo_mqar_xlstm_rwkv7.csv": Source(
        {"": "2-core AMD EPYC VM"}, {"mqar8": "2026-11-27", "": "2026-11-28"},
        "Selective copying and MQAR: sLSTM, mLSTM and RWKV-7 under the protocol (2026-11-27, tenth session, issue 51)"),
    "zoo_hybrid_mqar16.csv": Source(
        {"cpu": "2-core AMD EPYC VM", "gpu": "NVIDIA H100"}, {"": "2026-11-28"},
        "Hybrid zoo under the protocol: MQAR at 16 pairs (2026-11-28, eleventh session, issue 52)"),
    "zoo_hybrid_selective_copy.csv": Source(
        {"": "2-core AMD EPYC VM"}, {"": "2026-11-28"},
        "Hybrid zoo under the protocol: selective copying (2026-11-28, thirteenth session, issue 52)"),
    "zoo_hybrid_mqar8.csv": Source(
        {"": "2-core AMD EPYC VM"}, {"": "2026-11-28"},
        "Hybrid zoo under the protocol: MQAR at 8 pairs (2026-11-28, fourteenth and fifteenth sessions, issue 52)"),
    "zoo_hybrid_mqar4.csv": Source(
        {"": "2-core AMD EPYC VM"}, {"": "2026-11-28"},
        "Hybrid zoo under the protocol: MQAR at 4 pairs, five stacks (2026-11-28, fifteenth and sixteenth sessions, "
        "issue 52)"),
}
# Tables of the benchmark history that no per-job CSV holds: (its section, what is missing).
NOT_GENERATED = [
    ("Zoo protocol: parity, 13 cells at their best lr (2026-11-26)",
     "accuracy at 32, 64 and 128: zoo_parity_grid.csv keeps each job's training-length accuracy only"),
    ("Zoo protocol: selective copying, all 13 cells at their best lr (2026-11-26)",
     "accuracy at 64 and 128: zoo_selective_copy_grid.csv keeps each job's training-length accuracy only; "
     "Mamba's own-block row (2-core AMD EPYC VM) has no CSV"),
    ("MQAR: the current table (issue 41, 2026-11-26 to 2026-11-27)",
     "every row but sLSTM's, mLSTM's and RWKV-7's: numbers copied from the sessions' sections"),
    ("State tracking: the switch, DeltaProduct and the state-tracking zoo (2026-11-27, issue 49)",
     "parity with and without the switch (one lr, 3 seeds), the one-lr, one-seed S3, A5 and mod-5 subset, "
     "S3 and A5 with a longer schedule"),
    ("xLSTM and RWKV-7: parity and the S3 word problem (2026-11-27, issue 51)",
     "sLSTM, mLSTM and RWKV-7 on parity (grid and 3 seeds), and their one-lr S3, A5 and mod-5 rows"),
    ("Hybrid zoo: a one-lr pilot on MQAR at 8 pairs (2026-11-27, issue 52)", "the one-lr, one-seed pilot"),
]


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of a CSV, whatever its layout: the record every table is built from."""

    source: str  # the CSV's file name
    name: str
    task: str  # a TASKS key; otherwise what the job ran, for the note on rows no table takes
    setting: tuple[tuple[str, str], ...]  # the overrides that set it apart, the cell first
    lr: float
    seed: str
    status: str
    by_len: dict[int, float]  # the task's headline metric by eval length
    platform: str
    commit: str
    machine: str
    date: str
    tokens_per_sec: float | None


def number(text: str | None) -> float | None:
    try:
        value = float(text or "")
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def route(experiment: str, task: str = "", pairs: str = "") -> str:
    """The table a job belongs to (a TASKS key), or what it ran where no table takes it."""
    name = ROUTES.get((experiment, task), ROUTES.get((experiment, ""), ""))
    if name.endswith("mqar"):
        name += pairs
    return name if name in TASKS else " ".join(p for p in (experiment, task, pairs and f"pairs={pairs}") if p)


def by_length(row: dict[str, str], metric: str) -> dict[int, float]:
    """{eval length: value} from a row's `<metric>@<length>` columns."""
    found = (re.fullmatch(rf"{re.escape(metric)}@(\d+)", k) for k in row)
    return {int(m.group(1)): v for m in found if m and (v := number(row[m.group(0)])) is not None}


def job(source: str, row: dict[str, str], task: str, experiment: str, setting: dict[str, str], lr: str, seed: str,
        by_len: dict[int, float]) -> Job:
    """A Job, its machine and date from the row where it has them, else from SOURCES, else "not recorded". The
    experiment is part of the setting: the same cell under another preset (parity in zoo_state_tracking) is
    another row."""
    where = SOURCES.get(source, Source({}, {}, ""))
    platform = row.get("platform") or ""
    machine = row.get("machine") or where.machines.get(platform) or where.machines.get("") or NOT_RECORDED
    date = row.get("date") or where.dates.get(task) or where.dates.get("") or NOT_RECORDED
    setting = {**setting, "experiment": experiment}
    return Job(source, row["job"], task, tuple((k, v) for k, v in setting.items() if v), float(lr), seed,
               row.get("status") or "?", by_len, platform, row.get("commit") or NOT_RECORDED, machine, date,
               number(row.get("tokens_per_sec")))


def read_summary(source: str, row: dict[str, str]) -> Job:
    """summarize.py's summary.csv (zoo_parity_grid.csv, zoo_selective_copy_grid.csv): the overrides as columns
    between `job` and `status`, and the training length's metrics only, as `eval_<metric>`."""
    keys = list(row)
    overrides = {k: row[k] for k in keys[1:keys.index("status")]}
    experiment = overrides.pop("experiment", "")
    task = route(experiment)
    lr, seed = overrides.pop(zoo_protocol.LR_KEY), overrides.pop(zoo_protocol.SEED_KEY)
    spec = TASKS.get(task)
    value = number(row.get(f"eval_{spec.metric}")) if spec else None
    return job(source, row, task, experiment, overrides, lr, seed, {spec.train_len: value} if value is not None else {})


def read_queue(source: str, row: dict[str, str]) -> Job:
    """The xLSTM and RWKV-7 CSVs: the job's overrides as one space-separated `overrides` column."""
    overrides = dict(o.split("=", 1) for o in row["overrides"].split())
    pairs, experiment = overrides.pop("data.num_pairs", ""), overrides.pop("experiment", "")
    task = route(experiment, pairs=pairs)
    lr, seed = overrides.pop(zoo_protocol.LR_KEY), overrides.pop(zoo_protocol.SEED_KEY)
    metric = TASKS[task].metric if task in TASKS else "accuracy"
    return job(source, row, task, experiment, overrides, lr, seed, by_length(row, metric))


def read_hybrid(source: str, row: dict[str, str]) -> Job:
    """The hybrid zoo's CSVs: the stack as `hybrid`, the pair count as `num_pairs` (MQAR's files only: no column
    names the experiment), and any other override in the job's folder name (zoo_queue.py's slug:
    `hybrid-gdn3_window1_data.num_pairs-8_model.time_scan-sequential/lr3e-3_seed0`)."""
    pairs = row.get("num_pairs", "")
    experiment = "zoo_hybrid" if pairs else "zoo_hybrid_selective_copy"
    task = route(experiment, pairs=pairs)
    folder = row["job"].split("/")[0]
    extra = {k: v for k, v in re.findall(r"(?:^|_)([a-z][A-Za-z]*(?:\.[A-Za-z_]+)+)-([^_]+)", folder)
             if k != "data.num_pairs"}
    metric = TASKS[task].metric if task in TASKS else "accuracy"
    return job(source, row, task, experiment, {"hybrid": row["hybrid"], **extra}, row["lr"], row["seed"],
               by_length(row, metric))


def read_results(source: str, row: dict[str, str]) -> Job:
    """STATE_TRACKING_COLUMNS (docs/zoo_state_tracking.csv): a column per override that sets a setting apart."""
    task = route(row["experiment"], row.get("task") or "", row.get("data.num_pairs") or "")
    setting = {"model": row["model"], **{k: row[k] for k in row if "." in k and "@" not in k
                                          and k not in (zoo_protocol.LR_KEY, "data.num_pairs")}}
    metric = TASKS[task].metric if task in TASKS else "accuracy"
    return job(source, row, task, row["experiment"], setting, row[zoo_protocol.LR_KEY], row["seed"],
               by_length(row, metric))


# Each column layout by a column only it has, tried in order (a summary.csv has no `commit`, whatever it adds).
LAYOUTS = [("hybrid", read_hybrid), ("overrides", read_queue), ("commit", read_results), ("eval_loss", read_summary)]


def read_csv(path: Path) -> list[Job]:
    """Every job of one CSV, through the reader its columns call for; ValueError for a layout none knows."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0]) if rows else set()
    reader = next((read for column, read in LAYOUTS if column in columns), None)
    if reader is None:
        raise ValueError(f"{path.name}: no reader for its columns ({', '.join(sorted(columns))})")
    return [reader(path.name, row) for row in rows]


def read_jobs(docs: Path) -> list[Job]:
    """Every job of docs/zoo_*.csv, files in name order."""
    return [j for path in sorted(docs.glob("zoo_*.csv")) for j in read_csv(path)]


@dataclasses.dataclass
class Row:
    """One setting of a table under the protocol's rule, inside it (`outside` None) or not (why not)."""

    setting: tuple[tuple[str, str], ...]
    jobs: list[Job]  # every job of the setting
    choice: zoo_protocol.Choice  # its LrResult.jobs index `jobs`
    outside: str | None

    @property
    def chosen(self) -> list[Job]:
        return [self.jobs[i] for i in self.choice.best.jobs] if self.choice.best else []

    def stats(self, n: int) -> tuple[float | None, float | None]:
        return zoo_protocol.mean_and_spread([j.by_len.get(n) for j in self.chosen])


def same_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def outside_protocol(choice: zoo_protocol.Choice, jobs: list[Job], grid: tuple[float, ...] = LR_GRID) -> str | None:
    """Why a setting is outside the protocol (None: inside): its seed-0 grid lacks an lr of `grid`, every lr
    failed, or the chosen lr has a single seed."""
    seed0 = [g.lr for g in choice.grid if any(jobs[i].seed == "0" for i in g.jobs)]
    if len(choice.grid) == 1:
        seeds = len(choice.grid[0].jobs)
        return f"one lr, {seeds} seeds" if seeds > 1 else "one lr, one seed"
    missing = [lr for lr in grid if not any(same_lr(lr, x) for x in seed0)]
    if missing:
        return f"seed 0 at {len(grid) - len(missing)} of the grid's {len(grid)} lrs"
    if choice.best is None:
        return "every lr failed"
    return "one seed" if len(choice.best.jobs) < 2 else None


def rows_of(jobs: list[Job], task: Task) -> list[Row]:
    """The task's settings (first-seen order), each at the lr zoo_protocol chooses on the training length."""
    keys = list(dict.fromkeys(k for j in jobs for k, _ in j.setting))
    overrides = [dict(j.setting) | {zoo_protocol.LR_KEY: repr(j.lr), zoo_protocol.SEED_KEY: j.seed} for j in jobs]
    results = [{"status": j.status, "eval_metrics": {task.metric: j.by_len.get(task.train_len)}} for j in jobs]
    swept = [*keys, *zoo_protocol.PROTOCOL_KEYS]
    rows = []
    for choice in zoo_protocol.settings(overrides, results, [math.nan] * len(jobs), swept, task.metric):
        members = sorted(i for g in choice.grid for i in g.jobs)
        local = {i: n for n, i in enumerate(members)}
        for g in choice.grid:  # job numbers among all the task's jobs -> among the setting's
            g.jobs = [local[i] for i in g.jobs]
        mine = [jobs[i] for i in members]
        rows.append(Row(mine[0].setting, mine, choice, outside_protocol(choice, mine, task.grid)))
    return rows


def lr_text(lr: float) -> str:
    """3e-4, 1e-2: the presets' spelling."""
    mantissa, exponent = f"{lr:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def label(setting: tuple[tuple[str, str], ...], shown_experiment: bool) -> str:
    """The cell (or stack) and the other overrides that set the row apart, by their last key part."""
    parts = [v if k in ("model", "hybrid") else f"{k.split('.')[-1]}={v}" for k, v in setting
             if k != "experiment" or shown_experiment]
    return " ".join(parts)


# What the papers report for a setting, beside its row (tasks parity and s3), as docs/benchmarks-history.md's
# "What the papers report" states them (recalled from the papers, not re-read: their arguments, not their tables).
SWITCH_CELLS = ("mamba", "mamba2", "deltanet", "gated_deltanet", "deltaproduct", "rwkv7")
DIAGONAL = ("mamba", "mamba2")  # diagonal (or scalar) transitions: they commute


def finding(task_key: str, setting: tuple[tuple[str, str], ...]) -> str:
    """The papers' finding for a parity or S3 setting, in a phrase ("" where none is recalled)."""
    return claim(task_key, setting)[0]


def claim(task_key: str, setting: tuple[tuple[str, str], ...]) -> tuple[str, bool | None]:
    """(the papers' finding for a parity or S3 setting, whether it says the model solves the task at every
    length (True) or not beyond the training length (False); ("", None) where none is recalled)."""
    keys = dict(setting)
    cell, switch = keys.get("model", ""), keys.get("model.allow_neg_eigval") == "true"
    householders = int(keys.get("model.num_householder", 2 if cell == "deltaproduct" else 1))
    if cell == "lstm":
        return ("Merrill et al.: any length" if task_key == "s3" else "Deletang et al.: any length"), True
    if cell == "slstm":
        return "Beck et al.: state tracking (memory mixing)", True
    if cell == "mlstm":
        return "Beck et al.: no state tracking (no memory mixing)", False
    if cell not in SWITCH_CELLS:
        return "", None
    if not switch:
        return "Grazzi et al.: not with [0, 1] eigenvalues", False
    if task_key == "parity":
        return "Grazzi et al.: parity with [-1, 1]", True
    if cell in DIAGONAL:
        return "Grazzi et al.: no (diagonal transitions commute; S3 does not)", False
    if cell == "rwkv7":
        return "", None
    if householders >= 2:
        return f"Siems et al.: S3 in one layer from n_h = 2 (here {householders})", True
    return "Siems et al.: one layer needs n_h >= 2; Grazzi et al.: more layers help", False


SOLVED = 0.9  # a length counts as solved where the seeds' mean accuracy reaches this


def verdict(row: Row, task: Task, lengths: list[int]) -> str:
    """Whether the row agrees with its papers' claim (`claim`): a claim that the model solves the task holds
    where every evaluated length is solved (mean >= SOLVED), one that it does not where the longest is not."""
    expect = claim(task.key, row.setting)[1]
    means = {n: row.stats(n)[0] for n in lengths}
    if expect is None or any(means[n] is None for n in lengths) or max(lengths) <= task.train_len:
        return "-"  # no claim, or only the training length recorded: the claims are about longer ones
    longest, solved = max(lengths), [n for n in lengths if means[n] >= SOLVED]
    if not expect:
        return "agrees" if means[longest] < SOLVED else f"disagrees: {fmt(means[longest])} at {longest}"
    if means[longest] >= SOLVED and len(solved) == len(lengths):
        return "agrees"
    seeds = sum(1 for j in row.chosen if (j.by_len.get(task.train_len) or 0) >= SOLVED)
    if means[task.train_len] >= SOLVED:
        return f"partly: solved to {max(solved)}, {fmt(means[longest])} at {longest}"
    return f"disagrees: {fmt(means[task.train_len])} at {task.train_len} ({seeds} of {len(row.chosen)} seeds solve it)"


def joined(values: list[str]) -> str:
    return ", ".join(dict.fromkeys(sorted(values)))


def grid_cell(row: Row, task: Task) -> str:
    """Seed 0's training-length value at each lr of the task's grid (then any other lr), the chosen lr's in bold."""
    cells = []
    seed0 = {}
    for g in row.choice.grid:
        for i in g.jobs:
            if row.jobs[i].seed == "0":
                seed0[g.lr] = row.jobs[i]
    extra = [lr for lr in seed0 if not any(same_lr(lr, x) for x in task.grid)]
    for lr in [*task.grid, *extra]:
        found = next((j for x, j in seed0.items() if same_lr(lr, x)), None)
        if found is None:
            text = "not run"
        elif found.status != zoo_protocol.OK or task.train_len not in found.by_len:
            text = found.status
        else:
            text = fmt(found.by_len[task.train_len])
        chosen = row.choice.best is not None and same_lr(lr, row.choice.lr)
        cells.append(("" if lr in task.grid else f"{lr_text(lr)}: ") + (f"**{text}**" if chosen else text))
    return " / ".join(cells)


def value_cell(row: Row, n: int) -> str:
    mean, spread = row.stats(n)
    if mean is None:
        return NOT_RECORDED
    return fmt(mean) + (f" ± {spread:.2g}" if spread is not None else "")


def table(rows: list[Row], task: Task, outside: bool) -> list[str]:
    """A markdown table of the rows: mean ± sd at each eval length, lr, seeds, the grid, where and when."""
    lengths = sorted({n for r in rows for j in r.chosen for n in j.by_len} | {task.train_len})
    experiments = {dict(r.setting).get("experiment") for r in rows}
    grid = " / ".join(lr_text(lr) for lr in task.grid)
    papers = task.key in ("parity", "s3")
    head = ["setting", *(["why outside"] * outside),
            *(f"{task.metric}@{n}" + (" (train)" if n == task.train_len else "") for n in lengths),
            "lr", "seeds", f"seed 0 @{task.train_len}: {grid}", *(["the papers", "agrees?"] * papers), "tokens/s",
            "machine",
            "date", "commit", "jobs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        rate = zoo_protocol.mean_and_spread([j.tokens_per_sec for j in r.chosen])[0]
        cells = [label(r.setting, len(experiments) > 1), *([r.outside] * outside),
                 *(value_cell(r, n) for n in lengths), lr_text(r.choice.lr) if r.choice.best else "none",
                 str(len(r.chosen)), grid_cell(r, task), *([finding(task.key, r.setting) or "-", verdict(r, task, lengths)] * papers),
                 fmt(rate, ",") if rate is not None else NOT_RECORDED,
                 *(joined([getattr(j, key) for j in r.jobs]) for key in ("machine", "date", "commit")),
                 ", ".join(f"[{s}]({s})" for s in dict.fromkeys(j.source for j in r.jobs))]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def history_link(section: str) -> str:
    return f"[{section}]({HISTORY}#{slug(section)})"


def plot(rows: list[Row], task: Task, path: Path) -> None:
    """The task's protocol rows: the metric against eval length (log 2 axis), mean with sd error bars, a line
    per setting. Fixed size and dpi, matplotlib's default style whatever the local matplotlibrc, and no
    pyplot state: the same CSVs and matplotlib draw the same pixels."""
    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from summary_plots import fixed_ticks, styles

    with matplotlib.style.context("default"):
        fig = Figure(figsize=(8.0, 4.2), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        lengths = sorted({n for r in rows for j in r.chosen for n in j.by_len})
        for i, (r, style) in enumerate(zip(rows, styles(matplotlib, len(rows)))):
            xs = [n for n in lengths if r.stats(n)[0] is not None]
            dodge = 2 ** (0.03 * (i - (len(rows) - 1) / 2))  # a line's error bars beside, not on, the others'
            ax.errorbar([n * dodge for n in xs], [r.stats(n)[0] for n in xs], yerr=[r.stats(n)[1] or 0.0 for n in xs],
                        marker="o", capsize=3, label=f"{label(r.setting, False)} (lr {lr_text(r.choice.lr)})", **style)
        ax.set_xscale("log", base=2)
        fixed_ticks(ax, [(n, str(n)) for n in lengths])
        ax.axvline(task.train_len, color="0.6", linestyle=":", linewidth=1)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("eval length (dotted: training length)")
        ax.set_ylabel(f"{task.metric}: mean ± sd over seeds")
        ax.set_title(f"{task.title}, each setting at its chosen lr", fontsize=10)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        fig.savefig(path, dpi=100, metadata={"Software": f"matplotlib {matplotlib.__version__}"})


def plot_name(task: Task) -> str:
    return f"results_{task.key}.png"


def section(task: Task, rows: list[Row], docs: Path) -> list[str]:
    """The task's table of protocol rows and its plot, or a line saying there are none yet."""
    inside = [r for r in rows if r.outside is None]
    lines = [f"## {task.title}", "", task.about, ""]
    if inside:
        lines += [f"{len(inside)} setting(s) under the protocol, each at the lr its seed-0 grid chose on "
                  f"{task.metric}@{task.train_len}; mean ± sd over the seeds at that lr.", "",
                  *table(inside, task, outside=False), "", f"![{task.title}]({plot_name(task)})"]
        if task.key in ("parity", "s3"):
            lines += ["", "The papers' column: what Grazzi et al. (2025), Siems et al. (2025), Merrill et al. (2024), "
                      "Deletang et al. (2023) and Beck et al. (2024) report for such a model, as recalled in "
                      "[the history file](" + HISTORY + "#" + slug("The state-tracking zoo at CPU scale: a one-lr, one-seed subset") + "), not "
                      "re-read: their arguments, not their tables; where a row disagrees, the row is the measurement. "
                      f"\"agrees?\": a claim that the model solves the task holds where the seeds' mean reaches {SOLVED} at "
                      "every evaluated length, one that it does not where the longest stays below it; \"partly\": "
                      "solved at the training length but not at every longer one."]
        return lines
    reasons = collections.Counter(r.outside for r in rows)
    why = (f"{len(rows)} setting(s) have rows, all outside the protocol ("
           + ", ".join(f"{reason}: {n}" for reason, n in reasons.items())
           + "; [Outside the protocol](#outside-the-protocol))" if rows else "no rows")
    if task.key == "s3" and not (docs / STATE_TRACKING_CSV).exists():
        why = (f"{STATE_TRACKING_CSV} is not committed yet. Its columns, one row per job: "
               + ", ".join(f"`{c}`" for c in STATE_TRACKING_COLUMNS)
               + ", then `sequence_accuracy@16` to `@128` (parity's rows: `accuracy@16` to `@128`)")
    return [*lines, f"{task.title.split(' word')[0]}: no protocol rows yet: {why}."]


def page(jobs: list[Job], docs: Path) -> tuple[str, dict[str, list[Row]]]:
    """The page's markdown and, by task key, the protocol rows each plot draws."""
    tables = {key: rows_of([j for j in jobs if j.task == key], task) for key, task in TASKS.items()}
    unrouted = sorted({f"{j.task} ({j.source})" for j in jobs if j.task not in TASKS})
    lines = [
        "# Results: the zoo under its protocol", "",
        "Generated by `python scripts/results.py` from the per-job CSVs `docs/zoo_*.csv`; never edited by hand "
        "(tests/test_results_page.py regenerates it and fails if it differs). Each setting (a cell or stack and the "
        "overrides that set it apart) ran the lr grid " + " / ".join(lr_text(lr) for lr in LR_GRID) + " on seed 0 "
        "(S3: 1e-3 / 3e-3); "
        "the lr is chosen on the training length's headline metric only, ties to the smaller lr "
        "(scripts/zoo_protocol.py); seeds 1 and 2 ran at that lr. A row is the mean ± sd over the seeds at the "
        "chosen lr at each eval length, with seed 0's training-length value at every lr of the grid beside it (the "
        "chosen one in bold). A setting with one lr, one seed or part of the grid is outside the protocol: its row "
        "is in [Outside the protocol](#outside-the-protocol), never in a task's table. Where a CSV does not record "
        "the commit or the machine the table says so; machines and dates are quoted from the benchmark section "
        "that produced each CSV ([Sources](#sources)). The reading of each table, its caveats (blocks, forms, "
        "machines shared) and the papers beside it are in those sections, now in [the history file](" + HISTORY
        + ").", ""]
    for key, task in TASKS.items():
        lines += [*section(task, tables[key], docs), ""]
    lines += ["## Outside the protocol", "",
              "Settings measured with one lr, one seed or part of the grid: each at the lr the protocol's rule picks "
              "among what ran, labelled with why it is not a protocol row. Not comparable with the tables above.", ""]
    for key, task in TASKS.items():
        outside = [r for r in tables[key] if r.outside is not None]
        if outside:
            lines += [f"### {task.title}: outside the protocol", "", *table(outside, task, outside=True), ""]
    if unrouted:
        lines += ["Rows no table takes (their task has no table here): " + "; ".join(unrouted) + ".", ""]
    lines += ["## Not yet generated: no per-job CSV", "",
              "Tables of the benchmark history whose rows exist only as markdown (numbers copied by hand, or per-job "
              "values not kept): not on this page until their jobs are in a CSV.", ""]
    lines += [f"- {history_link(s)}: {what}." for s, what in NOT_GENERATED]
    lines += ["", "## Sources", ""]
    for path in sorted(docs.glob("zoo_*.csv")):
        where = SOURCES.get(path.name)
        if where is None:
            lines.append(f"- [{path.name}]({path.name}): machine, date and commit as its columns record them.")
            continue
        machines = ", ".join(f"{m} ({p})" if p else m for p, m in where.machines.items())
        dates = ", ".join(f"{d} ({TASKS[t].title})" if t else d for t, d in where.dates.items())
        lines.append(f"- [{path.name}]({path.name}): {machines}; {dates}; commit not recorded; "
                     f"{history_link(where.section)}.")
    plotted = {key: [r for r in rows if r.outside is None] for key, rows in tables.items()}
    return "\n".join(lines) + "\n", {k: v for k, v in plotted.items() if v}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=Path, default=DOCS, help="where the zoo_*.csv files are (default docs/)")
    parser.add_argument("--out", type=Path, help="where results.md and the plots go (default: --docs)")
    parser.add_argument("--no-plots", action="store_true", help="the page only")
    args = parser.parse_args(argv)
    try:
        jobs = read_jobs(args.docs)
    except ValueError as e:
        print(f"results: {e}", file=sys.stderr)
        return 1
    out = args.out or args.docs
    out.mkdir(parents=True, exist_ok=True)
    text, plotted = page(jobs, args.docs)
    (out / PAGE).write_text(text)
    if not args.no_plots:
        for key, rows in plotted.items():
            plot(rows, TASKS[key], out / plot_name(TASKS[key]))
    print(f"results: {out / PAGE}, {len(plotted)} plot(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
