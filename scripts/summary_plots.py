"""The figures of scripts/summarize.py, drawn with matplotlib (pip install -e ".[plots]").

Each figure is built by a function that returns it, so tests can inspect its artists, and `plot`
saves them. What a reader can trust: a qualitative palette (tab10, tab20 past ten lines) so no two
lines share a colour; a title and axis labels on every axes; a numeric sweep's ticks at exactly the
swept values; a categorical sweep (model=rnn,lstm) as categories whose points no line joins; and
legend labels naming the sweep dir whenever jobs of several sweeps are drawn together.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: files only, no display needed. Imported here rather
    than at the top, so that summarize.py's tables need no matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def styles(plt: Any, n: int) -> list[dict[str, Any]]:
    """`n` distinct line styles: tab10's colours, tab20's past ten; past twenty the colours come round
    again with another dash pattern, so no two lines look alike."""
    colors = plt.colormaps["tab10" if n <= 10 else "tab20"].colors
    dashes = ["-", "--", "-."]
    return [{"color": colors[i % len(colors)], "linestyle": dashes[i // len(colors) % len(dashes)]} for i in range(n)]


def fixed_ticks(ax: Any, ticks: list[tuple[float, str]]) -> None:
    """Ticks at exactly these (x, label) pairs and no others: a log axis's minor ticks carry labels too."""
    from matplotlib.ticker import NullLocator

    ax.set_xticks([x for x, _ in ticks], [label for _, label in ticks])
    ax.xaxis.set_minor_locator(NullLocator())


