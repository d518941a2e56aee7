"""The pure pieces of training: optimizer, train state, `train_step` and `eval_step`, on-device
batch sampling, the compiled multi-step dispatch the loop calls, and a run's compiled functions
as one frozen value (`StepFunctions`).

`train_step(state, batch) -> (state, metrics)` runs on one device's shard with gradients
and metrics averaged over `parallel.AXIS`; parallelism is applied where it is called
(`parallel.DataParallel.map`). Inside the loop the state is in the replicated layout.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from rnnlab import config as cfg
from rnnlab import parallel, tasks
from rnnlab.models import build_model, initial_state

PARAMS_STREAM = 2
DROPOUT_STREAM = 3
# pmap over simulated CPU devices aborts (all-reduce timeout) with ~50 steps queued
# without a host sync; the loop never queues more than this many, on every backend.
MAX_STEPS_IN_FLIGHT = 16
assert 2 * cfg.MAX_STEPS_PER_DISPATCH <= MAX_STEPS_IN_FLIGHT


class Hyperparameters(NamedTuple):
    """The run's scalars that its compiled programs take as inputs rather than constants, so that the jobs of
    an lr-and-seed grid compile one program (and share JAX's persistent compilation cache): the optimizer's
    and its schedule's numbers, and the seed. What they cannot change (the optimizer, the schedule's kind,
    whether clipping and momentum are on) stays in the config and so in the program."""

    lr: Any
    warmup_steps: Any  # int32
    total_steps: Any  # int32: the schedule's length (`steps`)
    end_lr_ratio: Any
    clip_norm: Any
    weight_decay: Any
    momentum: Any
    b1: Any
    b2: Any
    seed: Any  # uint32: parameters, data streams and dropout


def hyperparameters(config: cfg.Config) -> Hyperparameters:
    """`config`'s `Hyperparameters` as NumPy scalars (host values, to be passed in)."""
    opt = config.optimizer
    f32 = np.float32
    return Hyperparameters(
        lr=f32(opt.lr), warmup_steps=np.int32(opt.warmup_steps), total_steps=np.int32(config.steps),
        end_lr_ratio=f32(opt.end_lr_ratio), clip_norm=f32(opt.clip_norm), weight_decay=f32(opt.weight_decay),
        momentum=f32(opt.momentum), b1=f32(opt.b1), b2=f32(opt.b2), seed=np.uint32(config.seed))


def stack_hyperparameters(configs: Sequence[cfg.Config]) -> Hyperparameters:
    """The `Hyperparameters` of a population's members, each field with a leading [members] axis."""
    rows = [hyperparameters(c) for c in configs]
    return Hyperparameters(*(np.stack(field) for field in zip(*rows)))


class PopulationState(NamedTuple):
    """The train state of a population (`rnnlab.population`): the members' `TrainState`s stacked on a leading
    [members] axis, and which members still train (on_nonfinite=stop: a member stops updating at its first
    non-finite loss or gradient norm, while the others go on)."""

    members: Any  # train_state.TrainState, every leaf [members, ...]
    alive: Any  # bool[members]

    @classmethod
    def stack(cls, states: Sequence[Any]) -> "PopulationState":
        """The members' unreplicated states stacked, all alive (one structure: the first's; the members' optimizers
        are equal but for their numbers, which are inputs)."""
        stacked = jax.tree_util.tree_structure(states[0]).unflatten(
            [np.stack(leaves) for leaves in zip(*(jax.tree_util.tree_leaves(s) for s in states))])
        return cls(stacked, np.ones(len(states), bool))

    @property
    def params(self) -> Any:
        return self.members.params


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: it holds arrays
class Members:
    """The runs one set of programs trains, and the one place that tells the two shapes of state apart: a
    population's (what training trains, a run alone as a population of one) is a `PopulationState` and every
    program maps the run's over the member axis (`map`, `step`: `over_members`), its host reads split per member
    (`each`, `per_member`); `alone`'s is one `TrainState` and every program is the run's own (what evaluates,
    samples and decodes a trained run: `rnnlab.trained`). Shared code calls these rather than asking which it is."""

    values: Hyperparameters  # the programs' numbers: a run alone's scalars, or a population's on a [members] axis
    stacked: bool = False

    @classmethod
    def alone(cls, config: cfg.Config) -> "Members":
        return cls(hyperparameters(config))

    @classmethod
    def population(cls, configs: Sequence[cfg.Config]) -> "Members":
        """The members of a grid whose runs differ only in their `Hyperparameters` (`rnnlab.population`)."""
        return cls(stack_hyperparameters(configs), stacked=True)

    @property
    def count(self) -> int:
        return len(self.values.lr) if self.stacked else 1

    def seeds(self, dp: parallel.DataParallel) -> Any:
        """The seed the eval and probe programs take as an input (one program for every seed), replicated."""
        return dp.replicate(self.values.seed)

    def map(self, fn: Callable, in_axes: Any, out_axes: Any = 0, takes_state: bool = True) -> Callable:
        """`fn` of one run as it is, or over a population's members (`over_members` with these axes), its first
        argument then a `PopulationState` whose members' states `fn` gets (`takes_state`; False: `fn` takes none)."""
        if not self.stacked:
            return fn
        mapped = over_members(fn, self.count, in_axes, out_axes)
        return (lambda state, *args: mapped(state.members, *args)) if takes_state else mapped

    def step(self, one_step: Callable, names: Sequence[str], stop_diverged: bool, inputs_axes: Any = 0) -> Callable:
        """The train step of `one_step(TrainState, inputs) -> (TrainState, row)`: as it is, or a population's
        (`population_step`; `inputs_axes`: where the member axis is in `inputs`, None for what the members share)."""
        if not self.stacked:
            return one_step
        return population_step(one_step, names, stop_diverged, self.count, inputs_axes)

    def row_shape(self, names: Sequence[str]) -> tuple[int, ...]:
        """The shape of one step's metrics: [len(names)], a population's [members, len(names)]."""
        return (self.count, len(names)) if self.stacked else (len(names),)

    def each(self, tree: Any, axis: int = 0) -> list:
        """Each member's share of a host tree whose leaves carry the member axis at `axis` (a run alone: the tree)."""
        if not self.stacked:
            return [tree]
        return [jax.tree_util.tree_map(lambda x: np.take(x, i, axis), tree) for i in range(self.count)]

    def per_member(self, values: list) -> Any:
        """What a host read returns: a population's list with one value per member, a run alone's value."""
        return values if self.stacked else values[0]


