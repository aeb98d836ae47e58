"""A rank killed right after a local save loses only the step in flight: its
own shard of the saved step was committed before the save call returned, so
the relaunch resumes from that step, bit-exact (issue 33: killed at step 7
with a save every step, a rank resumed from step 5, step 6's shard still
being written when the process died)."""
from __future__ import annotations

import json

import pytest

from megaresil.events import read_events
from tests.harness.cli import SMALL

KILLED_AT = 6  # as step 6 starts: the local save of step 5 was the last call before


@pytest.mark.slow
def test_a_rank_killed_as_the_next_step_starts_resumes_from_the_saved_step(
        cli_main, chaos_reference, tmp_path):
    cli_main("chaos", *SMALL, f"run.dir={tmp_path}", "--scenario", "kill-rank-local",
             "--step", str(KILLED_AT), "--reference", str(chaos_reference), "--timeout", "240")
    report = json.loads((tmp_path / "chaos-kill-rank-local.json").read_text())
    assert report["recovered"] and report["final_loss_equal"], report
    events = read_events(report["faulted"])
    killed = [e for e in events if e["event"] == "fault_injected"]
    assert [(e["step"], e["section"]) for e in killed] == [(KILLED_AT, "data")], killed
    loads = [(e["tier"], e["step"]) for e in events if e["event"] == "checkpoint_loaded"]
    assert loads == [("local", KILLED_AT - 1)], loads
