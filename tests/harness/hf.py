"""Multi-rank helpers of the Hugging Face tests, kept apart from them so
spawned ranks do not import transformers."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness.model import load_full_state
from megaresil.checkpoint.sources import CheckpointSource, full_tensors
from megaresil.config import from_dict, load_recipe
from megaresil.launch.from_hf import from_hf_overrides
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.tensor_parallel import gather_vocab
from megaresil.model.gpt import GPT
from megaresil.train.loop import Trainer
from tests.harness.cli import ROOT


def parallel_logits(rank: int, world: int, port: int, hf_dir: str, out: str) -> None:
    """One rank of a tp=2 x pp=2 run started from the HF weights (init_from):
    the first stage sends its hidden states, the last gathers the logits."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        recipe = ROOT / "recipes" / "gpt-tiny.yaml"
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


def llama32_style(**overrides):
    """A tiny random model of Llama 3.2 1B's family: GQA, tied embeddings,
    Llama 3 RoPE scaling whose three frequency bands all occur at head_dim 16
    (original context 64, factor 8, low 1, high 4), theta 500000."""
    import transformers

    torch.manual_seed(0)
    config = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64})
    config.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()


def megaresil_model(checkpoint: Path) -> GPT:
    """The single-process model holding a checkpoint's weights."""
    source = CheckpointSource(checkpoint)
    cfg = from_dict(source.manifest["recipe"]).model
    model = GPT(cfg).eval()
    keys = [key for key in source.tensors if key.startswith("model/")]
    load_full_state(model, cfg, {key.removeprefix("model/"): t
                                 for key, t in full_tensors(source, keys)})
    return model
