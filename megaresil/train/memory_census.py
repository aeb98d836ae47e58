"""What each rank of a recipe's layout would hold, counted from the trainer's
own modules on the meta device (no memory, no processes): its parameters
as `build_chunks` makes them (each TP layer marks its shard), the fp32 grad
buffers, each gradient group's optimizer moments and main copies as its
ZeRO-1 rule (`zero1`, `make_shard`) keeps them, and one micro-batch's
activations as `ActivationMeter` counts them in a forward (and loss) of
the rank's chunks. plan/memory.py does the arithmetic over these counts;
see docs/clusters.md ("Memory before launch").
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch
import torch.nn as nn

from megaresil.config import (
    Precision,
    RecipeConfig,
    microbatches_per_step,
    resolved_schedule,
)
from megaresil.model.activation_meter import ActivationMeter
from megaresil.model.chunks import build_chunks
from megaresil.model.gpt import GPT
from megaresil.parallel.distributed_optimizer import make_shard
from megaresil.parallel.fsdp import planned_rows
from megaresil.parallel.grad_groups import zero1
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.sharding import spec_of
from megaresil.plan.memory import RankMemory, in_flight_microbatches
from megaresil.train.memory_shapes import MetaStandIns, balance_routing, plan_context_parallel
from megaresil.train.precision import logits_dtype, resolve

META = torch.device("meta")
MOMENTS = 2  # Adam's exp_avg and exp_avg_sq, fp32 each
FP32 = 4


def layout_line(cfg: RecipeConfig) -> str:
    """The settings an estimate depends on, precision resolved as on a GPU
    (where the estimate matters): `auto` is counted as bf16 and says so."""
    p = cfg.parallel
    precision = resolve(cfg.train.precision, torch.device("cuda")).value
    if cfg.train.precision == Precision.auto:
        precision += " (auto, as on a GPU)"
    parts = [f"tp={p.tp}", f"pp={p.pp}", f"dp={p.dp}"] + [
        f"{k}={v}" for k, v in (("dp_shard", p.dp_shard), ("vpp", p.vpp), ("ep", p.ep),
                                ("cp", p.cp)) if v > 1]
    return " ".join(parts + (["sp"] if p.sequence_parallel else []) +
                    [f"mbs={cfg.train.micro_batch_size}", f"recompute={cfg.model.recompute.value}",
                     f"zero1={'on' if cfg.optimizer.distributed else 'off'}",
                     f"precision={precision}"])


def estimate(cfg: RecipeConfig, device_type: str = "cuda") -> list[RankMemory]:
    """Every kind of rank of the recipe's layout, each with the global ranks
    alike. Ranks differ by pipeline stage, expert rank and (under ZeRO-1)
    data-parallel index; tensor-parallel ranks hold equal shares, so one
    build per (stage, expert rank) serves them all: the last tensor rank's,
    whose vocabulary slice holds the padding (its loss copies its logits).
    Expert ranks of a stage run the same shapes (a balanced routing): one
    forward per stage counts their activations."""
    precision = resolve(cfg.train.precision, torch.device(device_type))
    built: dict[tuple[int, int], tuple[RankMemory, list[nn.Parameter], int]] = {}
    activations: dict[int, tuple[int, int]] = {}  # by stage: (kept, transient)
    kinds: dict[RankMemory, list[int]] = {}
    for rank in range(cfg.parallel.world_size):
        layout = ParallelLayout.planned(cfg.parallel, rank)
        where = (layout.pp_rank, layout.coordinate("ep"))
        if where not in built:
            last_tp = ParallelLayout.planned(cfg.parallel, rank + layout.tp - 1 - layout.tp_rank)
            chunks = meta_chunks(cfg, last_tp)
            params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
            if layout.pp_rank not in activations:
                activations[layout.pp_rank] = microbatch_activations(cfg, last_tp, precision)
            built[where] = (rank_memory(cfg, last_tp, params, precision,
                                        activations[layout.pp_rank]), params,
                            largest_unit(chunks))
        memory, params, unit = built[where]
        moments, main = optimizer_bytes(cfg, params, layout, precision)
        memory = replace(memory, optimizer=moments, main=main)
        if layout.dp_shard > 1:
            memory = sharded_data_bytes(memory, params, unit, layout, precision)
        kinds.setdefault(memory, []).append(rank)
    return [replace(memory, ranks=tuple(ranks)) for memory, ranks in kinds.items()]


def meta_chunks(cfg: RecipeConfig, layout: ParallelLayout) -> list[GPT]:
    with META:
        return build_chunks(cfg.model, layout, cfg.train.seed)


def rank_memory(cfg: RecipeConfig, layout: ParallelLayout, params: list[nn.Parameter],
                precision: Precision, activations: tuple[int, int]) -> RankMemory:
    """One rank's figures (ranks, optimizer and main copies left to
    `estimate`); `activations`: one micro-batch's (kept, transient)."""
    numel = sum(p.numel() for p in params)
    width = 2 if precision == Precision.bf16 else FP32
    kept, transient = activations
    in_flight = in_flight_microbatches(
        resolved_schedule(cfg.parallel), pp=layout.pp, vpp=layout.vpp, stage=layout.pp_rank,
        microbatches=microbatches_per_step(cfg))
    return RankMemory((), layout.pp_rank, numel * width, numel * FP32, 0, 0, kept, in_flight,
                      transient)


