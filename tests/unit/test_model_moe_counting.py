"""The routing counters against hand counts: a training forward counts its
choices once (not eval, not without grad, not recomputation's second pass),
the capacity's drops (none dropless), the routing losses' sums, and the
metrics fields made of a step's summed counters."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.harness.dist import MOE, Case, recipe_for
from megaresil.config import MoEConfig
from megaresil.model import init
from megaresil.model.moe import MoEBlock, MoELossScale
from megaresil.model.moe.counting import AUX_LOSS, CALLS, DROPPED, Z_LOSS, RoutingCounter
from megaresil.model.moe.experts import dispatch_plan
from megaresil.model.moe.routing import Routing, load_balancing_loss, top_k_routing, router_z_loss
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.tensor_parallel import TPGroup
from megaresil.train.loop import Trainer
from megaresil.train.routing_figures import RoutingFigures
from tests.unit.test_model_moe import model_config

CFG = MoEConfig(num_experts=4, top_k=2)
LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0],  # experts 0, 1
                       [1.0, 3.0, 0.0, 1.5],  # 1, 3
                       [2.5, 0.0, 0.5, 1.0],  # 0, 3
                       [3.0, 2.0, 0.0, 0.0]])  # 0, 1


def figures(counter: RoutingCounter) -> torch.Tensor:
    return counter.totals[CFG.num_experts:]


@pytest.mark.parametrize("capacity, dropped", [(None, 0), (2, 2), (1, 5)])
def test_a_counter_counts_choices_and_the_capacitys_drops(capacity, dropped):
    counter = RoutingCounter(CFG)
    routing = top_k_routing(LOGITS, CFG)
    with torch.enable_grad():
        counter.record(routing, capacity)
    assert counter.choices.tolist() == [3, 3, 0, 2]  # every choice, dropped ones too
    kept = dispatch_plan(routing, 4, capacity).counts.sum()
    assert figures(counter)[DROPPED] == dropped == 8 - kept
    assert figures(counter)[AUX_LOSS] == load_balancing_loss(routing, CFG).double()
    assert figures(counter)[Z_LOSS] == router_z_loss(routing).double()
    assert figures(counter)[CALLS] == 1
    counter.reset()
    assert counter.totals.count_nonzero() == 0


def moe_block() -> MoEBlock:
    cfg = model_config(top_k=2)
    block = MoEBlock(cfg, TPGroup(), MoELossScale(), ffn=24)
    for key, param in block.named_parameters():
        init.draw_normal(param, "layers.0.mlp." + key, cfg, seed=3)
    return block


def test_a_block_counts_training_forwards_once_each():
    block, x = moe_block(), torch.randn(2, 3, 16)
    block(x)
    checkpoint(block, x, use_reentrant=False).sum().backward()  # recomputed in backward
    block.eval()
    block(x)
    with torch.no_grad():
        block.train()(x)
    assert block.counter.choices.sum() == 2 * 6 * 2  # two forwards, 6 tokens, top-2
    assert figures(block.counter)[CALLS] == 2


def test_the_fields_of_a_steps_sums(tmp_path):
    cfg = recipe_for(Case("moe", MOE + ["logging.log_interval=5"]), tmp_path / "run")
    E = cfg.model.moe.num_experts
    routing = RoutingFigures(cfg, ParallelLayout(device=torch.device("cpu")), [])
    assert routing.layer_ids == [1, 2, 3] and routing.fields(1) == {}
    choices = torch.tensor([[4.0, 4, 4, 4], [8, 4, 2, 2], [1, 1, 1, 13]])
    sums = torch.tensor([[1.0, 3.0, 0.5, 4], [0.0, 6.0, 1.5, 4], [2.0, 3.0, 1.0, 4]])
    routing.totals = torch.cat([choices, sums], 1).double()
    row = routing.fields(3)
    assert row == {"moe_aux_loss": 12 / 12, "moe_z_loss": 3 / 12, "moe_dropped_share": 3 / 48,
                   "moe_imbalance": 13 / 4}
    assert routing.fields(5)["moe_load"] == {"1": [4, 4, 4, 4], "2": [8, 4, 2, 2],
                                             "3": [1, 1, 1, 13]}
    assert "moe_load" in routing.fields(cfg.train.steps) and E == 4


def test_a_steps_record_carries_the_routing_fields(tmp_path):
    cfg = recipe_for(Case("moe", MOE + ["model.moe.capacity_factor=1.0"]), tmp_path / "run")
    trainer = Trainer(cfg, ParallelLayout(device=torch.device("cpu")))
    record = trainer.train_step()
    assert 0 < record["moe_dropped_share"] < 1 and record["moe_imbalance"] >= 1
    assert record["moe_aux_loss"] >= 1  # 1 when balanced, before its coefficient
    assert record["moe_z_loss"] > 0
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    assert trainer.routing.totals[:, :4].sum(1).tolist() == [tokens * 2] * 3
