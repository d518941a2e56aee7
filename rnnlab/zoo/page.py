"""docs/results.md and its plots, from the zoo's records alone (docs/zoo/records/*.jsonl; earlier runs from
docs/zoo/earlier/*.jsonl). Each table comes from one commit and one kind of device, the group with the most
finished jobs, stated once in its header; a row is a setting under the protocol (`rnnlab.zoo.protocol`): its seed-0
grid, the lr the rule chose, and every seed at that lr. The same records give the same page, byte for byte.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rnnlab.zoo import records
from rnnlab.zoo.protocol import Choice, Setting, Table, edge_choice, lr_text, same_lr

PAGE = "results.md"
SOLVED = 0.9  # a length counts as solved where the seeds' mean reaches this ("agrees?")
HISTORY = "benchmarks-history.md"


def fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


@dataclasses.dataclass
class Row:
    """A setting of a table: its records at the table's commit and device, and where it stands in the protocol."""

    setting: str
    grid: dict[float, Mapping[str, Any] | None]  # seed 0's record at each lr the rule asked for (None: not run)
    lr: float | None  # the rule's choice (None: seed 0's lrs are not done, or every lr failed)
    chosen: list[Mapping[str, Any]]  # the records of every seed at the chosen lr
    complete: bool  # under the protocol: seed 0's lrs done (the edge rule's too) and every seed at the chosen lr
    choice: Choice | None = None  # where the rule stands (`protocol.edge_choice`)
    # Shown before it is final: the table's own grid and every seed are done at the best lr so far, and only the edge
    # rule's next lr is pending (`lr` is then that best, marked as not final).
    provisional: bool = False

    def stats(self, table: Table, n: int | str, metric: str | None = None) -> tuple[float | None, float | None]:
        """Mean and sd over the chosen seeds of `metric` (the headline one by default) at length or split `n`."""
        return records.mean_and_spread([value(r, metric or table.metric, n) for r in self.chosen])

    def jobs(self) -> int:
        return sum(r is not None for r in self.grid.values()) + sum(int(r["seed"]) > 0 for r in self.chosen)

    def expected(self, table: Table) -> int:
        """The jobs the row needs as far as the rule knows: seed 0's lrs and the other seeds."""
        return len(self.grid) + table.seeds - 1


def value(record: Mapping[str, Any], metric: str, n: int | str) -> float | None:
    if record.get("status") != "completed":
        return None
    v = (record.get("metrics") or {}).get(str(n), {}).get(metric)
    return float(v) if isinstance(v, (int, float)) else None


def rows_of(table: Table, recs: Sequence[Mapping[str, Any]], settings: Sequence[str]) -> list[Row]:
    rows = []
    for name in settings:
        mine = [r for r in recs if r["setting"] == name and r.get("status") in records.FINAL]
        seed0 = {float(r["lr"]): r for r in mine if int(r["seed"]) == 0}
        choice = edge_choice(table, {lr: records.score(r, table) for lr, r in seed0.items()})
        grid = {lr: next((r for k, r in seed0.items() if same_lr(k, lr)), None) for lr in choice.lrs}
        lr = choice.lr if choice.final else choice.best
        chosen = sorted((r for r in mine if lr is not None and same_lr(r["lr"], lr)), key=lambda r: int(r["seed"]))
        seeds_done = {int(r["seed"]) for r in chosen} >= set(range(table.seeds))
        complete = choice.final and (lr is None or seeds_done)
        provisional = (not choice.final and lr is not None and seeds_done
                       and not any(same_lr(p, g) for p in choice.pending for g in table.lrs))
        rows.append(Row(name, grid, lr if choice.final or provisional else None, chosen if choice.final or provisional
                        else [], complete, choice, provisional))
    return rows


def source_group(recs: Sequence[Mapping[str, Any]]) -> tuple[str | None, str | None]:
    """(commit, device kind) with the most finished records: the one a table is built from."""
    counts = collections.Counter((records.commit_of(r), records.kind_of(r)) for r in recs
                                 if r.get("status") in records.FINAL)
    if not counts:
        return None, None
    return min(counts, key=lambda k: (-counts[k], k[0] or "", k[1]))


