"""Synthetic sequence tasks, generated on device from `(stream key, step, example index)`.

Every example is drawn from its own key, `fold_in(fold_in(stream, step), global_index)`,
so a step's global batch is the same whatever the device count, a device generates
only its own shard, and resuming at step `s` needs no data-loader state.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from rnnlab.config import DataConfig

TRAIN_STREAM, EVAL_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class Batch:
    """inputs: f32[B, T, input_dim]; targets: task-specific (see each task)."""

    inputs: jax.Array
    targets: jax.Array


jax.tree_util.register_dataclass(Batch, data_fields=["inputs", "targets"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class AddingTask:
    """Adding problem (Le, Jaitly & Hinton 2015, after Hochreiter & Schmidhuber 1997).

    Input f32[T, 2]: channel 0 values ~ U[0, 1], channel 1 a marker that is 1 at exactly
    two steps, one in the first half and one in the second. Target: the sum of the two
    marked values, read from the output at the last step; loss and metric are the MSE.
    The sum has variance 2/12, so always predicting its mean 1 scores 1/6.
    """

    seq_len: int
    name: str = "adding"
    input_dim: int = 2
    output_dim: int = 1
    metric_name: str = "mse"

    @property
    def total_len(self) -> int:
        return self.seq_len

    @property
    def baseline_loss(self) -> float:
        return 1.0 / 6.0

    def sample_one(self, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """-> (inputs f32[T, 2], target f32[])."""
        k_val, k_first, k_second = jax.random.split(key, 3)
        half = self.seq_len // 2
        values = jax.random.uniform(k_val, (self.seq_len,))
        first = jax.random.randint(k_first, (), 0, half)
        second = jax.random.randint(k_second, (), half, self.seq_len)
        markers = jnp.zeros((self.seq_len,)).at[first].set(1.0).at[second].set(1.0)
        return jnp.stack([values, markers], axis=-1), values[first] + values[second]

    def loss_and_metric(self, outputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """outputs: f32[B, T, 1], targets: f32[B] -> (mse, mse)."""
        mse = jnp.mean((outputs[:, -1, 0] - targets) ** 2)
        return mse, mse


@dataclasses.dataclass(frozen=True)
class CopyTask:
    """Copy memory task (Arjovsky, Shah & Bengio 2016), delay T = `seq_len`.

    Symbols 0..7 are data, 8 is blank, 9 the delimiter. Input (one-hot, 10 classes):
    10 random data symbols, T-1 blanks, the delimiter, 10 blanks (T+20 steps). Target:
    T+10 blanks, then the 10 data symbols. Loss: cross-entropy averaged over all T+20
    steps; metric: accuracy on the 10 recalled symbols. A memoryless model that emits
    blanks and then guesses uniformly scores 10 ln 8 / (T+20).
    """

    seq_len: int
    name: str = "copy"
    input_dim: int = 10
    output_dim: int = 10
    metric_name: str = "accuracy"
    num_symbols: int = 8
    copy_len: int = 10

    BLANK, DELIMITER = 8, 9

    @property
    def total_len(self) -> int:
        return self.seq_len + 2 * self.copy_len

    @property
    def baseline_loss(self) -> float:
        return self.copy_len * math.log(self.num_symbols) / self.total_len

    def sample_one(self, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """-> (inputs f32[T+20, 10] one-hot, targets int32[T+20])."""
        symbols = jax.random.randint(key, (self.copy_len,), 0, self.num_symbols)
        blanks = lambda n: jnp.full((n,), self.BLANK, jnp.int32)  # noqa: E731
        tokens = jnp.concatenate(
            [symbols, blanks(self.seq_len - 1), jnp.array([self.DELIMITER]), blanks(self.copy_len)]
        )
        targets = jnp.concatenate([blanks(self.seq_len + self.copy_len), symbols])
        return jax.nn.one_hot(tokens, self.input_dim), targets

    def loss_and_metric(self, outputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """outputs: f32[B, T+20, 10] logits, targets: int32[B, T+20] -> (cross-entropy, recall accuracy)."""
        loss = optax.softmax_cross_entropy_with_integer_labels(outputs, targets).mean()
        recalled = outputs[:, -self.copy_len :].argmax(-1) == targets[:, -self.copy_len :]
        return loss, recalled.mean()


Task = AddingTask | CopyTask


def make_task(config: DataConfig) -> Task:
    if config.task == "adding":
        return AddingTask(config.seq_len)
    if config.task == "copy":
        return CopyTask(config.seq_len)
    raise ValueError(f"unknown task {config.task!r}")


def sample_batch(task: Task, stream_key: jax.Array, step: jax.Array, first_index: jax.Array, size: int) -> Batch:
    """Examples `first_index .. first_index+size-1` of the global batch at `step`.

    stream_key: a key for the train or eval stream; step, first_index: int scalars.
    """
    step_key = jax.random.fold_in(stream_key, step)
    indices = first_index + jnp.arange(size)
    keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(indices)
    inputs, targets = jax.vmap(task.sample_one)(keys)
    return Batch(inputs, targets)


def stream_key(seed: int, stream: int) -> jax.Array:
    """The key of a data stream (TRAIN_STREAM or EVAL_STREAM) of run `seed`."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), stream)
