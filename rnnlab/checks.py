"""Range and choice checks of a built `Config` (`rnnlab.config.from_dict` runs them): each problem is
one `ConfigError` whose line names the key, the value and what is allowed."""

from __future__ import annotations

from rnnlab import cells, tasks
from rnnlab.blocks import MLPS
from rnnlab.config import (
    BLOCKS, DTYPES, MAX_DEVICES, MAX_STEPS_PER_DISPATCH, NONFINITE_POLICIES, OPTIMIZERS, PLATFORMS, RECURRENCES,
    SCHEDULES, SEED_LIMIT, STACK_INITS, STRATEGIES, Config, ConfigError, OptimizerConfig, flatten,
)
from rnnlab.config import check_choice as _choice

MAX_MLP_EXPAND = 64  # wider than any published block (GPT-2's and Zoology's are 4)


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"key '{key}': got {value!r}, must be > 0")


def _non_negative(key: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"key '{key}': got {value!r}, must be >= 0")


def validate(c: Config) -> None:
    """Range and choice checks; raises ConfigError on the first problem."""
    for key in ("steps", "batch_size", "hidden_dim", "num_layers", "log_every", "eval_every", "eval_batches"):
        _positive(key, getattr(c, key))
    if not 0 <= c.seed < SEED_LIMIT:
        raise ConfigError(f"key 'seed': got {c.seed}, allowed: 0 .. {SEED_LIMIT - 1} "
                          f"(JAX keys hold 32 bits: a larger seed would repeat a smaller one's run)")
    _choice("on_nonfinite", c.on_nonfinite, NONFINITE_POLICIES)
    _validate_model(c)
    _choice("data.task", c.data.task, tasks.task_names())
    try:
        tasks.check_data(c.data)  # the task's options, data.seq_len, data.min_seq_len, data.eval_seq_lens
    except tasks.OptionError as e:
        raise ConfigError(str(e)) from None
    _validate_optimizer(c.optimizer)
    _validate_devices(c)
    _non_negative("checkpoint.every", c.checkpoint.every)
    _positive("checkpoint.keep", c.checkpoint.keep)
    known = set(flatten(c))
    for name in c.checkpoint.allow_changes:
        if name not in known:
            raise ConfigError(f"key 'checkpoint.allow_changes': {name!r} is not a config key; allowed: dotted keys "
                              f"as `python train.py --cfg job` shows them, e.g. [steps,optimizer.lr]")
    _positive("profile.start_step", c.profile.start_step)
    _non_negative("profile.num_steps", c.profile.num_steps)
    _non_negative("log.histograms_every", c.log.histograms_every)
    _positive("zoo.seeds", c.zoo.seeds)


