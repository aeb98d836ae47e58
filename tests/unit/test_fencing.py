"""Fencing: once the job forms again without a rank (the run directory's
fence names another formation), that rank commits no checkpoint, moves no
`latest` and appends no metrics row; it records `fenced` once."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.offline.planning import recipe_layout
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.state import RunRecord
from megaresil.config import RecipeConfig, to_dict
from megaresil.events import EventLog, read_events
import megaresil.checkpoint.manager as manager
from megaresil.fencing import (FENCE_NAME, Fence, FenceDamaged, Fenced, fence_of, read_fence,
                               set_fence)
from megaresil.train.metrics import MetricsLog, StepFigures


def save(ckpt: Checkpointer, step: int) -> None:
    cfg = RecipeConfig()
    state = RunRecord(step=step, layout=recipe_layout(cfg), recipe=to_dict(cfg),
                      consumed_samples=0, optimizer_steps=step)
    ckpt.save([Rect("w", (1000,), (0,), torch.full((1000,), float(step)))], state, {})
    ckpt.wait()


def fenced_events(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "fenced"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_save_of_a_generation_the_job_left_behind_is_never_committed(tmp_path, asynchronous):
    run_dir, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    events = EventLog(run_dir, 0)
    ckpt = Checkpointer(root, "torch_dist", group=None, asynchronous=asynchronous, keep=3,
                        events=events, device=torch.device("cpu"),
                        fence=Fence(run_dir, 2, "ours", events))
    try:
        set_fence(run_dir, 2, "ours")
        save(ckpt, 1)
        set_fence(run_dir, 3, "theirs")  # the job formed again without this rank
        for step in (2, 3):
            with pytest.raises(Fenced, match="generation 3 without this rank"):
                save(ckpt, step)
    finally:
        ckpt.close()
    assert sorted(p.name for p in root.iterdir()) == [fmt.LATEST, fmt.step_dir_name(1)]
    assert (root / fmt.LATEST).read_text().strip() == fmt.step_dir_name(1)
    [fenced] = fenced_events(run_dir)  # once, however many writes it gave up
    assert fenced["rank"] == 0 and fenced["generation"] == 2
    assert fenced["current_generation"] == 3
    assert fenced["refused"] == f"the commit of {fmt.step_dir_name(2)}"


def test_a_save_in_the_current_generation_commits_in_its_own_partial_directory(
        tmp_path, monkeypatch):
    run_dir, root = tmp_path, tmp_path / "checkpoints"
    set_fence(run_dir, 4, "ours")
    seen = []

    def commit(partial, final, *args, **kwargs):
        seen.append(partial.name)
        return original(partial, final, *args, **kwargs)

    original = manager.commit
    monkeypatch.setattr(manager, "commit", commit)
    ckpt = Checkpointer(root, "torch_dist", group=None, asynchronous=False, keep=3,
                        events=EventLog(run_dir, 0), device=torch.device("cpu"),
                        fence=Fence(run_dir, 4, "ours", EventLog(run_dir, 0)))
    save(ckpt, 1)
    ckpt.close()
    assert seen == [f"{fmt.step_dir_name(1)}.partial-4-ours"]
    assert (root / fmt.LATEST).read_text().strip() == fmt.step_dir_name(1)
    assert fenced_events(run_dir) == []


def test_metrics_rows_stop_at_the_fence(tmp_path):
    cfg = RecipeConfig()
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, tensorboard=False,
                                                               progress=False))
    events = EventLog(tmp_path, 0)
    log = MetricsLog(tmp_path, cfg, StepFigures.for_recipe(cfg, torch.device("cpu")),
                     start_step=0, generation=1, fence=Fence(tmp_path, 1, "ours", events))
    try:
        set_fence(tmp_path, 1, "ours")
        log.write({"step": 1, "loss": 2.0})
        set_fence(tmp_path, 2, "theirs")
        with pytest.raises(Fenced):
            log.write({"step": 2, "loss": 1.9})
    finally:
        log.close()
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and '"step": 1' in rows[0]
    assert fenced_events(tmp_path)[0]["refused"] == "the metrics row of step 2"


def test_two_formations_with_one_number_fence_each_other_out(tmp_path):
    # Two parts of a job that formed apart, both as generation 3: the last to
    # form holds the run directory, the other writes nothing more.
    first, second = Fence(tmp_path, 3, "aaaa", None), Fence(tmp_path, 3, "bbbb", None)
    set_fence(tmp_path, 3, "aaaa")
    first.check("a write")
    set_fence(tmp_path, 3, "bbbb")
    second.check("a write")
    with pytest.raises(Fenced):
        first.check("a write")


def test_the_fence_never_goes_back_and_a_damaged_one_says_what_to_do(tmp_path):
    assert read_fence(tmp_path) is None and fence_of(tmp_path) == 0
    set_fence(tmp_path, 3, "new")
    set_fence(tmp_path, 2, "old")  # an older formation's rank 0, late
    assert read_fence(tmp_path) == (3, "new")
    Fence(tmp_path, 4, "next", None).check("anything")  # newer than the fence: not fenced
    (tmp_path / FENCE_NAME).write_text("three\n")
    # Issue 46 item 9: not "remove it" (a missing fence fences nobody out).
    with pytest.raises(FenceDamaged) as err:
        fence_of(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / FENCE_NAME}: holds 'three', not the fence megaresil writes there "
        '("NUMBER TOKEN" as each generation of the job forms). Fix: run the same command '
        "again: before any worker starts it says which generation to write back.")
    (tmp_path / FENCE_NAME).unlink()
    (tmp_path / FENCE_NAME).mkdir()
    with pytest.raises(FenceDamaged, match="generation: is a directory, not the fence"):
        fence_of(tmp_path)


@pytest.mark.parametrize("generation", [0, 2])
def test_a_fence_deleted_while_the_job_runs_fences_nobody(tmp_path, generation):
    """Issue 46 item 9: deleting `generation` while generation 0 ran fenced
    the healthy job ("formed again as generation 0 without this rank
    (generation 0)") and cost it a relaunch. No fence names no other
    formation; the next formation writes it again."""
    events = EventLog(tmp_path, 0)
    fence = Fence(tmp_path, generation, "ours", events)
    set_fence(tmp_path, generation, "ours")
    (tmp_path / FENCE_NAME).unlink()
    fence.check("the metrics row of step 3")
    set_fence(tmp_path, generation + 1, "next")  # as the next formation forms
    with pytest.raises(Fenced):
        fence.check("the metrics row of step 4")
    assert [e["current_generation"] for e in fenced_events(tmp_path)] == [generation + 1]


def test_a_link_in_the_fences_place_is_neither_read_nor_written_through(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("1\n")
    (tmp_path / FENCE_NAME).symlink_to(target)
    with pytest.raises(OSError):
        fence_of(tmp_path)
    (tmp_path / FENCE_NAME).unlink()
    (tmp_path / FENCE_NAME).symlink_to(tmp_path / "missing")  # reads as no fence
    with pytest.raises(OSError):
        fence_of(tmp_path)


def test_a_local_commit_of_a_generation_the_job_left_behind_replaces_nothing(tmp_path):
    # The re-formed job (generation 2) committed step 3 on this node; a rank
    # of generation 1, cut off and back, saves step 3 too: refused, and the
    # re-formed job's shard stays as it was.
    from megaresil.checkpoint.local.store import DATA, NodeStore
    from tests.unit.test_safe_files import local_shard

    run_dir, node = tmp_path / "run", tmp_path / "shm" / "node_0"
    run_dir.mkdir()
    set_fence(run_dir, 1, "old")
    NodeStore(node, admit=Fence(run_dir, 1, "old", None).check).write(local_shard(3))
    data = NodeStore(node).shard_dir(3, 0) / DATA
    committed = data.read_bytes()
    set_fence(run_dir, 2, "new")
    stale = NodeStore(node, admit=Fence(run_dir, 1, "old", EventLog(run_dir, 0)).check)
    shard = local_shard(3)
    shard.data[:] = 7  # what the stale rank holds
    with pytest.raises(Fenced, match="the local commit of rank 0's step 3 refused"):
        stale.write(shard)
    assert data.read_bytes() == committed and (data.parent / fmt.MARKER).exists()
    assert not list(node.rglob("*.partial"))
    assert [e["refused"] for e in fenced_events(run_dir)] == ["the local commit of rank 0's step 3"]


def test_a_save_its_rank_abandoned_is_refused_without_recording_the_rank_fenced(
        tmp_path, monkeypatch):
    # The rank's local save is writing when the job fails: the rank abandons
    # it, joins the next formation, and that formation sets the fence before
    # the old save thread reaches its commit. The commit is refused, but the
    # rank is in the job: no `fenced` (CI met this as a flaky test).
    from megaresil.checkpoint.local.replication import Topology
    from megaresil.checkpoint.local.tier import LocalTier
    from tests.unit.test_checkpoint_local_tier import RUN_ID, FakeState, rects

    monkeypatch.setattr("megaresil.checkpoint.local.shard.training_rects",
                        lambda state, include_copies: rects(float(state.step)))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    set_fence(run_dir, 1, "ours")
    events = EventLog(run_dir, 0)
    tier = LocalTier(tmp_path / "shm", RUN_ID, Topology(1, 1, 1), group=None, interval=1,
                     keep=2, events=events, device=torch.device("cpu"),
                     fence=Fence(run_dir, 1, "ours", events))
    write_data = tier.store.write_data

    def write_as_the_job_reforms(path, data):
        write_data(path, data)
        # Step 3: the rank failed, abandoned its save (abandon() sets this
        # first) and joined the next formation. Step 4: the rank was cut off.
        tier.abandoned = state.step == 3
        set_fence(run_dir, 2, "next")

    monkeypatch.setattr(tier.store, "write_data", write_as_the_job_reforms)
    state = FakeState()
    state.step = 3
    tier.save(state, 3)
    assert isinstance(tier.pending.exception(timeout=60), Fenced)
    tier.pending = None
    state.step = 4
    tier.save(state, 4)
    assert isinstance(tier.pending.exception(timeout=60), Fenced)
    tier.executor.shutdown()
    assert not list((tmp_path / "shm").rglob("data.bin"))
    assert [e["refused"] for e in fenced_events(run_dir)] == ["the local commit of rank 0's step 4"]
