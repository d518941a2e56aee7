"""tensorboardX, imported without torch: where torch is installed (the bench and refs extras) tensorboardX's
writer imports it only to recognise torch tensors, which the lab never hands it, and that import is most of a
run's start-up. Import this module before `tensorboardX` (rnnlab.board and rnnlab.metrics do)."""

from __future__ import annotations

import importlib
import sys


def import_without_torch(name: str):
    """`importlib.import_module(name)` with `import torch` failing meanwhile (tensorboardX catches the
    ImportError); torch stays importable afterwards. Where torch is already imported, a plain import."""
    if "torch" in sys.modules:
        return importlib.import_module(name)
    sys.modules["torch"] = None  # type: ignore[assignment]  # the import system's "not importable"
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["torch"]


tensorboardX = import_without_torch("tensorboardX")
