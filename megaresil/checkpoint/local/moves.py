"""Shards moved between ranks at a recovery: from the ranks that hold a
shard to the ranks that need it, point to point on a tier's own group
(`Collectives`, on its owning thread): sizes first, then the payloads, and
what arrives is checked against its checksums before anything uses it. The
local tier moves its replicas this way (live replacement moves a peer's
state from memory straight into the receiver's tensors: train/handover.py)."""
from __future__ import annotations

from typing import Optional

import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.collectives import Collectives
from megaresil.checkpoint.local.replication import decode_meta, encode_meta, header
from megaresil.checkpoint.local.shard import Shard
from megaresil.checkpoint.validation import shard_problem


def move_shards(coll: Collectives, moves: list[tuple[int, int]], outgoing: dict[int, Shard],
                what: str) -> Optional[Shard]:
    """Collective over `coll`: for each (holder, receiver) in `moves` the
    holder sends `outgoing[receiver]` (its own dict) to the receiver. Returns
    the shard this rank received (at most one), None if none; raises
    CheckpointError, naming `what`, when it arrived damaged."""
    sends, heads = [], {}
    for holder, receiver in moves:
        if holder == coll.rank:
            shard = outgoing[receiver]
            meta = encode_meta(shard.meta)
            sends += [(receiver, 0, header(meta, shard.data)), (receiver, 1, meta),
                      (receiver, 2, shard.data)]
        if receiver == coll.rank:
            heads[holder] = torch.empty(2, dtype=torch.int64)
    # Headers first (sizes), then payloads; sends of both go out at once.
    coll.exchange([s for s in sends if s[1] == 0], [(h, 0, head) for h, head in heads.items()])
    payload = []
    for holder, head in heads.items():
        payload += [(holder, 1, torch.empty(int(head[0]), dtype=torch.uint8)),
                    (holder, 2, torch.empty(int(head[1]), dtype=torch.uint8))]
    coll.exchange([s for s in sends if s[1] > 0], payload)
    if not payload:
        return None
    (holder, _, meta), (_, _, data) = payload  # from the one holder of what this rank needs
    shard = Shard(decode_meta(meta), data)
    problem = shard_problem(shard)
    if problem:
        raise fmt.CheckpointError(f"{what} arrived from rank {holder} damaged: {problem}")
    return shard
