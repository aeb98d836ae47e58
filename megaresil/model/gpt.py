"""The GPT decoder (GPT-2 and Llama flavours) and its layout-free parameter names.

Parameter keys use global layer numbers (`layers.17.attn.qkv.weight` wherever
layer 17 lives), so a checkpoint's keys do not depend on the parallel layout.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaresil.config import Flavour, ModelConfig
from megaresil.model.layers import Block, make_norm


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp, as
    Megatron pads it, so every TP rank holds an equal slice of the embedding."""
    multiple = cfg.make_vocab_size_divisible_by * tp
    return -(-cfg.vocab_size // multiple) * multiple


def ties_embeddings(cfg: ModelConfig) -> bool:
    if cfg.tie_embeddings is not None:
        return cfg.tie_embeddings
    return cfg.flavour == Flavour.gpt2


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, padded_vocab: int):
        super().__init__()
        self.tokens = nn.Embedding(padded_vocab, cfg.hidden_size)
        self.positions = (nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
                          if cfg.flavour == Flavour.gpt2 else None)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        x = self.tokens(tokens)
        if self.positions is not None:
            x = x + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        return self.dropout(x)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp: int = 1):
        super().__init__()
        self.cfg = cfg
        self.padded_vocab = padded_vocab_size(cfg, tp)
        self.embed = Embedding(cfg, self.padded_vocab)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm = make_norm(cfg)
        self.tied = ties_embeddings(cfg)
        self.head = None if self.tied else nn.Linear(cfg.hidden_size, self.padded_vocab, bias=False)

    def output_weight(self) -> torch.Tensor:
        return self.embed.tokens.weight if self.tied else self.head.weight

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.embed(tokens)
        for layer in self.layers.values():
            x = layer(x)
        x = self.norm(x)
        # Padding columns are cut before softmax so they never enter the loss.
        return F.linear(x, self.output_weight())[..., : self.cfg.vocab_size]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over all B*T positions."""
        logits = self.logits(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
