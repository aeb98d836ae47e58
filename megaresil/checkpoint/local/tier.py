"""LocalTier: the node-local checkpoint tier's saves, replication and
recovery (docs/local-tier.md).

Threads and groups as for the global tier: staging, writing, replication and
the start-up collectives run on the tier's own thread over its own process
group (async_save.BackgroundSaves), never the training thread's nor the
global checkpointer's. A save call returns once the rank's own shard is
committed, so a process killed after it finds the step on its node;
replication goes on behind the loop. When the world changes shape
(elastic shrink) the shards do not fit: the restart takes the global tier,
which reshards.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.async_save import BackgroundSaves, SaveReport, SaveRequest
from megaresil.checkpoint.local.cadence import Cadence, Pause, retry_step
from megaresil.checkpoint.local.replication import (
    Choice,
    Holdings,
    Space,
    Topology,
    complete_step,
    passed_over,
    space_shortfall,
    transfers,
)
from megaresil.checkpoint.local.runs import run_local_dir
from megaresil.checkpoint.local.shard import (
    Shard,
    add_checksums,
    saved_run_record,
    shard_bytes,
    shard_meta,
    shard_rects,
    shard_size,
    stage,
    unpack_into,
)
from megaresil.checkpoint.local.store import DIR_KEY, NodeStore, filesystem_space, node_dir
from megaresil.checkpoint.staging import StagingCopy
from megaresil.checkpoint.state import RunRecord, TrainingState
from megaresil.checkpoint.transfer import Outgoing, move
from megaresil.checkpoint.validation import nonfinite_keys, nonfinite_refusal, shard_problem
from megaresil.clock import Clock, SystemClock
from megaresil.compat import detach_process_group
from megaresil.fencing import Fence


@dataclass
class Outcome:
    """One rank's side of a local save, gathered by every rank at its end."""
    bytes: int
    replica_bytes: int
    seconds: float
    replication_seconds: float
    proposal: int  # the interval this rank proposes (Cadence)
    problem: Optional[str]  # why this rank's writes failed, None when they did not
    retry_at: int  # the step this rank proposes to retry at, should any rank have failed
    retry_after_s: float


