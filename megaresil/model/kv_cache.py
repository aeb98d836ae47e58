"""The keys and values a batch of sequences has seen, layer by layer, so
generation feeds each new token alone instead of rerunning the window.

Rows are left-padded to one length: slot s of row b holds its token
s - pads[b] (slots before pads[b] are padding, which no real token sees).
Every layer's keys and values sit in buffers of `capacity` slots, allocated
on first use and written in place; a forward over T new tokens writes slots
length..length+T-1, and the model `advance`s the cache after its last layer.
What a step reads per token (positions, which slots are real) is computed
once for every slot, so a one-token step slices views instead of building
tensors."""
from __future__ import annotations

from typing import Optional

import torch

from megaresil.model.masks import visible


class KVCache:
    """`pads` (B,): each row's left padding; `capacity`: slots per row;
    `max_position`: the last position the model embeds (a row past it reads
    that one: its tokens are no longer used, see generation.continue_batch)."""

    def __init__(self, pads: torch.Tensor, capacity: int, max_position: int):
        self.pads, self.capacity, self.max_position = pads, capacity, max_position
        self.length = 0  # slots written, the same in every row
        self.layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # The mask of the forward in progress, the same in every layer: (length, T, window, mask).
        self.step_mask: Optional[tuple[int, int, Optional[int], Optional[torch.Tensor]]] = None
        every_slot = torch.arange(capacity, device=pads.device)
        self.places = (every_slot[None, :] - pads[:, None]).clamp(0, max_position)  # (B, slots)
        self.real = every_slot[None, :] >= pads[:, None]  # (B, slots)
        self.padded = bool(pads.any())

    def slots(self, T: int) -> torch.Tensor:
        """(T,) the slots of the next T tokens."""
        return torch.arange(self.length, self.length + T, device=self.pads.device)

    def positions(self, T: int) -> torch.Tensor:
        """(B, T) each new token's place in its own sequence."""
        return self.places[:, self.length:self.length + T]

    def mask(self, T: int, window: Optional[int]) -> Optional[torch.Tensor]:
        """(B, 1, T, length + T), True where a new token sees a key: its
        row's real tokens at or before it (in the window); None where each
        sees every key. A padding slot sees itself alone, so its (unused) row
        of attention has a key to weigh."""
        if self.step_mask is not None and self.step_mask[:3] == (self.length, T, window):
            return self.step_mask[3]
        end = self.length + T
        if T == 1 and (window is None or end <= window):  # one token: every real key is before it
            mask = self.real[:, None, None, :end] if self.padded else None
        else:
            queries, keys = self.slots(T), torch.arange(end, device=self.pads.device)
            seen = visible(queries, keys, window)[None] & self.real[:, None, :end]
            mask = (seen | (queries[:, None] == keys[None, :])[None]).unsqueeze(1)
        self.step_mask = (self.length, T, window, mask)
        return mask

    def extend(self, layer: str, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' k and v (B, kv heads, T, D) of `layer`;
        every key and value the layer's tokens so far see, (B, kv heads, length + T, D)."""
        if layer not in self.layers:
            B, G, _, D = k.shape
            self.layers[layer] = (k.new_empty(B, G, self.capacity, D),
                                  v.new_empty(B, G, self.capacity, D))
        keys, values = self.layers[layer]
        end = self.length + k.shape[2]
        keys[:, :, self.length:end], values[:, :, self.length:end] = k, v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, T: int) -> None:
        self.length += T
