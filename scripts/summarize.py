"""Summarise a sweep: one table row per job, and plots that compare them.

    python scripts/summarize.py multirun/2026-01-01/12-00-00      # one sweep
    python scripts/summarize.py outputs                            # every run under a folder

Finds every job dir below the given folder (a folder holding `.hydra/overrides.yaml` or
`results.json`), reads its overrides, results.json and TensorBoard event files (with
TensorBoard's own EventAccumulator), and
  - prints a markdown table: the swept overrides, status, final eval loss and metric,
    the task's baseline loss, tokens/s, MFU and wall time; failed jobs (and jobs with
    no results.json: still running, or killed) are marked;
  - writes summary.md and summary.csv (every override, every result) to --out;
  - when jobs report `eval_by_len` (data.eval_seq_lens, the experiment=zoo_<task> presets), prints
    and writes zoo_table.md: a row per cell (model.cell), the headline eval metric at each eval length,
    parameters and tokens/s; when those jobs span several tasks (experiment=zoo_state_tracking: results.json's
    `task`, with a word problem's data.group and modular arithmetic's data.modulus), a section per task, each
    with its own training and eval lengths, headline metric (`headline_metric`) and lr choices;
  - writes PNG plots to --out when matplotlib is installed (pip install -e ".[plots]"), drawn by
    summary_plots.py: loss_curves.png (train and eval loss of every job against step), for each
    swept parameter P sweep_P.png (final eval metric and tokens/s against P), and with
    `eval_by_len` zoo_<metric>_by_len.png (the metric against eval length, a line per cell), or for
    several tasks zoo_tasks_by_len.png (a panel per task, a line per setting).
--out defaults to the folder given. Exit code 0, or 1 if no job was found.
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # summary_plots.py beside this file, also when it is loaded by path
    sys.path.insert(0, HERE)

import zoo_protocol  # noqa: E402

OK = "completed"
SWEEP_KEY = "sweep"  # a zoo setting's sweep dir, where the root holds several sweeps
SKIP_DIRS = {".hydra", "tensorboard", "checkpoints"}
CELL_KEYS = ("model", "model.cell")
# The data keys that make a task's instance another task (its own table): a word problem's group, the modulus.
TASK_KEYS = {"word_problem": ("group",), "modular_arithmetic": ("modulus",)}


def headline_metric(task: str | None, metrics: list[str]) -> str | None:
    """The metric a zoo table reports for `task`, if the jobs report it; None: the task's own first metric.

    A word problem's is `sequence_accuracy` (every prefix product of the sequence right), not its
    per-step `accuracy`. At an eval length L past the training length T the per-step mean counts the
    first T steps, which lie inside the training range, and guesses right 1/|G| of the rest: a model
    that tracks the state to T and no further scores T/L + (1 - T/L)/|G| (0.27 for S3 at 8x), a curve
    that falls smoothly like partial generalisation where there is none. Sequence accuracy is the
    fraction of sequences whose state was tracked through all L steps, chance about |G|^-(L-1): the
    same question parity and modular arithmetic ask of their one target (there, accuracy is it). The
    lr is chosen on the same metric at the training length; results.json keeps both at every length."""
    preferred = {"word_problem": "sequence_accuracy"}.get(task or "")
    return preferred if preferred in metrics else None


def lookup(config: dict[str, Any], key: str) -> str | None:
    """A dotted key's value in a job's composed config as an override would spell it (true, 3), or None
    where the config lacks it or holds an interpolation (`${hidden_dim}`) or a container."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, bool):
        return str(node).lower()
    if isinstance(node, (int, float, str)) and not (isinstance(node, str) and "${" in node):
        return str(node)
    return None


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


