"""Live replacement, the trainer's side: a rank that lost a peer keeps its
state in host memory for the next generation (its tensors, described as a
local-tier shard), and the next generation takes every rank's state from memory, its own or a
data-parallel peer's (under expert parallelism one of the same ep
coordinate: it holds the same experts), at the newest step the job
completed: no completed step is lost. A state that moves to another rank must be proven first
(`proof`): the one its replicas last agreed on, or one its live replicas
agree on now; copied unproven, a corruption would reach every replica and no
check could see it again. Where no live rank holds a rank's state at that
step, or none that is proven (dp = 1, all its replicas lost, a donor newer
than the replicas' last agreement, or optimizer.distributed, whose optimizer
shards live in one rank's memory only) the job resumes from the checkpoint
tiers, and the event says why. docs/fault-tolerance.md ("Live replacement")."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint import transfer
from megaresil.checkpoint.collectives import Collectives, own_group
from megaresil.checkpoint.keys import MOMENTS, moment_key
from megaresil.checkpoint.local.replication import transfers
from megaresil.checkpoint.local.shard import (
    matched,
    rect_records,
    saved_run_record,
    shard_meta,
    shard_rects,
    stage,
    view_of,
)
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.staging import StagingCopy
from megaresil.checkpoint.state import RunRecord, TrainingState
from megaresil.compat import viewed
from megaresil.config import RecipeConfig, no_live_copy
from megaresil.errors import MegaresilError
from megaresil.parallel.grad_groups import shards_over_dp
from megaresil.parallel.layout import ParallelLayout, use_device
from megaresil.resilience.numerics import odd_ones_out
from megaresil.train.replicas import Agreement, quick_checksum


class LiveStateDamaged(MegaresilError, RuntimeError):
    """A peer's state arrived damaged (its checksums fail)."""


@dataclass
class Carried:
    """A rank's state kept for the next generation, in host memory: each
    record of a local shard's meta (checksums are taken when it is sent)
    with its tensor. On the CPU the tensors are the trainer's own, kept, not
    copied: the hand-over costs nothing, the next generation's state adopts
    them (`whole`) instead of copying them in, and the trainer they came
    from is let go at once, its process groups with it, which frees a peer
    blocked in one of them (it waited for this rank's copy before). On a GPU
    they are staged to the host: a second copy of the state may not fit on
    the device."""
    meta: dict  # shard_meta's fields
    tensors: list[torch.Tensor]  # contiguous, one for each of meta["rects"]
    whole: dict[str, torch.Tensor] = field(default_factory=dict)  # by key: the trainer's own
    digest: int = 0  # quick_checksum of `tensors`, what the replica check compares
    agreed: Optional[Agreement] = None  # the last agreement of its trainer's replicas

    @property
    def step(self) -> int:
        return self.meta["step"]

    @property
    def nbytes(self) -> int:
        return sum(rec["nbytes"] for rec in self.meta["rects"])


# How long a GPU rank waits for its state to land on the host after a failure.
LANDING_S = 10.0


def donated_tensors(state: TrainingState) -> list[torch.Tensor]:
    """What a hand-over of `state` carries, in its order: the replica check
    sums these (ReplicaCheck's `donated`) as carried_state does."""
    return [r.tensor for r in shard_rects(state)]


def carried_state(state: TrainingState, rank: int, world: int,
                  agreed: Optional[Agreement] = None) -> Optional[Carried]:
    """This rank's state, kept in host memory for the next generation, with
    its sum and `agreed`, the last agreement of its replicas (its proof);
    None when a GPU's copy did not land within LANDING_S (queued behind a
    hung kernel): the rank carries nothing and the job resumes from the
    checkpoints. The sum is taken of the host copy: a device a lost peer left
    hanging would never run it."""
    rects = shard_rects(state)
    if all(r.tensor.device.type == "cpu" for r in rects):
        records, _ = rect_records(rects)
        tensors = [r.tensor.detach().contiguous() for r in rects]
        whole = {r.key: viewed(r.tensor) for r in rects}  # a rect of vocabulary rows is a view
    else:
        copy = StagingCopy.of([r.tensor for r in rects])
        buffer, records = stage(rects, None, copy)
        if not copy.landed_within(LANDING_S):  # enqueued on a side stream
            return None
        tensors, whole = [view_of(buffer, rec) for rec in records], {}
    meta = shard_meta(state.run_record(), rank, world, state.rng_state(), records)
    digest = int(quick_checksum(tensors, torch.device("cpu")))
    return Carried(meta, tensors, whole, digest, agreed)