def make_optimizer(config: cfg.OptimizerConfig, total_steps: Any,
                   values: Hyperparameters | None = None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping -> optimizer, with a learning-rate schedule over `total_steps`.

    `schedule(s)` is the learning rate of the update that takes the state from step s-1
    to s: linear warm-up reaches `lr` at s = warmup_steps (the first update already
    moves, at lr / warmup_steps), then cosine decay to `end_lr_ratio * lr` at the
    last step, or constant.

    values: the numbers (`Hyperparameters`, traced inside a compiled step, so that one program serves every
    lr); None: `config`'s own, with `total_steps`. `config` fixes the structure either way.
    """
    if values is None:
        f32 = np.float32
        values = Hyperparameters(
            lr=f32(config.lr), warmup_steps=np.int32(config.warmup_steps), total_steps=np.int32(total_steps),
            end_lr_ratio=f32(config.end_lr_ratio), clip_norm=f32(config.clip_norm),
            weight_decay=f32(config.weight_decay), momentum=f32(config.momentum), b1=f32(config.b1),
            b2=f32(config.b2), seed=np.uint32(0))
    schedule = functools.partial(learning_rate, values, config.schedule == "cosine")
    # Optax calls the schedule with the number of updates applied so far.
    lr = lambda count: schedule(count + 1)  # noqa: E731
    b1, b2, decay = values.b1, values.b2, values.weight_decay
    if config.name == "adam":
        opt = optax.chain(optax.add_decayed_weights(decay), optax.adam(lr, b1, b2))
    elif config.name == "adamw":
        opt = optax.adamw(lr, b1, b2, weight_decay=decay)
    elif config.name == "sgd":
        opt = optax.chain(optax.add_decayed_weights(decay), optax.sgd(lr, momentum=values.momentum if config.momentum else None))
    else:
        raise ValueError(f"unknown optimizer {config.name!r}")
    clip = optax.clip_by_global_norm(values.clip_norm) if config.clip_norm > 0 else optax.identity()
    return optax.chain(clip, opt), schedule


def learning_rate(values: Hyperparameters, cosine: bool, s: Any) -> jax.Array:
    """The learning rate of update s (1-based) under `values`: optax's join of `linear_schedule(0, lr, warmup)`
    and `cosine_decay_schedule(lr, max(total - warmup, 1), end_lr_ratio)` (or a constant), written with the
    numbers as arrays so that they can be inputs of a compiled program."""
    s = jnp.asarray(s, jnp.int32)
    lr = jnp.asarray(values.lr, jnp.float32)
    warmup = jnp.minimum(jnp.asarray(values.warmup_steps, jnp.int32), jnp.asarray(values.total_steps, jnp.int32))
    if cosine:
        decay_steps = jnp.maximum(jnp.asarray(values.total_steps, jnp.int32) - warmup, 1)
        t = jnp.minimum(s - warmup, decay_steps).astype(jnp.float32)
        alpha = jnp.asarray(values.end_lr_ratio, jnp.float32)
        cosine_part = 0.5 * (1 + jnp.cos(jnp.pi * t / decay_steps.astype(jnp.float32)))
        decayed = lr * ((1 - alpha) * cosine_part + alpha)
    else:
        decayed = lr
    # linear_schedule(0, lr, warmup)(s), as optax writes it: (0 - lr) * (1 - clip(s, 0, warmup) / warmup) + lr
    fraction = 1 - jnp.clip(s, 0, warmup).astype(jnp.float32) / jnp.maximum(warmup, 1).astype(jnp.float32)
    warming = (0 - lr) * fraction + lr
    return jnp.where(s < warmup, warming, decayed)


def run_once_options(platform: str) -> dict[str, Any] | None:
    """XLA's options for the programs a run calls once (the initialisation, the eval batches' draw): on CPU,
    LLVM at O1, which compiles them in 60-80% of the default's time to the same values (checked bitwise for
    every cell and task); elsewhere the defaults."""
    return {"xla_backend_optimization_level": 1} if platform == "cpu" else None


class CarryTrainState(train_state.TrainState):
    """The train state of a task trained by truncated backpropagation through time (`carries_state`: data=text):
    `carry`, the model's state (`initial_state`) of every stream of the global batch at the end of the last
    step, which the next step starts from. It is replicated like the rest (each device updates its own rows,
    then all gather them), so a checkpoint holds every stream's and a resume continues bit for bit."""

    carry: Any = None


def carries_state(task: tasks.Task) -> bool:
    """Whether `task` trains by truncated BPTT over contiguous streams (`sample_step`; data=text): its train
    state is a `CarryTrainState` (`tasks.carries_state`)."""
    return tasks.carries_state(task)


def create_train_state(
    key: jax.Array, model: nn.Module, example_inputs: jax.Array, tx: optax.GradientTransformation,
    compiler_options: dict[str, Any] | None = None, carry_batch: int = 0,
) -> train_state.TrainState:
    """Unreplicated initial state. example_inputs: the model's input, f32[B, T, I] or token ids
    int32[B, T] (`Task.example_inputs`; only shapes matter). compiler_options: the initialisation's
    (`run_once_options`); only where this call is not itself traced (JAX takes them at the top level only).
    carry_batch > 0: a `CarryTrainState` whose carry is the model's initial state of that many streams (the
    global batch; `carries_state`)."""
    params = jax.jit(model.init, compiler_options=compiler_options)(key, example_inputs)["params"]
    if carry_batch:
        state = CarryTrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                       carry=initial_state(model, carry_batch))
        return state.replace(step=jnp.zeros((), jnp.int32))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # A strongly typed step: a weakly typed Python 0 would make the second step recompile.
    return state.replace(step=jnp.zeros((), jnp.int32))


def train_step(
    state: train_state.TrainState,
    batch: tasks.Batch,
    task: tasks.Task,
    schedule: optax.Schedule,
    skip_nonfinite: bool = False,
    seed: Any = 0,
    tx: optax.GradientTransformation | None = None,
    carry: Any = None,
    carry_axes: Any = None,
) -> tuple[train_state.TrainState, dict[str, jax.Array]]:
    """One optimizer update on this device's shard; gradients and metrics averaged over `AXIS`.

    carry: this device's rows of the model's state to start from (truncated BPTT: `CarryTrainState`, resets
    applied), `carry_axes` the batch axis of each of its leaves (`state_batch_axes`): the new state's carry is
    the state the model ends with, gradients stopped, every device's rows gathered.

    skip_nonfinite: if the loss or gradient norm is NaN/Inf, keep the old parameters and
    optimizer state (the step counter still advances, so the data stream moves on) and
    report `skipped` = 1. tx: the optimizer to apply (None: `state.tx`); one built from traced
    `Hyperparameters` (`make_optimizer`) has the same state structure as `state.tx`.
    """

    old = state
    if carry is None:
        metrics, grads = loss_and_gradients(state, batch, task, seed)
    else:
        metrics, grads, after = carried_loss_and_gradients(state, batch, task, seed, carry)
        state = state.replace(carry=gather_rows(after, carry_axes))
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = schedule(state.step + 1)
    if tx is None:
        new_state = state.apply_gradients(grads=grads)
    else:  # as apply_gradients, with this tx (state.tx, a static field, stays as it is)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                                  opt_state=opt_state)
    if skip_nonfinite:
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        keep_old = old.replace(step=new_state.step)  # a carried state too: the one before the skipped step
        new_state = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old), new_state, keep_old)
        metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
    return new_state, metrics


