"""scripts/summarize.py on hand-made sweep dirs: the figures a reader trusts (distinct colours,
titles and labels, ticks at the swept values, unjoined categories, sweep names in legends) and
the zoo's cell-by-length table and plot. No training: each job is a few small files."""

import json
import sys

import pytest
import yaml

from conftest import ROOT, require

LENGTHS = {"128": 0.25, "16": 1.0, "32": 0.75}  # eval length -> accuracy; string keys, as results.json has them


@pytest.fixture
def scripts(monkeypatch):
    """scripts/summarize.py as a module; the figures a test drew are closed after it."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import summarize

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
    """summary_plots.<draw>(Sweep(root), *args, plt): the figure summarize.py would save."""
    import summary_plots

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


def test_numeric_sweep_has_ticks_at_the_swept_values_and_joined_lines(tmp_path, scripts):
    require("matplotlib")
    fig = figure_of(scripts, make_sweep(tmp_path / "s", GRID), "param_figure", "hidden_dim")
    check_labelled(fig)
    for ax in fig.axes:
        assert list(ax.get_xticks()) == [32, 64] and tick_labels(ax) == ["32", "64"]
        check_distinct_colours(ax, 2)  # a line per model
        assert all(line.get_linestyle() == "-" and len(line.get_xdata()) == 2 for line in lines_of(ax))
    assert sorted(t.get_text() for t in fig.axes[0].get_legend().get_texts()) == [
        "model=lstm", "model=rnn", "trivial baseline"]


def test_log_spaced_sweep_has_only_the_swept_ticks(tmp_path, scripts):
    require("matplotlib")
    root = make_sweep(tmp_path / "s", [{"optimizer.lr": v} for v in ("0.0001", "0.001", "0.01")])
    fig = figure_of(scripts, root, "param_figure", "optimizer.lr")
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        assert tick_labels(ax) == ["0.0001", "0.001", "0.01"] and len(ax.xaxis.get_minorticklocs()) == 0


def test_categorical_sweep_has_category_ticks_and_unjoined_points(tmp_path, scripts):
    require("matplotlib")
    fig = figure_of(scripts, make_sweep(tmp_path / "s", GRID), "param_figure", "model")
    check_labelled(fig)
    for ax in fig.axes:
        assert tick_labels(ax) == ["lstm", "rnn"] and list(ax.get_xticks()) == [0, 1]
        check_distinct_colours(ax, 2)  # a colour per hidden_dim
        assert all(line.get_linestyle() == "None" and line.get_marker() == "o" for line in lines_of(ax))
    xs = [x for line in lines_of(fig.axes[1]) for x in line.get_xdata()]
    assert len(set(xs)) == 4 and {round(x) for x in xs} == {0, 1}  # beside their category, none hidden


def test_loss_curves_have_a_colour_per_job_and_labelled_axes(tmp_path, scripts):
    require("matplotlib")
    require("tensorboard")
    fig = figure_of(scripts, make_sweep(tmp_path / "s", GRID), "loss_figure")
    check_labelled(fig)
    for ax in fig.axes:
        check_distinct_colours(ax, 4)
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert labels == ["hidden_dim=32 model=rnn", "hidden_dim=64 model=rnn", "hidden_dim=32 model=lstm",
                      "hidden_dim=64 model=lstm"]


def test_legends_name_the_sweep_when_several_are_summarized(tmp_path, scripts):
    require("matplotlib")
    require("tensorboard")
    for name in ("a", "b"):
        make_sweep(tmp_path / name, [{"hidden_dim": 32}, {"hidden_dim": 64}])
    fig = figure_of(scripts, tmp_path, "loss_figure")
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert labels == ["a: hidden_dim=32", "a: hidden_dim=64", "b: hidden_dim=32", "b: hidden_dim=64"]
    check_distinct_colours(fig.axes[0], 4)
    fig = figure_of(scripts, tmp_path, "param_figure", "hidden_dim")
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == ["a", "b"]  # a line per sweep


def zoo_sweep(root, grid):
    """A zoo sweep: each job reports eval_by_len (its accuracy falling with its job number)."""
    def results(n, values):
        by_len = {k: {"loss": 1 - v, "accuracy": v / (n + 1)} for k, v in LENGTHS.items()}
        return {"eval_by_len": by_len, "eval_metrics": {"accuracy": 0.5}, "eval_metric_name": "accuracy",
                "task": "mqar", "num_params": 12345 * (n + 1), "tokens_per_sec": 1234567.0 / (n + 1)}

    def config(values):
        return {"model": {"cell": values["model"], "hidden_dim": "${hidden_dim}"},
                "data": {"task": "mqar", "seq_len": 32}}

    return make_sweep(root, grid, results, config)


def test_zoo_table_has_a_row_per_cell_and_a_column_per_length(tmp_path, scripts, capsys):
    root = zoo_sweep(tmp_path / "zoo", [{"model": m} for m in ("rnn", "lstm", "mingru")])
    (root / "3_model=gru").mkdir()  # a job that died before writing anything
    (root / "3_model=gru" / ".hydra").mkdir()
    (root / "3_model=gru" / ".hydra" / "overrides.yaml").write_text("- model=gru\n- steps=4\n")
    assert scripts.main([str(root), "--no-plots"]) == 0
    table = (root / "zoo_table.md").read_text()
    assert table.strip() in capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].startswith("Zoo (mqar): eval accuracy by eval length, 4 setting(s) under") and "seq_len 32" in lines[0]
    assert lines[0].endswith("one lr, mean ± sd over 1 seed(s)")
    assert lines[2] == ("| cell | accuracy@16 | accuracy@32 (train) | accuracy@128 | lr | seeds | state floats | params"
                        " | tokens/s |")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[4:7]]
    for n, (row, cell) in enumerate(zip(rows, ("rnn", "lstm", "mingru"))):
        expected = [format(LENGTHS[k] / (n + 1), ".4g") for k in ("16", "32", "128")]
        assert row == [cell, *expected, "n/a", "1", "n/a", f"{12345 * (n + 1):,}", f"{1234567 / (n + 1):,.0f}"]
    assert lines[7] == "| gru | n/a | n/a | n/a | failed (missing) | 0 | n/a | n/a | n/a |"  # a dead job is a row


def test_zoo_rows_name_the_other_swept_overrides(tmp_path, scripts):
    grid = [{"model": m, "hidden_dim": h} for m in ("rnn", "lru") for h in (8, 16)]
    zoo = scripts.Zoo(scripts.Sweep(zoo_sweep(tmp_path / "zoo", grid)))
    assert zoo.labels == ["rnn hidden_dim=8", "rnn hidden_dim=16", "lru hidden_dim=8", "lru hidden_dim=16"]
    assert zoo.lengths == [16, 32, 128] and zoo.metric == "accuracy" and zoo.seq_len == 32


def test_zoo_plot_has_a_line_per_cell_against_length(tmp_path, scripts):
    require("matplotlib")
    import summary_plots

    root = zoo_sweep(tmp_path / "zoo", [{"model": m} for m in ("rnn", "lstm", "gru")])
    fig = summary_plots.zoo_figure(scripts.Zoo(scripts.Sweep(root)), summary_plots.pyplot())
    (ax,) = fig.axes
    assert ax.get_title() == "mqar: eval accuracy by sequence length"
    assert ax.get_xlabel().startswith("eval sequence length") and ax.get_ylabel() == "eval accuracy"
    assert ax.get_xscale() == "log" and tick_labels(ax) == ["16", "32", "128"]
    assert len(ax.xaxis.get_minorticklocs()) == 0
    check_distinct_colours(ax, 3)
    for n, line in enumerate(lines_of(ax)):
        assert list(line.get_xdata()) == [16, 32, 128]
        assert list(line.get_ydata()) == pytest.approx([LENGTHS[k] / (n + 1) for k in ("16", "32", "128")])
    (train_len,) = [line for line in ax.get_lines() if line.get_color() == "grey"]
    assert list(train_len.get_xdata()) == [32, 32] and train_len.get_linestyle() == "--"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rnn", "lstm", "gru", "training seq_len 32"]


def test_main_writes_every_figure(tmp_path, scripts):
    require("matplotlib")
    root = zoo_sweep(tmp_path / "zoo", [{"model": m} for m in ("rnn", "lstm")])
    assert scripts.main([str(root)]) == 0
    for name in ("loss_curves.png", "sweep_model.png", "zoo_accuracy_by_len.png", "zoo_table.md", "summary.md"):
        assert (root / name).stat().st_size > 0, name
