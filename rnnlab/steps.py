"""The pure pieces of training: optimizer, train state, `train_step` and `eval_step`, on-device
batch sampling, and the compiled multi-step dispatch the loop calls.

`train_step(state, batch) -> (state, metrics)` runs on one device's shard with gradients
and metrics averaged over `parallel.AXIS`; parallelism is applied where it is called
(`parallel.DataParallel.map`). Inside the loop the state is in the replicated layout.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from rnnlab import config as cfg
from rnnlab import parallel, tasks

PARAMS_STREAM = 2
DROPOUT_STREAM = 3


def make_optimizer(config: cfg.OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping -> optimizer, with a learning-rate schedule over `total_steps`.

    `schedule(s)` is the learning rate of the update that takes the state from step s-1
    to s: linear warm-up reaches `lr` at s = warmup_steps (the first update already
    moves, at lr / warmup_steps), then cosine decay to `end_lr_ratio * lr` at the
    last step, or constant.
    """
    warmup = min(config.warmup_steps, total_steps)
    if config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(config.lr, max(total_steps - warmup, 1), alpha=config.end_lr_ratio)
    else:
        decay = optax.constant_schedule(config.lr)
    if warmup:
        schedule = optax.join_schedules([optax.linear_schedule(0.0, config.lr, warmup), decay], [warmup])
    else:
        schedule = decay
    # Optax calls the schedule with the number of updates applied so far.
    lr = lambda count: schedule(count + 1)  # noqa: E731
    if config.name == "adam":
        opt = optax.chain(optax.add_decayed_weights(config.weight_decay), optax.adam(lr, config.b1, config.b2))
    elif config.name == "adamw":
        opt = optax.adamw(lr, config.b1, config.b2, weight_decay=config.weight_decay)
    elif config.name == "sgd":
        opt = optax.chain(optax.add_decayed_weights(config.weight_decay), optax.sgd(lr, momentum=config.momentum or None))
    else:
        raise ValueError(f"unknown optimizer {config.name!r}")
    clip = optax.clip_by_global_norm(config.clip_norm) if config.clip_norm > 0 else optax.identity()
    return optax.chain(clip, opt), schedule


def create_train_state(
    key: jax.Array, model: nn.Module, example_inputs: jax.Array, tx: optax.GradientTransformation
) -> train_state.TrainState:
    """Unreplicated initial state. example_inputs: the model's input, f32[B, T, I] or token ids
    int32[B, T] (`Task.example_inputs`; only shapes matter)."""
    params = jax.jit(model.init)(key, example_inputs)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # A strongly typed step: a weakly typed Python 0 would make the second step recompile.
    return state.replace(step=jnp.zeros((), jnp.int32))


def train_step(
    state: train_state.TrainState,
    batch: tasks.Batch,
    task: tasks.Task,
    schedule: optax.Schedule,
    skip_nonfinite: bool = False,
    seed: int = 0,
) -> tuple[train_state.TrainState, dict[str, jax.Array]]:
    """One optimizer update on this device's shard; gradients and metrics averaged over `AXIS`.

    skip_nonfinite: if the loss or gradient norm is NaN/Inf, keep the old parameters and
    optimizer state (the step counter still advances, so the data stream moves on) and
    report `skipped` = 1.
    """

    metrics, grads = loss_and_gradients(state, batch, task, seed)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = schedule(state.step + 1)
    new_state = state.apply_gradients(grads=grads)
    if skip_nonfinite:
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        keep_old = state.replace(step=new_state.step)
        new_state = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old), new_state, keep_old)
        metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
    return new_state, metrics


def loss_and_gradients(state: train_state.TrainState, batch: tasks.Batch, task: tasks.Task,
                       seed: int = 0) -> tuple[dict[str, jax.Array], Any]:
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


def eval_step(state: train_state.TrainState, batch: tasks.Batch, task: tasks.Task) -> dict[str, jax.Array]:
    outputs = state.apply_fn({"params": state.params}, batch.inputs)
    loss, task_metrics = task.loss_and_metrics(outputs, batch.targets)
    return jax.lax.pmean({"loss": loss, **task_metrics}, parallel.AXIS)


def make_sampler(task: tasks.Task, stream: jax.Array, per_device: int, dp: parallel.DataParallel) -> Callable:
    """`step -> Batch` on every device: each device draws its own slice of the global batch."""

    def sample(step):
        first = jax.lax.axis_index(parallel.AXIS) * per_device
        return tasks.sample_batch(task, stream, step, first, per_device)

    return dp.map(sample, (parallel.REPLICATED,), parallel.SHARDED)


def pmap_sampler(task: tasks.Task, stream: jax.Array, per_device: int, devices: list) -> Callable:
    """`make_sampler` with pmap: `step[num_devices] -> Batch` with a leading device axis."""
    return make_sampler(task, stream, per_device, parallel.DataParallel(devices, "pmap"))


