"""Issue 34's exposure items, below the CLI: where the launcher's stores
listen."""
from __future__ import annotations

import psutil
import torch.distributed as dist

from megaresil.compat import elastic_stores_on_their_hosts
from megaresil.launch import Membership


def listening_ips() -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def test_one_node_meets_and_serves_its_workers_on_loopback():
    one = Membership.parse("1", 2, "node7.example:29400", "job", backend="c10d")
    assert one.rendezvous_endpoint == "127.0.0.1:29400"
    assert Membership().rendezvous_endpoint == "127.0.0.1:0"
    assert one.local_addr == Membership().local_addr == "127.0.0.1"


def test_several_nodes_meet_where_the_endpoint_says_from_the_interface_reaching_it():
    several = Membership.parse("2", 2, "127.0.0.1:29400", "job", backend="c10d")
    assert several.rendezvous_endpoint == "127.0.0.1:29400"
    assert several.local_addr == "127.0.0.1"  # the interface that reaches 127.0.0.1


def test_torchelastic_store_servers_listen_on_their_host_only():
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    before = listening_ips()
    with elastic_stores_on_their_hosts():
        rendezvous = c10d_rendezvous_backend.TCPStore("127.0.0.1", 0, is_master=True,
                                                      multi_tenant=True)
        agent = DynamicRendezvousHandler._create_tcp_store_server(None, "127.0.0.1", 0)
        rendezvous.set("k", "v")
        assert dist.TCPStore("127.0.0.1", agent.port, is_master=False) is not None
        assert listening_ips() - before == {"127.0.0.1"}
    assert c10d_rendezvous_backend.TCPStore is dist.TCPStore  # put back after the launch
