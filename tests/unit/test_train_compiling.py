"""train.compile (train/compiling.py): blocks compiled in place train as
eager ones do and keep their checkpoint keys; the setting is checked.

The backend here is aot_eager: dynamo's tracing and AOTAutograd's joint
graph, as inductor gets them, without inductor's C++ code generation
(minutes on a cold cache). It must match eager bit for bit. Inductor's
own fp32 difference (reordered reductions) is measured by
bench/train_throughput.py --compile: |loss - eager| was at most 1.9e-6 over
8 steps (docs/gpu.md, "train.compile")."""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megaresil.config import ConfigError, load_recipe
from megaresil.model.gpt import GPT
from megaresil.model.init import initialize
from megaresil.parallel.tensor_parallel import TPGroup
from megaresil.ports import free_port
from megaresil.train.compiling import BlockCompile, compile_blocks, compiles_blocks, whole_graphs
from megaresil.train.story import banner
from tests.harness.dist import MOE, RECIPE, TINY, join_group, spawn_ranks

CPU = torch.device("cpu")


def tiny(*overrides):
    return load_recipe(RECIPE, TINY + ["train.compile=blocks", *overrides])


def trained(cfg, compiled: bool, steps: int = 3, tp: TPGroup = TPGroup()):
    """Losses of `steps` SGD steps on fixed batches, and the model after."""
    model = GPT(cfg.model, tp=tp)
    initialize(model, cfg.model, cfg.train.seed)
    model.train()
    if compiled:
        assert compile_blocks([model], cfg, CPU, backend="aot_eager") is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 2, 16), generator=batches)
        loss = model(tokens[0], tokens[1], torch.arange(2) + 2 * step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


# MoE's run (attention compiled, experts eager) matches too, but costs 17 s
# of compiling: test_moe_blocks_compile_only_their_attention checks its units.
@pytest.mark.parametrize("overrides", [[], ["model.recompute=full", "model.dropout=0.1"]],
                         ids=["dense", "recompute-dropout"])
def test_compiled_blocks_train_as_eager_and_keep_their_keys(overrides):
    cfg = tiny(*overrides)
    eager_losses, eager = trained(cfg, compiled=False)
    compiled_losses, compiled = trained(cfg, compiled=True)
    assert compiled_losses == eager_losses
    eager_state, compiled_state = eager.state_dict(), compiled.state_dict()
    assert list(compiled_state) == list(eager_state)  # no `_orig_mod.` anywhere
    assert all(torch.equal(compiled_state[k], eager_state[k]) for k in eager_state)


def test_a_compiled_models_state_loads_into_an_eager_one_and_back():
    cfg = tiny()
    _, compiled = trained(cfg, compiled=True, steps=1)
    fresh = GPT(cfg.model)
    fresh.load_state_dict(compiled.state_dict())  # strict: the same keys
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 compiled.state_dict().values()))
    fresh_compiled = GPT(cfg.model)
    compile_blocks([fresh_compiled], cfg, CPU, backend="aot_eager")
    fresh_compiled.load_state_dict(fresh.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh_compiled.state_dict().values(),
                                                 fresh.state_dict().values()))


def test_moe_blocks_compile_only_their_attention():
    cfg = tiny(*MOE)
    model = GPT(cfg.model)
    report = compile_blocks([model], cfg, CPU, backend="aot_eager")
    assert report == BlockCompile(units=4, fullgraph=True)
    assert model.layers["0"]._compiled_call_impl is not None  # the dense first layer
    assert model.layers["1"]._compiled_call_impl is None
    assert model.layers["1"].attn._compiled_call_impl is not None


def test_none_is_the_default_auto_compiles_on_cuda_only_and_the_banner_says_so():
    assert not compiles_blocks(load_recipe(RECIPE, TINY), torch.device("cuda"))  # the default
    cfg = load_recipe(RECIPE, TINY + ["train.compile=auto"])
    assert not compiles_blocks(cfg, CPU) and compiles_blocks(cfg, torch.device("cuda"))
    words = BlockCompile(4, fullgraph=False).words()
    assert f"; {words}; starts at step 0" in banner(cfg, 0, words)


@pytest.mark.parametrize("override,problem", [
    ("train.compile=yes", "write one of the listed names"),
    ("model.backend=te", "Transformer Engine"),
])
def test_a_setting_that_cannot_compile_is_refused_in_one_line(override, problem):
    with pytest.raises(ConfigError) as err:
        tiny(override)
    assert "train.compile" in str(err.value) and problem in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def _tp_worker(rank: int, port: int, out: str) -> None:
    join_group(rank, 2, port)
    try:
        cfg = tiny("parallel.tp=2", "parallel.sequence_parallel=true")
        tp = TPGroup(dist.group.WORLD, 2, rank, sequence_parallel=True)
        runs = [trained(cfg, compiled, steps=2, tp=tp) for compiled in (False, True)]
        if rank == 0:
            Path(out).write_text(json.dumps([losses for losses, _ in runs]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_blocks_under_tp2_with_sequence_parallelism_train_as_eager(tmp_path):
    """SP's collectives break the graph (train/compiling.whole_graphs): the
    blocks compile with breaks, and the losses stay eager's, bit for bit."""
    assert not whole_graphs(tiny("parallel.tp=2", "parallel.sequence_parallel=true"))
    out = tmp_path / "losses.json"
    spawn_ranks(_tp_worker, (free_port(), str(out)), 2)
    eager, compiled = json.loads(out.read_text())
    assert compiled == eager
