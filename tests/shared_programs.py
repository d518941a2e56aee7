"""One XLA executable per distinct program in a test process.

The suite builds the same program again and again in one process: every in-process run builds its step
functions anew (other learning rates and seeds are inputs, not constants), and several tests of a module
compile the same model. JAX's in-memory caches key on the Python function, so each of those compiles again;
JAX's persistent cache would share them, but reading an entry back can crash the process (jax-ml/jax#28908),
so CI runs without it. Here XLA's compile itself is memoised, keyed on everything it reads: the module's
text (debug locations left out: they name source lines, not operations), the serialised compile options
(XLA's debug options, the device assignment), the devices and the backend. JAX still traces, lowers, logs
and counts every compile as before (`jax_log_compiles`, its monitoring events): only XLA's work is shared.

`install()` wraps `jax._src.compiler.backend_compile_and_load`, JAX's one call into XLA's compiler.
RNNLAB_TEST_SHARE_PROGRAMS=0 turns it off.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from typing import Any

# Executables kept (least recently used dropped first): a module's repeats are near each other, and each kept
# executable holds its code in memory for the life of the worker.
MAX_PROGRAMS = 256

stats = {"compiled": 0, "shared": 0}
_programs: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
_lock = threading.Lock()


def program_key(backend, module, executable_devices, options) -> bytes:
    digest = hashlib.sha256()
    for part in (module.operation.get_asm(enable_debug_info=False), options.SerializeAsString(),
                 repr([d.id for d in executable_devices or ()]), backend.platform, backend.platform_version):
        digest.update(part if isinstance(part, bytes) else str(part).encode())
        digest.update(b"\0")
    return digest.digest()


def install() -> bool:
    """Memoise XLA's compile in this process; False (nothing changed) where it is turned off or JAX's
    compile call is not where this expects it."""
    if os.environ.get("RNNLAB_TEST_SHARE_PROGRAMS", "1") == "0":
        return False
    from jax._src import compiler

    compile_and_load = getattr(compiler, "backend_compile_and_load", None)
    if compile_and_load is None or getattr(compile_and_load, "shares_programs", False):
        return bool(compile_and_load)

    def backend_compile_and_load(backend, module, executable_devices, options, host_callbacks):
        if host_callbacks:  # the executable calls back into this function's Python: never shared
            return compile_and_load(backend, module, executable_devices, options, host_callbacks)
        key = program_key(backend, module, executable_devices, options)
        with _lock:
            executable = _programs.get(key)
            if executable is not None:
                _programs.move_to_end(key)
                stats["shared"] += 1
                return executable
        executable = compile_and_load(backend, module, executable_devices, options, host_callbacks)
        with _lock:
            stats["compiled"] += 1
            _programs[key] = executable
            while len(_programs) > MAX_PROGRAMS:
                _programs.popitem(last=False)
        return executable

    backend_compile_and_load.shares_programs = True
    compiler.backend_compile_and_load = backend_compile_and_load
    return True
