"""scripts/summarize.py on hand-made sweep dirs: the figures a reader trusts (distinct colours,
titles and labels, ticks at the swept values, unjoined categories, sweep names in legends) and
the zoo's cell-by-length table and plot. No training: each job is a few small files."""

import csv
import io
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


# A zoo of several tasks (experiment=zoo_state_tracking): the preset's own sweep in multirun/zoo_state_tracking and
# the switch-on and n_h sweeps in subdirs of it, as train.py names them. Each task: (results.json task, data keys,
# training length, eval lengths).
TASKS = {"parity": ("parity", {}, 16, (16, 128)),
         "modular_arithmetic": ("modular_arithmetic", {"modulus": 5}, 15, (15, 127)),
         "s3": ("word_problem", {"group": "s3"}, 16, (16, 128)),
         "a5": ("word_problem", {"group": "a5"}, 16, (16, 128))}
ST_LRS = ("0.001", "0.01")  # 0.001 wins at the training length, 0.01 past it and on a word problem's per-step accuracy
SWITCH_DIR = "model.allow_neg_eigval=true,model=mamba,deltaproduct"
NH_DIR = "model.allow_neg_eigval=true,model.num_householder=3,model=deltaproduct"


def st_job(root, n, task, cell, lr, extra=()):
    """One job of the state-tracking zoo; its headline at the training length ranks the settings by job number."""
    name, data, train, lengths = TASKS[task]
    overrides = [f"state_tracking={task}", f"model={cell}", *extra, f"optimizer.lr={lr}", "seed=0"]
    model = {"cell": cell, **({"allow_neg_eigval": False} if cell in ("mamba", "deltaproduct") else {}),
             **({"num_householder": 2} if cell == "deltaproduct" else {})}
    for o in extra:  # the composed config holds the overrides
        key, value = o.split("=")
        model[key.split(".")[1]] = yaml.safe_load(value)
    config = {"model": model, "data": {"task": name, "seq_len": train, **data}, "optimizer": {"lr": float(lr)}}
    best = lr == ST_LRS[0]
    headline = {train: 0.9 if best else 0.8, lengths[1]: 0.3 if best else 0.6}  # the lr chosen wins at `train` only
    by_len = {str(k): {"loss": 1 - v, "accuracy": v} for k, v in headline.items()}
    metrics = {"accuracy": headline[train]}
    if name == "word_problem":  # per-step accuracy favours the other lr: the headline is sequence_accuracy
        by_len = {k: {"loss": v["loss"], "accuracy": 1.9 - v["accuracy"], "sequence_accuracy": v["accuracy"]}
                  for k, v in by_len.items()}
        metrics = {"accuracy": 1.9 - headline[train], "sequence_accuracy": headline[train]}
    make_job(root / f"{n}_{','.join(overrides)}", overrides,
             {"task": name, "eval_metric_name": "accuracy", "eval_metrics": metrics, "eval_loss": 0.5,
              "eval_by_len": by_len, "state_floats": 64, "num_params": 100, "tokens_per_sec": 1000.0}, config)


def state_tracking_zoo(root):
    """The three sweeps: every task x (gru, mamba, deltaproduct) x 2 lrs at the root, mamba and deltaproduct
    with allow_neg_eigval=true in one subdir, deltaproduct at n_h=3 in another."""
    sweeps = [(root, ("gru", "mamba", "deltaproduct"), ()),  # a single value as Hydra's sweeper writes it: True
              (root / SWITCH_DIR, ("mamba", "deltaproduct"), ("model.allow_neg_eigval=True",)),
              (root / NH_DIR, ("deltaproduct",), ("model.allow_neg_eigval=true", "model.num_householder=3"))]
    for sweep_dir, cells, extra in sweeps:
        sweep_dir.mkdir(parents=True)
        (sweep_dir / "multirun.yaml").write_text("{}\n")
        jobs = [(task, cell, lr) for task in TASKS for cell in cells for lr in ST_LRS]
        for n, (task, cell, lr) in enumerate(jobs):
            st_job(sweep_dir, n, task, cell, lr, extra)
    return root


ST_LABELS = ["gru", "mamba allow_neg_eigval=false", "mamba allow_neg_eigval=true",
             "deltaproduct allow_neg_eigval=false num_householder=2",
             "deltaproduct allow_neg_eigval=true num_householder=2",
             "deltaproduct allow_neg_eigval=true num_householder=3"]


