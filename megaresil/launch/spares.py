"""Hot spares: agents beyond the nodes the layout trains on (`--spares N`,
or `--nnodes MIN:MAX` with MAX above them). The rendezvous takes at most the
nodes the layout trains on; TorchElastic's dynamic rendezvous (c10d,
etcd-v2) keeps the nodes beyond a full round on its redundancy list, where
they wait with no time limit and without making the job restart. When a
training node is lost, a spare moves to the wait list and the job re-forms
with it in the lost node's place, so dp does not shrink while spares
remain; a node that returns to a full job waits as a spare too. A job with
spares does not shrink: with none left it waits for a node (up to the
rendezvous's join_timeout). When the job ends, the rendezvous closes and
the spares exit gracefully.
docs/fault-tolerance.md ("Hot spares")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaresil.config import ConfigError


@dataclass(frozen=True)
class NodeCounts:
    min_nodes: int
    max_nodes: int  # the rendezvous's: the nodes that train at most
    spares: int  # agents that may join beyond max_nodes and wait


def node_counts(min_nodes: int, max_nodes: int, spares: int, world: int, nproc_per_node: int,
                backend: str) -> NodeCounts:
    """The rendezvous's node counts for a layout of `world` ranks: nodes
    beyond those it trains on (MAX above them, and --spares) are spares."""
    trains_on = max(1, world // nproc_per_node)
    extra = max(0, max_nodes - trains_on) + spares
    if not extra:
        return NodeCounts(min_nodes, max_nodes, 0)
    if world % nproc_per_node:
        raise ConfigError("--nproc-per-node", f"the layout's {world} ranks do not fill whole "
                          f"nodes of {nproc_per_node}, so a spare node could not take a node's "
                          "place.", f"use a --nproc-per-node that divides {world}.")
    if backend == "etcd":
        raise ConfigError("--rdzv-backend", "the etcd (v1) rendezvous has no waiting place for "
                          "spare nodes: each would make the job restart.",
                          "use --rdzv-backend etcd-v2 (or c10d).")
    # Every training node, at least: a round of fewer would let a spare form
    # one alone as the finished job's nodes leave, and start training again.
    return NodeCounts(trains_on, trains_on, extra)


def spare_keep_alive(nodes: NodeCounts) -> dict:
    """With spares, a node is called dead after 5 missed keep-alives, not 2:
    a live node called dead sends a spare to the wait list, and every node
    restarts to take it in. A node that has just joined beats late on a
    busy machine (seen: 2.1 s after its last beat, at a load of 9)."""
    return {"keep_alive_max_attempt": 5} if nodes.spares else {}


def spare_line(nodes: NodeCounts) -> Optional[str]:
    if not nodes.spares:
        return None
    return (f"megaresil: the job trains on {nodes.max_nodes} node(s); up to {nodes.spares} more "
            "wait as hot spares (a node that joins a full job waits as one)")
