"""Device setup and data-parallel helpers for `jax.pmap`.

`configure_backend` must run before anything asks JAX for a device: it picks the
platform and, on CPU, how many devices to simulate. Once a backend is up (a second
job of a Hydra sweep in the same process) the platform and device count are fixed;
a job may still use fewer devices than exist, and is refused if it wants more.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rnnlab.config import ConfigError, DeviceConfig, DistributedConfig

AXIS = "devices"  # the pmap axis name over which gradients and metrics are averaged
_JAX_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def host_cores() -> int:
    """The cores this process may run on (the affinity mask, not the host's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


MAX_CPU_DEVICES = 8  # the most simulated CPU devices `device.num_devices=null` tries


def max_cpu_devices() -> int:
    """The most simulated CPU devices worth trying: one per core, at most MAX_CPU_DEVICES, or
    fewer if `RNNLAB_MAX_CPU_DEVICES` says so (the parallel sweep launcher sets 1: a job per core)."""
    cap = MAX_CPU_DEVICES
    if os.environ.get("RNNLAB_MAX_CPU_DEVICES"):
        cap = max(1, int(os.environ["RNNLAB_MAX_CPU_DEVICES"]))
    return min(host_cores(), cap)


def cpu_device_count(batch_size: int, most: int) -> int:
    """The largest count up to `most` that the batch divides into."""
    return max(n for n in range(1, max(most, 1) + 1) if batch_size % n == 0)


def device_count_is_open(config: DeviceConfig, devices: Sequence[jax.Device]) -> bool:
    """`device.num_devices=null` on CPU in one process, with more than one count to choose from."""
    return (config.num_devices is None and devices[0].platform == "cpu" and jax.process_count() == 1
            and len(devices) > 1)


def _read_json_object(path: Path) -> dict:
    """A JSON object from `path`, or {} if it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def choose_device_count(key: str, candidates: Sequence[int], seconds_per_step: Callable[[int], float],
                        cache_file: Path, margin: float = 0.05) -> tuple[int, dict[int, float], bool]:
    """The candidate count whose train step measures fastest, remembered per `key` in `cache_file`.

    On CPU, XLA runs the small matmuls inside a time scan on about one core: one simulated
    device per core made models with H=100 and H=256 1.13-1.50x faster on a 2-core CPU,
    and made H=1024 models 0.69-0.76x as fast, since their big matmuls already use every
    core (README benchmark). So the count is measured, once per key (machine, candidates,
    XLA_FLAGS, model, batch, data), and later runs read it back. More devices must win by
    `margin` to be chosen over fewer. Returns (count, seconds per step by count, from cache).
    """
    entries = _read_json_object(cache_file)
    try:
        cached = entries.get(key)
        count = int(cached["num_devices"])
        if count in candidates:
            return count, {int(n): float(t) for n, t in cached["seconds_per_step"].items()}, True
    except (TypeError, KeyError, ValueError, AttributeError):
        pass  # no entry, or a damaged one: measure (and overwrite it)
    timings = {n: seconds_per_step(n) for n in sorted(candidates)}
    best = min(candidates)
    for n in sorted(candidates):
        if timings[n] < (1 - margin) * timings[best]:
            best = n
    entries[key] = {"num_devices": best, "seconds_per_step": timings}
    tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, cache_file)
    except OSError:  # an unwritable cache dir: the run trains, and measures again next time
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return best, timings, False


# XLA CPU code generation options set for every rnnlab run on CPU, unless XLA_FLAGS names them
# (the user's value wins): 512-bit vectors for the cells' transcendentals (XLA's default is 256)
# and copy insertion that leaves fewer copies inside while loops. On the loop's 8-step dispatch,
# timed side by side in one process (`scripts/benchmark.py --xla-variant`, README benchmark
# section, on a 2-core AMD Zen 4), they made the LSTM and GRU steps at H=100 and at B=1, T=2000
# 1.13-1.25x faster and the other rows -1% to +5% (Elman H=100: 1.14x there, 1.02x in two reruns
# of that row). Measured on AVX-512 machines only; where the CPU has narrower vectors LLVM
# cannot use 512-bit ones (untested there).
CPU_XLA_FLAGS = {
    "xla_cpu_prefer_vector_width": "512",
    "xla_cpu_copy_insertion_use_region_analysis": "true",
}


def with_cpu_xla_flags(xla_flags: str) -> str:
    """An XLA_FLAGS value with each of CPU_XLA_FLAGS that it does not already set, put first:
    XLA ignores every flag after a token that does not start with '-' (hydra/launcher=parallel
    sets one). A value that does not start with '-' at all names a flag file: left as it is."""
    flags = xla_flags.strip()
    if flags and not flags.startswith("-"):
        return xla_flags
    named = {token.lstrip("-").split("=", 1)[0] for token in flags.split()}
    added = [f"--{name}={value}" for name, value in CPU_XLA_FLAGS.items() if name not in named]
    return " ".join([*added, flags]).strip()


def set_cpu_xla_flags() -> None:
    """Merge CPU_XLA_FLAGS into the XLA_FLAGS environment variable. XLA reads it when its
    backend starts (not at `import jax`), so this must come before anything asks for a device."""
    os.environ["XLA_FLAGS"] = with_cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))


PIN_CPU_ENV = "RNNLAB_PIN_CPU"  # "1": pin the process to a core of its own (hydra/launcher=parallel sets it)
_pin: tuple[int, Any] | None = None  # (core, the open lock file holding it) for the life of the process


def pin_lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"rnnlab-cpu-pins-{os.getuid()}"


def pin_to_free_core(lock_dir: Path | None = None) -> int | None:
    """Pin this process to one CPU core that no other process pinned through `lock_dir` holds.
    Returns the core, or None (not pinned) when every core of the affinity mask is held.

    For sweep jobs run side by side, one per core. XLA's CPU client sizes its thread pool
    from the affinity mask when the backend starts, and `--xla_cpu_multi_thread_eigen=false`
    does not make a job single-threaded (its matmuls still run on the pool): two default
    jobs side by side on a 2-core CPU each kept both cores busy and trained at 1.35-1.37M
    tokens/s, against 1.86-1.90M each when pinned to a core apiece. A core is held by an
    exclusive `flock` on `lock_dir/cpu<N>.lock`, kept open for the life of the process:
    the OS releases it when the process exits, a crash included, so no lock goes stale.
    Must run before the backend starts (the pool's threads inherit the mask); idempotent.
    """
    global _pin
    if _pin is not None:
        return _pin[0]
    import fcntl

    lock_dir = lock_dir or pin_lock_dir()
    lock_dir.mkdir(parents=True, exist_ok=True)
    for core in sorted(os.sched_getaffinity(0)):
        lock = open(lock_dir / f"cpu{core}.lock", "a")  # noqa: SIM115 - held open on purpose
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        for thread in _thread_ids():  # threads started before this one (`import jax` starts one) too
            try:
                os.sched_setaffinity(thread, {core})
            except ProcessLookupError:  # it ended meanwhile
                pass
        _pin = (core, lock)
        return core
    return None


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread, which every later thread inherits from
        return [0]


def pinned_core() -> int | None:
    """The core `pin_to_free_core` pinned this process to, if it did."""
    return None if _pin is None else _pin[0]


def configure_backend(config: DeviceConfig, batch_size: int, distributed: bool = False) -> None:
    """Choose the platform, the CPU code generation flags, the simulated CPU device count and,
    where `RNNLAB_PIN_CPU=1` asks for it, a core of the process's own, if JAX has not started yet."""
    if backend_started():
        return
    if config.platform != "auto":
        jax.config.update("jax_platforms", _JAX_PLATFORM[config.platform])
    if config.platform in ("auto", "cpu"):
        set_cpu_xla_flags()
        if os.environ.get(PIN_CPU_ENV) == "1" and hasattr(os, "sched_setaffinity"):
            pin_to_free_core()
        # Only affects the CPU backend: N simulated devices sharing the host's cores.
        wanted = config.num_devices
        if wanted is None and not distributed and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            wanted = cpu_device_count(batch_size, max_cpu_devices())
        if wanted is not None:
            jax.config.update("jax_num_cpu_devices", max(wanted, jax.config.jax_num_cpu_devices))


def initialize_distributed(config: DistributedConfig, platform: str) -> None:
    """Join the multi-process JAX runtime (after `configure_backend`, before any device query).

    Null fields are left to JAX's auto-detection (TPU pods, SLURM). On CPU, collectives
    across processes go through gloo.
    """
    if not config.enabled or jax.distributed.is_initialized():
        return
    if platform in ("auto", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
    )


def is_primary() -> bool:
    """Process 0 is the one writer of TensorBoard events, results.json and the console summary."""
    return jax.process_index() == 0


def local_count(devices: Sequence[jax.Device]) -> int:
    """How many of `devices` belong to this process (the leading axis of pmap's per-process arrays)."""
    return sum(d.process_index == jax.process_index() for d in devices)


def select_devices(config: DeviceConfig, batch_size: int) -> list[jax.Device]:
    """The devices to pmap over, or a ConfigError that says what exists.

    One process: its first `num_devices` local devices; null means every local device
    on an accelerator, and on CPU the `cpu_device_count` candidates (the training run
    then measures which count is fastest: `choose_device_count`). Several processes: every device of
    every process (pmap's device list is global); `num_devices` must then be null or
    this process's local device count.
    """
    try:
        if config.platform == "auto":
            available = jax.local_devices()
        else:
            available = jax.local_devices(backend=_JAX_PLATFORM[config.platform])
    except Exception as e:  # noqa: BLE001 - JAX raises RuntimeError, or AssertionError for a missing CUDA
        reason = str(e).splitlines()[0] if str(e) else f"no {config.platform} backend in this JAX installation"
        raise ConfigError(
            f"key 'device.platform': {config.platform!r} is not available here ({reason}); "
            f"allowed here: auto, cpu"
        ) from None
    if jax.process_count() > 1:
        if config.num_devices not in (None, len(available)):
            raise ConfigError(
                f"key 'device.num_devices': got {config.num_devices}, but with several processes every "
                f"process uses all its {len(available)} local devices (set null or {len(available)})"
            )
        return jax.devices(available[0].platform)
    wanted = config.num_devices
    if wanted is None:
        on_cpu = available[0].platform == "cpu"
        wanted = cpu_device_count(batch_size, min(max_cpu_devices(), len(available))) if on_cpu else len(available)
    if wanted > len(available):
        platform = available[0].platform
        hint = (
            " (JAX started earlier in this process with fewer simulated CPU devices, and the jobs of a "
            "sweep share processes, the joblib launcher's workers too: list the largest count first, "
            "e.g. device.num_devices=4,2,1, or run each count as its own command)"
            if platform == "cpu"
            else ""
        )
        raise ConfigError(
            f"key 'device.num_devices': got {wanted}, only {len(available)} {platform} device(s) exist{hint}"
        )
    return available[:wanted]


def check_batch_divides(batch_size: int, num_devices: int) -> int:
    """Per-device batch size; a ConfigError if the global batch does not split evenly."""
    if batch_size % num_devices:
        raise ConfigError(
            f"key 'batch_size': got {batch_size}, must be divisible by the {num_devices} devices "
            f"(e.g. batch_size={max(num_devices, batch_size // num_devices * num_devices)})"
        )
    return batch_size // num_devices


def replicate(tree: Any, devices: Sequence[jax.Device]) -> Any:
    """Put a copy of every leaf on each device: leaves gain a leading [num_devices] axis.

    The sharding is the one `pmap` gives its outputs (a mesh over `AXIS`), so the state
    fed to the first step and the state a step returns have the same type: one compile.
    With several processes each one fills only its own devices (the value is the same
    everywhere), giving one global array per leaf.
    """
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXIS))

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(
            (len(devices), *x.shape), sharding, lambda index: np.broadcast_to(x, (len(devices), *x.shape))[index]
        )

    return jax.tree_util.tree_map(put, tree)