def test_a_zoo_of_several_tasks_has_a_table_per_task(tmp_path, scripts):
    root = state_tracking_zoo(tmp_path / "zoo_state_tracking")
    assert scripts.main([str(root), "--no-plots"]) == 0
    text = (root / "zoo_table.md").read_text()
    names = ["parity", "modular_arithmetic modulus=5", "word_problem group=s3", "word_problem group=a5"]
    assert text.splitlines()[0] == f"# Zoo of 4 tasks under {root}: {', '.join(names)}"
    sections = text.split("\n## ")[1:]
    assert [s.splitlines()[0] for s in sections] == names
    for section, (task, (name, _, train, lengths)) in zip(sections, TASKS.items()):
        lines = section.splitlines()
        metric = "sequence_accuracy" if name == "word_problem" else "accuracy"
        assert lines[2].startswith(f"Zoo ({lines[0]}): eval {metric} by eval length, 6 setting(s) under")
        assert f"trained at seq_len {train};" in lines[2]
        assert lines[4].startswith(f"| cell | {metric}@{lengths[0]} (train) | {metric}@{lengths[1]} | lr |")
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[6:]]
        assert [r[0] for r in rows] == ST_LABELS  # each cell's rows together, told apart by their switches
        assert all(r[1:4] == ["0.9", "0.3", "0.001"] for r in rows), rows  # the lr of the training length
    # summary.csv marks each task's chosen jobs (the first lr of each setting), in the whole folder's numbering
    rows = list(csv.DictReader(io.StringIO((root / "summary.csv").read_text())))
    assert len(rows) == 4 * 6 * 2
    assert all((r["chosen_lr"] == "True") == (float(r["optimizer.lr"]) == 0.001) for r in rows)


def test_a_single_task_zoo_beside_its_switch_on_sweep_names_only_the_switch(tmp_path, scripts):
    """One task, two sweeps: the rows name the switch, not the sweep dir (still named where rows read alike)."""
    root = tmp_path / "zoo"
    for sweep_dir, cells, extra in ((root, ("gru", "mamba"), ()),
                                    (root / "s", ("mamba",), ("model.allow_neg_eigval=True",))):
        sweep_dir.mkdir(parents=True)
        (sweep_dir / "multirun.yaml").write_text("{}\n")
        for n, (cell, lr) in enumerate((c, lr) for c in cells for lr in ST_LRS):
            st_job(sweep_dir, n, "parity", cell, lr, extra)
    zoo, = scripts.zoos(scripts.Sweep(root))
    assert zoo.labels == ["gru", "mamba allow_neg_eigval=false", "mamba allow_neg_eigval=true"]
    assert zoo.task == "parity" and zoo.metric == "accuracy" and zoo.markdown().startswith("Zoo (parity): ")


def test_a_zoo_of_several_tasks_plots_a_panel_per_task(tmp_path, scripts):
    require("matplotlib")
    import summary_plots

    root = state_tracking_zoo(tmp_path / "zoo_state_tracking")
    assert scripts.main([str(root)]) == 0
    assert (root / "zoo_tasks_by_len.png").stat().st_size > 0
    assert not list(root.glob("zoo_*accuracy_by_len.png"))  # no single-task figure of one task's lines
    zoos = scripts.zoos(scripts.Sweep(root))
    fig = summary_plots.zoo_tasks_figure(zoos, "zoo_state_tracking", summary_plots.pyplot())
    check_labelled(fig)
    assert len(fig.axes) == 4
    assert [ax.get_title().split(",")[0] for ax in fig.axes] == [
        "parity", "modular_arithmetic modulus=5", "word_problem group=s3", "word_problem group=a5"]
    for ax, (name, _, train, lengths) in zip(fig.axes, TASKS.values()):
        assert tick_labels(ax) == [str(n) for n in lengths] and ax.get_xscale() == "log"
        assert ax.get_ylabel() == "eval " + ("sequence_accuracy" if name == "word_problem" else "accuracy")
        check_distinct_colours_any(ax, 6)
        for line in lines_of(ax):
            assert list(line.get_xdata()) == list(lengths) and list(line.get_ydata()) == [0.9, 0.3]
        (marker,) = [line for line in ax.get_lines() if line.get_color() == "grey"]
        assert list(marker.get_xdata()) == [train, train]
    colours = [[tuple(line.get_color()) for line in lines_of(ax)] for ax in fig.axes]
    assert all(c == colours[0] for c in colours)  # a setting keeps its colour across panels
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ST_LABELS


def check_distinct_colours_any(ax, n):
    colours = [tuple(line.get_color()) for line in lines_of(ax)]
    assert len(colours) == n and len(set(colours)) == n, colours


