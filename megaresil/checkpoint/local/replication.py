"""Who holds whose local shards, and how they move between ranks.

Pure bookkeeping (no I/O, no process group): the node topology (node = the
ranks of one launcher agent, or `ranks_per_node` simulated on one machine),
which peers a rank replicates to, which local step every rank can recover
and from whom, and whether a save fits in the ranks' storage. Shards move
between ranks through checkpoint/transfer.py.

A rank's replicas go to the rank with the same local rank on the next
`replicas` nodes (ring order), so every node holds exactly `replicas` copies
of each other node's shards and losing any `replicas` nodes loses no shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Topology:
    world: int
    ranks_per_node: int
    replicas: int  # requested; `copies` is what the node count allows

    def __post_init__(self):
        if self.world % self.ranks_per_node:
            raise ValueError(f"checkpoint.local.ranks_per_node: {self.ranks_per_node} does not "
                             f"divide the world size {self.world}. Fix: choose a divisor of "
                             f"{self.world} (or 0 to read LOCAL_WORLD_SIZE)")

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    @property
    def copies(self) -> int:
        """Replicas actually kept: one per other node at most."""
        return min(self.replicas, self.nodes - 1)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def peers(self, rank: int) -> list[int]:
        """The ranks that hold copies of `rank`'s shards."""
        return [(rank + i * self.ranks_per_node) % self.world for i in range(1, self.copies + 1)]

    def sources(self, rank: int) -> list[int]:
        """The ranks whose shards `rank` holds copies of (same order as peers)."""
        return [(rank - i * self.ranks_per_node) % self.world for i in range(1, self.copies + 1)]


def ranks_per_node(configured: int, world: int, local_world_size: Optional[int]) -> int:
    """`checkpoint.local.ranks_per_node`, or the launcher agent's
    LOCAL_WORLD_SIZE, or (neither) the whole world on one node; never more
    than the world."""
    if configured:
        return min(world, configured)
    return min(world, local_world_size) if local_world_size else world


# --- choosing the step ----------------------------------------------------------------

# What a rank reports holding: {step: {owner rank: None (valid) or why not}}.
Holdings = dict[int, dict[int, Optional[str]]]


@dataclass
class Choice:
    """The newest local step every rank can recover, and from whom."""
    step: Optional[int]
    sources: dict[int, int]  # owner rank -> the rank that provides its shard
    skipped: list[str]  # newer steps that could not be used, and why


def complete_step(reports: list[Holdings], world: int) -> Choice:
    """The newest step for which every owner rank has a valid shard on some
    rank; each owner takes its own copy when valid, else the lowest-ranked
    holder of a valid replica."""
    skipped: list[str] = []
    for step in sorted({s for report in reports for s in report}, reverse=True):
        holders: dict[int, list[int]] = {owner: [] for owner in range(world)}
        problems = []
        for rank, report in enumerate(reports):
            for owner, problem in report.get(step, {}).items():
                if owner not in holders:
                    problems.append(f"rank {rank} holds a shard of rank {owner}, outside the world")
                elif problem is None:
                    holders[owner].append(rank)
                else:
                    problems.append(f"rank {rank}'s copy of rank {owner}: {problem}")
        missing = [owner for owner, found in holders.items() if not found]
        if not missing:
            sources = {owner: owner if owner in found else min(found)
                       for owner, found in holders.items()}
            return Choice(step, sources, skipped)
        detail = f" ({'; '.join(problems[:4])})" if problems else ""
        skipped.append(f"local step {step}: no valid shard of rank(s) {missing}{detail}")
    return Choice(None, {}, skipped)


# A shard's problem when it was saved at another layout: no damage (after an
# elastic shrink every shard has it; the global tier reshards and serves).
OTHER_LAYOUT = "saved at another layout"


def passed_over(reports: list[Holdings], chosen: Optional[int],
                topology: Topology) -> list[tuple[int, int, int, str]]:
    """(node, step, owner, problem) for each damaged copy of the steps looked
    at (the chosen one and newer; all when none was chosen), once per node
    however many of its ranks reported it."""
    found: dict[tuple[int, int, int], str] = {}
    for rank, report in enumerate(reports):
        for step, owners in report.items():
            if chosen is not None and step < chosen:
                continue
            for owner, problem in owners.items():
                if problem is not None and not problem.startswith(OTHER_LAYOUT):
                    found.setdefault((topology.node_of(rank), step, owner), problem)
    return [(*copy, problem) for copy, problem in sorted(found.items())]


def transfers(sources: dict[int, int]) -> list[tuple[int, int]]:
    """(holder, owner) pairs where a shard must move to its owner."""
    return sorted((holder, owner) for owner, holder in sources.items() if holder != owner)


# --- room for a save ---------------------------------------------------------------------

@dataclass
class Space:
    """A rank's view of its local storage at start-up."""
    filesystem: str  # host and device: ranks (simulated nodes too) on one share its room
    directory: str  # the rank's node directory
    free: int  # bytes
    shard: int  # bytes of this rank's own shard


def space_shortfall(spaces: list[Space], topology: Topology) -> Optional[str]:
    """None when one local save fits on every filesystem: the shards of the
    ranks writing there, their own and their replicas of their sources';
    else what is short, for the warning."""
    need: dict[str, int] = {}
    ranks: dict[str, list[int]] = {}
    for rank, space in enumerate(spaces):
        writes = [rank, *topology.sources(rank)]
        need[space.filesystem] = need.get(space.filesystem, 0) + sum(spaces[o].shard
                                                                     for o in writes)
        ranks.setdefault(space.filesystem, []).append(rank)
    for filesystem, needed in need.items():
        first = spaces[ranks[filesystem][0]]
        free = min(spaces[r].free for r in ranks[filesystem])
        if needed > free:
            copies = f" and {topology.copies} replica(s) each" if topology.copies else ""
            return (f"a local save needs {needed:,} bytes on the filesystem of "
                    f"{first.directory} (the shards of rank(s) {ranks[filesystem]}{copies}), "
                    f"{free:,} bytes are free")
    return None
