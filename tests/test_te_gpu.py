"""model.backend=te where Transformer Engine imports (`pytest -m gpu`, run by
tools/gpu_check.sh): TE's fused modules compute the local backend's logits at
tp=1 and tp=2, and their state maps onto the local keys both ways."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaresil.config import ModelConfig
from megaresil.model import te
from megaresil.model.gpt import GPT
from megaresil.model.init import initialize
from megaresil.parallel.tensor_parallel import TPGroup
from megaresil.ports import free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not te.available(), reason="needs Transformer Engine")]
FLAVOURS = ["gpt2", "llama"]


def config(flavour: str) -> ModelConfig:
    extra = {"flavour": "llama", "num_kv_heads": 2} if flavour == "llama" else {}
    return ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=300, max_seq_len=32,
                       **extra)


def local_model(flavour: str, tp: TPGroup = TPGroup()) -> GPT:
    cfg = config(flavour)
    model = GPT(cfg, tp=tp)
    initialize(model, cfg, seed=0)
    return model.cuda()


def te_model(flavour: str, tp: TPGroup = TPGroup()) -> GPT:
    return te.convert(local_model(flavour, tp), torch.device("cuda", torch.cuda.current_device()))


def local_state(model: GPT, flavour: str) -> dict[str, torch.Tensor]:
    """A TE model's parameters under the local backend's keys."""
    return {te.local_key(k, flavour): p.detach() for k, p in model.named_parameters()}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_te_logits_match_local_at_tp1(flavour):
    local, engine = local_model(flavour), te_model(flavour)
    assert set(local_state(engine, flavour)) == {k for k, _ in local.named_parameters()}
    tokens = torch.randint(300, (2, 32), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(engine.logits(tokens), local.logits(tokens),
                                   rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_te_state_round_trips_through_local_keys(flavour):
    """te -> local keys -> a local model -> te keys -> a fresh TE model: same logits."""
    engine = te_model(flavour)
    with torch.no_grad():
        for p in engine.parameters():  # away from the init both sides share
            p.add_(0.01 * torch.randn_like(p))
    local = local_model(flavour)
    local.load_state_dict(local_state(engine, flavour), strict=False)
    back = te_model(flavour)
    back_params = dict(back.named_parameters())
    with torch.no_grad():
        for key, param in local.named_parameters():
            back_params[te.te_key(key, flavour)].copy_(param)
    tokens = torch.randint(300, (2, 32), device="cuda")
    with torch.no_grad():
        want = engine.logits(tokens)
        torch.testing.assert_close(local.logits(tokens), want, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(back.logits(tokens), want, rtol=0, atol=0)


def _tp2_worker(rank: int, port: int, flavour: str, backend: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        tp = TPGroup(dist.group.WORLD, 2, rank)
        local, engine = local_model(flavour, tp), te_model(flavour, tp)
        torch.manual_seed(0)
        tokens = torch.randint(300, (2, 32), device="cuda")
        with torch.no_grad():
            diff = (engine.logits(tokens) - local.logits(tokens)).abs().max().item()
        torch.save(diff, f"{out}/diff.{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_te_logits_match_local_at_tp2(flavour, tmp_path):
    """NCCL with two GPUs; one GPU shared by two ranks needs gloo (NCCL refuses a
    device used twice)."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    mp.start_processes(_tp2_worker, args=(free_port(), flavour, backend, str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        assert torch.load(tmp_path / f"diff.{rank}.pt") < 1e-3
