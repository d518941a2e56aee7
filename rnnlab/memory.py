"""Whether a run fits in memory, asked before it allocates: a step that cannot fit stops with one
line naming the keys that size it, instead of an allocator abort or a machine that swaps."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from rnnlab.config import Config, ConfigError

GiB = 2.0**30


class OutOfMemoryError(ConfigError):
    """The run needs more memory than its devices have free."""


def free_bytes(devices: Sequence[jax.Device]) -> float | None:
    """Memory free to this process's share of `devices`: on CPU the host's available memory (the
    tighter of /proc/meminfo's MemAvailable and the cgroup's limit, shared by every simulated
    device); on an accelerator the first device's limit less what is in use. None if unknown."""
    device = devices[0]
    if device.platform == "cpu":
        return _host_available_bytes()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def _host_available_bytes() -> float | None:
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(float(line.split()[1]) * 1024)
    except OSError:
        pass
    for max_file, current_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, used = Path(max_file).read_text().strip(), Path(current_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" or a huge number: no limit
            limits.append(float(int(limit) - int(used)))
        break
    return min(limits) if limits else None


def tree_bytes(tree: Any) -> float:
    """Bytes of a tree of arrays or ShapeDtypeStructs."""
    return float(sum(np.prod(x.shape, dtype=np.float64) * np.dtype(x.dtype).itemsize
                     for x in jax.tree_util.tree_leaves(tree)))


def check_fits(what: str, host_bytes: float, device_bytes: float, devices: Sequence[jax.Device],
               config: Config) -> None:
    """OutOfMemoryError if `host_bytes` on the host plus `device_bytes` on each of this process's
    `devices` do not fit in the free memory (on CPU the devices share the host's)."""
    free = free_bytes(devices)
    local = sum(d.process_index == jax.process_index() for d in devices)
    needed = host_bytes + device_bytes * local if devices[0].platform == "cpu" else device_bytes
    if free is None or needed <= free:
        return
    raise OutOfMemoryError(
        f"{what} would take about {needed / GiB:.3g} GiB, but {free / GiB:.3g} GiB of {devices[0].platform} memory is "
        f"free (hidden_dim={config.hidden_dim}, num_layers={config.num_layers}, batch_size={config.batch_size}, "
        f"data.seq_len={config.data.seq_len}); lower one of them"
    )


def check_state_fits(state: Any, batches: Sequence[Any], devices: Sequence[jax.Device], config: Config,
                     kept_per_device: float = 0.0) -> None:
    """Before anything is allocated (shapes will do): OutOfMemoryError unless the train state `state` (on the
    host and on each local device), the batches that stay on the devices, and `kept_per_device` bytes of what
    the step must keep for its backward (`layer_outputs_bytes`, a lower bound of the compiled step's own
    memory) fit. `batches`: a global train batch, then one of each length evaluated whole (the longer ones run in
    segments, `data.eval_segment_len`); the train batch and `config.eval_batches` of each evaluated length stay,
    split over the processes and their devices."""
    sizes = [tree_bytes(batch) for batch in batches]
    local = sum(d.process_index == jax.process_index() for d in devices)
    on_devices = (sizes[0] + config.eval_batches * sum(sizes[1:])) / max(1, jax.process_count())
    what = "the train state and the batches" + (", with the layer outputs the backward keeps," if kept_per_device else "")
    check_fits(what, host_bytes=tree_bytes(state), device_bytes=tree_bytes(state) + on_devices / local + kept_per_device,
               devices=devices, config=config)


def check_eval_batches_fit(state: Any, batches: Sequence[Any], extra: dict[int, Any], devices: Sequence[jax.Device],
                           config: Config, kept_per_device: float, forward_per_device: float, segmentable: bool) -> None:
    """Once `check_state_fits(state, batches, ...)` passed: OutOfMemoryError naming `data.eval_seq_lens` unless the
    batches of the further lengths evaluated whole (`extra`: {length: a global batch}) fit beside them too, with
    `forward_per_device` bytes for the longest one's forward (a layer's outputs over one device's batch, what it
    holds at least; the train step's `kept_per_device` is not held at the same time). segmentable: the task runs
    in segments, which the refusal then suggests."""
    if not extra:
        return
    free = free_bytes(devices)
    local = sum(d.process_index == jax.process_index() for d in devices)
    sizes = [tree_bytes(batch) for batch in [*batches, *extra.values()]]
    on_devices = (sizes[0] + config.eval_batches * sum(sizes[1:])) / max(1, jax.process_count())
    device_bytes = tree_bytes(state) + on_devices / local + max(kept_per_device, forward_per_device)
    needed = tree_bytes(state) + device_bytes * local if devices[0].platform == "cpu" else device_bytes
    if free is None or needed <= free:
        return
    longest = max(extra)
    segment = max(1, min(config.data.eval_segment_len or 4096, longest // 2))
    allowed = (f"shorter lengths, fewer eval_batches, or data.eval_segment_len={segment} (longer lengths run "
               f"in segments of it, in memory that does not grow with the length)" if segmentable else
               f"shorter lengths or fewer eval_batches (the {config.data.task} task is not evaluated in segments)")
    raise OutOfMemoryError(
        f"key 'data.eval_seq_lens': evaluating {longest} steps whole keeps eval_batches={config.eval_batches} "
        f"batches of every length and its forward on the devices, about {needed / GiB:.3g} GiB with training, but "
        f"{free / GiB:.3g} GiB of {devices[0].platform} memory is free; allowed: {allowed}")


def check_eval_state_fits(state_bytes: float, length: int, devices: Sequence[jax.Device], config: Config,
                          forward_per_device: float = 0.0, segment: int = 0) -> None:
    """OutOfMemoryError unless the model's state for one device's batch at `length` steps, evaluated in segments
    (`data.eval_segment_len`), fits beside the forward of one segment (`forward_per_device`: `forward_bytes` of
    its `segment` steps): a recurrence's state does whatever the length, attention's cache of every step seen
    may not (naming `data.eval_seq_lens`); a segment's forward may not (naming `data.eval_segment_len`)."""
    free = free_bytes(devices)
    if free is None or state_bytes + forward_per_device <= free / 2:  # the segments' own work needs the rest
        return
    if state_bytes >= forward_per_device:
        raise OutOfMemoryError(
            f"key 'data.eval_seq_lens': evaluating {length} steps keeps a model state of about {state_bytes / GiB:.3g} "
            f"GiB per device (attention's cache of every step), but {free / GiB:.3g} GiB of {devices[0].platform} "
            f"memory is free; allowed: shorter lengths, or attention with a window (model.window)")
    raise OutOfMemoryError(
        f"key 'data.eval_segment_len': evaluating {length} steps in segments of {segment} steps takes about "
        f"{(state_bytes + forward_per_device) / GiB:.3g} GiB per device for a segment's forward, but "
        f"{free / GiB:.3g} GiB of {devices[0].platform} memory is free; allowed: data.eval_segment_len below {segment}, "
        f"or a smaller batch_size")


def forward_bytes(config: Config, output_dim: int, rows: int, time_steps: int) -> float:
    """Bytes a forward of the model over `rows` examples of `time_steps` steps holds at least, per device, whatever
    its cells' forms: a layer's input term [T, B, W] (W the widest cell's `input_width`) and its output [T, B, H]
    in the compute dtype, and the readout's logits [B, T, output_dim] in float32 (what the loss reads). An
    evaluation holds this beside the train state; the train step's backward (`layer_outputs_bytes`) is not held
    at the same time."""
    model = config.model
    itemsize = np.dtype(jax.numpy.dtype(model.dtype)).itemsize
    width = max(spec.make(model.hidden_dim).input_width for spec in model.layer_cells())
    return float(rows) * time_steps * ((width + model.hidden_dim) * itemsize + 4.0 * output_dim)


def check_stream_eval_fits(state: Any, batches: Sequence[Any], devices: Sequence[jax.Device], config: Config,
                           kept_per_device: float, streams: int, per_stream: float, fixed: float, windows: int) -> None:
    """Once `check_state_fits(state, batches, ...)` passed, for a task evaluated through streams (data=text):
    OutOfMemoryError naming `data.eval_streams` unless its evaluation fits beside the train state and batches:
    `streams` streams over this process's devices, each device holding `per_stream` bytes for each of its rows (its
    model state and forwards: `forward_bytes`) and `fixed` bytes (the held-out text); the train step's
    `kept_per_device` is not held at the same time. The message says about how many streams fit, and how many
    read anything (`windows`: the held-out text's windows; a stream past them reads none)."""
    free = free_bytes(devices)
    if free is None:
        return
    local = sum(d.process_index == jax.process_index() for d in devices)
    rows = -(-streams // len(devices))
    sizes = [tree_bytes(batch) for batch in batches]
    resident = tree_bytes(state) + (sizes[0] + config.eval_batches * sum(sizes[1:])) / max(1, jax.process_count()) / local
    cpu = devices[0].platform == "cpu"
    host, copies = (tree_bytes(state), local) if cpu else (0.0, 1)
    needed = host + copies * (resident + max(kept_per_device, fixed + per_stream * rows))
    if needed <= free:
        return
    fit_rows = int(((free - host) / copies - resident - fixed) // per_stream) if per_stream else 0
    fit = max(0, fit_rows) * len(devices)
    advice = (f"fewer data.eval_streams (at most about {fit:,} by this estimate, a lower bound; the held-out text has "
              f"{windows:,} windows of data.seq_len, and a stream past them reads nothing)" if fit else
              "not one stream fits beside training: lower hidden_dim, num_layers, batch_size or data.seq_len")
    raise OutOfMemoryError(
        f"key 'data.eval_streams': evaluating the held-out text through {streams:,} streams ({rows:,} per device, "
        f"each run with its state carried and reset over data.seq_len={config.data.seq_len} steps) would take about "
        f"{needed / GiB:.3g} GiB with training, but {free / GiB:.3g} GiB of {devices[0].platform} memory is free; "
        f"allowed: {advice}")


def layer_outputs_bytes(config: Config, per_device: int, time_steps: int) -> float:
    """Bytes of every layer's output [T, B, H] over one device's batch, in the compute dtype: what any
    backward through the stack keeps at least (each layer's input for its weight gradient, the last's for
    the readout), whatever the cell and its form; the compiled step's memory analysis says the rest."""
    itemsize = np.dtype(jax.numpy.dtype(config.model.dtype)).itemsize
    return float(config.model.num_layers) * time_steps * per_device * config.model.hidden_dim * itemsize


def check_step_fits(stats: Any, devices: Sequence[jax.Device], config: Config) -> None:
    """OutOfMemoryError if a compiled step (`stats`: XLA's memory analysis of it; None: unknown, passes)
    cannot fit beside the (already resident) state on `devices`."""
    if stats is not None:
        check_fits("the train step", host_bytes=0.0, device_bytes=compiled_bytes(stats), devices=devices, config=config)


def check_population_fits(stats: Any, state_bytes: float, members: int, devices: Sequence[jax.Device],
                          config: Config) -> None:
    """OutOfMemoryError naming how many members would fit, if a population's compiled step (`stats`, for all
    `members` on one device; None: unknown, passes) cannot fit beside its train states (`state_bytes` for all,
    already resident). A member's share of either is taken as 1/members of it; on CPU the local devices share
    the host's memory. A population of one (a run alone) is refused as its step would be (`check_step_fits`)."""
    if members == 1:
        return check_step_fits(stats, devices, config)
    if stats is None:
        return
    free = free_bytes(devices)
    local = sum(d.process_index == jax.process_index() for d in devices) if devices[0].platform == "cpu" else 1
    step = compiled_bytes(stats) * local
    if free is None or step <= free:
        return
    per_member = (step + state_bytes) / members
    fit = int((free + state_bytes) // per_member)
    advice = (f"about {fit} member(s) fit (hydra.launcher.max_members={fit} trains the grid in groups of that size)"
              if fit else "not one member fits (lower hidden_dim, num_layers, batch_size or data.seq_len)")
    raise OutOfMemoryError(
        f"key 'hydra/launcher': a population of {members} members would take about {(step + state_bytes) / GiB:.3g} GiB, "
        f"but {(free + state_bytes) / GiB:.3g} GiB of {devices[0].platform} memory is free: {advice}; allowed: "
        f"hydra/launcher=basic|parallel|population")


def compiled_bytes(stats: Any) -> float:
    """Memory an executable allocates per device beyond its (already resident) arguments: outputs
    not aliased to donated arguments, plus XLA's temporaries."""
    return float(stats.temp_size_in_bytes + max(0, stats.output_size_in_bytes - stats.alias_size_in_bytes))


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation failure reported by XLA (not an I/O error that happens to say RESOURCE_EXHAUSTED)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def out_of_memory_error(error: BaseException, config: Config, evaluating: bool = False) -> OutOfMemoryError:
    """The one line of an allocation failure XLA reported: with `evaluating` (it happened in an evaluation) naming
    the keys that size the evaluation, else those that size training."""
    reason = str(error).splitlines()[0][:200]
    if evaluating:
        from rnnlab import tasks  # noqa: PLC0415

        if tasks.carries_state(tasks.get_task(config.data.task)):
            keys = f"data.eval_streams={dict(config.data.options).get('eval_streams')}"
        else:
            keys = (f"data.eval_seq_lens={list(config.data.eval_seq_lens)}, eval_batches={config.eval_batches}, "
                    f"data.eval_segment_len={config.data.eval_segment_len}")
        return OutOfMemoryError(f"out of memory in an evaluation ({reason}) with {keys}; lower one of them")
    return OutOfMemoryError(
        f"out of memory ({reason}) with hidden_dim={config.hidden_dim}, num_layers={config.num_layers}, "
        f"batch_size={config.batch_size}, data.seq_len={config.data.seq_len}; lower one of them"
    )
