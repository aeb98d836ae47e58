"""Failure profiles: counts of failures by kind observed on a fleet, turned
into a job's Poisson rates at another size."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import yaml

from megaresil.plan.simulate import Kind

DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "llama3_405b.yaml"
# What a failure took out, for a profile kind or trace line that does not say:
# its recovery path implies it (an in-process restart: a worker's error).
SCOPE_OF_PATH = {"in_process": "process", "relaunch": "job", "node_replacement": "node"}


def load_profile(path: str | Path = DEFAULT_PROFILE) -> dict:
    profile = yaml.safe_load(Path(path).read_text())
    for key in ("observed", "kinds"):
        if key not in profile:
            raise ValueError(f"failure profile {path} has no '{key}': see {DEFAULT_PROFILE}")
    return profile


def scope_of(entry: dict) -> str:
    """A profile kind's or trace line's scope: process, node or job."""
    return entry.get("scope") or SCOPE_OF_PATH.get(entry["path"], "job")


def job_kinds(profile: dict, gpus: int) -> list[Kind]:
    """Each kind's rate for a job on `gpus` GPUs (per second)."""
    seen = profile["observed"]
    seconds = seen["days"] * 86400
    scale = {"gpu": gpus / seen["gpus"], "node": gpus / seen["gpus"], "job": 1.0}
    return [Kind(k["name"], k["count"] / seconds * scale[k["basis"]], k["path"], scope_of(k))
            for k in profile["kinds"]]


def failure_kinds(profile: dict, gpus: int, mtbf_hours: Optional[float] = None) -> list[Kind]:
    """The profile's kinds at `gpus` GPUs; with `mtbf_hours`, the profile's
    mix of kinds at that mean time between failures per GPU."""
    kinds = job_kinds(profile, gpus)
    if not mtbf_hours:
        return kinds
    factor = gpus / (mtbf_hours * 3600) / sum(k.per_s for k in kinds)
    return [replace(k, per_s=k.per_s * factor) for k in kinds]


def mtbf_hours(kinds: list[Kind]) -> float:
    return 1 / sum(k.per_s for k in kinds) / 3600
