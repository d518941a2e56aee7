"""Hardening (issue 23): damaged or hand-edited caches never reach a result, JSON is strict JSON,
the distributed coordinator listens on one address, and pin locks never follow a link."""

import inspect
import json
import math
import os
from pathlib import Path

import jax
import pytest

from conftest import compose_config
from rnnlab import cpu, files, flops, metrics, parallel
from rnnlab.config import ConfigError, DistributedConfig


def strict_json(text):
    """Parse as a strict JSON parser would: NaN, Infinity and -Infinity are errors."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# --- peak FLOP/s cache ----------------------------------------------------------------------------

MEASURED = 3.0e10


@pytest.fixture
def peak_cache(tmp_path, monkeypatch):
    """An empty cache dir, and a quick measurement that returns MEASURED and counts its calls."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def measure(n, kind, device=None, **kwargs):
        calls.append((n, kind))
        return MEASURED

    monkeypatch.setattr(flops, "measure_matmul_flops", measure)
    flops.cache_path().parent.mkdir(parents=True)
    return flops.cache_path(), calls


ABSURD_ENTRIES = {
    "tiny": '{"flops_per_sec": 1e-3}',
    "huge": '{"flops_per_sec": 1e30}',
    "negative": '{"flops_per_sec": -5}',
    "nan": '{"flops_per_sec": NaN}',  # Python's json module reads (and used to write) this
    "infinite": '{"flops_per_sec": Infinity}',
    "string": '{"flops_per_sec": "fast"}',
    "list": '{"flops_per_sec": [1]}',
    "bool": '{"flops_per_sec": true}',
    "not an object": '"fast"',
    # a quick-measured entry whose figure was edited: plausible alone, 100x from its own measurement
    "edited quick entry": '{"flops_per_sec": 1e8, "quick_flops_per_sec": 1e10}',
}


ABSURD_FILES = {"file not json": "not json {", "file a list": "[1, 2]", "file a string": '"fast"', "file null": "null"}


@pytest.mark.parametrize("entry, text", [*((e, None) for e in ABSURD_ENTRIES.values()),
                                         *((None, f) for f in ABSURD_FILES.values())],
                         ids=[*ABSURD_ENTRIES, *ABSURD_FILES])
def test_an_absurd_cached_peak_is_measured_again_and_replaced(peak_cache, entry, text, caplog):
    """`entry`: this device's float32 entry as written in the file; `text`: the whole file."""
    path, calls = peak_cache
    device = jax.devices("cpu")[0]
    path.write_text(text if entry is None else '{"%s": {"float32": %s}}' % (flops.device_key(device), entry))
    assert flops.peak_flops(device, "float32", measure=False) is None  # never the absurd value
    with caplog.at_level("WARNING", logger="rnnlab.flops"):
        peak = flops.peak_flops(device, "float32")
    assert peak == MEASURED and calls == [(flops.QUICK_N, "float32")]
    assert str(path) in caplog.text  # the warning names the file to look at
    assert flops.mfu(1.5e10, peak, [device]) == 0.5
    entry = strict_json(path.read_text())[flops.device_key(device)]["float32"]
    assert entry["flops_per_sec"] == entry["quick_flops_per_sec"] == MEASURED
    assert flops.peak_flops(device, "float32") == MEASURED and len(calls) == 1  # read back, not measured again


def test_mfu_is_none_unless_finite_and_positive():
    devices = jax.devices("cpu")[:1]
    assert flops.mfu(1e9, float("inf"), devices) is None
    assert flops.mfu(float("nan"), 1e9, devices) is None
    assert flops.mfu(-1e9, 1e9, devices) is None
    assert flops.mfu(1e9, -5.0, devices) is None
    assert flops.mfu(1e9, 2e9, devices) == 0.5


# --- measured CPU device count cache ----------------------------------------------------------------

FAKE_ENTRIES = {
    "negative time": '{"num_devices": 2, "seconds_per_step": {"1": 0.01, "2": -0.005}}',
    "nan time": '{"num_devices": 2, "seconds_per_step": {"1": 0.01, "2": NaN}}',
    "string time": '{"num_devices": 2, "seconds_per_step": {"1": "0.01", "2": "0.005"}}',
    "an hour a step": '{"num_devices": 2, "seconds_per_step": {"1": 0.01, "2": 7200}}',
    "missing candidate": '{"num_devices": 2, "seconds_per_step": {"2": 0.005}}',
    "count not a candidate": '{"num_devices": 2.5, "seconds_per_step": {"1": 0.01, "2": 0.005}}',
    "count a bool": '{"num_devices": true, "seconds_per_step": {"1": 0.01, "2": 0.005}}',
}


@pytest.mark.parametrize("entry", FAKE_ENTRIES.values(), ids=FAKE_ENTRIES)
def test_fake_cached_device_timings_are_measured_again(tmp_path, entry):
    cache = tmp_path / "device_count.json"
    cache.write_text('{"k": %s}' % entry)
    calls = []

    def seconds_per_step(n):
        calls.append(n)
        return {1: 0.02, 2: 0.01}[n]

    assert cpu.choose_device_count("k", [1, 2], seconds_per_step, cache) == (2, {1: 0.02, 2: 0.01}, False)
    assert calls == [1, 2]
    assert strict_json(cache.read_text())["k"] == {"num_devices": 2, "seconds_per_step": {"1": 0.02, "2": 0.01}}


# --- strict JSON ----------------------------------------------------------------------------------