def unreplicate_to_host(tree: Any) -> Any:
    """The first device's copy as NumPy arrays (leaves lose the leading device axis).

    Reads one shard per leaf, every copy started before any is waited for (jax.device_get):
    no device computation, so nothing new is compiled.
    """
    return jax.tree_util.tree_map(lambda x: x[0], _first_shards_to_host(tree))


def _first_shards_to_host(tree: Any) -> Any:
    return jax.device_get(jax.tree_util.tree_map(lambda x: x.addressable_shards[0].data, tree))


REPLICATED, SHARDED = "replicated", "sharded"  # the layouts a DataParallel function's arguments take


class DataParallel:
    """Runs per-device functions (with collectives over `AXIS`) on `devices` by one of two strategies.

    pmap (default): `jax.pmap`; every array carries a leading [num_devices] axis, the
    state as identical copies, a batch as one shard per device.
    shard_map: `jax.jit` of `jax.shard_map` over a 1-D `Mesh`, the path JAX now
    recommends; the state is one replicated global array (no device axis) and a batch is
    sharded along its leading (example) axis. Both run the same per-device code and so
    the same training trajectory.

    `map(fn, in_layouts, out_layouts)` takes each argument's and result's layout,
    REPLICATED or SHARDED (pmap ignores them: its layout is always "one slice per device").
    """

    def __init__(self, devices: Sequence[jax.Device], strategy: str = "pmap"):
        self.devices = list(devices)
        self.strategy = strategy
        self.mesh = jax.sharding.Mesh(np.array(self.devices), (AXIS,))

    def _spec(self, layout: str) -> jax.sharding.PartitionSpec:
        return jax.sharding.PartitionSpec(AXIS) if layout == SHARDED else jax.sharding.PartitionSpec()

    def map(self, fn, in_layouts: tuple[str, ...], out_layouts: Any, donate_argnums: tuple[int, ...] = ()):
        if self.strategy == "pmap":
            return jax.pmap(fn, axis_name=AXIS, devices=self.devices, donate_argnums=donate_argnums)
        specs = jax.tree_util.tree_map(self._spec, out_layouts)
        # check_vma=False: the recurrent scans start from an unsharded zero carry that becomes
        # device-varying, which the varying-axes type check rejects; replicated outputs are
        # replicated by construction (they come out of pmean), as under pmap.
        mapped = jax.shard_map(
            fn, mesh=self.mesh, in_specs=tuple(map(self._spec, in_layouts)), out_specs=specs, check_vma=False
        )
        return jax.jit(mapped, donate_argnums=donate_argnums)

    def replicate(self, tree: Any) -> Any:
        """Host values -> the replicated layout on every device."""
        if self.strategy == "pmap":
            return replicate(tree, self.devices)
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.tree_util.tree_map(
            lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda index: np.asarray(x)[index]), tree
        )

    def to_host(self, tree: Any) -> Any:
        """Replicated layout -> NumPy values (one device's copy; no computation, nothing compiled)."""
        if self.strategy == "pmap":
            return unreplicate_to_host(tree)
        return _first_shards_to_host(tree)

    def host_scalar(self, value: int) -> np.ndarray:
        """An int32 argument in the replicated layout, as host data."""
        if self.strategy == "pmap":
            return np.full(local_count(self.devices), value, np.int32)
        return np.int32(value)
