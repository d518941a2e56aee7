"""How the keys under `data:` reach a task, and the length checks every task shares.

`data:` has four keys of its own (`rnnlab.config.DataConfig`); every other key must be a field of the chosen
task's dataclass (`option_fields`; `rnnlab.config` coerces them to the fields' types and fills
the unset ones from their defaults), so that a task with parameters of its own is still one
file. Problems raise `OptionError` with rnnlab's one-line message naming the key;
`rnnlab.config` raises it again as a ConfigError, before anything compiles.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from rnnlab.tasks.registry import OptionError, Task, make_task

# The longest length `data.eval_seq_lens` takes: even in segments (`data.eval_segment_len`) 10^8 steps are hours on
# a CPU (a small LSTM: about 70 s per 10^6 steps of a batch of 64), and positions stay far inside int32.
MAX_EVAL_SEQ_LEN = 10**8
# DataConfig's own keys that a data file may leave out, so that an extension's needs only `task` and `seq_len`.
OPTIONAL_DATA_KEYS: Mapping[str, Any] = {"min_seq_len": None, "eval_seq_lens": (), "eval_segment_len": None}


def option_fields(task_class: type[Task]) -> dict[str, tuple[Any, Any]]:
    """{option: (type, default or dataclasses.MISSING)}: the task's dataclass fields but `seq_len`."""
    hints = typing.get_type_hints(task_class)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(task_class) if f.name != "seq_len"}


def check_data(data: Any) -> None:
    """A `DataConfig` whose task exists: the task's own checks (`Task.check`), then `data.seq_len`,
    `data.min_seq_len` and `data.eval_seq_lens` against the task's minimum length."""
    missing = [name for name, value in data.options if value is dataclasses.MISSING]
    if missing:
        raise OptionError(f"missing key 'data.{missing[0]}' (the {data.task} task has no default for it)")
    task = make_task(data)
    task.check()
    shortest = task.min_seq_len
    if data.seq_len < shortest:
        raise OptionError(f"key 'data.seq_len': got {data.seq_len}, the {data.task} task needs >= {shortest}")
    if data.min_seq_len is not None and not task.variable_length():
        raise OptionError(f"key 'data.min_seq_len': got {data.min_seq_len}, but every {data.task} example has "
                          f"data.seq_len steps (the task has no sample_padded); allowed: null")
    if data.min_seq_len is not None and not shortest <= data.min_seq_len <= data.seq_len:
        raise OptionError(f"key 'data.min_seq_len': got {data.min_seq_len}, allowed: null or {shortest} .. "
                          f"{data.seq_len} (the {data.task} task's minimum .. data.seq_len)")
    lengths = list(data.eval_seq_lens)
    if any(n < shortest for n in lengths) or len(set(lengths)) < len(lengths):
        raise OptionError(f"key 'data.eval_seq_lens': got {lengths}, allowed: a list of distinct lengths, "
                          f"each >= {shortest} (the {data.task} task's minimum)")
    if any(n > MAX_EVAL_SEQ_LEN for n in lengths):
        raise OptionError(f"key 'data.eval_seq_lens': got {max(lengths)}, allowed: lengths up to {MAX_EVAL_SEQ_LEN:,} "
                          f"(10^8 steps take hours even in segments; eval_max_minutes refuses a shorter one by its "
                          f"measured time)")
    segment = data.eval_segment_len
    if segment is not None and (isinstance(segment, bool) or not isinstance(segment, int) or segment < 1):
        raise OptionError(f"key 'data.eval_segment_len': got {segment!r}, allowed: null or a length >= 1")
    if segment is not None and not task.segmentable():
        raise OptionError(f"key 'data.eval_segment_len': got {segment}, but the {data.task} task is not evaluated in "
                          f"segments (it has no sample_segment); allowed: null")
