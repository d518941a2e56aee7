"""CPU-only tuning: XLA code generation flags, one core per process for parallel sweep jobs,
and the simulated device count, measured once per machine and model and then cached.

On CPU, JAX can split the host into N simulated devices; XLA runs the small matmuls
inside a time scan on about one core, so one device per core can train faster, while
large matmuls already use every core. Which wins depends on the model, so it is
measured (`choose_device_count`, docs/design.md) where a rule measured on a 2-core machine does not
decide it (`device_count_by_rule`): a step too small to gain from a second device runs on one, a step
of middling size on one per core, both without compiling the model twice.
"""

from __future__ import annotations

import json
import logging
import os
import reprlib
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rnnlab import files

log = logging.getLogger(__name__)


def configure_cpu_backend(num_devices: int | None, batch_size: int, distributed: bool) -> None:
    """Before the backend starts: the XLA flags, a core of this process's own where `RNNLAB_PIN_CPU=1`
    asks for it, and the simulated device count (`num_devices`, or null: one per core that the batch divides into)."""
    set_cpu_xla_flags()
    if os.environ.get(PIN_CPU_ENV) == "1" and hasattr(os, "sched_setaffinity"):
        pin_to_free_core()
    wanted = num_devices
    if wanted is None and not distributed and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        wanted = cpu_device_count(batch_size, max_cpu_devices())
    if wanted is not None:
        jax.config.update("jax_num_cpu_devices", max(wanted, jax.config.jax_num_cpu_devices))


# The device count by rule, from the train step's matmul FLOPs per time step (over the global batch),
# measured on a 2-core AMD EPYC (docs/performance-notes.md, scripts/device_count_probe.py): below the
# first bound a second device can only split the small work inside each of the scan's sequential steps
# and loses; between the bounds one device per core won every shape probed (1.3-1.6x at 2-38 MFLOP); from
# about 50 MFLOP the matmuls already use both cores and either may win (LSTM H=256: 1 device 1.1x faster,
# Elman H=512: 2 devices 1.07x), so above the second bound the two are timed. The rule holds where it was
# measured, at most RULE_DEVICES devices to choose from; with more, every step above the first bound is timed.
ONE_DEVICE_BELOW_FLOPS_PER_TIME_STEP = 2e5
TIMED_ABOVE_FLOPS_PER_TIME_STEP = 4e7
RULE_DEVICES = 2
LONG_DISPATCH_SECONDS = 1.0  # a warm dispatch this long is timed once: its noise is small beside it


def device_count_by_rule(flops_per_step: float, time_steps: int, available: int) -> int | None:
    """1 or `available` devices for a step of `flops_per_step` matmul FLOPs over `time_steps` time steps,
    as the rule above says; None where it must be timed (`choose_device_count`)."""
    per_time_step = flops_per_step / max(time_steps, 1)
    if per_time_step < ONE_DEVICE_BELOW_FLOPS_PER_TIME_STEP:
        return 1
    if available <= RULE_DEVICES and per_time_step < TIMED_ABOVE_FLOPS_PER_TIME_STEP:
        return available
    return None


def seconds_per_step(dispatch: Callable, state: Any, steps_per_dispatch: int, max_in_flight: int) -> float:
    """Median seconds per train step of `dispatch(state, k) -> (state, metrics)`: compiled and
    warmed up, then windows of whole dispatches (at most `max_in_flight` steps, about 50 ms
    each), median of up to 5 windows within about 2 s. A dispatch that takes LONG_DISPATCH_SECONDS
    once warm is timed once, since more runs of it would cost minutes on a large shape."""
    k = steps_per_dispatch
    for warm_up in range(3):  # compile, then warm up (the first runs after a compile are slower)
        start = time.perf_counter()
        state, metrics = dispatch(state, k)
        jax.block_until_ready(metrics)
        if warm_up and time.perf_counter() - start >= LONG_DISPATCH_SECONDS:
            return (time.perf_counter() - start) / k
    start = time.perf_counter()
    state, metrics = dispatch(state, k)
    jax.block_until_ready(metrics)
    windows = int(min(max_in_flight // k, max(1, 0.05 / (time.perf_counter() - start))))
    times: list[float] = []
    budget_end = time.perf_counter() + 2.0
    while len(times) < 5 and (not times or time.perf_counter() < budget_end):
        start = time.perf_counter()
        for _ in range(windows):
            state, metrics = dispatch(state, k)
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - start) / (windows * k))
    return float(np.median(times))


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


