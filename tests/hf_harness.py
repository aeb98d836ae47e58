"""Multi-rank helpers of the Hugging Face tests, kept apart from them so
spawned ranks do not import transformers."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from megaresil.config import load_recipe
from megaresil.launch import from_hf_overrides
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.tensor_parallel import gather_vocab
from megaresil.train.loop import Trainer


def parallel_logits(rank: int, world: int, port: int, hf_dir: str, out: str) -> None:
    """One rank of a tp=2 x pp=2 run started from the HF weights (init_from):
    the first stage sends its hidden states, the last gathers the logits."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        recipe = Path(__file__).resolve().parent.parent / "recipes" / "gpt-tiny.yaml"
        overrides = from_hf_overrides(Path(hf_dir), str(recipe), [
            "parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "data.source=synthetic",
            "data.seq_len=128", "train.micro_batch_size=2", "train.global_batch_size=4",
            "logging.progress=false", "logging.tensorboard=false", f"run.dir={out}/run"])
        cfg = load_recipe(recipe, overrides)
        trainer = Trainer(cfg, ParallelLayout.from_config(cfg.parallel, torch.device("cpu")))
        trainer.model.eval()
        tokens = torch.load(Path(out) / "tokens.pt")
        chunk, layout = trainer.chunks[0], trainer.layout
        with torch.no_grad():
            if layout.pp_rank == 0:
                dist.send(chunk.stage_forward(tokens, None).contiguous(), dst=rank + layout.tp)
            else:
                hidden = torch.empty(tokens.shape[0], tokens.shape[1], cfg.model.hidden_size)
                dist.recv(hidden, src=rank - layout.tp)
                logits = gather_vocab(chunk.stage_forward(hidden, None), chunk.tp)
                if layout.tp_rank == 0:
                    torch.save(logits[..., :cfg.model.vocab_size], Path(out) / "logits.pt")
    finally:
        dist.destroy_process_group()
