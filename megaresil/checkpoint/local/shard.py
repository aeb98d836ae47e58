"""A rank's state as one local shard: every rect it holds (the tied-embedding
copy included) back to back in one byte buffer, and a meta record of each
rect's place and checksum, the run state and the rank's RNG. A same-layout
resume copies the bytes back with no resharding, so it is bit-exact."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.staging import StagingCopy
from megaresil.checkpoint.state import RunRecord, TrainingState, training_rects

SHARD_FORMAT = "megaresil-local-shard"
SHARD_SLACK = 64 * 1024  # a shard's bytes on disk beyond data.bin and meta.json (marker, blocks)


def shard_rects(state: TrainingState) -> list[Rect]:
    """What a shard of `state` holds: every rect, the tied-embedding copy
    included (a load target, so it is restored without a collective)."""
    return training_rects(state, include_copies=True)


@dataclass
class Shard:
    meta: dict  # SHARD_FORMAT's fields: run_id, step, owner, world, layout, run, rank_state, rects
    data: torch.Tensor  # flat uint8: every rect's bytes at its record's `start`

    @property
    def step(self) -> int:
        return self.meta["step"]

    @property
    def owner(self) -> int:
        return self.meta["owner"]


def stage(rects: list[Rect], buffer: Optional[torch.Tensor],
          copy: Optional[StagingCopy] = None) -> tuple[torch.Tensor, list[dict]]:
    """Copy `rects` back to back into `buffer` (reused when it fits) by
    `copy` (enqueued on a GPU: see StagingCopy); returns the buffer and each
    rect's record (checksums come later)."""
    copy = copy or StagingCopy.of([r.tensor for r in rects])
    records, size = rect_records(rects)
    if buffer is None or buffer.numel() != size:
        buffer = copy.host_empty((size,), torch.uint8)
    copy.into([view_of(buffer, rec) for rec in records], [r.tensor for r in rects])
    return buffer, records


def rect_records(rects: list[Rect]) -> tuple[list[dict], int]:
    """Each rect's record, back to back from byte 0, and the bytes of all."""
    records, start = [], 0
    for r in rects:
        records.append({"key": r.key, "global_shape": list(r.global_shape),
                        "offset": list(r.offset), "shape": list(r.shape),
                        "dtype": fmt.dtype_name(r.tensor), "start": start, "nbytes": r.nbytes})
        start += r.nbytes
    return records, start


def shard_meta(run: RunRecord, owner: int, world: int, rng: dict, records: list[dict], *,
               run_id: Optional[str] = None) -> dict:
    """A shard's meta.json (its records' checksums added once staged): whose
    run it is (`run_id`, run_identity; None for a state carried in memory
    between generations, never written) and the run state, the recipe
    included, which a resume compares as it does a global checkpoint's."""
    return {"format": SHARD_FORMAT, "version": 1, "run_id": run_id, "step": run.step,
            "owner": owner, "world": world, "layout": run.layout, "run": run.to_manifest(),
            "rank_state": rng, "rects": records}


def shard_bytes(state: TrainingState, owner: int, world: int, run_id: str) -> int:
    """What one shard of `state` takes in the local tier's storage."""
    records, size = rect_records(shard_rects(state))
    for rec in records:
        rec["checksum"] = "0" * 16  # an xxh3-64 digest's length
    meta = shard_meta(state.run_record(), owner, world, state.rng_state(), records,
                      run_id=run_id)
    return size + len(json.dumps(meta, indent=1)) + SHARD_SLACK  # as write_json_atomic writes it


def shard_size(meta: dict) -> int:
    """The bytes of a shard's data: its records', back to back."""
    return sum(rec["nbytes"] for rec in meta["rects"])


def view_of(data: torch.Tensor, record: dict) -> torch.Tensor:
    """The tensor a record describes, as a view into a shard's bytes."""
    raw = data[record["start"]: record["start"] + record["nbytes"]]
    return raw.view(fmt.torch_dtype(record["dtype"])).view(record["shape"])


def add_checksums(data: torch.Tensor, records: list[dict]) -> None:
    for rec in records:
        rec["checksum"] = fmt.checksum(data[rec["start"]: rec["start"] + rec["nbytes"]])


def matched(meta: dict, targets: list[Rect], fix: str = "") -> list[tuple[dict, Rect]]:
    """Each of a shard's records with this rank's target of the same
    identity and dtype, in the records' order; CheckpointError (with `fix`)
    unless the two hold the same tensors."""
    identities = [(rec["key"], tuple(rec["offset"]), tuple(rec["shape"])) for rec in meta["rects"]]
    saved = dict(zip(identities, meta["rects"]))
    by_identity = {t.identity(): t for t in targets}
    differ = list(by_identity.keys() ^ saved.keys())
    differ += [i for i, n in Counter(identities).items() if n > 1]
    differ += [i for i in by_identity.keys() & saved.keys()
               if saved[i]["dtype"] != fmt.dtype_name(by_identity[i].tensor)]
    if differ:
        names = sorted(str(i[0]) for i in differ)
        raise fmt.CheckpointError(f"the shard of rank {meta['owner']} at step {meta['step']} "
                                  f"does not hold this rank's tensors ({', '.join(names[:4])})"
                                  + (f"; Fix: {fix}" if fix else ""))
    return [(rec, by_identity[identity]) for identity, rec in saved.items()]


def unpack_into(shard: Shard, targets: list[Rect]) -> None:
    """Fill this rank's `targets` from its own shard, matched by identity."""
    with torch.no_grad():
        for rec, target in matched(shard.meta, targets,
                                   fix="set checkpoint.local.enabled=false for this restart"):
            target.tensor.copy_(view_of(shard.data, rec))


def saved_run_record(meta: dict) -> RunRecord:
    """A shard's run state (`meta`: its meta record), its owner's RNG state
    placed at the owner's rank (the only one a rank restores)."""
    saved = RunRecord.from_manifest(meta["run"])
    rank_states: list[Optional[dict]] = [None] * meta["world"]
    rank_states[meta["owner"]] = meta["rank_state"]
    saved.rank_states = rank_states
    return saved
