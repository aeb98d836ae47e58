"""The control plane's share of a recovery at scale, as the simulator measured
it (bench/control_plane.py): from a silent rank's loss to every rank aborted,
and from the replacement's entry to the new generation agreed; the plan adds
their growth over the smallest simulated size to a run's downtimes. The packaged
figures (profiles/control_plane.yaml) are copied from the bench's results;
`--control-plane FILE` takes the bench's JSON or that YAML. Between measured
world sizes a figure is linear in log2(world); outside them it is the nearest
row's, and the plan says it is extrapolated. bench/control_plane_profile.py
refreshes the packaged copy."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from megaresil.run_records import NON_NEGATIVE, STEP, Kind

DEFAULT_CONTROL_PLANE = Path(__file__).parent / "profiles" / "control_plane.yaml"
# The fields read of each row (dotted: nested in the bench's JSON), and what
# each holds; every other field of a row is the bench's own and is ignored.
FIELDS: dict[str, tuple[str, Kind]] = {
    "world": ("world", STEP),
    "detected_s": ("fault.detected_s", NON_NEGATIVE),
    "all_aborted_s": ("fault.all_aborted_s", NON_NEGATIVE),
    "agreed_s": ("replacement.after_join_s", NON_NEGATIVE),
}
FIX = ("give the JSON bench/control_plane.py writes (a list of rows, each with "
       + ", ".join(dotted for dotted, _ in FIELDS.values()) + f"), or a YAML as {DEFAULT_CONTROL_PLANE.name}")


@dataclass(frozen=True)
class Row:
    world: int
    detected_s: float  # a silent rank's loss to its detection
    all_aborted_s: float  # ... to every rank aborted
    agreed_s: float  # the replacement's entry to the new generation agreed


@dataclass(frozen=True)
class Figure:
    value: float
    measured_at: tuple[int, ...]  # the worlds of the rows it comes from
    extrapolated: bool  # outside the measured worlds: the nearest row's


def dotted(row: dict, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(row, dict) or part not in row:
            return None
        row = row[part]
    return row


def parse_row(row: Any, where: str) -> Row:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is not a mapping")
    values = {}
    for name, (path, kind) in FIELDS.items():
        value = dotted(row, path)
        if value is None:
            raise ValueError(f"{where} has no {path!r} ({kind.what})")
        if not kind.admits(value):
            raise ValueError(f"{where}'s {path!r} is not {kind.what} (got {value!r})")
        values[name] = value
    return Row(**values)


@dataclass(frozen=True)
class ControlPlane:
    source: str  # the file read, and where its figures came from
    rows: tuple[Row, ...]  # by world, at least one

    def at(self, world: int, name: str) -> Figure:
        """Figure `name` (a Row field) at `world` ranks."""
        worlds = [r.world for r in self.rows]
        values = [getattr(r, name) for r in self.rows]
        if world <= worlds[0] or world >= worlds[-1]:
            nearest = 0 if world <= worlds[0] else -1
            return Figure(values[nearest], (worlds[nearest],), world != worlds[nearest])
        high = bisect.bisect_left(worlds, world)
        if worlds[high] == world:
            return Figure(values[high], (world,), False)
        low = high - 1
        share = ((math.log2(world) - math.log2(worlds[low]))
                 / (math.log2(worlds[high]) - math.log2(worlds[low])))
        return Figure(values[low] + share * (values[high] - values[low]),
                      (worlds[low], worlds[high]), False)

    def path_s(self, world: int) -> dict[str, float]:
        """Seconds of each recovery path spent in the control plane at `world`
        ranks. The lost rank is taken as silent (a lost node, a hang): the
        heartbeats find it, then every rank aborts. An in-process restart's
        failing rank knows at once: the abort's spread alone; a replacement
        also waits for the new generation's agreement."""
        aborted = self.at(world, "all_aborted_s").value
        spread = max(0.0, aborted - self.at(world, "detected_s").value)
        return {"in_process": spread, "relaunch": aborted,
                "replace": aborted + self.at(world, "agreed_s").value}

    def added_s(self, world: int) -> dict[str, float]:
        """What the control plane adds to a run's measured downtimes at `world`
        ranks: its growth over the smallest simulated size, which the run's
        own downtime stands for (a run is measured on a few ranks, its own
        detection inside its downtime; below that size nothing is added)."""
        base = self.path_s(self.rows[0].world)
        return {p: max(0.0, s - base[p]) for p, s in self.path_s(world).items()}

    def describe(self, world: int) -> dict:
        figures = {name: self.at(world, name) for name in ("detected_s", "all_aborted_s",
                                                           "agreed_s")}
        return {"gpus": world, "source": self.source,
                **{name: f.value for name, f in figures.items()},
                "measured_at": list(figures["detected_s"].measured_at),
                "extrapolated": figures["detected_s"].extrapolated,
                "base_world": self.rows[0].world, "added_s": self.added_s(world)}


