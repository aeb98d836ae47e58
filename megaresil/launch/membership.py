"""Which agents form the job: one (this machine), several meeting at a
rendezvous endpoint (--nnodes), or a Slurm step's nodes."""
from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass
from typing import Optional

from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from megaresil.config import ConfigError
from megaresil.ports import LOOPBACK, address_towards, is_loopback_name
from megaresil.slurm import SlurmStep


@dataclass
class Membership:
    """Which agents form the job: one (this machine) by default, or several
    that meet at a rendezvous endpoint, like torchrun's --nnodes."""
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: Optional[int] = None
    endpoint: str = "localhost:0"
    run_id: Optional[str] = None
    rdzv_conf: dict = dataclasses.field(default_factory=dict)
    # c10d: the rendezvous store lives in the agent started with is_host=1,
    # which must outlive the others; etcd, etcd-v2: in an etcd server apart
    # from the training nodes, so any node may be lost.
    backend: str = "c10d"
    node_address: Optional[str] = None  # --local-addr: where this node's stores listen
    spares: int = 0  # --spares: agents that may join beyond MAX and wait, hot spares

    @classmethod
    def parse(cls, nnodes: Optional[str], nproc_per_node: Optional[int], endpoint: Optional[str],
              run_id: Optional[str], rdzv_conf: str = "", backend: str = "c10d",
              local_addr: Optional[str] = None, spares: int = 0) -> "Membership":
        if not nnodes:
            if spares:
                raise ConfigError("--spares", "spare nodes join a job of several nodes.",
                                  "add --nnodes MIN:MAX, --rdzv-endpoint and --rdzv-id.")
            return cls(nproc_per_node=nproc_per_node, node_address=local_addr)
        conf = dict(item.split("=", 1) for item in rdzv_conf.split(",") if item)
        low, _, high = nnodes.partition(":")
        if not endpoint:
            where = "HOST:PORT" if backend == "c10d" else "ETCD_HOST:PORT"
            raise ConfigError("--rdzv-endpoint", "several nodes need a rendezvous endpoint.",
                              f"add --rdzv-endpoint {where} (the same on every node).")
        if not run_id and int(high or low) + spares > 1:
            # Without one each agent would name its job after its own pid:
            # the nodes would never meet, each waiting for the others.
            raise ConfigError("--rdzv-id", "several nodes need one job id to meet under.",
                              "add --rdzv-id ID (the same on every node, e.g. the job's name).")
        return cls(int(low), int(high or low), nproc_per_node, endpoint, run_id, conf,
                   backend, local_addr, spares)

    @property
    def host_can_be_lost(self) -> bool:
        return self.backend != "c10d" or self.max_nodes == 1

    @property
    def rendezvous_endpoint(self) -> str:
        """Where the agents meet: on one node, a c10d rendezvous at this
        node's address (loopback unless --local-addr), where its store listens."""
        if self.max_nodes > 1 or self.backend != "c10d":
            return self.endpoint
        return f"{self.local_addr}:{parse_rendezvous_endpoint(self.endpoint, default_port=0)[1]}"

    @property
    def local_addr(self) -> Optional[str]:
        """This node's address, where its stores listen and what its workers
        get as MASTER_ADDR: loopback on one node; on several, the interface
        that reaches the rendezvous endpoint (the network the job runs on).
        None (torch's own: the host name, stores on every interface) when that
        is loopback but the endpoint is not named so: a host name that
        resolves to 127.0.1.1 here (Debian's /etc/hosts), which the other
        nodes reach by another address. --local-addr overrides all of this."""
        if self.node_address:
            return self.node_address
        if self.max_nodes == 1:
            return LOOPBACK
        host, port = parse_rendezvous_endpoint(self.endpoint, default_port=0)
        address = address_towards(host, port)
        if address and ipaddress.ip_address(address).is_loopback and not is_loopback_name(host):
            return None
        return address

    @classmethod
    def for_slurm(cls, step: SlurmStep, world: int, nproc_per_node: Optional[int],
                  backend: str = "c10d", etcd_endpoint: Optional[str] = None) -> "Membership":
        """One agent per node of the Slurm step, meeting on its first node
        (c10d) or at an etcd server, where each requeue of the job needs a
        rendezvous of its own (etcd keeps a finished one, closed)."""
        nodes, nproc = step.nodes, nproc_per_node or step.ranks_per_node(world)
        if backend == "c10d":
            return cls(nodes, nodes, nproc, f"{step.master}:{step.port}", step.job_name)
        requeue = os.environ.get("SLURM_RESTART_COUNT", "0")
        return cls.parse(f"1:{nodes}", nproc, etcd_endpoint, f"{step.job_name}-{requeue}",
                         backend=backend)