class LocalTier(BackgroundSaves):
    """This rank's side of the local tier for run `run_id` (run_identity)
    under the local root `root`: its node's store in the run's own directory
    there (runs.py), its replicas' peers (`topology`) and the cadence of its
    saves, timed on `clock`."""

    def __init__(self, root: Path, run_id: str, topology: Topology, *,
                 group: Optional[dist.ProcessGroup], interval: int, keep: int, events,
                 device: torch.device, fence: Optional[Fence] = None,
                 clock: Clock = SystemClock()):
        super().__init__("ckpt-local", group, device, clock)
        self.device = device  # of the training state; the tier's thread works on it
        self.topology, self.keep, self.events = topology, keep, events
        self.rank = self.coll.rank
        self.local_root, self.run_id = root, run_id
        self.root = run_local_dir(root, run_id)  # this run's; other runs' are never touched
        # A fence (None: no restarts, library use) refuses the commits of a
        # rank the job re-formed without: they could replace the re-formed
        # job's shards of the same step on this node.
        self.store = NodeStore(node_dir(self.root, topology.node_of(self.rank)),
                               admit=functools.partial(self.check_fence, fence) if fence else None)
        self.mine = [self.rank, *topology.sources(self.rank)]  # the shards this rank writes
        self.cadence = Cadence(interval, clock)
        self.buffer: Optional[torch.Tensor] = None  # staging, reused by every save
        self.recv_buffers: dict[int, torch.Tensor] = {}
        self.loaded: dict[int, Shard] = {}  # start-up: shards of the chosen step, by owner
        self.pause: Optional[Pause] = None  # set and cleared by saves' agreement (and start-up)

    # --- saving --------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.cadence.due(step)

    def save(self, state: TrainingState, step: int) -> None:
        """Save this rank's state after `step` as a local step: staged,
        written, replicated and committed on the tier's thread. Returns once
        this rank's own shard is committed, so a process killed from then on
        resumes from this step; replication goes on behind the loop."""
        started = self.clock.monotonic()
        self.wait()  # after it, every rank knows the same pause
        if self.pause is not None and self.pause.holds(step):
            return
        self.cadence.saving(step)
        # The RNG is global to the process: read it here, before the next
        # step draws from it. The rest is read on the tier's thread, before
        # the own shard is committed, which this call awaits.
        rng = state.rng_state()
        report = SaveReport(self.events, "local_checkpoint_saved", self.clock)
        failures = self.pause.failures + 1 if self.pause else 1
        retry = retry_step(step, failures, self.cadence.step_seconds())  # should this one fail
        self._submit(SaveRequest(StagingCopy(self.device), report), self._stage_write_replicate,
                     [state], rng, started, retry)
        held = self.clock.monotonic() - started
        report.loop_held(held)
        self._loop_held(held)
        # The wait every save's next update has, taken here: a rank killed
        # in the next step's forward or backward, before that update, would
        # otherwise lose this step with its process and resume from the save
        # before it. The work stays on the tier's thread, which owns the
        # staging stream on a GPU.
        self.before_update()

    def _loop_held(self, seconds: float) -> None:
        self.cadence.held(seconds)

    def _stage_write_replicate(self, holder: list[TrainingState], rng: dict, started: float,
                               retry: tuple[int, float], request: SaveRequest) -> None:
        # The state comes in a holder emptied once staged: a save abandoned
        # with a job blocks in its collectives until their timeout, and must
        # not keep the job's model (and its process groups, whose sockets
        # tell peers blocked on them that this rank left) alive meanwhile.
        with request.holding_update():
            own, problem = self._commit_own(holder.pop(), rng, request.copy)
        # Every rank goes through the replication and the final gather
        # whatever its writes did, so none waits on a peer that gave up; the
        # gather tells every rank whether the step stands.
        replica_started = self.clock.monotonic()
        received = self._replicate(own)
        problem = problem or self._damaged(received) or self._written(received)
        outcome = Outcome(own.data.numel(), sum(s.data.numel() for s in received),
                          self.clock.monotonic() - started, self.clock.monotonic() - replica_started,
                          self.cadence.proposal, problem, *retry)
        gathered = self.coll.all_gather(outcome)
        if self.abandoned:
            # The job failed meanwhile: the next generation may be reading
            # this node's shards; what this save left is retired by its
            # retention (or cleaned at the next start-up).
            return
        self.cadence.agree([g.proposal for g in gathered])
        failed = {rank: g.problem for rank, g in enumerate(gathered) if g.problem}
        if failed:
            self.store.remove(own.step, self.mine)
            self._paused(own.step, failed, max(g.retry_at for g in gathered), retry[1])
            return
        self.pause = None
        self.store.retain(self.keep, self.rank, self.mine)
        if self.rank == 0:
            request.report.saved(step=own.step, bytes=sum(g.bytes for g in gathered),
                                 replica_bytes=sum(g.replica_bytes for g in gathered),
                                 seconds=max(g.seconds for g in gathered),
                                 replication_seconds=max(g.replication_seconds for g in gathered),
                                 replicas=self.topology.copies, path=str(self.root),
                                 interval=self.cadence.every)

    def _commit_own(self, state: TrainingState, rng: dict,
                    copy: StagingCopy) -> tuple[Shard, Optional[str]]:
        """Stage `state` and commit it as this rank's own shard, which the
        save call awaits. Needs no peer, so it ends even when a peer died.
        Returns the shard, and why it was not written (None: it was)."""
        try:
            run = state.run_record()
            rects = shard_rects(state)
            nonfinite = nonfinite_keys(rects)  # such a step is refused: never written
            self.buffer, records = stage(rects, self.buffer, copy)
            meta = shard_meta(run, self.rank, self.coll.world, rng, records, run_id=self.run_id)
        finally:
            del state
        copy.wait_on_host()
        add_checksums(self.buffer, meta["rects"])
        own = Shard(meta, self.buffer)
        return own, nonfinite_refusal(nonfinite) if nonfinite else self._written([own])

    def _written(self, shards: list[Shard]) -> Optional[str]:
        """Write `shards` here; None, or why a write failed (full storage,
        any OSError): the tier pauses then, the run goes on."""
        try:
            for shard in shards:
                self.store.write(shard)
        except (OSError, fmt.CheckpointError) as err:
            return str(err)
        return None

    @staticmethod
    def _damaged(received: list[Shard]) -> Optional[str]:
        """Why a replica that arrived is not what its owner sent, if it is
        not: never committed, so the previous step's replica stands."""
        for shard in received:
            problem = shard_problem(shard)
            if problem:
                return (f"the replica of rank {shard.owner}'s step {shard.step} arrived "
                        f"damaged: {problem}")
        return None

    def _paused(self, step: int, failed: dict[int, str], retry_at: int, backoff_s: float) -> None:
        """Every rank, after a failed save: its shards of the step are gone;
        pause until `retry_at`; rank 0 reports it."""
        failures = self.pause.failures + 1 if self.pause else 1
        first = min(failed)
        reason = f"rank {first}: {failed[first]}"
        self.pause = Pause(step, reason, retry_at, failures)
        if self.rank == 0:
            self.events.emit("local_tier_paused", step=step, reason=reason, ranks=sorted(failed),
                             retry_at_step=retry_at, retry_after_s=backoff_s, failures=failures,
                             path=str(self.local_root))

    def _replicate(self, own: Shard) -> list[Shard]:
        """Send this rank's shard to its peers and take in its sources'."""
        peers, sources = self.topology.peers(self.rank), self.topology.sources(self.rank)
        if not peers:
            return []
        # Checked at the commit (_damaged), as every shard written is.
        received = move(self.coll, [*((self.rank, p) for p in peers),
                                    *((s, self.rank) for s in sources)],
                        {p: as_outgoing(own) for p in peers}, self._recv_buffer, "a replica")
        return [Shard(got.meta, got.pieces[0]) for got in received.values()]

    def _recv_buffer(self, meta: dict) -> list[torch.Tensor]:
        """Where a source's replica lands: the buffer its last one did, when
        the size is the same (a save's replicas are all alike)."""
        size, owner = shard_size(meta), meta["owner"]
        if owner not in self.recv_buffers or self.recv_buffers[owner].numel() != size:
            self.recv_buffers[owner] = torch.empty(size, dtype=torch.uint8)
        return [self.recv_buffers[owner]]

    # --- start-up ------------------------------------------------------------------

    def find(self, layout: dict) -> Choice:
        """Collective: the newest local step every rank can recover at this
        layout, checksums verified; this rank keeps what it holds of it.
        Each copy found damaged on the way is reported (rank 0)."""
        self.store.clean_partials(self.mine)
        reports = self.coll.all_gather(self.store.report(layout, self.coll.world, self.run_id))
        verified: set[int] = set()
        while True:
            choice = complete_step(reports, self.coll.world)
            if choice.step is None or choice.step in verified:
                self._report_passed_over(reports, choice.step)
                return choice
            step = choice.step
            self.loaded.clear()  # of a step found wanting
            mine = {owner: self._verified(step, owner)
                    for owner, problem in reports[self.rank].get(step, {}).items()
                    if problem is None}
            for rank, found in enumerate(self.coll.all_gather(mine)):
                if found:
                    reports[rank][step].update(found)
            verified.add(step)

    def _report_passed_over(self, reports: list[Holdings], chosen: Optional[int]) -> None:
        """`checkpoint_skipped` (tier local) for each damaged copy of the
        steps looked at, as the global tier reports a checkpoint it skips:
        a copy passed over for another (a replica) says nothing otherwise."""
        if self.rank != 0:
            return
        for node, step, owner, problem in passed_over(reports, chosen, self.topology):
            path = NodeStore(node_dir(self.root, node)).shard_dir(step, owner)
            self.events.emit("checkpoint_skipped", path=str(path), reason=problem,
                             tier="local", step=step, owner=owner)

    def _verified(self, step: int, owner: int) -> Optional[str]:
        try:
            shard = self.store.read(step, owner)
        except (OSError, ValueError, fmt.CheckpointError) as err:
            return f"reading it failed: {err}"
        problem = shard_problem(shard)
        if problem is None:
            self.loaded[owner] = shard
        return problem

    def recover(self, choice: Choice, state: TrainingState) -> RunRecord:
        """Collective: shards move from holders to owners whose own copy is
        missing or bad; each rank loads its own."""
        received = self._received(transfers(choice.sources),
                                  f"rank {self.rank}'s shard of step {choice.step}")
        if received is not None:
            self.store.write(received)  # this node holds its own shard again
        shard = received or self.loaded[self.rank]
        unpack_into(shard, shard_rects(state))
        saved = saved_run_record(shard.meta)
        state.restore(saved)
        self.loaded.clear()
        return saved

    def _received(self, moves: list[tuple[int, int]], what: str) -> Optional[Shard]:
        """Collective: the holders send the shards of `moves` to their owners;
        the shard this rank received (at most one), checked, if any."""
        outgoing = {owner: as_outgoing(self.loaded[owner]) for holder, owner in moves
                    if holder == self.rank}
        received = move(self.coll, moves, outgoing,
                        lambda meta: [torch.empty(shard_size(meta), dtype=torch.uint8)], what)
        if not received:
            return None
        ((holder, got),) = received.items()  # a rank's shard comes from one holder
        shard = Shard(got.meta, got.pieces[0])
        problem = shard_problem(shard)
        if problem:
            raise fmt.CheckpointError(f"{what} arrived from rank {holder} damaged: {problem}")
        return shard

    def check_space(self, state: TrainingState) -> None:
        """Collective, at start-up (after the resume, which retired later
        steps): the tier stays off for this run when one save does not fit
        in the free space of checkpoint.local.dir, counting on each
        filesystem the shards of every rank writing there, replicas too."""
        filesystem, free = filesystem_space(self.store.root)
        mine = Space(filesystem, str(self.store.root), free,
                     shard_bytes(state, self.rank, self.coll.world, self.run_id))
        short = space_shortfall(self.coll.all_gather(mine), self.topology)
        if short is None:
            return
        step, root = state.run_record().step, self.local_root
        reason = (f"{DIR_KEY}={root}: {short}. Fix: free space there, point {DIR_KEY} at "
                  "storage with room (in Docker, a larger --shm-size), or set "
                  "checkpoint.local.enabled=false")
        self.pause = Pause(step, reason, retry_at=None)
        if self.rank == 0:
            self.events.emit("local_tier_paused", step=step, reason=reason, ranks=[],
                             retry_at_step=None, retry_after_s=None, failures=0, path=str(root))

    def discard_after(self, step: Optional[int]) -> None:
        """The run resumed from `step` (None: from scratch): later local steps
        are from an abandoned future and must never be chosen. Shards read
        at start-up are let go."""
        self.loaded.clear()
        self.store.discard_after(-1 if step is None else step, self.mine)

    # --- ending ----------------------------------------------------------------------

    def remove_all(self) -> None:
        """The run finished with a global checkpoint of its last step: this
        rank's local shards are no longer needed (they hold memory)."""
        self.discard_after(None)
        for path in (self.store.root, self.root, self.local_root):
            try:
                path.rmdir()
            except OSError:
                pass  # other ranks' shards still there, another run's, or the job's lock

    def abandon(self) -> None:
        """The job failed (see BackgroundSaves.abandon): the committed local
        steps stand."""
        super().abandon()
        # A save every step is nearly always in flight when a job fails: its
        # blocked collective must not hold up the generation's teardown.
        if self.coll.group is not None:
            detach_process_group(self.coll.group)


def as_outgoing(shard: Shard) -> Outgoing:
    """A shard on the wire: its data in one piece (its records carry their
    checksums; one message keeps gloo's per-message cost to one a shard)."""
    return Outgoing(shard.meta, [shard.data])
