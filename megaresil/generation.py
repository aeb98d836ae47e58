"""Continuing a batch of prompts with a model, one forward per new token:
the prompts run once (the prefill), then each step feeds the tokens just
drawn alone, reading every earlier key and value from a KVCache.

Prompts of different lengths are left-padded to the longest, under a mask
that keeps the padding unseen, and each row draws from its own generator
seeded alike: a prompt's continuation is the one it gets alone. Generation
stops at the model's context: a prompt of P tokens gets at most
max_seq_len - P + 1 new ones (the last is never fed back), and one longer
than the context is refused before the model loads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megaresil.config import ConfigError
from megaresil.model.kv_cache import KVCache


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: Optional[int] = None  # sample among the k likeliest tokens only
    seed: int = 0  # every row's generator's


def check_prompts(prompts: list[list[int]], context: int) -> None:
    """Refuse a prompt the model cannot continue, naming it (1-based)."""
    for number, ids in enumerate(prompts, 1):
        if not ids:
            raise ConfigError("--prompt", f"prompt {number} is empty (no token to continue).",
                              "give it some text.")
        if len(ids) > context:
            raise ConfigError("--prompt", f"prompt {number} has {len(ids)} tokens, more than the "
                              f"model's context of {context} (model.max_seq_len).",
                              f"shorten it to at most {context} tokens (e.g. keep its end).")


def new_token_budget(prompt_tokens: int, context: int, max_new_tokens: int) -> int:
    """New tokens a prompt gets: each but the last is fed back at the next position."""
    return min(max_new_tokens, context - prompt_tokens + 1)


@torch.inference_mode()
def continue_batch(model, prompts: list[list[int]], context: int, max_new_tokens: int,
                   sampling: Sampling) -> list[list[int]]:
    """Each prompt's new token ids (`model`: a whole GPT, in eval mode)."""
    device = next(model.parameters()).device
    longest = max(len(ids) for ids in prompts)
    budgets = [new_token_budget(len(ids), context, max_new_tokens) for ids in prompts]
    steps = max(budgets)
    pads = torch.tensor([longest - len(ids) for ids in prompts], device=device)
    # A row past its budget goes on being fed (its tokens unused) at its
    # last position, so the batch keeps one shape.
    cache = KVCache(pads, capacity=longest + max(steps - 1, 0), max_position=context - 1)
    generators = [torch.Generator().manual_seed(sampling.seed) for _ in prompts]
    tokens = torch.tensor([[0] * (longest - len(ids)) + ids for ids in prompts], device=device)
    drawn: list[torch.Tensor] = []  # each step's (B, 1), read back once at the end
    for _ in range(steps):
        logits = model.logits(tokens, cache=cache)[:, -1]  # (B, V)
        if sampling.temperature == 0:  # greedy: no copy, no sync with the device
            tokens = logits.argmax(dim=-1, keepdim=True)
        else:
            rows = logits.float().cpu()
            tokens = torch.tensor([[next_token(row, sampling, g)] for row, g in
                                   zip(rows, generators)], device=device)
        drawn.append(tokens)
    columns = torch.cat(drawn, dim=1).tolist()  # (B, steps)
    return [row[:budget] for row, budget in zip(columns, budgets)]


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """A token drawn from one row's logits (V,) at `sampling`'s temperature (> 0)."""
    if sampling.top_k:
        cutoff = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
