"""The node-local checkpoint tier: shards, replication, which step a restart
takes from which tier, and recovery of a lost node from its peers."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megaresil.checkpoint.local.cadence import Cadence
from megaresil.clock import Clock, SystemClock
from megaresil.checkpoint.local.replication import Topology, complete_step, transfers
from megaresil.checkpoint.local.shard import Shard, add_checksums, stage, unpack_into
from megaresil.checkpoint.local.store import NodeStore
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.validation import shard_problem
from megaresil.events import read_events, read_metrics
from megaresil.ports import free_port
from tests.harness.dist import spawn_ranks
from tests.harness.fake_clock import FakeClock
from tests.harness.journey import home, megaresil, with_demo_corpus  # noqa: F401  (home: a fixture)

LAYOUT = {"tp": 1, "pp": 1, "dp": 2, "world_size": 2}
RUN_ID = "0123456789abcdef"  # the run the shards of these tests belong to


def rects(seed: float) -> list[Rect]:
    return [Rect("model/w", (4, 6), (0, 2), torch.full((4, 3), seed)),
            Rect("optim/m", (5,), (0,), torch.arange(5, dtype=torch.float64) + seed),
            Rect("model/h", (3,), (0,), torch.tensor([1.0, 2.0, seed]).bfloat16())]


def shard(step: int, owner: int, seed: float = 1.0, layout: dict = LAYOUT) -> Shard:
    data, records = stage(rects(seed), None)
    add_checksums(data, records)
    return Shard({"format": "megaresil-local-shard", "run_id": RUN_ID, "step": step,
                  "owner": owner,
                  "world": layout["world_size"], "layout": layout, "rects": records,
                  "run": {"step": step, "layout": layout, "recipe": {},
                          "data": {"consumed_samples": 0}, "optimizer": {"adam_step": step}},
                  "rank_state": {}}, data.clone())


# --- unit: topology and the choice of step -------------------------------------------------

def test_replicas_go_to_other_nodes_and_at_most_one_per_other_node():
    t = Topology(world=8, ranks_per_node=2, replicas=2)
    for rank in range(8):
        assert [t.node_of(p) for p in t.peers(rank)] and all(
            t.node_of(p) != t.node_of(rank) for p in t.peers(rank))
        assert all(rank in t.peers(s) for s in t.sources(rank))
    assert Topology(world=4, ranks_per_node=2, replicas=3).copies == 1  # only one other node
    assert Topology(world=4, ranks_per_node=4, replicas=1).peers(0) == []  # one node: none
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology(world=6, ranks_per_node=4, replicas=1)


def test_newest_step_complete_for_every_rank_own_copy_first_else_a_replica():
    # Rank 0 holds its own shard and rank 1's replica; rank 1 lost step 6 (node loss).
    reports = [{5: {0: None, 1: None}, 6: {0: None, 1: None}}, {5: {1: None, 0: None}}]
    choice = complete_step(reports, world=2)
    assert choice.step == 6 and choice.sources == {0: 0, 1: 0}
    assert transfers(choice.sources) == [(0, 1)]
    # Rank 0's own step-6 shard is corrupt and nobody else holds it: step 5, saying why.
    reports[0][6][0] = "checksum mismatch in model/w"
    choice = complete_step(reports, world=2)
    assert choice.step == 5 and choice.sources == {0: 0, 1: 1}
    assert "step 6" in choice.skipped[0] and "checksum mismatch" in choice.skipped[0]


def test_a_different_layout_is_no_local_step_so_the_global_tier_serves(tmp_path):
    """Elastic shrink: shards saved by 4 ranks do not fit 2; the local tier
    offers nothing and says why (resume then takes the global tier)."""
    store = NodeStore(tmp_path / "node_0")
    four = {**LAYOUT, "dp": 4, "world_size": 4}
    store.write(shard(7, 0, layout=four))
    store.write(shard(7, 1, layout=four))
    report = store.report(LAYOUT, world=2, run_id=RUN_ID)
    assert "another layout" in report[7][0]
    choice = complete_step([report, {}], world=2)
    assert choice.step is None and "another layout" in choice.skipped[0]


# --- unit: the shard on disk -----------------------------------------------------------------

def test_shard_round_trip_is_bit_exact_and_a_partial_write_is_never_held(tmp_path):
    store = NodeStore(tmp_path)
    store.write(shard(3, 1, seed=2.5))
    (tmp_path / "step_0000004" / "rank_00001.partial").mkdir(parents=True)  # a save that died
    assert store.held() == {3: [1], 4: []}
    back = store.read(3, 1)
    assert shard_problem(back) is None
    targets = [Rect(r.key, r.global_shape, r.offset, torch.zeros_like(r.tensor))
               for r in rects(2.5)]
    unpack_into(back, targets)
    for t, r in zip(targets, rects(2.5)):
        assert t.tensor.dtype == r.tensor.dtype and torch.equal(t.tensor, r.tensor)
    store.clean_partials([1])
    assert not (tmp_path / "step_0000004" / "rank_00001.partial").exists()


def test_a_flipped_byte_fails_the_checksum(tmp_path):
    store = NodeStore(tmp_path)
    store.write(shard(3, 0))
    flip_byte(store.shard_dir(3, 0) / "data.bin")
    assert "checksum mismatch" in shard_problem(store.read(3, 0))
    assert store.report(LAYOUT, 2, RUN_ID) == {3: {0: None}}  # cheap check passes: verified later


def test_corrupt_local_fault_damages_only_the_ranks_own_committed_shards(tmp_path):
    from megaresil.events import EventLog
    from megaresil.resilience.faults import FaultInjector

    store = NodeStore(tmp_path / "node_0")
    for step in (3, 4):
        store.write(shard(step, 0))
        store.write(shard(step, 1))  # a replica this node holds
    fault = {"kind": "corrupt_local_checkpoint", "rank": 0, "step": 5, "section": "data"}
    FaultInjector([fault], rank=0, run_dir=tmp_path, checkpoint_root=tmp_path / "global",
                  events=EventLog(tmp_path, 0),
                  local_node_dir=store.root).on_section("data", 5)
    assert all("checksum mismatch" in shard_problem(store.read(s, 0)) for s in (3, 4))
    assert all(shard_problem(store.read(s, 1)) is None for s in (3, 4))


def test_a_lost_node_comes_back_empty_once_its_worker_is_dead(tmp_path):
    import subprocess
    import sys
    import time

    node = tmp_path / "node_1"
    NodeStore(node).write(shard(3, 1))
    worker = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                             "from megaresil.resilience.faults import lose_node; "
                             "lose_node(Path(sys.argv[1]))", str(node)])
    assert worker.returncode == -9  # SIGKILL
    deadline = time.time() + 30
    while node.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not node.exists()


def test_the_restart_line_names_the_newest_step_of_either_tier(tmp_path):
    from tests.harness.dist import RECIPE, TINY
    from megaresil.config import load_recipe
    from megaresil.resilience.records import newest_step

    overrides = TINY + [f"run.dir={tmp_path}", f"checkpoint.local.dir={tmp_path}/local"]
    (tmp_path / "checkpoints" / "step_0000004").mkdir(parents=True)
    off = load_recipe(RECIPE, overrides)
    on = load_recipe(RECIPE, overrides + ["checkpoint.local.enabled=true"])
    assert newest_step(on, world=2) == (4, "global")  # no run id yet: no local shard of its own
    (tmp_path / "run_id").write_text(RUN_ID)
    nodes = [NodeStore(tmp_path / "local" / f"run-{RUN_ID}" / f"node_{n}") for n in (0, 1)]
    for step in (5, 6):
        nodes[0].write(shard(step, 0))
        nodes[1].write(shard(step, 0))  # rank 0's replica
    nodes[1].write(shard(5, 1))  # rank 1 has step 5 only: step 6 is incomplete
    assert newest_step(off, world=2) == (4, None)  # one tier: nothing to name
    assert newest_step(on, world=2) == (5, "local")
    (tmp_path / "checkpoints" / "step_0000005").mkdir()
    assert newest_step(on, world=2) == (5, "local")  # the restart reads it on a tie
    (tmp_path / "checkpoints" / "step_0000006").mkdir()
    assert newest_step(on, world=2) == (6, "global")


def test_retention_keeps_the_newest_steps_of_what_this_rank_writes(tmp_path):
    store = NodeStore(tmp_path)
    for step in range(1, 5):
        for owner in (0, 2, 1):  # rank 0's own, its replica of rank 2; rank 1 shares the node
            store.write(shard(step, owner))
        store.retain(keep=2, owner=0, owners=[0, 2])
    held = store.held()
    assert {s: o for s, o in held.items() if 0 in o or 2 in o} == {3: [0, 1, 2], 4: [0, 1, 2]}
    assert held[1] == held[2] == [1]  # another rank's shards are its own to retire


def test_adaptive_interval_is_the_smallest_keeping_the_hold_within_five_percent():
    cadence = Cadence(interval=0, clock=FakeClock(tick=1.0))  # due() is called one second apart
    assert cadence.due(1)
    cadence.saving(1)
    cadence.agree([cadence.proposal, 1])
    cadence.held(0.2)  # the save held the loop 0.2 s of a 1 s step (0.8 s of work)
    assert cadence.due(2)  # every step until a save's hold is known
    cadence.saving(2)
    proposal, work = cadence.proposal, 0.8
    assert 0.2 / proposal <= 0.05 * work < 0.2 / (proposal - 1)
    # Another rank's saves were cheaper: the largest proposal is agreed, and
    # takes effect at the next save, when every rank has it.
    cadence.agree([1, proposal, 2])
    assert cadence.due(3)
    cadence.saving(3)
    assert cadence.every == proposal
    assert [s for s in range(4, 4 + proposal) if cadence.due(s)] == [3 + proposal]
    cheap = Cadence(interval=0)
    cheap.due(1), cheap.saving(1), cheap.held(0.01), cheap.due(2), cheap.saving(2)
    assert cheap.proposal == 1
    assert [s for s in range(1, 7) if Cadence(interval=3).due(s)] == [3, 6]


def flip_byte(path: Path, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


# --- end to end: 4 ranks on 2 simulated nodes ---------------------------------------------

LOCAL = ["parallel.tp=2", "parallel.dp=2", "train.steps=9", "checkpoint.interval=4",
         "checkpoint.local.enabled=true", "checkpoint.local.interval=1",
         "checkpoint.local.ranks_per_node=2", "checkpoint.local.replicas=1",
         "checkpoint.local.keep=2", "checkpoint.keep=0"]  # every global save kept, to list


def _phases(rank: int, world: int, port: int, out: str) -> None:
    """The reference run, then a run stopped and resumed four times, the
    local tier's storage damaged differently before each resume."""
    from tests.harness.dist import RECIPE, TINY
    from megaresil.config import load_recipe
    from megaresil.parallel.layout import ParallelLayout
    from megaresil.train.loop import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megaresil.run_identity import read_run_id

    out = Path(out)
    local = lambda node: out / "local" / f"run-{read_run_id(out / 'faulted')}" / f"node_{node}"

    def run(run_dir: str, *extra: str) -> None:
        cfg = load_recipe(RECIPE, TINY + LOCAL + [f"run.dir={out / run_dir}",
                                                  f"checkpoint.local.dir={out / 'local'}",
                                                  *extra])
        Trainer(cfg, ParallelLayout.from_config(cfg.parallel, torch.device("cpu"))).run()
        dist.barrier()

    def on_rank0(action) -> None:
        if rank == 0:
            action()
        dist.barrier()

    shard_data = lambda node, step, owner: local(node) / f"step_{step:07d}" / f"rank_{owner:05d}" / "data.bin"
    run("reference", "checkpoint.local.enabled=false")
    run("faulted", "train.exit_at_step=6")
    # The global save of step 6 never happened; node 1 is lost with its storage.
    on_rank0(lambda: (fmt_rmtree(out / "faulted" / "checkpoints" / "step_0000006"),
                      fmt_rmtree(local(1))))
    run("faulted", "train.exit_at_step=7")
    on_rank0(lambda: flip_byte(shard_data(0, 7, 0), at=100))  # rank 0's own copy of step 7
    run("faulted", "train.exit_at_step=8")
    # Every copy of rank 1's steps 7 and 8 (its own on node 0, its replica on node 1).
    on_rank0(lambda: [flip_byte(shard_data(node, step, 1), at=5)
                      for node in (0, 1) for step in (7, 8)])
    run("faulted")
    dist.destroy_process_group()


