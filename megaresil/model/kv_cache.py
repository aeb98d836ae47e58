"""The keys and values a batch of sequences has seen, layer by layer, so
generation feeds each new token alone instead of rerunning the window.

Rows are left-padded to one length: slot s of row b holds its token
s - pads[b] (slots before pads[b] are padding, which no real token sees).
Every layer's keys and values sit in buffers of `capacity` slots, allocated
on first use; a forward over T new tokens writes slots length..length+T-1,
and the model `advance`s the cache after its last layer."""
from __future__ import annotations

from typing import Optional

import torch

from megaresil.model.masks import visible


class KVCache:
    """`pads` (B,): each row's left padding; `capacity`: slots per row;
    `max_position`: the last position the model embeds (a row past it reads
    that one: its tokens are no longer used, see inference.continue_batch)."""

    def __init__(self, pads: torch.Tensor, capacity: int, max_position: int):
        self.pads, self.capacity, self.max_position = pads, capacity, max_position
        self.length = 0  # slots written, the same in every row
        self.layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # The mask of the forward in progress, the same in every layer: (length, T, window, mask).
        self.step_mask: Optional[tuple[int, int, Optional[int], torch.Tensor]] = None

    def slots(self, T: int) -> torch.Tensor:
        """(T,) the slots of the next T tokens."""
        return torch.arange(self.length, self.length + T, device=self.pads.device)

    def positions(self, T: int) -> torch.Tensor:
        """(B, T) each new token's place in its own sequence."""
        places = self.slots(T)[None, :] - self.pads[:, None]
        return places.clamp(0, self.max_position)

    def mask(self, T: int, window: Optional[int]) -> torch.Tensor:
        """(B, 1, T, length + T), True where a new token sees a key: its
        row's real tokens at or before it (in the window). A padding slot sees
        itself alone, so its (unused) row of attention has a key to weigh."""
        if self.step_mask is not None and self.step_mask[:3] == (self.length, T, window):
            return self.step_mask[3]
        queries, keys = self.slots(T), torch.arange(self.length + T, device=self.pads.device)
        real = keys[None, None, :] >= self.pads[:, None, None]  # (B, 1, K)
        seen = visible(queries, keys, window)[None] & real
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
