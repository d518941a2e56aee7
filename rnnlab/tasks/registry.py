"""The task interface, the registry of tasks by name, and on-device batch sampling.

A task is one file: subclass `Task`, decorate it with `@register_task`, and the config's
choices (`data=<name>`), the minimum `data.seq_len`, the trainer's metrics, TensorBoard
tags, HParams metrics, results.json and `scripts/summarize.py` all find it by name.

Batches are generated on device from `(stream key, step, example index)`: every example
is drawn from its own key, `fold_in(fold_in(stream, step), global_index)`, so a step's
global batch is the same whatever the device count, a device generates only its own
shard, and resuming at step `s` needs no data-loader state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from rnnlab.registry import Registry

TRAIN_STREAM, EVAL_STREAM = 0, 1
# Names the trainer gives its own per-step values; a task's metrics must not reuse them.
RESERVED_METRIC_NAMES = ("loss", "grad_norm", "lr", "skipped")


@dataclasses.dataclass(frozen=True)
class Batch:
    """inputs: f32[B, T, input_dim]; targets: task-specific (see each task)."""

    inputs: jax.Array
    targets: jax.Array


jax.tree_util.register_dataclass(Batch, data_fields=["inputs", "targets"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class Task:
    """A synthetic sequence task of length parameter `seq_len` (`data.seq_len`).

    Subclasses set the class constants and define `baseline_loss`, `sample_one` and
    `loss_and_metrics`; `total_len` defaults to `seq_len`.
    """

    seq_len: int

    name: ClassVar[str]
    input_dim: ClassVar[int]  # width of the model's input at each time step
    output_dim: ClassVar[int]  # width of the model's output at each time step
    min_seq_len: ClassVar[int] = 1  # the shortest `seq_len` the task is defined for

    @property
    def total_len(self) -> int:
        """Time steps of one example (what the model runs over)."""
        return self.seq_len

    @property
    def baseline_loss(self) -> float:
        """The loss of the best model that ignores the input's memory content (the trivial baseline)."""
        raise NotImplementedError

    def sample_one(self, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One example from `key` -> (inputs f32[total_len, input_dim], targets)."""
        raise NotImplementedError

    def loss_and_metrics(self, outputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """outputs f32[B, total_len, output_dim], targets [B, ...] -> (scalar loss, {metric name: scalar}).

        The first metric is the task's headline (results.json's `eval_metric`)."""
        raise NotImplementedError

    @functools.cached_property
    def metric_names(self) -> tuple[str, ...]:
        """The keys of `loss_and_metrics`'s metrics, in order (read off its shapes, nothing is computed)."""
        keys = jax.ShapeDtypeStruct((2,), jax.random.key(0).dtype)
        _, targets = jax.eval_shape(jax.vmap(self.sample_one), keys)
        outputs = jax.ShapeDtypeStruct((2, self.total_len, self.output_dim), jnp.float32)
        _, metrics = jax.eval_shape(self.loss_and_metrics, outputs, targets)
        names = tuple(metrics)
        clash = [n for n in names if n in RESERVED_METRIC_NAMES]
        if clash:
            raise ValueError(f"task {self.name!r}: metric name {clash[0]!r} is reserved ({', '.join(RESERVED_METRIC_NAMES)})")
        return names


TASKS: Registry[type[Task]] = Registry("task")
register_task = TASKS.register  # class decorator: make a Task subclass available as `data.task=<its name>`
get_task = TASKS.get_class
task_names = TASKS.names


def make_task(config: Any) -> Task:
    """The task of a `DataConfig` (`data.task`, `data.seq_len`)."""
    return get_task(config.task)(config.seq_len)


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