@dataclass(frozen=True)
class Held:
    """What one rank carries, as every rank sees it when the plan is made."""
    step: int
    nbytes: int
    digest: int
    agreed: Optional[tuple[int, int]] = None  # Agreement's (step, digest)

    @classmethod
    def of(cls, carried: Carried) -> "Held":
        agreed = (carried.agreed.step, carried.agreed.digest) if carried.agreed else None
        return cls(carried.step, carried.nbytes, carried.digest, agreed)

    @property
    def vouched(self) -> bool:
        """Its state is the one its replicas agreed on at its step."""
        return self.agreed == (self.step, self.digest)


@dataclass
class LivePlan:
    """The step every rank takes from memory and from whom (owner ->
    holder); step None when the live state does not serve, and why not
    (empty when no rank carried any: an ordinary start or restart)."""
    step: Optional[int]
    sources: dict[int, int] = field(default_factory=dict)
    why_not: str = ""
    bytes_moved: int = 0  # what crosses between ranks (plan_live_start)
    # By rank: the sum of the proven state it takes (none where nothing was
    # proven), the next generation's agreement until its first check.
    proven: dict[int, int] = field(default_factory=dict)
    # Ranks whose own state at the newest step carried is disproven: it
    # differs from the proven one, or from the one its replicas agreed on then.
    corrupted: list[int] = field(default_factory=list)
    newest: Optional[int] = None  # the newest step carried
    replicated: bool = True  # every replica holds the whole state (a donor could send it)

    def agreement(self, rank: int) -> Optional[Agreement]:
        if rank not in self.proven:
            return None
        assert self.step is not None  # a plan proves states only where it serves
        return Agreement(self.step, self.proven[rank])

    @property
    def serves(self) -> bool:
        return self.step is not None


def live_plan(held: list[Optional[Held]], groups: list[list[int]], replicated: bool,
              why_unreplicated: str = "", prove: bool = False) -> LivePlan:
    """`held[r]`: what rank r carries (None: nothing: a replacement, or a
    rank caught mid-update); `groups`: the data-parallel groups
    (ParallelLayout.whole_state_groups), whose members hold the same state
    at the same step when `replicated`. Every
    rank takes the newest carried step: its own state when it is there,
    else that of the lowest-ranked member of its group that is. With
    `prove` (the replica check runs) only a proven state moves, and a
    member whose own state is disproven takes the proven one too; a group
    with nothing to move and nothing proven keeps its own states, which the
    replica check compares as ever."""
    steps = [h.step if h else None for h in held]
    if all(s is None for s in steps):
        return LivePlan(None)
    target = max(s for s in steps if s is not None)
    plan, whys, unproven = LivePlan(target, newest=target), [], False
    for group in groups:
        at_target = [r for r in group if steps[r] == target]
        truth = proof(at_target, held) if prove and replicated else None
        if prove and replicated:
            plan.corrupted += [r for r in at_target if disproven(carried_by(held, r), truth)]
        if truth is not None:
            trusted = [r for r in at_target if carried_by(held, r).digest == truth]
            plan.proven.update(dict.fromkeys(group, truth))
        elif prove and replicated and len(at_target) < len(group):
            trusted = []  # a state would move, and none is proven
        else:
            trusted = at_target
        for rank in group:
            if rank in trusted:
                plan.sources[rank] = rank
            elif trusted and replicated:
                plan.sources[rank] = trusted[0]
        if any(r not in plan.sources for r in group):
            unproven |= bool(replicated and at_target)
            whys.append(why_lacking(at_target, held, target, replicated, why_unreplicated))
    missing = sorted(r for r in range(len(held)) if r not in plan.sources)
    if missing:
        holds = "holds a proven copy of" if unproven else "holds"
        return LivePlan(None, why_not=f"no live rank {holds} rank(s) {missing}'s state at step "
                                      f"{target}: {'; '.join(dict.fromkeys(whys))}",
                        corrupted=plan.corrupted, newest=target)
    return plan