def make_evaluator(config: cfg.Config, task: tasks.Task, per_device: int,
                   dp: parallel.DataParallel) -> tuple[Callable, list]:
    """(p_eval_step, eval batches) of `task`: its eval step mapped over `dp` (state replicated, batch
    sharded -> replicated metrics) and the `config.eval_batches` batches of the eval stream at the
    task's length, drawn once on the devices. One per evaluated length: each compiles on its first call."""
    p_eval_step = dp.map(functools.partial(eval_step, task=task), (parallel.REPLICATED, parallel.SHARDED),
                         parallel.REPLICATED)
    sample = make_sampler(task, tasks.stream_key(config.seed, tasks.EVAL_STREAM), per_device, dp)
    return p_eval_step, [sample(dp.host_scalar(i)) for i in range(config.eval_batches)]


def train_metric_names(task: tasks.Task, skip_nonfinite: bool) -> tuple[str, ...]:
    """The keys of `train_step`'s metrics, in the order `make_dispatch` stacks them."""
    return ("loss", *task.metric_names, "grad_norm", "lr") + (("skipped",) if skip_nonfinite else ())


def default_steps_per_dispatch(platform: str) -> int:
    """`device.steps_per_dispatch=null`: 8 on CPU, where each dispatch has a fixed cost and
    allocates XLA's temporary buffer afresh; 1 on GPU/TPU, where the device runs ahead of
    the host anyway (docs/design.md)."""
    return 8 if platform == "cpu" else 1


def _train_batches(config: cfg.Config, task: tasks.Task, per_device: int) -> Callable:
    """`state -> Batch`: this device's share of the batch of the update from `state.step`, drawn on the device."""
    stream = tasks.stream_key(config.seed, tasks.TRAIN_STREAM)

    def next_batch(state):
        first = jax.lax.axis_index(parallel.AXIS) * per_device
        return tasks.sample_batch(task, stream, state.step, first, per_device, config.data.min_seq_len)

    return next_batch


def make_gradient_probe(config: cfg.Config, task: tasks.Task, per_device: int, dp: parallel.DataParallel) -> Callable:
    """`probe(state) -> gradients` (replicated layout): the gradients the next update will apply,
    before clipping, on its own batch; for `log.histograms_every`. Compiles on its first call."""
    next_batch = _train_batches(config, task, per_device)

    def gradients(state):
        return loss_and_gradients(state, next_batch(state), task, config.seed)[1]

    return dp.map(gradients, (parallel.REPLICATED,), parallel.REPLICATED)


def make_dispatch(config: cfg.Config, task: tasks.Task, schedule: optax.Schedule, dp: parallel.DataParallel,
                  per_device: int, max_steps: int = 1) -> Callable:
    """`dispatch(state, n)`: n <= max_steps consecutive train steps in one dispatch, each with
    its batch drawn on the devices (lengths drawn per example with data.min_seq_len)
    -> (state, f32[max_steps, len(train_metric_names)]),
    row i holding step i's metrics (rows >= n unused; with max_steps=1 one row, f32[len(names)]);
    state donated.

    Drawing the batch inside the step makes one dispatch per step instead of two, and
    stacking the metrics one device-to-host copy per dispatch instead of one per metric.
    With max_steps > 1 the steps run in a `fori_loop` whose trip count is an argument, so
    every n shares one compilation and the same loop body: a run resumed mid-way reaches
    the same numbers.

    `dispatch.compile(state)` compiles it ahead of the first call (which then runs that
    executable) and returns XLA's memory analysis of it, so that a step that cannot fit is
    refused before it runs."""
    skip = config.on_nonfinite == "skip"
    update = functools.partial(train_step, task=task, schedule=schedule, skip_nonfinite=skip, seed=config.seed)
    names = train_metric_names(task, skip)
    next_batch = _train_batches(config, task, per_device)

    def one_step(state):
        state, metrics = update(state, next_batch(state))
        return state, jnp.stack([metrics[k] for k in names])

    out_layouts = (parallel.REPLICATED, parallel.REPLICATED)
    if max_steps == 1:
        single = dp.map(one_step, (parallel.REPLICATED,), out_layouts, donate_argnums=(0,))

        def dispatch_one(state, n: int):
            if n != 1:
                raise ValueError(f"n={n} steps: this dispatch runs 1")
            return single(state)  # metrics f32[len(names)]: one row

        def compile_one(state):
            nonlocal single
            single = single.lower(state).compile()
            return single.memory_analysis()

        dispatch_one.compile = compile_one
        return dispatch_one

    def steps(state, n):
        def body(i, carry):
            state, rows = carry
            state, metrics = one_step(state)
            return state, rows.at[i].set(metrics)

        return jax.lax.fori_loop(0, n, body, (state, jnp.zeros((max_steps, len(names)), jnp.float32)))

    mapped = dp.map(steps, (parallel.REPLICATED, parallel.REPLICATED), out_layouts, donate_argnums=(0,))
    counts: dict[int, Any] = {}  # n -> its argument, built once

    def dispatch(state, n: int):
        if not 1 <= n <= max_steps:
            raise ValueError(f"n={n} steps: this dispatch runs 1 .. {max_steps}")
        if n not in counts:
            counts[n] = dp.host_scalar(n)
        return mapped(state, counts[n])

    def compile_all(state):
        nonlocal mapped
        mapped = mapped.lower(state, dp.host_scalar(max_steps)).compile()
        return mapped.memory_analysis()

    dispatch.compile = compile_all
    return dispatch