def loss_and_gradients(state: train_state.TrainState, batch: tasks.Batch, task: tasks.Task,
                       seed: Any = 0) -> tuple[dict[str, jax.Array], Any]:
    """({"loss", task metrics}, gradients of the loss in the parameters) of the update from
    `state.step`, averaged over `AXIS`: what `train_step` applies, before clipping."""
    # Dropout masks from (seed, step, device index): a resumed run draws the same ones.
    dropout_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), DROPOUT_STREAM), state.step)
    dropout_key = jax.random.fold_in(dropout_key, jax.lax.axis_index(parallel.AXIS))

    def loss_fn(params):
        outputs = state.apply_fn({"params": params}, batch.inputs, train=True, rngs={"dropout": dropout_key})
        return task.loss_and_metrics(outputs, batch.targets)

    (loss, task_metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return jax.lax.pmean({"loss": loss, **task_metrics}, parallel.AXIS), jax.lax.pmean(grads, parallel.AXIS)


def carried_loss_and_gradients(state: train_state.TrainState, batch: tasks.Batch, task: tasks.Task, seed: Any,
                               carry: Any) -> tuple[dict[str, jax.Array], Any, Any]:
    """`loss_and_gradients` of the model run from `carry` (this device's rows of the model's state) -> (metrics,
    gradients, the state after the batch's last step with its gradient stopped: truncated BPTT)."""
    dropout_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), DROPOUT_STREAM), state.step)
    dropout_key = jax.random.fold_in(dropout_key, jax.lax.axis_index(parallel.AXIS))

    def loss_fn(params):
        outputs, after = state.apply_fn({"params": params}, batch.inputs, train=True, rngs={"dropout": dropout_key},
                                        state=carry)
        loss, task_metrics = task.loss_and_metrics(outputs, batch.targets)
        return loss, (task_metrics, after)

    (loss, (task_metrics, after)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    metrics = jax.lax.pmean({"loss": loss, **task_metrics}, parallel.AXIS)
    return metrics, jax.lax.pmean(grads, parallel.AXIS), jax.lax.stop_gradient(after)


def state_batch_axes(model: nn.Module) -> Any:
    """The batch axis of each leaf of `initial_state(model, ...)` (a tree of ints): where the shapes of the
    states of one and of two examples differ."""
    one, two = (jax.eval_shape(lambda b=b: initial_state(model, b)) for b in (1, 2))
    return jax.tree_util.tree_map(lambda a, b: next(i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n),
                                  one, two)


def take_rows(tree: Any, axes: Any, first: jax.Array, rows: int) -> Any:
    """Rows first .. first + rows - 1 of every leaf of `tree` along its batch axis (`axes`)."""
    return jax.tree_util.tree_map(lambda x, axis: jax.lax.dynamic_slice_in_dim(x, first, rows, axis), tree, axes)


def gather_rows(tree: Any, axes: Any) -> Any:
    """Every device's rows of `tree` (along each leaf's batch axis), in device order: the global batch's."""
    return jax.tree_util.tree_map(lambda x, axis: jax.lax.all_gather(x, parallel.AXIS, axis=axis, tiled=True),
                                  tree, axes)


def reset_rows(carry: Any, fresh: Any, axes: Any, reset: jax.Array) -> Any:
    """`carry` with the rows flagged in `reset` (bool[R]) replaced by `fresh`'s (the initial state)."""

    def one(c, f, axis):
        shape = [1] * c.ndim
        shape[axis] = reset.shape[0]
        return jnp.where(reset.reshape(shape), f, c)

    return jax.tree_util.tree_map(one, carry, fresh, axes)


def stream_arrays(task: tasks.Task, split: str = "train") -> Any:
    """A stream task's `split` as host arrays (`TextArrays` of NumPy), to be passed to the compiled programs as
    an argument (not compiled in as a constant)."""
    return jax.tree_util.tree_map(np.asarray, task.arrays(split))


def _stream_batches(config: cfg.Config, task: tasks.Task, per_device: int, model: nn.Module) -> tuple[Callable, Any]:
    """(`(state, arrays) -> (Batch, carry)`, the carry's batch axes): this device's rows of the step from
    `state.step` (`task.sample_step`) and of the carried model state, the rows the step resets (`reset[:, 0]`)
    set to the initial state. A reset is only ever at a step's first position (each document starts at a
    window's first position)."""
    axes = state_batch_axes(model)

    def next_batch(state, arrays):
        first = jax.lax.axis_index(parallel.AXIS) * per_device
        window = task.sample_step(arrays, state.step, first, per_device, config.batch_size)
        carry = take_rows(state.carry, axes, first, per_device)
        carry = reset_rows(carry, initial_state(model, per_device), axes, window.reset[:, 0])
        return tasks.Batch(window.inputs, window.targets), carry

    return next_batch, axes


def eval_step(state: train_state.TrainState, batch: tasks.Batch, task: tasks.Task, examples: int = 0) -> Any:
    """Eval metrics averaged over `AXIS`; with `examples` > 0, (metrics, the outputs of this shard's first
    `examples` examples): the eval examples come from the eval's own forward, not a second compiled one."""
    outputs = state.apply_fn({"params": state.params}, batch.inputs)
    loss, task_metrics = task.loss_and_metrics(outputs, batch.targets)
    metrics = jax.lax.pmean({"loss": loss, **task_metrics}, parallel.AXIS)
    return (metrics, outputs[:examples]) if examples else metrics


def make_sampler(task: tasks.Task, stream: jax.Array, per_device: int, dp: parallel.DataParallel) -> Callable:
    """`step -> Batch` on every device: each device draws its own slice of the global batch."""

    def sample(step):
        first = jax.lax.axis_index(parallel.AXIS) * per_device
        return tasks.sample_batch(task, stream, step, first, per_device)

    return dp.map(sample, (parallel.REPLICATED,), parallel.SHARDED)


def pmap_sampler(task: tasks.Task, stream: jax.Array, per_device: int, devices: list) -> Callable:
    """`make_sampler` with pmap: `step[num_devices] -> Batch` with a leading device axis."""
    return make_sampler(task, stream, per_device, parallel.DataParallel(devices, "pmap"))


def make_evaluator(config: cfg.Config, task: tasks.Task, per_device: int, dp: parallel.DataParallel,
                   examples: int = 0, members: Members | None = None) -> Evaluator:
    """The `Evaluator` of `task`: its eval step mapped over `dp` (state replicated, batch sharded ->
    replicated metrics, and with `examples` > 0 sharded outputs of each shard's first examples) and the
    `config.eval_batches` batches of the eval stream at the task's length, drawn once on the devices.
    One per evaluated length: each eval step compiles on its first call.
    members: the runs it evaluates (default: `config`'s alone); a population's members each on its own seed's
    batches, which carry the member axis second ([B, members, ...], as the outputs do); the metrics gain a
    leading member axis."""
    out_layouts = (parallel.REPLICATED, parallel.SHARDED) if examples else parallel.REPLICATED
    evaluate = functools.partial(eval_step, task=task, examples=examples)

    def sample(step, seed):  # the seed an input: one program for every seed
        first = jax.lax.axis_index(parallel.AXIS) * per_device
        return tasks.sample_batch(task, tasks.stream_key(seed, tasks.EVAL_STREAM), step, first, per_device)

    members = members or Members.alone(config)
    evaluate = members.map(evaluate, (0, 1), (0, 1) if examples else 0)
    sample = members.map(sample, (None, 0), 1, takes_state=False)
    p_eval_step = dp.map(evaluate, (parallel.REPLICATED, parallel.SHARDED), out_layouts)
    sampler = dp.map(sample, (parallel.REPLICATED, parallel.REPLICATED), parallel.SHARDED)
    seed = members.seeds(dp)
    if jax.process_count() == 1:  # with several processes the first call compiles (see `make_dispatch`)
        options = run_once_options(dp.devices[0].platform)
        sampler = sampler.lower(dp.host_scalar(0), seed).compile(compiler_options=options)
    return Evaluator(p_eval_step, [sampler(dp.host_scalar(i), seed) for i in range(config.eval_batches)], examples)


# What one segment of a long evaluation runs through the model at once, per device: the model's activations for it
# are what the evaluation holds (Mamba at the zoo's H=64, 2 layers: 80 MB of XLA temporaries, against 640 MB at 131,072).
EVAL_BLOCK_TOKENS = 16_384
# A long evaluation runs from the host in chunks of segments (`SegmentedEval`), each one compiled call whose segment
# count is an argument: a chunk grows (at most 4x a chunk) until it takes about CHUNK_SECONDS, so that a stop request
# (SIGTERM, Ctrl-C), checked between chunks, is honoured within about that long.
CHUNK_SECONDS = 1.0
# Once a length's timed chunks have run this long, its time is predicted from their speed, checked against the
# budget (`eval_max_minutes`) and, past NOTE_SECONDS, logged.
MEASURE_SECONDS = 0.5
NOTE_SECONDS = 10.0

log = logging.getLogger("rnnlab.trainer")  # the run's lines (rnnlab.report)


class EvalInterrupted(Exception):
    """An evaluation stopped between its chunks or lengths because a stop was requested (SIGTERM, a first
    Ctrl-C): nothing of it is reported."""


class EvalTooLongError(cfg.ConfigError):
    """An evaluated length whose time, predicted from its measured speed, is past the budget (`eval_max_minutes`)."""

    def __init__(self, length: int, seconds: float, tokens_per_sec: float, budget: float):
        self.length, self.seconds, self.tokens_per_sec, self.budget = length, seconds, tokens_per_sec, budget
        super().__init__(
            f"key 'data.eval_seq_lens': evaluating length {length} would take {prediction(seconds, tokens_per_sec)}, "
            f"more than eval_max_minutes={budget / 60:g}; allowed: shorter lengths, fewer eval_batches, or a larger "
            f"eval_max_minutes (null: no limit)")


def prediction(seconds: float, tokens_per_sec: float) -> str:
    """`about 12 min (measured 110,000 tokens/s)`."""
    return f"about {duration(seconds)} (measured {tokens_per_sec:,.0f} tokens/s)"


def duration(seconds: float) -> str:
    """`12 s`, `3.5 min`, `20.1 h`."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.3g} min" if seconds < 3600 else f"{seconds / 3600:.3g} h"


def agree_to_stop(stop: bool) -> bool:
    """Whether any process asks to stop: with several processes all must leave an evaluation at the same point
    (a tiny all-gather); one process: `stop`."""
    if jax.process_count() == 1:
        return stop
    from jax.experimental import multihost_utils

    return bool(multihost_utils.process_allgather(np.int32(stop)).any())


def agree_on_chunk(stop: bool, count: int, measured: float, per_segment: float) -> tuple[bool, int, float, float]:
    """A chunk every process runs alike: (any stops, the smallest count, the least measured time, the slowest
    seconds per segment), in one all-gather; one process: as given."""
    if jax.process_count() == 1:
        return stop, count, measured, per_segment
    from jax.experimental import multihost_utils

    rows = multihost_utils.process_allgather(np.array([stop, count, measured, per_segment], np.float64))
    return bool(rows[:, 0].any()), int(rows[:, 1].min()), float(rows[:, 2].min()), float(rows[:, 3].max())


def eval_block_len(segment_len: int, per_device: int) -> int:
    """The steps of each segment a long evaluation runs: `data.eval_segment_len`, at most `EVAL_BLOCK_TOKENS`
    tokens per device (never below one step), so that its memory is bounded by neither the length nor the batch."""
    return max(1, min(segment_len, EVAL_BLOCK_TOKENS // per_device))


def make_segment_evaluator(config: cfg.Config, task: tasks.Task, per_device: int, dp: parallel.DataParallel,
                           segment_len: int, members: Members | None = None) -> Evaluator:
    """The `Evaluator` of `task` run as an RNN (`data.eval_segment_len`): each eval batch, drawn from the same
    keys as `make_evaluator`'s, is evaluated in segments of `segment_len` steps, one after another, the
    model's state and the task's carry (`Task.sample_segment`) going from each to the next and the
    scores summed (`Task.segment_totals`): nothing of the whole length is ever in memory. Its batches are
    the (batch index, seed) pairs; each segment is drawn on the device. The segments run from the host in
    chunks (`SegmentedEval`: its `run` checks for a stop between them and predicts the length's time).
    members: as `make_evaluator`'s."""
    model = build_model(config.model, task.output_dim, dp.devices[0].platform, task.input_dim)
    length = task.total_len
    segment_len = eval_block_len(segment_len, per_device)
    whole, rest = divmod(length, segment_len)
    draw = jax.vmap(task.sample_segment, in_axes=(0, 0, None, None))

    def example_keys(index, seed):
        first = jax.lax.axis_index(parallel.AXIS) * per_device
        step_key = jax.random.fold_in(tasks.stream_key(seed, tasks.EVAL_STREAM), index)  # as `tasks.sample_batch`
        return jax.vmap(lambda i: jax.random.fold_in(step_key, i))(first + jnp.arange(per_device))

    def segment(state, keys, carry, start, size):
        model_state, data, totals = carry
        inputs, targets, data = draw(keys, data, start, size)
        outputs, model_state = state.apply_fn({"params": state.params}, inputs, state=model_state)
        totals = jax.tree_util.tree_map(jnp.add, totals, task.segment_totals(outputs, targets))
        return model_state, data, totals

    def init(index, seed):
        data = jax.vmap(lambda _: task.initial_carry())(example_keys(index, seed))
        totals = jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(
            lambda: task.segment_totals(jnp.zeros((per_device, 1, task.output_dim)), jnp.zeros((per_device, 1), jnp.int32))))
        return initial_state(model, per_device, length), data, totals

    def chunk(state, carry, index, seed, first, count):  # segments first .. first + count - 1
        keys = example_keys(index, seed)
        return jax.lax.fori_loop(0, count, lambda i, c: segment(state, keys, c, (first + i) * segment_len, segment_len),
                                 carry)

    def final(state, carry, index, seed):  # the last, shorter segment, then the scores
        if rest:
            carry = segment(state, example_keys(index, seed), carry, whole * segment_len, rest)
        loss, task_metrics = task.metrics_from_totals(carry[2])
        return jax.lax.pmean({"loss": loss, **task_metrics}, parallel.AXIS)

    # A population: every member on its own seed's batches; the carry gains a leading member axis.
    members = members or Members.alone(config)
    init = members.map(init, (None, 0), takes_state=False)
    chunk = members.map(chunk, (0, 0, None, 0, None, None))
    final = members.map(final, (0, 0, None, 0))

    # The carry stays on the devices between calls, each device's own (its leaves gain a leading axis of 1,
    # so that even a scalar one has an axis to shard).
    out = lambda tree: jax.tree_util.tree_map(lambda x: x[None], tree)  # noqa: E731
    into = lambda tree: jax.tree_util.tree_map(lambda x: x[0], tree)  # noqa: E731
    R, S = parallel.REPLICATED, parallel.SHARDED
    segments = SegmentedEval(
        dp=dp, length=length, whole=whole, tokens_per_segment=segment_len * per_device * len(dp.devices),
        budget=None if config.eval_max_minutes is None else 60.0 * config.eval_max_minutes,
        init=dp.map(lambda index, seed: out(init(index, seed)), (R, R), S),
        chunk=dp.map(lambda state, carry, *args: out(chunk(state, into(carry), *args)), (R, S, R, R, R, R), S,
                     donate_argnums=(1,)),
        final=dp.map(lambda state, carry, *args: final(state, into(carry), *args), (R, S, R, R), R))
    seed = members.seeds(dp)
    return Evaluator(segments, [(dp.host_scalar(i), seed) for i in range(config.eval_batches)], segments=segments)


def make_stream_evaluator(config: cfg.Config, task: tasks.Task, dp: parallel.DataParallel,
                          split: str = "valid", members: Members | None = None) -> Evaluator:
    """The `Evaluator` of a stream task (`carries_state`: data=text) on its held-out `split`: the text's
    `data.eval_streams` streams (`task.eval_layout`), spread over the devices, run segment by segment from a
    fresh state, with the state carried from segment to segment (`loss`, `bpc`) and, in the same pass, from a
    fresh state at every segment (`loss_reset`, `bpc_reset`: the state never older than `seq_len` bytes);
    the scores summed over the whole text (`segment_totals`, over the devices too) and then averaged
    (`metrics_from_totals`). The segments run from the host in chunks (`SegmentedEval`: a stop request is
    honoured between chunks); its one "batch" is (0, the split's arrays). A population: every member on the same
    text, the carry and the metrics with a leading member axis."""
    model = _model(config, task, dp)
    layout = task.eval_layout(split)
    devices = len(dp.devices)
    rows = -(-task.eval_streams // devices)  # rows past the last stream score nothing
    seq_len = task.seq_len
    axes = state_batch_axes(model)
    zeros = lambda: jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(  # noqa: E731
        lambda: task.segment_totals(jnp.zeros((rows, 1, task.output_dim)), jnp.zeros((rows, 1), jnp.int32))))

    def init(index, arrays):
        return initial_state(model, rows), zeros(), zeros()

    def segment(state, arrays, carry, k):
        model_state, carried, fresh = carry
        window = task.eval_window(arrays, k, jax.lax.axis_index(parallel.AXIS) * rows, rows, True)
        start = initial_state(model, rows)
        model_state = reset_rows(model_state, start, axes, window.reset[:, 0])
        outputs, model_state = state.apply_fn({"params": state.params}, window.inputs, state=model_state)
        reset_outputs, _ = state.apply_fn({"params": state.params}, window.inputs, state=start)
        def add(totals, out):
            return jax.tree_util.tree_map(jnp.add, totals, task.segment_totals(out, window.targets))

        return model_state, add(carried, outputs), add(fresh, reset_outputs)

    def chunk(state, carry, index, arrays, first, count):  # segments first .. first + count - 1
        return jax.lax.fori_loop(0, count, lambda i, c: segment(state, arrays, c, first + i), carry)

    def final(state, carry, index, arrays):
        carried, fresh = jax.lax.psum((carry[1], carry[2]), parallel.AXIS)  # sums over the devices' streams
        loss, metrics = task.metrics_from_totals(carried)
        loss_reset, metrics_reset = task.metrics_from_totals(fresh)
        reset = {"loss_reset": loss_reset, **{f"{k}_reset": v for k, v in metrics_reset.items()}}
        return {"loss": loss, **metrics, **reset}

    members = members or Members.alone(config)
    init = members.map(init, (None, None), takes_state=False)
    chunk = members.map(chunk, (0, 0, None, None, None, None))
    final = members.map(final, (0, 0, None, None))
    out = lambda tree: jax.tree_util.tree_map(lambda x: x[None], tree)  # noqa: E731
    into = lambda tree: jax.tree_util.tree_map(lambda x: x[0], tree)  # noqa: E731
    R, S = parallel.REPLICATED, parallel.SHARDED
    segments = SegmentedEval(
        dp=dp, length=layout.num_segments * seq_len, whole=layout.num_segments,
        tokens_per_segment=seq_len * rows * devices, budget=None,
        init=dp.map(lambda index, arrays: out(init(index, arrays)), (R, R), S),
        chunk=dp.map(lambda state, carry, *args: out(chunk(state, into(carry), *args)), (R, S, R, R, R, R), S,
                     donate_argnums=(1,)),
        final=dp.map(lambda state, carry, *args: final(state, into(carry), *args), (R, S, R, R), R))
    return Evaluator(segments, [(dp.host_scalar(0), dp.replicate(stream_arrays(task, split)))], segments=segments)


class SegmentedEval:
    """The segments of one length's evaluation (`make_segment_evaluator`), driven from the host: per batch,
    `init` makes the carry (model state, task carry, summed scores), `chunk` runs `count` segments of it
    from segment `first` (one compiled program whatever the count: a loop whose trip count is an argument),
    `final` the last, shorter segment and the metrics. Calling it evaluates one batch (`Evaluator.step`);
    `run` evaluates them all, checking for a stop between chunks."""

    def __init__(self, dp: parallel.DataParallel, length: int, whole: int, tokens_per_segment: int,
                 budget: float | None, init: Callable, chunk: Callable, final: Callable):
        self.dp, self.length, self.whole, self.tokens_per_segment, self.budget = dp, length, whole, tokens_per_segment, budget
        self._init, self._chunk, self._final = init, chunk, final
        self._count = 1  # the next chunk's segments (kept from one evaluation to the next)
        self._compiled = False  # the chunk's first call compiles: it is not timed

    def __call__(self, state: Any, batch: Any) -> Any:
        """One batch's replicated metrics."""
        return self.run(state, [batch])[0]

    def run(self, state: Any, batches: Sequence[Any], should_stop: Callable[[], bool] | None = None) -> list:
        """Every batch's replicated metrics, in order. Between chunks: `should_stop()` true raises EvalInterrupted;
        once the timed chunks have run MEASURE_SECONDS, the time of all `batches` is predicted from their speed,
        logged if long, and past `budget` (seconds; None: no limit) refused (EvalTooLongError)."""
        timed, per_segment, predicted, rows = 0.0, 0.0, False, []  # the timed chunks' seconds; the last one's speed
        for index, seed in batches:
            carry = self._init(index, seed)
            done = 0
            while done < self.whole:
                stop, count, measured, slowest = agree_on_chunk(
                    bool(should_stop and should_stop()), min(self._count, self.whole - done), timed, per_segment)
                if stop:
                    raise EvalInterrupted
                if not predicted and slowest > 0 and measured >= MEASURE_SECONDS:
                    predicted = True
                    self._predict(slowest, len(batches))
                started = time.perf_counter()
                carry = jax.block_until_ready(self._chunk(state, carry, index, seed, self.dp.host_scalar(done),
                                                          self.dp.host_scalar(count)))
                seconds = time.perf_counter() - started
                done += count
                if not self._compiled:  # the first call compiled
                    self._compiled = True
                    continue
                timed, per_segment = timed + seconds, seconds / count
                self._count = max(1, min(4 * count, int(CHUNK_SECONDS * count / max(seconds, 1e-9))))
            if agree_to_stop(bool(should_stop and should_stop())):
                raise EvalInterrupted
            rows.append(self._final(state, carry, index, seed))
        return rows

    def _predict(self, per_segment: float, batches: int) -> None:
        """From the measured seconds per segment: log the time of a long evaluation of `batches` batches; refuse one
        past the budget (every process alike: the slowest one's measure decides)."""
        seconds = per_segment * self.whole * batches
        tokens_per_sec = self.tokens_per_segment / max(per_segment, 1e-12)
        if seconds >= NOTE_SECONDS:
            log.info("eval at length %d: %s", self.length, prediction(seconds, tokens_per_sec))
        if self.budget is not None and seconds > self.budget:
            raise EvalTooLongError(self.length, seconds, tokens_per_sec, self.budget)


def train_metric_names(task: tasks.Task, skip_nonfinite: bool) -> tuple[str, ...]:
    """The keys of `train_step`'s metrics, in the order `make_dispatch` stacks them."""
    return ("loss", *task.metric_names, "grad_norm", "lr") + (("skipped",) if skip_nonfinite else ())


def default_steps_per_dispatch(platform: str) -> int:
    """`device.steps_per_dispatch=null`: 8 on CPU, where each dispatch has a fixed cost and
    allocates XLA's temporary buffer afresh; 1 on GPU/TPU, where the device runs ahead of
    the host anyway (docs/design.md)."""
    return 8 if platform == "cpu" else 1


def _model(config: cfg.Config, task: tasks.Task, dp: parallel.DataParallel) -> nn.Module:
    """The run's model (as `rnnlab.setup.plan` builds it), for its `initial_state` inside the compiled steps."""
    return build_model(config.model, task.output_dim, dp.devices[0].platform, task.input_dim)


def _train_batches(config: cfg.Config, task: tasks.Task, per_device: int) -> Callable:
    """`(state, seed) -> Batch`: this device's share of the batch of the update from `state.step` in run `seed`'s
    train stream, drawn on the device."""

    def next_batch(state, seed):
        first = jax.lax.axis_index(parallel.AXIS) * per_device
        stream = tasks.stream_key(seed, tasks.TRAIN_STREAM)
        return tasks.sample_batch(task, stream, state.step, first, per_device, config.data.min_seq_len)

    return next_batch


def make_gradient_probe(config: cfg.Config, task: tasks.Task, per_device: int, dp: parallel.DataParallel,
                        members: Members | None = None) -> Callable:
    """`probe(state) -> gradients` (replicated layout): the gradients the next update will apply,
    before clipping, on its own batch; for `log.histograms_every`. Compiles on its first call.
    members: the runs it probes (default: `config`'s alone; a population's: `PopulationState` in, gradients with
    a leading member axis out)."""
    next_batch = _train_batches(config, task, per_device)
    members = members or Members.alone(config)

    def gradients(state, seed):
        return loss_and_gradients(state, next_batch(state, seed), task, seed)[1]

    if carries_state(task):  # the text streams (the members share them), the batch and the carry from the step
        stream_batch, _ = _stream_batches(config, task, per_device, _model(config, task, dp))

        def gradients(state, inputs):
            seed, arrays = inputs
            batch, carry = stream_batch(state, arrays)
            return carried_loss_and_gradients(state, batch, task, seed, carry)[1]

        mapped = dp.map(members.map(gradients, (0, (0, None))), (parallel.REPLICATED, parallel.REPLICATED),
                        parallel.REPLICATED)
        inputs = dp.replicate((members.values.seed, stream_arrays(task)))
        return lambda state: mapped(state, inputs)
    mapped = dp.map(members.map(gradients, 0), (parallel.REPLICATED, parallel.REPLICATED), parallel.REPLICATED)
    seed = members.seeds(dp)
    return lambda state: mapped(state, seed)


def make_dispatch(config: cfg.Config, task: tasks.Task, dp: parallel.DataParallel,
                  per_device: int, max_steps: int = 1, members: Members | None = None) -> Callable:
    """`dispatch(state, n)`: n <= max_steps consecutive train steps in one dispatch, each with
    its batch drawn on the devices (lengths drawn per example with data.min_seq_len)
    -> (state, f32[max_steps, len(train_metric_names)]),
    row i holding step i's metrics (rows >= n unused; with max_steps=1 one row, f32[len(names)]);
    state donated.

    Drawing the batch inside the step makes one dispatch per step instead of two, and
    stacking the metrics one device-to-host copy per dispatch instead of one per metric.
    With max_steps > 1 the steps run in a `fori_loop` whose trip count is an argument, so
    every n shares one compilation and the same loop body: a run resumed mid-way reaches
    the same numbers. The run's `Hyperparameters` (lr, schedule, seed) are arguments too, so
    runs that differ only in them compile the same program (a persistent-cache hit).

    `dispatch.compile(state)` compiles it ahead of the first call (which then runs that
    executable) and returns XLA's memory analysis of it, so that a step that cannot fit is
    refused before it runs.

    members: the runs it trains (default: `config`'s alone); a population's (`Members.population`): the state is a
    `PopulationState`, every step runs each member on its own batch with its own numbers (`over_members`: the
    member axis beside the device axis), and each row of metrics gains a member axis: f32[..., members, len(names)]."""
    skip = config.on_nonfinite == "skip"
    names = train_metric_names(task, skip)
    next_batch = _train_batches(config, task, per_device)
    members = members or Members.alone(config)
    hyper, inputs_axes = dp.replicate(members.values), 0

    def one_step(state, values):
        tx, schedule = make_optimizer(config.optimizer, values.total_steps, values)
        state, metrics = train_step(state, next_batch(state, values.seed), task, schedule, skip, values.seed, tx)
        return state, jnp.stack([metrics[k] for k in names])

    if carries_state(task):  # truncated BPTT over the text's streams: the text an input beside the numbers
        stream_batch, axes = _stream_batches(config, task, per_device, _model(config, task, dp))
        # the members' numbers, and the text they share
        hyper, inputs_axes = dp.replicate((members.values, stream_arrays(task))), (0, None)

        def one_step(state, inputs):
            values, arrays = inputs
            tx, schedule = make_optimizer(config.optimizer, values.total_steps, values)
            batch, carry = stream_batch(state, arrays)
            state, metrics = train_step(state, batch, task, schedule, skip, values.seed, tx, carry, axes)
            return state, jnp.stack([metrics[k] for k in names])

    one_step = members.step(one_step, names, stop_diverged=not skip, inputs_axes=inputs_axes)
    row_shape = members.row_shape(names)

    out_layouts = (parallel.REPLICATED, parallel.REPLICATED)
    if max_steps == 1:
        single = dp.map(one_step, (parallel.REPLICATED, parallel.REPLICATED), out_layouts, donate_argnums=(0,))

        def dispatch_one(state, n: int):
            if n != 1:
                raise ValueError(f"n={n} steps: this dispatch runs 1")
            return single(state, hyper)  # metrics f32[len(names)]: one row

        def compile_one(state):
            nonlocal single
            single = single.lower(state, hyper).compile()
            return single.memory_analysis()

        dispatch_one.compile = compile_one
        return dispatch_one

    def steps(state, n, values):
        def body(i, carry):
            state, rows = carry
            state, metrics = one_step(state, values)
            return state, rows.at[i].set(metrics)

        return jax.lax.fori_loop(0, n, body, (state, jnp.zeros((max_steps, *row_shape), jnp.float32)))

    layouts = (parallel.REPLICATED, parallel.REPLICATED, parallel.REPLICATED)
    mapped = dp.map(steps, layouts, out_layouts, donate_argnums=(0,))
    counts: dict[int, Any] = {}  # n -> its argument, built once

    def dispatch(state, n: int):
        if not 1 <= n <= max_steps:
            raise ValueError(f"n={n} steps: this dispatch runs 1 .. {max_steps}")
        if n not in counts:
            counts[n] = dp.host_scalar(n)
        return mapped(state, counts[n], hyper)

    def compile_all(state):
        nonlocal mapped
        mapped = mapped.lower(state, dp.host_scalar(max_steps), hyper).compile()
        return mapped.memory_analysis()

    dispatch.compile = compile_all
    return dispatch


def population_step(one_step: Callable, names: Sequence[str], stop_diverged: bool, count: int,
                    inputs_axes: Any = 0) -> Callable:
    """`one_step(TrainState, inputs) -> (TrainState, row)` of one run -> the same for a `PopulationState` of `count`
    members and inputs whose member axis is at `inputs_axes` (`over_members`; the `Hyperparameters` stacked, and data
    the members share at None). stop_diverged: a member whose loss or gradient
    norm is not finite keeps its state from then on (its updates stop, its rows go on being computed: the host
    stops reading them), as a lone run would stop there."""
    loss, norm = names.index("loss"), names.index("grad_norm")

    def member(state, alive, values):
        new, row = one_step(state, values)
        if stop_diverged and count > 1:  # one member: the host ends the run at its first non-finite row
            alive = alive & jnp.isfinite(row[loss]) & jnp.isfinite(row[norm])
            new = jax.tree_util.tree_map(lambda a, b: jnp.where(alive, a, b), new, state)
        return new, alive, row

    members = over_members(member, count, (0, 0, inputs_axes), 0)

    def step(state, values):
        new, alive, rows = members(state.members, state.alive, values)
        return PopulationState(new, alive), rows

    return step


def over_members(fn: Callable, count: int, in_axes: Any, out_axes: Any) -> Callable:
    """`jax.vmap(fn, in_axes, out_axes, axis_size=count)` over a member axis of `count`; for one member, `fn` between
    a squeeze of its inputs' member axes and an expansion of its outputs' (the same values): a batching of one would
    make XLA compile a program of its own (more copies, other layouts), where a population of one should run as its
    run alone. `in_axes`: an axis or None per argument (or one for all; an argument's own may be a tree of them, as
    jax.vmap takes), `out_axes`: one for all outputs or one per output."""
    if count != 1:
        return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_size=count)

    def at(axes: Any, n: int) -> tuple:
        return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,) * n

    def squeeze(axes: Any, tree: Any) -> Any:  # `axes` a prefix of `tree`, None where nothing is mapped
        return jax.tree_util.tree_map(
            lambda axis, sub: sub if axis is None else jax.tree_util.tree_map(lambda x: jnp.squeeze(x, axis), sub),
            axes, tree, is_leaf=lambda x: x is None)

    def one(*args):
        out = fn(*(squeeze(axis, a) for a, axis in zip(args, at(in_axes, len(args)), strict=True)))
        if not isinstance(out_axes, (tuple, list)):
            return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, out_axes), out)
        return tuple(jax.tree_util.tree_map(lambda x, axis=axis: jnp.expand_dims(x, axis), o)
                     for o, axis in zip(out, out_axes, strict=True))

    return one


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each key over `rows` (dicts with the same keys); {} for no rows."""
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} if rows else {}


class Evaluator(NamedTuple):
    """`make_evaluator`'s eval step of one length and its eval batches, on the devices."""

    step: Callable  # p_eval_step(state, batch) -> replicated metrics (and with examples > 0, sharded outputs)
    batches: list
    examples: int = 0  # outputs of each shard's first examples that the step also returns
    segments: SegmentedEval | None = None  # a length run in segments: `step` is it, `segments.run` all its batches


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: it holds functions
class StepFunctions:
    """The compiled functions of a run, each in the replicated layout of `dp` and compiled on its
    first call (the dispatch ahead of it: `dispatch.compile`). Their host reads give NumPy arrays
    and dicts of floats; a population's (`members.stacked`) give one of each per member, in member order."""

    dp: parallel.DataParallel
    dispatch: Callable  # make_dispatch's: (state, n <= steps_per_dispatch) -> (state, stacked metrics)
    steps_per_dispatch: int
    metric_names: tuple[str, ...]  # train_metric_names: the columns of the dispatch's metrics
    evaluators: dict[int, Evaluator]  # by eval length: data.seq_len's (the usual eval) first, then data.eval_seq_lens'
    gradient_probe: Callable | None  # make_gradient_probe's, with log.histograms_every > 0
    members: Members  # the runs it trains: a run alone, or a population (its state a `PopulationState`)
    # Evaluated once, at the last step, by name (data=text: {"test": the test text's `make_stream_evaluator`})
    final_evaluators: dict[str, Evaluator] = dataclasses.field(default_factory=dict)
    samples: Callable | None = None  # data=text: state -> a few sampled texts as Markdown (`make_text_samples`)

    def evaluate_final(self, state: Any, should_stop: Callable[[], bool] | None = None) -> dict[str, dict[str, float]]:
        """{name: mean metrics} of `final_evaluators` (each run in segments); EvalInterrupted as `evaluate`."""
        asked = should_stop or (lambda: False)
        out: list[dict[str, dict[str, float]]] = [{} for _ in range(self.members.count)]
        for name, evaluator in self.final_evaluators.items():
            if agree_to_stop(asked()):
                raise EvalInterrupted
            rows = self.dp.to_host(evaluator.segments.run(state, evaluator.batches, asked))
            for mine, member_rows in zip(out, self.members.each(rows), strict=True):
                mine[name] = mean_rows([{k: float(v) for k, v in m.items()} for m in member_rows])
        return self.members.per_member(out)

    def host_rows(self, dispatches: Sequence[tuple[int, jax.Array]]) -> list:
        """(n, stacked metrics) of dispatches -> one dict of host floats per step, in order (a population: a
        list of them per member). Waits for those dispatches; the copies all start at once."""
        names = self.metric_names
        host = self.dp.to_host([metrics for _, metrics in dispatches])
        shape = self.members.row_shape(names)
        steps = np.concatenate([rows.reshape(-1, *shape)[:n] for (n, _), rows in zip(dispatches, host)])
        return self.members.per_member([[dict(zip(names, map(float, row), strict=True)) for row in member]
                                        for member in self.members.each(steps, axis=1)])

    def evaluate(self, state: Any, should_stop: Callable[[], bool] | None = None) -> tuple[Any, Any]:
        """(mean eval metrics at every evaluated length (keys as `evaluators`), the eval examples), one length after
        another: a length evaluated whole is dispatched at once, then read; one in segments runs chunk by chunk
        (`SegmentedEval.run`, which may refuse it: EvalTooLongError). `should_stop()` is asked before each length
        and between chunks: true raises EvalInterrupted. The examples are (inputs, targets, outputs) of the
        first examples of the usual eval's first batch (the first device's), for tasks whose targets are a symbol
        per step ([B, T]) where its evaluator returns outputs; else None. A population: a list of both, per member."""
        asked = should_stop or (lambda: False)
        metrics, shown = [], None
        for i, evaluator in enumerate(self.evaluators.values()):
            if agree_to_stop(asked()):
                raise EvalInterrupted
            if evaluator.segments is not None:
                metrics.append(self.dp.to_host(evaluator.segments.run(state, evaluator.batches, asked)))
                continue
            rows = [evaluator.step(state, batch) for batch in evaluator.batches]
            if i == 0 and evaluator.examples:  # the usual eval's examples
                shown = (evaluator.batches[0], rows[0][1])
                rows = [m for m, _ in rows]
            rows, shown = self.dp.to_host((rows, shown)) if i == 0 else (self.dp.to_host(rows), shown)
            metrics.append(rows)
        each = self.members.each
        examples = [None] * self.members.count if shown is None else list(zip(each(shown[0], 1), each(shown[1], 1)))
        return (self.members.per_member([self._by_length(m) for m in each(metrics)]),
                self.members.per_member([self._examples(e) for e in examples]))

    def _by_length(self, metrics: Any) -> dict[int, dict[str, float]]:
        return {n: mean_rows([{k: float(v) for k, v in m.items()} for m in rows])
                for n, rows in zip(self.evaluators, metrics)}

    @staticmethod
    def _examples(shown: Any) -> tuple[np.ndarray, ...] | None:
        if shown is None or np.ndim(shown[0].targets) != 2:
            return None
        batch, outputs = shown
        count = len(outputs)
        return np.asarray(batch.inputs[:count]), np.asarray(batch.targets[:count]), np.asarray(outputs)

    def param_stats(self, state: Any) -> tuple[Any, Any]:
        """(parameters, the gradients the next update applies), on the host; every process computes the
        gradients (a collective). A population's carry a leading member axis."""
        return self.dp.to_host((state.params, self.gradient_probe(state)))


