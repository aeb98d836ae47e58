"""Aux-loss-free balancing against hand computations: the bias moves the
choice and not the weights, the update rule from the step's summed loads,
and the bias as checkpoint state."""
import torch

from tests.harness.dist import MOE, Case, recipe_for
from megaresil.checkpoint.keys import state_rects
from megaresil.checkpoint.offline.planning import planned_rects, writer_share
from megaresil.config import MoEConfig
from megaresil.model.moe import ExpertBalance, named_state_buffers
from megaresil.model.moe.routing import Router, top_k_routing
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.tensor_parallel import TPGroup
from megaresil.train.loop import Trainer

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0],
                       [0.0, 3.0, 1.0, 1.5]])


def biased(rate: float = 0.1) -> MoEConfig:
    return MoEConfig(num_experts=4, top_k=2, bias_update_rate=rate)


def test_the_bias_moves_the_choice_and_not_the_weights():
    cfg = biased()
    scores = LOGITS.softmax(-1)
    routing = top_k_routing(LOGITS, cfg, torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert routing.experts.tolist() == [[3, 0], [3, 1]]  # 3 lifted above every other score
    chosen = scores.gather(-1, routing.experts)
    assert torch.equal(routing.weights, chosen / chosen.sum(-1, keepdim=True))


def test_the_update_moves_each_bias_by_the_sign_of_its_shortfall():
    routers = [Router(biased(0.25), 8, TPGroup()) for _ in range(2)]
    loads = torch.tensor([[6.0, 2.0, 0.0, 0.0],  # mean 2
                          [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    ExpertBalance(routers, 0.25).after_step(loads)
    assert routers[0].expert_bias.tolist() == [-0.25, 0.0, 0.25, 0.25]
    assert routers[1].expert_bias.tolist() == [0.0] * 4


def test_the_bias_is_checkpoint_state_without_moments():
    router = torch.nn.ModuleDict({"router": Router(biased(), 8, TPGroup())})
    assert [name for name, _ in router.named_parameters()] == ["router.weight"]
    buffers = list(named_state_buffers([router]))
    assert [name for name, _ in buffers] == ["router.expert_bias"]
    rects = state_rects([], None, lambda p: None, include_copies=False, named_buffers=buffers)
    assert [(r.key, r.global_shape, r.offset) for r in rects] == \
        [("model/router.expert_bias", (4,), (0,))]


def test_without_a_rate_the_router_holds_no_bias():
    router = Router(biased(0.0), 8, TPGroup())
    assert router.expert_bias is None
    assert "expert_bias" not in router.state_dict()


def test_a_step_held_back_moves_no_bias(tmp_path):
    cfg = recipe_for(Case("moe", MOE), tmp_path / "run")
    trainer = Trainer(cfg, ParallelLayout(device=torch.device("cpu")))
    routers = trainer.routing.balance.routers
    biases = [r.expert_bias for r in routers]
    assert len(biases) == 3  # the first layer is dense

    trainer.numerics.holds_back = lambda step, result: True
    assert not trainer.attempt_step(1).applied
    assert all(b.count_nonzero() == 0 for b in biases)
    del trainer.numerics.holds_back
    assert trainer.attempt_step(1).applied
    loads = trainer.routing.totals[:, :4].float()  # the step's sums stay until the next attempt
    for router, load in zip(routers, loads):
        assert load.sum() == 8 * 16 * 2  # every token of the global batch, top-2
        assert torch.equal(router.expert_bias, 0.01 * torch.sign(load.mean() - load))


def test_convert_plans_the_bias_whole_once_a_stage(tmp_path):
    """At tp2 x pp2 x dp2 every rank of a stage holds its layers' biases
    whole; one of them writes each (offline/planning, as a save does)."""
    three_d = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"]
    cfg = recipe_for(Case("moe", MOE + three_d), tmp_path / "run")
    share = writer_share(planned_rects(cfg, weights_only=False))
    written = sorted(rect.key for _, rect in share if rect.key.endswith("expert_bias"))
    assert written == [f"model/layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)]
