"""Small JSON files that must never be seen half-written: results, caches, run configs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
from pathlib import Path
from typing import Any, Iterator


def write_json(path: Path, value: Any, indent: int | None = 2) -> None:
    """Write `value` as JSON to `path` atomically (a temp file renamed into place): a reader sees
    the old file or the new one, never part of one, even with several writers. Non-finite
    floats, at any depth, are written as null: JSON has no NaN or Infinity, and strict
    parsers (jq, JavaScript, most other languages) reject the `NaN` Python writes by default."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(finite_or_null(value), indent=indent, sort_keys=True, allow_nan=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float in it (nested dicts, lists and tuples too) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def read_json_object(path: Path) -> dict:
    """A JSON object from `path`, or {} if it is missing, unreadable or not an object."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def cache_dir() -> Path:
    """rnnlab's per-user cache: `$XDG_CACHE_HOME/rnnlab`, default `~/.cache/rnnlab`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rnnlab"


def exclusive_lock(path: Path, flags: int = 0) -> tuple[int | None, str]:
    """An exclusive `flock` on `path` (created if missing), without waiting: (its fd, "") once held, the file then
    naming this process (pid and host) for whoever finds it held; (None, "pid N on host H") while another live
    process holds it. The OS drops the lock when its fd is closed or the process ends, SIGKILL included, so it never
    goes stale. The run dir's, the sweep dir's and the zoo runner's locks."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 200, 0).decode(errors="replace").split()
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return None, f"pid {holder[0]} on host {holder[1]}" if len(holder) >= 2 else "another process"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd, ""


@contextlib.contextmanager
def waited_lock(path: Path) -> Iterator[None]:
    """An exclusive `flock` on `path` (a folder, or a file created if missing) for the block, waiting for it: one
    process at a time, across processes (the zoo's records, the sweep status's count). The OS drops it when its
    holder dies, even by SIGKILL. An OSError if `path` cannot be opened."""
    mode = os.O_RDONLY | os.O_DIRECTORY if Path(path).is_dir() else os.O_RDWR | os.O_CREAT
    fd = os.open(path, mode | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def lock_holder(path: Path) -> str | None:
    """Who holds the `flock` on `path` ("pid N"), if a live process does; None if nobody does (or there is no file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").split()
        return f"pid {holder[0]}" if holder else "another process"
    finally:
        os.close(fd)  # drops the probe's shared lock, if it got one
    return None
