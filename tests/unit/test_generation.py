"""Generation with a key/value cache (megaresil/generation.py): greedy tokens
equal to rerunning the whole window for each (the model's own logits), for
every way a flavour places tokens (learned positions, RoPE with grouped
queries, qk-norm and experts, a sliding window); a batch of prompts of
different lengths equal to each alone; the context's limits."""
from __future__ import annotations

import pytest
import torch

from megaresil.config import ConfigError, Flavour, ModelConfig, MoEConfig
from megaresil.generation import Sampling, check_prompts, continue_batch
from megaresil.model.gpt import GPT
from megaresil.model.init import materialize

CONTEXT = 24
FLAVOURS = {
    "gpt2": {},
    "llama": {"num_kv_heads": 2},
    "qwen3_moe": {"num_kv_heads": 2, "moe": MoEConfig(num_experts=4, top_k=2)},
    "mistral": {"num_kv_heads": 2, "sliding_window": 5},
}
PROMPTS = [[5, 17, 3, 99, 42, 7, 250], [8], [60, 61, 62, 63]]


def tiny(flavour: str) -> GPT:
    cfg = ModelConfig(flavour=Flavour(flavour), num_layers=2, hidden_size=32, num_heads=4,
                      vocab_size=300, max_seq_len=CONTEXT, **FLAVOURS[flavour])
    with torch.device("meta"):
        model = GPT(cfg)
    return materialize(model, cfg, 0, torch.device("cpu")).eval()


@torch.no_grad()
def full_window_greedy(model: GPT, prompt: list[int], new: int) -> list[int]:
    """The reference: the whole sequence through the model for every token."""
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(int(model.logits(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_cached_greedy_tokens_equal_the_full_window_ones(flavour):
    model = tiny(flavour)
    for prompt in PROMPTS[:2]:
        cached = continue_batch(model, [prompt], CONTEXT, 10, Sampling())[0]
        assert cached == full_window_greedy(model, prompt, 10)


@pytest.mark.parametrize("flavour", ["gpt2", "llama", "mistral"])
def test_a_batch_continues_each_prompt_as_it_would_alone(flavour):
    model = tiny(flavour)
    alone = [continue_batch(model, [p], CONTEXT, 8, Sampling())[0] for p in PROMPTS]
    assert continue_batch(model, PROMPTS, CONTEXT, 8, Sampling()) == alone
    sampled = Sampling(temperature=1.0, top_k=20, seed=3)
    alone = [continue_batch(model, [p], CONTEXT, 8, sampled)[0] for p in PROMPTS]
    assert continue_batch(model, PROMPTS, CONTEXT, 8, sampled) == alone


def test_generation_stops_at_the_context_each_prompt_at_its_own():
    model = tiny("gpt2")  # learned positions: none past the context exists
    long, short = list(range(1, CONTEXT - 2)), [9, 8]
    new = continue_batch(model, [long, short], CONTEXT, 30, Sampling())
    # A prompt of P tokens: CONTEXT - P + 1 new ones, the last never fed back.
    assert [len(n) for n in new] == [4, CONTEXT - 1]
    assert new[0] == full_window_greedy(model, long, 4)
    assert new[1] == continue_batch(model, [short], CONTEXT, 30, Sampling())[0]


def test_a_prompt_past_the_context_or_empty_is_refused_in_one_line():
    check_prompts([[1] * CONTEXT], CONTEXT)
    with pytest.raises(ConfigError, match=f"prompt 2 has {CONTEXT + 1} tokens, more than the "
                       f"model's context of {CONTEXT}.*shorten it"):
        check_prompts([[1], [1] * (CONTEXT + 1)], CONTEXT)
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        check_prompts([[]], CONTEXT)


def test_a_model_trains_after_generating():
    """Generation runs under inference mode: RoPE's tables it builds must
    not be kept for a backward (inference tensors cannot be saved for one)."""
    model = tiny("llama")
    continue_batch(model, [PROMPTS[0]], CONTEXT, 4, Sampling())
    model.train()
    tokens = torch.tensor([PROMPTS[0]])
    model(tokens, tokens).backward()
    assert model.layers["0"].attn.qkv.weight.grad is not None