def _validate_model(c: Config) -> None:
    m = c.model
    _choice("model.cell", m.cell, cells.cell_names())
    for key in ("hidden_dim", "num_layers"):  # the top-level key is the one source
        if getattr(m, key) != getattr(c, key):
            raise ConfigError(f"key 'model.{key}': got {getattr(m, key)}, but the top-level {key} is {getattr(c, key)}; "
                              f"set the top-level key instead ({key}={getattr(m, key)})")
    _choice("model.init", m.init, tuple(cells.INITIALIZERS))
    _choice("model.activation", m.activation, tuple(cells.ACTIVATIONS))
    _choice("model.stack_init", m.stack_init, STACK_INITS)
    _choice("model.dtype", m.dtype, DTYPES)
    _choice("model.recurrence", m.recurrence, RECURRENCES)
    if m.recurrence == "custom_vjp" and not m.make_cell().has_backward:
        raise ConfigError(f"key 'model.recurrence': got 'custom_vjp', but cell {m.cell!r} has no hand-written "
                          f"backward; allowed: autodiff")
    if m.recurrence in ("onednn", "auto") and m.make_cell().onednn_kernel is None:
        with_kernel = [name for name in cells.cell_names() if cells.get_cell(name).onednn_kernel]
        raise ConfigError(f"key 'model.recurrence': got {m.recurrence!r}, but cell {m.cell!r} has no oneDNN kernel; "
                          f"allowed: autodiff, custom_vjp (onednn and auto: {', '.join(with_kernel)})")
    if m.recurrence == "onednn" and m.dtype != "float32":
        raise ConfigError(f"key 'model.dtype': got {m.dtype!r}, but model.recurrence=onednn runs float32 only; "
                          f"allowed: float32, or model.recurrence=auto or custom_vjp")
    if m.recurrence in ("custom_vjp", "onednn", "auto") and m.remat:
        raise ConfigError("key 'model.remat': got true, which needs model.recurrence=autodiff "
                          f"(model.recurrence={m.recurrence} keeps its own residuals; allowed: model.recurrence=autodiff, or model.remat=false)")
    if m.unroll is not None:
        _positive("model.unroll", m.unroll)
    _choice("model.block", m.block, BLOCKS)
    _choice("model.mlp", m.mlp, MLPS)
    if not 0 < m.mlp_expand <= MAX_MLP_EXPAND:
        raise ConfigError(f"key 'model.mlp_expand': got {m.mlp_expand}, must be in (0, {MAX_MLP_EXPAND}] "
                          f"(the MLP's hidden width in multiples of hidden_dim)")
    cell = m.make_cell()
    if m.time_scan not in cell.time_scans:
        raise ConfigError(f"key 'model.time_scan': got {m.time_scan!r}, allowed for cell {m.cell!r}: "
                          f"{', '.join(cell.time_scans)}")
    if m.remat and isinstance(cell, cells.SequenceCell):
        raise ConfigError(f"key 'model.remat': got true, but cell {m.cell!r} mixes the whole sequence at once: "
                          f"it has no per-step cell to recompute; allowed: false")
    problem = cell.option_problem()
    if problem:
        raise ConfigError(problem)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"key 'model.dropout': got {m.dropout}, must be in [0, 1)")


def _validate_optimizer(o: OptimizerConfig) -> None:
    _choice("optimizer.name", o.name, OPTIMIZERS)
    _positive("optimizer.lr", o.lr)
    _choice("optimizer.schedule", o.schedule, SCHEDULES)
    _non_negative("optimizer.warmup_steps", o.warmup_steps)
    _non_negative("optimizer.clip_norm", o.clip_norm)
    _non_negative("optimizer.weight_decay", o.weight_decay)
    if not 0.0 <= o.end_lr_ratio <= 1.0:
        raise ConfigError(f"key 'optimizer.end_lr_ratio': got {o.end_lr_ratio}, must be in [0, 1]")
    for key in ("momentum", "b1", "b2"):
        value = getattr(o, key)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"key 'optimizer.{key}': got {value}, must be in [0, 1)")


def _validate_devices(c: Config) -> None:
    d = c.distributed
    if d.num_processes is not None:
        _positive("distributed.num_processes", d.num_processes)
    if d.process_id is not None and not 0 <= d.process_id < (d.num_processes or 1):
        raise ConfigError(
            f"key 'distributed.process_id': got {d.process_id}, must be in [0, distributed.num_processes={d.num_processes})"
        )
    _choice("device.platform", c.device.platform, PLATFORMS)
    _choice("device.strategy", c.device.strategy, STRATEGIES)
    n = c.device.num_devices
    if n is not None and not 1 <= n <= MAX_DEVICES:
        raise ConfigError(f"key 'device.num_devices': got {n}, allowed: null or 1 .. {MAX_DEVICES} "
                          f"(the devices of one process; a CPU simulates that many)")
    k = c.device.steps_per_dispatch
    if k is not None and not 1 <= k <= MAX_STEPS_PER_DISPATCH:
        raise ConfigError(f"key 'device.steps_per_dispatch': got {k}, allowed: null or 1 .. {MAX_STEPS_PER_DISPATCH}")
