"""The agents' rendezvous: TorchElastic's handler wrapped, not rewritten.
Only its answer to the agent's "how many nodes wait to join?" changes (asked
every monitor interval; above zero, the agent restarts its workers to join):
- An etcd host out of reach: "none waiting", said once, not the agent's end
  (a job needs the rendezvous only to change its membership). Everything
  else (forming again after a failure, closing) fails as before.
- This node dropped as dead (its keep-alives late: an agent starved of CPU;
  harmless while no node leaves) and a round after its own begun with a
  participant: "one waiting", said once, so this node joins. TorchElastic
  lets a node that left to re-join wait there, not in the wait list, until
  its join times out (a soak on two nodes hung so)."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Optional

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from megaresil.clock import Clock, SystemClock
from megaresil.compat import rendezvous_round

# The backends wrapped: TorchElastic's names, registered again under this
# prefix with the wrapper around them.
WRAPPED = ("c10d", "etcd", "etcd-v2")
# Those whose host is not one of the job's agents: an outage is ridden out.
# (A c10d host is one of the job's agents: out of reach, the job cannot go
# on anyway, as its store is there, and losing it has its own line.)
OUTAGE_TOLERANT = ("etcd", "etcd-v2")
PREFIX = "megaresil-"


class AgentRendezvous(RendezvousHandler):
    """`inner` (TorchElastic's handler) with `num_nodes_waiting` as the
    module docstring says; `say` prints a line for a person."""

    def __init__(self, inner: RendezvousHandler, endpoint: str, say: Callable[[str], None],
                 *, rides_out_outages: bool, clock: Clock = SystemClock()):
        self.inner, self.endpoint, self.say, self.clock = inner, endpoint, say, clock
        self.rides_out_outages = rides_out_outages
        self.out_since: float | None = None  # when the rendezvous stopped answering
        self.joined_round: Optional[int] = None  # the round this node last formed in

    def num_nodes_waiting(self) -> int:
        waiting = self._nodes_waiting()
        if waiting == 0 and self._dropped():
            self.say(f"megaresil: the rendezvous at {self.endpoint} went on without this node "
                     "(its keep-alives came late, so the other nodes took it for dead): "
                     "restarting its workers to join again")
            self.joined_round = None  # said once: the restart joins again
            return 1
        return waiting

    def _nodes_waiting(self) -> int:
        asked = self.clock.monotonic()  # a read of an unreachable host fails only after its timeouts
        try:
            waiting = self.inner.num_nodes_waiting()
        except RendezvousConnectionError as err:
            if not self.rides_out_outages:
                raise
            if self.out_since is None:
                self.out_since = asked
                self.say(f"megaresil: the rendezvous at {self.endpoint} is out of reach "
                         f"({err}): training goes on, but no node can join, leave or restart "
                         "until it answers again")
            return 0
        if self.out_since is not None:
            self.say(f"megaresil: the rendezvous at {self.endpoint} answers again, after "
                     f"{self.clock.monotonic() - self.out_since:.0f}s out of reach")
            self.out_since = None
        return waiting

    def _dropped(self) -> bool:
        """Whether a round after the one this node formed in has begun, with
        a participant: the rounds move on only once every participant of the
        last one left or was dropped, and this node did not leave."""
        now = rendezvous_round(self.inner)
        if now is None or self.joined_round is None:
            return False
        round_now, participants = now
        return round_now != self.joined_round and participants > 0

    def get_backend(self) -> str:
        return PREFIX + self.inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        formed = rendezvous_round(self.inner)
        self.joined_round = formed[0] if formed else None
        return info

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()


def create_wrapped(name: str, params: RendezvousParameters) -> RendezvousHandler:
    """TorchElastic's handler for backend `name`, wrapped; it speaks to the
    agent's console (stderr)."""
    wrapped, params.backend = params.backend, name
    try:
        inner = rendezvous_handler_registry.create_handler(params)
    finally:
        params.backend = wrapped
    return AgentRendezvous(inner, params.endpoint,
                           lambda line: print(line, file=sys.stderr, flush=True),
                           rides_out_outages=name in OUTAGE_TOLERANT)


# One creator object per name for the process: the registry refuses a name
# registered again with another creator (a second launch in one process).
CREATORS = {PREFIX + name: functools.partial(create_wrapped, name) for name in WRAPPED}


def register_wrapped() -> None:
    """Register each WRAPPED backend again as PREFIX + name."""
    for name, creator in CREATORS.items():
        rendezvous_handler_registry.register(name, creator)


def launch_backend(backend: str) -> str:
    """The backend name the agent is given for the user's `--rdzv-backend`."""
    return PREFIX + backend if backend in WRAPPED else backend
