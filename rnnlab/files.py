"""Small JSON files that must never be seen half-written: results, caches, run configs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, value: Any, indent: int | None = 2) -> None:
    """Write `value` as JSON to `path` atomically (a temp file renamed into place): a reader sees
    the old file or the new one, never part of one, even with several writers."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=indent, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
