"""`megaresil eval` and `megaresil generate`: a checkpoint's model in one
process, whatever layout saved it. Its global tensors are read whole by the
reader the offline converter and the Hugging Face export use; the model and
the held-out batches are the trainer's own, at tp = pp = dp = 1, so a loss
here is the number the run's eval wrote."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional

import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.convert import open_source
from megaresil.checkpoint.sources import full_tensors
from megaresil.config import ParallelConfig, RecipeConfig, from_dict
from megaresil.data.build import recipe_tokenizer
from megaresil.parallel.layout import ParallelLayout, pick_device
from megaresil.train.loop import Trainer


def checkpoint_of(path: Path) -> Path:
    """A checkpoint directory as given, else the newest under a run directory
    or a checkpoints directory."""
    if (path / "metadata.json").exists():
        return path
    for root in (path / "checkpoints", path):
        found = fmt.committed_checkpoints(root)
        if found:
            return found[0]
    raise fmt.CheckpointError(f"{path}: no checkpoint here. Fix: give a checkpoint directory, "
                              "or a run directory that has saved one (checkpoint.interval).")


def one_process_trainer(path: Path, eval_batches: int | None = None) -> tuple[Trainer, int]:
    """(a one-process trainer holding the checkpoint's weights, its step)."""
    source = open_source(checkpoint_of(path))
    source.verify()
    cfg = one_process_recipe(from_dict(source.manifest["recipe"]), eval_batches)
    trainer = Trainer(cfg, ParallelLayout.from_config(cfg.parallel, pick_device()))
    params = dict(trainer.named_parameters())
    with torch.no_grad():
        for key, tensor in full_tensors(source, [f"model/{k}" for k in params]):
            params[key.removeprefix("model/")].copy_(tensor)
    return trainer, source.manifest["step"]


def one_process_recipe(cfg: RecipeConfig, eval_batches: int | None) -> RecipeConfig:
    """The run's recipe at one process, without its drills' faults."""
    train = cfg.train if eval_batches is None else dataclasses.replace(
        cfg.train, eval_batches=eval_batches)
    return dataclasses.replace(cfg, parallel=ParallelConfig(), train=train, faults=[])


def evaluate(path: Path, batches: int | None = None) -> dict:
    """Loss and perplexity on the held-out split: the run's own eval batches."""
    trainer, step = one_process_trainer(path, batches)
    if trainer.cfg.train.eval_batches == 0:
        raise fmt.CheckpointError("the run evaluated on no batches (train.eval_batches=0). "
                                  "Fix: pass --batches N.")
    loss = float(trainer.evaluate())
    return {"checkpoint": str(checkpoint_of(path)), "step": step, "split": "valid",
            "batches": trainer.cfg.train.eval_batches, "loss": loss,
            "perplexity": math.exp(loss)}


def generate(path: Path, prompt: str, *, max_new_tokens: int = 50, temperature: float = 0.0,
             top_k: Optional[int] = None, seed: int = 0) -> dict:
    """The prompt continued by the checkpoint's model (temperature 0: greedy)."""
    trainer, step = one_process_trainer(path, eval_batches=0)
    cfg = trainer.cfg
    try:
        tokenizer = recipe_tokenizer(cfg.data, cfg.model.vocab_size)
    except ValueError as err:
        raise fmt.CheckpointError(f"{err} (generation needs text in and out)") from None
    prompt_ids = tokenizer.encode(prompt)
    trainer.model.eval()
    ids = continue_tokens(trainer.chunks[0], prompt_ids, cfg.model.max_seq_len, max_new_tokens,
                          temperature, top_k, torch.Generator().manual_seed(seed))
    return {"checkpoint": str(checkpoint_of(path)), "step": step, "prompt": prompt,
            "completion": tokenizer.decode(ids), "token_ids": ids}


@torch.no_grad()
def continue_tokens(model, prompt_ids: list[int], context: int, max_new_tokens: int,
                    temperature: float, top_k: Optional[int],
                    generator: torch.Generator) -> list[int]:
    """New token ids, one forward pass over the last `context` tokens each
    (no KV cache: the models served here are the ones a checkpoint test holds)."""
    tokens, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = model.logits(torch.tensor([tokens[-context:]]))[0, -1].float()  # (V,)
        token = next_token(logits, temperature, top_k, generator)
        tokens.append(token)
        new.append(token)
    return new


def next_token(logits: torch.Tensor, temperature: float, top_k: Optional[int],
               generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    if top_k:
        cutoff = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
