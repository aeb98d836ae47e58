"""What the commands that read a run after the fact (`megaresil report`,
`megaresil plan`) compute with in its records, and of what kind: a record
that parses as JSON but holds something else where a number or a name
belongs (edited by hand, written by another tool, corrupted) stops them with
one line naming the file, the line and the field (events.DamagedRecord, as
the launcher's check of the same files), instead of a TypeError deep inside
a plot or a formula. docs/observability.md lists the fields."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from megaresil.events import read_jsonl

METRICS, EVENTS, WINDOWS = "metrics.jsonl", "events.jsonl", "stragglers.jsonl"


@dataclass(frozen=True)
class Kind:
    """What a field may hold, said as a person reads it."""
    what: str
    admits: Callable[[Any], bool]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


NUMBER = Kind("a number", _number)  # a diverged loss is NaN or Infinity
FINITE = Kind("a finite number", lambda v: _number(v) and math.isfinite(v))
NON_NEGATIVE = Kind("a finite number >= 0", lambda v: FINITE.admits(v) and v >= 0)
POSITIVE = Kind("a finite number > 0", lambda v: FINITE.admits(v) and v > 0)
STEP = Kind("a whole number >= 1", lambda v: _whole(v) and v >= 1)
COUNT = Kind("a whole number >= 0", lambda v: _whole(v) and v >= 0)
COUNT_OR_NULL = Kind("a whole number >= 0 or null", lambda v: v is None or COUNT.admits(v))
TEXT = Kind("a string", lambda v: isinstance(v, str))
LIST = Kind("a list", lambda v: isinstance(v, list))
WINDOW = Kind("[first step, last step]",
              lambda v: isinstance(v, list) and len(v) == 2 and all(map(COUNT.admits, v)))


def one_of(*names: str) -> Kind:
    return Kind(f"one of {', '.join(names)}", lambda v: v in names)


def per_rank(inner: Kind) -> Kind:
    """A map from rank numbers (as JSON writes them: strings) to `inner`."""
    return Kind(f"a map of rank to {inner.what}",
                lambda v: isinstance(v, dict) and all(k.isdigit() and inner.admits(x)
                                                      for k, x in v.items()))


NUMBERS = Kind("a map of names to numbers",
               lambda v: isinstance(v, dict) and all(map(NUMBER.admits, v.values())))


@dataclass(frozen=True)
class Shape:
    """The fields one sort of record must hold, and those it may (at least
    one of `any_of` among them)."""
    required: dict[str, Kind]
    optional: dict[str, Kind] = field(default_factory=dict)
    any_of: tuple[str, ...] = ()

    def needing(self, *names: str) -> "Shape":
        """This shape for a reader that needs some of its optional fields."""
        return replace(self, required={**self.required, **{n: self.optional[n] for n in names}})

    def problem(self, record: dict) -> Optional[str]:
        for name, kind in self.required.items():
            if name not in record:
                return f"has no {name!r} ({kind.what})"
        if self.any_of and not any(name in record for name in self.any_of):
            return f"has none of {', '.join(map(repr, self.any_of))}"
        for name, kind in {**self.required, **self.optional}.items():
            if name in record and not kind.admits(record[name]):
                return f"has {name}={short(record[name])}, not {kind.what}"
        return None

    def unknown(self, record: dict) -> Optional[str]:
        """For a record no newer writer may add to: a field of no known name."""
        extra = sorted(set(record) - set(self.required) - set(self.optional))
        return f"has an unknown field {extra[0]!r}" if extra else None


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class MalformedRecord(ValueError):
    """A record of a file a person wrote (a failure trace) that holds
    another kind than its readers need."""

    def __init__(self, path: Path, number: int, problem: str):
        super().__init__(f"{path}: record {number} {problem}. Fix: correct or delete that "
                         "record (a line of the file)")


def checked(records: list, path: Path, shape_of: Callable[[dict], Optional[Shape]]) -> list[dict]:
    """`records` (read from `path`) when each is a JSON object of its shape
    (`shape_of`: None for a record read by nothing); MalformedRecord otherwise."""
    for number, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise MalformedRecord(path, number, f"is {short(record)}, not a JSON object")
        shape = shape_of(record)
        problem = shape.problem(record) if shape else None
        if problem:
            raise MalformedRecord(path, number, problem)
    return records


# --- metrics.jsonl ----------------------------------------------------------------------------

# A step's time is its own (step_time_s), or its share of the tokens over their rate.
STEP_RECORD = Shape({"step": STEP, "time": FINITE, "loss": NUMBER, "tokens_per_s": POSITIVE},
                    {"tokens": NON_NEGATIVE, "step_time_s": NON_NEGATIVE, "mfu": NUMBER,
                     "tflops": NUMBER, "mem_peak_mb": NUMBER,
                     "global_batch_size": POSITIVE}, any_of=("step_time_s", "tokens"))


def step_seconds(record: dict) -> float:
    """A step record's own compute time: its step_time_s, or for records
    without one its share of the tokens over their rate (tokens is
    cumulative, so this holds only at a constant batch; a batch ramp's
    records all have their own)."""
    if "step_time_s" in record:
        return record["step_time_s"]
    return record["tokens"] / record["tokens_per_s"] / max(record["step"], 1)


EVAL_RECORD = Shape({"step": COUNT, "eval_loss": NUMBER},
                    {"time": FINITE, "eval_time_s": NON_NEGATIVE})




# --- events.jsonl -----------------------------------------------------------------------------

EVENT = {"event": TEXT, "time": FINITE}
ANY_EVENT = {"step": COUNT_OR_NULL, "window": WINDOW}
SAVE = {"seconds": NON_NEGATIVE, "blocking_seconds": NON_NEGATIVE, "bytes": NON_NEGATIVE}
EVENT_SHAPES = {
    "generation_started": Shape({**EVENT, "launched_at": FINITE}, ANY_EVENT),
    "checkpoint_saved": Shape({**EVENT, **SAVE, "step": COUNT},
                              {**ANY_EVENT, "bytes_per_rank": LIST}),
    "local_checkpoint_saved": Shape({**EVENT, **SAVE}, {**ANY_EVENT, "bytes_per_rank": LIST}),
    "restart": Shape({**EVENT, "kind": one_of("in_process", "replace", "relaunch")}, ANY_EVENT),
}
OTHER_EVENT = Shape(EVENT, ANY_EVENT)


def events_shape(record: dict) -> Shape:
    name = record.get("event")
    return EVENT_SHAPES.get(name, OTHER_EVENT) if isinstance(name, str) else OTHER_EVENT


# --- stragglers.jsonl -------------------------------------------------------------------------

WINDOW_RECORD = Shape({"window": WINDOW, "ratios": per_rank(NUMBERS),
                       "scores": per_rank(NUMBER), "mem_peak_mb": per_rank(NUMBER)})


# --- reading them -----------------------------------------------------------------------------

def run_file(path: Path, shape_of: Callable[[dict], Optional[Shape]]) -> list[dict]:
    """The records of a run's JSON Lines file (none when it is absent), each
    of its shape (`shape_of`: None for a record read by nothing);
    events.DamagedRecord naming the line otherwise."""
    def problem(record: dict) -> Optional[str]:
        shape = shape_of(record)
        return shape.problem(record) if shape else None

    return read_jsonl(path, problem) if path.exists() else []


def metrics_of(run_dir: Path, steps: Shape = STEP_RECORD) -> list[dict]:
    """The run's metrics, its step records of the shape `steps`."""
    def shape_of(record: dict) -> Optional[Shape]:
        if "loss" in record:
            return steps
        return EVAL_RECORD if "eval_loss" in record else None

    return run_file(Path(run_dir) / METRICS, shape_of)


def events_of(run_dir: Path) -> list[dict]:
    return run_file(Path(run_dir) / EVENTS, events_shape)


def windows_of(run_dir: Path) -> list[dict]:
    """The straggler windows (none when the run wrote none)."""
    return run_file(Path(run_dir) / WINDOWS, lambda _: WINDOW_RECORD)
