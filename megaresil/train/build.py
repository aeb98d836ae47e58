"""What one rank trains with, built once per trainer (`build_parts`): its
data, model chunks, precision and fp32 main copies, optimizer, gradient
groups, progress, and the checkpoint state and face over them. The order of
construction is part of a run's identity (the same process groups, parameter
registration and RNG draws on every rank, run after run), so `build_parts`
keeps it in one place."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn

from megaresil.config import FP8, Precision, RecipeConfig, resolved_schedule
from megaresil.data.build import Dataset, build_datasets, end_of_document_id
from megaresil.events import EventLog
from megaresil.model.gpt import GPT
from megaresil.model.masks import DocumentMasking
from megaresil.model.moe import named_state_buffers
from megaresil.observe.startup import process_times
from megaresil.parallel.fsdp import ShardedGrads, row_shards, shard_chunks
from megaresil.parallel.grad_groups import GroupedGrads, StepGrads, grad_groups, shards_its_group
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.pipeline import Pipeline
from megaresil.resilience.supervision import Supervision
from megaresil.train.checkpointing import TrainCheckpointing
from megaresil.train.compiling import BlockCompile, compile_blocks
from megaresil.train.model_build import build_model, checkpoint_key_map, make_deterministic
from megaresil.train.optim import build_optimizer, group_parts, shards_state
from megaresil.train.precision import (
    ComputeContext,
    MainParams,
    logits_dtype,
    optimizer_params,
    resolve,
    shard_main_params,
)
from megaresil.train.progress import Progress
from megaresil.train.state import LiveTrainingState, configured_skips

KeyMap = Callable[[str], str]


@dataclass
class TrainerParts:
    """One rank's training objects, as `build_parts` makes them."""
    train_data: Dataset
    valid_data: Optional[Dataset]  # None when train.eval_batches is 0
    masking: Optional[DocumentMasking]  # None when the recipe masks no documents
    chunks: list[GPT]  # this rank's model chunks (several under virtual pipeline stages)
    checkpoint_key: KeyMap  # a parameter's name -> its layout-free checkpoint key
    model: nn.ModuleList  # the chunks, as one module
    params: list[nn.Parameter]  # the trained ones, in registration order
    precision: Precision  # train.precision, resolved for the device
    # The fp32 main weights as whole copies (bf16 without ZeRO-1), else None.
    main: Optional[MainParams]
    opt_params: list[nn.Parameter]  # what the optimizer steps, grads are reduced on, checkpoints hold
    autocast: ComputeContext
    optimizer: Any  # one group's optimizer, or a ChainedOptimizer over several
    sharded_optimizer: bool  # whether any group's optimizer shards its state over dp (ZeRO-1)
    pipeline: Optional[Pipeline]  # the schedule over stages, None without pipeline parallelism
    grads: StepGrads  # GroupedGrads, or FSDP2's ShardedGrads under parallel.dp_shard > 1
    state: Progress
    checkpoint_state: LiveTrainingState
    checkpointing: TrainCheckpointing
    compiled: Optional[BlockCompile]  # None when train.compile leaves the blocks eager


