"""Silent data corruption: after an update every data-parallel replica holds
the same parameters (and, unless optimizer.distributed, the same optimizer
state): dense parameters over dp, experts over edp (same ep coordinate).
Every resilience.numerics.check_interval steps each rank sums its weights'
bit patterns (any one changed element changes the sum), and before every
save, or once those sums differ, its whole replicated state's, per tensor,
with their squares; one world all-gather compares each group's replicas.
A replica outvoted by a majority (3 or more replicas) gets the tensors that
differ from a healthy one; with no majority (2) the run rolls back to its
newest checkpoint and replays: the replica whose replayed state differs from
what it held was the corrupted one. With live replacement, each check also
sums what a hand-over would send (`donated`), and the sum the replicas last
agreed on is kept: a donor proves its state with it (train/handover.py).
docs/numerics.md, docs/fault-tolerance.md#live-replacement."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megaresil.parallel.layout import ParallelLayout
from megaresil.resilience.numerics import odd_ones_out
from megaresil.resilience.step_faults import INT_VIEWS

Named = Sequence[tuple[str, torch.Tensor]]
# A rank's replicated tensors, named, by the data-parallel axes they are replicated over.
Replicated = Mapping[tuple[str, ...], Named]
# A replica group's verdict, by (its axes, its ranks).
Verdicts = dict[tuple[tuple[str, ...], tuple[int, ...]], Optional[list[int]]]
Section = Callable[[str, int], ContextManager]


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the elements' bit patterns: of the patterns (one
    changed element always changes it), and of their squares wrapped to the
    element's width, so that many small changes (a replica whose clipping
    differed: +1 unit in the last place here, -1 there) do not cancel out in
    both. Each is one pass the memory system streams; a hash (xxh3) would
    need a copy to the host or a kernel of our own."""
    bits = tensor.detach().reshape(-1).view(INT_VIEWS[tensor.element_size()])
    return torch.stack([bits.sum(dtype=torch.int64), (bits * bits).sum(dtype=torch.int64)])


def checksums(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(tensors, 2) int64: each tensor's tensor_checksum."""
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64, device=device)
    # .to(device): AdamW keeps its step count on the host even on a GPU.
    return torch.stack([tensor_checksum(t).to(device) for t in tensors])