def legend(ax: Any) -> None:
    """A legend where something is labelled: matplotlib warns about, and draws, an empty one."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def loss_figure(sweep: Any, plt: Any) -> Any:
    """Train and eval loss of every job against step, a colour each; failed jobs dotted."""
    curves = sweep.read_curves()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, (job_curves, style) in enumerate(zip(curves, styles(plt, len(sweep.jobs)))):
        failed = not sweep.completed(i)
        for ax, tag in zip(axes, ("train/loss", "eval/loss")):
            if job_curves.get(tag):
                steps, values = zip(*job_curves[tag])
                ax.plot(steps, values, **{**style, **({"linestyle": ":"} if failed else {})},
                        marker="o" if tag == "eval/loss" else None, markersize=3,
                        label=sweep.label(i) + (" (failed)" if failed else ""))
    baselines = {r.get("baseline_loss") for r in sweep.results if r.get("baseline_loss")}
    for ax, tag in zip(axes, ("train loss", "eval loss")):
        for b in baselines:
            ax.axhline(b, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="step", ylabel="loss", title=tag, yscale="log")
        ax.grid(True, alpha=0.3)
    if baselines:
        axes[0].text(0.01, 0.02, "dashed: trivial baseline", transform=axes[0].transAxes, color="grey", fontsize=8)
    legend(axes[1])
    fig.suptitle(f"{sweep.title()}: loss of {len(sweep.jobs)} job(s)")
    fig.tight_layout()
    return fig


def param_figure(sweep: Any, param: str, plt: Any) -> Any:
    """Final eval metric and tokens/s against `param`, a colour per combination of the other swept
    parameters (and sweep dir). Numbers: lines, ticks at the swept values (a log axis past a 10x
    range). Categories: unjoined points, each group's shifted a little so none hides another."""
    done = [i for i in range(len(sweep.jobs)) if sweep.completed(i) and param in sweep.overrides[i]]
    numeric, x_of, ticks = sweep.param_axis(param, done)
    others = [k for k in sweep.swept if k != param]
    groups: dict[tuple, list[int]] = {}  # in job order: a grid sweep's order of values
    for i in done:
        key = ((sweep.sweep_of(i),) if sweep.multi else ()) + tuple(sweep.overrides[i].get(k, "") for k in others)
        groups.setdefault(key, []).append(i)
    headline = sweep.headline()
    fields = ((lambda i: sweep.final(i, headline), f"final eval {headline}", f"eval {headline}"),
              (lambda i: sweep.results[i].get("tokens_per_sec"), "throughput", "tokens/s"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = min(0.15, 0.6 / max(len(groups), 1))  # a categorical group's horizontal offset step
    for ax, (value, title, ylabel) in zip(axes, fields):
        for g, (key, style) in enumerate(zip(groups, styles(plt, len(groups)))):
            shift = 0.0 if numeric else (g - (len(groups) - 1) / 2) * width
            pts = sorted((x_of[sweep.overrides[i][param]] + shift, value(i)) for i in groups[key])
            pts = [(x, y) for x, y in pts if y is not None]
            name = sweep.describe(zip(others, key[sweep.multi:]))
            label = ": ".join(part for part in (key[0] if sweep.multi else "", name) if part)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=style["color"], label=label or None,
                        linestyle=style["linestyle"] if numeric else "none")
        xs = [x for x, _ in ticks]
        if numeric and xs and min(xs) > 0 and max(xs) / min(xs) >= 10:
            ax.set_xscale("log")
        fixed_ticks(ax, ticks)
        if not numeric:
            ax.set_xlim(-0.5, len(ticks) - 0.5)
        ax.set(xlabel=param, ylabel=ylabel, title=title)
        ax.grid(True, alpha=0.3)
    baselines = {r.get("baseline_loss") for r in sweep.results if r.get("baseline_loss")}
    if headline in ("mse", "loss") and len(baselines) == 1:  # a metric in the loss's units
        axes[0].axhline(baselines.pop(), color="grey", linestyle="--", linewidth=1, label="trivial baseline")
    for ax in axes:
        legend(ax)
    fig.suptitle(f"{sweep.title()}: final eval {headline} and throughput against {param}")
    fig.tight_layout()
    return fig


def zoo_figure(zoo: Any, plt: Any) -> Any:
    """The zoo's metric against eval length, a line per cell, lengths on a log2 axis with a tick at
    each; a dashed line at the training length when the jobs share one."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, values, style in zip(zoo.labels, zoo.values, styles(plt, len(zoo.labels))):
        pts = [(n, values[n]) for n in zoo.lengths if values.get(n) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label, **style)
    if zoo.lengths and min(zoo.lengths) > 0:
        ax.set_xscale("log", base=2)
    if zoo.seq_len:
        ax.axvline(zoo.seq_len, color="grey", linestyle="--", linewidth=1, label=f"training seq_len {zoo.seq_len}")
    fixed_ticks(ax, [(n, str(n)) for n in zoo.lengths])
    ax.set(xlabel="eval sequence length" + (" (log2 axis)" if ax.get_xscale() == "log" else ""),
           ylabel=f"eval {zoo.metric}", title=f"{zoo.task or 'zoo'}: eval {zoo.metric} by sequence length")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def zoo_tasks_figure(zoos: list[Any], title: str, plt: Any) -> Any:
    """A zoo of several tasks (experiment=zoo_state_tracking): a panel per task, its headline metric
    against eval length as zoo_figure draws it (log2 axis, a tick at each of its lengths, dashed at its
    training length), a line per setting; a setting keeps its colour in every panel, one legend names them."""
    labels = list(dict.fromkeys(label for zoo in zoos for label in zoo.labels))
    palette = dict(zip(labels, styles(plt, len(labels))))
    cols = len(zoos) if len(zoos) <= 3 else 2
    rows = -(-len(zoos) // cols)
    legend_width = 0.7 + 0.055 * max((len(label) for label in labels), default=0)  # inches, at fontsize 7
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols + legend_width, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(zoos):]:
        fig.delaxes(ax)  # an axes per task, no empty panel
    for ax, zoo in zip(axes.flat, zoos):
        for label, values in zip(zoo.labels, zoo.values):
            pts = [(n, values[n]) for n in zoo.lengths if values.get(n) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=label, **palette[label])
        if zoo.lengths and min(zoo.lengths) > 0:
            ax.set_xscale("log", base=2)
        if zoo.seq_len:
            ax.axvline(zoo.seq_len, color="grey", linestyle="--", linewidth=1)
        fixed_ticks(ax, [(n, str(n)) for n in zoo.lengths])
        trained = f", trained at seq_len {zoo.seq_len} (dashed)" if zoo.seq_len else ""
        ax.set(xlabel="eval sequence length" + (" (log2 axis)" if ax.get_xscale() == "log" else ""),
               ylabel=f"eval {zoo.metric}", title=f"{zoo.task or 'task unknown'}{trained}")
        ax.title.set_fontsize(9)
        if zoo.metric.endswith("accuracy"):
            ax.set_ylim(-0.03, 1.03)  # every panel on the same scale, chance and all
        ax.grid(True, alpha=0.3)
    handles = {}
    for ax in fig.axes:  # one entry per setting, in the tables' order
        handles.update({label: h for h, label in zip(*ax.get_legend_handles_labels()) if label not in handles})
    if handles:
        drawn = [label for label in labels if label in handles]
        fig.legend([handles[label] for label in drawn], drawn, loc="center right", fontsize=7, frameon=False)
    fig.suptitle(f"{title}: eval headline metric by sequence length, each setting at its best lr")
    fig.tight_layout(rect=(0, 0, 1 - legend_width / fig.get_figwidth(), 1))  # the legend on the right
    return fig


def zoo_train_metric(zoo: Any, row: int) -> float | None:
    """A zoo row's metric at the training length (its chosen lr's mean over seeds)."""
    return zoo.values[row].get(zoo.seq_len) if zoo.seq_len else None


def zoo_param_figure(zoo: Any, key: str, plt: Any) -> Any:
    """The zoo's metric at the training length against a numeric swept key (data.num_pairs), a line
    per setting of the other keys (the cell, hidden_dim...), ticks at the swept values."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for row, label in enumerate(zoo.labels):
        x, y = zoo.setting_value(row, key), zoo_train_metric(zoo, row)
        rest = " ".join(part for part in label.split() if not part.startswith(key.split(".")[-1] + "="))
        lines.setdefault(rest, [])
        if x is not None and y is not None:
            lines[rest].append((float(x), y))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (label, pts), style in zip(lines.items(), styles(plt, len(lines))):
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=label, **style)
    xs = sorted({x for pts in lines.values() for x, _ in pts})
    if xs and min(xs) > 0 and max(xs) / min(xs) >= 4:
        ax.set_xscale("log", base=2)
    fixed_ticks(ax, [(x, format(x, "g")) for x in xs])
    ax.set(xlabel=key, ylabel=f"eval {zoo.metric} at seq_len {zoo.seq_len}",
           title=f"{zoo.task or 'zoo'}: eval {zoo.metric} against {key} (best lr of each)")
    ax.grid(True, alpha=0.3)
    legend(ax)
    fig.tight_layout()
    return fig


