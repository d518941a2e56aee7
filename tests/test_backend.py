"""The CPU code generation flags rnnlab adds to XLA_FLAGS (rnnlab.parallel.CPU_XLA_FLAGS)."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from rnnlab import parallel


def test_cpu_flags_are_added_to_what_xla_flags_already_holds():
    assert parallel.with_cpu_xla_flags("") == (
        "--xla_cpu_prefer_vector_width=512 --xla_cpu_copy_insertion_use_region_analysis=true"
    )
    theirs = "--xla_force_host_platform_device_count=4 --xla_cpu_multi_thread_eigen=false"
    merged = parallel.with_cpu_xla_flags(f"  {theirs} ")
    # First: XLA ignores what follows a token without a leading '-'.
    assert merged == f"{parallel.with_cpu_xla_flags('')} {theirs}"
    assert parallel.with_cpu_xla_flags(merged) == merged  # idempotent: a second job of a sweep adds nothing


def test_a_flag_the_user_set_keeps_the_users_value():
    merged = parallel.with_cpu_xla_flags("--xla_cpu_prefer_vector_width=256")
    assert merged.split() == ["--xla_cpu_copy_insertion_use_region_analysis=true", "--xla_cpu_prefer_vector_width=256"]
    assert parallel.with_cpu_xla_flags("-xla_cpu_copy_insertion_use_region_analysis=false").count("region_analysis") == 1


def test_a_flag_file_is_left_alone():
    """XLA_FLAGS that does not start with '-' names a file of flags: appending to it would break it."""
    assert parallel.with_cpu_xla_flags("/etc/xla_flags.txt") == "/etc/xla_flags.txt"


_COMPILE_AFTER_CONFIGURE = """
import jax, jax.numpy as jnp
from rnnlab import parallel
from rnnlab.config import DeviceConfig
parallel.configure_backend(DeviceConfig("cpu", 1, "pmap", None), batch_size=1)
jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x) * 2)(jnp.ones(1000)))
"""


@pytest.mark.parametrize("user_flags, width", [
    ("", "512"),
    ("--xla_cpu_prefer_vector_width=256", "256"),
    ("--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1", "512"),  # hydra/launcher=parallel's value
])
def test_xla_compiles_with_the_flags_after_configure_backend(tmp_path, user_flags, width):
    """The flags are set after `import jax`, before the backend starts; XLA must still read them.
    The kernels' LLVM IR, dumped by XLA, carries the vector width they were compiled for."""
    dump = tmp_path / "xla_dump"
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump} {user_flags}", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", _COMPILE_AFTER_CONFIGURE], env=env, check=True, timeout=120)
    widths = {m for ll in dump.glob("*.ll") for m in re.findall(r'"prefer-vector-width"="(\d+)"', ll.read_text())}
    assert widths == {width}
