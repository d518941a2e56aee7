"""A grid as one program (rnnlab.population, hydra/launcher=population): every member ends as its own run
ends (its results.json, checkpoints and TensorBoard run against `train_and_evaluate`'s, the independent
reference here), a diverged member stops alone, a rerun resumes every member at the step all of them saved,
and the launcher writes the run dirs the basic launcher writes."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT, TEXT_FIXTURE_DATA, TINY, run_train, saved_state, tiny_config, train_env

BASE = ["model=gru", "data=parity", "steps=8", "checkpoint.every=4", "eval_every=4", "log_every=2"]
GRID = [("optimizer.lr=1e-3", "seed=0"), ("optimizer.lr=3e-3", "seed=1"), ("optimizer.lr=1e-2", "seed=0")]
RESULT_KEYS = ("status", "step", "task", "eval_metric_name", "num_params", "tokens_per_step", "num_devices")
CLOSE_KEYS = ("train_loss", "eval_loss", "eval_metric")


def members(tmp_path, grid, *extra):
    from rnnlab.population import Member

    return [Member(tiny_config(*BASE, *extra, *g), tmp_path / f"member{i}", g, g) for i, g in enumerate(grid)]


def alone(tmp_path, grid, *extra):
    """Each member's results.json as `train_and_evaluate` writes it for the member alone."""
    from rnnlab.report import NonFiniteLossError
    from rnnlab.trainer import train_and_evaluate

    out = []
    for i, g in enumerate(grid):
        workdir = tmp_path / f"alone{i}"
        try:
            train_and_evaluate(tiny_config(*BASE, *extra, *g), workdir, g, g)
        except NonFiniteLossError:
            pass
        out.append(json.loads((workdir / "results.json").read_text()))
    return out


def assert_same_results(a, b, rtol=1e-5):
    for key in RESULT_KEYS:
        assert a[key] == b[key], key
    for key in CLOSE_KEYS:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, err_msg=key)
    for key in [k for k in b if k.startswith("test_")]:  # data=text: the test text, evaluated at the end
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, err_msg=key)
    for n, metrics in b["eval_by_len"].items():
        for name, value in metrics.items():
            np.testing.assert_allclose(a["eval_by_len"][n][name], value, rtol=rtol, err_msg=f"{n} {name}")


def leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


@pytest.mark.parametrize("extra", [
    pytest.param(("device.num_devices=2", "data=copy", "data.seq_len=12", "model=lstm"), id="pmap-2-devices-copy",
                 marks=pytest.mark.slow("long")),
    pytest.param(("device.num_devices=2", "device.strategy=shard_map", "data.eval_seq_lens=[6,12]",
                  "data.eval_segment_len=4", "log.histograms_every=4"), id="shard_map-segments-histograms",
                 marks=pytest.mark.slow("cross-product")),
    pytest.param((*TEXT_FIXTURE_DATA, "model=lstm", "num_layers=1", "batch_size=4", "device.num_devices=2",
                  "log.histograms_every=4"), id="text-2-devices-histograms", marks=pytest.mark.slow("long")),
])
def test_each_member_ends_as_its_own_run(tmp_path, extra):
    from rnnlab.trainer import train_population

    population = members(tmp_path, GRID, *extra)
    outcome = train_population(population)
    for member, (results, error), single in zip(population, outcome, alone(tmp_path, GRID, *extra)):
        assert error is None
        assert json.loads((member.workdir / "results.json").read_text()) == json.loads(json.dumps(results))
        assert_same_results(results, single)
        i = population.index(member)
        mine, its = saved_state(member.workdir, 8), saved_state(tmp_path / f"alone{i}", 8)
        for x, y in zip(leaves(mine), leaves(its)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
        for tag in ("train/loss", "eval/loss"):
            got, want = scalars(member.workdir, tag), scalars(tmp_path / f"alone{i}", tag)
            assert [s for s, _ in got] == [s for s, _ in want]
            np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-5)
        if "log.histograms_every=4" in extra:
            assert scalars(member.workdir, "grad_norm/" + scalars_tag(member.workdir))
        if "data=text" in extra:  # its carried streams trained as its run's, its test text and samples its own
            assert results["test_bpc"] == pytest.approx(single["test_bpc"], rel=1e-5)
            samples = texts(member.workdir, "eval/samples")
            assert samples and samples == texts(tmp_path / f"alone{i}", "eval/samples")
        assert (member.workdir / "model_summary.txt").is_file()


def texts(run_dir, tag):
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    return [(e.step, e.tensor_proto.string_val[0]) for e in events.Tensors(f"{tag}/text_summary")]


def scalars_tag(run_dir):
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return next(t for t in events.Tags()["scalars"] if t.startswith("grad_norm/")).split("/", 1)[1]


