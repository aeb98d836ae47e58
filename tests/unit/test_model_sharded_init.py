"""Meta-device build and sharded init: every rank draws only its own slices,
and they are exactly the single-process values."""
import pytest
import torch

from megaresil.config import Flavour, ModelConfig, MoEConfig
from megaresil.model import init
from megaresil.model.gpt import GPT
from megaresil.parallel.sharding import spec_of
from megaresil.parallel.tensor_parallel import TPGroup
from tests.harness.model import local_slice


def config(flavour: str) -> ModelConfig:
    extra: dict = {"num_kv_heads": 4} if flavour.startswith("llama") else {}
    if flavour == "llama_moe":  # 3 experts drawn one by one, cut along their width by tp
        flavour, extra["moe"] = "llama", MoEConfig(num_experts=3, shared_expert_hidden_size=32)
    # vocab 300 pads to 384 at tp=1 and to 512 at tp=2 and 4: rank 3 of 4 holds padding only.
    return ModelConfig(flavour=Flavour(flavour), num_layers=2, hidden_size=48, num_heads=4,
                       vocab_size=300, max_seq_len=16, make_vocab_size_divisible_by=128, **extra)


def sharded_model(cfg: ModelConfig, tp: int, rank: int) -> GPT:
    with torch.device("meta"):
        model = GPT(cfg, tp=TPGroup(size=tp, rank=rank), seed=5)
    return init.materialize(model, cfg, seed=5, device=torch.device("cpu"))


@pytest.fixture
def small_draws(monkeypatch):
    """Blocks of 7 units, so rank boundaries cut through blocks."""
    monkeypatch.setattr(init, "UNITS_PER_DRAW", 7)


@pytest.mark.parametrize("flavour", ["gpt2", "llama", "llama_moe"])
def test_every_rank_holds_its_slice_of_the_single_process_values(flavour, small_draws):
    cfg = config(flavour)
    reference = {key: p.detach() for key, p in sharded_model(cfg, 1, 0).named_parameters()}
    for tp in (2, 4):
        for rank in range(tp):
            for key, param in sharded_model(cfg, tp, rank).named_parameters():
                full = reference[key]
                if init.vocab_rows(key, cfg):
                    assert not full[cfg.vocab_size:].any(), key  # padding is zero
                    full = full[:cfg.vocab_size]
                expected = local_slice(param, full)
                torch.testing.assert_close(param.detach(), expected, rtol=0, atol=0,
                                           msg=f"{key} tp={tp} rank={rank}")


def test_materialize_matches_initialising_a_built_model_and_keeps_marks():
    cfg = config("llama")
    built = GPT(cfg, tp=TPGroup(size=2, rank=1), seed=5)
    init.initialize(built, cfg, seed=5)
    materialized = sharded_model(cfg, 2, 1)
    built_params = dict(built.named_parameters())
    for key, param in materialized.named_parameters():
        assert not param.is_meta and param.requires_grad
        assert spec_of(param).shards == spec_of(built_params[key]).shards, key
        torch.testing.assert_close(param, built_params[key], rtol=0, atol=0, msg=key)
    for (name, buffer), (_, expected) in zip(materialized.named_buffers(), built.named_buffers()):
        torch.testing.assert_close(buffer, expected, rtol=0, atol=0, msg=name)


def test_a_rank_draws_only_the_blocks_its_slice_touches(small_draws, monkeypatch):
    drawn: dict[str, set[int]] = {}
    seed_of = init.block_seed

    def counting(seed, key, block):
        drawn.setdefault(key, set()).add(block)
        return seed_of(seed, key, block)

    monkeypatch.setattr(init, "block_seed", counting)
    model = sharded_model(config("gpt2"), 4, 3)
    assert drawn and "embed.tokens.weight" not in drawn  # its slice is all padding
    for key, param in model.named_parameters():
        units = init.local_units(param)
        touched = set(range(units.start // 7, -(-units.stop // 7)))
        assert drawn.get(key, set()) <= touched, key


def test_a_model_built_for_a_load_gets_its_storage_and_marks_but_draws_nothing(monkeypatch):
    """The build before a load from live peers: every value drawn would be overwritten."""
    cfg = config("llama")
    drawn = sharded_model(cfg, 2, 1)
    monkeypatch.setattr(init, "initialize_parameter",
                        lambda *args: pytest.fail("a parameter was drawn"))
    with torch.device("meta"):
        model = GPT(cfg, tp=TPGroup(size=2, rank=1), seed=5)
    undrawn = dict(init.materialize(model, cfg, seed=5, device=torch.device("cpu"),
                                    draw=False).named_parameters())
    assert undrawn.keys() == dict(drawn.named_parameters()).keys()
    for key, param in drawn.named_parameters():
        assert not undrawn[key].is_meta and undrawn[key].requires_grad, key
        assert undrawn[key].shape == param.shape and undrawn[key].dtype == param.dtype, key
        assert spec_of(undrawn[key]).shards == spec_of(param).shards, key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_materialized_on_the_gpu_holds_the_cpu_values():
    """Draws stay on the host's generator: the device changes nothing."""
    cfg = config("llama")
    with torch.device("meta"):
        model = GPT(cfg, tp=TPGroup(size=2, rank=1), seed=5)
    on_gpu = init.materialize(model, cfg, seed=5, device=torch.device("cuda"))
    on_cpu = dict(sharded_model(cfg, 2, 1).named_parameters())
    for key, param in on_gpu.named_parameters():
        assert param.is_cuda, key
        torch.testing.assert_close(param.cpu(), on_cpu[key], rtol=0, atol=0, msg=key)
    assert all(b.is_cuda for b in on_gpu.buffers())
