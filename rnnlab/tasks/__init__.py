"""Synthetic sequence tasks, one module each, found by name through the registry (`rnnlab.tasks.registry`).

Every module of this package is imported here, and each registers its task: a new task
is a new file, with no list to edit.
"""

import importlib
import pkgutil

from rnnlab.tasks.options import (  # noqa: F401  (the public names)
    MAX_EVAL_SEQ_LEN, OPTIONAL_DATA_KEYS, check_data, option_fields,
)
from rnnlab.tasks.registry import (  # noqa: F401  (the public names)
    EVAL_STREAM, IGNORE, TASKS, TRAIN_STREAM, Batch, OptionError, Task, carries_state, eval_option_keys, get_task,
    make_task, masked_cross_entropy, per_position_uniform, register_task, sample_batch, stream_key, task_names,
)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
