"""The GPT decoder (every flavour of `model/flavours/`) and its layout-free parameter names.

Parameter keys use global layer numbers (`layers.17.attn.qkv.weight` wherever
layer 17 lives), so a checkpoint's keys do not depend on the parallel layout.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn

from megaresil.config import ModelConfig
from megaresil.model.activations import CheckpointStore, recompute_segments
from megaresil.model.flavours import spec_of_model
from megaresil.model.init import global_shape
from megaresil.model.kv_cache import KVCache
from megaresil.model.layers import Block, make_norm, sequence_dropout
from megaresil.model.losses import OutputZLoss
from megaresil.model.masks import Documents
from megaresil.model.moe import MoELossScale
from megaresil.parallel.context_parallel import CPGroup
from megaresil.parallel.expert_parallel import EPGroup
from megaresil.parallel.sharding import EMBEDDING_TIE, with_spec
from megaresil.parallel.tensor_parallel import (
    ColumnParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    cross_entropy_and_logsumexp,
    enter_tp_region,
    gather_vocab,
    mark_replicated,
    seq_shard,
    swap_batch_and_sequence,
    vocab_parallel_cross_entropy,
)


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp, as
    Megatron pads it, so every TP rank holds an equal slice of the embedding."""
    multiple = cfg.make_vocab_size_divisible_by * tp
    return -(-cfg.vocab_size // multiple) * multiple


def layout_free_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in a checkpoint (unsharded, the real
    vocabulary), read off the whole model built on the meta device: no
    memory, no process group."""
    with torch.device("meta"):
        model = GPT(cfg)
    return {key: tuple(global_shape(key, param, cfg)) for key, param in model.named_parameters()}


def layout_free_buffer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each state buffer's shape in a checkpoint (the expert biases: whole
    on every rank), read off the whole model built on the meta device."""
    from megaresil.model.moe.balance import named_state_buffers

    with torch.device("meta"):
        model = GPT(cfg)
    return {key: tuple(buffer.shape) for key, buffer in named_state_buffers([model])}


def ties_embeddings(cfg: ModelConfig) -> bool:
    if cfg.tie_embeddings is not None:
        return cfg.tie_embeddings
    return spec_of_model(cfg).tied_by_default


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, padded_vocab: int, seed: int, *,
                 positions: bool = True, cp: CPGroup = CPGroup()):
        super().__init__()
        self.tp, self.cp = tp, cp
        self.tokens = VocabParallelEmbedding(padded_vocab, cfg.hidden_size, tp)
        self.positions = (nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
                          if spec_of_model(cfg).learned_positions and positions else None)
        if self.positions is not None:
            mark_replicated(self.positions.parameters(), tp)
        self.dropout = sequence_dropout(cfg.dropout, "embed", seed, tp, cp)

    def forward(self, tokens: torch.Tensor, samples: Optional[torch.Tensor],
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`positions` (B, T): each token's place in its document (None: its
        place in the sequence, this rank's chunks' under context parallelism)."""
        x = self.tokens(tokens)  # (B, T, C), or (B, T/tp, C) under SP
        if self.positions is not None:
            if positions is None:
                positions = self.cp.positions(tokens.shape[1], tokens.device).unsqueeze(0)
            pos = self.positions(positions)  # (B or 1, T, C)
            x = x + (seq_shard(pos, self.tp) if self.tp.sequence_parallel else pos)
        return self.dropout(x, samples)


class GPT(nn.Module):
    """The whole model, or one pipeline chunk of it: the embedding when `first`,
    the blocks `layer_ids`, the final norm and output head when `last`.

    With tied embeddings a last chunk that is not also first keeps its own copy
    of `embed.tokens.weight` (same key, same init); the pipeline keeps the two
    copies equal by summing their grads, as Megatron does.

    `z_loss`: the coefficient of the z-loss on the output logits (train.z_loss).
    """

    def __init__(self, cfg: ModelConfig, *, tp: TPGroup = TPGroup(), ep: EPGroup = EPGroup(),
                 cp: CPGroup = CPGroup(), seed: int = 0, layer_ids: Optional[range] = None,
                 first: bool = True, last: bool = True, z_loss: float = 0.0):
        super().__init__()
        self.cfg, self.tp, self.cp, self.first, self.last = cfg, tp, cp, first, last
        self.padded_vocab = padded_vocab_size(cfg, tp.size)
        self.tied = ties_embeddings(cfg)
        if first or (last and self.tied):
            self.embed = Embedding(cfg, tp, self.padded_vocab, seed, positions=first, cp=cp)
        if self.tied and first != last:
            with_spec(self.embed.tokens.weight, tie=EMBEDDING_TIE, pipeline_copy=not first)
        layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        # What the trainer's backward scales this chunk's loss by (MoELossScale).
        self.moe_loss_scale = MoELossScale()
        self.layers = nn.ModuleDict({str(i): Block(cfg, tp, index=i, seed=seed,
                                                   moe_scale=self.moe_loss_scale, ep=ep, cp=cp)
                                     for i in layer_ids})
        self.segments = recompute_segments(cfg, layer_ids)
        self.checkpoints = CheckpointStore.for_model(cfg, tp)
        # The blocks' activation layout: (B, T, C), or (T, B, C) once model/te.py
        # has converted them (Megatron's layout, the one TE's sequence
        # parallelism shards along dim 0). The stage's inputs and outputs stay
        # (B, T, C) either way, so pipeline shapes, embedding and head do not change.
        self.sequence_first = False
        if last:
            self.output_z_loss = OutputZLoss(z_loss)
            self.norm = make_norm(cfg, tp)
            self.head = (None if self.tied else
                         ColumnParallelLinear(cfg.hidden_size, self.padded_vocab, tp, bias=False))

    def stage_forward(self, x: torch.Tensor, samples: Optional[torch.Tensor],
                      documents: Optional[Documents] = None,
                      cache: Optional[KVCache] = None) -> torch.Tensor:
        """tokens (first chunk) or hidden states in; hidden states or this
        rank's vocabulary slice of the logits (last chunk) out. `documents`:
        the micro-batch's documents under document masking (model/masks.py);
        `cache`: generation's keys and values so far (the whole model's);
        with it a last chunk returns the last position's logits alone."""
        if self.first:
            positions = (cache.positions(x.shape[1]) if cache is not None else
                         None if documents is None else documents.positions)
            x = self.embed(x, samples, positions)  # (B, T, C), or (B, T/tp, C) under SP
        x = self.blocks_layout(x)
        for layer_ids, recompute in self.segments:
            run = functools.partial(self.run_layers, layer_ids, documents=documents, cache=cache)
            if recompute and self.training:
                x = self.checkpoints.run(run, x, samples)
            else:
                x = run(x, samples)
        x = self.blocks_layout(x)
        if cache is not None:
            cache.advance(x.shape[1])
            if self.last:  # generation reads the last token's logits alone
                x = x[:, -1:]
        if not self.last:
            return x
        x = self.norm(x)
        if self.head is not None:
            return self.head(x)  # (B, T, padded V / tp)
        return nn.functional.linear(enter_tp_region(x, self.tp), self.embed.tokens.weight)

    def blocks_layout(self, x: torch.Tensor) -> torch.Tensor:
        """Between the stage's (B, T, C) and sequence-first blocks' (T, B, C), either
        way; an identity for batch-first blocks. Contiguous: TE's GEMMs view their
        input as 2-D."""
        return swap_batch_and_sequence(x).contiguous() if self.sequence_first else x

    def run_layers(self, layer_ids: list[int], x: torch.Tensor, samples: Optional[torch.Tensor],
                   *, documents: Optional[Documents],
                   cache: Optional[KVCache] = None) -> torch.Tensor:
        for i in layer_ids:
            x = self.layers[str(i)](x, samples, documents, cache)
        return x

    def example_io(self, micro_batch: int, seq_len: int, output_dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty tensors shaped as `stage_forward`'s input and output for one
        micro-batch: token ids or hidden states in; hidden states or logits
        (in `output_dtype`) out. Hidden states are sequence-sharded under SP and
        in the parameters' dtype (bf16 under train.precision=bf16)."""
        seq_len //= self.cp.size  # this rank's chunks of each sequence
        seq = seq_len // self.tp.size if self.tp.sequence_parallel else seq_len
        hidden = torch.empty(micro_batch, seq, self.cfg.hidden_size, device=device,
                             dtype=next(self.parameters()).dtype)
        tokens = torch.empty(micro_batch, seq_len, dtype=torch.long, device=device)
        logits = torch.empty(micro_batch, seq_len, self.padded_vocab // self.tp.size,
                             dtype=output_dtype, device=device)
        return (tokens if self.first else hidden), (logits if self.last else hidden)

    def loss(self, local_logits: torch.Tensor, targets: torch.Tensor, *,
             overwrite_logits: bool = False) -> torch.Tensor:
        """Mean next-token cross-entropy over the B*T positions but those
        whose target is IGNORE_TARGET (data.eod_mask_loss)
        (`overwrite_logits`: see vocab_parallel_cross_entropy); in training
        with a z-loss, carrying its gradient (OutputZLoss.added_to). Under
        context parallelism, this rank's share of the whole sequences' mean
        (CPGroup.token_share): the cp ranks' losses sum to it."""
        share = self.cp.token_share(targets)
        if not self.output_z_loss.applies():
            loss = vocab_parallel_cross_entropy(local_logits, targets,
                                                real_vocab=self.cfg.vocab_size, tp=self.tp,
                                                overwrite_logits=overwrite_logits)
            return loss if share is None else loss * share
        loss, logsumexp = cross_entropy_and_logsumexp(local_logits, targets,
                                                      real_vocab=self.cfg.vocab_size, tp=self.tp,
                                                      overwrite_logits=overwrite_logits)
        return self.output_z_loss.added_to(loss, logsumexp, share)

    def logits(self, tokens: torch.Tensor, documents: Optional[Documents] = None,
               cache: Optional[KVCache] = None) -> torch.Tensor:
        """Full-vocabulary logits (B, T, V), padding cut (for inference and
        tests); with a `cache`, the last position's alone (B, 1, V)."""
        local = self.stage_forward(tokens, None, documents, cache)
        return gather_vocab(local, self.tp)[..., : self.cfg.vocab_size]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                samples: Optional[torch.Tensor] = None,
                documents: Optional[Documents] = None) -> torch.Tensor:
        """Loss of the whole (unpipelined) model. `samples` are the global sample
        indices of the batch (they seed dropout)."""
        # The logits are this call's own temporary: the loss may overwrite them.
        return self.loss(self.stage_forward(tokens, samples, documents), targets,
                         overwrite_logits=True)
