"""A run directory's records written as training writes them, for tests of
what reads them (plan, report)."""
from __future__ import annotations

import json
from pathlib import Path


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
