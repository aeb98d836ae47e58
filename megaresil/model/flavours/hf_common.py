"""The pieces every flavour's Hugging Face mapping is made of: a mapped
tensor, the fused-QKV layout both ways, a layer's experts both ways, and the
config.json checks that refuse a variant megaresil's model cannot represent.

Pure torch and dicts; `checkpoint/hf/mapping.py` drives them (model does not
import checkpoint, so a refusal is an `UnsupportedVariant` that the mapping
turns into its `UnsupportedModel`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megaresil.config import ModelConfig


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
             num_kv_heads: int) -> torch.Tensor:
    """Stack separate q/k/v rows into megaresil's kv-group-major fused layout."""
    groups = num_kv_heads
    q = q.reshape(groups, num_heads // groups, -1, *q.shape[1:])  # (G, H/G, D, ...)
    k = k.reshape(groups, 1, -1, *k.shape[1:])
    v = v.reshape(groups, 1, -1, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[3:])


def split_qkv(qkv: torch.Tensor, num_heads: int,
              num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group = num_kv_heads, num_heads // num_kv_heads
    grouped = qkv.reshape(groups, per_group + 2, -1, *qkv.shape[1:])  # (G, H/G+2, D, ...)
    q = grouped[:, :per_group].reshape(-1, *qkv.shape[1:])
    k = grouped[:, per_group].reshape(-1, *qkv.shape[1:])
    v = grouped[:, per_group + 1].reshape(-1, *qkv.shape[1:])
    return q, k, v


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Mapped:
    """One megaresil tensor, made from Hugging Face tensors `sources` by
    `combine` (which also works on meta tensors, giving shapes unread)."""
    sources: tuple[str, ...]
    combine: Callable[..., torch.Tensor] = _identity


def transposed(source: str) -> Mapped:
    """A Conv1D weight (GPT-2 stores (in, out)) as nn.Linear's (out, in)."""
    return Mapped((source,), lambda t: t.t())


@dataclass(frozen=True)
class HubExperts:
    """A family's names for a layer's experts. Hub files (and transformers'
    save_pretrained, which writes them) hold one matrix per expert,
    `{block}experts.{j}.{gate|up|down}.weight`; transformers holds them
    stacked in memory, `mlp.experts.gate_up_proj` (E, 2F, C: gate rows
    first) and `mlp.experts.down_proj` (E, C, F), as a file may too. Ours
    are stacked per projection, `mlp.experts.{gate,up,down}`; the router is
    `{block}gate.weight` on the Hub, `mlp.gate.weight` in memory."""
    block: str  # the experts' module in Hub names, e.g. "block_sparse_moe."
    gate: str  # an expert's projection names in Hub names, e.g. "w1"
    up: str
    down: str

    def from_hf(self, h: str, o: str, cfg: ModelConfig) -> dict[str, Mapped]:
        """Layer prefix `h`'s experts (Hub names) as ours at prefix `o`."""
        experts = range(cfg.moe.num_experts)
        out = {o + "mlp.router.weight": Mapped((f"{h}{self.block}gate.weight",))}
        for ours, theirs in (("gate", self.gate), ("up", self.up), ("down", self.down)):
            names = tuple(f"{h}{self.block}experts.{j}.{theirs}.weight" for j in experts)
            out[o + f"mlp.experts.{ours}"] = Mapped(names, _stacked)
        return out

    def stacked_from_hf(self, h: str, o: str) -> dict[str, Mapped]:
        """The same, from transformers' in-memory names."""
        stack = h + "mlp.experts."
        return {o + "mlp.router.weight": Mapped((h + "mlp.gate.weight",)),
                o + "mlp.experts.gate": Mapped((stack + "gate_up_proj",), _first_half),
                o + "mlp.experts.up": Mapped((stack + "gate_up_proj",), _second_half),
                o + "mlp.experts.down": Mapped((stack + "down_proj",))}

    def to_hf(self, ours: dict, h: str, o: str) -> dict:
        """Our experts at prefix `o` in Hub names at `h` (what save_pretrained writes)."""
        out = {f"{h}{self.block}gate.weight": ours[o + "mlp.router.weight"]}
        for name, theirs in (("gate", self.gate), ("up", self.up), ("down", self.down)):
            for j, matrix in enumerate(ours[o + f"mlp.experts.{name}"].unbind(0)):
                # A copy: safetensors refuses tensors that share storage.
                out[f"{h}{self.block}experts.{j}.{theirs}.weight"] = matrix.clone()
        return out


def _stacked(*matrices: torch.Tensor) -> torch.Tensor:
    return torch.stack(matrices)


def _first_half(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up[:, :gate_up.shape[1] // 2]


def _second_half(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up[:, gate_up.shape[1] // 2:]


class UnsupportedVariant(ValueError):
    """A config.json setting megaresil's model has no variant for (the
    message is the one the user reads)."""


def require_hf(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise UnsupportedVariant(f"config.json {key}: {problem}; megaresil's model has no such "
                                 "variant. Fix: convert a model without it.")


def token_id(hf: dict, key: str, notes: list[str]) -> Optional[int]:
    """config.json's `key` token id as megaresil keeps it (one id, inside the
    vocabulary), with a note in `notes` where it could not be kept as is."""
    token = hf.get(key)
    if isinstance(token, list):  # instruction-tuned Llamas list several ends
        notes.append(f"config.json {key}={token}: megaresil keeps one id, {token[0]}")
        token = token[0] if token else None
    if token is not None and token >= hf["vocab_size"]:  # GPT2Config's 50256 in a small vocabulary
        notes.append(f"config.json {key}={token} is outside its vocabulary "
                     f"({hf['vocab_size']}); not carried over")
        token = None
    return token
