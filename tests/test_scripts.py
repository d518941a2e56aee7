"""rnnlab.peak_flops and scripts/benchmark.py run and write what they say, on tiny shapes; the package's tools
(`python -m rnnlab.eval_long`, ...) and the scripts that wrap them answer alike."""

import importlib.util
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT, TEXT_FIXTURE_DATA, require, train_env
from rnnlab import flops, peak_flops, tasks


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_script_measures_each_kind_and_caches_the_best(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = peak_flops.main(
        ["--sizes", "32", "64", "--repeats", "1", "--min-seconds", "0.001", "--json", str(tmp_path / "peak.json")]
    )
    assert set(out["table"]) == {"float32", "bfloat16"}  # on CPU float32_default is float32: not measured twice
    for kind, rates in out["table"].items():
        assert set(rates) == {32, 64} and min(rates.values()) > 0
        assert out["peak"][kind] == max(rates.values())
    cpu = jax.devices("cpu")[0]
    assert flops.peak_flops(cpu, "float32", measure=False) == out["peak"]["float32"]
    assert flops.peak_flops(cpu, "float32_default", measure=False) == out["peak"]["float32"]
    assert json.loads((tmp_path / "peak.json").read_text())["peak"]["bfloat16"] == out["peak"]["bfloat16"]


def test_float32_models_divide_by_the_default_precision_peak(tmp_path, monkeypatch):
    """JAX's default float32 matmul is TF32 on NVIDIA GPUs: a float32 model's MFU uses that peak."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert flops.model_peak_kind("float32") == "float32_default" and flops.model_peak_kind("bfloat16") == "bfloat16"
    cpu = jax.devices("cpu")[0]
    flops.save_peak(cpu, "float32", 3.0e9, source="test")
    assert flops.peak_flops(cpu, "float32_default", measure=False) == 3.0e9  # the same matmul on CPU
    flops.save_peak(cpu, "float32_default", 4.0e9, source="test")
    assert flops.peak_flops(cpu, "float32_default", measure=False) == 4.0e9


@pytest.mark.slow("long")
def test_benchmark_gives_every_framework_the_whole_batch():
    """rnnlab's step runs on 2 devices, each with half the batch; torch and flax get all of it."""
    benchmark = load_script("benchmark")
    config = benchmark.compose("gru", 8, 4, 6, 1)
    step = benchmark.RnnlabStep(config, num_devices=2)
    assert step.batch.inputs.shape == (2, 2, 6, 2)
    whole = step.global_batch()
    assert whole.inputs.shape == (4, 6, 2) and whole.targets.shape == (4,)
    np.testing.assert_array_equal(whole.inputs[2:], np.asarray(step.batch.inputs[1]))
    flax_step = benchmark.FlaxStep("gru", 8, 4, 6, 1, whole)
    params = jax.tree_util.tree_map(np.array, flax_step.carry[0])  # a copy: the step donates its arguments
    last_step_mse = lambda batch: float(np.mean(  # noqa: E731  (the loss FlaxStep trains, computed here)
        (np.asarray(flax_step.model.apply(params, batch.inputs))[:, -1, 0] - batch.targets) ** 2))
    want = last_step_mse(whole)
    assert want != pytest.approx(last_step_mse(tasks.Batch(whole.inputs[:2], whole.targets[:2])), rel=1e-3)
    flax_step(1)
    assert flax_step.loss == pytest.approx(want, rel=1e-5)  # its step's loss is the whole batch's
    flax_step(1)  # and runs again on its donated state


def test_benchmark_composes_each_cells_own_model_config():
    """As `python train.py model=lstm` does: the LSTM's row gets its config's recurrence (auto), not the Elman's."""
    benchmark = load_script("benchmark")
    assert benchmark.compose("lstm", 8, 4, 6, 1).model.recurrence == "auto"
    assert benchmark.compose("lstm", 8, 4, 6, 1).model.init == "orthogonal"


@pytest.mark.slow("extra")  # torch comes with the full tier
def test_torch_step_times_the_benchmarks_torch_alone(tmp_path):
    require("torch")
    out = tmp_path / "t.json"
    result = load_script("torch_step").main(["gru", "8", "4", "6", "1", "--min-seconds", "0.01", "--repeats", "2",
                                             "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["torch_ms"] > 0 and result["tokens_per_sec"] == pytest.approx(4 * 6 / result["torch_ms"] * 1e3)


def test_benchmark_compiles_an_xla_variant_with_its_options():
    benchmark = load_script("benchmark")
    assert benchmark.parse_xla_options("--xla_cpu_prefer_vector_width=256 xla_cpu_enable_fast_math=false a=b --c") == {
        "xla_cpu_prefer_vector_width": 256, "xla_cpu_enable_fast_math": False, "a": "b", "c": True}
    devices = jax.devices()[:2]
    double = benchmark.CompilerOptionsPmap(devices, {"xla_cpu_prefer_vector_width": 256}).map(
        lambda x: 2 * x, (benchmark.parallel.SHARDED,), benchmark.parallel.SHARDED)
    np.testing.assert_array_equal(double(np.ones((2, 3), np.float32)), np.full((2, 3), 2.0))
    bad = benchmark.CompilerOptionsPmap(devices, {"xla_cpu_prefer_vector_width": "wide"})  # reaches XLA, which refuses it
    with pytest.raises(Exception, match="xla_cpu_prefer_vector_width"):
        bad.map(lambda x: 2 * x, (benchmark.parallel.SHARDED,), benchmark.parallel.SHARDED)(np.ones((2, 3), np.float32))


def run_benchmark(tmp_path, *args):
    """`scripts/benchmark.py ARGS --json FILE` in a fresh process (at most 2 CPU devices) -> (process, JSON)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark.py"), *args, "--repeats", "2", "--min-seconds", "0.01",
         "--json", str(out)],
        cwd=tmp_path, env=train_env({"RNNLAB_MAX_CPU_DEVICES": "2"}), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow("end-to-end")
def test_benchmark_prints_a_row_and_writes_json(tmp_path):
    off = "xla_cpu_prefer_vector_width=256 xla_cpu_copy_insertion_use_region_analysis=false"
    proc, result = run_benchmark(tmp_path, "--cells", "lstm", "--shapes", "8,4,6,2", "--devices", "1", "2",
                                 "--xla-variant", off)
    (row,) = result["results"]
    assert list(row["step_ms_by_variant"]) == [f"xla: {off}"] and row["step_ms_by_variant"][f"xla: {off}"] > 0
    assert (row["cell"], row["hidden"], row["batch"], row["time"], row["layers"]) == ("lstm", 8, 4, 6, 2)
    assert row["step_ms"] > 0 and row["flax_step_ms"] > 0 and row["devices"] in (1, 2)
    assert row["steps_per_dispatch"] == 8 and row["bare_step_ms"] > 0  # train.py's CPU dispatch, and the bare step
    assert set(row["step_ms_by_devices"]) == {"1", "2"}  # JSON keys; the main column is the faster count
    assert row["step_ms"] == pytest.approx(min(v for v in row["step_ms_by_devices"].values() if v))
    assert row["flops_per_step"] == flops.train_step_flops(
        benchmark_config("lstm", 8, 4, 6, 2).model, 2, 1, 4 * 6, 6
    )
    assert "lstm" in proc.stdout and "wrote" in proc.stdout


@pytest.mark.slow("end-to-end")
def test_benchmark_times_the_loops_dispatch_at_each_size(tmp_path):
    proc, result = run_benchmark(tmp_path, "--cells", "gru", "--shapes", "8,4,6,1", "--dispatch", "1", "3")
    (row,) = result["dispatch_sizes"]
    assert row["devices"] == 2 and set(row["ms_per_step"]) == {"1", "3"}
    assert min(row["ms_per_step"].values()) > 0
    assert set(row["minor_faults_per_step"]) == set(row["kernel_seconds_per_step"]) == {"1", "3"}
    assert "3/dispatch" in proc.stdout


def benchmark_config(cell, h, b, t, layers):
    return load_script("benchmark").compose(cell, h, b, t, layers)


@pytest.mark.slow("end-to-end")
def test_bench_scans_times_every_form_of_a_cell(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    out = tmp_path / "scans.json"
    result = load_script("bench_scans").main(["--cells", "gla", "mingru", "--seq-lens", "8", "--hidden", "8",
                                              "--batch", "2", "--repeats", "1", "--min-seconds", "0.01",
                                              "--mixer", "--set", "model.chunk_size=4", "--json", str(out)])
    forms = [(row["cell"], row["time_scan"]) for row in result["rows"]]
    assert forms == [("gla", "sequential"), ("gla", "associative"), ("gla", "chunked"), ("gla", "fused"),
                     ("mingru", "sequential"), ("mingru", "associative")]
    assert all(row["tokens_per_sec"] > 0 and row["memory_mib"] > 0 and row["compile_seconds"] > 0
               and row["mixer_ms"] > 0 for row in result["rows"])
    assert json.loads(out.read_text())["rows"] == result["rows"]


@pytest.mark.slow("end-to-end")
def test_bench_scans_memory_only_compiles_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    result = load_script("bench_scans").main(["--cells", "mamba", "attention", "--seq-lens", "8", "--hidden", "8",
                                              "--batch", "2", "--memory-only", "--json", str(tmp_path / "m.json")])
    forms = [(row["cell"], row["time_scan"]) for row in result["rows"]]
    assert forms == [("mamba", "sequential"), ("mamba", "associative"), ("mamba", "chunked"), ("mamba", "fused"),
                     ("attention", "parallel"), ("attention", "blockwise")]
    assert all(row["memory_mib"] > 0 and row["tokens_per_sec"] is None for row in result["rows"])


@pytest.mark.slow("end-to-end")
def test_bench_scans_as_configured_takes_each_config_and_reads_train_peak_rss(tmp_path, monkeypatch):
    """Each cell's own default form (mamba2: auto, its chunked form on a CPU; gru: sequential) and block, and the peak RSS of a
    real two-step `train.py` run: JAX alone holds hundreds of MiB, and a failing run is reported."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    result = load_script("bench_scans").main(["--cells", "mamba2", "gru", "--seq-lens", "8", "--hidden", "8",
                                              "--batch", "2", "--as-configured", "--memory-only", "--train-rss",
                                              "--json", str(tmp_path / "m.json")])
    rows = result["rows"]
    assert [(row["cell"], row["time_scan"]) for row in rows] == [("mamba2", "auto"), ("gru", "sequential")]
    assert all(row["train_exit"] == 0 and 200 < row["train_rss_mib"] < 8000 for row in rows)


@pytest.mark.slow("end-to-end")
def test_first_step_runs_each_cell_from_empty_caches_and_reads_its_results(capsys):
    (row,) = load_script("first_step").main(["--cells", "rnn", "--set", "steps=2"])
    assert row["cell"] == "rnn" and 0 < row["compile"] < row["run_wall"] < row["process_wall"]
    assert "| rnn |" in capsys.readouterr().out


@pytest.mark.slow("end-to-end")  # decoding itself: tests/test_decode.py
def test_bench_decode_writes_its_table_csv_and_plot(tmp_path):
    """scripts/bench_decode.py at a toy size: a row per cell, batch and context that fits; a recurrence's state
    bytes do not grow with the context, full attention's do, a window's stop at the window."""
    require("matplotlib")
    out, plot = tmp_path / "decode.csv", tmp_path / "decode.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_decode.py"), "--cells", "gru", "attention", "attention model.window=4",
         "--batches", "1", "2", "--contexts", "8", "32", "--decode", "3", "--repeats", "1", "--hidden", "8", "--layers", "1",
         "--vocab", "5", "--max-prefill-tokens", "40", "--out", str(out), "--plot", str(plot)],
        capture_output=True, text=True, env=train_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import csv

    rows = list(csv.DictReader(out.open()))
    assert [(r["cell"], r["batch"], r["context"]) for r in rows] == [
        (cell, b, n) for cell in ("gru", "attention", "attention model.window=4") for b, n in (("1", "8"), ("1", "32"), ("2", "8"))]
    size = {(r["cell"], r["context"]): int(r["state_bytes_per_sequence"]) for r in rows}
    assert size["gru", "8"] == size["gru", "32"] == 8 * 4
    assert size["attention", "32"] > size["attention", "8"]  # k and v of every step: 2 x (8 + 3) vs 2 x (32 + 3)
    assert size["attention model.window=4", "8"] == size["attention model.window=4", "32"]
    assert all(float(r["decode_tokens_per_sec"]) > 0 for r in rows) and plot.stat().st_size > 0
    assert sum(line.startswith("| ") for line in proc.stdout.splitlines()) == len(rows) + 1  # the header and the rows


