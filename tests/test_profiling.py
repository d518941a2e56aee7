"""profile.* captures a jax.profiler trace (and a memory profile) of a window of steps."""

import pytest

from conftest import compose_config
from rnnlab.config import ConfigError
from rnnlab.trainer import train_and_evaluate


@pytest.mark.slow("long")
def test_profile_window_writes_a_trace_and_a_memory_profile(tmp_path, tiny):
    config = tiny("profile.start_step=3", "profile.num_steps=2", "profile.memory=true")
    train_and_evaluate(config, tmp_path)
    traces = list((tmp_path / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert (tmp_path / "tensorboard" / "memory_step4.prof").stat().st_size > 0


@pytest.mark.slow("long")
def test_profile_window_inside_multi_step_dispatches(tmp_path, tiny):
    # With 8 steps per dispatch and nothing else to stop at before step 16, dispatches end at
    # the window's edges (steps 4 and 7), so the trace holds steps 5-7 and no more.
    config = tiny("steps=16", "log_every=16", "eval_every=16", "checkpoint.every=0", "device.steps_per_dispatch=8",
                  "profile.start_step=5", "profile.num_steps=3", "profile.memory=true")
    train_and_evaluate(config, tmp_path)
    assert len(list((tmp_path / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))) == 1
    assert [p.name for p in (tmp_path / "tensorboard").glob("memory_step*.prof")] == ["memory_step7.prof"]


@pytest.mark.slow("long")
def test_profiling_is_off_by_default(tmp_path, tiny):
    config = tiny()
    assert config.profile.num_steps == 0
    train_and_evaluate(config, tmp_path)
    assert not (tmp_path / "tensorboard" / "plugins").exists()


@pytest.mark.parametrize("override, key", [("profile.num_steps=-1", "profile.num_steps"), ("profile.start_step=0", "profile.start_step")])
def test_bad_profile_keys_are_refused(override, key):
    with pytest.raises(ConfigError, match=key):
        compose_config([override])


def test_the_window_starts_and_stops_the_trace_at_its_edges_and_waits_only_at_its_end(tmp_path, monkeypatch, tiny):
    """StepProfiler's window alone, jax.profiler's calls recorded (the real capture: the test above)."""
    import jax

    from rnnlab.profiling import StepProfiler

    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda logdir: calls.append(("start", logdir)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    monkeypatch.setattr(jax.profiler, "save_device_memory_profile", lambda path: calls.append(("memory", path)))
    monkeypatch.setattr(jax, "block_until_ready", lambda outputs: calls.append(("wait", outputs)))

    def run(*overrides, last=6):
        calls.clear()
        profiler = StepProfiler(tiny(*overrides).profile, tmp_path / "tb")
        for step in range(1, last + 1):
            profiler.begin(step)
            calls.append(("step", step))
            profiler.end(step, f"outputs of {step}")
        profiler.stop()  # as the loop does at its end: idempotent
        return list(calls)

    logdir = str(tmp_path / "tb")
    assert run("profile.start_step=3", "profile.num_steps=2", "profile.memory=true") == [
        ("step", 1), ("step", 2), ("start", logdir), ("step", 3), ("step", 4), ("wait", "outputs of 4"), ("stop",),
        ("memory", str(tmp_path / "tb" / "memory_step4.prof")), ("step", 5), ("step", 6)]
    assert run("profile.start_step=5", "profile.num_steps=4", last=6) == [  # the run ends inside the window
        ("step", 1), ("step", 2), ("step", 3), ("step", 4), ("start", logdir), ("step", 5), ("step", 6), ("stop",)]
    assert run() == [("step", s) for s in range(1, 7)]  # off by default
