"""Document masking (model/masks.py): the documents, positions and ignored
targets are Megatron-LM's; a window of packed documents gives, document by
document, the logits and loss of running each document alone (fp32), with
learned positions and RoPE, grouped-query attention and a sliding window;
and the dense mask of the dropout path sees what the block-diagonal path sees."""
from __future__ import annotations

import pytest
import torch

from megaresil.config import Flavour, ModelConfig
from megaresil.model.gpt import GPT
from megaresil.model.init import materialize
from megaresil.model.masks import GROUP_TOKENS, DocumentMasking, document_layout
from megaresil.parallel.tensor_parallel import IGNORE_TARGET

EOD = 0
VOCAB = 64


def megatron_masks(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron-LM's _get_ltor_masks_and_position_ids for one row, all three
    switches on, in its own loop form: (attention mask True where masked,
    loss mask, position ids)."""
    T = tokens.numel()
    attention = torch.tril(torch.ones(T, T))
    loss_mask = torch.ones(T)
    loss_mask[tokens == EOD] = 0.0
    positions = torch.arange(T)
    previous = 0
    for i in positions[tokens == EOD].clone().tolist():
        attention[i + 1:, :i + 1] = 0
        positions[i + 1:] -= i + 1 - previous
        previous = i + 1
    return attention < 0.5, loss_mask, positions


def packed(lengths: list[list[int]], seed: int = 0) -> torch.Tensor:
    """(rows, T) tokens: each row its documents end to end, each closed by
    EOD; the first of a row as if begun in an earlier window (no EOD before it)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in lengths:
        docs = [torch.randint(1, VOCAB, (n,), generator=generator) for n in row]
        for doc in docs:
            doc[-1] = EOD
        rows.append(torch.cat(docs))
    rows[-1][-1] = 5  # a row may end inside a document
    return torch.stack(rows)


def test_documents_positions_and_ignored_targets_are_megatrons():
    tokens = packed([[3, 1, 7, 5], [16]])
    targets = torch.roll(tokens, -1, dims=1)
    masking = DocumentMasking(EOD, reset_position_ids=True, reset_attention_mask=True,
                              eod_mask_loss=True)
    masked_targets, documents = masking.apply(tokens, targets)
    assert documents is not None and documents.positions is not None
    for row in range(tokens.shape[0]):
        attention, loss_mask, positions = megatron_masks(tokens[row])
        assert torch.equal(documents.positions[row], positions)
        assert torch.equal(~documents.dense_mask(None)[row, 0], attention)
        assert torch.equal(masked_targets[row] != IGNORE_TARGET, loss_mask.bool())


def test_short_documents_share_an_attention_call_and_long_ones_have_their_own():
    short, long = GROUP_TOKENS // 4, GROUP_TOKENS + 3
    lengths = [3, short, short, short, short, long, 2, 5]
    documents = document_layout(packed([lengths]), EOD, reset_position_ids=False,
                                reset_attention_mask=True)
    assert documents.blocks is not None and documents.positions is None
    spans = [(b.start, b.length, b.one_document) for b in documents.blocks]
    run = 3 + 4 * short  # past GROUP_TOKENS with its fifth document
    assert spans == [(0, run, False), (run, long, True), (run + long, 7, False)]
    one = document_layout(packed([[long]]), EOD, reset_position_ids=False,
                          reset_attention_mask=True)
    assert one.blocks is None  # no boundary in the window: one causal call


def model(flavour: Flavour, **extra) -> GPT:
    kv = {"num_kv_heads": 2} if flavour != Flavour.gpt2 else {}
    cfg = ModelConfig(flavour=flavour, num_layers=2, hidden_size=32, num_heads=4,
                      vocab_size=VOCAB, max_seq_len=2 * GROUP_TOKENS, **kv, **extra)
    with torch.device("meta"):
        built = GPT(cfg)
    return materialize(built, cfg, 0, torch.device("cpu")).eval()


# Both rows 2 * GROUP_TOKENS long: runs of short documents, long ones alone.
LENGTHS = [[40, 9, 50, GROUP_TOKENS + 10, 12, 1, 6],
           [GROUP_TOKENS + 60, 2, 3, 1, 50, 12]]
CASES = {"learned positions": (Flavour.gpt2, {}),
         "rope, grouped-query": (Flavour.llama, {}),
         "rope, sliding window": (Flavour.qwen2, {"sliding_window": 20})}


@pytest.mark.parametrize("case", CASES)
def test_a_packed_window_is_each_document_alone(case):
    flavour, extra = CASES[case]
    gpt = model(flavour, **extra)
    tokens = packed(LENGTHS, seed=1)
    targets = torch.roll(tokens, -1, dims=1)
    masking = DocumentMasking(EOD, reset_position_ids=True, reset_attention_mask=True,
                              eod_mask_loss=True)
    masked_targets, documents = masking.apply(tokens, targets)
    with torch.no_grad():
        logits = gpt.logits(tokens, documents)
        loss = gpt(tokens, masked_targets, None, documents)
        token_losses = []
        for row, lengths in enumerate(LENGTHS):
            start = 0
            for n in lengths:
                alone = gpt.logits(tokens[row:row + 1, start:start + n])[0]
                torch.testing.assert_close(logits[row, start:start + n], alone,
                                           rtol=1e-5, atol=1e-5)
                kept = masked_targets[row, start:start + n] != IGNORE_TARGET
                token_losses.append(torch.nn.functional.cross_entropy(
                    alone[kept], targets[row, start:start + n][kept], reduction="none"))
                start += n
    torch.testing.assert_close(loss, torch.cat(token_losses).mean(), rtol=1e-6, atol=0)


def test_the_dropout_paths_dense_mask_sees_what_the_blocks_see():
    gpt = model(Flavour.qwen2, sliding_window=20)
    attention = gpt.layers["0"].attn
    documents = document_layout(packed(LENGTHS, seed=2), EOD, reset_position_ids=True,
                                reset_attention_mask=True)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 2 * GROUP_TOKENS, 8, generator=generator)
    k, v = (torch.randn(2, 2, 2 * GROUP_TOKENS, 8, generator=generator) for _ in range(2))
    attention.prob_dropout.p = 0.0  # the dense path without dropping: the mask alone
    torch.testing.assert_close(attention.core_with_dropout(q, k, v, None, documents),
                               attention.core(q, k, v, None, documents), rtol=1e-5, atol=1e-6)
