"""Live replacement's meeting protocol in the launch store: how the ranks
that stayed in their processes and a replacement started in place of a lost
one find the same generation, and how long the waiting ranks give it.

Every rank records, as it enters a generation, the generation's number and
its own pid. The agent that starts a replacement records the lost pid as
replaced. The waiting ranks wait for every rank to enter; a missing rank
whose lost process nobody is replacing (its node is gone too, or the
agent's budget is spent) ends the wait at once: the job is relaunched.
The records are JobStore's (resilience/coordination.py); this module is
the waiting ranks' judgement of them.
docs/fault-tolerance.md ("Live replacement") says it for users."""
from __future__ import annotations

from typing import Callable, Optional

from megaresil.clock import Clock, SystemClock
from megaresil.errors import MegaresilError
from megaresil.resilience.coordination import JobStore

# The agent polls its workers every 0.1 s and records a replacement in the
# store as it starts it: a lost rank without that record after this long
# (50 polls, on a loaded machine) has no agent starting one (its node is
# lost), and waiting the whole join timeout would only delay the relaunch
# that recovers the job.
NOTICE_S = 5.0
POLL_S = 0.1  # how often a waiting rank looks at who is missing (JobStore.missing_members)
# How often a waiting rank reads the count of ranks entered (one store read),
# so the wait ends within this of the last one entering; at most this many
# reads a second from all ranks together.
ENTERED_POLL_S = 0.01
ENTERED_READS_PER_S = 20_000


class ReplacementFailed(MegaresilError):
    """A lost rank was not replaced in time: the job relaunches."""


def await_members(store: JobStore, generation: int, world: int, join_timeout_s: float, *,
                  stopping: Callable[[], bool] = lambda: False,
                  clock: Clock = SystemClock()) -> None:
    """Wait until every rank entered `generation`; raises ReplacementFailed
    once a missing rank has no replacement started and has been silent (no
    heartbeat of the generation before) for NOTICE_S, once any is still
    missing after `join_timeout_s`, or once this rank is told to stop (the
    agent is stopping the workers)."""
    started = clock.monotonic()
    looked = started - POLL_S  # look at once
    beats = Liveness(store, generation - 1, clock)
    while True:
        now = clock.monotonic()
        due = now - looked >= POLL_S
        # The count only says when to look: a rank that entered twice (a
        # replacement lost in turn) must not stand in for a missing one.
        if due or store.entered_count(generation) >= world:
            missing = store.missing_members(generation, list(range(world)))
            if not missing:
                return
        if stopping():
            raise ReplacementFailed("told to stop while waiting for the replacement")
        if due:
            looked = now
            give_up_on(missing, store, generation, beats, now, now - started, join_timeout_s)
        clock.sleep(max(ENTERED_POLL_S, world / ENTERED_READS_PER_S))


def give_up_on(missing: list[int], store: JobStore, generation: int, beats: Liveness,
               now: float, waited_s: float, join_timeout_s: float) -> None:
    """Raise ReplacementFailed when a missing rank has no replacement started
    and has been silent for NOTICE_S, or after the join timeout."""
    orphaned = [r for r in missing if beats.silent_s(r, now) > NOTICE_S
                and not store.replacement_started(generation, r)]
    if orphaned:
        raise ReplacementFailed(f"no replacement was started for rank(s) {orphaned} "
                                f"within {NOTICE_S:.0f}s (its node is lost, or the "
                                "replacement budget is spent): relaunching the job")
    if waited_s > join_timeout_s:
        raise ReplacementFailed(f"the replacement of rank(s) {missing} did not join within "
                                f"{join_timeout_s:.0f}s "
                                "(resilience.replacement.join_timeout_s): relaunching the job")


class Liveness:
    """How long each rank has been silent in a generation: its watchdog
    heartbeat there (JobStore.heartbeat) not changed since. A rank still
    stuck in a collective of that generation (its peers left it; the
    collective ends at its time limit) beats on and is waited for; a lost
    one is silent. Without a watchdog every rank is silent from the start."""

    def __init__(self, store: JobStore, generation: int, clock: Clock):
        self.store, self.generation = store, generation
        self.seen: dict[int, tuple[Optional[int], float]] = {}  # rank -> (beat, since)
        self.started = clock.monotonic()

    def silent_s(self, rank: int, now: float) -> float:
        heartbeat = self.store.heartbeat(self.generation, rank)
        beat = None if heartbeat is None else heartbeat["beat"]
        last, since = self.seen.get(rank, (beat, self.started))
        if beat != last:
            since = now
        self.seen[rank] = (beat, since)
        return now - since
