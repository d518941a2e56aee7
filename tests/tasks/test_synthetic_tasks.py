"""Synthetic tasks: their structure, their analytic baselines, and device-count-free batches."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rnnlab import tasks
from rnnlab.tasks import stream_key
from rnnlab.tasks.adding import AddingTask
from rnnlab.tasks.copy import CopyTask

sample_batch = jax.jit(tasks.sample_batch, static_argnums=(0, 4))


def draw(task, n, step=0, seed=0):
    return sample_batch(task, stream_key(seed, 0), jnp.int32(step), jnp.int32(0), n)


def test_adding_structure():
    task = AddingTask(seq_len=20)
    batch = draw(task, 256)
    values, markers = np.asarray(batch.inputs[..., 0]), np.asarray(batch.inputs[..., 1])
    assert batch.inputs.shape == (256, 20, 2) and batch.targets.shape == (256,)
    assert ((values >= 0) & (values < 1)).all()
    assert (markers.sum(1) == 2).all()
    assert (markers[:, :10].sum(1) == 1).all() and (markers[:, 10:].sum(1) == 1).all()
    np.testing.assert_allclose((values * markers).sum(1), np.asarray(batch.targets), rtol=1e-6)


def test_adding_baseline_is_one_sixth():
    task = AddingTask(seq_len=10)
    batch = draw(task, 40_000)
    constant_one = jnp.ones((40_000, 10, 1))
    loss, _ = task.loss_and_metrics(constant_one, batch.targets)
    assert task.baseline_loss == pytest.approx(1 / 6)
    # Standard error of the MSE estimate at n=40k is about 0.001.
    assert float(loss) == pytest.approx(1 / 6, abs=0.005)


def test_copy_structure():
    task = CopyTask(seq_len=5)
    batch = draw(task, 64)
    tokens = np.asarray(batch.inputs)  # token ids
    targets = np.asarray(batch.targets)
    assert batch.inputs.dtype == jnp.int32 and tokens.shape == targets.shape == (64, 25)
    assert (tokens[:, :10] < 8).all()
    assert (tokens[:, 10:14] == CopyTask.BLANK).all() and (tokens[:, 14] == CopyTask.DELIMITER).all()
    assert (tokens[:, 15:] == CopyTask.BLANK).all()
    assert (targets[:, :15] == CopyTask.BLANK).all()
    np.testing.assert_array_equal(targets[:, 15:], tokens[:, :10])


def test_copy_memoryless_baseline():
    task = CopyTask(seq_len=30)
    batch = draw(task, 512)
    # Memoryless strategy: certain blank until the recall phase, then uniform over the 8 symbols.
    blank = jax.nn.one_hot(CopyTask.BLANK, 10) * 1e4
    uniform = jnp.where(jnp.arange(10) < 8, 0.0, -1e4)
    logits = jnp.concatenate([jnp.tile(blank, (512, 40, 1)), jnp.tile(uniform, (512, 10, 1))], axis=1)
    loss, metrics = task.loss_and_metrics(logits, batch.targets)
    accuracy = metrics["accuracy"]
    assert task.baseline_loss == pytest.approx(10 * math.log(8) / 50)
    assert float(loss) == pytest.approx(task.baseline_loss, rel=1e-4)
    assert 0.0 <= float(accuracy) <= 0.3  # argmax of uniform logits picks symbol 0: about 1/8


def test_perfect_copy_scores_zero_loss_and_full_accuracy():
    task = CopyTask(seq_len=3)
    batch = draw(task, 16)
    loss, metrics = task.loss_and_metrics(jax.nn.one_hot(batch.targets, 10) * 1e4, batch.targets)
    assert float(loss) < 1e-6 and float(metrics["accuracy"]) == 1.0
    assert task.metric_names == ("accuracy",) and AddingTask(seq_len=4).metric_names == ("mse",)


@pytest.mark.parametrize("task", [AddingTask(12), CopyTask(4)], ids=["adding", "copy"])
def test_batches_are_a_function_of_seed_step_and_index(task):
    a, b = draw(task, 8, step=3), draw(task, 8, step=3)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    assert not np.array_equal(a.inputs, draw(task, 8, step=4).inputs)
    assert not np.array_equal(a.inputs, draw(task, 8, step=3, seed=1).inputs)
    # Two shards of 4 are exactly the global batch of 8: independent of the device count.
    key = stream_key(0, 0)
    shards = [sample_batch(task, key, jnp.int32(3), jnp.int32(first), 4) for first in (0, 4)]
    np.testing.assert_array_equal(np.concatenate([s.inputs for s in shards]), a.inputs)


def test_train_and_eval_streams_differ():
    task = AddingTask(8)
    train = sample_batch(task, stream_key(0, 0), jnp.int32(0), jnp.int32(0), 4)
    held_out = sample_batch(task, stream_key(0, 1), jnp.int32(0), jnp.int32(0), 4)
    assert not np.array_equal(train.inputs, held_out.inputs)
