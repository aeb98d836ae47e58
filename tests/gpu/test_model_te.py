"""model.backend=te where Transformer Engine imports (`pytest -m gpu`, run by
tools/gpu_check.sh): TE's fused modules and DotProductAttention compute the
local backend's logits, grads and one SGD step at tp=1, tp=2 and tp=2 with
sequence parallelism, and their state maps onto the local keys both ways."""
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
from megaresil.parallel.data_parallel import all_reduce_sequence_parallel_grads
from megaresil.parallel.tensor_parallel import TPGroup
from megaresil.ports import free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not te.available(), reason="needs Transformer Engine")]
FLAVOURS = ["gpt2", "llama"]


def config(flavour: str) -> ModelConfig:
    """Llama with GQA (2 kv heads, 1 per rank at tp=2). Block dropout on: its
    masks are layout-independent, so TE must draw the local ones; attention
    dropout off: DotProductAttention draws its own."""
    extra = {"flavour": "llama", "num_kv_heads": 2} if flavour == "llama" else {}
    return ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=300, max_seq_len=32,
                       dropout=0.1, **extra)


def local_model(flavour: str, tp: TPGroup = TPGroup()) -> GPT:
    cfg = config(flavour)
    model = GPT(cfg, tp=tp)
    initialize(model, cfg, seed=0)
    return model.cuda()


def te_model(flavour: str, tp: TPGroup = TPGroup()) -> GPT:
    return te.convert(local_model(flavour, tp), torch.device("cuda", torch.cuda.current_device()))


def local_state_params(model: GPT, flavour: str) -> dict[str, torch.nn.Parameter]:
    """A TE model's parameters under the local backend's keys."""
    return {te.local_key(k, flavour): p for k, p in model.named_parameters()}


def local_state(model: GPT, flavour: str) -> dict[str, torch.Tensor]:
    return {k: p.detach() for k, p in local_state_params(model, flavour).items()}


def logits_diff(local: GPT, engine: GPT, tokens: torch.Tensor) -> float:
    local.eval(), engine.eval()
    with torch.no_grad():
        diff = (engine.logits(tokens) - local.logits(tokens)).abs().max().item()
    local.train(), engine.train()
    return diff


def training_diffs(local: GPT, engine: GPT, flavour: str, tp: TPGroup) -> dict[str, float]:
    """TE vs local: max |diff| of the logits, before and after one SGD step, and
    the worst grad's max |diff| relative to its max |grad|. The grads of the
    sequence-parallel params are summed over TP as the trainer sums them, by
    each model's own marks (a TE norm left unmarked would step differently)."""
    torch.manual_seed(0)
    tokens, targets = (torch.randint(300, (2, 32), device="cuda") for _ in range(2))
    samples = torch.tensor([3, 7])
    diffs = {"logits": logits_diff(local, engine, tokens)}
    for model in (local, engine):
        model(tokens, targets, samples).backward()
        all_reduce_sequence_parallel_grads([(p, p.grad) for p in model.parameters()],
                                           tp.group if tp.active else None)
    engine_params = local_state_params(engine, flavour)
    diffs["grads"] = max(((engine_params[k].grad - p.grad).abs().max()
                          / p.grad.abs().max().clamp_min(1e-12)).item()
                         for k, p in local.named_parameters())
    for model in (local, engine):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    diffs["logits_after_step"] = logits_diff(local, engine, tokens)
    return diffs


def assert_close_training(diffs: dict[str, float]) -> None:
    assert diffs["logits"] < 1e-3 and diffs["logits_after_step"] < 1e-3, diffs
    assert diffs["grads"] < 1e-2, diffs


def uses_dot_product_attention(model: GPT) -> bool:
    return all(isinstance(block.attn.core, te.te.DotProductAttention)
               for block in model.layers.values())


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_te_logits_match_local_at_tp1(flavour):
    local, engine = local_model(flavour), te_model(flavour)
    assert set(local_state(engine, flavour)) == {k for k, _ in local.named_parameters()}
    assert uses_dot_product_attention(engine)
    tokens = torch.randint(300, (2, 32), device="cuda")
    assert logits_diff(local, engine, tokens) < 1e-3


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_te_grads_and_step_match_local_at_tp1(flavour):
    diffs = training_diffs(local_model(flavour), te_model(flavour), flavour, TPGroup())
    assert_close_training(diffs)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_te_state_round_trips_through_local_keys(flavour):
    """te -> local keys -> a local model -> te keys -> a fresh TE model: same logits."""
    engine = te_model(flavour).eval()  # logits without dropout
    with torch.no_grad():
        for p in engine.parameters():  # away from the init both sides share
            p.add_(0.01 * torch.randn_like(p))
    local = local_model(flavour).eval()
    local.load_state_dict(local_state(engine, flavour), strict=False)
    back = te_model(flavour).eval()
    back_params = dict(back.named_parameters())
    with torch.no_grad():
        for key, param in local.named_parameters():
            back_params[te.te_key(key, flavour)].copy_(param)
    tokens = torch.randint(300, (2, 32), device="cuda")
    with torch.no_grad():
        want = engine.logits(tokens)
        torch.testing.assert_close(local.logits(tokens), want, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(back.logits(tokens), want, rtol=0, atol=0)


def _tp2_worker(rank: int, port: int, flavour: str, sequence_parallel: bool, backend: str,
                out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        tp = TPGroup(dist.group.WORLD, 2, rank, sequence_parallel)
        engine = te_model(flavour, tp)
        diffs = training_diffs(local_model(flavour, tp), engine, flavour, tp)
        diffs["dot_product_attention"] = uses_dot_product_attention(engine)
        torch.save(diffs, f"{out}/diffs.{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_te_matches_local_at_tp2(flavour, sequence_parallel, tmp_path):
    """NCCL with two GPUs; one GPU shared by two ranks needs gloo (NCCL refuses a
    device used twice), and gloo's CUDA collectives are not relied on for TE's
    sequence-parallel all-gather / reduce-scatter."""
    two_gpus = torch.cuda.device_count() >= 2
    if sequence_parallel and not two_gpus:
        pytest.skip("TE's sequence parallelism is checked with NCCL on two GPUs")
    mp.start_processes(_tp2_worker, args=(free_port(), flavour, sequence_parallel,
                                          "nccl" if two_gpus else "gloo", str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        diffs = torch.load(tmp_path / f"diffs.{rank}.pt")
        assert diffs.pop("dot_product_attention")
        assert_close_training(diffs)
