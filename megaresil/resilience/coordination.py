"""The coordination store's schema: every key the workers and their agents
meet under, and the typed reads and writes of them. Nothing else in the
package names a key or calls a store operation (tests/unit/
test_resilience_coordination.py holds it to that), so a renamed key cannot
silently part a writer from its reader.

A launch attempt's store lives under `attempt_prefix`; inside it, each
generation's process group meets under `GENERATION_PREFIX`. Every method
takes the generation it reads or writes: a caller's idea of "the current
one" may change under it (the watchdog's rank leaving a generation), and a
key of generation None would wait out the store's timeout."""
from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from typing import Callable, Iterable, Optional, Union

import torch.distributed as dist

from megaresil.compat import tcp_store_listening_on
from megaresil.worker_env import WorkerEnv

ATTEMPT_ROUND = "megaresil/round_{port}"
ATTEMPT_COUNT = "megaresil/attempt_{count}"
GENERATION = "generation"  # the newest generation any rank entered
MEMBER = "gen{generation}/pid/{rank}"  # the pid that is `rank` in the generation
ENTERED = "gen{generation}/entered"  # how many ranks entered it (a counter)
ENTRY = "gen{generation}/entry/{rank}"  # how often `rank` entered it: only its first counts
MEMBERS_FAILED = "gen{generation}/members_failed"  # why the wait for its members was given up
READY = "gen{generation}/ready/{rank}"  # the rank's process groups are formed
REPLACED = "replaced/{pid}"  # the pid of the process replacing `pid`
GENERATION_PREFIX = "gen{generation}"  # the generation's process group meets under it
FENCE_TOKEN = "fence_token"  # inside GENERATION_PREFIX
HEARTBEAT = "hb/{generation}/{rank}"
ABORT = "abort/{generation}"  # the first announced cause; the watchdog's hangs too
HANG = "hang/{generation}"  # the first rank to declare a hang
SUSPECT = "suspect/{section}/{step}/{generation}"  # the rank that warns of a suspected hang

AGENT_TIMEOUT_S = 30.0  # the agent's connection: it decides on replacements, none may wait long
WORKER_TIMEOUT_S = 300.0


def attempt_prefix(env: WorkerEnv) -> str:
    """The store prefix of one launch attempt's coordination, the same on
    every node of it: under megaresil's launcher each rendezvous round hosts
    its workers' store anew, at a port of its own
    (compat.workers_store_per_round), while the agents' restart counts
    differ (a hot spare's first round is the others' second); under a
    torchrun of the user's own, the store may be the same for every
    attempt, and the restart count tells them apart."""
    if env.under_launcher:
        return ATTEMPT_ROUND.format(port=env.master_port)
    return ATTEMPT_COUNT.format(count=env.restart_count)


def launch_store(env: WorkerEnv) -> dist.Store:
    """The store of this launch attempt's coordination (process groups,
    abort board, heartbeats): hosted by the TorchElastic agent of node rank 0
    when it shares one (c10d, etcd-v2), else by rank 0 (etcd, Slurm tasks).
    Nothing in it needs to outlive the attempt: each attempt uses its own
    prefix, and an attempt that loses the store's node is over anyway."""
    host, port, world = env.master_addr, env.master_port, env.world
    assert host is not None and port is not None, "a worker's launcher names the store"
    is_master = env.rank == 0 and not env.agent_store
    store: Callable[..., dist.TCPStore] = dist.TCPStore
    if is_master and env.local_world == world:
        # Every rank is on this machine: listen only where they connect, not on
        # every interface (an unauthenticated store). Across nodes, which of this
        # node's addresses the others reach is not knowable here: torch's bind stays.
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
        store = tcp_store_listening_on(str(address))
    return store(host, port, world, is_master=is_master,
                 timeout=timedelta(seconds=WORKER_TIMEOUT_S), wait_for_workers=False)


def own_connection(store: dist.Store) -> dist.Store:
    """The same store through a connection of its own, for the monitor
    thread: a TCPStore client serves one request at a time, so a blocking
    wait of the training thread (a process group's creation waiting for a
    peer's address) would stop the monitor's heartbeats, and the guardian
    would kill the waiting rank as starved while the rank it waits for hangs."""
    if isinstance(store, dist.TCPStore):
        return store.clone()  # type: ignore[attr-defined]  # public, missing from torch's stubs
    return store