def device_count_is_open(num_devices: int | None, devices: Sequence[jax.Device]) -> bool:
    """`device.num_devices=null` on CPU in one process, with more than one count to choose from."""
    return (num_devices is None and devices[0].platform == "cpu" and jax.process_count() == 1
            and len(devices) > 1)


def fastest_device_count(available: int, batch_size: int, recorded: int | None, step_flops: float, time_steps: int,
                         cache_key: dict[str, Any], seconds_per_step: Callable[[int], float]) -> tuple[int, str]:
    """`device.num_devices=null` on CPU with `available` > 1 devices to choose from: (the count, how it was
    chosen, for the start line). A resumed run keeps the count its run dir `recorded`, so that it continues
    with the same numerics; a step of `step_flops` over `time_steps` that the rule decides
    (`device_count_by_rule`) runs on its count without timing; else 1 or all of them, whichever
    `seconds_per_step(n)` measures faster (`choose_device_count`, cached by `cache_key`, the candidates and
    the XLA flags)."""
    if recorded is not None:
        count = recorded if recorded <= available and batch_size % recorded == 0 else 1
        return count, f" (device.num_devices=null: {count}, as this run dir was trained)"
    by_rule = device_count_by_rule(step_flops, time_steps, available)
    if by_rule is not None:
        return by_rule, f" (untimed, by rule: {step_flops / max(time_steps, 1) / 1e6:.2g} MFLOP a time step)"
    candidates = [1, available]
    key = json.dumps({**cache_key, "candidates": candidates,
                      "xla_flags": with_cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))}, sort_keys=True)
    count, timings, cached = choose_device_count(key, candidates, seconds_per_step, files.cache_dir() / "device_count.json")
    measured = ", ".join(f"{n}: {1e3 * t:.1f}" for n, t in sorted(timings.items()))
    return count, f" (device.num_devices=null: fastest of {measured} ms{'; cached' if cached else ''})"


MAX_SECONDS_PER_STEP = 3600.0  # a cached step time at or above this is no measurement of a step that trains


def cached_device_count_problem(cached: Any, candidates: Sequence[int]) -> str | None:
    """Why a `choose_device_count` cache entry must not be used (None: it may): its count must be an
    int among `candidates`, and each candidate needs a time in (0, MAX_SECONDS_PER_STEP) seconds."""
    if not isinstance(cached, dict):
        return f"not an object but {reprlib.repr(cached)}"
    count, timings = cached.get("num_devices"), cached.get("seconds_per_step")
    if isinstance(count, bool) or not isinstance(count, int) or count not in candidates:
        return f"num_devices {reprlib.repr(count)} is not one of {list(candidates)}"
    if not isinstance(timings, dict):
        return f"seconds_per_step {reprlib.repr(timings)} is not an object"
    for n in candidates:
        t = timings.get(str(n))
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < MAX_SECONDS_PER_STEP:
            return f"seconds_per_step of {n} devices is {reprlib.repr(t)}, not in (0, {MAX_SECONDS_PER_STEP:g}) seconds"
    return None


