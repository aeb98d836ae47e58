"""The schema's vocabulary: the recipe error, the bounds a number admits, and
the documented field every schema section is built from."""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from megaresil.errors import MegaresilError

# Recipe keys that are Python keywords, and the dataclass fields behind them.
KEY_ALIASES = {"checkpoint.async": "checkpoint.async_"}
# Other spellings a recipe may write for a key (read as that key, never
# written back): the American spelling users of other frameworks reach for.
KEY_SPELLINGS = {"model.flavor": "model.flavour"}


def public_key(field_key: str) -> str:
    """The recipe's spelling of a dataclass field's dotted key."""
    return {v: k for k, v in KEY_ALIASES.items()}.get(field_key, field_key)


class ConfigError(MegaresilError, ValueError):
    """A recipe problem, always naming the key and how to fix it."""

    exit_status, fatal, reported_by_cli = 2, True, True

    def __init__(self, key: str, problem: str, fix: str = ""):
        self.key = key
        message = f"{key}: {problem}"
        if fix:  # a problem of several lines ends in one: its fix starts a line
            message += f"{'' if problem.endswith(chr(10)) else ' '}Fix: {fix}"
        super().__init__(message)


def require(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(key, problem, fix)


@dataclass(frozen=True)
class Bounds:
    """The values a numeric key admits: an interval, each end open or closed."""
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        low = f"{self.low:.12g}"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        opening, closing = "(["[not self.low_open], ")]"[not self.high_open]
        return f"in {opening}{low}, {self.high:.12g}{closing}"


POSITIVE = Bounds(0, low_open=True)
NON_NEGATIVE = Bounds(0)
FRACTION = Bounds(0, 1, high_open=True)  # probabilities, Adam betas, held-out shares
SEED = Bounds(0, 2**32, high_open=True)  # what numpy's seeding accepts


def doc(default: Any, text: str, bounds: Optional[Bounds] = None,
        recipe_type: Optional[str] = None, **kwargs: Any) -> Any:
    """A dataclass field with its documentation (and, for numbers, the
    values it admits, checked by `validate`) attached. `recipe_type`: the
    type `config docs` shows where a recipe writes the value differently
    from its Python type (a typed record is written as a YAML mapping)."""
    metadata = {"doc": text, "bounds": bounds, "recipe_type": recipe_type}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        # Each instance gets its own copy: a shared default would leak one
        # instance's edits into every other.
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


def section(cls: type, text: str) -> Any:
    return field(default_factory=cls, metadata={"doc": text})
