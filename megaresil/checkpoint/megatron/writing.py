"""Megatron-LM checkpoints out of megaresil checkpoints:
`megaresil convert SRC --to-megatron DIR`.

DIR is what Megatron-LM's `--load DIR` reads: `latest_checkpointed_iteration.txt`
naming the step, and `iter_NNNNNNN/` in Megatron-Core's torch_dist format at
tp=1, pp=1 (DCP reshards on load): Mcore's keys (names.py), the layers stacked
on a leading axis as its `sharded_state_dict()` asks (keyed one by one with
experts, over the global expert axis), a layer at a time; `metadata.json`;
the common state (Megatron-LM's `args`,
the iteration) both as `common.pt` and inside the DCP files. The weights only:
the optimizer state and RNG streams are dropped, which `args` says. What
Mcore's GPT cannot express is refused in one line (`refusals`). What is
written and why: docs/checkpoints.md, "To Megatron".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.backends.dcp_write import RankWriter, merged
from megaresil.checkpoint.backends.torch_dist import (
    ChunkSavePlanner,
    by_key,
    own_errors,
    quiet_single_process,
)
from megaresil.checkpoint.manager import move_into_place
from megaresil.checkpoint.megatron.arguments import MCORE_ROPE_SCALING
from megaresil.checkpoint.megatron.directory import TRACKER
from megaresil.checkpoint.megatron.names import (
    LAYER,
    LAYERS,
    TOP,
    VOCAB_KEYS,
    Name,
    names_of,
    padded,
    per_layer,
    stacked,
    swiglu_fc1,
)
from megaresil.checkpoint.megatron.reading import COMMON, COMMON_STATE
from megaresil.checkpoint.offline.convert import open_source
from megaresil.checkpoint.offline.writer import partial_dir, refuse_existing, replacing
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.sources import CheckpointSource, full_tensors
from megaresil.config import (
    ModelConfig,
    RecipeConfig,
    RopeScalingType,
    RouterScore,
    attention_head_dim,
    from_dict,
)
from megaresil.config.flavours import MEGATRON
from megaresil.data.tokenizer import GPT2_BPE
from megaresil.model.gpt import padded_vocab_size, ties_embeddings
from megaresil.model.layers import ffn_size
from megaresil.model.moe.block import has_experts

# metadata.json of a torch_dist checkpoint, as Mcore's dist_checkpointing.save writes it.
MCORE_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                  "common_backend": "torch", "common_backend_version": 1}
CHECKPOINT_VERSION = 3.0  # Megatron-LM's, since its distributed checkpoints
# What Megatron-LM's save records about how its sharded state dicts were made
# (training/checkpointing.py _build_sharded_state_dict_metadata, no distributed optimizer).
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
FILE_MODE, DIR_MODE = 0o644, 0o755  # an export is for others to read

# The modules of a layer whose `_extra_state` Mcore's load asks for: the
# linear layers (None in the local spec, FP8 metadata under Transformer
# Engine, which takes None as none) and Transformer Engine's attention.
_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                "mlp.linear_fc2", "self_attention.core_attention")


def refusals(cfg: ModelConfig) -> list[str]:
    """What of the model a Megatron-LM GPT (Mcore's GPTModel) cannot hold,
    or the export does not convert yet."""
    if cfg.flavour not in MEGATRON:
        return [f"flavour {cfg.flavour.value} (the export converts "
                f"{', '.join(f.value for f in MEGATRON)})"]
    out = []
    if cfg.sliding_window is not None:
        out.append(f"model.sliding_window={cfg.sliding_window} (not exported yet: Megatron's "
                   "window_size needs its flash attention)")
    if cfg.moe.bias_update_rate > 0 and cfg.moe.score_function != RouterScore.sigmoid:
        out.append("an expert bias over softmax scores (Megatron's expert bias takes "
                   "model.moe.score_function=sigmoid only)")
    if not float(cfg.rope_theta).is_integer():
        out.append(f"model.rope_theta={cfg.rope_theta} (Megatron's rotary_base is an integer)")
    scaling = cfg.rope_scaling
    if scaling.type == RopeScalingType.llama3 and any(
            getattr(scaling, name) != value for name, value in MCORE_ROPE_SCALING.items()):
        out.append("model.rope_scaling other than low_freq_factor=1, high_freq_factor=4, "
                   "original_max_seq_len=8192 (Mcore's Llama 3 scaling takes the factor alone)")
    return out


def _tokenizer_args(tokenizer: Optional[str]) -> dict:
    """Megatron-LM's tokenizer for the recipe's data.tokenizer: GPT-2's BPE,
    or a Hugging Face one where it names a directory or tokenizer.json; else
    none (the user gives Megatron-LM theirs)."""
    if tokenizer == GPT2_BPE:  # Megatron-LM's GPT2BPETokenizer reads --vocab-file/--merge-file
        return {"tokenizer_type": "GPT2BPETokenizer", "tokenizer_model": None}
    if tokenizer and tokenizer not in ("bpe", "byte"):
        path = Path(tokenizer).expanduser().resolve()
        return {"tokenizer_type": "HuggingFaceTokenizer",
                "tokenizer_model": str(path.parent if path.is_file() else path)}
    return {"tokenizer_type": "NullTokenizer", "tokenizer_model": None}


def experts_args(m: ModelConfig) -> dict:
    """Megatron-LM's mixture-of-experts args (num_experts None: dense). The
    layer pattern is a list, so Mcore keys each layer on its own."""
    e = m.moe
    if not e.num_experts:
        return {"num_experts": None}
    return dict(
        num_experts=e.num_experts, moe_router_topk=e.top_k,
        moe_ffn_hidden_size=e.expert_ffn_hidden_size or ffn_size(m),
        moe_shared_expert_intermediate_size=e.shared_expert_hidden_size or None,
        moe_layer_freq=[int(has_experts(e, i)) for i in range(m.num_layers)],
        moe_router_score_function=e.score_function.value,
        moe_router_pre_softmax=not e.normalize_top_k,  # megaresil's: softmax over the top k
        moe_router_topk_scaling_factor=(e.routed_scaling_factor
                                        if e.routed_scaling_factor != 1.0 else None),
        moe_router_load_balancing_type="aux_loss" if e.aux_loss_coeff else "none",
        moe_aux_loss_coeff=e.aux_loss_coeff, moe_z_loss_coeff=e.z_loss_coeff or None,
        moe_expert_capacity_factor=e.capacity_factor,
        moe_router_enable_expert_bias=e.bias_update_rate > 0,
        moe_router_bias_update_rate=e.bias_update_rate or 1e-3,
        moe_grouped_gemm=False)


def megatron_args(recipe: RecipeConfig, iteration: int, consumed_samples: int,
                  dtype: torch.dtype) -> argparse.Namespace:
    """Megatron-LM's `args` (training/arguments.py names) of the model at
    tp=1, pp=1: what `--use-checkpoint-args` reads back (load_args_from_checkpoint)
    and what its load checks (check_checkpoint_args), with the dropped state
    flagged (no_save_optim, no_save_rng)."""
    m = recipe.model
    form = MEGATRON[m.flavour]
    rope = form.position_embedding_type == "rope"
    kv_heads = m.num_kv_heads or m.num_heads
    scaled = m.rope_scaling.type == RopeScalingType.llama3
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=ffn_size(m),
        num_attention_heads=m.num_heads, group_query_attention=kv_heads < m.num_heads,
        num_query_groups=kv_heads, kv_channels=attention_head_dim(m),
        max_position_embeddings=m.max_seq_len, seq_length=recipe.data.seq_len,
        position_embedding_type=form.position_embedding_type,
        add_position_embedding=not rope, use_rotary_position_embeddings=rope,
        rotary_base=int(m.rope_theta), rotary_percent=1.0, rotary_interleaved=False,
        use_rope_scaling=scaled, rope_scaling_factor=m.rope_scaling.factor if scaled else 8.0,
        normalization=form.normalization, norm_epsilon=m.norm_eps,
        apply_layernorm_1p=False, swiglu=form.swiglu, squared_relu=False,
        openai_gelu=not form.swiglu,  # megaresil's GELU is the tanh one
        untie_embeddings_and_output_weights=not ties_embeddings(m),
        add_bias_linear=form.add_bias_linear, add_qkv_bias=form.add_qkv_bias,
        qk_layernorm=form.qk_layernorm,
        apply_query_key_layer_scaling=False, hidden_dropout=m.dropout,
        attention_dropout=m.attention_dropout, init_method_std=m.init_std,
        **experts_args(m), vocab_size=m.vocab_size, padded_vocab_size=padded_vocab_size(m, 1),
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        **_tokenizer_args(recipe.data.tokenizer),
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
        context_parallel_size=1, data_parallel_size=1, world_size=1,
        ckpt_format="torch_dist", use_dist_ckpt=True, use_distributed_optimizer=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        micro_batch_size=recipe.train.micro_batch_size,
        global_batch_size=recipe.train.global_batch_size, iteration=iteration,
        # As Megatron's parser gives --rampup-batch-size: strings, or None.
        rampup_batch_size=(None if recipe.train.rampup_batch_size is None
                           else [str(v) for v in recipe.train.rampup_batch_size]),
        consumed_train_samples=consumed_samples, consumed_valid_samples=0,
        skipped_train_samples=0, no_save_optim=True, no_save_rng=True)


def common_state(args: argparse.Namespace) -> dict:
    """The common (non-sharded) state of Megatron-LM's save_checkpoint."""
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": args.iteration,
            "num_floating_point_operations_so_far": 0, "content_metadata": CONTENT_METADATA}


