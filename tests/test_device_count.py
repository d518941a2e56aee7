"""device.num_devices=null on CPU: the measured device count, its cache, and resume keeping it."""

import json

import pytest

from conftest import tiny_config
from rnnlab import cpu
from rnnlab.rundir import DEVICES_USED_KEY
from rnnlab.trainer import train_and_evaluate


def test_cpu_device_count_is_the_largest_count_the_batch_divides_into():
    assert cpu.cpu_device_count(32, 2) == 2
    assert cpu.cpu_device_count(30, 4) == 3
    assert cpu.cpu_device_count(7, 4) == 1
    assert cpu.cpu_device_count(1, 16) == 1


def test_max_cpu_devices_honours_the_environment_cap(monkeypatch):
    monkeypatch.setenv("RNNLAB_MAX_CPU_DEVICES", "1")
    assert cpu.max_cpu_devices() == 1
    monkeypatch.delenv("RNNLAB_MAX_CPU_DEVICES")
    assert cpu.max_cpu_devices() == min(cpu.host_cores(), cpu.MAX_CPU_DEVICES)


def test_the_rule_runs_small_steps_on_one_device_middling_ones_on_all_and_times_the_rest():
    low, high = cpu.ONE_DEVICE_BELOW_FLOPS_PER_TIME_STEP, cpu.TIMED_ABOVE_FLOPS_PER_TIME_STEP
    assert cpu.device_count_by_rule(0.5 * low * 100, 100, 2) == 1
    assert cpu.device_count_by_rule(low * 100, 100, 2) == 2
    assert cpu.device_count_by_rule(0.99 * high * 100, 100, 2) == 2
    assert cpu.device_count_by_rule(high * 100, 100, 2) is None
    assert cpu.device_count_by_rule(low * 100, 100, cpu.RULE_DEVICES + 1) is None  # more devices than measured
    assert cpu.device_count_by_rule(low, 0, 2) == 2  # no time steps: as one


@pytest.mark.parametrize("overrides, count", [
    (["debug=fast"], 1),
    (["model=rnn", "hidden_dim=100", "batch_size=32", "data.seq_len=100"], 2),  # 1.23x: docs/benchmarks-history.md
    (["model=deltanet", "hidden_dim=24", "data=mqar", "data.vocab_size=16", "data.num_pairs=2", "data.seq_len=20"], 2),
    (["model=lstm", "hidden_dim=1024", "batch_size=32", "data.seq_len=100"], None),  # 0.69-0.76x: timed
])
def test_the_rule_on_the_shapes_it_was_measured_on(overrides, count):
    """Without compiling: the smoke test on one device, the Elman row and an MQAR-sized DeltaNet on two, a
    wide LSTM (whose matmuls use both cores already) timed."""
    from conftest import compose_config
    from rnnlab import flops, tasks

    config = compose_config(overrides)
    task = tasks.make_task(config.data)
    step = flops.train_step_flops(config.model, task.input_dim, task.output_dim, config.batch_size * task.total_len,
                                  task.total_len, task.token_inputs)
    assert cpu.device_count_by_rule(step, task.total_len, 2) == count


def test_device_count_is_measured_once_then_read_from_the_cache(tmp_path):
    cache = tmp_path / "device_count.json"
    calls = []

    def seconds_per_step(n):
        calls.append(n)
        return {1: 0.010, 2: 0.007}[n]

    assert cpu.choose_device_count("model A", [1, 2], seconds_per_step, cache) == (2, {1: 0.010, 2: 0.007}, False)
    assert calls == [1, 2]
    assert cpu.choose_device_count("model A", [1, 2], seconds_per_step, cache) == (2, {1: 0.010, 2: 0.007}, True)
    assert calls == [1, 2]  # read back, not measured again
    assert cpu.choose_device_count("model B", [1, 2], {1: 0.010, 2: 0.020}.get, cache)[0] == 1
    assert set(json.loads(cache.read_text())) == {"model A", "model B"}
    # A cached count that is no longer a candidate (fewer devices now) is measured again.
    assert cpu.choose_device_count("model A", [1], {1: 0.5}.get, cache) == (1, {1: 0.5}, False)


def test_more_devices_must_win_by_the_margin(tmp_path):
    timings = {1: 0.0100, 2: 0.0098}  # 2% faster: within the noise, keep one device
    assert cpu.choose_device_count("k", [1, 2], timings.get, tmp_path / "device_count.json")[0] == 1


def _unwritable(tmp_path):
    """A cache path whose parent is a file: no write can succeed, whoever runs the test."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    return blocker / "device_count.json"


def test_a_damaged_or_unwritable_cache_is_measured_again_and_replaced(tmp_path):
    cache = tmp_path / "device_count.json"
    for damage in ("not json", "[]", "null", json.dumps({"k": {"num_devices": "x"}}), json.dumps({"k": 3})):
        cache.write_text(damage)
        assert cpu.choose_device_count("k", [1, 2], {1: 0.01, 2: 0.005}.get, cache) == (2, {1: 0.01, 2: 0.005}, False)
        assert json.loads(cache.read_text())["k"]["num_devices"] == 2
    assert cpu.choose_device_count("k", [1, 2], {1: 0.01, 2: 0.005}.get, _unwritable(tmp_path))[0] == 2
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.slow("long")
def test_a_resumed_run_keeps_the_device_count_its_run_dir_recorded(tmp_path, caplog, monkeypatch):
    if cpu.max_cpu_devices() < 2:
        pytest.skip("one core: device.num_devices=null has nothing to choose")
    monkeypatch.setattr(cpu, "device_count_by_rule", lambda *args: None)  # time even this tiny step
    measured = train_and_evaluate(tiny_config("device.num_devices=null"), tmp_path / "measured")["num_devices"]
    # A run dir trained on the other count: resumed with null, it must follow its record,
    # not the (cached) measurement.
    other = 1 if measured > 1 else 2
    run_dir = tmp_path / "run"
    train_and_evaluate(tiny_config(f"device.num_devices={other}"), run_dir)
    assert json.loads((run_dir / "checkpoints" / "run_config.json").read_text())[DEVICES_USED_KEY] == other
    with caplog.at_level("INFO", logger="rnnlab.trainer"):
        resumed = train_and_evaluate(tiny_config("device.num_devices=null", "steps=9",
                                                 "checkpoint.allow_changes=[steps]"), run_dir)
    assert resumed["step"] == 9 and resumed["num_devices"] == other
    assert f"device.num_devices=null: {other}, as this run dir was trained" in caplog.text