def optimizer_bytes(cfg: RecipeConfig, params: Iterable[nn.Parameter], layout: ParallelLayout,
                    precision: Precision) -> tuple[int, int]:
    """(Adam's moments, fp32 main copies) this rank holds: per parameter, the
    whole of it, or where its gradient group shards (ZeRO-1) its row shard."""
    moments = main = 0
    for param in params:
        axes = spec_of(param).replicated_over
        held = param.numel()
        if layout.dp_shard > 1:
            held = _sharded_numel(param, layout)
        elif zero1(cfg.optimizer, layout.size(*axes)):
            shard = make_shard(param, layout.size(*axes), layout.index_over(axes))
            held = max(0, shard.stop - shard.start) * (param.numel() // max(1, _rows(param)))
        moments += held * MOMENTS * FP32
        main += held * FP32 if precision == Precision.bf16 and layout.dp_shard == 1 else 0
    return moments, main


def sharded_data_bytes(memory: RankMemory, params: list[nn.Parameter], unit: int,
                       layout: ParallelLayout, precision: Precision) -> RankMemory:
    """Under FSDP2 (parallel/fsdp.py): this rank's rows of every parameter in
    fp32 (under bf16 they are the main weights) and of every grad, plus the
    largest unit (`unit` elements) gathered whole in the compute dtype,
    twice (the one in use and the next, prefetched)."""
    width = 2 if precision == Precision.bf16 else FP32
    rows = sum(_sharded_numel(p, layout) for p in params)
    return replace(memory, params=rows * FP32 + 2 * unit * width, grads=rows * FP32)


def _sharded_numel(param: nn.Parameter, layout: ParallelLayout) -> int:
    shard = planned_rows(param, layout)
    return max(0, shard.stop - shard.start) * (param.numel() // max(1, _rows(param)))


def largest_unit(chunks: list[GPT]) -> int:
    """Elements of the largest FSDP unit of `chunks` as parallel/fsdp.py
    wraps them: a block, or a chunk's own parameters (embedding, head)."""
    units = []
    for chunk in chunks:
        blocks = [sum(p.numel() for p in block.parameters()) for block in chunk.layers.values()]
        units += blocks + [sum(p.numel() for p in chunk.parameters()) - sum(blocks)]
    return max(units, default=0)


def _rows(param: nn.Parameter) -> int:
    return param.shape[0] if param.ndim > 0 else 1


def microbatch_activations(cfg: RecipeConfig, layout: ParallelLayout,
                           precision: Precision) -> tuple[int, int]:
    """(bytes one micro-batch keeps for backward over this rank's chunks, the
    largest forward's working memory beyond that), from a forward (and, on
    the last stage, the loss) of the chunks on the meta device under the
    allocator count a CPU run is measured with. A pipeline stage's input
    (the received hidden states, kept for their grad) counts; its output
    is the next stage's input and is counted there too, as the schedule
    keeps it until the backward that frees it."""
    kept = transient = 0
    for chunk in meta_chunks(cfg, layout):
        chunk.train()
        balance_routing(chunk)
        plan_context_parallel(chunk)
        chunk.to(META)  # the buffers a meta build keeps on the CPU (the routers')
        if precision == Precision.bf16:
            chunk.to(torch.bfloat16)
        meter = ActivationMeter(META)
        with meter, MetaStandIns():
            x, _ = chunk.example_io(cfg.train.micro_batch_size, cfg.data.seq_len,
                                    logits_dtype(precision), META)
            x = x.requires_grad_(x.is_floating_point())
            samples = torch.zeros(cfg.train.micro_batch_size, dtype=torch.long, device=META)
            out = chunk.stage_forward(x, samples)
            if chunk.last:
                out = chunk.loss(out, torch.zeros(out.shape[:-1], dtype=torch.long, device=META),
                                 overwrite_logits=True)
            reading = meter.reading()
        kept += reading.device_bytes
        transient = max(transient, reading.peak_device_bytes - reading.device_bytes)
    return kept, transient


