"""The task interface, the registry of tasks by name, and on-device batch sampling.

A task is one file: subclass `Task`, decorate it with `@register_task`, and the config's
choices (`data=<name>`), the minimum `data.seq_len`, the trainer's metrics, TensorBoard
tags, HParams metrics, results.json and `rnnlab.summarize` all find it by name. Its own
parameters are dataclass fields with defaults, set from the keys under `data:`
(`rnnlab.tasks.options`); a task that defines `sample_padded` accepts `data.min_seq_len`.

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
import numpy as np
import optax

from rnnlab.options import allowed, declared_problem
from rnnlab.registry import Registry

TRAIN_STREAM, EVAL_STREAM = 0, 1
# Names the trainer gives its own per-step values; a task's metrics must not reuse them.
RESERVED_METRIC_NAMES = ("loss", "grad_norm", "lr", "skipped")
IGNORE = -1  # the target of a step that is not scored (`masked_cross_entropy`)


@dataclasses.dataclass(frozen=True)
class Batch:
    """inputs: the model's input, of one of two kinds (`Task.token_inputs`): int32[B, T] token ids in
    [0, input_dim), `Task.padding_id` at a padded step (the symbol tasks), or f32[B, T, input_dim]
    (continuous tasks, zero rows at a padded step); targets: task-specific (see each task)."""

    inputs: jax.Array
    targets: jax.Array


jax.tree_util.register_dataclass(Batch, data_fields=["inputs", "targets"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class Task:
    """A synthetic sequence task of length parameter `seq_len` (`data.seq_len`).

    Subclasses set `name`, the widths and `min_seq_len` (class constants, or properties where
    they depend on the task's own fields) and define `baseline_loss`, `sample_one` (or
    `sample_padded`) and `loss_and_metrics`; `total_len` defaults to `seq_len`. A subclass's
    dataclass fields (with defaults) are its options, set as `data.<field>`.

    A task whose input is one symbol per step sets `token_inputs = True` and samples token ids: the
    model embeds them (a gather of its input projection's rows), which costs what its model costs
    whatever the vocabulary, where a one-hot matrix would cost [T, input_dim] per example.
    """

    seq_len: int = allowed(at_least="min_seq_len")  # checked by `rnnlab.tasks.check_data`, which names the task

    name: ClassVar[str]
    input_dim: ClassVar[int]  # width of the model's input at each time step (token tasks: the number of symbols)
    output_dim: ClassVar[int]  # width of the model's output at each time step
    min_seq_len: ClassVar[int] = 1  # the shortest `seq_len` the task is defined for
    token_inputs: ClassVar[bool] = False  # inputs are int32[T] token ids, not f32[T, input_dim]
    # The task's options (`data.<name>`) that change how it is evaluated and nothing of its training: a resume,
    # or a finished run's rerun, may change them as it may `data.eval_seq_lens` (`rnnlab.rundir`).
    eval_options: ClassVar[tuple[str, ...]] = ()

    @property
    def padding_id(self) -> int:
        """The token id of a padded step: one past the symbols, embedded as zero (the one-hot of no symbol)."""
        return self.input_dim

    def input_spec(self, batch_size: int) -> jax.ShapeDtypeStruct:
        """The model's input for `batch_size` examples: int32[B, total_len] token ids (`token_inputs`),
        else f32[B, total_len, input_dim]."""
        if self.token_inputs:
            return jax.ShapeDtypeStruct((batch_size, self.total_len), jnp.int32)
        return jax.ShapeDtypeStruct((batch_size, self.total_len, self.input_dim), jnp.float32)

    def example_inputs(self, batch_size: int) -> jax.Array:
        """Zeros of `input_spec(batch_size)`: what initialising a model needs (only shapes matter)."""
        spec = self.input_spec(batch_size)
        return jnp.zeros(spec.shape, spec.dtype)

    @property
    def total_len(self) -> int:
        """Time steps of one example (what the model runs over)."""
        return self.seq_len

    @property
    def baseline_loss(self) -> float:
        """The loss of the best model that ignores the input's memory content (the trivial baseline)."""
        raise NotImplementedError

    def sample_one(self, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One example from `key` -> (inputs f32[total_len, input_dim], targets).

        A task with `sample_padded` gets this for free: its example of the full length."""
        if self.variable_length():
            return self.sample_padded(key, jnp.int32(self.seq_len))
        raise NotImplementedError

    def sample_padded(self, key: jax.Array, length: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One example of length parameter `length` (int32[], traced; min_seq_len <= length <= seq_len),
        padded to `total_len` steps -> (inputs, targets), a padded step's input `padding_id` (token
        inputs) or zeros.

        Defining it declares that the task accepts `data.min_seq_len`. `loss_and_metrics` must then
        score only the steps the example defines, and score the same number of them in every example,
        so that a padded example gives the result of the unpadded one (the models are causal) and a
        per-device mean averaged over devices is the mean over the global batch."""
        raise NotImplementedError

    def sample_segment(self, key: jax.Array, carry: jax.Array, start: jax.Array, length: int
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Steps `start` .. `start` + `length` - 1 of the example `sample_one(key)` draws (int32[] `start`,
        traced; `length` static), given `carry`, what the targets after `start` need of the steps before it
        (`initial_carry()` at 0) -> (inputs, targets, the carry after the segment). Defining it declares that
        the task is evaluated in segments (`data.eval_segment_len`): any length, in memory that does not grow
        with it. Its targets must be scored by `segment_totals`."""
        raise NotImplementedError

    def initial_carry(self) -> jax.Array:
        """`sample_segment`'s carry before the first step."""
        return jnp.int32(0)

    @classmethod
    def segmentable(cls) -> bool:
        """Whether the task is evaluated in segments (`sample_segment`)."""
        return cls.sample_segment is not Task.sample_segment

    def segment_totals(self, outputs: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
        """Per-example sums over one segment's scored steps (outputs f32[B, T, C] logits, targets int32[B, T],
        IGNORE where not scored) -> {loss, scored, right}: f32[B] each; segments add up."""
        scored = targets != IGNORE
        labels = jnp.where(scored, targets, 0)
        losses = jnp.where(scored, optax.softmax_cross_entropy_with_integer_labels(outputs, labels), 0.0)
        right = scored & (outputs.argmax(-1) == labels)
        return {"loss": losses.sum(-1), "scored": scored.sum(-1).astype(jnp.float32),
                "right": right.sum(-1).astype(jnp.float32)}

    def metrics_from_totals(self, totals: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`loss_and_metrics` of a whole sequence from its segments' summed `segment_totals`: by default the
        mean over every scored step of the batch (`masked_cross_entropy`'s) and {accuracy}."""
        count = jnp.maximum(totals["scored"].sum(), 1)
        return totals["loss"].sum() / count, {"accuracy": totals["right"].sum() / count}

    @classmethod
    def variable_length(cls) -> bool:
        """Whether examples may be shorter than `seq_len` (`data.min_seq_len`): the task defines `sample_padded`."""
        return cls.sample_padded is not Task.sample_padded

    def check(self) -> None:
        """Raise `OptionError` for an option out of range (called when the config is checked, before
        any compile): the options' declared ranges (`rnnlab.options.allowed`); a task adds its checks
        across keys after these. The minimum `seq_len` is checked apart, against `min_seq_len`."""
        problem = declared_problem(self, "data.")
        if problem:
            raise OptionError(problem)

    def with_seq_len(self, seq_len: int) -> "Task":
        """The same task at another length (for `data.eval_seq_lens`)."""
        return dataclasses.replace(self, seq_len=seq_len)

    def loss_and_metrics(self, outputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """outputs f32[B, total_len, output_dim], targets [B, ...] -> (scalar loss, {metric name: scalar}).

        The first metric is the task's headline (results.json's `eval_metric`)."""
        raise NotImplementedError

    def symbol_names(self) -> dict[int, str]:
        """Input symbols with a name of their own in `describe_examples` (noise, delimiter, ...)."""
        return {}

    def scored(self, targets: np.ndarray) -> np.ndarray:
        """bool[B, T]: the steps the loss scores (IGNORE marks the others)."""
        return targets != IGNORE

    def describe_examples(self, inputs: np.ndarray, targets: np.ndarray, outputs: np.ndarray) -> str | None:
        """A few eval examples as a Markdown table for TensorBoard's text tab: the input's symbols, then the
        target and the prediction at each scored step (inputs: token ids [B, T], or one-hot rows [B, T, input_dim]).
        None for a task whose targets are not symbols per step."""
        if targets.ndim != 2 or not np.issubdtype(targets.dtype, np.integer):
            return None
        names = self.symbol_names()
        if inputs.ndim == 3:  # f32[B, T, input_dim] one-hot rows, zero at a padded step: as ids
            inputs = np.where(inputs.any(-1), inputs.argmax(-1), self.padding_id)
        rows = ["| input | target | predicted | right |", "|---|---|---|---|"]
        for x, y, out, mask in zip(inputs, targets, outputs.argmax(-1), self.scored(targets)):
            symbols = " ".join("." if i == self.padding_id else names.get(int(i), str(int(i))) for i in x)
            right = int((out[mask] == y[mask]).sum())
            rows.append(f"| `{symbols}` | `{' '.join(map(str, y[mask]))}` | `{' '.join(map(str, out[mask]))}` "
                        f"| {right}/{int(mask.sum())} |")
        return "\n".join(rows)

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


class OptionError(ValueError):
    """A `data:` key is unknown, mistyped or out of range; the message is one line naming it
    (`rnnlab.config` raises it again as a ConfigError: this package cannot import the config)."""


def masked_cross_entropy(outputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """outputs f32[B, T, C] logits, targets int32[B, T] (IGNORE where not scored) -> (mean
    cross-entropy, accuracy of the argmax), both over the scored steps only."""
    scored = targets != IGNORE
    labels = jnp.where(scored, targets, 0)
    count = jnp.maximum(scored.sum(), 1)
    loss = jnp.where(scored, optax.softmax_cross_entropy_with_integer_labels(outputs, labels), 0.0).sum() / count
    correct = scored & (outputs.argmax(-1) == labels)
    return loss, correct.sum() / count


def per_position_uniform(key: jax.Array, size: int) -> jax.Array:
    """f32[size] ~ U[0, 1), element i drawn from `fold_in(key, i)`: a longer draw extends a shorter
    one, so an example padded to a larger `seq_len` is the unpadded example plus padding."""
    return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(jnp.arange(size))


TASKS: Registry[type[Task]] = Registry("task")
register_task = TASKS.register  # class decorator: make a Task subclass available as `data.task=<its name>`
get_task = TASKS.get_class
task_names = TASKS.names


def carries_state(task: Task | type[Task]) -> bool:
    """Whether `task` (a task or its class) trains by truncated backpropagation through time over contiguous
    streams (it defines `sample_step`: data=text): its train state carries every stream's model state from step to
    step (`rnnlab.steps.CarryTrainState`), so its runs train one at a time and have no lengths to evaluate at."""
    return callable(getattr(task, "sample_step", None))


def eval_option_keys(name: str) -> tuple[str, ...]:
    """The config keys (`data.<option>`) of the registered task `name`'s `eval_options`; () for a name not
    registered."""
    if name not in TASKS:
        return ()
    return tuple(f"data.{option}" for option in get_task(name).eval_options)


def make_task(config: Any) -> Task:
    """The task of a `DataConfig` (`data.task`, `data.seq_len` and the task's options)."""
    return get_task(config.task)(config.seq_len, **dict(config.options))


def sample_batch(task: Task, stream_key: jax.Array, step: jax.Array, first_index: jax.Array, size: int,
                 min_len: int | None = None) -> Batch:
    """Examples `first_index .. first_index+size-1` of the global batch at `step`.

    stream_key: a key for the train or eval stream; step, first_index: int scalars. min_len:
    None, every example of length `task.seq_len`; else (`data.min_seq_len`) each example's
    length drawn uniformly from [min_len, seq_len] with its own key, and the example padded.
    """
    step_key = jax.random.fold_in(stream_key, step)
    indices = first_index + jnp.arange(size)
    keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(indices)
    sample = task.sample_one if min_len is None else functools.partial(_sample_variable, task, min_len)
    inputs, targets = jax.vmap(sample)(keys)
    return Batch(inputs, targets)


def _sample_variable(task: Task, min_len: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    length_key, key = jax.random.split(key)
    return task.sample_padded(key, jax.random.randint(length_key, (), min_len, task.seq_len + 1))


def stream_key(seed: int, stream: int) -> jax.Array:
    """The key of a data stream (TRAIN_STREAM or EVAL_STREAM) of run `seed`."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), stream)