def zoo_state_figure(zoo: Any, panel_key: str | None, plt: Any) -> Any:
    """Zoology's Figure 2: the metric at the training length against the floats of recurrent state
    (log2 axis): the whole model's (results.json's model_state_floats) where every row has it, so that hybrids
    sit beside pure stacks, else per layer (state_floats); a line per cell or pattern through its settings
    (hidden sizes), a panel per value of `panel_key` (data.num_pairs) when given."""
    whole = all(f is not None for f in zoo.model_state_floats)
    floats = zoo.model_state_floats if whole else zoo.state_floats
    panels = sorted({zoo.setting_value(r, panel_key) for r in range(len(zoo.labels))}, key=natural_key) \
        if panel_key else [None]
    cells = list(dict.fromkeys(zoo.cells))
    palette = dict(zip(cells, styles(plt, len(cells))))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1.5, 4.2), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for cell in cells:
            pts = sorted((floats[r], zoo_train_metric(zoo, r)) for r in range(len(zoo.labels))
                         if zoo.cells[r] == cell and (panel_key is None or zoo.setting_value(r, panel_key) == panel)
                         and floats[r] and zoo_train_metric(zoo, r) is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=cell, **palette[cell])
        ax.set_xscale("log", base=2)
        ax.set(xlabel=f"state floats {'of the model' if whole else 'per layer'} (log2 axis)", title=f"{panel_key}={panel}" if panel_key else "")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(f"eval {zoo.metric} at seq_len {zoo.seq_len}")
    legend(axes[0][-1])
    fig.suptitle(f"{zoo.task or 'zoo'}: eval {zoo.metric} against recurrent state size (best lr of each)")
    fig.tight_layout()
    return fig


def decode_speeds(path: Path) -> tuple[dict[str, float], str]:
    """From `scripts/bench_decode.py`'s CSV: {cell: decode tokens/s} at its largest batch and the longest context
    every cell measured there, and that setting in words ("" and {} where the file is absent)."""
    import csv

    if not path or not Path(path).exists():
        return {}, ""
    rows = list(csv.DictReader(Path(path).open()))
    if not rows:
        return {}, ""
    batch = max(int(r["batch"]) for r in rows)
    rows = [r for r in rows if int(r["batch"]) == batch]
    cells = {r["cell"] for r in rows}
    contexts = [c for c in {int(r["context"]) for r in rows} if {r["cell"] for r in rows if int(r["context"]) == c} == cells]
    if not contexts:
        return {}, ""
    context = max(contexts)
    speeds = {r["cell"]: float(r["decode_tokens_per_sec"]) for r in rows if int(r["context"]) == context}
    return speeds, f"batch {batch}, context {context:,}, {rows[0]['platform']}"


