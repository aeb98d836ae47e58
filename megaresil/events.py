"""The run directory's JSON-lines records: `events.jsonl` (one object per
resilience/lifecycle event, written here) and `metrics.jsonl` (read here;
the training loop writes it)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional


class EventLog:
    """Appends events from any rank. Each line is written with one O_APPEND
    write, so lines from concurrent ranks never interleave."""

    def __init__(self, run_dir: str | Path, rank: Optional[int] = None):
        self.path = Path(run_dir) / "events.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"time": time.time(), "event": event}
        if self.rank is not None:
            record["rank"] = self.rank
        record.update(fields)
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_events(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "events.jsonl"
    return read_jsonl(path) if path.exists() else []


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []
