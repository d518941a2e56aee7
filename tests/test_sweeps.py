"""Sweeps end to end: launchers, a failing job, Optuna, HParams events, summarize.py; the progress bar;
the status line a sweep prints per finished job (rnnlab.sweep_status)."""

import io
import json
import re
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, compose_config, require, run_train

# Tiny jobs: each compiles and runs in a few seconds on a 2-core CPU.
SWEEP_TINY = ["steps=4", "batch_size=8", "data.seq_len=6", "log_every=2", "eval_every=4", "eval_batches=1",
              "checkpoint.enabled=false", "device=cpu"]


STATUS_LINE = re.compile(r"\[(\d+)/(\d+|\?)\] (\d+) running, (\d+|\?) left, (\d+) failed, .*")


def status_lines(text):
    return [line for line in text.splitlines() if STATUS_LINE.fullmatch(line)]


def jobs_of(sweep_dir):
    """Job dirs of a sweep, in job-number order."""
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name[0].isdigit()),
                  key=lambda p: int(p.name.split("_")[0]))


def results_of(job):
    return json.loads((job / "results.json").read_text())


def summarize(sweep_dir, *args):
    return subprocess.run([sys.executable, "-m", "rnnlab.summarize", str(sweep_dir), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory):
    """A 2x2 sweep with Hydra's basic launcher (all jobs in one process)."""
    sweep_dir = tmp_path_factory.mktemp("grid")
    proc = run_train(["-m", "hidden_dim=8,16", "optimizer.lr=1e-3,1e-2", *SWEEP_TINY, f"hydra.sweep.dir={sweep_dir}"],
                     cwd=sweep_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir


@pytest.mark.slow("end-to-end")
def test_basic_multirun_2x2_completes_every_job(grid_sweep):
    jobs = jobs_of(grid_sweep)
    assert len(jobs) == 4
    assert [j.name.split("_", 1)[0] for j in jobs] == ["0", "1", "2", "3"]
    assert jobs[2].name == "2_hidden_dim=16,optimizer.lr=0.001"  # the swept keys, not the shared SWEEP_TINY ones
    for job in jobs:
        results = results_of(job)
        assert results["status"] == "completed" and results["step"] == 4
        assert not (job / "checkpoints").exists() or not any(p.name.isdigit() for p in (job / "checkpoints").iterdir())


@pytest.mark.slow("end-to-end")
def test_hparams_events_are_readable_per_job(grid_sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    seen = set()
    for job in jobs_of(grid_sweep):
        events = EventAccumulator(str(job / "tensorboard"))
        events.Reload()
        content = events.PluginTagToContent(metadata.PLUGIN_NAME)
        assert {metadata.EXPERIMENT_TAG, metadata.SESSION_START_INFO_TAG} <= set(content)
        experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
        assert {m.name.tag for m in experiment.metric_infos} >= {"eval/loss", "perf/tokens_per_sec"}
        # The swept keys are registered as differing (TensorBoard lists and ticks them first); the keys every
        # job shares (SWEEP_TINY's steps, log_every, ...) are not registered at all.
        differs = {h.name: h.differs for h in experiment.hparam_infos}
        assert differs == {"hidden_dim": True, "optimizer.lr": True, "model.cell": False, "num_layers": False,
                           "batch_size": False, "data.task": False, "data.seq_len": False, "state_floats": False}
        start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        hparams = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
        seen.add((hparams["hidden_dim"], hparams["optimizer.lr"]))
        assert events.Scalars("eval/loss")[-1].value == pytest.approx(results_of(job)["eval_loss"], rel=1e-5)
    assert seen == {(8, 1e-3), (8, 1e-2), (16, 1e-3), (16, 1e-2)}  # the HParams table tells the jobs apart


@pytest.mark.slow("end-to-end")
def test_tensorboard_hparams_dashboard_shows_one_row_per_job(grid_sweep):
    """What `tensorboard --logdir <sweep dir>` serves to its HParams tab, from the plugin's own handlers."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(grid_sweep))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(grid_sweep))
    hparams = backend_context.Context(base_plugin.TBContext(logdir=str(grid_sweep), multiplexer=multiplexer,
                                                            data_provider=provider))
    request = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=100, allowed_statuses=[
        api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE, api_pb2.STATUS_RUNNING])
    groups = list_session_groups.Handler(context.RequestContext(), hparams, "", request).run()
    assert groups.total_size == 4
    for group in groups.session_groups:
        job = grid_sweep / group.name.split("/")[0]  # the run name is the readable job dir
        metrics = {m.name.tag: m.value for m in group.metric_values}
        assert metrics["eval/loss"] == pytest.approx(results_of(job)["eval_loss"], rel=1e-5)
        assert group.hparams["hidden_dim"].number_value == int(job.name.split("hidden_dim=")[1].split(",")[0])


@pytest.mark.slow("end-to-end")
def test_summarize_writes_tables_and_plots(grid_sweep, tmp_path):
    require("matplotlib")
    proc = summarize(grid_sweep, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    assert "| job | hidden_dim | optimizer.lr | status | eval loss | eval mse | baseline | tokens/s | MFU | wall s |" in table
    assert table.count("| completed |") == 4 and table.count("(best)") == 1
    assert (tmp_path / "summary.md").read_text().strip() == table.split("\nOptuna")[0].strip()
    rows = (tmp_path / "summary.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("job,") and "eval_loss" in rows[0]
    for name in ("loss_curves.png", "sweep_hidden_dim.png", "sweep_optimizer.lr.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name


@pytest.mark.slow("end-to-end")
def test_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    """Job 0 has a bad value: it fails first, job 1 still runs; the exit code and summary say so."""
    proc = run_train(["-m", "data.seq_len=1,6", *[o for o in SWEEP_TINY if "seq_len" not in o], "hidden_dim=8",
                      f"hydra.sweep.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Error executing job with overrides: ['data.seq_len=1'" in proc.stderr
    assert "rnnlab: error: sweep job 0 (data.seq_len=1" in proc.stderr
    assert "Traceback" not in proc.stderr.split("Error executing job")[1]  # the failure is reported in one line
    failed, ok = jobs_of(tmp_path)
    record = results_of(failed)
    assert record["status"] == "failed" and record["exit_code"] == 2
    assert "data.seq_len" in record["error"] and "data.seq_len=1" in record["overrides"]
    assert "job 0 failed (data.seq_len=1" in (failed / "train.log").read_text()
    assert results_of(ok)["status"] == "completed"
    table = summarize(tmp_path, "--no-plots").stdout
    assert "**FAILED**: key 'data.seq_len'" in table and "| completed |" in table


@pytest.mark.slow("end-to-end")
def test_joblib_runs_two_jobs_in_parallel_processes(tmp_path):
    require("hydra_plugins.hydra_joblib_launcher")
    # The jobs' own pin locks (cpu.pin_lock_dir is under the temp dir): on a machine where another sweep's
    # jobs hold every core, a job rightly runs unpinned, and this test asks whether pinning happens.
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    sweep_dir = tmp_path / "sweep"
    proc = run_train(["-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", "hidden_dim=8,16", *SWEEP_TINY,
                      f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, env_extra={"TMPDIR": str(private_tmp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2,backend=loky" in proc.stdout + proc.stderr
    jobs = jobs_of(sweep_dir)
    assert len(jobs) == 2 and all(results_of(j)["status"] == "completed" for j in jobs)
    assert [j.name for j in jobs] == ["0_hidden_dim=8", "1_hidden_dim=16"]  # worker processes name them alike
    hydra_cfg = yaml.safe_load((jobs[0] / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra_cfg["job"]["env_set"]["RNNLAB_PIN_CPU"] == "1"  # one core per job
    assert hydra_cfg["job"]["env_set"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # jobs share a GPU
    assert all("pinned to CPU core" in (job / "train.log").read_text() for job in jobs)
    # The workers' output went to each job's train.log; the terminal got one status line per finished job.
    assert [STATUS_LINE.fullmatch(line).group(1, 2) for line in status_lines(proc.stdout)] == [("1", "2"), ("2", "2")]
    assert status_lines(proc.stdout)[-1].endswith("0 left, 0 failed, done in " + proc.stdout.split("done in ")[-1].strip())
    assert " step 4/4 " not in proc.stdout + proc.stderr and "Summary" not in proc.stdout + proc.stderr
    assert all(" step 4/4 " in (job / "train.log").read_text() for job in jobs)


@pytest.mark.slow("end-to-end")
def test_optuna_study_of_three_trials(tmp_path):
    require("hydra_plugins.hydra_optuna_sweeper")
    proc = run_train(["-m", "hparams_search=adding_optuna", "hydra.sweeper.n_trials=3", *SWEEP_TINY,
                      "hidden_dim=choice(8,16)", f"hydra.sweep.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = jobs_of(tmp_path)
    assert len(jobs) == 3
    # Named by the keys the study varies: its search space (hydra.sweeper.params) and the command line's choice().
    assert all(re.fullmatch(r"\d_hidden_dim=(8|16),optimizer.lr=[0-9.e-]+", j.name) for j in jobs), [j.name for j in jobs]
    losses = [results_of(j)["eval_loss"] for j in jobs]
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(losses), rel=1e-6)
    assert set(best["best_params"]) == {"optimizer.lr", "hidden_dim"}
    assert 1e-4 <= best["best_params"]["optimizer.lr"] <= 3e-2


@pytest.mark.parametrize("task", ["adding", "copy", "selective_copy", "mqar", "parity"])
def test_debug_fast_preset_composes_with_every_task(task):
    config = compose_config(["debug=fast", f"data={task}"])
    assert config.steps == 4 and config.log_every == 1 and config.checkpoint.enabled is False


def test_progress_bar_draws_step_loss_rate_and_eta():
    import logging

    from rich.console import Console

    from rnnlab.progress import ProgressBar

    buffer = io.StringIO()
    bar = ProgressBar(100, enabled=True, console=Console(file=buffer, force_terminal=True, width=120))
    assert buffer.getvalue() == ""  # nothing before the first step
    original = sys.stdout
    console = logging.StreamHandler(original)  # a console log handler, as Hydra's job logging makes one
    console.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger().addHandler(console)
    try:
        bar.update(50, 0.1234, 12345.6)
        assert sys.stdout is not original and console.stream is sys.stdout  # through the bar's proxy while it runs
        logging.getLogger("rnnlab.test").warning("a log line")
        bar.close()
        assert sys.stdout is original and console.stream is original  # and given back after
    finally:
        logging.getLogger().removeHandler(console)
    drawn = buffer.getvalue()
    bar.close()  # idempotent: draws nothing more
    assert buffer.getvalue() == drawn
    frames = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", drawn).split("\r")  # without colours and cursor moves
    assert "\ra log line\n" in "\r".join(frames[:-1])  # the log line scrolled above the bar, drawn again below it
    assert re.fullmatch(r"training +━+╺?━* +50/100 loss 0\.1234 12,346 tokens/s \S+ ETA \S+\n", frames[-1]), frames[-1]


@pytest.mark.slow("end-to-end")
def test_a_sweep_prints_one_status_line_per_job_and_each_jobs_output_goes_to_its_train_log(tmp_path):
    """Three tiny jobs with the basic launcher, the second failing: the terminal gets a status line per job
    (the failure counted, its train.log named) and none of the jobs' own lines; their train.logs hold them."""
    proc = run_train(["-m", "data.seq_len=6,1,8", *[o for o in SWEEP_TINY if "seq_len" not in o], "hidden_dim=8",
                      f"hydra.sweep.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = status_lines(proc.stdout)
    assert [re.sub(r", (about|less|done|time).*", "", line) for line in lines] == [
        "[1/3] 0 running, 2 left, 0 failed", "[2/3] 0 running, 1 left, 1 failed", "[3/3] 0 running, 0 left, 1 failed"]
    assert lines[0].endswith(("less than a minute left", " min left")) and ", done in " in lines[2]
    first, failed, last = jobs_of(tmp_path)
    assert f"; job 1 failed: see {failed / 'train.log'}" in proc.stdout  # the status line of the failed job
    assert len([line for line in proc.stdout.splitlines() if re.match(r"\[\d+/", line)]) == 3  # one line per job
    terminal = proc.stdout + proc.stderr
    assert " step 4/4 " not in terminal and "Summary" not in terminal and "eval step" not in terminal
    for job in (first, last):
        log = (job / "train.log").read_text()
        assert "RecurrentModel Summary" in log and " step 4/4 " in log and "eval step 4 " in log
    assert "rnnlab: error: key 'data.seq_len'" in (failed / "train.log").read_text()  # the job's error, in its log
    assert "rnnlab: error: sweep job 1 (data.seq_len=1" in proc.stderr  # and the sweep's summary, as before


@pytest.mark.slow("end-to-end")
def test_a_sweep_with_sweep_console_keeps_the_jobs_output_on_the_terminal(tmp_path):
    proc = run_train(["-m", "hidden_dim=8", "log.sweep_console=true", *SWEEP_TINY, f"hydra.sweep.dir={tmp_path}"],
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " step 4/4 " in proc.stdout and "RecurrentModel Summary" in proc.stdout
    assert len(status_lines(proc.stdout)) == 1 and status_lines(proc.stdout)[0].startswith("[1/1] 0 running, 0 left")


def test_status_line_and_time_left():
    from rnnlab.sweep_status import seconds_left, status_line, time_left

    assert time_left(6000) == "about 1 h 40 min left"
    assert time_left(170) == "about 3 min left"
    assert time_left(59) == time_left(0) == "less than a minute left"
    assert time_left(7200) == "about 2 h left" and time_left(None) == "time left unknown"
    assert status_line(12, 72, 2, 0, 6000) == "[12/72] 2 running, 58 left, 0 failed, about 1 h 40 min left"
    assert status_line(3, 3, 0, 1, 0, elapsed=4000) == "[3/3] 0 running, 0 left, 1 failed, done in 1 h 7 min"
    assert status_line(2, None, 1, 0, None) == "[2/?] 1 running, ? left, 0 failed, time left unknown"
    # Jobs of 100 s: 4 left on 2 workers, one running for 30 s -> slots end at 70+100+100 and 100+100.
    assert seconds_left([90, 110], 4, [30], 2) == 270
    assert seconds_left([100], 3, [], 1) == 300 and seconds_left([], 3, [], 1) is None
    assert seconds_left([100], 0, [40, 130], 4) == 60  # only the running jobs: the longest remainder


def test_job_output_to_sends_prints_fds_and_console_logging_to_the_log(tmp_path, capfd):
    import logging
    import os

    from rnnlab.sweep_status import job_output_to

    root = logging.getLogger()
    console = logging.StreamHandler(sys.stdout)
    root.addHandler(console)
    try:
        with job_output_to(tmp_path / "train.log"):
            print("printed", flush=True)
            os.write(2, b"native stderr\n")
            logging.getLogger("rnnlab.test").warning("logged")
            assert console not in root.handlers
        print("after")
        assert console in root.handlers
    finally:
        root.removeHandler(console)
    out, err = capfd.readouterr()
    assert out == "after\n" and err == ""
    assert (tmp_path / "train.log").read_text() == "printed\nnative stderr\n"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_is_off_without_a_terminal(monkeypatch):
    import multiprocessing

    from rich.console import Console

    from rnnlab.progress import ProgressBar, wants_bar

    assert wants_bar(Terminal()) and not wants_bar(io.StringIO())
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert not wants_bar() and not ProgressBar(10).enabled  # enabled=None asks wants_bar about stdout
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert wants_bar() and ProgressBar(10).enabled
    with monkeypatch.context() as patch:  # a worker process (joblib's, a population's) draws none
        patch.setattr(multiprocessing, "parent_process", lambda: object())
        assert not wants_bar(Terminal()) and not ProgressBar(10).enabled
    buffer, stdout = io.StringIO(), sys.stdout
    bar = ProgressBar(10, enabled=False, console=Console(file=buffer, force_terminal=True))
    bar.phase("compiling")
    bar.update(5, 1.0, None)
    bar.close()
    assert buffer.getvalue() == "" and sys.stdout is stdout  # drew nothing, took no stream


def test_summarize_marks_failed_and_missing_jobs_without_matplotlib(tmp_path, monkeypatch, capsys):
    """A hand-made sweep dir: completed, failed and vanished jobs; the table needs no matplotlib."""
    from rnnlab import summarize as summarize_script

    jobs = {
        "0_hidden_dim=8": {"status": "completed", "eval_loss": 0.2, "eval_metrics": {"mse": 0.2},
                           "baseline_loss": 1 / 6, "tokens_per_sec": 1000.0, "mfu": None, "wall_seconds": 3.0},
        "1_hidden_dim=16": {"status": "failed", "error": "key 'x': bad", "exit_code": 2, "wall_seconds": 0.1},
        "2_hidden_dim=32": None,  # killed before it wrote results.json
    }
    for name, results in jobs.items():
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(f"- {name.split('_', 1)[1]}\n- steps=4\n")
        if results:
            (tmp_path / name / "results.json").write_text(json.dumps(results))
    (tmp_path / "multirun.yaml").write_text("{}\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert summarize_script.main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "3 job(s)" in out and "2 not completed" in out and "common overrides: steps=4" in out
    assert "| 0 | 8 | completed | 0.2 (best) | 0.2 | 0.1667 | 1,000 | n/a | 3.0 |" in out
    assert "| 1 | 16 | **FAILED**: key 'x': bad |" in out and "| 2 | 32 | **MISSING** |" in out
    assert "matplotlib is not installed" in err
    assert (tmp_path / "summary.csv").read_text().count("\n") == 4


def test_a_preset_sweep_has_a_stable_dir_and_a_timestamped_one_is_named_to_resume():
    import datetime

    sys.path.insert(0, str(ROOT))
    import train

    now = datetime.datetime(2026, 11, 26, 12, 0, 0)
    assert train.sweep_home(["-m", "experiment=zoo_parity", "hydra/launcher=parallel"], now) == "multirun/zoo_parity"
    assert train.sweep_home(["-m", "experiment=zoo_parity", "model=gru,lstm", "optimizer.lr=1e-3,3e-3"], now) == \
        "multirun/zoo_parity/model=gru,lstm,optimizer.lr=1e-3,3e-3"
    assert train.sweep_home(["-m", "hidden_dim=8,16"], now) == "multirun/2026-11-26/12-00-00"
    assert train.sweep_home(["-m", "experiment=adding_grid", "hparams_search=adding_optuna"], now).startswith("multirun/2026")
    long = train.sweep_home(["experiment=zoo_mqar", *[f"+k{i}=v" for i in range(40)]], now)
    assert len(long) <= len("multirun/zoo_mqar/") + train.MAX_SWEEP_NAME


@pytest.mark.slow("end-to-end")
def test_a_stopped_parallel_sweep_resumes_by_the_command_it_prints(tmp_path):
    """Ctrl-C (SIGINT to the process group) stops a parallel-launcher preset sweep; the one line it prints
    is a command that, run as is, finishes every job, resuming those that had a checkpoint."""
    import os
    import shlex
    import signal
    import time

    from conftest import train_env

    require("hydra_plugins.hydra_joblib_launcher")
    args = ["experiment=adding_grid", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", "steps=1500",
            "checkpoint.every=100", "log_every=100", "eval_every=1500", "eval_batches=1", "data.seq_len=20"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=train_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    def saved_steps(job_glob):  # finished saves only: "<step>.orbax-checkpoint-tmp-*" is one cut off mid-write
        return [p for p in tmp_path.glob(f"{job_glob}/checkpoints/*") if p.name.isdigit()]

    deadline = time.time() + 240  # until a job holds a checkpoint: multirun/adding_grid/<the other overrides>/<job>
    while time.time() < deadline and not saved_steps("multirun/adding_grid/*/*"):
        time.sleep(0.5)
    (sweep_dir,) = (tmp_path / "multirun" / "adding_grid").iterdir()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode in (75, 130), stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("rnnlab: error: sweep interrupted")]
    assert len(lines) == 1, stderr[-3000:]
    command = shlex.split(lines[0].split("resume it with: ", 1)[1])
    assert command == ["python", "train.py", *args]  # the preset's sweep dir is stable: the same command
    started = {job.name for job in jobs_of(sweep_dir) if saved_steps(job.relative_to(tmp_path))}
    assert started
    resumed = run_train(command[2:], cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    jobs = jobs_of(sweep_dir)
    assert len(jobs) == 4 and all(results_of(j)["status"] == "completed" and results_of(j)["step"] == 1500 for j in jobs)
    for job in jobs:
        if job.name in started:  # no job that had a checkpoint started over
            assert "resumed from" in (job / "train.log").read_text(), job.name


def test_a_rerun_refused_before_it_trains_keeps_the_earlier_runs_results(tmp_path):
    """A finished job rerun where its resume is refused (another device count, say) must not turn its completed
    results.json into a failure: the refusal goes beside it."""
    import time

    from rnnlab.metrics import write_failure

    done = tmp_path / "results.json"
    done.write_text(json.dumps({"status": "completed", "eval_loss": 0.1}))
    write_failure(done, "key 'checkpoint.allow_changes': resuming changes ...", 2, ["seed=0"], time.time() + 1)
    assert json.loads(done.read_text()) == {"status": "completed", "eval_loss": 0.1}
    attempt = json.loads((tmp_path / "results.failed_attempt.json").read_text())
    assert attempt["status"] == "failed" and attempt["exit_code"] == 2
    # This run's own record (written after it started) is marked failed in place, as before.
    started = time.time() - 1
    done.write_text(json.dumps({"status": "diverged", "step": 3}))
    write_failure(done, "non-finite", 3, [], started)
    assert json.loads(done.read_text())["status"] == "diverged" and json.loads(done.read_text())["exit_code"] == 3


@pytest.mark.parametrize("task, params, jobs", [
    (["model=rnn,lstm", "hidden_dim=64,128", "seed=1"], {}, 4),
    (["model=rnn,lstm", "model=gru"], {"optimizer.lr": "1e-3,3e-3"}, 2),  # a key's last override replaces the one before
    (["seed=range(1,4)"], {"model": "rnn,lstm"}, 6),
    (["optimizer.lr=interval(1e-4,1e-2)"], {}, None),  # the basic sweeper cannot sweep an interval: no count
])
def test_the_basic_sweepers_grid_is_counted_from_the_parsed_overrides(task, params, jobs):
    """sweep_status's job count, from Hydra's public override parser (no private sweeper call): one axis a key, the
    cross product of the discrete sweeps, as hydra's BasicSweeper.split_arguments forms its grid."""
    from omegaconf import OmegaConf

    from rnnlab.sweep_status import planned_jobs

    config = OmegaConf.create({"hydra": {"sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                                                     "params": params}, "overrides": {"task": task}}})
    assert planned_jobs(config) == jobs


def test_train_py_tells_hydras_flags_from_overrides_as_hydra_main_does():
    """train.py's own reading of the command line (`parsed_overrides`: the sweep's dir and varied keys) takes the
    flags that hydra.main's private parser takes with a value, and leaves the same overrides."""
    import importlib.util

    from hydra._internal.utils import get_args_parser

    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    def valued(parser):  # each flag that takes a value, and how many (None: one; "?": one or none)
        return {flag: action.nargs for action in parser._actions for flag in action.option_strings
                if action.nargs != 0}
    assert valued(train._HYDRA_FLAGS) == valued(get_args_parser())
    args = ["-m", "-cd", "conf", "--cfg", "job", "-p", "model", "--info", "config", "hidden_dim=8,16", "model=rnn", "-r"]
    assert train._HYDRA_FLAGS.parse_known_args(args)[0].overrides == \
        get_args_parser().parse_known_args(args)[0].overrides == ["hidden_dim=8,16", "model=rnn"]