@pytest.mark.slow("long")
def test_a_diverged_member_stops_alone_where_its_run_stops(tmp_path):
    from rnnlab.trainer import train_population
    from rnnlab.report import NonFiniteLossError

    grid = [("optimizer.lr=1e-3", "seed=0"), ("optimizer.lr=1e38", "seed=0")]
    extra = ("optimizer.clip_norm=0",)
    outcome = train_population(members(tmp_path, grid, *extra))
    single = alone(tmp_path, grid, *extra)
    assert single[1]["status"] == "diverged"  # the grid's second lr diverges alone too
    (ok, ok_error), (bad, bad_error) = outcome
    assert ok_error is None and bad["status"] == "diverged" and isinstance(bad_error, NonFiniteLossError)
    assert bad["step"] == single[1]["step"] and bad["error"] == single[1]["error"]
    assert_same_results(ok, single[0])
    # No checkpoint at or after the step where it diverged, as for the run alone.
    saved = sorted(int(p.name) for p in (tmp_path / "member1" / "checkpoints").iterdir() if p.name.isdigit())
    assert all(step < bad["step"] for step in saved)


@pytest.mark.slow("long")
def test_a_rerun_resumes_every_member_at_the_newest_step_all_saved(tmp_path, caplog):
    """As after a SIGKILL between the members' saves: one member lacks the newest checkpoint."""
    from rnnlab.trainer import train_population

    population = members(tmp_path, GRID[:2])
    train_population(population)
    finished = [saved_state(m.workdir, 8) for m in population]
    shutil.rmtree(population[0].workdir / "checkpoints" / "8")
    for m in population:  # killed before the end: no final record (a finished member is left as it is)
        (m.workdir / "results.json").unlink()
    with caplog.at_level("INFO"):
        outcome = train_population(population)
    assert [(r["status"], r["step"]) for r, _ in outcome] == [("completed", 8), ("completed", 8)]
    assert f"deleted checkpoint {population[1].workdir / 'checkpoints' / '8'}: training resumes from step 4" \
        in caplog.text
    for member, before in zip(population, finished):
        for x, y in zip(leaves(saved_state(member.workdir, 8)), leaves(before)):
            np.testing.assert_array_equal(x, y)


@pytest.mark.slow("long")
def test_a_member_that_would_start_afresh_beside_trained_ones_is_refused_and_nothing_is_deleted(tmp_path):
    from rnnlab.checkpoint import CheckpointError
    from rnnlab.trainer import train_population

    pair = members(tmp_path, GRID[:2])
    train_population(pair)
    saved = sorted(p.name for p in (pair[0].workdir / "checkpoints").iterdir())
    # The same two, to train on (their records are not final: another step count), and a new one without checkpoints.
    grown = members(tmp_path, GRID, "steps=12", "checkpoint.allow_changes=[steps]")
    with pytest.raises(CheckpointError, match="would start afresh"):
        train_population(grown)
    assert sorted(p.name for p in (pair[0].workdir / "checkpoints").iterdir()) == saved


def test_a_member_axis_of_one_gives_what_jax_vmap_gives():
    """`steps.over_members` squeezes a member axis of one rather than vmapping it (so that a population of one
    compiles as its run alone): the same values as jax.vmap, the axis anywhere in an input or in none, the outputs'
    one axis for all or one each."""
    import jax
    import jax.numpy as jnp

    from rnnlab.steps import over_members

    def fn(a, b, shared):
        return (a * b[:, None] + shared["x"]).sum(0), {"y": a @ a.T, "z": b.mean()}

    rng = np.random.default_rng(0)
    shared = {"x": rng.normal(size=(3, 2))}
    for in_axes, out_axes in [((0, 1, None), (1, 0)), ((0, 1, None), 0), ((2, 0, None), 0)]:
        a = rng.normal(size=(1, 3, 2) if in_axes[0] == 0 else (3, 2, 1))
        b = rng.normal(size=(3, 1) if in_axes[1] == 1 else (1, 3))
        want = jax.vmap(fn, in_axes, out_axes)(a, b, shared)
        got = over_members(fn, 1, in_axes, out_axes)(a, b, shared)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert x.shape == y.shape
            np.testing.assert_allclose(x, y, rtol=1e-6)
    assert jnp.shape(over_members(lambda x: x.sum(), 1, 0, 0)(jnp.ones((1, 4)))) == (1,)


