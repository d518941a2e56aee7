"""JAX's persistent compilation cache for runs, and what a run learns from it.

A run keeps its compiled programs in `$XDG_CACHE_HOME/rnnlab/jax-compilation-cache` (`device.compile_cache`,
on by default), so that the next job of a sweep that compiles the same program (another lr or seed of the
same cell: both are inputs of the compiled step, `rnnlab.steps.Hyperparameters`) reads it instead of
compiling. A cache dir JAX was already given (`JAX_COMPILATION_CACHE_DIR`, the tests') is used as it is.

Reading a cached executable can crash the process (jax-ml/jax#28908: a deserialised executable
segfaulting). So that a bad entry costs at most one crash: while JAX reads or compiles through the cache,
the process keeps a marker file beside it; a run that finds the marker of a process that is gone (it died
there) moves the cache aside before it compiles anything, and says so. Where even one crash is too many
(CI), `RNNLAB_COMPILE_CACHE=0` in the environment turns the cache off for every run, whatever the config says.

An entry that cannot be read (truncated, damaged: JAX would warn `Error reading persistent compilation cache
entry` and compile, at every run, without ever writing it again) is renamed `<entry>.unreadable` beside the
others (`guard_reads`): the program compiles afresh and its new entry is written, so that the next run hits.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from rnnlab import files

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
# "0": no markers and no quarantine (the test suite, whose tests SIGKILL train.py at random moments on purpose,
# compilations included: each such kill would move the suite's shared cache aside).
GUARD_ENV = "RNNLAB_COMPILE_CACHE_GUARD"
OFF_ENV = "RNNLAB_COMPILE_CACHE"  # "0": every run of this environment compiles without the cache
_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"  # recorded before the cache is read
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_COMPILED_EVENT = "/jax/core/compile/backend_compile_duration"  # recorded once the program is loaded or compiled


def default_dir() -> Path:
    return files.cache_dir() / "jax-compilation-cache"


class CacheUse:
    """Counts of this process's compilations through the cache (`requests`, `hits`) and the marker that
    spans each of them. One per process: `enable` returns it."""

    def __init__(self, directory: Path, guard: bool = True):
        self.directory, self.guard = directory, guard
        self.requests = 0
        self.hits = 0
        self._marker = _markers_dir(directory) / f"{socket.gethostname()}-{os.getpid()}"
        self._marked = False

    def on_event(self, event: str, **_: object) -> None:
        if event == _REQUEST_EVENT:
            self.requests += 1
            self._mark()
        elif event == _HIT_EVENT:
            self.hits += 1

    def on_duration(self, event: str, _seconds: float, **__: object) -> None:
        if event == _COMPILED_EVENT:
            self._unmark()

    def _mark(self) -> None:
        if not self.guard:
            return
        try:
            self._marker.parent.mkdir(parents=True, exist_ok=True)
            self._marker.write_text(str(time.time()))
            self._marked = True
        except OSError:  # a cache dir that cannot be written: JAX warns about it itself
            pass

    def _unmark(self) -> None:
        if self._marked:
            self._marked = False
            try:
                self._marker.unlink()
            except OSError:
                pass


_use: CacheUse | None = None
_given: list[str | None] = []  # the dir JAX was given before rnnlab set one (read once)
_state: list[tuple[bool, str]] = []  # the (enabled, dir) this process last set


def enable(enabled: bool) -> CacheUse | None:
    """JAX's persistent cache for this process's next compilations, before anything compiles: with `enabled`,
    in the dir JAX was given, else in rnnlab's (`default_dir`), programs that take 0.1 s or more to compile
    kept; off otherwise (None). A cache that a process died reading is moved aside first
    (`quarantine_if_crashed`), an entry that cannot be read as it is met (`guard_reads`). Jobs of one process
    (a launcher's worker, the tests) may call it in turn."""
    global _use
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if not _given:
        _given.append(jax.config.jax_compilation_cache_dir or os.environ.get(CACHE_DIR_ENV) or None)
    directory = Path(_given[0]) if _given[0] else default_dir()
    guard = os.environ.get(GUARD_ENV, "1") != "0"
    enabled = enabled and os.environ.get(OFF_ENV, "1") != "0"
    if enabled and guard and quarantine_if_crashed(directory) is not None:
        _state.clear()  # a new cache in the dir: JAX opens it afresh
    if _state != [(enabled, str(directory))]:  # JAX decides whether to use its cache once, until reset
        jax.config.update("jax_enable_compilation_cache", enabled)
        jax.config.update("jax_compilation_cache_dir", str(directory))
        if not _given[0]:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
        compilation_cache.reset_cache()
        _state[:] = [(enabled, str(directory))]
    if not enabled:
        return None
    guard_reads(directory)
    if _use is None:
        _use = CacheUse(directory, guard)
        jax.monitoring.register_event_listener(_use.on_event)
        jax.monitoring.register_event_duration_secs_listener(_use.on_duration)
    return _use


UNREADABLE_SUFFIX = ".unreadable"
_read_guard: list[Path] = []  # the cache dir whose unreadable entries `guard_reads` moves aside (once installed)


def guard_reads(directory: Path) -> None:
    """From now on, an entry of `directory` that JAX cannot read (decompress, unpack or deserialise) is moved aside
    as `<entry>.unreadable`, said in one warning naming it, and counted as a miss: JAX compiles the program and
    writes its entry afresh (it never overwrites an entry that exists). Wraps JAX's
    `compilation_cache.get_executable_and_time`, the one function that reads an entry; a JAX without it is left
    as it is (its warning and miss at every run)."""
    from jax._src import compilation_cache as jax_cache

    _read_guard[:] = [Path(directory)]
    original = getattr(jax_cache, "get_executable_and_time", None)
    if original is None or getattr(original, "_rnnlab_guard", False):
        return

    def get_executable_and_time(cache_key: str, *args: object, **kwargs: object) -> object:
        try:
            return original(cache_key, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure to read this one entry: set it aside, compile afresh
            verification = getattr(jax_cache, "CacheVerificationError", ())
            if (verification and isinstance(e, verification)) or _raise_cache_errors():
                raise
            quarantine_entry(cache_key, e)
            return None, None

    get_executable_and_time._rnnlab_guard = True  # type: ignore[attr-defined]
    jax_cache.get_executable_and_time = get_executable_and_time


def _raise_cache_errors() -> bool:
    import jax

    try:
        return bool(jax.config.jax_raise_persistent_cache_errors)
    except AttributeError:
        return False


def quarantine_entry(cache_key: str, error: BaseException) -> Path | None:
    """Move the entry of `cache_key` in the guarded dir to `<entry>.unreadable` (replacing an older one) and say so;
    returns where it went, None if it is not a file there (JAX's other cache kinds: left to JAX)."""
    if not _read_guard:
        return None
    entry = _read_guard[0] / f"{cache_key}-cache"  # jax._src.lru_cache's name for an entry
    aside = entry.with_name(entry.name + UNREADABLE_SUFFIX)
    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:200]
    try:
        os.replace(entry, aside)
    except OSError as e:
        log.warning("the compilation cache entry %s cannot be read (%s) nor moved aside (%s): compiling without it",
                    entry, reason, e.strerror or e)
        return None
    log.warning("the compilation cache entry %s cannot be read (%s): moved aside as %s, compiling afresh", entry,
                reason, aside.name)
    return aside


def quarantine_if_crashed(directory: Path) -> Path | None:
    """If a process of this host died while compiling through `directory` (its marker is left and its pid is
    gone), move the cache to `<directory>.crashed-<time>` and return that path; else None."""
    markers = _markers_dir(directory)
    host = socket.gethostname()
    dead = []
    for marker in markers.glob(f"{host}-*") if markers.is_dir() else ():
        pid = marker.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            dead.append(marker)
    if not dead or not directory.exists():
        for marker in dead:
            marker.unlink(missing_ok=True)
        return None
    aside = directory.with_name(f"{directory.name}.crashed-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        directory.rename(aside)
    except OSError as e:  # another process moved it first, or it cannot be moved: start without it
        log.warning("the compilation cache %s may hold a bad entry (process %s died compiling) and cannot be "
                    "moved aside (%s)", directory, dead[0].name, e.strerror or e)
        return None
    for marker in dead:
        marker.unlink(missing_ok=True)
    log.warning("a process (%s) died while compiling through the compilation cache: moved it to %s (jax-ml/jax#28908; "
                "delete it when done; device.compile_cache=false runs without a cache)", dead[0].name, aside)
    return aside


def _markers_dir(directory: Path) -> Path:
    return directory.with_name(directory.name + ".in-use")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