def fmt_rmtree(path: Path) -> None:
    import shutil
    shutil.rmtree(path)


@pytest.mark.slow
def test_restarts_take_the_newest_recoverable_step_from_either_tier_bit_exact(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("MEGARESIL_PHASE_LINE_S", "0")  # every start-up phase gets its event
    spawn_ranks(_phases, (4, free_port(), str(tmp_path)), 4)
    loads = [e for e in read_events(tmp_path / "faulted") if e["event"] == "checkpoint_loaded"]
    got = [(e["tier"], e["step"], e.get("from_replicas")) for e in loads]
    assert got == [("local", 6, [2, 3]),  # node 1 lost: its ranks' shards from node 0
                   ("local", 7, [0]),  # a corrupt own shard: the replica; local beats equal global
                   ("global", 8, None)], got  # no step with every rank: the global tier
    assert "rank(s) [1]" in loads[2]["skipped"]["local"]
    assert "not newer" in loads[0]["skipped"]["global"]
    # Each load has its start-up line: a global one with its bytes, a local one without.
    phases = [(e["phase"], e.get("bytes") is not None) for e in read_events(tmp_path / "faulted")
              if e["event"] == "startup_phase" and "load" in e["phase"]]
    assert phases == [("checkpoint load from the local tier", False)] * 2 + [
        ("checkpoint load", True)], phases

    # Bit for bit the reference: every step's loss and the final checkpoint.
    losses = lambda run: {r["step"]: r["loss"] for r in read_metrics(tmp_path / run)
                          if "loss" in r}
    assert losses("faulted") == losses("reference")
    from megaresil.checkpoint.offline.diff import diff_checkpoints
    final = [tmp_path / run / "checkpoints" / "step_0000009" for run in ("reference", "faulted")]
    assert diff_checkpoints(*final).identical

    # The local tier wrote nothing in the shared checkpoint directory, and
    # released its shards once the run finished with a global checkpoint.
    shared = {p.name for p in (tmp_path / "faulted" / "checkpoints").iterdir()}
    assert shared == {"latest", "step_0000004", "step_0000007", "step_0000008", "step_0000009"}
    assert [p for p in (tmp_path / "local").rglob("*") if p.is_file()] == []
    saves = [e for e in read_events(tmp_path / "faulted") if e["event"] == "local_checkpoint_saved"]
    assert saves and all(e["replicas"] == 1 and e["replica_bytes"] == e["bytes"]
                         and e["interval"] == 1 for e in saves)  # the interval in force


def test_settings_that_cannot_work_are_refused_naming_the_key(tmp_path):
    from tests.harness.dist import RECIPE, TINY
    from megaresil.config import ConfigError, load_recipe
    from megaresil.checkpoint.paths import RunPaths

    with pytest.raises(ConfigError, match="checkpoint.local.ranks_per_node"):
        load_recipe(RECIPE, TINY + ["parallel.dp=4", "train.global_batch_size=8",
                                    "checkpoint.local.ranks_per_node=3"])
    with pytest.raises(ConfigError, match="checkpoint.local.keep"):
        load_recipe(RECIPE, TINY + ["checkpoint.local.keep=1"])
    with pytest.raises(ConfigError, match="lose_local_node acts on the local checkpoint tier"):
        load_recipe(RECIPE, TINY + ['faults=[{"kind": "lose_local_node", "rank": 0, "step": 2}]'])
    inside = load_recipe(RECIPE, TINY + [f"run.dir={tmp_path}",
                                         f"checkpoint.local.dir={tmp_path}/checkpoints/local"])
    with pytest.raises(ConfigError, match="inside the global checkpoint root"):
        RunPaths.of(inside).check()
    default = load_recipe(RECIPE, TINY + [f"run.dir={tmp_path}"])
    assert tmp_path not in RunPaths.of(default).local_root.parents  # node-local, never the run dir


# --- a full local tier degrades, never ends the run ------------------------------------

class Recorded:
    def __init__(self):
        self.events: list[dict] = []

    def emit(self, event: str, **fields) -> None:
        self.events.append({"event": event, **fields})


class FakeState:
    """What the tier reads of a trainer (its tensors come from `rects`)."""

    def __init__(self, world: int = 1):
        self.step, self.world = 0, world

    def run_record(self):
        from megaresil.checkpoint.state import RunRecord
        layout = {**LAYOUT, "dp": self.world, "world_size": self.world}
        return RunRecord(step=self.step, layout=layout, recipe={"optimizer": {}},
                        consumed_samples=4 * self.step, optimizer_steps=self.step)

    def rng_state(self) -> dict:
        return {"seed": self.step}


class FillingStore(NodeStore):
    """A node directory on storage that is full while `full` is set: a
    data.bin write stops half way with ENOSPC, as on a full tmpfs."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.full, self.writes = False, 0

    def write_data(self, path: Path, data: torch.Tensor) -> None:
        import errno
        self.writes += 1
        if not self.full:
            return super().write_data(path, data)
        path.write_bytes(bytes(data.numpy()[: data.numel() // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def single_tier(root: Path, monkeypatch, run_id: str = RUN_ID, clock: Clock = SystemClock()):
    """A one-rank tier (no process group) of run `run_id` on a FillingStore,
    saving every step, timed on `clock`."""
    from megaresil.checkpoint.local.tier import LocalTier

    monkeypatch.setattr("megaresil.checkpoint.local.shard.training_rects",
                        lambda state, include_copies: rects(float(state.step)))
    events = Recorded()
    tier = LocalTier(root, run_id, Topology(1, 1, 1), group=None, interval=1, keep=2,
                     events=events, device=torch.device("cpu"), clock=clock)
    tier.store = FillingStore(tier.store.root)
    return tier, events


def run_steps(tier, state: FakeState, clock: FakeClock, steps) -> None:
    """The loop's calls, one step a second."""
    for step in steps:
        clock.now += 1.0
        state.step = step
        if tier.due(step):
            tier.save(state, step)
            tier.wait()


def test_a_failed_local_save_is_removed_and_pauses_the_tier_which_retries_after_a_back_off(
        tmp_path, monkeypatch):
    from megaresil.checkpoint.local.cadence import RETRY_FIRST_S
    from megaresil.resilience.incidents import describe

    clock = FakeClock()
    tier, events = single_tier(tmp_path, monkeypatch, clock=clock)
    state = FakeState()
    run_steps(tier, state, clock, range(1, 3))
    tier.store.full = True
    run_steps(tier, state, clock, [3])  # no exception: the run goes on
    assert tier.store.held() == {1: [0], 2: [0]}  # step 3's partial shard is gone
    assert not list(tmp_path.rglob("*.partial"))
    paused = [e for e in events.events if e["event"] == "local_tier_paused"]
    retry = 3 + int(RETRY_FIRST_S)  # a step a second
    assert [(e["step"], e["retry_at_step"], e["failures"], e["ranks"]) for e in paused] == [
        (3, retry, 1, [0])]
    assert "ENOSPC" in paused[0]["reason"] and "checkpoint.local.dir" in paused[0]["reason"]
    assert "checkpoint.dir " not in paused[0]["reason"]
    assert "megaresil: warning:" in describe(paused[0]) and f"step {retry}" in describe(paused[0])

    writes = tier.store.writes
    run_steps(tier, state, clock, range(4, retry))
    assert tier.store.writes == writes  # paused: not even tried
    run_steps(tier, state, clock, [retry])  # still full: the back-off doubles, warned once
    second = [e for e in events.events if e["event"] == "local_tier_paused"][-1]
    assert (second["failures"], second["retry_at_step"]) == (2, retry + 2 * int(RETRY_FIRST_S))
    assert describe(second) is None
    tier.store.full = False
    run_steps(tier, state, clock, range(retry + 1, second["retry_at_step"] + 1))
    assert tier.pause is None and tier.store.held() == {2: [0], second["retry_at_step"]: [0]}
    saved = [e["step"] for e in events.events if e["event"] == "local_checkpoint_saved"]
    assert saved == [1, 2, second["retry_at_step"]]
    assert tier.find(LAYOUT | {"dp": 1, "world_size": 1}).step == second["retry_at_step"]


def test_a_rerun_never_takes_a_step_a_dead_save_left_half_written(tmp_path, monkeypatch):
    """A save killed after its rename but before its marker, and one killed
    mid-write: both are removed at start-up; the step before serves."""
    tier, _ = single_tier(tmp_path, monkeypatch)
    one = {**LAYOUT, "dp": 1, "world_size": 1}
    for step in (4, 5, 6):
        tier.store.write(shard(step, 0, layout=one))
    (tier.store.shard_dir(5, 0) / "COMMITTED").unlink()
    (tier.store.shard_dir(6, 0) / "COMMITTED").unlink()
    tier.store.shard_dir(6, 0).rename(tier.store.shard_dir(6, 0).with_name("rank_00000.partial"))
    assert tier.find(one).step == 4
    assert tier.store.held() == {4: [0]}  # nothing of the dead saves is left filling memory


def test_room_for_a_save_counts_every_rank_writing_on_a_filesystem_replicas_included():
    from megaresil.checkpoint.local.replication import Space, space_shortfall

    two_nodes = Topology(world=2, ranks_per_node=1, replicas=1)
    one_fs = [Space("host:1", f"/shm/node_{r}", free=250, shard=60) for r in range(2)]
    assert space_shortfall(one_fs, two_nodes) is None  # 2 ranks x (own + a replica) = 240
    one_fs[1].free = 200  # what is free now, seen by the rank that looked last
    assert "needs 240 bytes" in space_shortfall(one_fs, two_nodes)
    assert "200 bytes are free" in space_shortfall(one_fs, two_nodes)
    apart = [Space(f"host{r}:1", f"/shm/node_{r}", free=130, shard=60) for r in range(2)]
    assert space_shortfall(apart, two_nodes) is None  # each node's own storage: 120 each
    assert space_shortfall(apart, Topology(world=2, ranks_per_node=2, replicas=1)) is None


def test_a_local_dir_without_room_for_one_save_turns_the_tier_off_for_the_run(
        tmp_path, monkeypatch):
    from megaresil.checkpoint.local.shard import shard_bytes
    from megaresil.resilience.incidents import describe

    tier, events = single_tier(tmp_path, monkeypatch)
    state = FakeState()
    needed = shard_bytes(state, 0, 1, RUN_ID)
    assert needed > sum(r.nbytes for r in rects(0.0))  # data, meta and their blocks
    monkeypatch.setattr("megaresil.checkpoint.local.tier.filesystem_space",
                        lambda directory: ("host:1", needed - 1))
    tier.check_space(state)
    (off,) = events.events
    assert off["event"] == "local_tier_paused" and off["retry_at_step"] is None
    line = describe(off)
    assert f"checkpoint.local.dir={tmp_path}" in line and f"{needed:,} bytes" in line
    assert f"{needed - 1:,} bytes are free" in line and "Fix:" in line
    run_steps(tier, state, FakeClock(), range(1, 5))
    assert tier.store.writes == 0 and tier.store.held() == {}
    state.step = 0
    monkeypatch.setattr("megaresil.checkpoint.local.tier.filesystem_space",
                        lambda directory: ("host:1", needed))
    tier.pause = None
    tier.check_space(state)
    assert tier.pause is None  # exactly one save's room is enough


def _one_rank_full(rank: int, world: int, port: int, out: str) -> None:
    """Two ranks on two simulated nodes, each holding the other's replica;
    rank 1's storage fills up before step 2."""
    import json
    from datetime import timedelta
    from megaresil.checkpoint.local import shard as local_shard
    from megaresil.checkpoint.local.tier import LocalTier

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))  # a hang fails
    local_shard.training_rects = lambda state, include_copies: rects(float(state.step + rank))
    events = Recorded()
    tier = LocalTier(Path(out), RUN_ID, Topology(world, 1, 1), group=group, interval=1,
                     keep=2, events=events, device=torch.device("cpu"))
    tier.store = FillingStore(tier.store.root)
    state, clock = FakeState(world), FakeClock()
    run_steps(tier, state, clock, [1])
    tier.store.full = rank == 1
    run_steps(tier, state, clock, [2, 3])
    held, retry_at = tier.store.held(), tier.pause.retry_at
    # Then, the back-off over and the storage free, a replica that arrives
    # damaged at rank 0: a failed save too, not the end of the run.
    tier.store.full, tier.pause = False, None
    if rank == 0:
        received = tier._replicate
        tier._replicate = lambda own: [flipped(s) for s in received(own)]
    run_steps(tier, state, clock, [4])
    tier.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "retry_at": retry_at, "held": {str(k): v for k, v in held.items()},
        "held_after": {str(k): v for k, v in tier.store.held().items()},
        "writes": tier.store.writes, "events": [e for e in events.events
                                                if e["event"] == "local_tier_paused"]}))
    dist.destroy_process_group()


