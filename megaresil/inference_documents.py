"""`megaresil eval CKPT --data PREFIX_OR_JSONL`: a checkpoint's loss on any
data, document by document (data/documents.py reads them).

Each document is scored alone, from its first token: it is cut into
non-overlapping windows of data.seq_len predictions (window k reads tokens
k*L .. k*L+L-1 and predicts k*L+1 .. k*L+L), so every token but the first is
predicted exactly once, and a window's context starts at the window. The
run's document masking applies to each window as training applies it
(data.eod_mask_loss drops the prediction after an eod; positions and
attention reset at one); one document alone in a window reads as it would
under reset_position_ids and reset_attention_mask, where training's own
document boundaries fall. A document's loss is the mean over its predicted
tokens; the overall loss the token-weighted mean of those."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megaresil.checkpoint.validation import read_manifest
from megaresil.config import from_dict
from megaresil.data.documents import load_documents
from megaresil.inference import Use, run_on_model
from megaresil.inference_model import LoadedModel
from megaresil.parallel.tensor_parallel import IGNORE_TARGET


def evaluate_documents(checkpoint: Path, data: str, tp: int = 1) -> dict:
    """Overall loss on `data` and each document's (index, scored tokens,
    loss and perplexity; null for a document with nothing to predict)."""
    recipe = from_dict(read_manifest(checkpoint)["recipe"])
    # Read (and refused) before the model loads or any rank starts.
    documents = load_documents(data, recipe.data, recipe.model.vocab_size)
    return run_on_model(checkpoint, tp, Use(eval_batches=0), documents_job,
                        data=data, documents=documents)


def documents_job(loaded: LoadedModel, checkpoint: Path, step: int, *, data: str,
                  documents: list[np.ndarray]) -> dict:
    scored = [score_document(loaded, tokens) for tokens in documents]
    tokens = sum(count for _, count in scored)
    loss = sum(total for total, _ in scored) / tokens if tokens else None
    return {"checkpoint": str(checkpoint), "step": step, "data": data,
            "window": loaded.cfg.data.seq_len, "documents": len(documents),
            "tokens": tokens, **loss_and_perplexity(loss),
            "per_document": [{"index": i, "tokens": count,
                              **loss_and_perplexity(total / count if count else None)}
                             for i, (total, count) in enumerate(scored)]}


def loss_and_perplexity(loss: Optional[float]) -> dict:
    return {"loss": loss, "perplexity": None if loss is None else math.exp(loss)}


@torch.no_grad()
def score_document(loaded: LoadedModel, tokens: np.ndarray) -> tuple[float, int]:
    """(summed loss, predicted tokens) of one document over its windows."""
    window = loaded.cfg.data.seq_len
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        piece = torch.from_numpy(tokens[start:start + window + 1]).unsqueeze(0)  # (1, <= L+1)
        window_total, window_count = score_window(loaded, piece[:, :-1], piece[:, 1:])
        total, count = total + window_total, count + window_count
    return total, count


def score_window(loaded: LoadedModel, inputs: torch.Tensor,
                 targets: torch.Tensor) -> tuple[float, int]:
    """One window's summed loss and predicted tokens, masked as the trainer
    masks its batches (Trainer.batches)."""
    documents = None
    if loaded.masking is not None:
        targets, documents = loaded.masking.apply(inputs, targets)
    device = loaded.layout.device
    with loaded.autocast:
        logits = loaded.model.logits(inputs.to(device),
                                          None if documents is None else documents.to(device))
    losses = torch.nn.functional.cross_entropy(logits[0].float(), targets[0].to(device),
                                               ignore_index=IGNORE_TARGET, reduction="sum")
    return float(losses), int((targets != IGNORE_TARGET).sum())
