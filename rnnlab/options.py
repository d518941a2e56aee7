"""What values a config key takes, declared once beside its dataclass field (`allowed`), so that the
checks (`rnnlab.config.validate`, a cell's `option_problem`, a task's `check`) and the config fuzzer
(tests/test_fuzz_config.py, which draws each key's boundary values from it) read the same bounds.

A declaration holds what one key decides: a range with open or closed ends, a list of choices,
whether null is allowed, and a width of its owner it must divide (`divides`: a cell's heads). Other
checks across keys stay code beside the class; where one has a boundary the fuzzer can draw (at
least the task's minimum length), the declaration names it (`at_least`) for the fuzzer alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

METADATA_KEY = "allowed"  # where `allowed` puts the declaration in a field's metadata

Choices = tuple[str, ...] | Callable[[], tuple[str, ...]]  # a registry's names are read when checked


@dataclasses.dataclass(frozen=True)
class Allowed:
    """The values one key takes; `problem` gives the one-line refusal of any other value."""

    low: float | None = None  # smallest value, or the open end (`low_open`) it must exceed
    high: float | None = None  # largest value, or the open end (`high_open`) it must stay below
    low_open: bool = False
    high_open: bool = False
    null: bool = False  # null is allowed (the field's type is Optional)
    choices: Choices | None = None
    note: str = ""  # what a value means, shown in parentheses after the range (e.g. "0 = off")
    divides: str | None = None  # the owner's attribute (a cell's hidden_dim) this value must be >= 1 and divide
    # a boundary checked by the owner's code and drawn by the fuzzer: the owner's attribute (a task's
    # min_seq_len) this value must reach
    at_least: str | None = None

    def allowed_choices(self) -> tuple[str, ...] | None:
        """The choices as a tuple (a callable's names read now), or None for a key without choices."""
        return self.choices() if callable(self.choices) else self.choices

    def problem(self, key: str, value: Any, owner: Any = None) -> str | None:
        """The one line refusing `value` for `key` ("key 'k': got v, ..."), or None if it is allowed;
        `owner` (the cell or task holding the field) gives the width a `divides` key must divide."""
        if value is None:
            return None  # the field's type decided whether null may reach here (rnnlab.config's coercion)
        choices = self.allowed_choices()
        if choices is not None:
            return None if value in choices else f"key '{key}': got {value!r}, allowed: {', '.join(choices)}"
        if self.divides and owner is not None:
            width = getattr(owner, self.divides)
            if value < 1 or width % value:
                note = f" ({self.note})" if self.note else ""
                return f"key '{key}': got {value!r}, must be >= 1 and divide {self.divides}={width}{note}"
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        return f"key '{key}': got {value!r}, {self.describe()}" if too_low or too_high else None

    def describe(self) -> str:
        """The range in words: "must be > 0", "must be in [0, 1)", or for closed integer ends "allowed: 1 .. 8"."""
        note = f" ({self.note})" if self.note else ""
        if self.low is None or self.high is None:
            if self.low is not None:
                return f"must be {'>' if self.low_open else '>='} {_shown(self.low)}{note}"
            return f"must be {'<' if self.high_open else '<='} {_shown(self.high)}{note}"
        if isinstance(self.low, int) and isinstance(self.high, int) and not (self.low_open or self.high_open):
            return f"allowed: {'null or ' if self.null else ''}{self.low} .. {self.high}{note}"
        return (f"must be in {'(' if self.low_open else '['}{_shown(self.low)}, {_shown(self.high)}"
                f"{')' if self.high_open else ']'}{note}")


def _shown(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def allowed(default: Any = dataclasses.MISSING, **declaration: Any) -> Any:
    """A dataclass field (with `default`, if given) carrying `Allowed(**declaration)` in its metadata."""
    return dataclasses.field(default=default, metadata={METADATA_KEY: Allowed(**declaration)})


def declaration(field: dataclasses.Field) -> Allowed | None:
    """The field's `Allowed`, or None for a field declared without one."""
    return field.metadata.get(METADATA_KEY)


def declared_problem(instance: Any, prefix: str) -> str | None:
    """The first refusal among the declared fields of a dataclass instance, in field order, each named
    `prefix + field name` (e.g. "model.window"); None if every declared value is allowed."""
    for field in dataclasses.fields(instance):
        rule = declaration(field)
        problem = rule and rule.problem(prefix + field.name, getattr(instance, field.name), instance)
        if problem:
            return problem
    return None
