"""The figures of `python -m rnnlab.summarize`, drawn with matplotlib (pip install -e ".[plots]").

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


def file_name(text: str) -> str:
    """A parameter or metric name as part of a file name: anything but [A-Za-z0-9_.-] becomes _."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def plot(sweep: Any, out: Path) -> list[Path]:
    """Writes loss_curves.png and sweep_<param>.png per swept parameter; returns the files written."""
    plt = pyplot()
    figures = [("loss_curves.png", loss_figure(sweep, plt))]
    figures += [(f"sweep_{file_name(param)}.png", param_figure(sweep, param, plt)) for param in sweep.swept]
    written = []
    for name, fig in figures:
        written.append(out / name)
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
