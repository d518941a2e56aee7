"""Recurrent cells, one module each, found by name through the registry (`rnnlab.cells.registry`).

Every module of this package is imported here, and each registers its cell: a new cell
is a new file, with no list to edit.
"""

import importlib
import pkgutil

from rnnlab.cells.registry import (  # noqa: F401  (the public names)
    ACTIVATIONS, CELLS, INITIALIZERS, Cell, LinearCell, SequenceCell, cell_names, from_torch, get_cell, initializers, per_gate,
    register_cell,
)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
