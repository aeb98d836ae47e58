"""The mixture-of-experts layer against hand formulas and plain loops: the
router's top-k and weights, the grouped experts, capacity dropping, and the
routing losses reaching the gradients as an explicit `loss + coeff * aux`
would."""
import math

import pytest
import torch
import torch.nn.functional as F

from megaresil.config import Flavour, ModelConfig, MoEConfig, RouterScore
from megaresil.model import init
from megaresil.model.moe import MoEBlock, MoELossScale, has_experts
from megaresil.model.moe.experts import GroupedExperts, dispatch_plan, expert_capacity
from megaresil.model.moe.routing import Routing, load_balancing_loss, top_k_routing, router_z_loss
from megaresil.parallel.tensor_parallel import TPGroup

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0],
                       [0.0, 3.0, 1.0, 1.5],
                       [-1.0, -2.0, 0.5, 0.0]])


def model_config(**moe) -> ModelConfig:
    return ModelConfig(flavour=Flavour.llama, num_layers=2, hidden_size=16, num_heads=2,
                       num_kv_heads=2, ffn_hidden_size=24, vocab_size=64, max_seq_len=8,
                       moe=MoEConfig(**{"num_experts": 4, **moe}))


@pytest.mark.parametrize("normalize", [False, True])
def test_softmax_routing_takes_the_top_k_scores(normalize):
    routing = top_k_routing(LOGITS, MoEConfig(num_experts=4, top_k=2, normalize_top_k=normalize,
                                              routed_scaling_factor=2.5))
    probs = LOGITS.softmax(-1)
    assert routing.experts.tolist() == [[0, 1], [1, 3], [2, 3]]
    chosen = probs.gather(1, routing.experts)
    if normalize:
        chosen = chosen / chosen.sum(-1, keepdim=True)
        assert torch.allclose(routing.weights.sum(-1), torch.full((3,), 2.5))
    torch.testing.assert_close(routing.weights, 2.5 * chosen)


def test_sigmoid_routing_normalises_the_chosen_scores():
    cfg = MoEConfig(num_experts=4, top_k=2, score_function=RouterScore.sigmoid)
    routing = top_k_routing(LOGITS, cfg)
    chosen = LOGITS.sigmoid().gather(1, routing.experts)
    torch.testing.assert_close(routing.scores, LOGITS.sigmoid())
    torch.testing.assert_close(routing.weights, chosen / chosen.sum(-1, keepdim=True))
    assert routing.experts.tolist() == [[0, 1], [1, 3], [2, 3]]


def test_the_routing_losses_follow_their_formulas():
    for score in RouterScore:
        cfg = MoEConfig(num_experts=4, top_k=2, score_function=score)
        routing = top_k_routing(LOGITS, cfg)
        probs = routing.scores / routing.scores.sum(-1, keepdim=True)
        share = torch.zeros(4)
        for e in routing.experts.flatten().tolist():
            share[e] += 1 / 6  # 3 tokens x 2 choices
        expected = 4 * sum(share[i] * probs[:, i].mean() for i in range(4))
        torch.testing.assert_close(load_balancing_loss(routing, cfg), expected)
    lse = [math.log(sum(math.exp(v) for v in row)) for row in LOGITS.tolist()]
    torch.testing.assert_close(router_z_loss(routing), torch.tensor(sum(v * v for v in lse) / 3))


def routing_of(experts: list[list[int]]) -> Routing:
    chosen = torch.tensor(experts)
    weights = torch.arange(1.0, chosen.numel() + 1).view_as(chosen)
    return Routing(torch.zeros(0), torch.zeros(0), chosen, weights)


def test_capacity_drops_the_later_tokens_of_a_full_expert():
    # Expert 0 is chosen by tokens 0, 1, 2 and 3; with room for 2 it keeps tokens 0 and 1.
    routing = routing_of([[0, 1], [2, 0], [0, 3], [0, 1]])
    assert expert_capacity(1.0, tokens=4, top_k=2, num_experts=4) == 2
    plan = dispatch_plan(routing, 4, capacity=2)
    assert plan.counts.tolist() == [2, 2, 1, 1]
    assert plan.tokens.tolist() == [0, 1, 0, 3, 1, 2]
    assert plan.weights.tolist() == [1.0, 4.0, 2.0, 8.0, 3.0, 6.0]
    dropless = dispatch_plan(routing, 4, capacity=None)
    assert dropless.counts.tolist() == [4, 2, 1, 1] and dropless.tokens[:4].tolist() == [0, 1, 2, 3]


