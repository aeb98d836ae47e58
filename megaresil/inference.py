"""`megaresil eval` and `megaresil generate`: a checkpoint's model, whatever
layout saved it, in one process or spread over `--tp N` local
tensor-parallel processes (one per GPU). The weights are loaded as
`checkpoint.init_from` loads them (verified, resharded to this layout) into
the trainer's own model alone (inference_model.py: no Trainer is built),
and a split's held-out batches are read as the trainer reads them
(train/batches.py), so a loss here is the number the run's eval wrote.

Before any process starts, the bytes the model needs are estimated from the
manifest and compared with the memory free on the device, and a model that
does not fit is refused in one line (naming both figures and the fix: more
GPUs with --tp) instead of dying of an out-of-memory kill halfway through
the load."""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.offline.convert import open_source
from megaresil.checkpoint.validation import read_manifest
from megaresil.config import (
    FP8,
    Backend,
    ConfigError,
    ParallelConfig,
    RecipeConfig,
    from_dict,
    validate,
)
from megaresil.data.build import build_datasets, build_test_dataset, recipe_tokenizer
from megaresil.data.sampler import SampleDataset
from megaresil.generation import Sampling, check_prompts, continue_batch
from megaresil.inference_model import LoadedModel, load_model
from megaresil.parallel.layout import ParallelLayout, backend_for, pick_device, visible_gpus
from megaresil.ports import free_port
from megaresil.train.batches import held_out_loss, model_loss
from megaresil.train.compiling import compile_blocks

# Tests set it to pretend a small machine (bytes free on the device); unset
# on a user's machine, where the device's own figure counts.
AVAILABLE_MEMORY_ENV = "MEGARESIL_AVAILABLE_MEMORY_BYTES"


def model_bytes(manifest: dict) -> int:
    """What holding the whole model for eval or generation allocates, about
    (over all ranks): its weights alone (inference_model.py builds no gradient
    buffer, no main copy and no optimizer state), 4 bytes each under any
    precision: they are built and loaded in fp32, and cast to bf16 after."""
    parameters = sum(math.prod(entry["global_shape"]) for key, entry in
                     manifest["tensors"].items() if key.startswith("model/"))
    return parameters * 4


def available_bytes(device: torch.device) -> int:
    if os.environ.get(AVAILABLE_MEMORY_ENV):
        return int(os.environ[AVAILABLE_MEMORY_ENV])
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def check_fits(checkpoint: Path, needed: int, available: int, device: torch.device,
               tp: int) -> None:
    """`needed`: the whole model's bytes. Spread over tp GPUs each holds a
    tp-th of it; on the CPU the ranks share one memory, so tp does not help."""
    share = needed if device.type == "cpu" else needed // tp
    if share <= available:
        return
    where = ("of the cpu's memory" + (f" ({tp} processes share it)" if tp > 1 else "")
             if device.type == "cpu" else f"on each of {tp} GPUs" if tp > 1 else "on one GPU")
    fix = ("run it where that much memory is free" if device.type == "cpu" else
           f"spread it over more GPUs with --tp N (each GPU then needs about "
           f"{needed / 1e9:.2f} GB / N free)")
    raise fmt.CheckpointError(
        f"{checkpoint} needs about {share / 1e9:.2f} GB {where} (its weights, loaded in "
        f"fp32), but {device.type} has "
        f"{available / 1e9:.2f} GB free. Fix: {fix}; the run's own eval at its training layout "
        "is the eval_loss in its metrics.jsonl")


def check_layout(recipe: RecipeConfig, tp: int, device: torch.device) -> None:
    """Before any process starts: the model splits over tp ranks, and a GPU
    run has a GPU for each."""
    validate(dataclasses.replace(recipe, parallel=ParallelConfig(tp=tp), faults=[]))
    gpus = visible_gpus()
    if device.type == "cuda" and tp > gpus:
        raise ConfigError("--tp", f"{tp} ranks need {tp} GPUs; {gpus} are visible.",
                          f"pass --tp {gpus} or fewer (a divisor of the model's heads).")


