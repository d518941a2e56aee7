"""Compiling the lab's C++ kernels (rnnlab/native/*.cc) into shared libraries on first use, cached per machine.

A kernel is built with the C++ compiler on PATH (or $CXX) against JAX's FFI headers, into
`files.cache_dir()/native/<stem>-<hash>.so`: the name hashes the source (and the headers beside it), the compiler, the flags, jaxlib and
the CPU's instruction-set flags, so an edit, an upgrade or another machine builds anew and a build is never
run on a CPU it was not made for. Processes that ask together wait for one build (a lock beside the library),
which writes a temporary file and renames it into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import jax

from rnnlab import files

NATIVE = Path(__file__).parent / "native"


def cache_dir() -> Path:
    return files.cache_dir() / "native"


def cpu_flags() -> str:
    """The CPU's instruction-set flags (/proc/cpuinfo), or the machine's name where there are none to read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def build(source: Path, flags: list[str], libraries: list[str] = ()) -> Path:
    """The path of `source` compiled into a shared library with `flags` (and linked against `libraries`, which
    come after the source), built once per source, compiler, flags, jaxlib and CPU; RuntimeError with the
    compiler's last line where it cannot be built."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    include = jax.ffi.include_dir()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    parts = [source.read_bytes(), *headers, compiler.encode(), " ".join([*flags, *libraries]).encode(), jax.__version__.encode(),
             include.encode(), cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with files.waited_lock(out.with_suffix(".lock")):  # processes that ask together build it once
        if not out.exists():
            _compile(compiler, [*flags, "-shared", "-fPIC", "-w", f"-I{include}", str(source), *libraries], source, out)
    return out


def _compile(compiler: str, args: list[str], source: Path, out: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)  # unique per build
    os.close(fd)
    done = subprocess.run([compiler, *args, "-o", str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        lines = done.stderr.strip().splitlines()
        why = next((line for line in lines if "error" in line), lines[-1] if lines else f"{compiler} exited {done.returncode}")
        raise RuntimeError(f"compiling {source.name} failed: {why.strip()}")
    os.replace(tmp, out)  # atomic: a process that does not take the lock sees no library or the whole one


class Loader:
    """A kernel library built, loaded and its FFI targets registered once per process (threads that ask together
    wait for the one build): `load()` -> (the library, "") or (None, why not), the reason kept for later asks."""

    def __init__(self, build: Callable[[], Path], targets: dict[str, str], prepare: Callable[[ctypes.CDLL], None] = None):
        self._build, self._targets, self._prepare = build, targets, prepare
        self._lock = threading.Lock()
        self._result: tuple[ctypes.CDLL | None, str] | None = None

    def load(self) -> tuple[ctypes.CDLL | None, str]:
        with self._lock:
            if self._result is None:
                self._result = self._load()
            return self._result

    def _load(self) -> tuple[ctypes.CDLL | None, str]:
        try:
            lib = ctypes.CDLL(str(self._build()))
        except (OSError, RuntimeError) as e:
            return None, str(e)
        if self._prepare:
            self._prepare(lib)
        for target, symbol in self._targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        return lib, ""