class JobStore:
    """One launch attempt's coordination, over a store already under its
    attempt's prefix (or a bare one, as tests give)."""

    def __init__(self, store: dist.Store):
        self.store = store

    @classmethod
    def of(cls, store: Union[dist.Store, JobStore]) -> JobStore:
        return store if isinstance(store, JobStore) else cls(store)

    @classmethod
    def for_attempt(cls, store: dist.Store, env: WorkerEnv) -> JobStore:
        return cls(dist.PrefixStore(attempt_prefix(env), store))

    @classmethod
    def for_agent(cls, host: str, port: int, env: WorkerEnv) -> JobStore:
        """The agent's client of its workers' store, under their attempt's
        prefix (the same for every local rank of the attempt)."""
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=timedelta(seconds=AGENT_TIMEOUT_S))
        return cls.for_attempt(store, env)

    def generation_store(self, generation: int) -> dist.Store:
        """Where the generation's process group meets: a stale address of an
        earlier generation can never be read."""
        return dist.PrefixStore(GENERATION_PREFIX.format(generation=generation), self.store)

    # --- membership (resilience/replacement.py's meeting protocol) ----------------

    def enter(self, generation: int, rank: int) -> int:
        """Record that this process is `rank` in `generation`; its arrival
        (1 for the first rank in), or 0 when `rank` had entered it already
        (a retried entry): the count of ranks entered counts each rank once,
        so that it alone can end the wait for the members."""
        self.store.set(GENERATION, str(generation))
        self.store.set(MEMBER.format(generation=generation, rank=rank), str(os.getpid()))
        if self.store.add(ENTRY.format(generation=generation, rank=rank), 1) != 1:
            return 0
        return self.store.add(ENTERED.format(generation=generation), 1)

    def entered_count(self, generation: int) -> int:
        return self.store.add(ENTERED.format(generation=generation), 0)

    def is_member(self, generation: int, rank: int) -> bool:
        return self.store.check([MEMBER.format(generation=generation, rank=rank)])

    def missing_members(self, generation: int, ranks: list[int],
                        known_missing: bool = False) -> list[int]:
        """The ranks of `ranks` that have not entered `generation`: one check
        of all their keys when none is missing; else the halves in turn, a
        second half unchecked when the first had none (`known_missing`):
        about log2(len(ranks)) checks and 2 len(ranks) keys for one missing
        rank. Only the ranks that judge the wait call it (replacement.REPORTERS):
        it names every rank's key (bench/README.md, "Control plane at scale")."""
        if not ranks:
            return []
        if not known_missing and self.store.check(
                [MEMBER.format(generation=generation, rank=r) for r in ranks]):
            return []
        if len(ranks) == 1:
            return ranks
        half = len(ranks) // 2
        first = self.missing_members(generation, ranks[:half])
        return first + self.missing_members(generation, ranks[half:], known_missing=not first)

    def give_up_members(self, generation: int, why: str) -> None:
        """A judging rank's verdict: the wait for `generation`'s members is over."""
        self.store.set(MEMBERS_FAILED.format(generation=generation), why)

    def members_failed(self, generation: int) -> Optional[str]:
        """Why the wait for `generation`'s members was given up; None if it was not."""
        key = MEMBERS_FAILED.format(generation=generation)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def member_pid(self, generation: int, rank: int) -> Optional[int]:
        """The pid that entered `generation` as `rank`; None if none did."""
        if not self.is_member(generation, rank):
            return None
        return int(self.store.get(MEMBER.format(generation=generation, rank=rank)))

    def newest_generation(self) -> Optional[int]:
        if not self.store.check([GENERATION]):
            return None
        return int(self.store.get(GENERATION))

    def generation_to_join(self, rank: int, timeout_s: float) -> int:
        """The generation a replacement of `rank` joins: the newest one, unless
        the process it replaces was a member of it (the others have not noticed
        the loss yet): then the next, which they form once they do."""
        self.store.wait([GENERATION], timedelta(seconds=timeout_s))
        newest = int(self.store.get(GENERATION))
        return newest + 1 if self.is_member(newest, rank) else newest

    def set_up(self, generation: int, rank: int) -> None:
        """Record that this rank finished the setup of `generation`: every
        process group it takes part in is formed."""
        self.store.set(READY.format(generation=generation, rank=rank), "1")

    def lost_in_setup(self, rank: int, lost_pid: int) -> bool:
        """Whether the lost process `lost_pid` of `rank` died in the setup of
        the newest generation it entered. Its peers may then wait in a process
        group's formation for it (a wait in the store that no abort can end
        before its timeout), and only a relaunch frees them; a process lost
        before it entered any generation, or after its setup, is replaceable."""
        newest = self.newest_generation()
        for generation in range(-1 if newest is None else newest, -1, -1):
            pid = self.member_pid(generation, rank)
            if pid is not None:
                if pid != lost_pid:
                    return False  # it never entered one: its predecessor's record
                return not self.store.check([READY.format(generation=generation, rank=rank)])
        return False

    def announce_replacement(self, lost_pid: int, pid: int) -> None:
        """The agent's record: process `pid` replaces `lost_pid`."""
        self.store.set(REPLACED.format(pid=lost_pid), str(pid))

    def replacement_started(self, generation: int, rank: int) -> bool:
        """Whether the last process that was `rank` before `generation` is being
        replaced."""
        for earlier in range(generation - 1, -1, -1):
            pid = self.member_pid(earlier, rank)
            if pid is not None:
                return self.store.check([REPLACED.format(pid=pid)])
        return False

    def fence_token(self, generation: int, draw: Optional[Callable[[], str]]) -> str:
        """The token of `generation`: drawn by the one rank given `draw`, read
        by the others."""
        store = self.generation_store(generation)
        if draw is not None:
            store.set(FENCE_TOKEN, draw())
        return store.get(FENCE_TOKEN).decode()

    # --- heartbeats (resilience/watchdog) ----------------------------------------

    def publish_heartbeat(self, generation: int, rank: int, beat: dict) -> None:
        self.store.set(HEARTBEAT.format(generation=generation, rank=rank), json.dumps(beat))

    def heartbeat(self, generation: int, rank: int) -> Optional[dict]:
        """The rank's latest heartbeat in `generation`; None before its first."""
        key = HEARTBEAT.format(generation=generation, rank=rank)
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def heartbeats(self, generation: int, ranks: Iterable[int]) -> dict[int, Optional[dict]]:
        """The ranks' latest heartbeats: one read for all when every rank
        wrote one, else key by key."""
        keys = {r: HEARTBEAT.format(generation=generation, rank=r) for r in ranks}
        if self.store.check(list(keys.values())):
            values = self.store.multi_get(list(keys.values()))
            return {r: json.loads(v) for r, v in zip(keys, values)}
        return {r: self.heartbeat(generation, r) for r in keys}

    # --- the abort record ------------------------------------------------------------

    def abort(self, generation: int) -> Optional[dict]:
        """The generation's first announced cause; None before any."""
        key = ABORT.format(generation=generation)
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def aborted(self, generation: int) -> bool:
        return self.store.check([ABORT.format(generation=generation)])

    def announce_abort(self, generation: int, mine: dict) -> dict:
        """Record `mine` as the generation's cause unless one is recorded;
        returns the one recorded first."""
        first = self.store.compare_set(ABORT.format(generation=generation), "", json.dumps(mine))
        return json.loads(first)

    def set_abort(self, generation: int, record: dict) -> None:
        self.store.set(ABORT.format(generation=generation), json.dumps(record))

    def claim_hang(self, generation: int, report: dict) -> bool:
        """Whether this rank is the first to declare the generation's hang."""
        mine = json.dumps(report)
        return self._claim(HANG.format(generation=generation), mine)

    def claim_suspect(self, generation: int, section: str, step: int, rank: int) -> bool:
        """Whether this rank is the first to suspect a hang of `section` at `step`."""
        return self._claim(SUSPECT.format(section=section, step=step, generation=generation),
                           str(rank))

    def _claim(self, key: str, mine: str) -> bool:
        return self.store.compare_set(key, "", mine) == mine.encode()
