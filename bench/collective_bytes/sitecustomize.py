"""Counts the bytes each process sends to other ranks in the collectives that
move tokens between experts, for bench/moe_throughput.py: on the PYTHONPATH
of a run's processes (with MEGARESIL_BENCH_BYTES_DIR set), it wraps
`torch.distributed.all_to_all_single`, `all_gather_into_tensor` and
`reduce_scatter_tensor` and keeps `<dir>/<pid>.json` up to date with the
totals per collective (the file is rewritten at every call, since a worker
may end without running exit handlers). Bench-only; nothing imports it.

Bytes sent to peers: an all-to-all's input less the split this rank keeps;
an all-gather's input once to each of the other world - 1 ranks; a
reduce-scatter's input less the 1/world this rank keeps. Integer tensors
(token counts, routing maps) are counted apart, their kind marked
"(integer, bool)"."""
from __future__ import annotations

import json
import os
from pathlib import Path

OUT = os.environ.get("MEGARESIL_BENCH_BYTES_DIR")


def _install(out: Path) -> None:
    import torch
    import torch.distributed as dist

    totals: dict[str, dict[str, int]] = {}

    def record(kind: str, tensor: torch.Tensor, sent: int) -> None:
        key = kind if tensor.is_floating_point() else f"{kind} (integer, bool)"
        entry = totals.setdefault(key, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += sent
        (out / f"{os.getpid()}.json").write_text(json.dumps(totals))

    def a2a_sent(inp: torch.Tensor, splits, group) -> int:
        world, me = dist.get_world_size(group), dist.get_rank(group)
        rows = inp.shape[0]
        kept = splits[me] if splits else rows // world
        return (rows - kept) * (inp.numel() // max(rows, 1)) * inp.element_size()

    a2a, gather, scatter = (dist.all_to_all_single, dist.all_gather_into_tensor,
                            dist.reduce_scatter_tensor)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        record("all_to_all", input, a2a_sent(input, input_split_sizes, group))
        return a2a(output, input, output_split_sizes, input_split_sizes, group, async_op)

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        peers = dist.get_world_size(group) - 1
        record("all_gather", input, input.numel() * input.element_size() * peers)
        return gather(output, input, group, async_op)

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        world = dist.get_world_size(group)
        record("reduce_scatter", input,
               input.numel() * input.element_size() * (world - 1) // world)
        return scatter(output, input, op, group, async_op)

    dist.all_to_all_single = all_to_all_single
    dist.all_gather_into_tensor = all_gather_into_tensor
    dist.reduce_scatter_tensor = reduce_scatter_tensor


if OUT:
    _install(Path(OUT))
