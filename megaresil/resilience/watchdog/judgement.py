"""Who stopped the job, and whether it is stuck or merely slow. Pure: every
function is given the heartbeats and the time now; none reads a clock or
the store.

A heartbeat is a dict a rank writes to the store: `state` (running|left),
`section`, `step`, `beat` (a counter), `stalled_s` (how long its training
thread has used no CPU), `quiet_s` (how long its peer connections have moved
no byte; absent where not measured), `waiting` (inside torch.distributed) and
`coll` (collectives started per process group), and where measured `node`
(the rank's node) and `at` (wall time written). See docs/watchdog.md."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megaresil.config import SECTIONS, WatchdogConfig

SECTION_ORDER = {name: i for i, name in enumerate(SECTIONS)}
PROGRESS_CPU_SHARE = 0.02  # CPU seconds per wall second below which a thread is not running
STALE_HEARTBEATS = 2.5  # heartbeat intervals without a new beat: the rank's monitor is gone
OPS_PER_HEARTBEAT = 1  # a set
OPS_PER_ABORT_POLL = 1  # a check
# Ranks, spread over the job (one a node from 8 nodes up), that read every
# heartbeat to judge a hang; the others learn of it from the abort poll.
# Every rank judging read world² heartbeats a look (bench/README.md).
HANG_JUDGES = 8


def store_intervals(cfg: WatchdogConfig, world: int) -> tuple[float, float]:
    """(heartbeat, abort poll) intervals, stretched with the world so that
    all ranks together stay under cfg.store_ops_limit."""
    scale = max(1.0, world * (OPS_PER_HEARTBEAT / cfg.heartbeat_s + OPS_PER_ABORT_POLL
                              / cfg.abort_poll_s) / cfg.store_ops_limit)
    return cfg.heartbeat_s * scale, cfg.abort_poll_s * scale


def judges_hangs(rank: int, world: int) -> bool:
    """Whether `rank` is one of the HANG_JUDGES (all ranks up to that world)."""
    judges = min(HANG_JUDGES, world)
    return rank in {i * world // judges for i in range(judges)}


class ProgressMeter:
    """Whether something advances: a thread's CPU time (at least `min_rate`
    CPU seconds per wall second), or with min_rate=0 a byte count (any gain)."""

    def __init__(self, read: Callable[[], float], now: float,
                 min_rate: float = PROGRESS_CPU_SHARE):
        self.read, self.min_rate = read, min_rate
        self.value, self.sampled, self.last_progress = read(), now, now

    def sample(self, now: float) -> None:
        value = self.read()
        gained = value - self.value
        if gained > 0 and gained >= self.min_rate * (now - self.sampled):
            self.last_progress = now
        self.value, self.sampled = value, now

    def stalled_s(self, now: float) -> float:
        """Seconds since it last advanced."""
        return now - self.last_progress


def position(hb: dict) -> tuple[int, int]:
    return hb["step"], SECTION_ORDER[hb["section"]]


def find_culprits(heartbeats: dict[int, dict | None], gone: frozenset = frozenset()) -> list[int]:
    """Ranks that stopped the job; the rest are waiting for them.

    `heartbeats` maps each rank to its latest heartbeat (None: it never wrote
    one this generation), `gone` names ranks whose heartbeat stopped. Ranks
    that left the generation (their own error, a restart) are not culprits.
    Silent ranks are culprits; otherwise the live ranks furthest behind
    (step, then section), ties broken by `blamed_in_collectives`."""
    silent = {r for r, hb in heartbeats.items() if hb is None} | set(gone)
    if silent:
        return sorted(silent)
    live = {r: hb for r, hb in heartbeats.items() if hb is not None and hb["state"] == "running"}
    if not live:
        return []
    least = min(position(hb) for hb in live.values())
    behind = [r for r, hb in live.items() if position(hb) == least]
    return blamed_in_collectives(behind, live) if len(behind) > 1 else behind


def blamed_in_collectives(candidates: list[int], heartbeats: dict[int, dict]) -> list[int]:
    """Of ranks at the same place, the ones the others wait for.

    Every group numbers its collectives in the same order on all members, so
    counts say who has started a collective that whom has not joined. First:
    a rank alone in a collective of a group of three or more, that no other
    member has started, called a collective nobody else calls (the others
    are all blocked elsewhere, waiting for it). Otherwise: the ranks most
    peers wait for (peers ahead of them on a shared group). Two-rank groups
    cannot tell the caller of an unmatched collective from a rank waiting
    for its partner, hence the first rule needs three."""
    unmatched = [r for r in candidates if alone_in_a_collective(r, heartbeats)]
    if unmatched:
        return sorted(unmatched)

    def waiters(rank: int) -> set[int]:
        mine = heartbeats[rank].get("coll", {})
        if not mine:  # no group to be waited on in: skip the walk of every peer
            return set()
        return {peer for peer, hb in heartbeats.items() if peer != rank and any(
            count > mine[name] for name, count in hb.get("coll", {}).items() if name in mine)}
    blame = {r: len(waiters(r)) for r in candidates}
    most = max(blame.values())
    blamed = [r for r in candidates if blame[r] == most]
    # Still tied (no collective tells them apart, e.g. a group being created):
    # the ranks waiting inside torch.distributed wait for those that are not.
    not_waiting = [r for r in blamed if not heartbeats[r].get("waiting")]
    return sorted(not_waiting or blamed)


def alone_in_a_collective(rank: int, heartbeats: dict[int, dict]) -> bool:
    for name, count in heartbeats[rank].get("coll", {}).items():
        others = [hb["coll"][name] for peer, hb in heartbeats.items()
                  if peer != rank and name in hb.get("coll", {})]
        if len(others) >= 2 and all(count > other for other in others):
            return True
    return False


def stuck_or_running(stalled_s: float, stall_s: float, quiet_s: float = float("inf"),
                     quiet_limit: float | None = None) -> str:
    """A rank whose training thread has used no CPU for stall_s is stuck,
    unless its peer connections moved a byte within `quiet_limit` (default
    stall_s; `quiet_s` is how long ago they did): then it waits on a slow
    link, it is not hung. On a congested link a waiting rank's own sockets
    idle for seconds between bytes (0.7-2.5 s seen at 20 Mbit/s), so
    the monitor gives a section's whole budget: that long with no byte is
    no congestion."""
    limit = stall_s if quiet_limit is None else max(stall_s, quiet_limit)
    return "stuck" if stalled_s >= stall_s and quiet_s >= limit else "running"


@dataclass
class Beat:
    """The latest distinct heartbeat seen from a peer, and when it was first seen."""
    record: dict
    seen: float
    fresh: bool  # written after an earlier read: at most one read interval old


class PeerBeats:
    """What this rank has seen of its peers' heartbeats in this generation."""

    def __init__(self, heartbeat_every: float):
        self.stale_after = STALE_HEARTBEATS * heartbeat_every
        self.seen: dict[int, Beat] = {}

    def note(self, beats: dict[int, dict | None], now: float) -> None:
        """Heartbeats just read: a new beat counter restarts a peer's silence."""
        for r, hb in beats.items():
            known = self.seen.get(r)
            if hb is not None and (known is None or known.record["beat"] != hb["beat"]):
                self.seen[r] = Beat(hb, now, fresh=known is not None)

    def gone(self, now: float) -> list[int]:
        """Peers whose heartbeat stopped changing (process killed or frozen)."""
        return [r for r, beat in self.seen.items() if self._stopped(beat, now)]

    def _stopped(self, beat: Beat, now: float) -> bool:
        return beat.record["state"] == "running" and now - beat.seen > self.stale_after

    def state(self, rank: int, now: float, stall_s: float,
              quiet_limit: float | None = None) -> str:
        """stuck, running, or unknown (no heartbeat written since the alarm
        began yet): judged by a heartbeat written since the previous read
        (see stuck_or_running), or by the peer's silence."""
        beat = self.seen.get(rank)
        if beat is None or self._stopped(beat, now):  # one peer's, not gone()'s every peer
            return "stuck"
        if not beat.fresh:
            return "unknown"
        return stuck_or_running(beat.record["stalled_s"], stall_s,
                                beat.record.get("quiet_s", float("inf")), quiet_limit)