# What the papers report for a parity or S3 setting (as docs/benchmarks-history.md's "What the papers report"
# recalls them: their arguments, not their tables).
SWITCH_CELLS = ("mamba", "mamba2", "deltanet", "gated_deltanet", "deltaproduct", "rwkv7")
DIAGONAL = ("mamba", "mamba2")


def claim(table: Table, setting: str) -> tuple[str, bool | None]:
    """(the papers' finding for a parity or S3 setting, whether it says the model solves the task at every length
    (True) or not beyond the training length (False)); ("", None) where none is recalled."""
    if table.key not in ("parity", "s3"):
        return "", None
    s = Setting.parse(setting)
    keys = dict(o.split("=", 1) for o in s.overrides if "=" in o)
    switch = keys.get("model.allow_neg_eigval") == "true"
    householders = int(keys.get("model.num_householder", 2 if s.cell == "deltaproduct" else 1))
    if s.cell == "lstm":
        return ("Merrill et al.: any length" if table.key == "s3" else "Deletang et al.: any length"), True
    if s.cell == "slstm":
        return "Beck et al.: state tracking (memory mixing)", True
    if s.cell == "mlstm":
        return "Beck et al.: no state tracking (no memory mixing)", False
    if s.cell not in SWITCH_CELLS:
        return "", None
    if not switch:
        return "Grazzi et al.: not with [0, 1] eigenvalues", False
    if table.key == "parity":
        return "Grazzi et al.: parity with [-1, 1]", True
    if s.cell in DIAGONAL:
        return "Grazzi et al.: no (diagonal transitions commute; S3 does not)", False
    if s.cell == "rwkv7":
        return "", None
    if householders >= 2:
        return f"Siems et al.: S3 in one layer from n_h = 2 (here {householders})", True
    return "Siems et al.: one layer needs n_h >= 2; Grazzi et al.: more layers help", False


def verdict(row: Row, table: Table) -> str:
    """Whether the row agrees with its papers' claim: a claim that the model solves the task holds where every
    evaluated length is solved (mean >= SOLVED), one that it does not where the longest is not."""
    expect = claim(table, row.setting)[1]
    lengths = list(table.eval_lens)
    means = {n: row.stats(table, n)[0] for n in lengths}
    if expect is None or any(means[n] is None for n in lengths):
        return "-"
    longest, solved = max(lengths), [n for n in lengths if means[n] >= SOLVED]
    if not expect:
        return "agrees" if means[longest] < SOLVED else f"disagrees: {fmt(means[longest])} at {longest}"
    if len(solved) == len(lengths):
        return "agrees"
    if means[table.train_len] >= SOLVED:
        return f"partly: solved to {max(solved)}, {fmt(means[longest])} at {longest}"
    seeds = sum(1 for r in row.chosen if (value(r, table.metric, table.train_len) or 0) >= SOLVED)
    return f"disagrees: {fmt(means[table.train_len])} at {table.train_len} ({seeds} of {len(row.chosen)} seeds solve it)"


def needs_budget_check(row: Row, table: Table) -> bool:
    """Whether a complete row's budget check runs (`protocol.budget_check`): it disagrees with its papers, or agrees
    only partly."""
    return row.complete and verdict(row, table).startswith(("disagrees", "partly"))


def budget_text(row: Row, table: Table, checks: Sequence[Mapping[str, Any]], check: Table) -> str:
    """The row's budget check beside it: its verdict on every seed at the row's lr and `check.steps` (with the mean
    at the training length and the longest), `k/n jobs` while it runs; "-" where none is needed."""
    if not needs_budget_check(row, table):
        return "-"
    mine = sorted((r for r in checks if r["setting"] == row.setting and same_lr(r["lr"], row.lr)
                   and r.get("status") in records.FINAL), key=lambda r: int(r["seed"]))
    if len(mine) < check.seeds:
        return f"{len(mine)}/{check.seeds} jobs"
    rerun = Row(row.setting, {}, row.lr, mine, True)
    means = f"{fmt(rerun.stats(table, table.train_len)[0])} at {table.train_len}, " \
            f"{fmt(rerun.stats(table, max(table.eval_lens))[0])} at {max(table.eval_lens)}"
    return f"{verdict(rerun, table)} ({means})"