def test_a_setting_missing_from_one_task_is_labelled_alike_in_every_table(tmp_path, scripts):
    """A switch-on sweep not yet run on A5: A5's own rows still name the switch they were run with."""
    import shutil

    root = state_tracking_zoo(tmp_path / "zoo_state_tracking")
    for job in (root / SWITCH_DIR).glob("*state_tracking=a5*"):
        shutil.rmtree(job)
    tables = {zoo.task: zoo.labels for zoo in scripts.zoos(scripts.Sweep(root))}
    assert tables["word_problem group=s3"] == ST_LABELS
    assert tables["word_problem group=a5"] == [label for label in ST_LABELS if label != "mamba allow_neg_eigval=true"
                                              and label != "deltaproduct allow_neg_eigval=true num_householder=2"]


def test_a_hybrid_is_its_own_row_with_the_models_state_and_sits_beside_pure_stacks_on_the_state_plot(tmp_path, scripts):
    """A swept model.pattern labels its row by the pattern's cells; the table adds the whole model's state
    (results.json's model_state_floats) and the state plot places every row by it."""
    patterns = {"gated_deltanet": [], "gated_deltanet+attention": ["gated_deltanet", "attention"]}
    grid = [{"model": "gated_deltanet", "model.pattern": name, "hidden_dim": h} for name in patterns for h in (8, 16)]

    def results(n, values):
        by_len = {k: {"loss": 1 - v, "accuracy": v / (n + 1)} for k, v in LENGTHS.items()}
        return {"eval_by_len": by_len, "eval_metrics": {"accuracy": 0.5}, "eval_metric_name": "accuracy",
                "task": "mqar", "state_floats": 16 * (n + 1), "model_state_floats": 64 * (n + 1)}

    def config(values):
        return {"model": {"cell": "gated_deltanet", "pattern": patterns[values["model.pattern"]]},
                "data": {"task": "mqar", "seq_len": 32}}

    zoo = scripts.Zoo(scripts.Sweep(make_sweep(tmp_path / "zoo", grid, results, config)))
    assert zoo.cells == ["gated_deltanet", "gated_deltanet", "gated_deltanet+attention", "gated_deltanet+attention"]
    lines = zoo.markdown().splitlines()
    assert "| state floats | model state floats | params |" in lines[2]
    assert [line.split("|")[-4].strip() for line in lines[4:8]] == ["64", "128", "192", "256"]
    require("matplotlib")
    import summary_plots

    fig = summary_plots.zoo_state_figure(zoo, None, summary_plots.pyplot())
    (ax,) = fig.axes
    assert ax.get_xlabel() == "state floats of the model (log2 axis)"
    assert sorted(x for line in ax.get_lines() for x in line.get_xdata()) == [64, 128, 192, 256]


def test_the_frontier_places_each_zoo_row_at_its_cells_decode_speed_from_the_bench(tmp_path, scripts):
    """Based's figure: accuracy against bench_decode.py's decode tokens/s (its largest batch, the longest context
    every cell has there), each point labelled with its state floats; a cell the bench lacks is left out."""
    grid = [{"model": cell, "hidden_dim": h} for cell in ("gru", "mamba", "lstm") for h in (8, 16)]

    def results(n, values):
        by_len = {k: {"loss": 1 - v, "accuracy": v / (n + 1)} for k, v in LENGTHS.items()}
        return {"eval_by_len": by_len, "eval_metrics": {"accuracy": 0.5}, "eval_metric_name": "accuracy",
                "task": "mqar", "state_floats": 16 * (n + 1)}

    zoo = scripts.Zoo(scripts.Sweep(make_sweep(tmp_path / "zoo", grid, results,
                                               lambda v: {"model": {"cell": v["model"]}, "data": {"task": "mqar", "seq_len": 32}})))
    bench = tmp_path / "decode.csv"
    rows = [("gru", 1, 1024, 500), ("gru", 64, 1024, 9000), ("gru", 64, 4096, 8000), ("mamba", 64, 1024, 4000),
            ("mamba", 64, 4096, 3000), ("mamba", 1, 1024, 100)]
    bench.write_text("cell,batch,context,decode_tokens_per_sec,platform\n"
                     + "".join(f"{c},{b},{n},{s},cpu\n" for c, b, n, s in rows))
    require("matplotlib")
    import summary_plots

    speeds, setting = summary_plots.decode_speeds(bench)
    assert speeds == {"gru": 8000.0, "mamba": 3000.0} and setting == "batch 64, context 4,096, cpu"
    fig = summary_plots.zoo_frontier_figure(zoo, None, speeds, setting, summary_plots.pyplot())
    (ax,) = fig.axes
    assert sorted(line.get_label() for line in ax.get_lines()) == ["gru", "mamba"]
    assert sorted(x for line in ax.get_lines() for x in line.get_xdata()) == [3000, 3000, 8000, 8000]
    assert ax.get_xlabel() == "decode tokens/s (batch 64, context 4,096, cpu)"
    assert {t.get_text() for t in ax.texts} == {f"{16 * (n + 1):,}" for n in range(4)}
