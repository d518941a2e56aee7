"""`data.eval_segment_len`: a length past it is evaluated in segments, the model's state and the task's carry
going from each to the next. A task's segments are its whole example cut up; the segmented eval scores what
the whole eval scores; train.py reports it; a task that cannot, or a bad value, is refused in one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import compose_config, fast_first, tiny_config
from rnnlab import config as cfg
from rnnlab import steps, tasks
from rnnlab.models import build_model
from rnnlab.tasks.parity import ParityTask
from rnnlab.trainer import train_and_evaluate

SEGMENTED = [("parity", ()), ("word_problem", (("group", "s3"),)), ("word_problem", (("group", "a4_x_z5"),)),
             ("modular_arithmetic", (("modulus", 5),))]


@pytest.mark.slow("long")
@settings(max_examples=5, deadline=None)
@given(which=st.sampled_from(SEGMENTED), length=st.integers(1, 40), cuts=st.lists(st.integers(1, 9), min_size=1),
       seed=st.integers(0, 2**16))
def test_segments_of_an_example_are_the_example(which, length, cuts, seed):
    name, options = which
    task = tasks.get_task(name)(length, **dict(options))
    key = jax.random.key(seed)
    inputs, targets = jax.jit(task.sample_one)(key)
    carry, start, got = task.initial_carry(), 0, []
    sample_segment = jax.jit(task.sample_segment, static_argnums=3)  # one program a size, not one a primitive
    while start < task.total_len:
        size = min(cuts[len(got) % len(cuts)], task.total_len - start)
        x, y, carry = sample_segment(key, carry, jnp.int32(start), size)
        got.append((x, y))
        start += size
    np.testing.assert_array_equal(np.concatenate([x for x, _ in got]), inputs)
    np.testing.assert_array_equal(np.concatenate([y for _, y in got]), targets)


def evaluate(config, length, segment_len):
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    tx, _ = steps.make_optimizer(config.optimizer, config.steps)
    state = steps.create_train_state(jax.random.key(1), model, task.example_inputs(1), tx)
    dp = steps.parallel.DataParallel(jax.devices()[:1], config.device.strategy)
    at = task.with_seq_len(length)
    make = (lambda: steps.make_evaluator(config, at, config.batch_size, dp)) if segment_len is None else (
        lambda: steps.make_segment_evaluator(config, at, config.batch_size, dp, segment_len))
    evaluator = make()
    rows = [evaluator.step(dp.replicate(state), batch) for batch in evaluator.batches]
    return steps.mean_rows([{k: float(np.asarray(v).reshape(-1)[0]) for k, v in r.items()} for r in dp.to_host(rows)])


@pytest.mark.parametrize("overrides", fast_first([
    (("data=word_problem", "model=gru"),),
    (("data=parity", "model=mamba", "model.allow_neg_eigval=true"),),
    (("data=modular_arithmetic", "model=lstm"),),
    (("data=word_problem", "data.group=a5", "model=attention", "model.window=6"),),
], why="cross-product", first_why="long"))
def test_the_segmented_eval_scores_what_the_whole_eval_scores(overrides):
    config = tiny_config(*overrides, "eval_batches=2")
    whole = evaluate(config, 29, None)
    for segment_len in (7, 4):
        got = evaluate(config, 29, segment_len)
        assert got.keys() == whole.keys()
        for key in whole:
            np.testing.assert_allclose(got[key], whole[key], rtol=2e-5, atol=1e-6, err_msg=f"{key} in segments of {segment_len}")


@pytest.mark.slow("long")
def test_a_segment_runs_at_most_the_block_tokens_per_device_and_scores_the_same(monkeypatch):
    assert [steps.eval_block_len(4096, b) for b in (1, 32, 20_000)] == [4096, 512, 1]
    config = tiny_config("data=parity", "model=gru", "eval_batches=1")
    whole = evaluate(config, 29, None)
    monkeypatch.setattr(steps, "EVAL_BLOCK_TOKENS", 3 * config.batch_size)  # segments of 29 run as 3-step blocks
    drawn = []
    sample_segment = ParityTask.sample_segment
    monkeypatch.setattr(ParityTask, "sample_segment", lambda self, key, carry, start, length: (
        drawn.append(length), sample_segment(self, key, carry, start, length))[1])
    got = evaluate(config, 29, 29)
    assert set(drawn) == {3, 2}  # nine blocks of 3 in a scan, then the last 2 steps
    for key in whole:
        np.testing.assert_allclose(got[key], whole[key], rtol=2e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow("long")
def test_train_py_reports_a_length_evaluated_in_segments(tmp_path):
    config = tiny_config("data=parity", "model=gru", "data.eval_seq_lens=[6,50]", "data.eval_segment_len=16",
                         "checkpoint.enabled=false", "steps=4", "eval_every=4")
    train_and_evaluate(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["eval_by_len"]) == {"6", "50"} and 0 <= results["eval_by_len"]["50"]["accuracy"] <= 1


@pytest.mark.parametrize("overrides,message", [
    (["data=parity", "data.eval_segment_len=0"], "key 'data.eval_segment_len': got 0, allowed: null or a length >= 1"),
    (["data=mqar", "data.eval_segment_len=64"], "key 'data.eval_segment_len': got 64, but the mqar task is not "
                                                "evaluated in segments (it has no sample_segment); allowed: null"),
])
def test_bad_segment_lengths_name_the_key_and_what_is_allowed(overrides, message):
    with pytest.raises(cfg.ConfigError) as info:
        compose_config(overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_attention_whose_cache_would_not_fit_is_refused_in_one_line_before_it_compiles(tmp_path):
    """A recurrence's state does not grow with the length; attention's cache of every step does: a length
    whose cache cannot fit is refused naming the key, and a window makes the same length fit."""
    from rnnlab.memory import OutOfMemoryError

    far = ["data=parity", "model=attention", "data.eval_seq_lens=[6,100000000]", "data.eval_segment_len=4096",
           "batch_size=64", "hidden_dim=32", "checkpoint.enabled=false", "steps=2", "eval_every=2"]  # a 3 TB cache
    with pytest.raises(OutOfMemoryError) as info:
        train_and_evaluate(tiny_config(*far), tmp_path / "full")
    message = str(info.value)
    assert message.startswith("key 'data.eval_seq_lens': evaluating 100000000 steps keeps a model state of about")
    assert "model.window" in message and "\n" not in message
    assert not (tmp_path / "full" / "results.json").exists()
    from rnnlab import memory  # with a window, the ring buffer of its last 8 steps: it fits
    from rnnlab.models import initial_state

    config = tiny_config(*far, "model.window=8")
    model = build_model(config.model, 2, "cpu", 2)
    state = jax.eval_shape(lambda: initial_state(model, config.batch_size, 100_000_000))
    assert memory.tree_bytes(state) < 1e6
    memory.check_eval_state_fits(memory.tree_bytes(state), 100_000_000, jax.devices()[:1], config)
