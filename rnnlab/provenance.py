"""Where a result came from: the code's commit (and whether its tree had changes), the machine and the library
versions, recorded in every results.json so that a table built from records can say what it compares."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Sequence

PACKAGES = ("jax", "jaxlib", "flax", "optax")
COMMIT_ENV = "RNNLAB_COMMIT"  # where the code has no git checkout (an installed wheel): the commit it was built from


def utc_now() -> str:
    """The time now, UTC, to the second: `2026-12-01T13:52:07Z`."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@functools.lru_cache(maxsize=None)
def code_version(root: str | None = None) -> dict[str, Any]:
    """{"commit": the HEAD of the git checkout holding rnnlab (or $RNNLAB_COMMIT, or None), "dirty": whether
    tracked or unignored files differ from it (None: unknown)}."""
    root = root or str(Path(__file__).resolve().parent.parent)
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=20, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", root, "status", "--porcelain"], capture_output=True, text=True,
                                 timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": os.environ.get(COMMIT_ENV) or None, "dirty": None}
    return {"commit": commit, "dirty": bool(changes.strip())}


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), else what Python's platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """The machine's cores (not the ones this process is pinned to: a zoo job pinned to one core ran on a
    machine of two)."""
    return os.cpu_count() or 1


def machine(devices: Sequence[Any]) -> dict[str, Any]:
    """The machine a run trained on: its platform and, for a CPU, the model and cores; for an accelerator, its
    kind and how many (`devices`: the run's JAX devices)."""
    platform_name = devices[0].platform if devices else "cpu"
    info: dict[str, Any] = {"platform": platform_name, "cpu": cpu_model(), "cpu_cores": cpu_cores(),
                            "hostname": platform.node()}
    if platform_name != "cpu":
        info |= {"accelerator": devices[0].device_kind, "accelerator_count": len(devices)}
    return info


@functools.lru_cache(maxsize=None)
def versions() -> dict[str, str | None]:
    """The versions of python and of the libraries a result depends on (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def machine_name(record_machine: dict[str, Any]) -> str:
    """A machine as a table names it: the accelerator's kind and count, or `CPU (<model>, <n> cores)`."""
    if record_machine.get("accelerator"):
        return f"{record_machine['accelerator']} x{record_machine.get('accelerator_count', 1)}"
    return f"CPU ({record_machine.get('cpu', '?')}, {record_machine.get('cpu_cores', '?')} cores)"


def device_kind(record_machine: dict[str, Any]) -> str:
    """The kind of device a table is built from: the accelerator's kind and count, or `CPU` for every CPU model (XLA
    computes the same float32 programs on each; only the speed differs, and the page names each machine with it)."""
    return machine_name(record_machine) if record_machine.get("accelerator") else "CPU"


def provenance(devices: Sequence[Any], started_utc: str) -> dict[str, Any]:
    """results.json's `provenance`: code version, machine, versions, and the UTC start (`started_utc`) and end."""
    return {**code_version(), "machine": machine(devices), "versions": versions(), "started_utc": started_utc,
            "ended_utc": utc_now()}
