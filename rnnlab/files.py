"""Small JSON files that must never be seen half-written: results, caches, run configs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


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
