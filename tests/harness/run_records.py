"""A run directory's records written as training writes them, for tests of
what reads them (plan, report); and what every goodput of them must hold."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaresil.observe.goodput import BUCKETS


def write_run_records(run_dir: Path, records: list[dict], events: list[dict],
                      checkpoints: str = "checkpoints/") -> None:
    """metrics.jsonl from `records` and events.jsonl from `events`, with a
    save after every second step (its path under `checkpoints`)."""
    events = events + [{"time": r["time"] + 0.01, "event": "checkpoint_saved", "rank": 0,
                        "step": r["step"], "path": f"{checkpoints}step_{r['step']:07d}",
                        "bytes": 4_000_000, "seconds": 0.4, "blocking_seconds": 0.2}
                       for r in records if r["step"] % 2 == 0]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def assert_goodput_adds_up(figures: dict) -> None:
    """Every second of the wall time in one bucket, and no bucket negative."""
    spent = {bucket: figures[f"{bucket}_s"] for bucket in BUCKETS}
    assert all(seconds >= 0 for seconds in spent.values()), spent
    assert sum(spent.values()) == pytest.approx(figures["wall_s"]), (spent, figures["wall_s"])