def load_control_plane(path: Optional[str | Path] = None) -> ControlPlane:
    """The figures of `path` (default: the packaged copy); ValueError in one
    line naming the file and the fix where it is not such a file."""
    path = Path(path) if path else DEFAULT_CONTROL_PLANE
    shown = (f"packaged plan/profiles/{path.name}" if path == DEFAULT_CONTROL_PLANE
             else str(path))
    try:
        data = yaml.safe_load(path.read_text())  # JSON is YAML
        rows, source = (data, shown) if isinstance(data, list) else (
            data.get("rows"), f"{shown}, copied from {data.get('source', 'an unnamed source')}")
        if not isinstance(rows, list) or not rows:
            raise ValueError("holds no rows")
        parsed = sorted((parse_row(r, f"row {i}") for i, r in enumerate(rows)),
                        key=lambda r: r.world)
        worlds = [r.world for r in parsed]
        if len(set(worlds)) != len(worlds):
            raise ValueError(f"has two rows of one world ({worlds})")
    except yaml.YAMLError as err:
        problem = str(err).splitlines()[0]
        raise ValueError(f"control-plane figures {path}: is neither JSON nor YAML ({problem}). "
                         f"Fix: {FIX}") from None
    except (OSError, AttributeError, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"control-plane figures {path}: {reason}. Fix: {FIX}") from None
    return ControlPlane(source, tuple(parsed))


def format_control_plane(described: list[dict]) -> list[str]:
    """The plan's lines on where its control-plane figures came from."""
    lines = []
    for d in described:
        worlds = " and ".join(f"{w:,}" for w in d["measured_at"])
        how = ("extrapolated: the nearest row's" if d["extrapolated"]
               else "measured" if len(d["measured_at"]) == 1 else "interpolated")
        added = ", ".join(f"{p} +{s:.1f} s" for p, s in d["added_s"].items())
        lines.append(f"control plane at {d['gpus']:,} GPUs ({how}, simulated at {worlds} "
                     f"ranks; {d['source']}): a silent rank detected {d['detected_s']:.1f} s, "
                     f"every rank aborted {d['all_aborted_s']:.1f} s, a new generation agreed "
                     f"{d['agreed_s']:.2f} s after the replacement entered; downtime over the "
                     f"run's (its control plane's taken as at {d['base_world']:,} ranks): "
                     f"{added}")
    return lines


def packaged(rows: list[dict], source: str) -> dict:
    """The packaged file's content from the bench's rows: only the fields read."""
    keep = [parse_row(r, f"row {i}") for i, r in enumerate(rows)]
    return {"source": source,
            "rows": [{"world": r.world,
                      "fault": {"detected_s": round(r.detected_s, 4),
                                "all_aborted_s": round(r.all_aborted_s, 4)},
                      "replacement": {"after_join_s": round(r.agreed_s, 4)}} for r in keep]}
