"""Live replacement's fallbacks, through `megaresil train` (the scenarios
kill-rank-replace, kill-during-replacement and corrupt-donor-replace are in
test_resilience.py): where no live peer holds a lost rank's state the
replacement still joins, and the job resumes from the checkpoints, saying
why; with the replacement budget spent, the launcher relaunches every worker
as without it; a save the lost process interrupted is made again at once."""
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


@pytest.mark.slow
def test_a_process_lost_in_a_restarts_setup_relaunches_at_once(cli, chaos_reference, tmp_path):
    """A raise restarts in place; rank 1 is killed in that generation's
    setup, where the other rank may wait for it in a process group's
    formation that no abort ends (seen in a soak: 142 s until the
    replacement's join timeout). The launcher relaunches instead of
    replacing it, and the run ends bit-equal."""
    faults = [{"kind": "raise", "rank": 0, "step": 3},
              {"kind": "kill", "rank": 1, "step": 0, "section": "setup", "generation": 1}]
    cli("train", *SMALL, f"run.dir={tmp_path}", "logging.progress=false",
        "checkpoint.interval=2", "resilience.in_process=true",
        "resilience.replacement.enabled=true", f"faults={json.dumps(faults)}")
    events = read_events(tmp_path)
    restarts = [e["kind"] for e in events if e["event"] == "restart"]
    assert restarts == ["in_process", "relaunch"], restarts
    killed = next(e["time"] for e in events if e["event"] == "fault_injected"
                  and e["kind"] == "kill")
    relaunched = next(e for e in events if e["event"] == "generation_started"
                      and e["time"] > killed)
    # The launcher's relaunch, not a join timeout (120 s): seconds on this machine.
    assert relaunched["time"] - killed < 60
    assert losses(tmp_path)[-1] == losses(chaos_reference)[-1]


@pytest.mark.slow
def test_sharded_optimizer_state_comes_from_the_local_tier_at_the_current_step(cli,
                                                                               tmp_path):
    """Under optimizer.distributed no live peer holds a lost rank's
    optimizer shard; with the local tier saving every step, the shard its
    process committed before it died (or the replica a peer node holds)
    is at the newest step: the job loads it, no completed step lost, and the
    survivor keeps its process."""
    cli("train", *SMALL, f"run.dir={tmp_path}", "logging.progress=false",
        "optimizer.distributed=true", "checkpoint.interval=3",
        "checkpoint.local.enabled=true", "checkpoint.local.interval=1",
        "checkpoint.local.replicas=1", "checkpoint.local.ranks_per_node=1",
        "resilience.replacement.enabled=true", f"faults={KILL}")
    events = read_events(tmp_path)
    restarts = [e["kind"] for e in events if e["event"] == "restart"]
    assert restarts == ["replace"], restarts
    loads = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [(e["tier"], e["step"]) for e in loads] == [("local", 4)], loads
    assert "optimizer.distributed" in loads[0]["skipped"]["live"]
    assert [s for s, _ in losses(tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8]
    started = {e["process_started"] for e in events if e["event"] == "generation_started"}
    assert len(started) == 1, started


def saved_steps(run_dir) -> list[int]:
    return [e["step"] for e in read_events(run_dir) if e["event"] == "checkpoint_saved"]


@pytest.mark.slow
def test_a_save_a_lost_process_interrupted_is_made_again_at_once(cli, chaos_reference,
                                                                tmp_path):
    """Rank 1 killed as it saves step 3 (checkpoint.interval=3): the job goes
    on from step 3 in the ranks' memory and saves it before training on, so
    the checkpoints go 3 -> 6, not 0 -> 6 (the issue's 5 -> 15: a second
    fault with no live holder would lose twice the interval)."""
    faults = [{"kind": "kill", "rank": 1, "step": 3, "section": "checkpoint"}]
    cli("train", *SMALL, f"run.dir={tmp_path}", "logging.progress=false",
        "checkpoint.interval=3", "resilience.replacement.enabled=true",
        f"faults={json.dumps(faults)}")
    loads = [(e["tier"], e["step"]) for e in read_events(tmp_path)
             if e["event"] == "checkpoint_loaded"]
    assert loads == [("live", 3)], loads
    assert saved_steps(tmp_path) == [3, 6, 8]
    assert losses(tmp_path) == losses(chaos_reference)  # every step once, bit for bit


@pytest.mark.slow
def test_an_exit_at_step_save_a_lost_process_interrupted_is_made_and_the_run_exits(cli,
                                                                                  tmp_path):
    """train.exit_at_step=4, rank 1 killed as it saves step 4: the job saves
    step 4 from the ranks' memory and exits 0 there, as without the fault
    (it used to train on to train.steps)."""
    faults = [{"kind": "kill", "rank": 1, "step": 4, "section": "checkpoint"}]
    cli("train", *SMALL, f"run.dir={tmp_path}", "logging.progress=false",
        "checkpoint.interval=3", "train.exit_at_step=4", "resilience.replacement.enabled=true",
        f"faults={json.dumps(faults)}")
    events = read_events(tmp_path)
    assert saved_steps(tmp_path) == [3, 4]
    assert [s for s, _ in losses(tmp_path)] == [1, 2, 3, 4]
    assert [e["step"] for e in events if e["event"] == "exited"] == [4]