def test_the_package_tools_and_their_script_wrappers_answer_help_alike(monkeypatch, capsys):
    """`python -m rnnlab.eval_long` (one fresh process: the entry point as a user types it) and each script kept as a
    wrapper so that existing commands work (`scripts/<tool>.py`, run here as Python runs a script) print their
    package module's --help and exit 0."""
    import runpy

    module = subprocess.run([sys.executable, "-m", "rnnlab.eval_long", "--help"], cwd=ROOT, env=train_env(),
                            capture_output=True, text=True, timeout=120)
    assert module.returncode == 0 and module.stdout.startswith("usage: eval_long "), module.stderr[-2000:]
    for name in ("eval_long", "sample", "summarize", "peak_flops"):
        shown = {}
        for how, run in (("module", lambda: runpy.run_module(f"rnnlab.{name}", run_name="__main__")),
                         ("script", lambda: runpy.run_path(str(ROOT / "scripts" / f"{name}.py"), run_name="__main__"))):
            monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
            with pytest.raises(SystemExit) as ended:
                run()
            assert ended.value.code == 0, (name, how)
            shown[how] = capsys.readouterr().out
        assert shown["module"] == shown["script"] and shown["script"].startswith("usage: "), name
    assert shown["script"] != module.stdout  # summarize's help, not eval_long's: each wrapper runs its own tool


