"""Device setup and data parallelism: `jax.pmap` or `jax.shard_map` over the chosen devices.

`configure_backend` must run before anything asks JAX for a device: it picks the
platform and, on CPU, how many devices to simulate. Once a backend is up (a second
job of a Hydra sweep in the same process) the platform and device count are fixed;
a job may still use fewer devices than exist, and is refused if it wants more.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import numpy as np

from rnnlab import cpu
from rnnlab.config import Config, ConfigError, DeviceConfig, DistributedConfig

AXIS = "devices"  # the pmap axis name over which gradients and metrics are averaged
_JAX_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def start_backend(config: Config) -> list[jax.Device]:
    """The platform (`configure_backend`), the multi-process runtime (`initialize_distributed`), then
    the devices to train on (`select_devices`)."""
    configure_backend(config.device, config.batch_size, config.distributed.enabled)
    initialize_distributed(config.distributed, config.device.platform)
    return select_devices(config.device, config.batch_size)


def configure_backend(config: DeviceConfig, batch_size: int, distributed: bool = False) -> None:
    """Choose the platform, the CPU code generation flags, the simulated CPU device count and,
    where `RNNLAB_PIN_CPU=1` asks for it, a core of the process's own, if JAX has not started yet."""
    if backend_started():
        return
    if config.platform != "auto":
        jax.config.update("jax_platforms", _JAX_PLATFORM[config.platform])
    if config.platform in ("auto", "cpu"):
        cpu.configure_cpu_backend(config.num_devices, batch_size, distributed)


def coordinator_bind_address(coordinator_address: str | None, bind_address: str | None) -> str | None:
    """Where process 0's coordinator service listens: `bind_address` if set, else the host and
    port of `coordinator_address` (the address the other processes connect to), not JAX's
    default of every interface; None (JAX's choice) when neither is set.

    A ConfigError if `coordinator_address` is not host:port (an IPv6 host in brackets: [::1]:1234).
    """
    if bind_address is not None:
        return bind_address
    if coordinator_address is None:
        return None
    host, sep, port = coordinator_address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if not sep or not host or not port.isdigit() or (":" in host and not bracketed):
        raise ConfigError(
            f"key 'distributed.coordinator_address': got {coordinator_address!r}, must be host:port "
            f"(an IPv6 host in brackets, e.g. [::1]:12355)"
        )
    return f"{host}:{port}"


def initialize_distributed(config: DistributedConfig, platform: str) -> None:
    """Join the multi-process JAX runtime (after `configure_backend`, before any device query).

    Null fields are left to JAX's auto-detection (TPU pods, SLURM). On CPU, collectives
    across processes go through gloo. The coordinator listens where `coordinator_bind_address`
    says, unless JAX_COORDINATOR_BIND_ADDRESS is set and `distributed.bind_address` is not.
    """
    if not config.enabled or jax.distributed.is_initialized():
        return
    if platform in ("auto", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    bind = config.bind_address
    if bind is None and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        bind = coordinator_bind_address(config.coordinator_address, None)
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        coordinator_bind_address=bind,
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
    on an accelerator, and on CPU the `cpu.cpu_device_count` candidates (the training run
    then measures which count is fastest: `cpu.choose_device_count`). Several processes: every device of
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
        wanted = cpu.cpu_device_count(batch_size, min(cpu.max_cpu_devices(), len(available))) if on_cpu else len(available)
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
