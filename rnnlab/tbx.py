"""tensorboardX, imported without torch and boto3: where they are installed (torch by the bench and refs extras,
boto3 by other tools), tensorboardX's writer imports torch only to recognise torch tensors and boto3 only for
s3:// log dirs, neither of which the lab hands it, and those imports are a large part of a run's start-up.
Import this module before `tensorboardX` (rnnlab.board and rnnlab.metrics do)."""

from __future__ import annotations

import importlib
import sys

# Modules tensorboardX imports where installed and the lab never needs from it.
UNUSED_BY_THE_LAB = ("torch", "boto3")


def import_without(name: str, unused: tuple[str, ...] = UNUSED_BY_THE_LAB):
    """`importlib.import_module(name)` with `import <each of unused>` failing meanwhile (tensorboardX catches the
    ImportError); each stays importable afterwards. One already imported is left as it is."""
    blocked = [module for module in unused if module not in sys.modules]
    for module in blocked:
        sys.modules[module] = None  # type: ignore[assignment]  # the import system's "not importable"
    try:
        return importlib.import_module(name)
    finally:
        for module in blocked:
            del sys.modules[module]


tensorboardX = import_without("tensorboardX")
