"""One record per zoo job, in one format, kept under docs/zoo/records/<table>.jsonl (one JSON object a line, in a
fixed order, so that a diff shows the jobs that changed): every override, the lr, the seed, the status, every
metric at every evaluated length, the timings and the provenance (`rnnlab.provenance`). The page is built from
these files alone; `collect` writes them from run dirs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from rnnlab.files import read_json_object, waited_lock
from rnnlab.provenance import device_kind, machine_name
from rnnlab.zoo.protocol import Setting, Table, same_lr

FINAL = ("completed", "diverged", "failed")  # a job with one of these is not run again; others (preempted) resume
COPIED = ("status", "error", "step", "num_params", "state_floats", "model_state_floats", "tokens_per_sec",
          "compile_seconds", "wall_seconds", "overrides", "provenance")


class RecordsError(Exception):
    """A records file that cannot be read as records (a damaged line, a conflict left by git): one line naming the
    file and line, exit 2. It is never rewritten over: what it holds is the page."""


class RecordsUnwritable(Exception):
    """The records dir or a records file cannot be written: one line, exit 74."""


def records_dir(docs: Path) -> Path:
    return Path(docs) / "zoo" / "records"


def record_from_results(table: Table, setting: Setting, lr: float, seed: int, results: Mapping[str, Any],
                        job: str) -> dict[str, Any]:
    """A job's record from its results.json: every evaluated length's metrics, the training length's included."""
    metrics: dict[str, dict[str, float | None]] = {}
    train = {"loss": results.get("eval_loss"), **(results.get("eval_metrics") or {})}
    if any(v is not None for v in train.values()):
        metrics[table.choose_key] = train
    for split in {key for key, _ in table.split_columns} - {table.choose_key}:  # data=text's test split, at the end
        prefix = f"{split}_"
        found = {k[len(prefix):]: v for k, v in results.items() if k.startswith(prefix)}
        if any(v is not None for v in found.values()):
            metrics[split] = found
    for length, values in (results.get("eval_by_len") or {}).items():
        metrics.setdefault(str(length), dict(values))
    return {"table": table.key, "setting": setting.name, "lr": float(lr), "seed": int(seed), "job": job,
            "metrics": metrics, **{k: results.get(k) for k in COPIED}}


def score(record: Mapping[str, Any], table: Table) -> float | None:
    """The protocol's score of a job: its headline metric at the training length, if it completed with one."""
    if record.get("status") != "completed":
        return None
    value = (record.get("metrics") or {}).get(table.choose_key, {}).get(table.metric)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def commit_of(record: Mapping[str, Any]) -> str | None:
    return (record.get("provenance") or {}).get("commit")


def machine_of(record: Mapping[str, Any]) -> str:
    """The machine a job ran on (an earlier run's record has only a description of it)."""
    machine = (record.get("provenance") or {}).get("machine") or {}
    return machine.get("description") or machine_name(machine)


def kind_of(record: Mapping[str, Any]) -> str:
    """The kind of device a job ran on (`provenance.device_kind`): what a table may not mix."""
    machine = (record.get("provenance") or {}).get("machine") or {}
    if machine.get("description"):
        return "CPU" if machine.get("platform") in ("cpu", None) else machine["description"]
    return device_kind(machine)


def key(record: Mapping[str, Any]) -> tuple:
    """What makes two records the same job: the table, setting, lr, seed, commit and kind of device."""
    return (record["table"], record["setting"], float(record["lr"]), int(record["seed"]), commit_of(record) or "",
            kind_of(record))


REQUIRED = ("table", "setting", "lr", "seed")


def read(path: Path) -> list[dict[str, Any]]:
    """The records in `path` (none if it is missing); a RecordsError naming the file and line of the first line that
    is not a record."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise RecordsError(f"{path}: cannot be read ({e.strerror or e})") from None
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            record, why = None, f"not JSON ({str(e).split(':')[0]})"
        else:
            missing = [k for k in REQUIRED if k not in record] if isinstance(record, dict) else list(REQUIRED)
            why = f"not a record (no {', '.join(missing)})" if missing else ""
        if why:
            shown = line if len(line) <= 40 else line[:37] + "..."
            raise RecordsError(f"{path} line {number}: {why}: {shown!r}; restore the line from git "
                               f"(`git log -p -- {path}`) or remove it, then run again")
        found.append(record)
    return found


def read_table(docs: Path, table: str) -> list[dict[str, Any]]:
    return read(records_dir(docs) / f"{table}.jsonl")


def order(table: Table | None, record: Mapping[str, Any]) -> tuple:
    """Records in the protocol's order: setting, lr, seed, then commit and device."""
    names = [s.name for s in table.settings] if table else []
    at = names.index(record["setting"]) if record["setting"] in names else len(names)
    return (at, record["setting"], float(record["lr"]), int(record["seed"]), commit_of(record) or "", kind_of(record))


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """An exclusive `flock` on the records dir itself for the block: one writer of the records at a time, across
    processes (no lock file to commit; the OS drops the lock when its holder dies, even by SIGKILL)."""
    folder = Path(folder)
    with contextlib.ExitStack() as held:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            held.enter_context(waited_lock(folder))
        except OSError as e:
            raise RecordsUnwritable(f"cannot write the records dir {folder} ({e.strerror or e})") from None
        yield


def write(path: Path, records: Iterable[Mapping[str, Any]], table: Table | None) -> None:
    """The records, one a line, sorted keys, in the protocol's order, through a temp file of this process renamed
    into place (a reader sees the old file or the new one). Call it under `locked`."""
    rows = sorted(records, key=lambda r: order(table, r))
    text = "".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n" for r in rows)
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise RecordsUnwritable(f"cannot write {path} ({e.strerror or e}); the jobs' results "
                                "stay in their run dirs: make it writable and run again (or `collect`)") from None
    finally:
        tmp.unlink(missing_ok=True)


def merge(docs: Path, table: Table, new: Iterable[Mapping[str, Any]]) -> int:
    """Add `new` records to the table's file, each replacing the record of the same job (`key`); returns how many
    records changed. Read, changed and written under the records dir's lock, so that concurrent merges (two
    runners, a runner and `collect`) lose nothing."""
    new = list(new)
    folder = records_dir(docs)
    path = folder / f"{table.key}.jsonl"
    with locked(folder):
        by_key = {key(r): r for r in read(path)}
        changed = 0
        for record in new:
            if by_key.get(key(record)) != record:
                by_key[key(record)] = dict(record)
                changed += 1
        if changed:
            write(path, by_key.values(), table)
    return changed


def results_of(run_dir: Path) -> dict[str, Any]:
    return read_json_object(Path(run_dir) / "results.json")


def find(records: Iterable[Mapping[str, Any]], setting: str, lr: float, seed: int) -> list[Mapping[str, Any]]:
    return [r for r in records if r["setting"] == setting and same_lr(r["lr"], lr) and int(r["seed"]) == seed]


def mean_and_spread(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation) of the values present; spread None with fewer than two."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None