@pytest.mark.slow("end-to-end")  # the segmented evaluation itself: tests/test_eval_segments.py
def test_eval_long_scores_a_trained_run_as_its_own_eval_did(tmp_path):
    """rnnlab.eval_long restores a run's newest checkpoint and evaluates it in segments: at a length the run
    evaluated whole, on the same examples (its eval batch), it scores what the run's results.json says."""
    from conftest import TINY, run_train

    run = tmp_path / "run"
    proc = run_train([*TINY, "data=word_problem", "model=gru", "data.eval_seq_lens=[6,40]", "eval_batches=1",
                      "steps=6", "eval_every=6", "checkpoint.every=6", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "long.csv"
    proc = subprocess.run([sys.executable, "-m", "rnnlab.eval_long", str(run), "--lengths", "40", "1000",
                           "--segment", "16", "--sequences", "8", "--out", str(out)],
                          capture_output=True, text=True, env=train_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import csv

    rows = {int(r["length"]): r for r in csv.DictReader(out.open())}
    results = json.loads((run / "results.json").read_text())
    for key, value in results["eval_by_len"]["40"].items():
        assert float(rows[40][key]) == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert 0 <= float(rows[1000]["accuracy"]) <= 1 and rows[1000]["step"] == "6"


@pytest.mark.slow("end-to-end")
def test_bench_text_times_the_carried_the_reset_and_a_synthetic_loop_side_by_side(tmp_path):
    """scripts/bench_text.py at a toy size on the fixture corpus: a row per loop, the JSON the table printed."""
    out = tmp_path / "text.json"
    data = TEXT_FIXTURE_DATA[1:]  # the corpus keys after data=text, which the script sets itself
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_text.py"), "--cells", "gru", "attention model.window=4", "--hidden", "8",
                           "--layers", "1", "--batch", "4", "--seq-len", "16", "--steps", "8", "--repeats", "1",
                           "--data", *data, "--json", str(out)], capture_output=True, text=True, env=train_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["cell"], r["loop"]) for r in rows] == [
        (cell, loop) for cell in ("gru", "attention model.window=4") for loop in ("text, carried", "text, reset", "mqar (synthetic)")]
    assert all(r["tokens_per_sec"] == pytest.approx(4 * 16 / (r["ms_per_step"] / 1e3)) for r in rows)
    for r in rows:
        assert f"{r['tokens_per_sec']:,.0f}" in proc.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_text.py"), "--steps", "0"], capture_output=True,
                         text=True, env=train_env(), timeout=120)
    assert bad.returncode == 2 and "--steps: got 0" in bad.stderr.strip().splitlines()[-1]
    # train.py's own refusal, before any compile: full attention's cache would grow without end on a stream
    full = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_text.py"), "--cells", "attention", "--hidden", "8",
                           "--batch", "4", "--seq-len", "16", "--data", *data], capture_output=True, text=True,
                          env=train_env(), timeout=300)
    (line,) = full.stderr.strip().splitlines()
    assert full.returncode == 2 and line.startswith("bench_text: error:") and "key 'model.window'" in line, full.stderr
