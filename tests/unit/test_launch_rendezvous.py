"""The agents' rendezvous riding out an outage of its host (a fake inner
handler here; a real etcd stopped and started again in
e2e/test_launch_etcd.py)."""
from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import (RendezvousConnectionError,
                                                  RendezvousStateError)

from megaresil.launch.rendezvous import OutageTolerantRendezvous, launch_backend


class Inner:
    """TorchElastic's handler as far as the wrapper asks it."""

    def __init__(self):
        self.error: Exception | None = None
        self.waiting = 1

    def num_nodes_waiting(self) -> int:
        if self.error is not None:
            raise self.error
        return self.waiting

    def get_backend(self) -> str:
        return "etcd-v2"


def test_an_unreachable_rendezvous_means_no_node_waits_said_once_and_its_return_said():
    inner, said, now = Inner(), [], [100.0]
    handler = OutageTolerantRendezvous(inner, "etcd0:2379", said.append, clock=lambda: now[0])
    assert handler.num_nodes_waiting() == 1 and said == []
    inner.error = RendezvousConnectionError("The connection to etcd has failed.")
    assert [handler.num_nodes_waiting() for _ in range(3)] == [0, 0, 0]
    assert len(said) == 1 and "rendezvous at etcd0:2379 is out of reach" in said[0]
    assert "training goes on" in said[0]
    inner.error, now[0] = None, 163.0
    assert handler.num_nodes_waiting() == 1
    assert said[1] == ("megaresil: the rendezvous at etcd0:2379 answers again, after 63s out "
                       "of reach")
    assert handler.get_backend() == "megaresil-etcd-v2"


def test_other_rendezvous_errors_still_end_the_agent():
    inner = Inner()
    inner.error = RendezvousStateError("corrupt")
    with pytest.raises(RendezvousStateError):
        OutageTolerantRendezvous(inner, "etcd0:2379", print).num_nodes_waiting()


def test_only_rendezvous_hosted_outside_the_job_are_wrapped():
    # A c10d host is one of the job's agents: out of reach, the job cannot
    # go on anyway (its store is there), and losing it has its own line.
    assert launch_backend("etcd-v2") == "megaresil-etcd-v2"
    assert launch_backend("etcd") == "megaresil-etcd"
    assert launch_backend("c10d") == "c10d"