def test_a_population_of_one_trains_as_its_run_alone():
    """The dispatch of a population of one (`steps.Members.population`) steps its member as the run's own dispatch
    steps the run: the same metrics and parameters (to float rounding: XLA fuses the two programs apart)."""
    import jax

    from rnnlab import parallel, steps, tasks
    from rnnlab.models import build_model

    config = tiny_config("model=gru", "data=parity")
    task = tasks.make_task(config.data)
    dp = parallel.DataParallel(jax.devices()[:1], "pmap")
    model = build_model(config.model, task.output_dim, input_dim=task.input_dim)
    tx, _ = steps.make_optimizer(config.optimizer, config.steps)
    state = steps.create_train_state(jax.random.key(0), model, task.example_inputs(config.batch_size), tx)
    one = steps.PopulationState(jax.tree_util.tree_map(lambda x: x[None], state), np.ones(1, bool))
    out = {}
    for name, members, start in [("alone", steps.Members.alone(config), state),
                                 ("one", steps.Members.population([config]), one)]:
        dispatch = steps.make_dispatch(config, task, dp, config.batch_size, 4, members)
        st, rows = dp.replicate(start), []
        for _ in range(3):
            st, metrics = dispatch(st, 4)
            rows.append(metrics)
        out[name] = jax.device_get((st.params, rows))
    (params, rows), (params_one, rows_one) = out["alone"], out["one"]
    np.testing.assert_allclose(np.reshape(rows_one, -1), np.reshape(rows, -1), rtol=1e-5, atol=1e-7)
    for x, y in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params_one)):
        np.testing.assert_allclose(y[:, 0], x, rtol=1e-5, atol=1e-7)  # [device, member, ...] against [device, ...]


def test_members_that_differ_in_the_program_are_refused(tmp_path):
    from rnnlab.config import ConfigError
    from rnnlab.population import Member, check_members

    a = Member(tiny_config(*BASE), tmp_path / "a")
    for other, key in ((("hidden_dim=16",), "hidden_dim"), (("optimizer.clip_norm=0",), "optimizer.clip_norm"),
                       (("steps=9",), "steps")):
        with pytest.raises(ConfigError, match=f"key '{key}"):
            check_members([a, Member(tiny_config(*BASE, *other), tmp_path / "b")])


def test_a_population_that_cannot_fit_says_how_many_members_would(tmp_path, monkeypatch):
    from rnnlab import memory
    from rnnlab.trainer import train_population

    # A step of 3 GiB for 3 members (1 GiB each) where 2.5 GiB is free: 2 would fit.
    stats = type("Stats", (), {"temp_size_in_bytes": 3 * 2**30, "output_size_in_bytes": 0, "alias_size_in_bytes": 0})()
    monkeypatch.setattr(memory, "free_bytes", lambda devices: 2.5 * 2**30)
    gpu = type("Device", (), {"platform": "gpu"})()
    with pytest.raises(memory.OutOfMemoryError, match=r"population of 3 members .* about 2 member\(s\) fit"):
        memory.check_population_fits(stats, 0.0, 3, [gpu], tiny_config(*BASE))
    monkeypatch.setattr(memory, "free_bytes", lambda devices: 4 * 2**30)
    memory.check_population_fits(stats, 0.0, 3, [gpu], tiny_config(*BASE))  # fits: no error


SWEEP = [o for o in TINY if not o.startswith(("steps", "checkpoint.every", "eval_every"))] + [
    "model=gru", "data=parity", "optimizer.lr=1e-3,3e-3", "seed=0,1"]


def run_dirs(sweep_dir):
    return sorted(p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name[0].isdigit())


@pytest.mark.slow("end-to-end")
def test_the_launcher_writes_what_the_basic_launcher_writes(tmp_path):
    common = ["-m", *SWEEP, "steps=12", "eval_every=6", "checkpoint.every=6"]
    population = run_train([*common, "hydra/launcher=population", f"hydra.sweep.dir={tmp_path / 'population'}"],
                           cwd=tmp_path)
    basic = run_train([*common, f"hydra.sweep.dir={tmp_path / 'basic'}"], cwd=tmp_path)
    assert population.returncode == 0 and basic.returncode == 0, population.stderr[-2000:]
    # The terminal: the status lines, none of the jobs' own lines.
    assert "[4/4] 0 running, 0 left, 0 failed" in population.stdout and "step 12/12" not in population.stdout
    mine, theirs = run_dirs(tmp_path / "population"), run_dirs(tmp_path / "basic")
    assert [p.name for p in mine] == [p.name for p in theirs] and len(mine) == 4
    for a, b in zip(mine, theirs):
        assert_same_results(json.loads((a / "results.json").read_text()), json.loads((b / "results.json").read_text()))
        assert (a / ".hydra" / "overrides.yaml").read_text() == (b / ".hydra" / "overrides.yaml").read_text()
        assert "step 12/12" in (a / "train.log").read_text()


