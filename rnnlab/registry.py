"""A registry of classes by name: cells and tasks each keep one (`rnnlab.cells.CELLS`, `rnnlab.tasks.TASKS`)."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(dict, Generic[T]):
    """name -> class, filled by the `register` class decorator from each class's `name`."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind  # "cell" or "task", for messages

    def register(self, cls: T) -> T:
        """Class decorator: make `cls` available under `cls.name`."""
        if not getattr(cls, "name", None):
            raise ValueError(f"{cls.__name__} needs a `name`")
        if cls.name in self and self[cls.name] is not cls:
            raise ValueError(f"{self.kind} {cls.name!r} is registered already ({self[cls.name].__qualname__})")
        self[cls.name] = cls
        return cls

    def get_class(self, name: str) -> T:
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r} (registered: {', '.join(self)})")
        return self[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self)
