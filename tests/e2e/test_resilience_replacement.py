"""Live replacement's fallbacks, through `megaresil train` (the scenarios
kill-rank-replace and kill-during-replacement are in test_resilience.py):
where no live peer holds a lost rank's state the replacement still joins,
and the job resumes from the checkpoints, saying why; with the replacement
budget spent, the launcher relaunches every worker as without it."""
from __future__ import annotations

import json

import pytest

from megaresil.events import read_events, read_metrics
from tests.harness.cli import SMALL

KILL = json.dumps([{"kind": "kill", "rank": 1, "step": 5}])


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.slow
def test_unreplicated_optimizer_state_comes_from_the_checkpoint_and_says_why(cli, tmp_path):
    """optimizer.distributed keeps each rank's optimizer shard in its own
    memory: the new process (no standby here) joins, and every rank loads
    step 3's checkpoint; the survivor keeps its process all the same."""
    cli("train", *SMALL, f"run.dir={tmp_path}", "logging.progress=false",
        "optimizer.distributed=true", "checkpoint.interval=3",
        "resilience.replacement.enabled=true", "resilience.replacement.standby=false",
        f"faults={KILL}")
    events = read_events(tmp_path)
    restarts = [e for e in events if e["event"] == "restart"]
    assert [(e["kind"], e["standby"]) for e in restarts] == [("replace", False)], restarts
    loads = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [(e["tier"], e["step"]) for e in loads] == [("global", 3)], loads
    assert "optimizer.distributed" in loads[0]["skipped"]["live"]
    assert [s for s, _ in losses(tmp_path)] == [1, 2, 3, 4, 4, 5, 6, 7, 8]
    started = {e["process_started"] for e in events if e["event"] == "generation_started"}
    assert len(started) == 1, started


@pytest.mark.slow
def test_with_the_budget_spent_a_lost_process_relaunches_the_workers(cli, chaos_reference,
                                                                     tmp_path):
    cli("train", *SMALL, f"run.dir={tmp_path}", "logging.progress=false",
        "checkpoint.interval=2", "resilience.replacement.enabled=true",
        "resilience.replacement.max_replacements=0", f"faults={KILL}")
    restarts = [e["kind"] for e in read_events(tmp_path) if e["event"] == "restart"]
    assert restarts == ["relaunch"]
    assert losses(tmp_path)[-1] == losses(chaos_reference)[-1]