def test_json_files_are_strict_json_with_null_for_non_finite_numbers(tmp_path):
    value = {"loss": math.nan, "curve": [1.5, math.inf, {"min": -math.inf}], "pair": (math.nan, 2), "ok": 0.25, "none": None}
    files.write_json(tmp_path / "x.json", value)
    assert strict_json((tmp_path / "x.json").read_text()) == {
        "loss": None, "curve": [1.5, None, {"min": None}], "pair": [None, 2], "ok": 0.25, "none": None}
    metrics.write_results(tmp_path / "results.json", {"final_eval_loss": math.nan, "steps": 3})
    assert strict_json((tmp_path / "results.json").read_text()) == {"final_eval_loss": None, "steps": 3}
    assert value["loss"] != value["loss"]  # the caller's value is left as it was


# --- the distributed coordinator's listening address ----------------------------------------------


def test_the_coordinator_binds_to_the_address_the_others_connect_to():
    bind = parallel.coordinator_bind_address
    assert bind("127.0.0.1:12355", None) == "127.0.0.1:12355"
    assert bind("node0.cluster:9", None) == "node0.cluster:9"
    assert bind("[::1]:9", None) == "[::1]:9"
    assert bind("127.0.0.1:12355", "0.0.0.0:12355") == "0.0.0.0:12355"  # an explicit bind address wins
    assert bind(None, None) is None  # auto-detection (TPU pod, SLURM): JAX decides
    for bad in ("127.0.0.1", "::1:9", ":9", "host:port"):
        with pytest.raises(ConfigError, match="distributed.coordinator_address"):
            bind(bad, None)


@pytest.fixture
def captured_initialize(monkeypatch):
    assert "coordinator_bind_address" in inspect.signature(jax.distributed.initialize).parameters
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    return calls


def _distributed(address, bind=None):
    return DistributedConfig(enabled=True, coordinator_address=address, num_processes=2, process_id=0, bind_address=bind)


# platform "gpu": on CPU initialize_distributed would also switch this test process's collectives to gloo
def test_initialize_distributed_binds_the_coordinator(captured_initialize, monkeypatch):
    parallel.initialize_distributed(_distributed("127.0.0.1:12355"), "gpu")
    parallel.initialize_distributed(_distributed("127.0.0.1:12355", "[::]:12355"), "gpu")
    parallel.initialize_distributed(_distributed(None), "gpu")
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "10.0.0.1:12355")  # JAX's own setting is left to JAX
    parallel.initialize_distributed(_distributed("127.0.0.1:12355"), "gpu")
    assert [c["coordinator_bind_address"] for c in captured_initialize] == ["127.0.0.1:12355", "[::]:12355", None, None]
    assert captured_initialize[0]["coordinator_address"] == "127.0.0.1:12355"


def test_bind_address_is_a_config_key():
    assert compose_config().distributed.bind_address is None
    assert compose_config(["distributed.bind_address=0.0.0.0:12355"]).distributed.bind_address == "0.0.0.0:12355"


# --- CPU pin locks --------------------------------------------------------------------------------

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux")


@pytest.fixture
def pinning(monkeypatch):
    """pin_to_free_core without pinning this test process: its affinity calls are recorded instead."""
    calls = []
    monkeypatch.setattr(cpu, "_pin", None)
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, mask: calls.append(mask))
    yield calls
    if cpu._pin is not None:
        cpu._pin[1].close()


@needs_affinity
def test_a_lock_dir_that_is_a_link_is_not_used(tmp_path, pinning, caplog):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "pins").symlink_to(target)
    with caplog.at_level("WARNING", logger="rnnlab.cpu"):
        assert cpu.pin_to_free_core(tmp_path / "pins") is None
    assert list(target.iterdir()) == [] and pinning == []
    assert "symbolic link" in caplog.text and str(tmp_path / "pins") in caplog.text


@needs_affinity
def test_a_lock_dir_others_may_write_to_is_not_used(tmp_path, pinning, caplog):
    lock_dir = tmp_path / "pins"
    lock_dir.mkdir()
    lock_dir.chmod(0o777)
    with caplog.at_level("WARNING", logger="rnnlab.cpu"):
        assert cpu.pin_to_free_core(lock_dir) is None
    assert list(lock_dir.iterdir()) == [] and pinning == []
    assert "777" in caplog.text


@needs_affinity
def test_a_lock_file_that_is_a_link_is_never_followed(tmp_path, pinning):
    lock_dir = tmp_path / "pins"
    lock_dir.mkdir(mode=0o700)
    cores = sorted(os.sched_getaffinity(0))
    outside = tmp_path / "outside"
    outside.mkdir()
    (lock_dir / f"cpu{cores[0]}.lock").symlink_to(outside / "created-through-the-link")
    core = cpu.pin_to_free_core(lock_dir)
    assert not (outside / "created-through-the-link").exists()
    if len(cores) == 1:
        assert core is None and pinning == []
    else:  # the linked core is skipped as if held; the next one is taken
        assert core == cores[1] and pinning and all(mask == {cores[1]} for mask in pinning)
        assert (lock_dir / f"cpu{cores[1]}.lock").stat().st_mode & 0o777 == 0o600


@needs_affinity
def test_a_missing_lock_dir_is_made_private(tmp_path, pinning):
    lock_dir = tmp_path / "pins"
    assert cpu.pin_to_free_core(lock_dir) == min(os.sched_getaffinity(0))
    assert Path(lock_dir).stat().st_mode & 0o777 == 0o700