def build_parts(cfg: RecipeConfig, layout: ParallelLayout, supervision: Supervision,
                events: EventLog, *, draw: bool = True) -> TrainerParts:
    """Data, model chunks, optimizer, grad buffers and checkpoints, in the
    order that fixes a run's identity; the model's initial values are drawn
    unless `draw` is False (a load certain to overwrite them follows)."""
    make_deterministic(cfg, layout.device)
    train_data, valid_data, _ = build_datasets(
        cfg.data, cfg.model.vocab_size, cfg.train.seed, need_valid=cfg.train.eval_batches > 0)
    masking = document_masking(cfg)
    chunks = build_model(cfg, layout, draw=draw)
    precision = resolve(cfg.train.precision, layout.device)
    sharded_data = layout.dp_shard > 1
    if sharded_data:  # FSDP2: its sharded fp32 parameters are bf16's main weights
        shard_chunks(chunks, layout, precision)
    compiled = compile_blocks(chunks, cfg, layout.device)
    checkpoint_key = checkpoint_key_map(cfg)
    model = nn.ModuleList(chunks)
    params = [p for p in model.parameters() if p.requires_grad]
    bf16 = precision == Precision.bf16 and not sharded_data
    # The fp32 main weights, chosen per gradient group: whole copies here, or
    # where the group shards under ZeRO-1 only this rank's rows, which its
    # distributed optimizer keeps (experts in a group of one rank, edp = 1,
    # keep whole copies beside a sharded dense group).
    whole = [p for p in params if not shards_its_group(p, cfg.optimizer, layout)]
    main = MainParams(whole) if bf16 and whole else None
    opt_params = optimizer_params(params, main)
    fp8 = cfg.train.fp8 != FP8.none
    autocast = ComputeContext(precision, layout.device, fp8=fp8,
                              amax_group=layout.stage_group() if fp8 else None)
    groups = grad_groups(params, opt_params, layout)
    optimizer = build_optimizer(groups, cfg.optimizer, separate_main=bf16)
    sharded_optimizer = shards_state(optimizer)
    if bf16 and sharded_optimizer:
        shard_main_params(optimizer)
    # After the bf16 cast (under ZeRO-1, shard_main_params's): a stage's
    # activations take the dtype of its parameters.
    pipeline = (Pipeline(chunks, layout, resolved_schedule(cfg.parallel),
                         micro_batch=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len,
                         output_dtype=logits_dtype(precision),
                         # The mean is taken in the grad buffers, where bf16
                         # grads have already moved to fp32.
                         scale_grads=False)
                if layout.pp > 1 else None)
    grads: StepGrads = (ShardedGrads(params) if sharded_data else
                        GroupedGrads(groups, group_parts(optimizer), grad_dtype=torch.float32))
    state = Progress(skipped=configured_skips(cfg))
    checkpoint_state = LiveTrainingState(
        cfg, layout, list(named_state_parameters(chunks, checkpoint_key, opt_params)), optimizer,
        state, supervision.watchdog, after_load=main_to_model(main, optimizer) if bf16 else None,
        named_buffers=[(checkpoint_key(name), t) for name, t in named_state_buffers(chunks)],
        param_shards=row_shards(params, layout) if sharded_data else None)
    checkpointing = TrainCheckpointing.build(
        cfg, checkpoint_state, events, watchdog=supervision.watchdog, device=layout.device,
        fence=supervision.fence, rank=layout.rank, job_started=process_times()["launched_at"],
        local_world=supervision.local_world)
    return TrainerParts(train_data, valid_data, masking, chunks, checkpoint_key, model, params, precision,
                        main, opt_params, autocast, optimizer, sharded_optimizer, pipeline, grads,
                        state, checkpoint_state, checkpointing, compiled)


def document_masking(cfg: RecipeConfig) -> Optional[DocumentMasking]:
    """The recipe's document masking over its data's end-of-document token."""
    data = cfg.data
    if not data.masks_documents:
        return None
    return DocumentMasking(end_of_document_id(data, cfg.model.vocab_size),
                           reset_position_ids=data.reset_position_ids,
                           reset_attention_mask=data.reset_attention_mask,
                           eod_mask_loss=data.eod_mask_loss)


def named_parameters(chunks: Iterable[nn.Module],
                     checkpoint_key: KeyMap) -> Iterator[tuple[str, nn.Parameter]]:
    """(layout-free key, parameter) over a rank's chunks: the local
    backend's keys under model.backend=te too (model/te.local_key)."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            yield checkpoint_key(name), param


def named_state_parameters(chunks: Iterable[nn.Module], checkpoint_key: KeyMap,
                           opt_params: list[nn.Parameter]) -> Iterator[tuple[str, nn.Parameter]]:
    """(layout-free key, what the checkpoint holds for it): the fp32 main
    copy under bf16, else the parameter."""
    names = [key for key, p in named_parameters(chunks, checkpoint_key) if p.requires_grad]
    return zip(names, opt_params)


def main_to_model(main: Optional[MainParams], optimizer: Any) -> Callable[[], None]:
    """What sets the bf16 model to its fp32 main weights after a checkpoint
    load: the whole copies', and under ZeRO-1 the row shards' (gathered)."""
    def copy() -> None:
        if main is not None:
            main.copy_to_model()
        if shards_state(optimizer):
            optimizer.gather_params()
    return copy
