"""State moved between ranks, point to point on a group of its own
(`Collectives`, on its owning thread): the one protocol of live replacement
(a peer's state from memory, train/handover.py) and of the local tier (its
replicas at a save and at a recovery, checkpoint/local/tier.py).

For each (holder, receiver) pair the holder sends its meta (size first),
then each of its pieces, one message each: the receiver learns from the
meta where every piece lands (`Land`: the receiver's own tensors, or a flat
buffer) before any arrives, so nothing is copied twice. A meta whose every
record carries a checksum (a local shard's) is checked by the receiver as
any shard is (validation.shard_problem); otherwise the holder streams its
pieces' checksums after the pieces, taken while they move, and the
receiver checks each piece as it lands against them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.collectives import Collectives

# Message tags of a move: its meta's size and bytes, its checksums, then one per piece.
SIZE_TAG, META_TAG, SUMS_TAG, PIECE_TAGS = 0, 1, 2, 3
CHECKSUM_CHARS = 16  # fmt.checksum's hex digest (xxh3-64)


@dataclass
class Outgoing:
    """What a holder sends: a meta with its `rects` records, and its bytes
    as contiguous pieces (one for each record, or one flat buffer holding
    every record where the records carry their checksums)."""
    meta: dict
    pieces: list[torch.Tensor]


# The receiver's side: for a meta received, a contiguous host tensor for each
# of the holder's pieces, where that piece's bytes land.
Land = Callable[[dict], list[torch.Tensor]]


@dataclass
class Received:
    meta: dict
    pieces: list[torch.Tensor]  # Land's, filled


def move(coll: Collectives, moves: list[tuple[int, int]], outgoing: Mapping[int, Outgoing],
         land: Land, what: str) -> dict[int, Received]:
    """Collective over `coll`: for each (holder, receiver) in `moves` the
    holder sends `outgoing[receiver]`. What this rank received, by holder;
    raises CheckpointError, naming `what`, when a piece arrived damaged."""
    sends = {r: outgoing[r] for h, r in moves if h == coll.rank}
    holders = [h for h, r in moves if r == coll.rank]
    metas = exchange_metas(coll, sends, holders)
    landed = {h: land(meta) for h, meta in metas.items()}
    sums = {h: torch.empty(CHECKSUM_CHARS * len(landed[h]), dtype=torch.uint8)
            for h in holders if streams_sums(metas[h])}
    arriving = coll.post([], [(h, PIECE_TAGS + i, as_bytes(t)) for h in holders
                              for i, t in enumerate(landed[h])])
    others = coll.post([(r, PIECE_TAGS + i, as_bytes(t)) for r, out in sends.items()
                        for i, t in enumerate(out.pieces)],
                       [(h, SUMS_TAG, s) for h, s in sums.items()])
    coll.exchange([(r, SUMS_TAG, checksum_bytes(out.pieces)) for r, out in sends.items()
                   if streams_sums(out.meta)], [])
    arrived: dict[int, list[str]] = {h: [] for h in holders}
    for work, (h, piece) in zip(arriving, [(h, t) for h in holders for t in landed[h]]):
        coll.finish(work)
        if h in sums:  # checked as they land, while the next still arrive
            arrived[h].append(fmt.checksum(piece))
    for work in others:
        coll.finish(work)
    for h, sent in sums.items():
        check(metas[h], arrived[h], checksum_list(sent), f"{what} arrived from rank {h} damaged")
    return {h: Received(metas[h], landed[h]) for h in holders}


def streams_sums(meta: dict) -> bool:
    """Whether the holder streams its pieces' checksums: its records do not
    carry theirs."""
    return not all("checksum" in rec for rec in meta["rects"])


def check(meta: dict, arrived: list[str], sent: list[str], damaged: str) -> None:
    for rec, got, sent_sum in zip(meta["rects"], arrived, sent):
        if got != sent_sum:
            raise fmt.CheckpointError(f"{damaged}: checksum mismatch in {rec['key']} at offset "
                                      f"{tuple(rec['offset'])}")


def exchange_metas(coll: Collectives, sends: Mapping[int, Outgoing],
                   holders: list[int]) -> dict[int, dict]:
    """Each holder's meta to its receivers, its size first; what this rank
    received, by holder."""
    encoded = {r: encode_meta(out.meta) for r, out in sends.items()}
    sizes = {h: torch.zeros(1, dtype=torch.int64) for h in holders}
    coll.exchange([(r, SIZE_TAG, torch.tensor([m.numel()])) for r, m in encoded.items()],
                  [(h, SIZE_TAG, s) for h, s in sizes.items()])
    incoming = {h: torch.empty(int(s), dtype=torch.uint8) for h, s in sizes.items()}
    coll.exchange([(r, META_TAG, m) for r, m in encoded.items()],
                  [(h, META_TAG, m) for h, m in incoming.items()])
    return {h: decode_meta(m) for h, m in incoming.items()}


def encode_meta(meta: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)


def decode_meta(data: torch.Tensor) -> dict:
    return json.loads(bytes(data.numpy()).decode())


def checksum_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's checksum, back to back as ASCII bytes."""
    return torch.frombuffer(bytearray("".join(map(fmt.checksum, tensors)).encode()),
                            dtype=torch.uint8)


def checksum_list(data: torch.Tensor) -> list[str]:
    text = bytes(data.numpy()).decode()
    return [text[i: i + CHECKSUM_CHARS] for i in range(0, len(text), CHECKSUM_CHARS)]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a uint8 view (what the wire sends)."""
    return tensor.reshape(-1).view(torch.uint8)
