"""The agents' rendezvous, made to ride out an outage of its host.

Every monitor interval TorchElastic's agent asks the rendezvous how many
nodes wait to join (`num_nodes_waiting`). With the rendezvous in etcd, an
etcd host out of reach makes that read fail at its read timeout, and the
agent tears down its healthy workers and gives up: a job that needs the
rendezvous only to change its membership dies of an outage it could ride
out. TorchElastic's handler is wrapped, not rewritten: while the rendezvous
is out of reach this one question answers "none waiting", said once, and
everything else (forming again after a failure, closing) still needs the
rendezvous and fails as before."""
from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import (RendezvousConnectionError, RendezvousHandler,
                                                  RendezvousInfo, RendezvousParameters,
                                                  rendezvous_handler_registry)

# The backends whose host is not one of the job's agents: TorchElastic's
# names, registered again under this prefix with the wrapper around them.
OUTAGE_TOLERANT = ("etcd", "etcd-v2")
PREFIX = "megaresil-"


class OutageTolerantRendezvous(RendezvousHandler):
    """`inner` (TorchElastic's handler) with `num_nodes_waiting` riding out
    an outage of the rendezvous host; `say` prints a line for a person."""

    def __init__(self, inner: RendezvousHandler, endpoint: str, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.inner, self.endpoint, self.say, self.clock = inner, endpoint, say, clock
        self.out_since: float | None = None  # when the rendezvous stopped answering

    def num_nodes_waiting(self) -> int:
        asked = self.clock()  # a read of an unreachable host fails only after its timeouts
        try:
            waiting = self.inner.num_nodes_waiting()
        except RendezvousConnectionError as err:
            if self.out_since is None:
                self.out_since = asked
                self.say(f"megaresil: the rendezvous at {self.endpoint} is out of reach "
                         f"({err}): training goes on, but no node can join, leave or restart "
                         "until it answers again")
            return 0
        if self.out_since is not None:
            self.say(f"megaresil: the rendezvous at {self.endpoint} answers again, after "
                     f"{self.clock() - self.out_since:.0f}s out of reach")
            self.out_since = None
        return waiting

    def get_backend(self) -> str:
        return PREFIX + self.inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        return self.inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()


def create_outage_tolerant(name: str, params: RendezvousParameters) -> RendezvousHandler:
    """TorchElastic's handler for backend `name`, wrapped; it speaks to the
    agent's console (stderr)."""
    wrapped, params.backend = params.backend, name
    try:
        inner = rendezvous_handler_registry.create_handler(params)
    finally:
        params.backend = wrapped
    return OutageTolerantRendezvous(inner, params.endpoint,
                                    lambda line: print(line, file=sys.stderr, flush=True))


# One creator object per name for the process: the registry refuses a name
# registered again with another creator (a second launch in one process).
CREATORS = {PREFIX + name: functools.partial(create_outage_tolerant, name)
            for name in OUTAGE_TOLERANT}


def register_outage_tolerant() -> None:
    """Register each OUTAGE_TOLERANT backend again as PREFIX + name."""
    for name, creator in CREATORS.items():
        rendezvous_handler_registry.register(name, creator)


def launch_backend(backend: str) -> str:
    """The backend name the agent is given for the user's `--rdzv-backend`."""
    return PREFIX + backend if backend in OUTAGE_TOLERANT else backend