# --- the tensors -------------------------------------------------------------------


def _layer_table(names: list[Name]) -> dict[str, list[Name]]:
    """Mcore's key (the spelling it writes) of each layer tensor, and the
    table rows that make it: one, or SwiGLU's two halves in order."""
    table: dict[str, list[Name]] = {}
    for name in names:
        table.setdefault(name.theirs[0], []).append(name)
    return {key: sorted(rows, key=lambda n: n.half or 0) for key, rows in table.items()}


def _top_rects(ours: dict, names: list[Name], cfg: ModelConfig,
               dtype: torch.dtype) -> list[Rect]:
    rects = []
    for name in names:
        tensor = ours[name.ours]
        if name.ours in VOCAB_KEYS:
            tensor = padded(tensor, padded_vocab_size(cfg, 1))
        rects.append(Rect(name.theirs[0], tuple(tensor.shape), (0,) * tensor.dim(),
                          tensor.to(dtype)))
    return rects


def _layer_rects(ours: dict, i: int, table: dict[str, list[Name]], cfg: ModelConfig,
                 dtype: torch.dtype) -> list[Rect]:
    """Layer i's tensors: the i-th chunk of each layer-stacked tensor, or,
    with experts (Mcore keys a mixed stack of layers one by one), its own."""
    rects = []
    for key, rows in table.items():
        parts = [ours[f"layers.{i}.{name.ours}"] for name in rows]
        tensor = (swiglu_fc1(parts[0], parts[1], experts=rows[0].experts) if len(parts) == 2
                  else parts[0]).to(dtype)
        if cfg.moe.num_experts:
            rects.append(Rect(per_layer(i, key), tuple(tensor.shape), (0,) * tensor.dim(), tensor))
        else:
            rects.append(Rect(stacked(key), (cfg.num_layers, *tensor.shape),
                              (i,) + (0,) * tensor.dim(), tensor.unsqueeze(0)))
    return rects