def zoo_frontier_figure(zoo: Any, panel_key: str | None, speeds: dict[str, float], setting: str, plt: Any) -> Any:
    """Based's figure (Arora et al. 2024): the metric at the training length against decode tokens/s
    (`scripts/bench_decode.py`'s, by cell), each point labelled with its state floats: recall, state size and
    throughput together; a panel per value of `panel_key` (data.num_pairs). Cells the bench lacks are left out."""
    whole = all(f is not None for f in zoo.model_state_floats)
    floats = zoo.model_state_floats if whole else zoo.state_floats
    panels = sorted({zoo.setting_value(r, panel_key) for r in range(len(zoo.labels))}, key=natural_key) \
        if panel_key else [None]
    cells = [c for c in dict.fromkeys(zoo.cells) if c in speeds]
    palette = dict(zip(cells, styles(plt, len(cells))))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1.5, 4.2), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for cell in cells:
            pts = [(speeds[cell], zoo_train_metric(zoo, r), floats[r]) for r in range(len(zoo.labels))
                   if zoo.cells[r] == cell and (panel_key is None or zoo.setting_value(r, panel_key) == panel)
                   and zoo_train_metric(zoo, r) is not None]
            if not pts:
                continue
            style = {**palette[cell], "linestyle": "none"}  # one point per setting: no line joins them
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cell, **style)
            for x, y, f in pts:
                if f:
                    ax.annotate(f"{f:,.0f}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set(xlabel=f"decode tokens/s ({setting})", title=f"{panel_key}={panel}" if panel_key else "")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(f"eval {zoo.metric} at seq_len {zoo.seq_len}")
    legend(axes[0][-1])
    fig.suptitle(f"{zoo.task or 'zoo'}: eval {zoo.metric} against decode speed; labels: state floats "
                 f"{'of the model' if whole else 'per layer'} (best lr of each)")
    fig.tight_layout()
    return fig


def natural_key(text: Any) -> tuple:
    try:
        return (0, float(text), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(text))


def file_name(text: str) -> str:
    """A parameter or metric name as part of a file name: anything but [A-Za-z0-9_.-] becomes _."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def plot(sweep: Any, zoos: Any, out: Path, decode_csv: Path | None = None) -> list[Path]:
    """Writes loss_curves.png, sweep_<param>.png per swept parameter and, for a zoo (`zoos`: a Zoo, or
    summarize.zoos' list of one per task), zoo_<metric>_by_len.png, zoo_<metric>_by_<key>.png per numeric
    swept setting key (data.num_pairs, hidden_dim) and zoo_<metric>_by_state_floats.png where state sizes
    differ, and with `decode_csv` (`scripts/bench_decode.py`'s) zoo_<metric>_frontier.png there too. A zoo of
    several tasks: zoo_tasks_by_len.png (a panel per task), and the others per task as
    zoo_<task>_<metric>_by_....png. Returns the files written."""
    speeds, setting = decode_speeds(decode_csv)
    plt = pyplot()
    figures = [("loss_curves.png", loss_figure(sweep, plt))]
    figures += [(f"sweep_{file_name(param)}.png", param_figure(sweep, param, plt)) for param in sweep.swept]
    zoos = [z for z in (zoos if isinstance(zoos, (list, tuple)) else [zoos]) if z is not None and z.choices]
    if len(zoos) > 1:
        figures.append(("zoo_tasks_by_len.png", zoo_tasks_figure(zoos, sweep.title(), plt)))
    for zoo in zoos:
        metric = file_name(zoo.metric) if len(zoos) == 1 else file_name(f"{zoo.task or 'task'}_{zoo.metric}")
        if len(zoos) == 1:
            figures.append((f"zoo_{metric}_by_len.png", zoo_figure(zoo, plt)))
        keys = zoo.numeric_setting_keys()
        for key in keys:
            figures.append((f"zoo_{metric}_by_{file_name(key)}.png", zoo_param_figure(zoo, key, plt)))
        whole = all(f is not None for f in zoo.model_state_floats)
        if zoo.seq_len and len({f for f in (zoo.model_state_floats if whole else zoo.state_floats) if f}) > 1:
            panel = "data.num_pairs" if "data.num_pairs" in keys else None
            figures.append((f"zoo_{metric}_by_state_floats.png", zoo_state_figure(zoo, panel, plt)))
            if any(cell in speeds for cell in zoo.cells):
                figures.append((f"zoo_{metric}_frontier.png", zoo_frontier_figure(zoo, panel, speeds, setting, plt)))
    written = []
    for name, fig in figures:
        written.append(out / name)
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
