"""Live replacement's meeting protocol in the launch store: how the ranks
that stayed in their processes and a replacement started in place of a lost
one find the same generation, and how long the waiting ranks give it.

Every rank records, as it enters a generation, the generation's number and
its own pid. The agent that starts a replacement records the lost pid as
replaced. The waiting ranks wait for the count of ranks entered to reach
the world; the first ranks in judge the missing: one whose lost process
nobody is replacing (its node is gone too, or the agent's budget is spent)
ends the wait at once, for all: the job is relaunched.
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
POLL_S = 0.1  # how often a judging rank names the missing ranks (JobStore.missing_members)
# How often a waiting rank reads the count of ranks entered (one key), so the
# wait ends within this of the last one entering; at most this many reads a
# second from all ranks together.
ENTERED_POLL_S = 0.01
ENTERED_READS_PER_S = 20_000
# The first ranks to enter a generation judge its wait: they name the missing
# ranks (every rank's key) and record why they give up; the others read the
# count and that verdict, one key each. Two, should one of them be lost.
REPORTERS = 2


class ReplacementFailed(MegaresilError):
    """A lost rank was not replaced in time: the job relaunches."""


def judges_the_wait(arrival: int) -> bool:
    """Whether the rank that entered its generation `arrival`-th (JobStore.enter)
    is one of the REPORTERS."""
    return 0 < arrival <= REPORTERS


def wait_intervals(world: int, judge: bool) -> tuple[float, float]:
    """(look_s, judge_s) of a rank waiting for `world` members: how often it
    reads the count of ranks entered, and how often it judges the missing (a
    judge) or reads the judges' verdict (the others)."""
    look_s = max(ENTERED_POLL_S, world / ENTERED_READS_PER_S)
    return look_s, POLL_S if judge else max(POLL_S, look_s)


def await_members(store: JobStore, generation: int, world: int, join_timeout_s: float, *,
                  judge: bool = True, stopping: Callable[[], bool] = lambda: False,
                  clock: Clock = SystemClock()) -> None:
    """Wait until every rank entered `generation` (its count of ranks entered
    reached `world`); raises ReplacementFailed once a missing rank has no
    replacement started and has been silent (no heartbeat of the generation
    before) for NOTICE_S, or once any is still missing after
    `join_timeout_s` (as a `judge`, or on reading a judge's verdict), or once
    this rank is told to stop (the agent is stopping the workers)."""
    started = clock.monotonic()
    look_s, judge_s = wait_intervals(world, judge)
    judged = started - judge_s  # judge at once
    beats = Liveness(store, generation - 1, clock)
    while store.entered_count(generation) < world:
        if stopping():
            raise ReplacementFailed("told to stop while waiting for the replacement")
        now = clock.monotonic()
        if now - judged >= judge_s:
            judged = now
            if judge:
                judge_missing(store, generation, world, beats, now, now - started,
                              join_timeout_s)
            else:
                read_verdict(store, generation, now - started, join_timeout_s)
        clock.sleep(look_s)


def judge_missing(store: JobStore, generation: int, world: int, beats: Liveness,
                  now: float, waited_s: float, join_timeout_s: float) -> None:
    """A judge's look: name the missing ranks; give up on them (give_up_on),
    recording why for the other waiting ranks."""
    missing = store.missing_members(generation, list(range(world)))
    if not missing:
        return  # the count is about to say so
    try:
        give_up_on(missing, store, generation, beats, now, waited_s, join_timeout_s)
    except ReplacementFailed as failed:
        store.give_up_members(generation, str(failed))
        raise


def read_verdict(store: JobStore, generation: int, waited_s: float,
                 join_timeout_s: float) -> None:
    """The others' look: a judge's verdict, or the join timeout."""
    why = store.members_failed(generation)
    if why is not None:
        raise ReplacementFailed(why)
    if waited_s > join_timeout_s:
        raise ReplacementFailed(f"a replacement did not join within {join_timeout_s:.0f}s "
                                "(resilience.replacement.join_timeout_s): relaunching the job")


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
