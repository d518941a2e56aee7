"""rnnlab.summarize on hand-made sweep dirs: the figures a reader trusts (distinct colours,
titles and labels, ticks at the swept values, unjoined categories, sweep names in legends), and
the files it writes. No training: each job is a few small files. (The zoo's tables are
`python -m rnnlab.zoo`'s.)"""

import csv
import io
import json
import sys

import pytest
import yaml

from conftest import require


@pytest.fixture
def summarizer():
    """rnnlab.summarize; the figures a test drew are closed after it."""
    from rnnlab import summarize

    yield summarize
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


def make_job(job, overrides, results, config=None, curves=None):
    """A job dir as train.py leaves it: .hydra/{overrides,config}.yaml, results.json, TensorBoard events."""
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if config is not None:
        (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (job / "results.json").write_text(json.dumps({"status": "completed", "baseline_loss": 1 / 6, **results}))
    if curves:
        from tensorboardX import SummaryWriter

        with SummaryWriter(str(job / "tensorboard")) as writer:
            for tag, values in curves.items():
                for step, value in enumerate(values, 1):
                    writer.add_scalar(tag, value, step)


def make_sweep(root, grid, results=lambda n, values: {}, config=lambda values: None):
    """A sweep dir with one job per entry of `grid` ([{key: value}, ...]), named as Hydra names them."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text("{}\n")
    for n, values in enumerate(grid):
        overrides = [f"{k}={v}" for k, v in values.items()] + ["steps=4"]
        job_results = {"eval_loss": 0.1 * (n + 1), "eval_metrics": {"mse": 0.1 * (n + 1)}, "eval_metric_name": "mse",
                       "tokens_per_sec": 1000.0 * (n + 1), "num_params": 100 * (n + 1), **results(n, values)}
        make_job(root / f"{n}_{','.join(overrides[:-1])}", overrides, job_results, config(values),
                 {"train/loss": [1.0, 0.5 / (n + 1)], "eval/loss": [0.9, 0.4 / (n + 1)]})
    return root


GRID = [{"model": m, "hidden_dim": h} for m in ("rnn", "lstm") for h in (32, 64)]


def figure_of(summarize, root, draw, *args):
    """summary_plots.<draw>(Sweep(root), *args, plt): the figure summarize would save."""
    from rnnlab import summary_plots

    return getattr(summary_plots, draw)(summarize.Sweep(root), *args, summary_plots.pyplot())


def lines_of(ax):
    """The data lines of an axes, less baselines and the training-length marker (grey)."""
    return [line for line in ax.get_lines() if line.get_color() != "grey"]


def check_labelled(fig):
    suptitle = fig.get_suptitle() if hasattr(fig, "get_suptitle") else fig._suptitle.get_text()  # matplotlib < 3.8
    assert suptitle
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), ax


def check_distinct_colours(ax, n):
    """n lines, n colours, all from the qualitative tab10 (a sequential map's neighbours look alike)."""
    import matplotlib

    colours = [tuple(line.get_color()) for line in lines_of(ax)]
    assert len(colours) == n and len(set(colours)) == n, colours
    assert set(colours) <= set(matplotlib.colormaps["tab10"].colors)


def tick_labels(ax):
    return [t.get_text() for t in ax.get_xticklabels()]


def test_numeric_sweep_has_ticks_at_the_swept_values_and_joined_lines(tmp_path, summarizer):
    require("matplotlib")
    fig = figure_of(summarizer, make_sweep(tmp_path / "s", GRID), "param_figure", "hidden_dim")
    check_labelled(fig)
    for ax in fig.axes:
        assert list(ax.get_xticks()) == [32, 64] and tick_labels(ax) == ["32", "64"]
        check_distinct_colours(ax, 2)  # a line per model
        assert all(line.get_linestyle() == "-" and len(line.get_xdata()) == 2 for line in lines_of(ax))
    assert sorted(t.get_text() for t in fig.axes[0].get_legend().get_texts()) == [
        "model=lstm", "model=rnn", "trivial baseline"]


def test_log_spaced_sweep_has_only_the_swept_ticks(tmp_path, summarizer):
    require("matplotlib")
    root = make_sweep(tmp_path / "s", [{"optimizer.lr": v} for v in ("0.0001", "0.001", "0.01")])
    fig = figure_of(summarizer, root, "param_figure", "optimizer.lr")
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        assert tick_labels(ax) == ["0.0001", "0.001", "0.01"] and len(ax.xaxis.get_minorticklocs()) == 0


def test_categorical_sweep_has_category_ticks_and_unjoined_points(tmp_path, summarizer):
    require("matplotlib")
    fig = figure_of(summarizer, make_sweep(tmp_path / "s", GRID), "param_figure", "model")
    check_labelled(fig)
    for ax in fig.axes:
        assert tick_labels(ax) == ["lstm", "rnn"] and list(ax.get_xticks()) == [0, 1]
        check_distinct_colours(ax, 2)  # a colour per hidden_dim
        assert all(line.get_linestyle() == "None" and line.get_marker() == "o" for line in lines_of(ax))
    xs = [x for line in lines_of(fig.axes[1]) for x in line.get_xdata()]
    assert len(set(xs)) == 4 and {round(x) for x in xs} == {0, 1}  # beside their category, none hidden


def test_loss_curves_have_a_colour_per_job_and_labelled_axes(tmp_path, summarizer):
    require("matplotlib")
    require("tensorboard")
    fig = figure_of(summarizer, make_sweep(tmp_path / "s", GRID), "loss_figure")
    check_labelled(fig)
    for ax in fig.axes:
        check_distinct_colours(ax, 4)
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert labels == ["hidden_dim=32 model=rnn", "hidden_dim=64 model=rnn", "hidden_dim=32 model=lstm",
                      "hidden_dim=64 model=lstm"]


def test_legends_name_the_sweep_when_several_are_summarized(tmp_path, summarizer):
    require("matplotlib")
    require("tensorboard")
    for name in ("a", "b"):
        make_sweep(tmp_path / name, [{"hidden_dim": 32}, {"hidden_dim": 64}])
    fig = figure_of(summarizer, tmp_path, "loss_figure")
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert labels == ["a: hidden_dim=32", "a: hidden_dim=64", "b: hidden_dim=32", "b: hidden_dim=64"]
    check_distinct_colours(fig.axes[0], 4)
    fig = figure_of(summarizer, tmp_path, "param_figure", "hidden_dim")
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == ["a", "b"]  # a line per sweep


def test_main_writes_the_table_and_every_figure(tmp_path, summarizer, capsys):
    """A zoo preset's jobs (results.json with eval_by_len) are summarised like any sweep: no zoo table of its own."""
    require("matplotlib")
    require("tensorboard")

    def results(n, values):
        return {"eval_by_len": {"32": {"loss": 0.5, "accuracy": 0.9}, "128": {"loss": 0.9, "accuracy": 0.4}}}

    root = make_sweep(tmp_path / "s", [{"model": m} for m in ("rnn", "lstm")], results)
    assert summarizer.main([str(root)]) == 0
    table = (root / "summary.md").read_text()
    assert table.strip() in capsys.readouterr().out
    assert table.splitlines()[0].startswith("2 job(s) under") and "common overrides: steps=4" in table
    rows = list(csv.DictReader(io.StringIO((root / "summary.csv").read_text())))
    assert [r["model"] for r in rows] == ["rnn", "lstm"] and "chosen_lr" not in rows[0]
    for name in ("loss_curves.png", "sweep_model.png", "summary.md", "summary.csv"):
        assert (root / name).stat().st_size > 0, name
    assert not list(root.glob("zoo_*"))