def choose_device_count(key: str, candidates: Sequence[int], seconds_per_step: Callable[[int], float],
                        cache_file: Path, margin: float = 0.05) -> tuple[int, dict[int, float], bool]:
    """The candidate count whose train step measures fastest, remembered per `key` in `cache_file`.

    Which count wins depends on the model (see the module docstring), so it is measured
    once per key (machine, candidates, XLA_FLAGS, model, batch, data) and later runs read
    it back, unless the entry is damaged or implausible (`cached_device_count_problem`): that
    one is measured again and overwritten. More devices must win by
    `margin` to be chosen over fewer. Returns (count, seconds per step by count, from cache).
    """
    entries = files.read_json_object(cache_file)
    if key in entries:
        cached = entries[key]
        problem = cached_device_count_problem(cached, candidates)
        if problem is None:
            return cached["num_devices"], {n: float(cached["seconds_per_step"][str(n)]) for n in sorted(candidates)}, True
        log.warning("%s: the cached device count is not used (%s): measuring again", cache_file, problem)
    log.info("timing this model shape on %s devices to pick the fastest, once (cached in %s)",
             " and ".join(map(str, sorted(candidates))), cache_file.name)
    timings = {n: seconds_per_step(n) for n in sorted(candidates)}
    best = min(candidates)
    for n in sorted(candidates):
        if timings[n] < (1 - margin) * timings[best]:
            best = n
    entries[key] = {"num_devices": best, "seconds_per_step": timings}
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        files.write_json(cache_file, entries)
    except OSError:  # an unwritable cache dir: the run trains, and measures again next time
        pass
    return best, timings, False


# XLA CPU code generation options set for every rnnlab run on CPU, unless XLA_FLAGS names them
# (the user's value wins): 512-bit vectors for the cells' transcendentals (XLA's default is 256)
# and copy insertion that leaves fewer copies inside while loops; they made the gated cells'
# small steps faster and the rest no slower (docs/performance-notes.md; AVX-512 machines only).
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


def lock_dir_problem(lock_dir: Path) -> str | None:
    """Create `lock_dir` (mode 0o700) if it is missing; then why it must not hold pin locks, or None.

    The default one sits in the shared temp dir under a name anyone can predict, so a directory
    or link another user made there could steer the lock files this process creates (as root,
    say) onto files of their choosing: it must be a real directory, not a link, of this user,
    and writable by no one else.
    """
    try:
        lock_dir.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot be created ({e.strerror or e})"
    try:
        info = os.lstat(lock_dir)
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.getuid():
        return f"it belongs to uid {info.st_uid}, not this user ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others may write to it (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _open_lock(path: Path) -> Any | None:
    """`path` opened for a lock (created 0o600 if missing), or None if it is a symbolic link,
    which O_NOFOLLOW refuses to follow."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        if os.path.islink(path):
            return None
        raise
    return os.fdopen(fd, "r+")


def pin_to_free_core(lock_dir: Path | None = None) -> int | None:
    """Pin this process to one CPU core that no other process pinned through `lock_dir` holds.
    Returns the core, or None (not pinned) when every core of the affinity mask is held, or
    when `lock_dir` is not safe to use (`lock_dir_problem`: one warning says why).

    For sweep jobs run side by side, one per core. XLA's CPU client sizes its thread pool
    from the affinity mask when the backend starts, and `--xla_cpu_multi_thread_eigen=false`
    does not make a job single-threaded (its matmuls still run on the pool), so jobs side
    by side fight over every core unless pinned (docs/performance-notes.md). A core is held by an
    exclusive `flock` on `lock_dir/cpu<N>.lock`, kept open for the life of the process:
    the OS releases it when the process exits, a crash included, so no lock goes stale.
    Must run before the backend starts (the pool's threads inherit the mask); idempotent.
    """
    global _pin
    if _pin is not None:
        return _pin[0]
    import fcntl

    lock_dir = lock_dir or pin_lock_dir()
    problem = lock_dir_problem(lock_dir)
    if problem is not None:
        log.warning("not pinning this process to a core: the lock dir %s is unsafe, %s", lock_dir, problem)
        return None
    for core in sorted(os.sched_getaffinity(0)):
        lock = _open_lock(lock_dir / f"cpu{core}.lock")  # held open on purpose
        if lock is None:  # never followed; the other cores' files are still safe, so skip it as if held
            log.warning("not pinning to core %d: its lock file %s is a symbolic link", core, lock_dir / f"cpu{core}.lock")
            continue
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


