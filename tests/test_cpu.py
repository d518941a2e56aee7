"""The CPU code generation flags rnnlab adds to XLA_FLAGS (rnnlab.cpu.CPU_XLA_FLAGS), and the
one core per process that RNNLAB_PIN_CPU=1 asks for (rnnlab.cpu.pin_to_free_core)."""

import fcntl
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import ROOT
from rnnlab import cpu


def test_cpu_flags_are_added_to_what_xla_flags_already_holds():
    assert cpu.with_cpu_xla_flags("") == (
        "--xla_cpu_prefer_vector_width=512 --xla_cpu_copy_insertion_use_region_analysis=true"
    )
    theirs = "--xla_force_host_platform_device_count=4 --xla_cpu_multi_thread_eigen=false"
    merged = cpu.with_cpu_xla_flags(f"  {theirs} ")
    # First: XLA ignores what follows a token without a leading '-'.
    assert merged == f"{cpu.with_cpu_xla_flags('')} {theirs}"
    assert cpu.with_cpu_xla_flags(merged) == merged  # idempotent: a second job of a sweep adds nothing


def test_a_flag_the_user_set_keeps_the_users_value():
    merged = cpu.with_cpu_xla_flags("--xla_cpu_prefer_vector_width=256")
    assert merged.split() == ["--xla_cpu_copy_insertion_use_region_analysis=true", "--xla_cpu_prefer_vector_width=256"]
    assert cpu.with_cpu_xla_flags("-xla_cpu_copy_insertion_use_region_analysis=false").count("region_analysis") == 1


def test_a_flag_file_is_left_alone():
    """XLA_FLAGS that does not start with '-' names a file of flags: appending to it would break it."""
    assert cpu.with_cpu_xla_flags("/etc/xla_flags.txt") == "/etc/xla_flags.txt"


_COMPILE_AFTER_CONFIGURE = """
import jax, jax.numpy as jnp
from rnnlab import cpu, parallel
from rnnlab.config import DeviceConfig
parallel.configure_backend(DeviceConfig("cpu", 1, "pmap", None), batch_size=1)
jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x) * 2)(jnp.ones(1000)))
"""


@pytest.mark.parametrize("user_flags, width", [
    ("", "512"),
    ("--xla_cpu_prefer_vector_width=256", "256"),
    ("--xla_cpu_multi_thread_eigen=false not_a_flag=1", "512"),  # XLA ignores what follows a token without '-' 
])
def test_xla_compiles_with_the_flags_after_configure_backend(tmp_path, user_flags, width):
    """The flags are set after `import jax`, before the backend starts; XLA must still read them.
    The kernels' LLVM IR, dumped by XLA, carries the vector width they were compiled for."""
    dump = tmp_path / "xla_dump"
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump} {user_flags}", "PYTHONPATH": str(ROOT)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a cache hit would compile nothing to dump
    subprocess.run([sys.executable, "-c", _COMPILE_AFTER_CONFIGURE], env=env, check=True, timeout=120)
    widths = {m for ll in dump.glob("*.ll") for m in re.findall(r'"prefer-vector-width"="(\d+)"', ll.read_text())}
    assert widths == {width}


_PIN_AND_HOLD = """
import os, sys
from pathlib import Path
from rnnlab import cpu, parallel
core = cpu.pin_to_free_core(Path(sys.argv[1]))
if core is not None:
    import jax, jax.numpy as jnp
    jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x @ x))(jnp.ones((512, 512))))  # XLA's threads exist now
    masks = {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
    assert masks == {frozenset({core})}, masks
print(core, flush=True)
sys.stdin.read()  # hold the core until the test closes stdin
"""


@pytest.mark.slow("end-to-end")
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_pinned_processes_take_a_core_each_and_release_it_when_they_die(tmp_path):
    """Sweep jobs run side by side with RNNLAB_PIN_CPU=1 (hydra/launcher=parallel) each take a core no
    other holds, and every thread of the process, XLA's included, stays on it. The test holds all
    but two cores itself, so the third process finds none; a killed process frees its core."""
    cores = sorted(os.sched_getaffinity(0))
    held = [open(tmp_path / f"cpu{core}.lock", "a") for core in cores[2:]]
    for lock in held:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []

    def start():
        proc = subprocess.Popen([sys.executable, "-c", _PIN_AND_HOLD, str(tmp_path)], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(proc)
        return proc, proc.stdout.readline().strip()

    try:
        first, core = start()
        assert core == str(cores[0])
        assert start()[1] == str(cores[1])
        assert start()[1] == "None"  # every core held: not pinned
        first.send_signal(signal.SIGKILL)  # a crash: the OS drops its lock
        first.wait(timeout=30)
        assert start()[1] == str(cores[0])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
        for lock in held:
            lock.close()
    assert all(proc.returncode in (0, -signal.SIGKILL) for proc in procs)