def carried_by(held: list[Optional[Held]], rank: int) -> Held:
    """What `rank` carries, for a rank known to carry something (one at a
    step carried, or a holder the plan sends from)."""
    found = held[rank]
    assert found is not None
    return found


def disproven(held: Held, truth: Optional[int]) -> bool:
    """Whether a state at the newest step is shown corrupted: it differs from
    the proven one, or from the one its replicas agreed on at its step."""
    if truth is not None:
        return held.digest != truth
    return held.agreed is not None and held.agreed[0] == held.step and not held.vouched


def proof(at_target: list[int], held: list[Optional[Held]]) -> Optional[int]:
    """The sum of the state a group's members at the newest step can prove:
    the one their replicas agreed on at that step, else one two or more of
    them hold and no other as many (two replicas that computed the same
    bits are healthy); None when none can be shown."""
    vouched = [carried_by(held, r).digest for r in at_target if carried_by(held, r).vouched]
    if vouched:
        return vouched[0]
    digests = [carried_by(held, r).digest for r in at_target]
    outliers = odd_ones_out(digests) if len(digests) >= 2 else None
    if outliers is None:
        return None
    return next(d for i, d in enumerate(digests) if i not in outliers)


def why_lacking(at_target: list[int], held: list[Optional[Held]], target: int,
                replicated: bool, why_unreplicated: str) -> str:
    """Why a group's members not at the newest step cannot take it from a peer."""
    if not replicated:
        return why_unreplicated
    if not at_target:
        return "no live data-parallel peer holds it (dp = 1, or its replicas were lost too)"
    if len(at_target) > 1:
        return f"the copies on ranks {at_target} differ and no replica check vouches for one"
    rank = at_target[0]
    agreed = carried_by(held, rank).agreed
    if agreed is not None and agreed[0] == target:
        return (f"rank {rank}'s copy differs from the one its replicas agreed on at that step "
                "(silent data corruption since): a copy would spread it")
    since = f"its replicas last agreed at step {agreed[0]}" if agreed else \
        "no replica check passed in this generation"
    return (f"rank {rank}'s copy cannot be proven ({since}, and no other live replica holds "
            f"step {target} to compare it with; resilience.numerics.check_interval=1 checks "
            "every step)")


def plan_live_start(cfg: RecipeConfig, carried: Optional[Carried],
                    layout: ParallelLayout) -> Optional[LivePlan]:
    """Collective, with live replacement on (else None): what every rank
    carries, and where each rank's state comes from in this generation (the
    same plan on every rank). Made before the ranks build their models, so a
    model whose state comes from memory is not drawn only to be overwritten
    (train/model_build). A donor proves its state where the replica check
    runs."""
    if not cfg.resilience.replacement.enabled:
        return None
    held: list[Optional[Held]] = [None] * layout.world_size
    dist.all_gather_object(held, Held.of(carried) if carried else None)
    # Full sharding (parallel.dp_shard = dp) leaves no peer a copy either:
    # said in its own words, not as dp = 1's (config.no_live_copy).
    fully_sharded = no_live_copy(cfg) if layout.dp_shard > 1 else None
    replicated = not shards_over_dp(cfg.optimizer, layout) and fully_sharded is None
    why = (fully_sharded.why if fully_sharded else
           "optimizer.distributed keeps each rank's optimizer shard in its own memory only")
    plan = live_plan(held, layout.whole_state_groups(), replicated, why_unreplicated=why,
                     prove=cfg.resilience.numerics.check_interval > 0)
    plan.bytes_moved = sum(carried_by(held, h).nbytes for o, h in plan.sources.items() if o != h)
    plan.replicated = replicated
    return plan