def loop_reference(experts: GroupedExperts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's SwiGLU over its rows, one expert at a time."""
    outputs, start = [], 0
    for e, n in enumerate(counts):
        x = rows[start:start + n]
        hidden = F.silu(x @ experts.gate[e].T) * (x @ experts.up[e].T)
        outputs.append(hidden @ experts.down[e].T)
        start += n
    return torch.cat(outputs)


def test_grouped_experts_equal_a_loop_over_experts_forward_and_backward():
    torch.manual_seed(0)
    experts = GroupedExperts(4, hidden=16, ffn=24, tp=TPGroup())
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    counts = [3, 0, 5, 2]  # an expert without tokens too
    rows = torch.randn(10, 16, requires_grad=True)
    upstream = torch.randn(10, 16)
    got = experts(rows, torch.tensor(counts))
    grads = torch.autograd.grad(got, [rows, *experts.parameters()], upstream)
    expected = loop_reference(experts, rows, counts)
    want = torch.autograd.grad(expected, [rows, *experts.parameters()], upstream)
    torch.testing.assert_close(got, expected)
    for name, g, w in zip(["rows", "gate", "up", "down"], grads, want):
        torch.testing.assert_close(g, w, msg=name)
    assert not grads[1][1].any()  # expert 1 saw no tokens


def moe_block(**moe) -> tuple[MoEBlock, ModelConfig]:
    cfg = model_config(**moe)
    block = MoEBlock(cfg, TPGroup(), MoELossScale(), ffn=24)
    for key, param in block.named_parameters():
        init.draw_normal(param, "layers.0.mlp." + key, cfg, seed=3)
    return block, cfg


def test_the_block_sums_each_tokens_weighted_expert_outputs():
    block, cfg = moe_block(shared_expert_hidden_size=8)
    x = torch.randn(2, 3, 16)
    tokens = x.reshape(-1, 16)
    routing = block.router(tokens)
    expected = torch.zeros_like(tokens)
    for n in range(tokens.shape[0]):
        for e, w in zip(routing.experts[n].tolist(), routing.weights[n]):
            hidden = F.silu(tokens[n] @ block.experts.gate[e].T) * (tokens[n] @ block.experts.up[e].T)
            expected[n] += w * (hidden @ block.experts.down[e].T)
    expected = expected.view_as(x) + block.shared(x)
    torch.testing.assert_close(block(x), expected)


@pytest.mark.parametrize("score", list(RouterScore))
def test_routing_losses_reach_the_grads_as_an_explicit_sum(score):
    aux, zc, scale = 0.1, 0.01, 0.25
    block, cfg = moe_block(aux_loss_coeff=aux, z_loss_coeff=zc, score_function=score)
    block.scale.value = scale
    x = torch.randn(2, 5, 16)
    target = torch.randn(2, 5, 16)
    params = list(block.parameters())

    loss = F.mse_loss(block(x), target)
    got = torch.autograd.grad(loss * scale, params)

    block.eval()  # the plain output, the losses added by hand
    routing = block.router(x.reshape(-1, 16))
    explicit = (F.mse_loss(block(x), target)
                + aux * load_balancing_loss(routing, block.moe) + zc * router_z_loss(routing))
    want = torch.autograd.grad(explicit * scale, params)
    for (name, _), g, w in zip(block.named_parameters(), got, want):
        torch.testing.assert_close(g, w, msg=name)
    assert got[0].norm() > 0


def test_only_tensor_parallel_rank_0_starts_the_routing_losses_backward():
    """Every tp rank routes alike and the router's grads are summed over tp."""
    block, _ = moe_block(z_loss_coeff=1.0)
    block.tp = TPGroup(size=2, rank=1)  # no collective runs: only the weight is read
    x = torch.randn(1, 4, 16)
    out = block.with_routing_losses(x.clone().requires_grad_(), block.router(x.reshape(-1, 16)))
    (grad,) = torch.autograd.grad(out.sum(), [block.router.weight])
    assert not grad.any()


def test_layers_with_experts_follow_dense_first_and_the_frequency():
    moe = MoEConfig(num_experts=4, first_dense_layers=1, every_n_layers=2)
    assert [i for i in range(7) if has_experts(moe, i)] == [1, 3, 5]
    assert not any(has_experts(MoEConfig(), i) for i in range(4))


def test_an_experts_init_depends_on_neither_the_expert_count_nor_tp():
    def stack(num_experts: int, tp: TPGroup) -> torch.Tensor:
        experts = GroupedExperts(num_experts, hidden=16, ffn=24, tp=tp)
        cfg = model_config(num_experts=num_experts)
        init.draw_normal(experts.gate, "layers.1.mlp.experts.gate", cfg, seed=7)
        return experts.gate.detach()

    three, five = stack(3, TPGroup()), stack(5, TPGroup())
    torch.testing.assert_close(three, five[:3], rtol=0, atol=0)
    assert not torch.equal(three[0], three[1])
    torch.testing.assert_close(stack(3, TPGroup(size=2, rank=1)), three[:, 12:], rtol=0, atol=0)
