"""Whose local shards are whose (issue 46 item 1): a run's identity, drawn
once per run directory; a local root shared by runs, each loading, listing
and retiring only its own shards; the recipe check and the lock for the
local tier as for the global one; a damaged copy passed over is reported
(item 16)."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from megaresil.checkpoint.local.replication import Topology, passed_over
from megaresil.checkpoint.local.runs import other_runs, run_local_dir
from megaresil.config import ConfigError, load_recipe, to_dict
from megaresil.run_identity import read_run_id, run_id
from tests.harness.dist import RECIPE, TINY
from tests.harness.fake_clock import FakeClock
from tests.unit.test_checkpoint_local_tier import (LAYOUT, RUN_ID, FakeState, flip_byte,
                                                   run_steps, shard, single_tier)

ONE = {**LAYOUT, "dp": 1, "world_size": 1}  # the layout of single_tier's one rank
OTHER_ID = "fedcba9876543210"


# --- the run's identity ----------------------------------------------------------------

def test_a_run_id_is_drawn_once_and_a_directory_made_again_is_another_run(tmp_path):
    run_dir = tmp_path / "run"
    assert read_run_id(run_dir) is None  # reading draws nothing
    first = run_id(run_dir)
    assert run_id(run_dir) == read_run_id(run_dir) == first
    assert [p.name for p in run_dir.iterdir()] == ["run_id"]  # the drawing file is gone
    shutil.rmtree(run_dir)
    assert run_id(run_dir) != first


def test_ranks_drawing_the_id_at_once_agree_on_one(tmp_path):
    drawn: list[str] = []
    threads = [threading.Thread(target=lambda: drawn.append(run_id(tmp_path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(drawn) == 8 and len(set(drawn)) == 1


@pytest.mark.parametrize("plant", ["garbage", "directory", "link"])
def test_a_run_id_file_that_holds_no_id_is_refused_naming_it_and_the_fix(tmp_path, plant):
    path = tmp_path / "run_id"
    if plant == "garbage":
        path.write_text("../../etc\n")
    elif plant == "directory":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=f"run.dir: {path} .*Fix: put back the file"):
        run_id(tmp_path)


# --- runs sharing a local root ------------------------------------------------------------

def test_a_run_never_loads_lists_or_removes_another_runs_shards(tmp_path, monkeypatch):
    """Issue 46 item 1 (c): two runs whose recipes share checkpoint.local.dir."""
    clock = FakeClock()
    first, _ = single_tier(tmp_path, monkeypatch, run_id=RUN_ID)
    run_steps(first, FakeState(), clock, [1, 2])
    first.close()
    second, _ = single_tier(tmp_path, monkeypatch, run_id=OTHER_ID)
    assert second.find(ONE).step is None  # the first run's steps are not this run's
    assert second.store.held() == {}
    run_steps(second, FakeState(), clock, [1, 2, 3])  # saves and retires its own only
    assert second.store.held() == {2: [0], 3: [0]}
    assert other_runs(tmp_path, OTHER_ID) == [run_local_dir(tmp_path, RUN_ID)]
    second.remove_all()  # it finished with a global checkpoint
    second.close()
    assert not run_local_dir(tmp_path, OTHER_ID).exists()
    again, _ = single_tier(tmp_path, monkeypatch, run_id=RUN_ID)
    assert again.store.held() == {1: [0], 2: [0]} and again.find(ONE).step == 2
    again.close()


def test_a_shard_of_another_run_in_this_runs_directory_is_passed_over_and_reported(
        tmp_path, monkeypatch):
    tier, events = single_tier(tmp_path, monkeypatch, run_id=OTHER_ID)
    tier.store.write(shard(4, 0, layout=ONE))  # RUN_ID's shard, moved here by hand
    assert tier.find(ONE).step is None
    (skipped,) = [e for e in events.events if e["event"] == "checkpoint_skipped"]
    assert skipped["tier"] == "local" and (skipped["step"], skipped["owner"]) == (4, 0)
    assert f"saved by another run (run id {RUN_ID}" in skipped["reason"]
    tier.close()


# --- a damaged copy passed over says so (item 16) ------------------------------------------

def test_a_damaged_newest_step_is_reported_and_the_step_before_serves(tmp_path, monkeypatch):
    from megaresil.resilience.incidents import describe

    tier, events = single_tier(tmp_path, monkeypatch)
    run_steps(tier, FakeState(), FakeClock(), [1, 2])
    flip_byte(tier.store.shard_dir(2, 0) / "data.bin", at=3)
    assert tier.find(ONE).step == 1
    (skipped,) = [e for e in events.events if e["event"] == "checkpoint_skipped"]
    assert skipped == {"event": "checkpoint_skipped", "path": str(tier.store.shard_dir(2, 0)),
                       "reason": skipped["reason"], "tier": "local", "step": 2, "owner": 0}
    assert "checksum mismatch" in skipped["reason"]
    assert describe(skipped).startswith(f"megaresil: skipped local shard {skipped['path']}: ")
    tier.close()


def test_each_damaged_copy_of_the_steps_looked_at_is_reported_once_per_node():
    topology = Topology(world=4, ranks_per_node=2, replicas=1)  # node 0: ranks 0, 1
    bad = "checksum mismatch in model/w"
    node0 = {5: {0: None, 1: None, 2: bad}, 6: {0: "its save did not finish (no marker)"},
             4: {0: bad}}  # both of node 0's ranks report what it holds
    node1 = {5: {2: None, 3: None, 0: None, 1: None},
             6: {2: "saved at another layout (tp1xpp1xdp4, now tp1xpp1xdp2)"}}
    reports = [node0, node0, node1, node1]
    assert passed_over(reports, 5, topology) == [
        (0, 5, 2, bad),  # rank 2's replica on node 0, passed over for its own copy
        (0, 6, 0, "its save did not finish (no marker)")]  # step 4: older, not looked at
    assert (0, 4, 0, bad) in passed_over(reports, None, topology)  # none chosen: all looked at


# --- the recipe check and the lock, as for the global tier ----------------------------------

def test_a_resume_from_the_local_tier_is_refused_when_the_recipe_differs(tmp_path):
    """Issue 46 item 1 (b), by the check the global tier uses."""
    from megaresil.checkpoint.local.store import NodeStore
    from megaresil.checkpoint.recipe_check import check_resume_recipe

    on = TINY + [f"run.dir={tmp_path / 'run'}", f"checkpoint.local.dir={tmp_path / 'shm'}",
                 "checkpoint.local.enabled=true"]
    saved = load_recipe(RECIPE, on)
    held = shard(2, 0)
    held.meta.update(run_id=run_id(tmp_path / "run"))
    held.meta["run"]["recipe"] = to_dict(saved)
    NodeStore(run_local_dir(tmp_path / "shm", held.meta["run_id"]) / "node_0").write(held)
    check_resume_recipe(saved)  # the same recipe resumes
    changed = load_recipe(RECIPE, on + ["optimizer.lr=0.5", "train.seed=7"])
    with pytest.raises(ConfigError, match=r"resuming from local step 2 \(.*run-.*\) would train "
                       r"a different run:\n  optimizer.lr: .*\n  train.seed: .*\nFix: use a new "
                       r"run.dir, or allow it: checkpoint.allow_recipe_change=\[optimizer.lr,"
                       r"train.seed\]"):
        check_resume_recipe(changed)
    check_resume_recipe(load_recipe(RECIPE, on + ["optimizer.lr=0.5", "train.seed=7",
                                                  "checkpoint.load=none"]))  # tier not read
    shutil.rmtree(tmp_path / "run")  # another run at the same path: not its shards
    check_resume_recipe(changed)


def test_the_local_root_is_held_by_one_job_at_a_time(tmp_path):
    from megaresil.run_lock import RunDirInUse, locks_of_run

    shm = tmp_path / "shm"
    with locks_of_run(tmp_path / "a", tmp_path / "a" / "checkpoints", "job-a", shm):
        with pytest.raises(RunDirInUse, match=f"checkpoint.local.dir: {shm} is in use by job "
                           "job-a .*choose another checkpoint.local.dir"):
            with locks_of_run(tmp_path / "b", tmp_path / "b" / "checkpoints", "job-b", shm):
                pass
    with locks_of_run(tmp_path / "b", tmp_path / "b" / "checkpoints", "job-b", shm):
        pass  # released with the job


def test_links_planted_in_the_run_s_local_directory_are_refused_before_workers_start(tmp_path):
    from megaresil.launch.checks import check_links

    cfg = load_recipe(RECIPE, TINY + [f"run.dir={tmp_path / 'run'}",
                                      "checkpoint.local.enabled=true",
                                      f"checkpoint.local.dir={tmp_path / 'shm'}"])
    mine = run_local_dir(tmp_path / "shm", run_id(tmp_path / "run"))
    mine.mkdir(parents=True)
    (mine / "node_0").symlink_to(tmp_path)
    (tmp_path / "shm" / "run.lock").symlink_to(tmp_path / "passwd")
    with pytest.raises(ConfigError) as refused:
        check_links(cfg)
    assert f"{mine / 'node_0'} -> " in str(refused.value)
    assert f"{tmp_path / 'shm' / 'run.lock'} -> " in str(refused.value)
    (tmp_path / "run" / "run_id").unlink()
    (tmp_path / "run" / "run_id").symlink_to(tmp_path / "passwd")
    with pytest.raises(ConfigError, match="run_id -> "):
        check_links(cfg)