@dataclass(frozen=True)
class Use:
    """What a command changes in the run's recipe, and so in the model it loads."""
    eval_batches: Optional[int] = None  # None: the run's train.eval_batches
    # Generation's KV cache lives in the local layers (model/kv_cache.py): the
    # same weights under the same checkpoint keys, without TE's kernels.
    local_layers: bool = False


def run_on_model(checkpoint: Path, tp: int, use: Use, job, **kwargs) -> dict:
    """`job(loaded, checkpoint, step, **kwargs)` on the checkpoint's model
    (an inference_model.LoadedModel), whatever layout saved it, held by tp
    tensor-parallel ranks (one process when tp is 1, else local processes
    over gloo or NCCL); rank 0's result.
    The weights are loaded as `checkpoint.init_from` loads them: verified,
    checked against the model, resharded to this layout."""
    source = open_source(checkpoint)
    recipe = from_dict(source.manifest["recipe"])
    device = pick_device()
    check_layout(recipe, tp, device)
    check_fits(checkpoint, model_bytes(source.manifest), available_bytes(device), device, tp)
    if tp == 1:
        return on_rank(checkpoint, recipe, tp, use, job, kwargs, device)
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(spawned_rank, args=(tp, free_port(), checkpoint, use, job,
                                           kwargs, results), nprocs=tp, start_method="spawn")
    outcome, value = results.get()
    if outcome == "error":
        raise fmt.CheckpointError(value)
    return value


def spawned_rank(rank: int, tp: int, port: int, checkpoint: Path, use: Use,
                 job, kwargs: dict, results) -> None:
    """One of run_on_model's ranks; rank 0 puts ("ok", result) or ("error", why)."""
    device = pick_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=tp)
    result: tuple[str, Any]  # ("ok", what the job returned) or ("error", why)
    try:
        recipe = from_dict(open_source(checkpoint).manifest["recipe"])
        result = ("ok", on_rank(checkpoint, recipe, tp, use, job, kwargs, device))
    except fmt.CheckpointError as err:
        result = ("error", str(err))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.put(result)


def on_rank(checkpoint: Path, recipe: RecipeConfig, tp: int, use: Use, job,
            kwargs: dict, device: torch.device) -> dict:
    with tempfile.TemporaryDirectory(prefix="megaresil-inference-") as scratch:
        cfg = inference_recipe(recipe, use, Path(scratch), checkpoint, tp)
        layout = ParallelLayout.from_config(cfg.parallel, device)
        return job(load_model(cfg, layout), checkpoint, step_of(checkpoint), **kwargs)


def step_of(checkpoint: Path) -> int:
    return read_manifest(checkpoint)["step"]


def inference_recipe(cfg: RecipeConfig, use: Use, scratch: Path, checkpoint: Path,
                     tp: int) -> RecipeConfig:
    """The run's recipe at tp ranks (pp = dp = 1), starting from the
    checkpoint's weights, without its drills' faults, and kept out of the
    run's own directory: the trainer resumes nothing, writes no event there
    and never cleans up the partial save of a run still going. Live
    replacement is off: it plans each generation's state over the training
    job's process groups, which one inference process does not have."""
    train = cfg.train if use.eval_batches is None else dataclasses.replace(
        cfg.train, eval_batches=use.eval_batches)
    saved = dataclasses.replace(
        cfg.checkpoint, dir=None, load="none", init_from=str(checkpoint),
        init_from_optimizer=False, local=dataclasses.replace(cfg.checkpoint.local, enabled=False))
    resilience = dataclasses.replace(cfg.resilience, replacement=dataclasses.replace(
        cfg.resilience.replacement, enabled=False))
    model = cfg.model
    if use.local_layers:
        model = dataclasses.replace(model, backend=Backend.local)
        train = dataclasses.replace(train, fp8=FP8.none)
    return dataclasses.replace(cfg, parallel=ParallelConfig(tp=tp), model=model, train=train,
                               faults=[], run=dataclasses.replace(cfg.run, dir=str(scratch)),
                               checkpoint=saved, resilience=resilience)


