"""Typed, validated configuration: the one library module that touches OmegaConf.

`from_omegaconf` turns Hydra's composed `DictConfig` into frozen dataclasses and
checks every value (`validate`: each field's declared range or choices, `rnnlab.options`, then the checks
across keys) before anything is compiled. Every problem is a `ConfigError`
whose one-line message names the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Mapping, Optional

from rnnlab import cells, exit_codes, tasks
from rnnlab.blocks import MLPS
from rnnlab.options import allowed, declaration, declared_problem

DTYPES = ("float32", "bfloat16")
STACK_INITS = ("vmap", "scan")
RECURRENCES = ("autodiff", "custom_vjp", "onednn", "auto")
BLOCKS = ("plain", "residual")
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("cosine", "constant")
PLATFORMS = ("auto", "cpu", "gpu", "tpu")
STRATEGIES = ("pmap", "shard_map")

NONFINITE_POLICIES = ("stop", "skip")
MAX_DEVICES = 64  # per process: more local accelerators than any host has, and simulated CPU devices beyond
# about this many spend their time in all-reduce rendezvous (1000 ended in an XLA abort)
SEED_LIMIT = 2**32  # jax.random.key(seed) keeps the low 32 bits
# Train steps one dispatch may run: half of the 16 steps the loop lets queue (loop.MAX_STEPS_IN_FLIGHT),
# so that one dispatch always runs while the host reads the one before.
MAX_STEPS_PER_DISPATCH = 8
MAX_MLP_EXPAND = 64  # wider than any published block (GPT-2's and Zoology's are 4)
POSITIVE = {"low": 0, "low_open": True}  # the declaration of a count or size: must be > 0
NON_NEGATIVE = {"low": 0}  # must be >= 0
FRACTION = {"low": 0.0, "high": 1.0, "high_open": True}  # must be in [0, 1)


# `model.pattern_keys`: for each pattern cell other than model.cell, the (key, value) pairs its layers run with.
PatternKeys = tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
# The keys a pattern cell's layers take beyond its class's own options (as model.cell's under `model:`).
LAYER_KEYS = ("init", "activation", "forget_bias", "recurrence", "time_scan")


class ConfigError(ValueError):
    """A config value is missing, misspelt, mistyped or out of range."""

    exit_code = exit_codes.BAD_INPUT  # rnnlab.exit_codes.of_error


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    cell: str = allowed(choices=cells.cell_names)
    hidden_dim: int  # the top-level hidden_dim is the one source (`_validate_model`)
    num_layers: int
    init: str = allowed(choices=lambda: tuple(cells.INITIALIZERS))
    activation: str = allowed(choices=lambda: tuple(cells.ACTIVATIONS))
    scan_layers: bool
    stack_init: str = allowed(choices=STACK_INITS)
    forget_bias: float
    recurrence: str = allowed(choices=RECURRENCES)
    remat: bool
    dtype: str = allowed(choices=DTYPES)
    unroll: Optional[int] = allowed(null=True, **POSITIVE)  # None: per platform, resolved by rnnlab.models.build_model
    dropout: float = allowed(**FRACTION)
    # plain: the layers as they are | residual: pre-norm residual blocks with a gated MLP
    block: str = allowed(choices=BLOCKS)
    time_scan: str  # one of the cell's forms (`Cell.time_scans`): sequential, associative, chunked, parallel, blockwise
    # The residual block's channel mixer after the mixer (rnnlab.blocks): none | gelu | geglu | swiglu, its
    # hidden width in multiples of hidden_dim, and biases on its dense layers. Each model config names its
    # paper's; a config that leaves them out gets today's gated MLP.
    mlp: str = allowed("geglu", choices=MLPS)
    mlp_expand: float = allowed(2.0, low=0, low_open=True, high=MAX_MLP_EXPAND,
                                note="the MLP's hidden width in multiples of hidden_dim")
    mlp_bias: bool = False
    # Hybrid stacks: the cells of the layers, a list repeated to num_layers (its length divides num_layers,
    # or equals it: one cell per layer); empty: every layer is `cell`, today's model. `cell` must be one of
    # them: its layers run with the keys above (init, activation, forget_bias, recurrence, time_scan, and its
    # options below); a layer of another cell with the keys `pattern_keys` gives it, else that cell's class
    # defaults (`Cell.default_init`, `default_recurrence`, `default_form()`, its dataclass's options).
    # Model-wide, as in Jamba, Samba, Griffin and fla's hybrids (one block and MLP after every mixer):
    # hidden_dim, block, mlp, mlp_expand, mlp_bias, dtype, unroll, dropout, remat, scan_layers, stack_init
    # (`layer_cells`, rnnlab.models.LayerStack).
    pattern: tuple[str, ...] = ()
    # Hybrid stacks: the keys of the layers of the pattern's other cells, by cell (`+model.pattern_keys.
    # attention.window=16`, as fla's `attn` config gives its attention layers theirs): any of LAYER_KEYS and the
    # cell's own options; a key left out takes the cell class's default. Stored as ((cell, ((key, value), ...)),
    # ...), sorted.
    pattern_keys: PatternKeys = ()
    # The chosen cell's own keys (its dataclass fields beyond `Cell`'s, e.g. lru's r_min), as (name, value)
    # pairs: they sit beside the others under `model:` and are filled from the cell's defaults.
    options: tuple[tuple[str, Any], ...] = ()

    def make_cell(self) -> cells.Cell:
        """The configured cell (a frozen, hashable `rnnlab.cells.Cell`)."""
        return cells.get_cell(self.cell)(self.hidden_dim, self.init, self.activation, self.forget_bias,
                                         **dict(self.options))

    def layer_cells(self) -> tuple[LayerCell, ...]:
        """The cells of one period of the layer pattern, in order: `(cell,)` without a pattern (or with a
        pattern of that cell alone), else the shortest list that `pattern` repeats (so [a, b, a, b] is [a, b]),
        each with the keys its layers run with (the `ModelConfig` comment on `pattern`). Layer i runs
        `layer_cells()[i % len(layer_cells())]`."""
        names = self.pattern or (self.cell,)
        period = next(p for p in range(1, len(names) + 1)
                      if len(names) % p == 0 and names == names[:p] * (len(names) // p))
        keys = dict(self.pattern_keys)
        return tuple(self.own_layer_cell() if name == self.cell else LayerCell.defaults(name).with_keys(keys.get(name, ()))
                     for name in names[:period])

    def own_layer_cell(self) -> LayerCell:
        """`cell` with the keys above: what its layers run with."""
        return LayerCell(self.cell, self.init, self.activation, self.forget_bias, self.recurrence, self.time_scan,
                         self.options)


@dataclasses.dataclass(frozen=True)
class LayerCell:
    """A cell of the layer pattern (`ModelConfig.layer_cells`) with the keys its layers run with."""

    cell: str
    init: str
    activation: str
    forget_bias: float
    recurrence: str
    time_scan: str
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def defaults(cls, name: str) -> LayerCell:
        """The registered cell `name` with its class's defaults (a layer of a cell other than `model.cell`)."""
        kind = cells.get_cell(name)
        base = cells.Cell(1)
        return cls(name, kind.default_init, base.activation, base.forget_bias, kind.default_recurrence,
                   kind.default_form())

    def with_keys(self, keys: tuple[tuple[str, Any], ...]) -> LayerCell:
        """This cell with `keys` (`model.pattern_keys.<cell>`) in place of its defaults."""
        common = {name: value for name, value in keys if name in LAYER_KEYS}
        return dataclasses.replace(self, **common, options=tuple((n, v) for n, v in keys if n not in LAYER_KEYS))

    def make(self, hidden_dim: int) -> cells.Cell:
        return cells.get_cell(self.cell)(hidden_dim, self.init, self.activation, self.forget_bias,
                                         **dict(self.options))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    task: str = allowed(choices=tasks.task_names)
    seq_len: int
    min_seq_len: Optional[int]  # None: every training example has seq_len steps; else lengths in [min_seq_len, seq_len]
    eval_seq_lens: tuple[int, ...]  # further lengths evaluated at every eval (eval/<metric>@<len>, eval_by_len)
    # None: every evaluated length runs whole; N: lengths beyond N run in segments of N steps (at most
    # `steps.EVAL_BLOCK_TOKENS` tokens per device), the model's state carried and each segment drawn on the
    # device (memory grows with neither the length nor N)
    eval_segment_len: Optional[int] = None
    # The chosen task's own keys (its dataclass fields beyond `seq_len`, e.g. vocab_size), as (name, value)
    # pairs: they sit beside the others under `data:` and are filled from the task's defaults.
    options: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = allowed(choices=OPTIMIZERS)
    lr: float = allowed(**POSITIVE)
    schedule: str = allowed(choices=SCHEDULES)
    warmup_steps: int = allowed(**NON_NEGATIVE)
    end_lr_ratio: float = allowed(low=0.0, high=1.0)
    clip_norm: float = allowed(**NON_NEGATIVE)
    weight_decay: float = allowed(**NON_NEGATIVE)
    momentum: float = allowed(**FRACTION)
    b1: float = allowed(**FRACTION)
    b2: float = allowed(**FRACTION)


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    platform: str = allowed(choices=PLATFORMS)
    num_devices: Optional[int] = allowed(null=True, low=1, high=MAX_DEVICES,
                                         note="the devices of one process; a CPU simulates that many")
    strategy: str = allowed(choices=STRATEGIES)
    # None: per platform (rnnlab.steps.default_steps_per_dispatch)
    steps_per_dispatch: Optional[int] = allowed(null=True, low=1, high=MAX_STEPS_PER_DISPATCH)
    # JAX's persistent compilation cache in the user's cache dir (rnnlab.compile_cache): a sweep's jobs that
    # differ only in lr and seed compile once
    compile_cache: bool = True


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process JAX (`jax.distributed.initialize`): null fields are auto-detected
    on TPU pods and under SLURM; on CPU all three are needed (gloo over the network)."""

    enabled: bool
    coordinator_address: Optional[str]
    num_processes: Optional[int] = allowed(null=True, **POSITIVE)
    process_id: Optional[int]
    bind_address: Optional[str]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool
    every: int = allowed(**NON_NEGATIVE)
    keep: int = allowed(**POSITIVE)
    resume: bool
    allow_changes: tuple[str, ...]  # keys a resume may change from the checkpoint's config (rnnlab.rundir)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    start_step: int = allowed(**POSITIVE)  # first training step to trace (the loop's step numbers start at 1)
    num_steps: int = allowed(**NON_NEGATIVE)  # steps to trace with jax.profiler; 0 = off
    memory: bool  # also save a device memory profile after the traced steps


@dataclasses.dataclass(frozen=True)
class LogConfig:
    # steps between parameter/gradient histograms and per-layer gradient norms; 0 = off
    histograms_every: int = allowed(**NON_NEGATIVE)
    sweep_console: bool  # a sweep job's output on the terminal too, not only in its train.log (rnnlab.sweep_status)


@dataclasses.dataclass(frozen=True)
class Config:
    imports: tuple[str, ...]  # modules imported first: extensions that register cells and tasks
    seed: int = allowed(low=0, high=SEED_LIMIT - 1,
                        note="JAX keys hold 32 bits: a larger seed would repeat a smaller one's run")
    steps: int = allowed(**POSITIVE)
    batch_size: int = allowed(**POSITIVE)
    hidden_dim: int = allowed(**POSITIVE)
    num_layers: int = allowed(**POSITIVE)
    log_every: int = allowed(**POSITIVE)
    eval_every: int = allowed(**POSITIVE)
    eval_batches: int = allowed(**POSITIVE)
    on_nonfinite: str = allowed(choices=NONFINITE_POLICIES)
    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    device: DeviceConfig
    distributed: DistributedConfig
    checkpoint: CheckpointConfig
    profile: ProfileConfig
    log: LogConfig
    # An evaluated length whose time, predicted from the speed of its first segments (`data.eval_segment_len`), is
    # longer is refused (exit 2) with the checkpoint of its step saved; None: no limit. A default: a config from
    # before the key existed reads as today's.
    eval_max_minutes: Optional[float] = allowed(60.0, null=True, **POSITIVE)


def from_omegaconf(cfg: Any) -> Config:
    """DictConfig (Hydra's composed config, `hydra` node excluded) -> validated `Config`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:  # full_key names the key whose value failed (`batch_size=${oops}`)
        where = f"key '{e.full_key}': " if getattr(e, "full_key", None) else ""
        raise ConfigError(f"{where}cannot resolve the config: {e}".splitlines()[0]) from None
    return from_dict(container)


def from_dict(values: Mapping[str, Any]) -> Config:
    """Plain nested dict -> validated `Config` (the test-friendly twin of `from_omegaconf`)."""
    values = {k: v for k, v in values.items() if k != "hydra"}
    import_extensions(values.get("imports") or ())
    if isinstance(values.get("data"), Mapping):  # keys an extension's data file may leave out
        values["data"] = {**tasks.OPTIONAL_DATA_KEYS, **values["data"]}
    config = _build(Config, values, prefix="")
    validate(config)
    return config


def import_extensions(modules: Any) -> None:
    """Import the modules `imports` names, so that the cells and tasks they register can be chosen."""
    import importlib

    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(f"key 'imports': got {modules!r}, expected a list of module names")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure to import is bad input, named with its cause
            raise ConfigError(f"key 'imports': cannot import {module!r} ({type(e).__name__}: {e})".splitlines()[0]) from None


def replace(config: Config, **overrides: Any) -> Config:
    """A copy of `config` with dotted keys replaced, validated: replace(c, **{"model.init": "identity"})."""
    values = to_dict(config)
    for dotted, value in overrides.items():
        node = values
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ConfigError(f"unknown key '{dotted}'")
        node[leaf] = value
    return from_dict(values)


def to_dict(config: Config) -> dict[str, Any]:
    """The nested dict `from_dict` reads back: a group's `options` sit beside its other keys, and
    `model.pattern_keys` is the {cell: {key: value}} it was given as."""
    values = dataclasses.asdict(config)
    values["model"].update(dict(values["model"].pop("options")))
    values["model"]["pattern_keys"] = {cell: dict(keys) for cell, keys in config.model.pattern_keys}
    values["data"].update(dict(values["data"].pop("options")))
    return values


def flatten(config: Config) -> dict[str, Any]:
    """{'model.hidden_dim': 64, ...}: the flat view used for TensorBoard's HParams."""
    flat: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, Mapping):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v

    walk(to_dict(config), "")
    return flat


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:  # Optional[X]
        return f"{args[0].__name__} or null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is tuple:  # tuple[X, ...]: a list of X
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"key '{key}': got {value!r}, expected a list")
        (inner, _) = typing.get_args(tp)
        return tuple(_coerce(v, inner, key) for v in value)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(value, inner, key)
    ok = (
        (tp is bool and isinstance(value, bool))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(f"key '{key}': got {value!r}, expected {_type_name(tp)}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"key '{key}': got {value!r}, expected a finite number")
    return float(value) if tp is float else value


def _build(cls: type, values: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the config"
    if not isinstance(values, Mapping):
        raise ConfigError(f"key '{where}': expected a group of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name != "options"]
    names = [f.name for f in fields]
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    options = _option_fields(cls, values)
    unknown = sorted(set(values) - set(names) - set(options))
    if unknown:
        raise ConfigError(f"unknown key '{prefix}{unknown[0]}' (allowed in {where}: {', '.join([*names, *options])})")
    kwargs = {}
    if options:
        kwargs["options"] = tuple((name, _coerce(values[name], tp, prefix + name) if name in values else default)
                                  for name, (tp, default) in options.items())
    for name in names:
        key = prefix + name
        if name not in values and name in defaults:
            kwargs[name] = defaults[name]
            continue
        if name not in values:
            raise ConfigError(f"missing key '{key}'")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, values[name], prefix=key + ".")
        elif tp == PatternKeys:
            kwargs[name] = _pattern_keys(values[name], key)
        else:
            kwargs[name] = _coerce(values[name], tp, key)
    return cls(**kwargs)


def _option_fields(cls: type, values: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The keys a group takes beyond its dataclass's own: for `model`, the chosen cell's dataclass
    fields beyond `Cell`'s; for `data`, the chosen task's beyond `seq_len` -> {name: (type, default)}."""
    if cls is DataConfig and "task" in values:  # an unknown task is named before the keys it would take
        check_choice("data.task", values["task"], tasks.task_names())
        return tasks.option_fields(tasks.get_task(values["task"]))
    if cls is not ModelConfig or not isinstance(values.get("cell"), str) or values["cell"] not in cells.CELLS:
        return {}
    return _cell_option_fields(values["cell"])


def _cell_option_fields(name: str) -> dict[str, tuple[Any, Any]]:
    """The registered cell's dataclass fields beyond `Cell`'s -> {name: (type, default)}."""
    cell = cells.get_cell(name)
    base = {f.name for f in dataclasses.fields(cells.Cell)}
    hints = typing.get_type_hints(cell)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(cell) if f.name not in base}


def _pattern_keys(value: Any, key: str) -> PatternKeys:
    """`model.pattern_keys` ({cell: {key: value}}) -> sorted pairs, each key known to its cell and of its type."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"key '{key}': got {value!r}, expected keys by cell, e.g. {{attention: {{window: 16}}}}")
    hints = typing.get_type_hints(ModelConfig)
    pairs = []
    for name, keys in sorted(value.items()):
        check_choice(key, name, cells.cell_names())
        where = f"{key}.{name}"
        types_ = {**{k: hints[k] for k in LAYER_KEYS},
                  **{k: tp for k, (tp, _) in _cell_option_fields(name).items()}}
        if not isinstance(keys, Mapping):
            raise ConfigError(f"key '{where}': got {keys!r}, expected a group of keys ({', '.join(types_)})")
        unknown = sorted(set(keys) - set(types_))
        if unknown:
            raise ConfigError(f"unknown key '{where}.{unknown[0]}' (allowed in {where}: {', '.join(types_)})")
        pairs.append((name, tuple((k, _coerce(v, types_[k], f"{where}.{k}")) for k, v in sorted(keys.items()))))
    return tuple(pairs)


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"key '{key}': got {value!r}, allowed: {', '.join(allowed)}")


# Checks of a built `Config` (`from_dict` runs them): each problem is one `ConfigError` whose line names
# the key, the value and what is allowed. A key's own range or choices are its field's declaration
# (`rnnlab.options.allowed`); what involves several keys is code below.


def validate(c: Config) -> None:
    """The declared ranges and choices, then the checks across keys; raises ConfigError on the first problem."""
    problem = _declared_problem(c, prefix="")
    if problem:
        raise ConfigError(problem)
    _validate_model(c)
    _validate_fused(c)
    try:
        tasks.check_data(c.data)  # the task's options, data.seq_len, data.min_seq_len, data.eval_seq_lens
    except tasks.OptionError as e:
        raise ConfigError(str(e)) from None
    _validate_stream_task(c)
    d = c.distributed
    if d.process_id is not None and not 0 <= d.process_id < (d.num_processes or 1):
        raise ConfigError(
            f"key 'distributed.process_id': got {d.process_id}, must be in [0, distributed.num_processes={d.num_processes})"
        )
    known = set(flatten(c))
    for name in c.checkpoint.allow_changes:
        if name not in known and not _is_pattern_key(name):
            raise ConfigError(f"key 'checkpoint.allow_changes': {name!r} is not a config key; allowed: dotted keys "
                              f"as `python train.py --cfg job` shows them, e.g. [steps,optimizer.lr]")


def _validate_fused(c: Config) -> None:
    """`model.time_scan=fused` asked for by name: a CPU kernel, which must build here (`auto` falls back instead)."""
    m = c.model
    keys = [("model.", m.own_layer_cell())] + [(f"model.pattern_keys.{s.cell}.", s) for s in m.layer_cells()
                                               if m.pattern and s.cell != m.cell]
    for prefix, spec in keys:
        if spec.time_scan == "fused":
            from rnnlab import fused  # builds the kernels on first use (seconds, once per machine)

            problem = fused.refusal(prefix + "time_scan", spec.cell, spec.make(m.hidden_dim).time_scans,
                                    c.device.platform)
            if problem:
                raise ConfigError(problem)


def _validate_stream_task(c: Config) -> None:
    """A task trained over contiguous streams, each stream's state carried from step to step (`tasks.carries_state`:
    data=text): what its streams cannot do. A full attention cache would grow without end; its held-out text is
    evaluated through its streams, not at lengths."""
    task = tasks.get_task(c.data.task)
    if not tasks.carries_state(task):
        return
    if any(getattr(spec.make(c.model.hidden_dim), "window", None) == 0 for spec in c.model.layer_cells()):
        raise ConfigError(f"key 'model.window': 0 (full causal attention), but data={task.name} carries each "
                          f"stream's state from step to step, and a full cache would grow without end; allowed: a "
                          f"window >= 1 (model.window, or model.pattern_keys.attention.window in a hybrid), the "
                          f"ring buffer of the last window steps carried as the recurrences' state is")
    if c.data.eval_seq_lens:
        raise ConfigError(f"key 'data.eval_seq_lens': got {list(c.data.eval_seq_lens)}, allowed: [] for "
                          f"data={task.name} (held-out text is evaluated through its streams: data.eval_streams)")


def _is_pattern_key(name: str) -> bool:
    """`model.pattern_keys.<cell>.<key>` for a registered cell and a key it takes: a change a resume may accept
    (one that drops the key too, which `flatten` of the new config no longer lists)."""
    parts = name.split(".")
    if len(parts) != 4 or parts[:2] != ["model", "pattern_keys"] or parts[2] not in cells.CELLS:
        return False
    return parts[3] in LAYER_KEYS or parts[3] in _cell_option_fields(parts[2])


def _declared_problem(group: Any, prefix: str) -> Optional[str]:
    """The first declared refusal in `group` (a config dataclass), its own keys before its groups'."""
    nested = [f.name for f in dataclasses.fields(group) if dataclasses.is_dataclass(getattr(group, f.name))]
    return declared_problem(group, prefix) or next(
        filter(None, (_declared_problem(getattr(group, name), f"{prefix}{name}.") for name in nested)), None)


def _validate_model(c: Config) -> None:
    m = c.model
    for key in ("hidden_dim", "num_layers"):  # the top-level key is the one source
        if getattr(m, key) != getattr(c, key):
            raise ConfigError(f"key 'model.{key}': got {getattr(m, key)}, but the top-level {key} is {getattr(c, key)}; "
                              f"set the top-level key instead ({key}={getattr(m, key)})")
    problem = _layer_problem(m.own_layer_cell(), m, "model.")
    if problem:
        raise ConfigError(problem)
    _validate_pattern(m)


def _layer_problem(spec: LayerCell, m: ModelConfig, prefix: str) -> Optional[str]:
    """The first problem of one cell's layers, each named by the key that sets it: `prefix` "model." for
    model.cell's, "model.pattern_keys.<cell>." for another pattern cell's (its keys, else its class's defaults)."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for name in LAYER_KEYS:
        rule = declaration(fields[name])
        problem = rule and rule.problem(prefix + name, getattr(spec, name))
        if problem:
            return problem
    cell, r = spec.make(m.hidden_dim), spec.recurrence
    if r == "custom_vjp" and not cell.has_backward:
        return (f"key '{prefix}recurrence': got 'custom_vjp', but cell {spec.cell!r} has no hand-written "
                f"backward; allowed: autodiff")
    if r in ("onednn", "auto") and cell.onednn_kernel is None:
        with_kernel = [name for name in cells.cell_names() if cells.get_cell(name).onednn_kernel]
        return (f"key '{prefix}recurrence': got {r!r}, but cell {spec.cell!r} has no oneDNN kernel; "
                f"allowed: autodiff, custom_vjp (onednn and auto: {', '.join(with_kernel)})")
    if r == "onednn" and m.dtype != "float32":
        return (f"key 'model.dtype': got {m.dtype!r}, but {prefix}recurrence=onednn runs float32 only; "
                f"allowed: float32, or {prefix}recurrence=auto or custom_vjp")
    if r in ("custom_vjp", "onednn", "auto") and m.remat:
        return (f"key 'model.remat': got true, which needs {prefix}recurrence=autodiff ({prefix}recurrence={r} "
                f"keeps its own residuals; allowed: {prefix}recurrence=autodiff, or model.remat=false)")
    if spec.time_scan not in (*cell.time_scans, "auto"):
        return (f"key '{prefix}time_scan': got {spec.time_scan!r}, allowed for cell {spec.cell!r}: "
                f"{', '.join(cell.time_scans)}, auto (the fastest form at each length)")
    if r == "custom_vjp" and not cell.has_backward_in(spec.time_scan):  # that form would run autodiff
        forms = cell.custom_vjp_forms()
        return (f"key '{prefix}recurrence': got 'custom_vjp', but cell {spec.cell!r} has a hand-written backward "
                f"only in its form{'s' if len(forms) > 1 else ''} {', '.join(forms)}, not in "
                f"{prefix}time_scan={spec.time_scan}; allowed: autodiff, or {prefix}time_scan="
                f"{'|'.join(forms)}")
    if m.remat and isinstance(cell, cells.SequenceCell):
        return (f"key 'model.remat': got true, but cell {spec.cell!r} mixes the whole sequence at once: "
                f"it has no per-step cell to recompute; allowed: false")
    problem = cell.option_problem()  # names its keys 'model.<key>', as they sit for model.cell
    return problem and problem.replace("'model.", f"'{prefix}")


def _validate_pattern(m: ModelConfig) -> None:
    """`model.pattern`: registered cells, a length that divides num_layers, `model.cell` among them, and
    each other cell's layers runnable with its keys (`model.pattern_keys`) and the model-wide ones."""
    if not m.pattern:
        if m.pattern_keys:
            raise ConfigError(f"key 'model.pattern_keys': got keys for {', '.join(n for n, _ in m.pattern_keys)}, "
                              f"but model.pattern is empty; allowed: {{}} (or set model.pattern)")
        return
    for name in m.pattern:
        check_choice("model.pattern", name, cells.cell_names())
    shown = "[" + ",".join(m.pattern) + "]"
    if m.num_layers % len(m.pattern):
        raise ConfigError(f"key 'model.pattern': got {shown} ({len(m.pattern)} cells), which does not divide "
                          f"num_layers={m.num_layers}; allowed: a list whose length divides num_layers (it repeats "
                          f"num_layers / its length times) or equals it (a cell per layer)")
    if m.cell not in m.pattern:
        raise ConfigError(f"key 'model.pattern': got {shown}, without model.cell={m.cell!r} (the cell whose keys the "
                          f"model config holds); add it, or choose model=<one of the pattern's cells>")
    for name, _ in m.pattern_keys:
        where = f"key 'model.pattern_keys.{name}'"
        others = ", ".join(sorted(set(m.pattern) - {m.cell})) or "none"
        if name == m.cell:
            raise ConfigError(f"{where}: {name} is model.cell, whose keys sit under model: (model.<key>); "
                              f"allowed: the pattern's other cells ({others})")
        if name not in m.pattern:
            raise ConfigError(f"{where}: {name} is not in model.pattern={shown}; allowed: the pattern's other cells "
                              f"({others})")
    for spec in m.layer_cells():
        if spec.cell != m.cell:
            prefix = f"model.pattern_keys.{spec.cell}."
            problem = _layer_problem(spec, m, prefix)
            if problem:
                given = dict(dict(m.pattern_keys).get(spec.cell, ()))
                unset = [k for k in (*LAYER_KEYS, *_cell_option_fields(spec.cell)) if f"{prefix}{k}" in problem
                         and k not in given]
                raise ConfigError(problem + (f" ({', '.join(unset)}: {spec.cell}'s class default)" if unset else ""))
