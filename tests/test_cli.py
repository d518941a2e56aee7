"""`python train.py` as a user runs it, each in a fresh process (device count set at start)."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT, TINY, run_train
from rnnlab import cpu

pytestmark = pytest.mark.slow("end-to-end")
TINY_CLI = [o for o in TINY if not o.startswith("device")]


def test_readme_command_with_top_level_hidden_dim(tmp_path):
    proc = run_train(["model=rnn", "hidden_dim=100", *[o for o in TINY_CLI if not o.startswith("hidden_dim")],
                      f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["status"] == "completed" and results["step"] == 6
    assert results["steps_per_dispatch"] == 8  # device.steps_per_dispatch=null on CPU
    run_config = json.loads((tmp_path / "checkpoints" / "run_config.json").read_text())
    assert run_config["device.steps_per_dispatch"] is None and run_config["device.steps_per_dispatch_used"] == 8
    summary = (tmp_path / "model_summary.txt").read_text()
    assert "kernel: float32[2,100]" in summary and ",100,100]" in summary  # hidden_dim=100 reached the model
    assert "baseline 0.1667" in proc.stdout + proc.stderr
    # device.num_devices=null on CPU: this step of middling size runs on one device per core by rule
    # (cpu.device_count_by_rule), untimed, said so.
    most = cpu.cpu_device_count(8, cpu.max_cpu_devices())
    assert results["num_devices"] in (1, most)
    if 1 < most <= cpu.RULE_DEVICES:
        assert results["num_devices"] == most and "(untimed, by rule: " in proc.stdout + proc.stderr


def test_a_step_too_small_to_gain_runs_on_one_device_untimed(tmp_path):
    """debug=fast's step is far below cpu.ONE_DEVICE_BELOW_FLOPS_PER_TIME_STEP: one device, nothing timed."""
    proc = run_train(["debug=fast", "device=cpu", f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 cpu device(s)" in proc.stdout + proc.stderr and "(untimed, by rule: " in proc.stdout + proc.stderr
    assert "timing this model shape" not in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "results.json").read_text())["num_devices"] == 1


def test_four_simulated_devices(tmp_path):
    proc = run_train([*TINY_CLI, "device.num_devices=4", "batch_size=32", f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 cpu device(s) x batch 8" in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "results.json").read_text())["num_devices"] == 4


@pytest.mark.parametrize(
    "args,key",
    [
        (["device.num_devices=4", "batch_size=30"], "'batch_size': got 30, must be divisible by the 4 devices"),
        (["model.cell=transformer"], "'model.cell': got 'transformer', allowed: attention, deltanet, gated_deltanet, deltaproduct, gla, linear_attention, "
                                      "gru, lru, lstm, mamba, mamba2, mingru, minlstm, mlstm, rglru, rnn, rwkv7, slstm"),
        (["hidden_dim=-3"], "'hidden_dim': got -3, must be > 0"),
        (["data.seq_len=abc"], "'data.seq_len': got 'abc', expected an integer"),
        (["model=lstm", "model.time_scan=associative"], "'model.time_scan': got 'associative', allowed for cell 'lstm': sequential"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path, args, key):
    proc = run_train([*TINY_CLI, *args, f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert key in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints").exists() or not any(p.name.isdigit() for p in (tmp_path / "checkpoints").iterdir())


def test_multirun_writes_one_readable_run_per_job(tmp_path):
    proc = run_train(["-m", "--config-name", "config", "hidden_dim=8,16", "steps=4", "log_every=2", "eval_every=4", "batch_size=8",
                      "data.seq_len=6", f"hydra.sweep.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.iterdir() if (p / "results.json").exists())
    # Job dirs are named by their number and the swept overrides alone, so TensorBoard's run names are
    # short; flags with a value of their own (--config-name config) are not overrides.
    assert [job.name for job in jobs] == ["0_hidden_dim=8", "1_hidden_dim=16"]
    for job in jobs:
        events = EventAccumulator(str(job / "tensorboard"))
        events.Reload()
        assert [e.step for e in events.Scalars("train/loss")] == [2, 4]


def test_console_is_quiet_short_and_printed_once(tmp_path):
    """No JAX backend INFO line, lines start with the time and fit 120 columns, `--info` once."""
    proc = run_train(["debug=fast", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert not [line for line in lines if "Unable to initialize backend" in line or "xla_bridge" in line]
    logged = [line for line in lines if line[:2].isdigit() and line[2] == ":"]  # "14:03:27 message"
    assert any(" step 4/4 | loss " in line for line in logged) and all(len(line) <= 120 for line in logged)
    info = run_train(["--info"], cwd=tmp_path).stdout
    assert info.count("Installed Hydra Plugins") == 1 and info.count("Config search path") == 1


def test_sweeper_params_with_a_plus_prefix_count_as_varied(monkeypatch):
    import importlib.util

    from hydra.types import RunMode
    from omegaconf import OmegaConf

    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    node = OmegaConf.create({"mode": RunMode.MULTIRUN, "sweeper": {"params": {"+model.r_min": "0.5,0.9"}},
                             "overrides": {"task": ["steps=600", "+model.r_min=0.5", "hidden_dim=8"]}})
    monkeypatch.setenv(train.SWEPT_KEYS_ENV, "hidden_dim")
    assert train.varied_overrides(node) == ["+model.r_min=0.5", "hidden_dim=8"]
    assert train.swept_keys(["-m", "-cd", "conf", "hidden_dim=8,16", "model=rnn,gru", "steps=3"]) == ["hidden_dim", "model"]