def make_step_functions(config: cfg.Config, task: tasks.Task, devices: Sequence[jax.Device],
                        steps_per_dispatch: int, examples: int = 0,
                        members: Members | None = None) -> StepFunctions:
    """The run's `StepFunctions` on `devices`; the eval batches of every evaluated length are drawn now.
    examples: how many eval examples the usual eval also returns the outputs of (`StepFunctions.evaluate`).
    members: the runs they train (`make_dispatch`; default: `config`'s alone)."""
    per_device = config.batch_size // len(devices)
    dp = parallel.DataParallel(devices, config.device.strategy)
    members = members or Members.alone(config)
    dispatch = make_dispatch(config, task, dp, per_device, steps_per_dispatch, members)
    # One eval step and its batches per length: data.seq_len's, then each further data.eval_seq_lens length;
    # a length past data.eval_segment_len in segments, its batches drawn segment by segment as it runs.
    segment = config.data.eval_segment_len

    def evaluator(t: tasks.Task, examples: int = 0) -> Evaluator:
        if segment is not None and t.total_len > segment:
            return make_segment_evaluator(config, t, per_device, dp, segment, members)
        return make_evaluator(config, t, per_device, dp, examples, members)

    if carries_state(task):  # held-out text through its streams
        evaluators = {task.seq_len: make_stream_evaluator(config, task, dp, "valid", members)}
    else:
        evaluators = {task.seq_len: evaluator(task, examples)}
        evaluators |= {n: evaluator(task.with_seq_len(n)) for n in config.data.eval_seq_lens if n != task.seq_len}
    return StepFunctions(
        dp=dp, dispatch=dispatch, steps_per_dispatch=steps_per_dispatch,
        metric_names=train_metric_names(task, config.on_nonfinite == "skip"), evaluators=evaluators,
        gradient_probe=make_gradient_probe(config, task, per_device, dp, members) if config.log.histograms_every else None,
        members=members,
        final_evaluators={"test": make_stream_evaluator(config, task, dp, "test", members)}
        if carries_state(task) and task.splits["test"].names else {},
        samples=make_text_samples(config, task, dp, members) if carries_state(task) else None,
    )