def unreachable_nodes(peers: PeerBeats, now: float, mine: str | None) -> list[dict]:
    """Nodes other than this one (`mine`) whose every rank's heartbeat
    stopped: cut off from the store (a partition) or frozen whole, not a
    hang inside one rank. Each with its ranks and the wall time of its
    newest heartbeat (`since`)."""
    gone = set(peers.gone(now))
    nodes: dict[str, list[int]] = {}
    for rank, beat in peers.seen.items():
        if beat.record.get("node") is not None:
            nodes.setdefault(beat.record["node"], []).append(rank)
    return [{"node": node, "ranks": sorted(ranks),
             "since": max(peers.seen[r].record.get("at", 0.0) for r in ranks)}
            for node, ranks in sorted(nodes.items()) if node != mine and set(ranks) <= gone]


@dataclass
class Alarm:
    """One section that passed its budget, while it lasts."""
    section: str
    step: int
    started: float
    culprits: list[int] = field(default_factory=list)
    positions: dict = field(default_factory=dict)  # culprit -> (step, section) at the full read
    next_read: float = 0.0
    suspected: bool = False

    def culprits_stayed(self, beats: dict[int, dict | None]) -> bool:
        """Whether every culprit's fresh heartbeat shows it where it was at
        the full read (else someone else may hold the job now)."""
        return all((hb := beats[r]) is None or position(hb) == self.positions.get(r)
                   for r in self.culprits)

    def name_culprits(self, beats: dict[int, dict | None], gone: frozenset) -> None:
        """Culprits from every rank's heartbeat."""
        self.culprits = find_culprits(beats, gone)
        self.positions = {r: position(hb) for r in self.culprits if (hb := beats[r]) is not None}


def verdict(states: list[str], waited: float, slow_limit: float, suspected: bool) -> str | None:
    """What an alarm comes to, from its culprits' states: "stuck" (every
    culprit stopped: declare the hang), "slow_limit" (past the hard limit
    even a computing culprit is hung), "suspect" (a culprit still computes:
    warn once, go on) or None (nothing to do yet)."""
    if not states:
        return None
    if all(state == "stuck" for state in states):
        return "stuck"
    if waited > slow_limit:
        return "slow_limit"
    if "running" in states and not suspected:
        return "suspect"
    return None