def read_config(job: Path) -> dict[str, Any]:
    """The job's composed config (.hydra/config.yaml, interpolations unresolved); {} if there is none."""
    path = job / ".hydra" / "config.yaml"
    try:
        return yaml.safe_load(path.read_text()) or {} if path.exists() else {}
    except yaml.YAMLError:
        return {}


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
        self.configs = [read_config(j) for j in self.jobs]
        self.curves: list[dict] | None = None
        self.origin = list(range(len(self.jobs)))  # each job's index in the sweep read from root (see `part`)
        self._index()

    def _index(self) -> None:
        keys = sorted({k for o in self.overrides for k in o})
        values = {k: {o.get(k) for o in self.overrides} for k in keys}
        self.swept = [k for k in keys if len(values[k]) > 1]  # keys whose value differs between jobs
        self.fixed = {k: next(iter(values[k])) for k in keys if len(values[k]) == 1 and None not in values[k]}
        # Jobs of more than one sweep (a folder of sweeps, or outputs/): labels then name the sweep dir.
        self.multi = len({self.sweep_of(i) for i in range(len(self.jobs))}) > 1

    def part(self, indices: list[int]) -> Sweep:
        """These jobs alone (one task's, of a zoo of several), as a sweep of their own: its swept keys are
        those that vary among them; `origin` maps its job numbers back to this sweep's."""
        other = copy.copy(self)
        for field in ("jobs", "overrides", "results", "configs", "origin"):
            setattr(other, field, [getattr(self, field)[i] for i in indices])
        other.curves = [self.curves[i] for i in indices] if self.curves is not None else None
        other._index()
        return other

    def task_of(self, i: int) -> str | None:
        """The job's task as a zoo table names it: results.json's `task` (else the config's data.task),
        with the data keys that make it another task (TASK_KEYS: `word_problem group=a5`)."""
        data = self.configs[i].get("data") or {}
        task = self.results[i].get("task") or data.get("task")
        if not task:
            return None
        values = ((k, lookup(self.configs[i], f"data.{k}") or self.overrides[i].get(f"data.{k}"))
                  for k in TASK_KEYS.get(task, ()))
        return " ".join([task, *(f"{k}={v}" for k, v in values if v is not None)])

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

    def csv(self, chosen: set[int] | None = None) -> str:
        """Every job, every override and result; with `chosen` (a zoo's jobs at its settings' chosen
        lrs), a `chosen_lr` column marks them."""
        keys = sorted({k for o in self.overrides for k in o})
        fields = ["status", "error", "eval_loss", "baseline_loss", "tokens_per_sec",
                  "mfu", "wall_seconds", "step", "num_params", "state_floats", "compile_seconds", "platform"]
        metrics = self.metric_names()
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["job", *keys, *fields, *(f"eval_{m}" for m in metrics), *(["chosen_lr"] if chosen is not None else [])])
        for i, r in enumerate(self.results):
            writer.writerow([self.name(i), *(self.overrides[i].get(k, "") for k in keys), *(r.get(f, "") for f in fields),
                             *((r.get("eval_metrics") or {}).get(m, "") for m in metrics),
                             *([i in chosen] if chosen is not None else [])])
        return out.getvalue()

    def read_curves(self) -> list[dict]:
        if self.curves is None:
            try:
                self.curves = [read_curves(j) for j in self.jobs]
            except ImportError:
                print("summarize: tensorboard is not installed, no loss curves", file=sys.stderr)
                self.curves = [{} for _ in self.jobs]
        return self.curves


