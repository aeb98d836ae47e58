"""The agents' rendezvous riding out an outage of its host (a fake inner
handler here; a real etcd stopped and started again in
e2e/test_launch_etcd.py), and a node the others dropped joining again
(TorchElastic's own c10d handlers, two nodes in threads)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed.elastic.rendezvous import (RendezvousConnectionError,
                                                  RendezvousStateError)

from megaresil.launch.rendezvous import AgentRendezvous, launch_backend
from tests.harness.fake_clock import FakeClock


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
    inner, said, clock = Inner(), [], FakeClock(100.0)
    handler = AgentRendezvous(inner, "etcd0:2379", said.append, rides_out_outages=True,
                              clock=clock)
    assert handler.num_nodes_waiting() == 1 and said == []
    inner.error = RendezvousConnectionError("The connection to etcd has failed.")
    assert [handler.num_nodes_waiting() for _ in range(3)] == [0, 0, 0]
    assert len(said) == 1 and "rendezvous at etcd0:2379 is out of reach" in said[0]
    assert "training goes on" in said[0]
    inner.error, clock.now = None, 163.0
    assert handler.num_nodes_waiting() == 1
    assert said[1] == ("megaresil: the rendezvous at etcd0:2379 answers again, after 63s out "
                       "of reach")
    assert handler.get_backend() == "megaresil-etcd-v2"


def test_other_rendezvous_errors_still_end_the_agent():
    inner = Inner()
    inner.error = RendezvousStateError("corrupt")
    with pytest.raises(RendezvousStateError):
        AgentRendezvous(inner, "etcd0:2379", print, rides_out_outages=True).num_nodes_waiting()


def test_a_c10d_host_out_of_reach_still_ends_the_agent():
    inner = Inner()
    inner.error = RendezvousConnectionError("The connection to the C10d store has failed.")
    with pytest.raises(RendezvousConnectionError):
        AgentRendezvous(inner, "node0:29400", print, rides_out_outages=False).num_nodes_waiting()


def test_torchelastics_rendezvous_backends_are_wrapped():
    assert launch_backend("etcd-v2") == "megaresil-etcd-v2"
    assert launch_backend("etcd") == "megaresil-etcd"
    assert launch_backend("c10d") == "megaresil-c10d"
    assert launch_backend("static") == "static"


def c10d_node(store, run_id: str, said: list) -> AgentRendezvous:
    """One node's handler as the launcher builds it: TorchElastic's c10d
    one on a shared store (two nodes, a keep-alive every second, dead after
    two missed, as the launcher sets them), wrapped."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend)
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler, RendezvousTimeout)

    inner = DynamicRendezvousHandler.from_backend(
        run_id, store, C10dRendezvousBackend(store, run_id), min_nodes=2, max_nodes=2,
        timeout=RendezvousTimeout(join=timedelta(seconds=60), last_call=timedelta(seconds=0.1),
                                  heartbeat=timedelta(seconds=1)),
        keep_alive_interval=1, keep_alive_max_attempt=2)
    return AgentRendezvous(inner, "node0:29400", said.append, rides_out_outages=False)


def until(condition, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while not (found := condition()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_a_node_dropped_for_late_keep_alives_joins_the_round_a_leaving_node_begins():
    # Two nodes form; their keep-alives stop (starved agents), and a's read
    # drops both as dead: a round begins with nobody in it, and with their
    # workers healthy, nothing restarts. Then node b, restarting its workers,
    # leaves and joins: it begins that round as its participant, where
    # TorchElastic's a hears "none waiting" until b's join times out (a soak
    # on two nodes hung so); wrapped, a hears "one waiting" and joins too.
    import torch.distributed as dist

    store = dist.HashStore()
    said: list[str] = []
    a, b = (c10d_node(store, "dropped", said) for _ in range(2))
    with ThreadPoolExecutor(2) as pool:
        formed = [pool.submit(node.next_rendezvous) for node in (a, b)]
        assert sorted(f.result(timeout=60).rank for f in formed) == [0, 1]
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
        for node in (a, b):
            node.inner._stop_heartbeats()  # what starved agents' keep-alives look like
        time.sleep(3.0)  # past two missed keep-alives (and the state's 1 s cache)
        assert a.num_nodes_waiting() == 0 and said == []  # dropped, but nobody left
        rejoined = pool.submit(b.next_rendezvous)
        assert until(lambda: a.num_nodes_waiting() == 1), "the dropped node never heard"
        assert said == ["megaresil: the rendezvous at node0:29400 went on without this node "
                        "(its keep-alives came late, so the other nodes took it for dead): "
                        "restarting its workers to join again"]
        again = a.next_rendezvous()  # what the agent's restart of its workers does
        assert again.world_size == rejoined.result(timeout=60).world_size == 2
        assert a.num_nodes_waiting() == 0 and len(said) == 1
    for node in (a, b):
        node.shutdown()