def flipped(shard: Shard) -> Shard:
    data = shard.data.clone()
    data[0] ^= 0xFF
    return Shard(shard.meta, data)


def test_every_rank_pauses_with_the_rank_whose_storage_is_full(tmp_path):
    import json

    spawn_ranks(_one_rank_full, (2, free_port(), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["retry_at"] == ranks[1]["retry_at"] > 3  # the same step, agreed
    # Step 2 is gone from both nodes (rank 0's own shard and its replica of
    # rank 1 included); step 3 was skipped by both: rank 0 wrote step 1's
    # and step 2's two shards only.
    assert ranks[0]["held"] == ranks[1]["held"] == {"1": [0, 1]}
    (paused, damaged) = ranks[0]["events"]
    assert paused["ranks"] == [1] and paused["reason"].startswith("rank 1: ") and \
        ranks[1]["events"] == []  # rank 0 reports
    assert damaged["ranks"] == [0] and "arrived damaged" in damaged["reason"]
    assert ranks[0]["held_after"] == ranks[1]["held_after"] == {"1": [0, 1]}
    assert ranks[0]["writes"] == 4 + 1  # step 4: its own shard; the damaged replica never


# --- journey: a local tier on a small tmpfs --------------------------------------------------

@pytest.fixture
def small_shm(home):
    """A 300 MiB tmpfs: two local saves of gpt-tiny at dp=2 on two simulated
    nodes fit (4 shards of 31 MB a step, replicas included), a third does not."""
    from tests.harness.tmpfs import mounted_tmpfs

    with mounted_tmpfs(home / "shm", "300m") as disk:
        yield disk


@pytest.mark.journey
def test_a_full_local_tier_pauses_and_the_run_ends_bit_equal_to_the_reference(home, small_shm,
                                                                             demo_corpus):
    from tests.harness.dist import RECIPE

    with_demo_corpus(home / "cache", demo_corpus)  # as an earlier run left it

    common = [str(RECIPE), "parallel.tp=1", "parallel.pp=1", "parallel.dp=2", "train.steps=8",
              "checkpoint.interval=6", "data.seq_len=32", "train.eval_batches=0",
              "logging.progress=false", "logging.tensorboard=false",
              f"data.cache_dir={home / 'cache'}"]
    megaresil("train", *common, "run.dir=reference", cwd=home)
    # Step 3's save does not fit; step 5 raises (after the pause is known:
    # a save still in flight when a job fails may yet finish), and the
    # in-process restart resumes from local step 2, where one more save does
    # not fit either.
    run = megaresil("train", *common, "run.dir=run", "checkpoint.local.enabled=true",
                    "checkpoint.local.interval=1", "checkpoint.local.ranks_per_node=1",
                    f"checkpoint.local.dir={small_shm / 'local'}",
                    "faults=[{kind: raise, rank: 1, step: 5}]", cwd=home)
    assert "local checkpoint of step 3 failed (rank " in run.stderr, run.stderr
    assert "ENOSPC" in run.stderr and "point checkpoint.local.dir elsewhere" in run.stderr
    assert "local checkpoint tier is off for this run" in run.stderr
    assert "checkpoint.dir " not in run.stderr
    events = read_events(home / "run")
    loads = [(e["tier"], e["step"]) for e in events if e["event"] == "checkpoint_loaded"]
    assert loads == [("local", 2)], loads  # never the failed step 3
    paused = [e["retry_at_step"] for e in events if e["event"] == "local_tier_paused"]
    assert len(paused) == 2 and paused[0] > 3 and paused[1] is None
    assert {p.name for p in (home / "run" / "checkpoints").iterdir()} >= {"step_0000006",
                                                                         "step_0000008"}
    diff = megaresil("ckpt", "diff", "reference/checkpoints/step_0000008",
                     "run/checkpoints/step_0000008", cwd=home)
    assert " 0 not identical" in diff.stdout, diff.stdout
    assert [p for p in small_shm.rglob("*") if p.is_file()] == []  # released at the end
