"""The rules that span fields, checked after a recipe is composed: each
raises `ConfigError(key, problem, fix)` naming the key to change and how."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Optional

from megaresil.config.batch import batch_start_at_or_below, global_batch_at, validate_ramp
from megaresil.config.compiling import validate_compile
from megaresil.config.context import validate_context_parallel
from megaresil.config.faults import LOCAL_FAULT_KINDS, FaultKind, parse_faults
from megaresil.config.fields import Bounds, public_key, require
from megaresil.config.flavours import TRAITS, flavours_with
from megaresil.config.optimizer import validate_optimizer
from megaresil.config.run import SUPERVISION_BOUNDS, CheckpointConfig
from megaresil.config.schema import (
    FP8,
    ActivationOffload,
    Backend,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    PipelineSchedule,
    RecipeConfig,
    Recompute,
    RecomputePolicy,
    RopeScalingType,
    TrainConfig,
    attention_head_dim,
    microbatches_per_step,
    resolved_schedule,
)
from megaresil.config.sharded_data import validate_sharded_data


def numeric_fields(node: Any, prefix: str = "") -> Iterator[tuple[str, float, Optional[Bounds]]]:
    """(key, value, declared bounds) of every number set in a config tree."""
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from numeric_fields(value, key + ".")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            public = public_key(key)
            yield public, value, f.metadata.get("bounds") or SUPERVISION_BOUNDS.get(public)


def _validate_bounds(cfg: RecipeConfig) -> None:
    for key, value, bounds in numeric_fields(cfg):
        require(math.isfinite(value), key, f"must be a finite number, got {value}.",
                "give a finite value (`megaresil config docs`).")
        if bounds is not None:
            require(bounds.admits(value), key, f"must be {bounds}, got {value}.",
                    f"give a value {bounds}.")


def _validate_model(m: ModelConfig, p: ParallelConfig) -> None:
    require(m.head_dim is not None or m.hidden_size % m.num_heads == 0, "model.num_heads",
            f"{m.num_heads} heads do not divide hidden_size {m.hidden_size}.",
            "choose num_heads dividing model.hidden_size, or set model.head_dim.")
    # RoPE rotates each head's two halves against each other.
    require(not TRAITS[m.flavour].rope or attention_head_dim(m) % 2 == 0, "model.head_dim",
            f"RoPE needs an even head width, got {attention_head_dim(m)}.",
            "choose model.head_dim (or hidden_size / num_heads) even.")
    kv = m.num_kv_heads or m.num_heads
    require(m.num_heads % kv == 0, "model.num_kv_heads",
            f"{kv} kv heads do not divide num_heads {m.num_heads}.",
            "choose num_kv_heads dividing model.num_heads.")
    require(m.num_heads % p.tp == 0, "parallel.tp",
            f"tp={p.tp} does not divide model.num_heads={m.num_heads}.",
            "choose tp dividing the number of attention heads.")
    # Each TP rank holds whole kv groups (Megatron's rule); kv heads are not replicated.
    require(kv % p.tp == 0, "parallel.tp",
            f"tp={p.tp} does not divide model.num_kv_heads={kv}.",
            "choose tp dividing the number of key/value heads.")
    require(m.num_layers % (p.pp * p.vpp) == 0, "model.num_layers",
            f"{m.num_layers} layers do not divide into pp*vpp={p.pp * p.vpp} chunks.",
            "choose num_layers a multiple of parallel.pp * parallel.vpp.")
    _validate_activation_memory(m, p)
    if not TRAITS[m.flavour].grouped_query:
        name = m.flavour.value
        require(m.num_kv_heads in (None, m.num_heads), "model.num_kv_heads",
                f"{name} flavour has no grouped-query attention.",
                f"leave num_kv_heads null for {name}, or use {_flavour_choice('grouped_query')}.")


# grouped_mm needs 16-byte strides: bf16 rows of a multiple of 8 elements.
GROUPED_MM_ALIGN = 8


def _validate_moe(m: ModelConfig, p: ParallelConfig) -> None:
    e = m.moe
    require(e.num_experts > 0 or not TRAITS[m.flavour].needs_experts, "model.moe.num_experts",
            f"the {m.flavour.value} flavour is a mixture of experts.",
            "set model.moe.num_experts (and the rest of model.moe), or flavour=llama.")
    if e.num_experts == 0:
        return
    require(TRAITS[m.flavour].experts, "model.moe.num_experts",
            f"the {m.flavour.value} flavour has no experts.",
            f"set model.{_flavour_choice('experts')}, or model.moe.num_experts=0.")
    require(e.top_k <= e.num_experts, "model.moe.top_k",
            f"{e.top_k} exceeds num_experts={e.num_experts}.",
            f"choose top_k between 1 and {e.num_experts}.")
    require(e.first_dense_layers < m.num_layers, "model.moe.first_dense_layers",
            f"{e.first_dense_layers} leaves none of the {m.num_layers} layers with experts.",
            f"choose first_dense_layers below {m.num_layers}, or model.moe.num_experts=0.")
    require(m.backend == Backend.local, "model.moe.num_experts",
            "experts have no Transformer Engine layers yet.", "set model.backend=local.")
    require(m.hidden_size % GROUPED_MM_ALIGN == 0, "model.hidden_size",
            f"{m.hidden_size} is not a multiple of {GROUPED_MM_ALIGN}, which the experts' "
            "grouped matmul needs.", f"choose hidden_size a multiple of {GROUPED_MM_ALIGN}.")
    require(not (e.bias_update_rate and m.recompute == Recompute.full),
            "model.moe.bias_update_rate", "the expert bias counts each token once per forward, "
            "and full recomputation runs the forward again.", "set model.recompute=none or "
            "selective, or model.moe.bias_update_rate=0.")
    _require_expert_width(e, m.ffn_hidden_size, p.tp)


def _validate_expert_parallel(e: MoEConfig, p: ParallelConfig) -> None:
    if p.ep == 1:
        return
    require(e.num_experts > 0, "parallel.ep", "expert parallelism needs experts.",
            "set parallel.ep=1, or model.moe.num_experts > 0.")
    require(p.dp % p.ep == 0, "parallel.ep", f"{p.ep} does not divide dp={p.dp}: the "
            "expert-parallel groups are carved from the data-parallel ranks.",
            f"choose parallel.ep among the divisors of {p.dp}.")
    require(e.num_experts % p.ep == 0, "parallel.ep", f"{p.ep} does not divide "
            f"num_experts={e.num_experts}.", f"choose parallel.ep dividing {e.num_experts}.")


@dataclasses.dataclass(frozen=True)
class NoLiveCopy:
    """Why no live rank holds a copy of a lost rank's whole state, which live
    replacement takes from a data-parallel peer's memory (a rank's peers with
    the same state: its edp group, ParallelLayout.whole_state_groups).
    `refused`: the recipe may not turn live replacement on at all; otherwise
    a replacement resumes from the newest checkpoint."""
    why: str
    refused: bool


def no_live_copy(cfg: RecipeConfig) -> Optional[NoLiveCopy]:
    """The one rule of what live replacement needs, for every layout: an edp
    group of two or more ranks (dp / ep > 1, or cp > 1: context-parallel
    peers hold the same state; under sharded data parallelism, whose shards
    are cut over cp too, a dp_replicate group, dp / dp_shard > 1) whose
    optimizer state is not sharded over them. None where the layout has such a copy."""
    p = cfg.parallel
    if p.dp == 1 and p.cp == 1:
        return NoLiveCopy("at dp=1 no data-parallel peer holds a copy of a rank's state", False)
    # Under cp > 1 the cp peers hold every rank's whole state, experts
    # included (they are replicated over (edp, cp)), whatever dp.
    if p.ep == p.dp and p.cp == 1:
        return NoLiveCopy(f"at ep = dp = {p.dp} each rank holds the only copy of its experts",
                          True)
    # Under HSDP (dp_shard < dp) a rank's dp_replicate peers hold its shard
    # alike (ParallelLayout.whole_state_groups), so a copy lives; full
    # sharding leaves each shard in one rank's memory.
    if p.dp_shard == p.dp > 1:
        return NoLiveCopy(f"at parallel.dp_shard = dp = {p.dp} each rank holds the only copy of "
                          "its parameter and optimizer shards", False)
    if cfg.optimizer.distributed:
        return NoLiveCopy("optimizer.distributed=true keeps each optimizer shard in one rank's "
                          "memory only", False)
    return None


def _validate_expert_parallel_composes(cfg: RecipeConfig) -> None:
    """What expert parallelism does not compose with yet."""
    gap = no_live_copy(cfg)
    if gap and gap.refused:
        require(not cfg.resilience.replacement.enabled, "resilience.replacement.enabled",
                f"{gap.why}, so no live peer could hand them to a replacement.",
                f"set parallel.ep below {cfg.parallel.dp}, or resilience.replacement.enabled="
                "false and checkpoint.local.enabled=true (the node-local tier keeps every "
                "rank's state).")


def _require_expert_width(e: MoEConfig, ffn: Optional[int], tp: int) -> None:
    """Each tp rank's slice of an expert's (or the shared expert's) width is
    whole and a multiple of GROUPED_MM_ALIGN (the flavours' default widths are
    multiples of 64)."""
    unit = GROUPED_MM_ALIGN * tp
    widths = [("model.moe.expert_ffn_hidden_size", e.expert_ffn_hidden_size or ffn),
              ("model.moe.shared_expert_hidden_size", e.shared_expert_hidden_size or None)]
    for key, width in widths:
        require(width is None or width % unit == 0, key,
                f"{width} does not split into tp={tp} slices of a multiple of "
                f"{GROUPED_MM_ALIGN} (the grouped matmul's alignment).",
                f"choose a multiple of {unit}.")


def _flavour_choice(trait: str) -> str:
    """`flavour=NAME` for each flavour with `trait`, as a fix offers them."""
    return " or ".join(f"flavour={name}" for name in flavours_with(trait))


def _validate_rope_scaling(m: ModelConfig) -> None:
    r = m.rope_scaling
    if r.type == RopeScalingType.llama3:
        having = flavours_with("rope")
        require(TRAITS[m.flavour].rope, "model.rope_scaling.type",
                f"RoPE scaling needs RoPE, which only the {' and '.join(having)} flavour"
                f"{'s have' if len(having) > 1 else ' has'}.",
                f"set model.{_flavour_choice('rope')} or rope_scaling.type=none.")
        require(r.high_freq_factor > r.low_freq_factor, "model.rope_scaling.high_freq_factor",
                f"{r.high_freq_factor} must exceed low_freq_factor={r.low_freq_factor}.",
                "use Llama 3's values (low 1, high 4) or others with high > low.")


def _validate_sliding_window(m: ModelConfig) -> None:
    if m.sliding_window is None:
        return
    require(TRAITS[m.flavour].sliding_window, "model.sliding_window",
            f"the {m.flavour.value} flavour has no sliding-window attention (its Hugging Face "
            "model attends to every earlier position).",
            f"set model.{_flavour_choice('sliding_window')}, or model.sliding_window=null.")
    require(m.backend == Backend.local, "model.sliding_window",
            "the Transformer Engine backend's attention is not given the window yet.",
            "set model.backend=local, or model.sliding_window=null.")


def _validate_token_ids(m: ModelConfig) -> None:
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(m, name)
        require(token is None or token < m.vocab_size, f"model.{name}",
                f"{token} is outside the vocabulary (vocab_size={m.vocab_size}).",
                "give an id below model.vocab_size, or null.")


def _validate_interval(c: CheckpointConfig) -> None:
    require(not isinstance(c.interval, str) or c.interval == "auto", "checkpoint.interval",
            f"{c.interval!r} is neither auto nor a number of steps.",
            "give auto, a number of steps, or 0 for never.")


def _validate_init_from(c: CheckpointConfig) -> None:
    require(not c.init_from_optimizer or bool(c.init_from), "checkpoint.init_from_optimizer",
            "is set but checkpoint.init_from is not.",
            "set checkpoint.init_from=PATH (a full checkpoint) or drop init_from_optimizer.")

def _validate_activation_memory(m: ModelConfig, p: ParallelConfig) -> None:
    full = m.recompute == Recompute.full
    chunk_layers = m.num_layers // (p.pp * p.vpp)
    custom_policy = m.recompute_layers != 1 or m.recompute_policy != RecomputePolicy.uniform
    require(full or not custom_policy, "model.recompute_layers",
            f"recompute_policy/recompute_layers choose layers of full recomputation, but "
            f"recompute={m.recompute.value}.", "set model.recompute=full or leave them at "
            "uniform/1.")
    require(m.recompute_layers <= chunk_layers, "model.recompute_layers",
            f"{m.recompute_layers} exceeds the {chunk_layers} layers of a pipeline chunk "
            f"(num_layers / (pp*vpp)).", f"choose recompute_layers <= {chunk_layers}.")
    if m.activation_partition:
        require(full, "model.activation_partition",
                "partitions the inputs of fully recomputed layers, but recompute="
                f"{m.recompute.value}.", "set model.recompute=full.")
        require(p.tp > 1, "model.activation_partition", "splits checkpoints across the TP group "
                "but tp=1.", "set parallel.tp > 1 or turn it off.")
        require(not p.sequence_parallel, "model.activation_partition", "with sequence "
                "parallelism each rank's checkpoints are already 1/tp of the sequence.",
                "turn parallel.sequence_parallel off or activation_partition off.")
    require(full or m.activation_offload == ActivationOffload.none, "model.activation_offload",
            f"offloads the inputs of fully recomputed layers, but recompute={m.recompute.value}.",
            "set model.recompute=full or activation_offload=none.")


def _validate_batch(cfg: RecipeConfig) -> None:
    t, p = cfg.train, cfg.parallel
    per_step = t.micro_batch_size * p.dp
    require(t.global_batch_size % per_step == 0, "train.global_batch_size",
            f"{t.global_batch_size} is not a multiple of micro_batch_size*dp = "
            f"{t.micro_batch_size}*{p.dp} = {per_step}.",
            f"use a multiple of {per_step}, e.g. {per_step * max(1, t.global_batch_size // per_step)}.")
    if t.exit_at_step is not None:
        require(0 < t.exit_at_step <= t.steps, "train.exit_at_step",
                f"{t.exit_at_step} is outside 1..train.steps={t.steps}.",
                "choose a step between 1 and train.steps.")
    require(cfg.data.seq_len <= cfg.model.max_seq_len, "data.seq_len",
            f"{cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}.",
            "lower data.seq_len or raise model.max_seq_len.")



def _validate_pipeline(cfg: RecipeConfig) -> None:
    p = cfg.parallel
    schedule = resolved_schedule(p)
    interleaved = schedule in (PipelineSchedule.interleaved_1f1b,
                               PipelineSchedule.interleaved_zero_bubble)
    require(p.vpp == 1 or p.pp > 1, "parallel.vpp", "virtual stages need pipeline parallelism.",
            "set parallel.pp > 1 or parallel.vpp=1.")
    require(p.vpp == 1 or interleaved, "parallel.schedule",
            f"{schedule.value} runs one chunk per stage but vpp={p.vpp}.",
            "use schedule=interleaved_1f1b (or auto) with vpp > 1.")
    if p.pp == 1:
        return
    m = microbatches_per_step(cfg)
    if interleaved:
        require(m >= p.pp and m % p.pp == 0, "train.global_batch_size",
                f"the interleaved schedule needs the micro-batches per step "
                f"(global_batch/(micro_batch*dp) = {m}) to be a multiple of pp={p.pp}.",
                f"raise train.global_batch_size to a multiple of "
                f"{p.pp * cfg.train.micro_batch_size * p.dp}.")
    elif schedule == PipelineSchedule.one_f_one_b:
        require(m >= p.pp, "train.global_batch_size",
                f"1F1B needs at least pp={p.pp} micro-batches per step, got {m}.",
                f"raise train.global_batch_size to at least "
                f"{p.pp * cfg.train.micro_batch_size * p.dp} or use schedule=gpipe.")


def _validate_observing(cfg: RecipeConfig) -> None:
    require(cfg.logging.wandb.mode in WANDB_MODES, "logging.wandb.mode",
            f"{cfg.logging.wandb.mode!r} is not a W&B mode.", f"use one of {list(WANDB_MODES)}.")
    bad = [r for r in cfg.profile.ranks if not (isinstance(r, int) and r >= 0)]
    require(not bad, "profile.ranks", f"{bad} are not ranks.", "give ranks as integers >= 0.")


WANDB_MODES = ("online", "offline", "disabled")


def _validate_skips(skips: list, train: TrainConfig) -> None:
    """Each entry whole global batches from where a batch starts, none inside
    another: the sampler only ever stands at a batch start (data/sampler.
    skip_past), so any other entry would skip nothing."""
    key = "resilience.numerics.skip_batches"
    for i, skip in enumerate(skips):
        ok = (isinstance(skip, (list, tuple)) and len(skip) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in skip)
              and skip[0] >= 0 and skip[1] > 0)
        require(ok, f"{key}[{i}]",
                f"must be [first_sample, samples] (integers, samples > 0), got {skip!r}.",
                "write e.g. [[40, 8]] to pass over samples 40..47.")
        first, samples = skip
        below = batch_start_at_or_below(train, first)
        require(first == below, f"{key}[{i}]",
                f"{list(skip)} does not start a global batch: the batch there starts at "
                f"{below} (train.global_batch_size, train.rampup_batch_size), so it would "
                "skip nothing.", f"start it at {below} or {below + global_batch_at(train, below)}.")
        end = batch_start_at_or_below(train, first + samples)
        require(end == first + samples, f"{key}[{i}]",
                f"{list(skip)} is not a whole number of global batches (the batch at "
                f"{first} is {global_batch_at(train, first)} samples).",
                f"end it where a batch starts, e.g. [{first}, {global_batch_at(train, first)}].")
    taken = sorted(((first, samples, i) for i, (first, samples) in enumerate(skips)))
    for (first, samples, _), (later, n, i) in zip(taken, taken[1:]):
        require(later >= first + samples, f"{key}[{i}]",
                f"[{later}, {n}] repeats or lies inside [{first}, {samples}]: the sampler "
                "passes over that batch already, so it would skip nothing.",
                "give each batch once (merge overlapping entries into one).")


def validate(cfg: RecipeConfig) -> None:
    """Cross-field rules; raises `ConfigError` naming the key and the fix."""
    _validate_bounds(cfg)
    _validate_observing(cfg)
    validate_optimizer(cfg.optimizer, cfg.train.steps)
    _validate_model(cfg.model, cfg.parallel)
    _validate_rope_scaling(cfg.model)
    _validate_sliding_window(cfg.model)
    _validate_token_ids(cfg.model)
    _validate_moe(cfg.model, cfg.parallel)
    _validate_expert_parallel(cfg.model.moe, cfg.parallel)
    _validate_expert_parallel_composes(cfg)
    validate_context_parallel(cfg)
    validate_sharded_data(cfg)
    validate_compile(cfg)
    _validate_batch(cfg)
    _validate_pipeline(cfg)
    validate_ramp(cfg)
    router_faults = [f for f in parse_faults(cfg.faults) if f.kind == FaultKind.router_nan]
    require(cfg.model.moe.num_experts > 0 or not router_faults, "faults",
            "router_nan acts on a router's scores, and this model has no experts.",
            "give the model experts (model.moe.num_experts), or drop the fault.")
    local_faults = [f.kind.value for f in parse_faults(cfg.faults) if f.kind in LOCAL_FAULT_KINDS]
    require(cfg.checkpoint.local.enabled or not local_faults, "faults",
            f"{local_faults[0] if local_faults else ''} acts on the local checkpoint tier, "
            "which is off.", "set checkpoint.local.enabled=true.")
    if cfg.train.fp8 != FP8.none:
        require(cfg.model.backend == Backend.te, "train.fp8",
                "FP8 needs Transformer Engine's layers.", "set model.backend=te, or train.fp8=none.")
    require(cfg.parallel.tp > 1 or not cfg.parallel.sequence_parallel, "parallel.sequence_parallel",
            "sequence parallelism needs tp > 1.", "set parallel.tp>1 or turn it off.")
    _validate_interval(cfg.checkpoint)
    _validate_init_from(cfg.checkpoint)
    _validate_local_tier(cfg)
    _validate_data(cfg)
    _validate_document_masking(cfg)
    _validate_skips(cfg.resilience.numerics.skip_batches, cfg.train)
    require(cfg.resilience.in_process or not cfg.resilience.replacement.enabled,
            "resilience.replacement.enabled", "live replacement keeps the other ranks in their "
            "processes, which needs in-process restarts.",
            "set resilience.in_process=true, or resilience.replacement.enabled=false.")


def _validate_local_tier(cfg: RecipeConfig) -> None:
    per_node = cfg.checkpoint.local.ranks_per_node
    world = cfg.parallel.world_size
    if per_node:
        require(world % per_node == 0, "checkpoint.local.ranks_per_node",
                f"{per_node} does not divide the world size tp*pp*dp = {world}.",
                f"choose a divisor of {world}, or 0 for the launcher's LOCAL_WORLD_SIZE.")


def _validate_data(cfg: RecipeConfig) -> None:
    data = cfg.data
    if data.source == "indexed":
        require(bool(data.path) != bool(data.paths), "data.path",
                "source 'indexed' needs one dataset prefix (data.path) or a blend (data.paths), "
                "not both.", "set data.path=PREFIX (the part before .bin/.idx), or for a "
                "blend data.path=null data.paths='[0.7, PREFIX_A, 0.3, PREFIX_B]'.")
    else:
        require(not (data.path or data.paths), "data.source",
                f"data.path/data.paths are read only by source 'indexed', not {data.source!r}.",
                "set data.source=indexed, or drop data.path/data.paths.")


def _validate_document_masking(cfg: RecipeConfig) -> None:
    data = cfg.data
    switch = next((f"data.{name}" for name in ("reset_attention_mask", "reset_position_ids",
                                               "eod_mask_loss") if getattr(data, name)), None)
    if switch is None:
        return
    require(data.source != "synthetic", switch, "synthetic data has no documents: no "
            "end-of-document token to find.", "train on a corpus or indexed data, or turn "
            "document masking off.")
    require(not data.reset_attention_mask or cfg.model.backend == Backend.local,
            "data.reset_attention_mask", "the Transformer Engine backend's attention is not "
            "given the documents yet.", "set model.backend=local, or "
            "data.reset_attention_mask=false.")


def validate_world_size(cfg: RecipeConfig, world_size: int) -> None:
    p = cfg.parallel
    need = p.world_size
    require(need == world_size, "parallel",
            f"{_product_text(p)} = {need} but the world size is {world_size}.",
            f"launch {need} processes, or {fitting_change(p.model_parallel_size, world_size)}.")


def _product_text(p: ParallelConfig) -> str:
    """"tp*pp*dp = 2*1*2" (cp named where it is used, as the layout's axes)."""
    if p.cp == 1:
        return f"tp*pp*dp = {p.tp}*{p.pp}*{p.dp}"
    return f"tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{p.dp}"


def fitting_change(tp_pp: int, world_size: int) -> str:
    """The layout change that fits the world, where one dp does."""
    if world_size % tp_pp == 0:
        return f"change parallel.dp to {world_size // tp_pp}"
    return f"choose parallel.tp*pp (now {tp_pp}) dividing {world_size}, then dp to fit"
