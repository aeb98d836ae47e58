"""Failure profiles: counts of failures by kind observed on a fleet, turned
into a job's Poisson rates at another size."""
from __future__ import annotations

from pathlib import Path

import yaml

from megaresil.plan.simulate import Kind

DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "llama3_405b.yaml"


def load_profile(path: str | Path = DEFAULT_PROFILE) -> dict:
    profile = yaml.safe_load(Path(path).read_text())
    for key in ("observed", "kinds"):
        if key not in profile:
            raise ValueError(f"failure profile {path} has no '{key}': see {DEFAULT_PROFILE}")
    return profile


def job_kinds(profile: dict, gpus: int) -> list[Kind]:
    """Each kind's rate for a job on `gpus` GPUs (per second)."""
    seen = profile["observed"]
    seconds = seen["days"] * 86400
    scale = {"gpu": gpus / seen["gpus"], "node": gpus / seen["gpus"], "job": 1.0}
    return [Kind(k["name"], k["count"] / seconds * scale[k["basis"]], k["path"])
            for k in profile["kinds"]]


def mtbf_hours(kinds: list[Kind]) -> float:
    return 1 / sum(k.per_s for k in kinds) / 3600