def grid_text(row: Row, table: Table) -> str:
    """Seed 0 at every lr it trained, `lr value`, the chosen one in bold; the edge rule's lrs are the ones beyond
    the table's grid."""
    cells = []
    for lr, record in row.grid.items():
        text = "not run" if record is None else (
            fmt(value(record, table.metric, table.choose_key)) if record.get("status") == "completed" else record["status"])
        cells.append(f"{lr_text(lr)} " + (f"**{text}**" if row.lr is not None and same_lr(lr, row.lr) else text))
    return " / ".join(cells)


def grid_ends(rows: Sequence[Row], table: Table) -> str | None:
    """A sentence naming the settings whose choice the edge rule stopped at its bound: seed 0's best lr is an end of
    those tried and better than its neighbour, and the next lr out is past the bound (`Table.lr_bounds`)."""
    names = [row.setting for row in rows if row.choice is not None and row.choice.at_bound]
    if not names:
        return None
    lo, hi = table.lr_bounds
    return (f"Stopped at the edge rule's bound ({lr_text(lo)} to {lr_text(hi)}): {len(names)} of {len(rows)} "
            f"settings chose an end of the lrs tried and scored better there than one lr in ({', '.join(names)}); "
            "their best lr may lie beyond the bound.")


def edge_waiting(rows: Sequence[Row], table: Table) -> str | None:
    """A sentence naming the settings whose choice waits on the edge rule's next lr."""
    waiting = [r for r in rows if r.provisional]
    if not waiting:
        return None
    return ("† Not final: seed 0's best lr so far is an end of the lrs tried and better there than one lr in, so the "
            "edge rule trains the next lr out before the choice is final; the row shows every seed at the best lr so "
            "far: " + ", ".join(
                f"{r.setting} (best so far {lr_text(r.choice.best)}, next "
                f"{' and '.join(lr_text(lr) for lr in r.choice.pending)})" for r in waiting) + ".")


def cell_text(row: Row, table: Table, n: int | str, metric: str | None = None) -> str:
    mean, spread = row.stats(table, n, metric)
    return fmt(mean) + (f" ± {spread:.2g}" if spread is not None else "") if mean is not None else "-"


def machine_letters(recs: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, int]]:
    """A letter and a job count for each machine of a table's records, the one with the most jobs first (where
    there are several)."""
    counts = collections.Counter(records.machine_of(r) for r in recs)
    ordered = sorted(counts, key=lambda m: (-counts[m], m))
    return {m: (chr(ord("A") + i), counts[m]) for i, m in enumerate(ordered)} if len(ordered) > 1 else {}


def rate_text(row: Row, letters: Mapping[str, tuple[str, int]]) -> str:
    """The row's tokens/s: the mean over its chosen jobs on one machine (its most used; named by its letter where the
    table has several), since machines differ in speed."""
    by_machine: dict[str, list[float]] = {}
    for r in row.chosen:
        if r.get("tokens_per_sec"):
            by_machine.setdefault(records.machine_of(r), []).append(r["tokens_per_sec"])
    if not by_machine:
        return "-"
    machine = min(by_machine, key=lambda m: (-len(by_machine[m]), letters.get(m, ("", 0))[0], m))
    return f"{records.mean_and_spread(by_machine[machine])[0]:,.0f}" + (f" ({letters[machine][0]})" if letters else "")


