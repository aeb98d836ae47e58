"""`megaresil eval` and `megaresil generate`: a checkpoint's model in one
process, whatever layout saved it. Its global tensors are read whole by the
reader the offline converter and the Hugging Face export use; the model and
the held-out batches are the trainer's own, at tp = pp = dp = 1, so a loss
here is the number the run's eval wrote.

One process must hold the whole model: before anything is allocated, the
bytes it needs are estimated from the manifest and compared with the memory
free on the device, and a model that does not fit is refused in one line
(naming both figures) instead of dying of an out-of-memory kill halfway
through the load."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import psutil
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.convert import open_source
from megaresil.checkpoint.sources import full_tensors
from megaresil.config import ParallelConfig, Precision, RecipeConfig, from_dict
from megaresil.data.build import build_test_dataset, recipe_tokenizer
from megaresil.parallel.layout import ParallelLayout, pick_device
from megaresil.train.loop import Trainer
from megaresil.train.precision import resolve

# Tests set it to pretend a small machine (bytes free on the device); unset
# on a user's machine, where the device's own figure counts.
AVAILABLE_MEMORY_ENV = "MEGARESIL_AVAILABLE_MEMORY_BYTES"
SPLITS = ("valid", "test")


def one_process_bytes(manifest: dict, precision: Precision) -> int:
    """What one process holding the model for eval or generation allocates,
    about: per parameter the Trainer's (it is the model's one home) weight,
    fp32 gradient buffer and, under bf16, fp32 main copy; the optimizer's
    moments are not allocated before a step."""
    parameters = sum(math.prod(entry["global_shape"]) for key, entry in
                     manifest["tensors"].items() if key.startswith("model/"))
    per_parameter = 2 + 4 + 4 if precision == Precision.bf16 else 4 + 4
    return parameters * per_parameter


def available_bytes(device: torch.device) -> int:
    if os.environ.get(AVAILABLE_MEMORY_ENV):
        return int(os.environ[AVAILABLE_MEMORY_ENV])
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def check_fits(checkpoint: Path, needed: int, available: int, device: torch.device) -> None:
    if needed > available:
        raise fmt.CheckpointError(
            f"{checkpoint} needs about {needed / 1e9:.2f} GB in one process (its weights, "
            "their gradient buffers and any fp32 main copy), but "
            f"{device.type} has {available / 1e9:.2f} GB free. "
            "Fix: run it on a machine with that much free memory (eval and generate gather "
            "the whole model into one process; the run's own eval at its training layout is "
            "the eval_loss in its metrics.jsonl)")


@contextlib.contextmanager
def one_process_trainer(checkpoint: Path,
                        eval_batches: int | None = None) -> Iterator[tuple[Trainer, int]]:
    """(a one-process trainer holding the checkpoint's weights, its step)."""
    source = open_source(checkpoint)
    device = pick_device()
    recipe = from_dict(source.manifest["recipe"])
    check_fits(checkpoint, one_process_bytes(source.manifest,
                                             resolve(recipe.train.precision, device)),
               available_bytes(device), device)
    source.verify()
    with tempfile.TemporaryDirectory(prefix="megaresil-inference-") as scratch:
        cfg = one_process_recipe(recipe, eval_batches, Path(scratch))
        trainer = Trainer(cfg, ParallelLayout.from_config(cfg.parallel, device))
        try:
            params = dict(trainer.named_parameters())
            with torch.no_grad():
                for key, tensor in full_tensors(source, [f"model/{k}" for k in params]):
                    params[key.removeprefix("model/")].copy_(tensor)
            yield trainer, source.manifest["step"]
        finally:
            trainer.close()


def one_process_recipe(cfg: RecipeConfig, eval_batches: int | None,
                       scratch: Path) -> RecipeConfig:
    """The run's recipe at one process, without its drills' faults, and kept
    out of the run's own directory: the trainer resumes nothing, writes no
    event there and never cleans up the partial save of a run still going."""
    train = cfg.train if eval_batches is None else dataclasses.replace(
        cfg.train, eval_batches=eval_batches)
    checkpoint = dataclasses.replace(
        cfg.checkpoint, dir=None, load="none", init_from=None,
        local=dataclasses.replace(cfg.checkpoint.local, enabled=False))
    return dataclasses.replace(cfg, parallel=ParallelConfig(), train=train, faults=[],
                               run=dataclasses.replace(cfg.run, dir=str(scratch)),
                               checkpoint=checkpoint)


def evaluate(checkpoint: Path, batches: int | None = None, split: str = "valid") -> dict:
    """Loss and perplexity on a held-out split: on valid, the run's own eval
    batches; on test, as many batches of the test split (data/build.py)."""
    with one_process_trainer(checkpoint, batches) as (trainer, step):
        cfg = trainer.cfg
        if cfg.train.eval_batches == 0:
            raise fmt.CheckpointError("the run evaluated on no batches (train.eval_batches=0). "
                                      "Fix: pass --batches N.")
        dataset = (build_test_dataset(cfg.data, cfg.model.vocab_size, cfg.train.seed)
                   if split == "test" else None)
        loss = float(trainer.evaluate(dataset))
    return {"checkpoint": str(checkpoint), "step": step, "split": split,
            "batches": cfg.train.eval_batches, "loss": loss, "perplexity": math.exp(loss)}


def generate(checkpoint: Path, prompt: str, *, max_new_tokens: int = 50, temperature: float = 0.0,
             top_k: Optional[int] = None, seed: int = 0) -> dict:
    """The prompt continued by the checkpoint's model (temperature 0: greedy)."""
    with one_process_trainer(checkpoint, eval_batches=0) as (trainer, step):
        cfg = trainer.cfg
        try:
            tokenizer = recipe_tokenizer(cfg.data, cfg.model.vocab_size)
        except ValueError as err:
            raise fmt.CheckpointError(f"{err} (generation needs text in and out)") from None
        prompt_ids = tokenizer.encode(prompt)
        trainer.model.eval()
        ids = continue_tokens(trainer.chunks[0], prompt_ids, cfg.model.max_seq_len,
                              max_new_tokens, temperature, top_k,
                              torch.Generator().manual_seed(seed))
    return {"checkpoint": str(checkpoint), "step": step, "prompt": prompt,
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
