"""profile.* captures a jax.profiler trace (and a memory profile) of a window of steps."""

import pytest

from conftest import compose_config
from rnnlab.config import ConfigError
from rnnlab.trainer import train_and_evaluate


def test_profile_window_writes_a_trace_and_a_memory_profile(tmp_path, tiny):
    config = tiny("profile.start_step=3", "profile.num_steps=2", "profile.memory=true")
    train_and_evaluate(config, tmp_path)
    traces = list((tmp_path / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert (tmp_path / "tensorboard" / "memory_step4.prof").stat().st_size > 0


@pytest.mark.slow
def test_profile_window_inside_multi_step_dispatches(tmp_path, tiny):
    # With 8 steps per dispatch and nothing else to stop at before step 16, dispatches end at
    # the window's edges (steps 4 and 7), so the trace holds steps 5-7 and no more.
    config = tiny("steps=16", "log_every=16", "eval_every=16", "checkpoint.every=0", "device.steps_per_dispatch=8",
                  "profile.start_step=5", "profile.num_steps=3", "profile.memory=true")
    train_and_evaluate(config, tmp_path)
    assert len(list((tmp_path / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))) == 1
    assert [p.name for p in (tmp_path / "tensorboard").glob("memory_step*.prof")] == ["memory_step7.prof"]


@pytest.mark.slow
def test_profiling_is_off_by_default(tmp_path, tiny):
    config = tiny()
    assert config.profile.num_steps == 0
    train_and_evaluate(config, tmp_path)
    assert not (tmp_path / "tensorboard" / "plugins").exists()


@pytest.mark.parametrize("override, key", [("profile.num_steps=-1", "profile.num_steps"), ("profile.start_step=0", "profile.start_step")])
def test_bad_profile_keys_are_refused(override, key):
    with pytest.raises(ConfigError, match=key):
        compose_config([override])