def markdown_table(rows: Sequence[Row], table: Table, provenance_columns: bool = False,
                   letters: Mapping[str, tuple[str, int]] | None = None,
                   budget: tuple[Table, Sequence[Mapping[str, Any]]] | None = None) -> list[str]:
    """`budget`: the table's budget check and its records at this table's commit, a column beside the verdict."""
    papers = table.key in ("parity", "s3")
    head = ["setting", *(f"{metric}@{key}" + (" (train)" if key == str(table.train_len) else "")
                         for key, metric in table.columns),
            "lr", "seeds", f"seed 0 @{table.choose_key}: lr value", *(["the papers", "agrees?"] * papers),
            *([f"agrees? at {budget[0].steps:,} steps"] if budget else []), "params",
            "tokens/s", *(["machine", "date", "commit"] * provenance_columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        params = next((r.get("num_params") for r in row.chosen if r.get("num_params")), None)
        cells = [row.setting, *(cell_text(row, table, key, metric) for key, metric in table.columns),
                 (lr_text(row.lr) + (" †" if row.provisional else "")) if row.lr is not None else "every lr failed",
                 str(len(row.chosen)),
                 grid_text(row, table), *([claim(table, row.setting)[0] or "-", verdict(row, table)] * papers),
                 *([budget_text(row, table, budget[1], budget[0])] if budget else []),
                 f"{params:,}" if params else "-", rate_text(row, letters or {})]
        if provenance_columns:
            every = list(row.grid.values()) + row.chosen
            prov = [(r.get("provenance") or {}) for r in every if r is not None]
            cells += [", ".join(sorted({records.machine_of(r) for r in every if r is not None})),
                      ", ".join(sorted({p.get("date") or "not recorded" for p in prov})),
                      ", ".join(sorted({(p.get("commit") or "not recorded")[:12] for p in prov}))]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def dates(recs: Sequence[Mapping[str, Any]]) -> str:
    days = sorted({(r.get("provenance") or {}).get("started_utc", "")[:10] for r in recs} - {""})
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}" if days else "date not recorded"


PLOTS = "results_*.png"  # every plot the page draws, by name (`plot_name`)


def plot_name(table: Table) -> str:
    return PLOTS.replace("*", table.key)


def plot(rows: Sequence[Row], table: Table, path: Path) -> None:
    """The metric against eval length (log 2 axis), mean with sd error bars, a line per setting; fixed size, dpi and
    style, no pyplot state, so the same records draw the same pixels."""
    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.style.context("default"):
        fig = Figure(figsize=(8.0, 4.2), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        cmap = matplotlib.colormaps["tab20"]
        for i, row in enumerate(rows):
            xs = [n for n in table.eval_lens if row.stats(table, n)[0] is not None]
            dodge = 2 ** (0.03 * (i - (len(rows) - 1) / 2))
            ax.errorbar([n * dodge for n in xs], [row.stats(table, n)[0] for n in xs],
                        yerr=[row.stats(table, n)[1] or 0.0 for n in xs], marker="o", capsize=3, color=cmap(i % 20),
                        linestyle="-" if i < 20 else "--", label=f"{row.setting} (lr {lr_text(row.lr)})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(table.eval_lens), [str(n) for n in table.eval_lens])
        ax.minorticks_off()
        ax.axvline(table.train_len, color="0.6", linestyle=":", linewidth=1)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("eval length (dotted: training length)")
        ax.set_ylabel(f"{table.metric}: mean ± sd over seeds")
        ax.set_title(f"{table.title}, each setting at its chosen lr", fontsize=10)
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        fig.savefig(path, dpi=100, metadata={"Software": None})


WIDTH_PLOT = PLOTS.replace("*", "mqar8_width")


def width_rows(widths: Sequence[Table], built: Mapping[str, tuple[list[Row], Any]]) -> dict[str, dict[int, Row]]:
    """Each setting's complete row at each width: {setting: {width: row}}."""
    found: dict[str, dict[int, Row]] = {}
    for table in widths:
        for row in built[table.key][0]:
            if row.complete and row.lr is not None:
                found.setdefault(row.setting, {})[table.width] = row
    return found


def state_floats(row: Row) -> float | None:
    return next((float(r["state_floats"]) for r in row.chosen if r.get("state_floats")), None)


def width_section(widths: Sequence[Table], built: Mapping[str, tuple[list[Row], Any]]) -> list[str]:
    """MQAR over width: each setting's accuracy at the training length at every width (mean ± sd over its seeds at
    the lr its width's grid chose), and its recurrent state in floats per layer, as Zoology's Figure 2 plots it."""
    first = widths[0]
    rows = width_rows(widths, built)
    sources = [f"width {t.width}: commit `{(built[t.key][1][0] or 'none')[:12]}`, "
               f"{sum(r.complete for r in built[t.key][0])} of {len(t.settings)} settings" for t in widths]
    head = ["setting", *(f"{first.metric}@{first.train_len}, H={t.width}" for t in widths),
            *(f"state floats, H={t.width}" for t in widths)]
    lines = ["## MQAR over width", "",
             f"Zoology's Figure 2 as this lab runs it: MQAR at 8 pairs, every cell at H = "
             f"{', '.join(str(t.width) for t in widths)}, each width a table under the protocol (its own lr grid "
             f"with the edge rule, {first.seeds} seeds at the chosen lr). Each cell keeps its config's head count and "
             "state size at every width (`rnnlab/zoo/protocol.py`, WIDTHS). " + "; ".join(sources) + ".", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name in [s.name for s in first.settings] + sorted(set(rows) - {s.name for s in first.settings}):
        mine = rows.get(name, {})
        if not mine:
            continue
        accuracy = [cell_text(mine[t.width], t, t.train_len) if t.width in mine else "-" for t in widths]
        floats = [f"{state_floats(mine[t.width]):,.0f}" if t.width in mine and state_floats(mine[t.width]) else "-"
                  for t in widths]
        lines.append("| " + " | ".join([name, *accuracy, *floats]) + " |")
    return [*lines, "", f"![MQAR over width]({WIDTH_PLOT})", ""]


def plot_width(widths: Sequence[Table], built: Mapping[str, tuple[list[Row], Any]], path: Path) -> None:
    """Accuracy at the training length against width and against state floats (log 2 axes), a line per setting, mean
    with sd error bars; fixed size, dpi and style, so the same records draw the same pixels."""
    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    first = widths[0]
    rows = width_rows(widths, built)
    with matplotlib.style.context("default"):
        fig = Figure(figsize=(11.0, 4.2), dpi=100)
        FigureCanvasAgg(fig)
        by_width, by_state = fig.subplots(1, 2, sharey=True)
        cmap = matplotlib.colormaps["tab20"]
        for i, (name, mine) in enumerate(sorted(rows.items())):
            points = sorted(mine.items())
            ys = [r.stats(first, first.train_len)[0] for _, r in points]
            errs = [r.stats(first, first.train_len)[1] or 0.0 for _, r in points]
            style = dict(marker="o", capsize=3, color=cmap(i % 20), linestyle="-" if i < 20 else "--")
            by_width.errorbar([w for w, _ in points], ys, yerr=errs, label=name, **style)
            floats = [state_floats(r) for _, r in points]
            if all(floats):
                by_state.errorbar(floats, ys, yerr=errs, **style)
        by_width.set_xscale("log", base=2)
        by_width.set_xticks([t.width for t in widths], [str(t.width) for t in widths])
        by_width.minorticks_off()
        by_state.set_xscale("log", base=2)
        by_width.set_ylim(-0.02, 1.02)
        by_width.set_xlabel("model width (hidden_dim)")
        by_state.set_xlabel("recurrent state (floats per layer)")
        by_width.set_ylabel(f"{first.metric}@{first.train_len}: mean ± sd over seeds")
        fig.suptitle("MQAR, 8 pairs, over width: each setting at its chosen lr per width", fontsize=10)
        by_state.legend(*by_width.get_legend_handles_labels(), fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        fig.savefig(path, dpi=100, metadata={"Software": None})


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def coverage(tables: Sequence[Table], built: Mapping[str, tuple[list[Row], Any]]) -> list[str]:
    """Cells x tables: ✓ (the cell's default setting, or the one setting a table runs it with, under the protocol),
    k/n (jobs recorded so far), or -."""
    cells = list(dict.fromkeys(s.cell for t in tables for s in t.settings))
    head = ["cell", *(f"[{t.title}](#{anchor(t.title)})" if built[t.key][1][2] else t.title for t in tables)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for cell in cells:
        marks = []
        for t in tables:
            # The cell's default setting, or where a table runs it only with keys of its own, that setting.
            setting = t.setting(cell) or next((s for s in t.settings if s.cell == cell), None)
            row = next((r for r in built[t.key][0] if setting and r.setting == setting.name), None)
            if setting is None:
                marks.append("")
            elif row is None or row.jobs() == 0:
                marks.append("-")
            else:
                marks.append("✓" if row.complete else f"{row.jobs()}/{row.expected(t)}")
        lines.append("| " + " | ".join([cell, *marks]) + " |")
    return lines


def build(docs: Path, tables: Mapping[str, Table]) -> tuple[str, dict[str, Callable[[Path], None]]]:
    """The page's markdown, and each plot it names with what draws it (`write`)."""
    built: dict[str, tuple[list[Row], Any]] = {}
    for table in tables.values():
        recs = records.read_table(docs, table.key)
        commit, kind = source_group(recs)
        mine = [r for r in recs if (records.commit_of(r), records.kind_of(r)) == (commit, kind)]
        names = [s.name for s in table.settings] + sorted({r["setting"] for r in mine} - {s.name for s in table.settings})
        built[table.key] = (rows_of(table, mine, names), (commit, kind, mine, len(recs) - len(mine)))
    regenerated = [t for t in tables.values() if built[t.key][1][2] and t.base is None and not t.width]
    widths = sorted((t for t in tables.values() if t.width), key=lambda t: t.width)
    checks = {t.base.key: t for t in tables.values() if t.base is not None}  # base table -> its budget check
    lines = ["# Results: the zoo under its protocol", "",
             "Generated by `python -m rnnlab.zoo page` from the per-job records in `docs/zoo/records/` (written by "
             "`python -m rnnlab.zoo run` and `collect`); never edited by hand: a test regenerates it and fails if it "
             "differs. The protocol is `rnnlab/zoo/protocol.py`: each setting (a cell in its paper's block, and the "
             "overrides that set it apart) trains its table's lr grid on seed 0; the lr whose seed-0 job scores best "
             "on the headline metric at the training length is chosen (ties to the smaller lr; a diverged or failed "
             "job scores nothing). Where that best lr is an end of the lrs tried and better there than one lr in, "
             "the edge rule trains the next lr out on seed 0 (the grid's own spacing, within 1e-4 to 3e-2), until the "
             "best is inner or at that bound; then the other seeds train at the chosen lr. A row is the mean ± sd "
             "over every seed at the chosen lr at each evaluated length, with seed 0's training-length value at every "
             "lr it trained beside it (the chosen one in bold). Each table is built from one commit on one kind of device, named in its "
             "header (every CPU model is one kind: XLA computes the same float32 programs on each; where a table's "
             "jobs ran on several machines, the header names them and each row's tokens/s says on which); records "
             "of other commits or devices are counted there, not mixed in.", ""]
    cell_tables = [t for t in tables.values() if t.cell_key == "model" and t.base is None and not t.width]
    if cell_tables:
        lines += ["## Coverage", "", "Each cell's default setting in each table (or the one setting a table runs it with), at the table's "
                  "commit and device: ✓ "
                  "under the protocol (its grid and every seed at the chosen lr), k/n jobs recorded so far, - none yet "
                  "(a table with none is not on the page yet: see [Earlier runs](#earlier-runs)).", "",
                  *coverage(cell_tables, built), ""]
    plotted: dict[str, Callable[[Path], None]] = {}  # file name -> what draws it there
    for table in regenerated:
        rows, (commit, kind, mine, others) = built[table.key]
        complete = [r for r in rows if r.complete]
        done = [r for r in rows if r.complete or r.provisional]  # the rows drawn: final, or marked † (not final)
        waiting = [r for r in rows if not r.complete and not r.provisional and r.jobs()]
        letters = machine_letters(mine)
        where = (f"{kind}, {len(letters)} machines (" + "; ".join(
            f"{letter} = {m}, {count} jobs" for m, (letter, count) in letters.items())
                 + ")" if letters else records.machine_of(mine[0]))
        lines += [f"## {table.title}", "", table.about, "",
                  f"Commit `{(commit or 'not recorded')[:12]}` on {where}, {dates(mine)}: {len(complete)} of "
                  f"{len(table.settings)} settings under the protocol, each at the lr its seed-0 grid chose on "
                  f"{table.metric}@{table.choose_key} (the edge rule's lrs included); mean ± sd over {table.seeds} "
                  "seeds at that lr."
                  + (f" ({others} record(s) of other commits or devices not shown.)" if others else ""), ""]
        if done:
            check = checks.get(table.key)
            budget = (check, [r for r in records.read_table(docs, check.key) if (records.commit_of(r),
                                                                                  records.kind_of(r)) == (commit, kind)]
                      ) if check else None
            lines += [*markdown_table(done, table, letters=letters, budget=budget), ""]
            for sentence in (edge_waiting(done, table), grid_ends(done, table)):
                lines += [sentence, ""] if sentence else []
            if any(r.lr is not None for r in done) and len(table.eval_lens) > 1:  # a metric against length
                lines += [f"![{table.title}]({plot_name(table)})", ""]
                plotted[plot_name(table)] = functools.partial(plot, [r for r in done if r.lr is not None], table)
        if waiting:
            lines += ["In progress: " + ", ".join(f"{r.setting} ({r.jobs()}/{r.expected(table)} jobs)"
                                                  for r in waiting) + ".", ""]
        if table.key in ("parity", "s3") and done:
            lines += ["The papers' column: what Grazzi et al. (2025), Siems et al. (2025), Merrill et al. (2024), "
                      "Deletang et al. (2023) and Beck et al. (2024) report for such a model, as recalled in the "
                      f"[history file]({HISTORY}), not re-read: their arguments, not their tables; where a row "
                      f"disagrees, the row is the measurement. \"agrees?\": a claim that the model solves the task "
                      f"holds where the seeds' mean reaches {SOLVED} at every evaluated length, one that it does not "
                      "where the longest stays below it; \"partly\": solved at the training length only."
                      + (f" \"agrees? at {checks[table.key].steps:,} steps\": each row that disagrees or agrees only "
                         f"partly, trained again at its chosen lr with {checks[table.key].steps // table.steps}x the "
                         "steps, every seed, at this table's commit (the papers trained far longer): its verdict, and "
                         "the seeds' mean at the training and the longest length." if table.key in checks else ""),
                      ""]
    if widths and any(width_rows(widths, built).values()):
        lines += width_section(widths, built)
        plotted[WIDTH_PLOT] = functools.partial(plot_width, widths, built)
    lines += earlier(docs, tables, built)
    return "\n".join(lines).rstrip("\n") + "\n", plotted


def earlier(docs: Path, tables: Mapping[str, Table], built: Mapping[str, tuple[list[Row], Any]]) -> list[str]:
    """Earlier runs (docs/zoo/earlier/, converted from the CSVs before records existed): the settings no regenerated
    row covers yet, under the same rule, with their machine, date and commit as far as they were recorded."""
    lines = ["## Earlier runs", "", "Jobs run before the records (and their commit) were kept, converted from the "
             "CSVs of those sessions with what they recorded: the machine and date as the benchmark history quotes "
             f"them ([history]({HISTORY})), the commit where a CSV had it. Rows mix commits and machines, so they "
             "are not comparable with the tables above; a setting leaves this section once a regenerated table holds "
             "it under the protocol.", ""]
    for table in tables.values():
        recs = records.read(Path(docs) / "zoo" / "earlier" / f"{table.key}.jsonl")
        covered = {r.setting for r in built.get(table.key, ([], None))[0] if r.complete}
        names = [n for n in dict.fromkeys(r["setting"] for r in recs) if n not in covered]
        if not names:
            continue
        rows = rows_of(table, recs, names)
        inside = [r for r in rows if r.complete]
        lines += [f"### {table.title}: earlier runs", ""]
        if inside:
            lines += [*markdown_table(inside, table, provenance_columns=True), ""]
        outside = [r for r in rows if not r.complete]
        if outside:
            lines += ["Outside the protocol (part of the grid or a single seed): " + ", ".join(
                f"{r.setting} ({r.jobs()} jobs)" for r in outside) + ".", ""]
    return lines


def write(docs: Path, tables: Mapping[str, Table], plots: bool = True) -> list[Path]:
    """docs/results.md and, with `plots`, a plot per regenerated table with rows (matplotlib, if installed); a plot
    of the page's name pattern (`results_*.png`) that the page no longer draws is deleted, so the folder holds what
    the records make."""
    text, plotted = build(Path(docs), tables)
    page = Path(docs) / PAGE
    page.write_text(text)
    written = [page]
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return written
        for name, draw in plotted.items():
            draw(Path(docs) / name)
            written.append(Path(docs) / name)
        for stale in sorted(set(Path(docs).glob(PLOTS)) - set(written)):
            stale.unlink()
    return written