def _ours(source: CheckpointSource) -> set[str]:
    """The checkpoint's model tensors, in megaresil's layout-free keys."""
    return {key.removeprefix("model/") for key in source.tensors if key.startswith("model/")}


def _pieces(source: CheckpointSource, cfg: ModelConfig,
            dtype: torch.dtype) -> Iterator[list[Rect]]:
    """The model a piece at a time (the tensors outside the layers, then
    each layer), so an export holds one piece in memory, not the model."""
    def read(keys: list[str]) -> dict:
        return {key.removeprefix("model/"): t
                for key, t in full_tensors(source, [f"model/{k}" for k in keys])}

    held = _ours(source)
    top, _ = names_of(held)
    yield _top_rects(read([name.ours for name in top]), top, cfg, dtype)
    for i in range(cfg.num_layers):
        names = _layer_names(held, i)
        yield _layer_rects(read([f"layers.{i}.{name.ours}" for name in names]), i,
                           _layer_table(names), cfg, dtype)


def _layer_names(held: set[str], i: int) -> list[Name]:
    """The key table's rows that layer i has (a dense layer and one with
    experts differ)."""
    return [name for name in LAYER if f"layers.{i}.{name.ours}" in held]


def _unmapped(source: CheckpointSource) -> list[str]:
    """Model tensors the key table has no Mcore name for."""
    mapped = {n.ours for n in TOP} | {n.ours for n in LAYER}
    return sorted(key for key in _ours(source)
                  if (key.split(".", 2)[2] if key.startswith("layers.") else key) not in mapped)