# What each eval of data=text samples for TensorBoard's text tab (`eval/samples`): a few bytes, cheap beside the eval.
SAMPLES, SAMPLE_BYTES, SAMPLE_PROMPT_BYTES, SAMPLE_TEMPERATURE = 2, 200, 48, 0.8


def make_text_samples(config: cfg.Config, task: tasks.Task, dp: parallel.DataParallel,
                      members: Members | None = None) -> Callable:
    """`samples(state) -> Markdown`: SAMPLES continuations by SAMPLE_BYTES bytes (temperature SAMPLE_TEMPERATURE,
    seed 0) of the validation text's first SAMPLE_PROMPT_BYTES bytes, by the state's parameters; on the first
    device, one compiled prefill and one compiled sampling loop. A population: one Markdown per member."""
    from rnnlab import decode, textdata  # noqa: PLC0415

    model = _model(config, task, dp)
    prompt = task.splits["valid"].text[:SAMPLE_PROMPT_BYTES].astype(np.int32)
    prompt_ids = jnp.asarray(np.broadcast_to(prompt, (SAMPLES, len(prompt))))
    first_key, rest_key = jax.random.split(jax.random.key(0))

    members = members or Members.alone(config)

    def samples(state):
        return members.per_member([one(params) for params in members.each(dp.to_host(state.params))])

    def one(params):
        logits, carry = decode.prefill(model, params, prompt_ids, initial_state(model, SAMPLES))
        first = decode.choose(logits[:, -1], first_key, SAMPLE_TEMPERATURE)
        tokens, _ = decode.sample(model, params, carry, first, SAMPLE_BYTES, rest_key, SAMPLE_TEMPERATURE)
        shown = textdata.decode(prompt)
        return "\n\n".join(f"**{i + 1}.** (the prompt, then ⟩ and what was drawn)\n\n```\n{shown}⟩"
                            f"{textdata.decode(row).replace('```', chr(39) * 3)}\n```"
                            for i, row in enumerate(np.asarray(tokens)))

    return samples