class Zoo:
    """The cells of a zoo sweep (jobs whose results.json has `eval_by_len`: {"<len>": {"loss": x,
    "<metric>": y}}) under zoo_protocol's rule: a row per setting (the cell and the sweep's other
    overrides but optimizer.lr and seed), at the lr chosen on the training-length eval, with the mean
    and spread over that lr's seeds at every eval length. One task's: `zoos` splits a sweep of several."""

    def __init__(self, sweep: Sweep, varying: dict[str, set[str]] | None = None):
        """`varying`: for a cell, keys its rows set differently elsewhere (other tasks' tables): labels name them."""
        self.varying_elsewhere = varying or {}
        zoo_jobs = [i for i, r in enumerate(sweep.results) if r.get("eval_by_len")]
        by_len = {i: {int(k): v or {} for k, v in sweep.results[i]["eval_by_len"].items()} for i in zoo_jobs}
        self.lengths = sorted({n for entry in by_len.values() for n in entry})
        named = [sweep.results[i].get("eval_metric_name") for i in zoo_jobs]
        seen = [k for entry in by_len.values() for v in entry.values() for k in v]
        task = next((sweep.results[i]["task"] for i in zoo_jobs if sweep.results[i].get("task")), None)
        self.metric = headline_metric(task, seen) or next((m for m in named if m in seen),
                                                           next((k for k in seen if k != "loss"), "loss"))
        self.task = next((sweep.task_of(i) for i in zoo_jobs if sweep.task_of(i)), None)
        seq_lens = {(sweep.configs[i].get("data") or {}).get("seq_len") for i in zoo_jobs}
        seq_len = seq_lens.pop() if len(seq_lens) == 1 else None
        self.seq_len = seq_len if isinstance(seq_len, int) else None  # the training length, if the jobs share it
        self.root = sweep.root
        # Every job of a zoo sweep counts, finished or not: a failed one fails its lr (zoo_protocol).
        members = list(range(len(sweep.jobs))) if zoo_jobs else []
        lrs = [float(((sweep.configs[i].get("optimizer") or {}).get("lr")) or "nan") for i in members]
        # Jobs of several sweeps (a folder of sweeps): the sweep dir is part of the setting, never a seed of another's.
        overrides = [({SWEEP_KEY: sweep.sweep_of(i)} if sweep.multi else {}) | sweep.overrides[i] for i in members]
        swept = [SWEEP_KEY] * sweep.multi + sweep.swept
        self.choices = zoo_protocol.settings(overrides, [sweep.results[i] for i in members], lrs, swept, self.metric)
        for choice in self.choices:  # job numbers within `members` -> the sweep's
            for g in choice.grid:
                g.jobs = [members[j] for j in g.jobs]
        if sweep.multi:  # a folder of sweeps (switch-on runs beside the zoo): each cell's rows together, by value
            first: dict[str, int] = {}
            for choice in self.choices:
                first.setdefault(self._cell(sweep, choice), len(first))
            keys = self._label_keys()
            self.choices.sort(key=lambda c: (first[self._cell(sweep, c)],
                                             [natural(v or "") for v in self._values(sweep, c, keys).values()]))
        self.lr_swept = zoo_protocol.LR_KEY in sweep.swept
        chosen = [c.best.jobs if c.best else [] for c in self.choices]
        self.values, self.spreads = [], []
        for jobs in chosen:
            stats = {n: zoo_protocol.mean_and_spread([by_len.get(j, {}).get(n, {}).get(self.metric) for j in jobs])
                     for n in self.lengths}
            self.values.append({n: m for n, (m, _) in stats.items()})
            self.spreads.append({n: sd for n, (_, sd) in stats.items()})
        mean = lambda jobs, key: zoo_protocol.mean_and_spread([sweep.results[j].get(key) for j in jobs])[0]  # noqa: E731
        self.num_params = [mean(jobs, "num_params") for jobs in chosen]
        self.tokens_per_sec = [mean(jobs, "tokens_per_sec") for jobs in chosen]
        self.state_floats = [mean(jobs, "state_floats") for jobs in chosen]
        # The whole model's recurrent state, every layer's summed (results.json's model_state_floats; older runs
        # lack it): the state a hybrid is compared on, beside a pure stack.
        self.model_state_floats = [mean(jobs, "model_state_floats") for jobs in chosen]
        # Where each row ran (results.json's platform): a column only when the table mixes platforms.
        self.platforms = [", ".join(sorted({str(sweep.results[j]["platform"]) for j in jobs
                                            if sweep.results[j].get("platform")})) for jobs in chosen]
        self.cells = [self._cell(sweep, c) for c in self.choices]
        self.labels = self._labels(sweep)
        self.sweep = sweep

    @staticmethod
    def _cell(sweep: Sweep, choice: zoo_protocol.Choice) -> str:
        """The setting's cell (model.cell); a hybrid's, its pattern's cells joined by '+' (model.pattern)."""
        first = choice.grid[0].jobs[0]
        model = sweep.configs[first].get("model") or {}
        if len(set(model.get("pattern") or ())) > 1:
            return "+".join(model["pattern"])
        return str(model.get("cell") or sweep.overrides[first].get("model") or "")

    def varying_keys(self, sweep: Sweep) -> dict[str, set[str]]:
        """{cell: the setting keys whose value differs among the cell's rows}."""
        keys = self._label_keys()
        seen: dict[str, dict[str, set]] = {}
        for cell, choice in zip(self.cells, self.choices):
            for k, v in self._values(sweep, choice, keys).items():
                seen.setdefault(cell, {}).setdefault(k, set()).add(v)
        return {cell: {k for k, vs in by_key.items() if len(vs) > 1} for cell, by_key in seen.items()}

    def _label_keys(self) -> list[str]:
        """The setting's keys a label may name: all but the cell and the sweep dir."""
        return [k for k, _ in self.choices[0].setting if k not in (*CELL_KEYS, SWEEP_KEY)] if self.choices else []

    @staticmethod
    def _values(sweep: Sweep, choice: zoo_protocol.Choice, keys: list[str]) -> dict[str, str | None]:
        """Each key's value in the setting: its override, else its first job's config value (None: neither);
        a boolean spelt one way (Hydra's basic sweeper writes a single value's `true` as `True`)."""
        values = {k: dict(choice.setting).get(k) or lookup(sweep.configs[choice.grid[0].jobs[0]], k) for k in keys}
        return {k: v.lower() if v in ("True", "False") else v for k, v in values.items()}

    def setting_value(self, row: int, key: str) -> str | None:
        return dict(self.choices[row].setting).get(key) or None

    def numeric_setting_keys(self) -> list[str]:
        """Swept keys besides the cell, lr and seed whose values are all numbers (data.num_pairs, hidden_dim)."""
        keys = [k for k, _ in self.choices[0].setting] if self.choices else []
        return [k for k in keys if k not in ("model", "model.cell", SWEEP_KEY)
                and all(as_number(dict(c.setting).get(k) or "") is not None for c in self.choices)]

    def _labels(self, sweep: Sweep) -> list[str]:
        """The setting's cell (model.cell), then the overrides that set it apart: those it names, and a key
        other rows of its cell set differently (`deltaproduct allow_neg_eigval=false num_householder=2`: the
        zoo's own row, beside the sweeps that switch the eigenvalues and n_h; the value from its config);
        with several sweeps the sweep dir too where rows would read alike, then the job dir."""
        keys = self._label_keys()
        if self.varying_elsewhere:  # keys other tasks' rows of a cell tell apart, though this table's do not
            keys = sorted({*keys, *(k for ks in self.varying_elsewhere.values() for k in ks)})
        values = [self._values(sweep, c, keys) for c in self.choices]
        varying = self.varying_keys(sweep)

        def shown(row: int, key: str) -> bool:
            named = bool(dict(self.choices[row].setting).get(key))
            cell = self.cells[row]
            return values[row][key] is not None and (
                named or key in varying.get(cell, ()) or key in self.varying_elsewhere.get(cell, ()))

        labels = [" ".join(part for part in (cell, sweep.describe((k, values[row][k]) for k in keys if shown(row, k)))
                           if part) for row, cell in enumerate(self.cells)]
        if sweep.multi:  # the sweep dir, after the cell, where two rows would otherwise read alike
            where = [sweep.describe([(SWEEP_KEY, dict(c.setting)[SWEEP_KEY])]) for c in self.choices]
            labels = [label if labels.count(label) == 1 else " ".join(
                part for part in (cell, dir_, label[len(cell):].strip()) if part)
                for label, cell, dir_ in zip(labels, self.cells, where)]
        labels = [label or sweep.name(c.grid[0].jobs[0]) for label, c in zip(labels, self.choices)]
        return [label if labels.count(label) == 1 else f"{label} ({self.sweep_name(sweep, c)})"
                for label, c in zip(labels, self.choices)]

    @staticmethod
    def sweep_name(sweep: Sweep, choice: zoo_protocol.Choice) -> str:
        return sweep.name(choice.grid[0].jobs[0])

    def lr_cell(self, row: int) -> str:
        """The chosen lr, and how many of the grid's lrs failed (diverged, crashed or never finished)."""
        choice = self.choices[row]
        failed = [g for g in choice.grid if g.failed]
        if choice.best is None:
            statuses = sorted({self.sweep.results[j].get("status", "?") for g in choice.grid for j in g.failed})
            lrs = f"all {len(choice.grid)} lrs failed" if self.lr_swept else "failed"
            return f"{lrs} ({', '.join(statuses)})"
        text = fmt(choice.best.lr if choice.best.lr == choice.best.lr else None, ".3g")  # nan: not in the config
        return text + (f" ({len(failed)} of {len(choice.grid)} lrs failed)" if failed and self.lr_swept else "")

    def value_cell(self, row: int, n: int) -> str:
        mean, spread = self.values[row].get(n), self.spreads[row].get(n)
        return fmt(mean) + (f" ± {spread:.2g}" if spread is not None else "")

    def markdown(self) -> str:
        trained = f", trained at seq_len {self.seq_len}" if self.seq_len else ""
        seeds = max((len(c.best.jobs) for c in self.choices if c.best), default=0)
        protocol = (f"each at its best lr of the grid on the training-length eval, mean ± sd over {seeds} seed(s)"
                    if self.lr_swept else f"one lr, mean ± sd over {seeds} seed(s)")
        mixed = len(set(self.platforms) - {""}) > 1
        total = any(f is not None for f in self.model_state_floats)  # a column when any run recorded it
        head = ["cell", *(f"{self.metric}@{n}" + (" (train)" if n == self.seq_len else "") for n in self.lengths),
                "lr", "seeds", "state floats", *["model state floats"] * total, "params", "tokens/s",
                *["platform"] * mixed]
        lines = [f"Zoo{f' ({self.task})' if self.task else ''}: eval {self.metric} by eval length, "
                 f"{len(self.choices)} setting(s) under {self.root}{trained}; {protocol}", "",
                 "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for row, label in enumerate(self.labels):
            best = self.choices[row].best
            cells = [label, *(self.value_cell(row, n) for n in self.lengths), self.lr_cell(row),
                     str(len(best.jobs)) if best else "0", fmt(self.state_floats[row], ","),
                     *[fmt(self.model_state_floats[row], ",")] * total, fmt(self.num_params[row], ","), fmt(self.tokens_per_sec[row], ","),
                     *[self.platforms[row] or "n/a"] * mixed]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines)


