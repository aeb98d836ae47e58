"""Which keys each query sees, and where each token stands: the causal mask,
the sliding window (model.sliding_window) and document masking
(data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss,
with Megatron-LM's meaning). `visible` is the one rule every attention mask
is drawn from.

A training window holds documents end to end, each closed by the
end-of-document token (eod), which belongs to the document it closes; the
window's first document may have begun in an earlier window and counts as
starting at the window's start. `DocumentMasking.apply` finds the documents
in a micro-batch's input tokens once, before the micro-batch reaches the
model, and every pipeline stage and tensor-parallel rank is handed the
result (`Documents`); a context-parallel rank keeps its chunks' positions
and the whole window's documents (`Documents.context_slice`;
docs/architecture.md, "Document masking").
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch

from megaresil.parallel.context_parallel import CPGroup
from megaresil.parallel.tensor_parallel import IGNORE_TARGET

# Consecutive documents shorter than this share one attention call, under a
# mask that keeps them apart; a longer document gets a call of its own. Below
# about this many tokens a call's fixed cost outweighs the cross-document
# work it skips (bench/README.md, "Document masking").
GROUP_TOKENS = 128


def visible(queries: torch.Tensor, keys: torch.Tensor, window: Optional[int], *,
            query_documents: Optional[torch.Tensor] = None,
            key_documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Whether each query sees each key, (..., Q, K), from their places in
    the window (`queries` (Q,), `keys` (K,)): a key at or before the query,
    within the last `window` positions (key > query - window, as
    transformers' Mistral masks), and, given each token's document
    ((..., Q) and (..., K)), in the query's document."""
    offset = queries[:, None] - keys[None, :]  # (Q, K)
    seen = offset >= 0
    if window is not None:
        seen = seen & (offset < window)
    if query_documents is None or key_documents is None:
        return seen
    return seen & (query_documents[..., :, None] == key_documents[..., None, :])


def causal_mask(T: int, window: Optional[int], device: torch.device) -> torch.Tensor:
    """Which keys each of T queries sees, (T, T), True where seen."""
    places = torch.arange(T, device=device)
    return visible(places, places, window)


def sliding_window_mask(T: int, window: Optional[int],
                        device: torch.device) -> Optional[torch.Tensor]:
    """`causal_mask`, or None where that is every earlier position (no
    window, or one of T or more), which SDPA's is_causal computes without a mask."""
    if window is None or window >= T:
        return None
    return causal_mask(T, window, device)


@dataclass(frozen=True)
class AttentionBlock:
    """One attention call of a document-masked micro-batch: whole documents,
    `length` tokens of row `row` from `start`."""
    row: int
    start: int
    length: int
    one_document: bool

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Documents:
    """Where the documents of one micro-batch (B, T) lie, as the model reads them."""
    ids: torch.Tensor  # (B, T) int64: each token's document, counted from 0 in its row
    # (B, T) each token's place in its document; None: 0..T-1 (reset_position_ids off)
    positions: Optional[torch.Tensor]
    # The attention calls, row by row, that keep documents apart; None: one
    # causal call over the window does (reset_attention_mask off, or no row
    # holds a document's start after its first token).
    blocks: Optional[tuple[AttentionBlock, ...]]

    def context_slice(self, cp: CPGroup) -> Documents:
        """What a context-parallel rank's model reads: its chunks'
        positions, and the whole window's documents (its queries' and
        every key's, wherever the key lives), one attention over them."""
        if not cp.active:
            return self
        positions = None if self.positions is None else cp.slice_sequence(self.positions)
        return replace(self, positions=positions)

    def to(self, device: torch.device) -> Documents:
        positions = None if self.positions is None else self.positions.to(device)
        return replace(self, ids=self.ids.to(device), positions=positions)

    def rows(self) -> Iterator[list[AttentionBlock]]:
        """The blocks of each row, rows in order."""
        assert self.blocks is not None  # only document-separated attention asks
        for _, blocks in itertools.groupby(self.blocks, key=lambda block: block.row):
            yield list(blocks)

    def block_mask(self, block: AttentionBlock, window: Optional[int]) -> Optional[torch.Tensor]:
        """(length, length), True where seen inside `block`; None: plain causal."""
        if block.one_document:
            return sliding_window_mask(block.length, window, self.ids.device)
        documents = self.ids[block.row, block.start:block.end]
        places = torch.arange(block.length, device=self.ids.device)
        return visible(places, places, window, query_documents=documents,
                       key_documents=documents)

    def dense_mask(self, window: Optional[int]) -> torch.Tensor:
        """(B, 1, T, T), True where seen: one mask per row, shared by the heads."""
        places = torch.arange(self.ids.shape[1], device=self.ids.device)
        return visible(places, places, window, query_documents=self.ids,
                       key_documents=self.ids).unsqueeze(1)


def document_layout(tokens: torch.Tensor, eod_id: int, *, reset_position_ids: bool,
                    reset_attention_mask: bool) -> Documents:
    """The documents of `tokens` (B, T), the window's input tokens, as
    Megatron-LM's _get_ltor_masks_and_position_ids finds them: a document
    starts after each eod. Runs on the host copy (the blocks are host values)."""
    eod = (tokens == eod_id).long()
    ids = eod.cumsum(dim=1) - eod  # the eod belongs to the document it closes
    places = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.cat([torch.ones_like(eod[:, :1]), eod[:, :-1]], dim=1).bool()
    first = torch.where(starts, places, torch.zeros_like(places)).cummax(dim=1).values
    separate = reset_attention_mask and bool(ids[:, -1].any())
    blocks = tuple(_blocks(ids)) if separate else None
    return Documents(ids, places - first if reset_position_ids else None, blocks)


def _blocks(ids: torch.Tensor) -> Iterator[AttentionBlock]:
    """Each row's documents as attention calls: a document of GROUP_TOKENS
    or more alone, runs of shorter ones together until they reach it."""
    for row, row_ids in enumerate(ids):
        start, tokens, documents = 0, 0, 0  # the pending run: its tokens and documents
        for length in torch.unique_consecutive(row_ids, return_counts=True)[1].tolist():
            if length >= GROUP_TOKENS and documents:
                yield AttentionBlock(row, start, tokens, documents == 1)
                start, tokens, documents = start + tokens, 0, 0
            tokens, documents = tokens + length, documents + 1
            if tokens >= GROUP_TOKENS:
                yield AttentionBlock(row, start, tokens, documents == 1)
                start, tokens, documents = start + tokens, 0, 0
        if documents:
            yield AttentionBlock(row, start, tokens, documents == 1)


@dataclass(frozen=True)
class DocumentMasking:
    """The recipe's document masking over data whose documents end with `eod_id`."""
    eod_id: int
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool

    def apply(self, inputs: torch.Tensor,
              targets: torch.Tensor) -> tuple[torch.Tensor, Optional[Documents]]:
        """A micro-batch's targets, IGNORE_TARGET where the input token is an
        eod (eod_mask_loss: the next document's first token, predicted
        across the boundary), and its documents (None when neither positions
        nor attention are reset)."""
        if self.eod_mask_loss:
            targets = targets.masked_fill(inputs == self.eod_id, IGNORE_TARGET)
        if not (self.reset_position_ids or self.reset_attention_mask):
            return targets, None
        return targets, document_layout(inputs, self.eod_id,
                                        reset_position_ids=self.reset_position_ids,
                                        reset_attention_mask=self.reset_attention_mask)
