"""Synthetic sequence tasks, one module each, found by name through the registry (`rnnlab.tasks.registry`).

Every module of this package is imported here, and each registers its task: a new task
is a new file, with no list to edit.
"""

import importlib
import pkgutil

from rnnlab.tasks.registry import (  # noqa: F401  (the public names)
    EVAL_STREAM, TASKS, TRAIN_STREAM, Batch, Task, get_task, make_task, register_task, sample_batch, stream_key,
    task_names,
)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
