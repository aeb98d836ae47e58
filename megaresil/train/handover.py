"""Live replacement, the trainer's side: a rank that lost a peer keeps its
state in memory for the next generation (as one local-tier shard, checksummed),
and the next generation takes every rank's state from memory, its own or a
data-parallel peer's, at the newest step the job completed: no completed
step is lost. Where no live rank holds a rank's state at that step (dp = 1,
all its replicas lost, or optimizer.distributed, whose optimizer shards live
in one rank's memory only) the job resumes from the checkpoint tiers, and
the event says why. docs/fault-tolerance.md ("Live replacement")."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.collectives import Collectives, own_group
from megaresil.checkpoint.local.moves import move_shards
from megaresil.checkpoint.local.replication import transfers
from megaresil.checkpoint.local.shard import (Shard, add_checksums, saved_run_record, shard_meta,
                                              shard_rects, stage, unpack_into)
from megaresil.checkpoint.state import RunRecord, TrainingState
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.replicas import replica_groups


class LiveStateDamaged(RuntimeError):
    """A peer's state arrived damaged (its checksums fail)."""


def carried_state(state: TrainingState, rank: int, world: int) -> Shard:
    """This rank's state, staged into host memory as a shard of its own."""
    buffer, records = stage(shard_rects(state), None)
    meta = shard_meta(state.run_record(), rank, world, state.rng_state(), records)
    add_checksums(buffer, meta["rects"])
    return Shard(meta, buffer)


@dataclass
class LivePlan:
    """The step every rank takes from memory and from whom (owner ->
    holder); step None when the live state does not serve, and why not
    (empty when no rank carried any: an ordinary start or restart)."""
    step: Optional[int]
    sources: dict[int, int] = field(default_factory=dict)
    why_not: str = ""
    bytes_moved: int = 0  # what crosses between ranks (gather_live_plan)

    @property
    def serves(self) -> bool:
        return self.step is not None


def live_plan(steps: list[Optional[int]], groups: list[list[int]], replicated: bool,
              why_unreplicated: str = "") -> LivePlan:
    """`steps[r]`: the step rank r's carried state is at (None: it carries
    none: a replacement, or a rank caught mid-update); `groups`: the
    data-parallel groups, whose members hold the same state at the same
    step when `replicated`. Every rank takes the newest carried step: its
    own state when it is there, else the lowest-ranked member of its group
    that is."""
    held = [s for s in steps if s is not None]
    if not held:
        return LivePlan(None)
    target = max(held)
    sources, missing = {}, []
    for group in groups:
        at_target = [r for r in group if steps[r] == target]
        for rank in group:
            if steps[rank] == target:
                sources[rank] = rank
            elif at_target and replicated:
                sources[rank] = at_target[0]
            else:
                missing.append(rank)
    if missing:
        why = why_unreplicated if not replicated else \
            "no live data-parallel peer holds it (dp = 1, or its replicas were lost too)"
        return LivePlan(None, why_not=f"no live rank holds rank(s) {sorted(missing)}'s state at "
                                      f"step {target}: {why}")
    return LivePlan(target, sources)


def gather_live_plan(carried: Optional[Shard], layout: ParallelLayout, replicated: bool,
                     why_unreplicated: str) -> LivePlan:
    """Collective: every rank's carried step and size, and the plan made of
    them (the same on every rank). Made before the ranks build their models,
    so a model whose state comes from memory is not drawn only to be
    overwritten (train/model_build)."""
    held = [None] * layout.world_size  # each rank's (step, bytes) carried, or None
    dist.all_gather_object(held, (carried.step, carried.data.numel()) if carried else None)
    plan = live_plan([h[0] if h else None for h in held], replica_groups(layout), replicated,
                     why_unreplicated)
    plan.bytes_moved = sum(held[h][1] for o, h in plan.sources.items() if o != h)
    return plan


def recover_live(state: TrainingState, carried: Optional[Shard], plan: LivePlan,
                 rank: int, device: torch.device) -> RunRecord:
    """Collective: the ranks whose state is behind or lost receive a peer's
    (point to point, on a group and thread of their own); every rank loads
    its state at the plan's step."""
    moves = transfers(plan.sources)
    shard = carried if plan.sources[rank] == rank else None
    members = sorted({r for move in moves for r in move})
    if rank in members:
        shard = receive_or_send(carried, moves, members, rank, plan.step, device) or shard
    unpack_into(shard, shard_rects(state))
    saved = saved_run_record(shard)
    state.restore(saved)
    return saved


def receive_or_send(carried: Optional[Shard], moves: list[tuple[int, int]], members: list[int],
                    rank: int, step: int, device: torch.device) -> Optional[Shard]:
    """The moves, on a group of the ranks in them only (the others go on
    at once: a group of all ranks saw those leave and tear it down while
    the rest still connected) and a thread that owns it (the training
    thread only waits, in slices a hang abort can reach); what this rank
    received, if anything. A barrier ends it, so no member tears the group
    down under another still receiving."""
    group = dist.new_group(members, use_local_synchronization=True)
    owner = ThreadPoolExecutor(1, initializer=own_group, initargs=(group, device))
    coll = Collectives(group, owner)
    try:
        received = move_shards(coll, moves, {receiver: carried for holder, receiver in moves
                                             if holder == rank},
                               f"rank {rank}'s state of step {step}")
        coll.barrier()
        return received
    except fmt.CheckpointError as err:  # the wire, not the checkpoints: a restart cures it
        raise LiveStateDamaged(f"{err}; restarting from the checkpoints") from None
    finally:
        owner.shutdown()
        dist.destroy_process_group(group)