def start_and_stop(command, sweep_dir, at_step, signum, cwd):
    """Start the sweep, send `signum` once a member has saved a checkpoint at `at_step` or later; its exit code."""
    proc = subprocess.Popen(command, cwd=cwd, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        saved = [int(p.name) for d in sweep_dir.glob("*/checkpoints") for p in d.iterdir() if p.name.isdigit()]
        if saved and max(saved) >= at_step:
            break
        time.sleep(0.05)
    proc.send_signal(signum)
    return proc.wait(timeout=120)


@pytest.mark.slow("end-to-end")
def test_a_grown_grid_trains_the_new_member_apart_and_keeps_the_finished_ones(tmp_path):
    common = ["-m", *[o for o in SWEEP if not o.startswith(("seed=", "optimizer.lr="))], "steps=12", "eval_every=6",
              "checkpoint.every=6", "hydra/launcher=population", f"hydra.sweep.dir={tmp_path / 's'}"]
    assert run_train([*common, "seed=0,1"], cwd=tmp_path).returncode == 0
    files = lambda run: {str(f.relative_to(run)): (f.read_bytes(), f.stat().st_mtime_ns)  # noqa: E731
                         for f in run.rglob("*") if f.is_file() and ".rnnlab.lock" not in f.name}
    before = {p.name: files(p) for p in run_dirs(tmp_path / "s")}
    proc = run_train([*common, "seed=0,1,2"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = {p.name: json.loads((p / "results.json").read_text()) for p in run_dirs(tmp_path / "s")}
    assert len(after) == 3 and all(r["status"] == "completed" for r in after.values())
    for name, written in before.items():  # the finished members' records are final: nothing retrained or rewritten
        assert files(tmp_path / "s" / name) == written
    assert "[3/3] 0 running, 0 left, 0 failed" in proc.stdout  # and counted as done
    assert len(list((tmp_path / "s").glob("population_*.log"))) == 2


@pytest.mark.slow("end-to-end")
def test_sigterm_and_sigkill_then_the_same_command_ends_as_an_uninterrupted_population(tmp_path):
    common = ["-m", *SWEEP, "steps=300", "eval_every=150", "checkpoint.every=10", "log_every=10",
              "hydra/launcher=population"]
    killed = tmp_path / "killed"
    command = [sys.executable, str(ROOT / "train.py"), *common, f"hydra.sweep.dir={killed}"]
    assert start_and_stop(command, killed, 50, signal.SIGTERM, tmp_path) == 75  # every member saved, then exit 75
    stopped = [json.loads((d / "results.json").read_text()) for d in run_dirs(killed)]
    assert {r["status"] for r in stopped} == {"preempted"} and len({r["step"] for r in stopped}) == 1
    assert all((d / "checkpoints" / str(stopped[0]["step"])).is_dir() for d in run_dirs(killed))
    assert start_and_stop(command, killed, stopped[0]["step"] + 50, signal.SIGKILL, tmp_path) == -signal.SIGKILL
    assert run_train([*common, f"hydra.sweep.dir={killed}"], cwd=tmp_path).returncode == 0
    whole = run_train([*common, f"hydra.sweep.dir={tmp_path / 'whole'}"], cwd=tmp_path)
    assert whole.returncode == 0
    for a, b in zip(run_dirs(killed), run_dirs(tmp_path / "whole")):
        assert json.loads((a / "results.json").read_text())["status"] == "completed"
        for x, y in zip(leaves(saved_state(a, 300)), leaves(saved_state(b, 300))):
            np.testing.assert_array_equal(x, y)


@pytest.mark.slow("end-to-end")
def test_bad_launcher_keys_exit_2_with_one_line(tmp_path):
    proc = run_train(["-m", *SWEEP, "hydra/launcher=population", "hydra.launcher.member_keys=[model]",
                      f"hydra.sweep.dir={tmp_path / 's'}"], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "key 'hydra.launcher.member_keys': got 'model', allowed: optimizer.lr, seed" in proc.stderr


@pytest.mark.slow("end-to-end")
def test_the_device_check_runs_at_a_toy_size(tmp_path):
    """scripts/bench_population.py, as scripts/gpu_population.sh runs it on a device, at a toy size on the CPU."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_population.py"), "--toy", "--cells", "gru",
                           "--lrs", "1e-3", "3e-3", "--seeds", "1", "--steps", "10", "--launchers", "population", "basic",
                           "--out", str(tmp_path / "runs"), "--json", str(out)],
                          cwd=tmp_path, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["launcher"], r["jobs"], r["train_step_compiles"]) for r in rows] == [("population", 2, 1), ("basic", 2, 2)]
    np.testing.assert_allclose(rows[0]["eval_losses"], rows[1]["eval_losses"], rtol=1e-5)
    assert all(r["steps_per_sec_per_member"] > 0 and r["wall_seconds"] > 0 and r["peak_rss_mb"] > 0 for r in rows)
    assert "| gru | population | 2 |" in proc.stdout
