"""Live replacement's meeting protocol in the launch store: how the ranks
that stayed in their processes and a replacement started in place of a lost
one find the same generation, and how long the waiting ranks give it.

Every rank records, as it enters a generation, the generation's number and
its own pid. The agent that starts a replacement records the lost pid as
replaced. The waiting ranks wait for every rank to enter; a missing rank
whose lost process nobody is replacing (its node is gone too, or the
agent's budget is spent) ends the wait at once: the job is relaunched.
docs/fault-tolerance.md ("Live replacement") says it for users."""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Callable, Mapping, Optional

import torch.distributed as dist

from megaresil.errors import MegaresilError
from megaresil.run_lock import HELD_ENV

# Set by the agent in a replacement's environment.
REPLACEMENT_ENV = "MEGARESIL_REPLACEMENT"
# The agent polls its workers every 0.1 s and records a replacement in the
# store as it starts it: a lost rank without that record after this long
# (50 polls, on a loaded machine) has no agent starting one (its node is
# lost), and waiting the whole join timeout would only delay the relaunch
# that recovers the job.
NOTICE_S = 5.0
POLL_S = 0.1  # how often a waiting rank looks at who is missing (a store read per rank)
# How often a waiting rank reads the count of ranks entered (one store read),
# so the wait ends within this of the last one entering; at most this many
# reads a second from all ranks together.
ENTERED_POLL_S = 0.01
ENTERED_READS_PER_S = 20_000


class ReplacementFailed(MegaresilError):
    """A lost rank was not replaced in time: the job relaunches."""


def attempt_prefix(env: Mapping[str, str]) -> str:
    """The store prefix of one launch attempt's coordination, the same on
    every node of it: under megaresil's launcher each rendezvous round hosts
    its workers' store anew, at a port of its own
    (compat.workers_store_per_round), while the agents' restart counts
    differ (a hot spare's first round is the others' second); under a
    torchrun of the user's own, the store may be the same for every
    attempt, and the restart count tells them apart."""
    if HELD_ENV in env:
        return f"megaresil/round_{env['MASTER_PORT']}"
    return f"megaresil/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def member_key(generation: int, rank: int) -> str:
    return f"gen{generation}/pid/{rank}"


def entered_key(generation: int) -> str:
    return f"gen{generation}/entered"


def enter(store: dist.Store, generation: int, rank: int) -> None:
    """Record that this process is `rank` in `generation`."""
    store.set("generation", str(generation))
    store.set(member_key(generation, rank), str(os.getpid()))
    store.add(entered_key(generation), 1)


def is_replacement() -> bool:
    return os.environ.get(REPLACEMENT_ENV) == "1"


def generation_to_join(store: dist.Store, rank: int, timeout_s: float) -> int:
    """The generation a replacement of `rank` joins: the newest one, unless
    the process it replaces was a member of it (the others have not noticed
    the loss yet): then the next, which they form once they do."""
    store.wait(["generation"], timedelta(seconds=timeout_s))
    newest = int(store.get("generation"))
    return newest + 1 if store.check([member_key(newest, rank)]) else newest


def ready_key(generation: int, rank: int) -> str:
    return f"gen{generation}/ready/{rank}"


def set_up(store: dist.Store, generation: int, rank: int) -> None:
    """Record that this rank finished the setup of `generation`: every
    process group it takes part in is formed."""
    store.set(ready_key(generation, rank), "1")


def lost_in_setup(store: dist.Store, rank: int, lost_pid: int) -> bool:
    """Whether the lost process `lost_pid` of `rank` died in the setup of
    the newest generation it entered. Its peers may then wait in a process
    group's formation for it (a wait in the store that no abort can end
    before its timeout), and only a relaunch frees them; a process lost
    before it entered any generation, or after its setup, is replaceable."""
    if not store.check(["generation"]):
        return False
    for generation in range(int(store.get("generation")), -1, -1):
        if store.check([member_key(generation, rank)]):
            if int(store.get(member_key(generation, rank))) != lost_pid:
                return False  # it never entered one: its predecessor's record
            return not store.check([ready_key(generation, rank)])
    return False


def announce_replacement(store: dist.Store, lost_pid: int, pid: int) -> None:
    """The agent's record: process `pid` replaces `lost_pid`."""
    store.set(f"replaced/{lost_pid}", str(pid))


def replacement_started(store: dist.Store, generation: int, rank: int) -> bool:
    """Whether the last process that was `rank` before `generation` is being
    replaced."""
    for earlier in range(generation - 1, -1, -1):
        if store.check([member_key(earlier, rank)]):
            lost_pid = store.get(member_key(earlier, rank)).decode()
            return store.check([f"replaced/{lost_pid}"])
    return False


def await_members(store: dist.Store, generation: int, world: int, join_timeout_s: float, *,
                  stopping: Callable[[], bool] = lambda: False,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until every rank entered `generation`; raises ReplacementFailed
    once a missing rank has no replacement started and has been silent (no
    heartbeat of the generation before) for NOTICE_S, once any is still
    missing after `join_timeout_s`, or once this rank is told to stop (the
    agent is stopping the workers)."""
    started = clock()
    looked = started - POLL_S  # look at once
    beats = Liveness(store, generation - 1, clock)
    while True:
        now = clock()
        due = now - looked >= POLL_S
        # The count only says when to look: a rank that entered twice (a
        # replacement lost in turn) must not stand in for a missing one.
        if due or store.add(entered_key(generation), 0) >= world:
            missing = [r for r in range(world) if not store.check([member_key(generation, r)])]
            if not missing:
                return
        if stopping():
            raise ReplacementFailed("told to stop while waiting for the replacement")
        if due:
            looked = now
            give_up_on(missing, store, generation, beats, now, now - started, join_timeout_s)
        sleep(max(ENTERED_POLL_S, world / ENTERED_READS_PER_S))


def give_up_on(missing: list[int], store: dist.Store, generation: int, beats: Liveness,
               now: float, waited_s: float, join_timeout_s: float) -> None:
    """Raise ReplacementFailed when a missing rank has no replacement started
    and has been silent for NOTICE_S, or after the join timeout."""
    orphaned = [r for r in missing if beats.silent_s(r, now) > NOTICE_S
                and not replacement_started(store, generation, r)]
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
    heartbeat there (resilience/watchdog/monitor.py, `hb/GEN/RANK`) not
    changed since. A rank still stuck in a collective of that generation
    (its peers left it; the collective ends at its time limit) beats on and
    is waited for; a lost one is silent. Without a watchdog every rank is
    silent from the start."""

    def __init__(self, store: dist.Store, generation: int, clock: Callable[[], float]):
        self.store, self.generation = store, generation
        self.seen: dict[int, tuple[Optional[int], float]] = {}  # rank -> (beat, since)
        self.started = clock()

    def silent_s(self, rank: int, now: float) -> float:
        key = f"hb/{self.generation}/{rank}"
        beat = json.loads(self.store.get(key))["beat"] if self.store.check([key]) else None
        last, since = self.seen.get(rank, (beat, self.started))
        if beat != last:
            since = now
        self.seen[rank] = (beat, since)
        return now - since
