"""Device setup and data-parallel helpers for `jax.pmap`.

`configure_backend` must run before anything asks JAX for a device: it picks the
platform and, on CPU, how many devices to simulate. Once a backend is up (a second
job of a Hydra sweep in the same process) the platform and device count are fixed;
a job may still use fewer devices than exist, and is refused if it wants more.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from rnnlab.config import ConfigError, DeviceConfig

AXIS = "devices"  # the pmap axis name over which gradients and metrics are averaged
_JAX_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def configure_backend(config: DeviceConfig) -> None:
    """Choose the platform and the simulated CPU device count, if JAX has not started yet."""
    if backend_started():
        return
    if config.platform != "auto":
        jax.config.update("jax_platforms", _JAX_PLATFORM[config.platform])
    if config.num_devices is not None and config.platform in ("auto", "cpu"):
        # Only affects the CPU backend: N simulated devices sharing the host's cores.
        jax.config.update("jax_num_cpu_devices", max(config.num_devices, jax.config.jax_num_cpu_devices))


def select_devices(config: DeviceConfig) -> list[jax.Device]:
    """The local devices to pmap over, or a ConfigError that says what exists."""
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
    wanted = config.num_devices or len(available)
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
    """
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXIS))
    stacked = lambda x: np.broadcast_to(np.asarray(x), (len(devices), *np.shape(x)))  # noqa: E731
    return jax.tree_util.tree_map(lambda x: jax.device_put(stacked(x), sharding), tree)


def unreplicate_to_host(tree: Any) -> Any:
    """The first device's copy as NumPy arrays (leaves lose the leading device axis).

    Reads one shard per leaf: no device computation, so nothing new is compiled.
    """
    return jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_shards[0].data)[0], tree)