def _extra_states(cfg: ModelConfig, held: set[str]) -> dict[str, list]:
    """The `_extra_state` objects Mcore's load asks for, one per module and
    layer (per expert, for the experts), under ShardedObject unique keys
    (`key/shard_<offset>_<shape>`)."""
    layers, experts = cfg.num_layers, cfg.moe.num_experts
    if not experts:
        return {f"{LAYERS}{module}._extra_state/shard_{i}_{layers}": [None]
                for module in _EXTRA_STATE for i in range(layers)}
    out = {}
    for i in range(layers):
        weights = (key.rsplit(".", 1) for key in _layer_table(_layer_names(held, i)))
        modules = {owner for owner, param in weights
                   if param == "weight" and owner.rsplit(".", 1)[-1].startswith("linear_")}
        for module in sorted(modules | {"self_attention.core_attention"}):
            count = experts if ".experts.experts." in module else 1
            out.update({f"{per_layer(i, module)}._extra_state/shard_{j}_{count}": [None]
                        for j in range(count)})
    return out


def _objects(cfg: ModelConfig, held: set[str], common: dict) -> dict[str, list]:
    """The pickled objects of the checkpoint under their DCP keys, each in a
    one-element list as Mcore saves a ShardedObject: the extra states and
    the common state."""
    return {**_extra_states(cfg, held), COMMON_STATE: [common]}


class _ObjectWriter(RankWriter):
    """RankWriter for pickled objects: DCP's own writing, which takes them."""
    write_data = dcp.FileSystemWriter.write_data


def _write_dcp(directory: Path, pieces: Iterator[list[Rect]], objects: dict[str, list]) -> None:
    """Each piece saved on its own (its own `__<n>_0.distcp`), the objects
    last, then DCP's one `.metadata` over all of them."""
    notes = []
    with quiet_single_process(), own_errors():
        for n, rects in enumerate(pieces):
            writer = RankWriter(directory, n)
            saved = dcp.save(by_key(rects), storage_writer=writer, planner=ChunkSavePlanner(),
                             no_dist=True)
            notes.append((saved.state_dict_metadata, writer.results))
        writer = _ObjectWriter(directory, len(notes))
        dcp.save(objects, storage_writer=writer,
                 planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    metadata, results = merged(notes)
    metadata.state_dict_metadata.update({key: BytesStorageMetadata() for key in objects})
    dcp.FileSystemWriter(str(directory), sync_files=True).finish(metadata,
                                                                 results + [writer.results])


def _refuse_unmapped(src: Path, source: CheckpointSource, cfg: ModelConfig) -> None:
    refused, unmapped = refusals(cfg), _unmapped(source)
    if not refused and unmapped:
        refused = [f"tensors Mcore's GPT has no name for ({', '.join(unmapped[:4])})"]
    if refused:
        raise fmt.CheckpointError(f"{src} cannot be exported to Megatron: it has "
                                  f"{'; '.join(refused)}. Fix: export it with --to-hf instead, "
                                  "or convert a model without these.")


def export_to_megatron(src: Path, out: Path, *, overwrite: bool = False,
                       dtype: Optional[str] = None) -> Path:
    """Write checkpoint `src`'s weights as a Megatron-LM checkpoint directory
    (`--load out`), its step as the iteration; `dtype` (default float32)."""
    refuse_existing(out, overwrite)
    source = open_source(src)
    source.verify()
    recipe = from_dict(source.manifest["recipe"])
    _refuse_unmapped(src, source, recipe.model)
    torch_dtype = fmt.torch_dtype(dtype or "float32")
    step = source.manifest["step"]
    args = megatron_args(recipe, step, source.manifest["data"]["consumed_samples"], torch_dtype)
    if args.tokenizer_type == "NullTokenizer":
        print("megaresil: no tokenizer named in the Megatron args (tokenizer_type "
              "NullTokenizer): give Megatron-LM yours with --tokenizer-type/--tokenizer-model",
              file=sys.stderr)
    with partial_dir(out) as partial:
        iteration = partial / f"iter_{step:07d}"
        iteration.mkdir()
        common = common_state(args)
        _write_dcp(iteration, _pieces(source, recipe.model, torch_dtype),
                   _objects(recipe.model, _ours(source), common))
        torch.save(common, iteration / COMMON)
        (iteration / "metadata.json").write_text(json.dumps(MCORE_METADATA))
        (partial / TRACKER).write_text(str(step))
        for path in (p for p in partial.rglob("*") if p.is_file()):
            path.chmod(FILE_MODE)
        for directory in (partial, iteration):
            directory.chmod(DIR_MODE)
        fmt.fsync_tree(partial)
        with replacing(out, overwrite) as make_room:
            move_into_place(partial, out, make_room)
    return out