def evaluate(checkpoint: Path, batches: int | None = None, split: str = "valid",
             tp: int = 1) -> dict:
    """Loss and perplexity on a held-out split: on valid, the run's own eval
    batches; on test, as many batches of the test split (data/build.py)."""
    return run_on_model(checkpoint, tp, Use(eval_batches=batches), evaluate_job, split=split)


def evaluate_job(loaded: LoadedModel, checkpoint: Path, step: int, *, split: str) -> dict:
    """The trainer's eval (Trainer.evaluate) on the model alone: its held-out
    batches (train/batches.py), compiled blocks where the run compiled them."""
    cfg = loaded.cfg
    if cfg.train.eval_batches == 0:
        raise fmt.CheckpointError("the run evaluated on no batches (train.eval_batches=0). "
                                  "Fix: pass --batches N.")
    dataset = (build_test_dataset(cfg.data, cfg.model.vocab_size, cfg.train.seed)
               if split == "test" else
               build_datasets(cfg.data, cfg.model.vocab_size, cfg.train.seed)[1])
    compile_blocks([loaded.model], cfg, loaded.layout.device)
    with torch.no_grad():
        loss = float(held_out_loss(
            cast(SampleDataset, dataset), cfg.train, loaded.layout, loaded.masking,
            lambda batches: model_loss(loaded.model, loaded.autocast, batches)))
    return {"checkpoint": str(checkpoint), "step": step, "split": split,
            "batches": cfg.train.eval_batches, "loss": loss, "perplexity": math.exp(loss)}


def generate(checkpoint: Path, prompts: list[str], *, max_new_tokens: int = 50,
             sampling: Sampling = Sampling(), tp: int = 1,
             tokenizer: Optional[str] = None) -> list[dict]:
    """Each prompt continued by the checkpoint's model, all in one batch
    (generation.py); `tokenizer` names one other than the run's
    data.tokenizer. The prompts are read, and refused, before the model loads."""
    recipe = from_dict(read_manifest(checkpoint)["recipe"])
    text = prompt_tokenizer(recipe, tokenizer)
    ids = [text.encode(prompt) for prompt in prompts]
    check_prompts(ids, recipe.model.max_seq_len)
    use = Use(eval_batches=0, local_layers=True)
    new = run_on_model(checkpoint, tp, use, generate_job, prompts=ids,
                       max_new_tokens=max_new_tokens, sampling=sampling)["new"]
    return [{"checkpoint": str(checkpoint), "step": step_of(checkpoint), "prompt": prompt,
             "completion": text.decode(tokens), "token_ids": tokens,
             "stopped_at_context": len(tokens) < max_new_tokens}
            for prompt, tokens in zip(prompts, new)]


def prompt_tokenizer(recipe: RecipeConfig, name: Optional[str]):
    """The tokenizer `name` (None: the run's data.tokenizer), checked against the model."""
    data = recipe.data if name is None else dataclasses.replace(recipe.data, tokenizer=name)
    try:
        tokenizer = recipe_tokenizer(data, recipe.model.vocab_size)
    except ValueError as err:
        raise fmt.CheckpointError(f"{err} (generation needs text in and out; --tokenizer "
                                  "names the tokenizer)") from None
    if tokenizer.vocab_size > recipe.model.vocab_size:
        raise fmt.CheckpointError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model "
                                  f"{recipe.model.vocab_size} ids. Fix: --tokenizer naming the "
                                  "tokenizer the model trained with.")
    return tokenizer


def generate_job(loaded: LoadedModel, checkpoint: Path, step: int, *,
                 prompts: list[list[int]], max_new_tokens: int, sampling: Sampling) -> dict:
    # Every rank draws the same tokens: the logits are gathered over tp and
    # the sampling generators are seeded alike.
    return {"new": continue_batch(loaded.model, prompts, loaded.cfg.model.max_seq_len,
                                  max_new_tokens, sampling)}