def recover_live(state: TrainingState, carried: Optional[Carried], plan: LivePlan,
                 rank: int, device: torch.device) -> RunRecord:
    """Collective: the ranks whose state is behind or lost receive a peer's
    (point to point, on a group and thread of their own); every rank loads
    its state at the plan's step. A rank whose own state serves adopts the
    tensors it carried (on the CPU) and copies in the rest (on a GPU, all of
    it) on a thread of its own, while it sends: both only read what it
    carries, and a receiver waits for the sending, not for the copy."""
    assert plan.step is not None  # only a plan that serves is recovered from
    # This rank's own state, where it serves it; then it receives nothing.
    mine = carried if plan.sources[rank] == rank else None
    moves = transfers(plan.sources)
    state.adopt(mine.whole if mine is not None else blank_moments(state))
    targets = shard_rects(state)
    members = sorted({r for move in moves for r in move})
    with ThreadPoolExecutor(1, initializer=use_device, initargs=(device,)) as copier:
        own = copier.submit(fill_from, mine, targets) if mine is not None else None
        received = None
        if rank in members:
            received = receive_or_send(carried, moves, members, rank, plan.step, targets, device)
        if own is not None:
            own.result()
    if not received:
        assert mine is not None  # a rank that received nothing serves itself
        received = mine.meta
    saved = saved_run_record(received)
    state.restore(saved)
    return saved


def blank_moments(state: TrainingState) -> dict[str, torch.Tensor]:
    """Uninitialised moments for every parameter of a rank about to receive
    its whole state: the optimizer's zeros would all be overwritten (0.03-0.04 s
    of a 1 GB state's receiver, measured alone)."""
    return {moment_key(m, key): torch.empty_like(param)
            for key, param in state.named_parameters() for m in MOMENTS}


def fill_from(carried: Carried, targets: list[Rect]) -> None:
    """This rank's `targets` from its own carried state (but those that
    adopted it: the same storage)."""
    with torch.no_grad():
        for (_, target), tensor in zip(matched(carried.meta, targets), carried.tensors):
            if target.tensor.data_ptr() != tensor.data_ptr():
                target.tensor.copy_(tensor)


def receive_or_send(carried: Optional[Carried], moves: list[tuple[int, int]], members: list[int],
                    rank: int, step: int, targets: list[Rect],
                    device: torch.device) -> Optional[dict]:
    """The moves, on a group of the ranks in them only (the others go on
    at once: a group of all ranks saw those leave and tear it down while
    the rest still connected) and a thread that owns it (the training
    thread only waits, in slices a hang abort can reach); the meta of what
    this rank received into its `targets`, if anything. A barrier ends it,
    so no member tears the group down under another still receiving."""
    group = dist.new_group(members, use_local_synchronization=True)
    owner = ThreadPoolExecutor(1, initializer=own_group, initargs=(group, device))
    coll = Collectives(group, owner)
    try:
        received = move_state(coll, moves, carried, targets)
        coll.barrier()
        return received
    except fmt.CheckpointError as err:  # the wire, not the checkpoints: a restart cures it
        raise LiveStateDamaged(f"rank {rank}'s state of step {step}: {err}; restarting from "
                               "the checkpoints") from None
    finally:
        owner.shutdown()
        dist.destroy_process_group(group)


def move_state(coll: Collectives, moves: list[tuple[int, int]], carried: Optional[Carried],
               targets: list[Rect]) -> Optional[dict]:
    """Collective over `coll` (checkpoint/transfer.py): for each (holder,
    receiver) in `moves` the holder sends its carried state and the
    receiver takes each tensor straight into its own target (through a host
    tensor where the target is not one), checked against the holder's
    checksums. The meta received, or None for a rank that only sends."""
    landed_in: list[Rect] = []  # the targets matched to the holder's records, in its order

    def land(meta: dict) -> list[torch.Tensor]:
        landed_in.extend(target for _, target in matched(meta, targets))
        return [landing(target.tensor) for target in landed_in]

    outgoing: dict[int, transfer.Outgoing] = {}
    for holder, receiver in moves:
        if holder == coll.rank:
            assert carried is not None  # the plan picks holders among the ranks that carry
            outgoing[receiver] = transfer.Outgoing(carried.meta, carried.tensors)
    received = transfer.move(coll, moves, outgoing, land, "it")
    if not received:
        return None
    (got,) = received.values()  # a rank's state comes from one holder
    for target, arrived in zip(landed_in, got.pieces):
        if arrived is not target.tensor:
            with torch.no_grad():
                target.tensor.copy_(arrived)
    return got.meta


def landing(target: torch.Tensor) -> torch.Tensor:
    """Where a received tensor lands: the target itself when the wire
    (gloo, host memory) can write it in place."""
    if target.device.type == "cpu" and target.is_contiguous():
        return target
    return torch.empty(target.shape, dtype=target.dtype)