def word_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum, wrapped to 64 bits, of the tensor's bytes read as int64 words
    (the few elements that do not fill an aligned word widened one by one).
    Any one changed element changes it: its word changes by less than 2**64.
    Reading the bytes as words, rather than widening each element to int64
    first, is ~10x faster on the CPU."""
    flat = tensor.detach().reshape(-1)
    per_word = 8 // flat.element_size()
    if flat.storage_offset() % per_word:
        # view(int64) needs an aligned start; a copy keeps the words starting
        # at element 0, so equal contents give equal sums wherever they lie.
        flat = flat.clone()
    whole = flat.numel() - flat.numel() % per_word
    words = flat[:whole].view(torch.int64).sum()
    return words + flat[whole:].view(INT_VIEWS[flat.element_size()]).sum(dtype=torch.int64)


def quick_checksum(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(1, 1) int64: every tensor's word_sum, added up: one read of each
    tensor. Any one changed element changes it; what it could miss (changes
    that cancel out) is what the full check, before every save, is for."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for t in tensors:
        total += word_sum(t).to(device)
    return total.reshape(1, 1)


@dataclass(frozen=True)
class Agreement:
    """The last replica check this rank's group passed: its step, and the
    quick_checksum of what a hand-over would send that every replica of the
    group held then. A state whose sum is this one at this step is one the
    replicas agreed on; the state changes with each update, so it proves
    nothing about a later step."""
    step: int
    digest: int


@dataclass
class Part:
    """This rank's tensors replicated over `axes`, their sums, and the
    replica groups over `axes`."""
    axes: tuple[str, ...]
    groups: list[list[int]]
    named: Named
    sums: torch.Tensor  # (tensors, 2) in a full check, else (1, 1)

    def group_of(self, rank: int) -> list[int]:
        return next(g for g in self.groups if rank in g)


@dataclass
class Suspicion:
    """A mismatch with no majority, waiting for the replay to reach its step."""
    step: int
    sums: torch.Tensor  # this rank's per-tensor sums when it was found
    groups: list[list[int]]  # the replica groups whose replicas differed


def replay_culprits(groups: Sequence[Sequence[int]],
                    changes: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """From a replay: the ranks to blame, and the replica groups it cannot
    tell apart. In a group whose replicas differed, a replica whose
    replayed state differs from what it held was corrupted, and one whose
    state is the same is healthy: deterministic training computed the same
    bits. When every replica of the group changed, the corruption had
    reached all of them (a corrupted replica's gradients enter every
    replica's mean: check_interval > 1 lets forward passes use a flipped
    weight before the check), and blaming any would blame a healthy one.
    Ranks outside those groups are not blamed: a change there is the
    corruption's reach through tensor or pipeline parallelism, not a fault
    of their own."""
    culprits, unresolved = [], []
    for group in groups:
        changed = [rank for rank in group if changes[rank]]
        if len(changed) == len(group):
            unresolved.append(list(group))
        else:
            culprits += changed
    return sorted(culprits), unresolved


class ReplicaCheck:
    """`check(step)` compares the replicas; True when it rolled the run back
    (the caller goes on from the checkpoint's step)."""

    def __init__(self, interval: int, layout: ParallelLayout, state: Callable[[bool], Replicated],
                 events, rollback: Callable[[int, str], None], section: Section, *,
                 donated: Optional[Callable[[], Sequence[torch.Tensor]]] = None,
                 agreement: Optional[Agreement] = None):
        """`state(full)`: this rank's replicated tensors, named, in the same
        order on every replica, by the axes they are replicated over
        (ParallelLayout.replica_axes): the weights, and with `full` their
        optimizer state too; `rollback(step, reason)`: back to the newest
        checkpoint (it raises when there is none); `section`: the
        supervision's (the comparison's collectives run under the watchdog);
        `donated`: what a hand-over would send (live replacement), compared
        at every check within the groups whose whole state is alike (the
        last axes') and kept as `agreement` once the group agrees on it;
        `agreement`: where a generation starts from a proven state."""
        self.interval, self.layout, self.state = interval, layout, state
        self.events, self.rollback, self.section = events, rollback, section
        self.donated, self.agreement = donated, agreement
        self.suspicion: Optional[Suspicion] = None

    def due(self, step: int, saving: bool) -> bool:
        if self.interval == 0 or self.layout.size(*self.layout.replica_axes()[0]) == 1:
            return False
        return saving or step % self.interval == 0 or self.replaying(step)

    def replaying(self, step: int) -> bool:
        return self.suspicion is not None and step == self.suspicion.step

    def check(self, step: int, saving: bool) -> bool:
        """Between saves the weights, with one sum per rank; before a save,
        at a replay's step, or once the quick sums differ, everything, with
        two sums per tensor."""
        with self.section("optimizer", step):
            full = saving or self.replaying(step)
            verdicts = self.compare(step, full)
            if not full:
                assert verdicts is not None  # only a full check finds no majority
                if any(v != [] for v in verdicts.values()):
                    verdicts = self.compare(step, full=True)
        if verdicts is None:
            self.forget()
            self.rollback(step, "silent_corruption")
            return True
        return False

    def forget(self) -> None:
        """The state went back to a checkpoint: what replays to a step
        agreed on before may differ from it (a rollback that skipped batches),
        so no agreement holds until the next check."""
        self.agreement = None

    def compare(self, step: int, full: bool) -> Optional[Verdicts]:
        """The replica groups' verdicts, after restoring outvoted replicas
        (full checks only); None when some group has no majority (a replay
        must tell)."""
        parts = self.parts(full)
        device = self.layout.device
        sums = torch.cat([part.sums for part in parts])
        replayed = self.suspicion if self.replaying(step) else None
        changed = replayed is not None and not torch.equal(sums, replayed.sums)
        donated = (quick_checksum(self.donated(), device).reshape(1) if self.donated
                   else torch.zeros(0, dtype=torch.int64, device=device))
        mine = torch.cat([part.sums.sum(0) for part in parts]
                         + [donated, torch.tensor([int(changed)], device=device)])
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        rows = [g.tolist() for g in gathered]
        if replayed is not None:
            self.attribute(step, replayed, [row[-1] for row in rows])
        verdicts = self.verdicts(parts, rows, width=2 if full else 1)
        if all(v == [] for v in verdicts.values()):
            self.agree(step, parts[-1], rows, verdicts)
        if all(v == [] for v in verdicts.values()) or not full:
            return verdicts
        if all(v is not None for v in verdicts.values()):
            for part in parts:
                group = part.group_of(self.layout.rank)
                self.restore(step, part, group, verdicts[part.axes, tuple(group)])
            self.agree(step, parts[-1], rows, verdicts)
            return verdicts
        bad = [list(g) for (_, g), v in verdicts.items() if v != []]
        self.suspicion = Suspicion(step, sums, bad)
        self.emit_once("silent_corruption_detected", step=step, culprit=None, replicas=bad,
                       how="no majority", next=f"rolling back to replay up to step {step} and "
                       "tell which replica is wrong")
        return None

    def parts(self, full: bool) -> list[Part]:
        """This rank's replicated state by the axes it is replicated over,
        each with its sums; axes of one rank (experts at ep = dp) hold no
        replica and are left out."""
        state, device = self.state(full), self.layout.device
        parts = []
        for axes in self.layout.replica_axes():
            if self.layout.size(*axes) == 1:
                continue
            named = list(state.get(axes, ()))
            tensors = [t for _, t in named]
            sums = checksums(tensors, device) if full else quick_checksum(tensors, device)
            parts.append(Part(axes, self.layout.replica_groups(axes), named, sums))
        return parts

    @staticmethod
    def verdicts(parts: Sequence[Part], rows: Sequence[list[int]], width: int) -> Verdicts:
        """Each group's odd ones out (numerics.odd_ones_out) by its part's
        columns of the gathered rows (`width` per part); the last part's
        digest takes what a hand-over would send too: the whole state, alike
        only within its groups."""
        verdicts: Verdicts = {}
        for i, part in enumerate(parts):
            end = (i + 1) * width if i < len(parts) - 1 else -1
            digests = [tuple(row[i * width:end]) for row in rows]
            for group in part.groups:
                verdicts[part.axes, tuple(group)] = odd_ones_out([digests[r] for r in group])
        return verdicts

    def agree(self, step: int, whole: Part, rows: Sequence[list[int]],
              verdicts: Verdicts) -> None:
        """Keep what this rank's group agreed on at `step` (after any
        restore: what its healthy replicas hold) for a donor's proof; `whole`:
        the part whose groups hold the whole state alike."""
        if self.donated is None:
            return
        group = whole.group_of(self.layout.rank)
        outvoted = verdicts[whole.axes, tuple(group)] or []
        healthy = next(r for i, r in enumerate(group) if i not in outvoted)
        self.agreement = Agreement(step, rows[healthy][-2])

    def broadcast(self, tensor: torch.Tensor, src: int, axes: tuple[str, ...]) -> None:
        """`tensor` := src's, within its group over `axes`, through the
        device (NCCL takes no host tensor)."""
        on_device = tensor.detach().to(self.layout.device)
        dist.broadcast(on_device, src=src, group=self.layout.group(*axes))
        if on_device.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(on_device)

    def emit_once(self, event: str, **fields) -> None:
        if self.layout.rank == 0:
            self.events.emit(event, **fields)

    def attribute(self, step: int, replayed: Suspicion, changes: Sequence[int]) -> None:
        """At the replay's step: the ranks whose state differs from what
        they held before the rollback were the corrupted ones, in the groups
        whose replicas differed (replay_culprits)."""
        culprits, unresolved = replay_culprits(replayed.groups, changes)
        self.suspicion = None
        said = {}
        if unresolved:
            said = dict(unresolved=unresolved, why=(
                "every replica of those changed on replay: the corrupted one's gradients reached "
                "them all before the check (resilience.numerics.check_interval="
                f"{self.interval}), so no replay can tell which; check_interval=1 finds a flip "
                "before any forward pass uses it"))
        self.emit_once("silent_corruption_attributed", step=step, culprit=culprits, how="replay",
                       **said, next="the rollback restored every replica; training on")

    def restore(self, step: int, part: Part, group: list[int],
                outvoted: Optional[list[int]]) -> None:
        """Each outvoted replica of this rank's `group` gets the tensors of
        `part` that differ from a healthy one's, by broadcast on the group's
        own process group (the ranks of the other groups take no part)."""
        if not outvoted:
            return
        everyone = [torch.empty_like(part.sums) for _ in group]
        dist.all_gather(everyone, part.sums, group=self.layout.group(*part.axes))
        healthy = next(i for i in range(len(group)) if i not in outvoted)
        differ = [i for i in range(len(part.named))
                  if any(not torch.equal(everyone[o][i], everyone[healthy][i]) for o in outvoted)]
        for i in differ:
            self.broadcast(part.named[i][1], src=group[healthy], axes=part.axes)
        if self.layout.rank == group[healthy]:  # each group's own report
            self.events.emit("silent_corruption_detected", step=step,
                             culprit=[group[o] for o in outvoted],
                             tensors=[part.named[i][0] for i in differ][:8],
                             differing_tensors=len(differ), how="majority",
                             next=f"restored from rank {group[healthy]}; training on")