def zoos(sweep: Sweep) -> list[Zoo]:
    """The zoo of each task the sweep's zoo jobs span (Sweep.task_of; first-seen order), each over that
    task's jobs alone: its training and eval lengths, headline metric, settings and lr choices. One task:
    [Zoo(sweep)], as ever; none (no job reports eval_by_len): []."""
    tasks = {sweep.task_of(i) for i, r in enumerate(sweep.results) if r.get("eval_by_len")}
    if len(tasks) <= 1:
        zoo = Zoo(sweep)
        return [zoo] if zoo.choices else []
    jobs: dict[str | None, list[int]] = {}
    for i in range(len(sweep.jobs)):
        jobs.setdefault(sweep.task_of(i), []).append(i)
    whole = Zoo(sweep)  # which keys tell a cell's settings apart in any task: every table's labels name them
    varying = whole.varying_keys(sweep)
    return [zoo for zoo in (Zoo(sweep.part(part), varying) for part in jobs.values()) if zoo.choices]


def zoo_markdown(zoo_list: list[Zoo], root: Path) -> str:
    """zoo_table.md: the zoo's table, or for several tasks a section per task."""
    if len(zoo_list) == 1:
        return zoo_list[0].markdown()
    tasks = ", ".join(zoo.task or "task unknown" for zoo in zoo_list)
    sections = [f"# Zoo of {len(zoo_list)} tasks under {root}: {tasks}"]
    for zoo in zoo_list:
        sections += ["", f"## {zoo.task or 'task unknown'}", "", zoo.markdown()]
    return "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="a sweep dir (multirun/DATE/TIME), a run dir, or a folder of them")
    parser.add_argument("--out", type=Path, help="where summary.md/csv and the PNGs go (default: ROOT)")
    parser.add_argument("--csv", action="store_true", help="print CSV instead of markdown")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--decode", type=Path, default=Path(HERE).parent / "docs" / "decode.csv",
                        help="scripts/bench_decode.py's CSV: a zoo's state-size figure gains a frontier figure "
                             "against decode tokens/s (default: the committed docs/decode.csv, where it exists)")
    args = parser.parse_args(argv)
    sweep = Sweep(args.root)
    if not sweep.jobs:
        print(f"summarize: no job dirs (with results.json or .hydra/overrides.yaml) under {args.root}", file=sys.stderr)
        return 1
    out = args.out or args.root
    out.mkdir(parents=True, exist_ok=True)
    zoo_list = zoos(sweep)
    chosen = ({z.sweep.origin[j] for z in zoo_list for c in z.choices if c.best for j in c.best.jobs}
              if zoo_list else None)
    table, table_csv = sweep.markdown(), sweep.csv(chosen)
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.csv").write_text(table_csv)
    print(table_csv if args.csv else table)
    if zoo_list:
        zoo_table = zoo_markdown(zoo_list, args.root)
        (out / "zoo_table.md").write_text(zoo_table + "\n")
        if not args.csv:
            print("\n" + zoo_table)
    optuna = args.root / "optimization_results.yaml"
    if optuna.exists() and not args.csv:
        best = yaml.safe_load(optuna.read_text())
        print(f"\nOptuna best: {best.get('best_value')} with {best.get('best_params')}")
    if not args.no_plots:
        try:
            from summary_plots import plot

            written = plot(sweep, zoo_list, out, args.decode)
        except ImportError:
            print('summarize: matplotlib is not installed (pip install -e ".[plots]"): tables only', file=sys.stderr)
        else:
            print("\nplots: " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
