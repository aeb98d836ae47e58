"""Single-process properties of the TP building blocks."""
import pytest
import torch
import torch.nn.functional as F

from megaresil.config import ModelConfig
from megaresil.model.gpt import GPT, padded_vocab_size
from megaresil.model.init import initialize
from megaresil.parallel.tensor_parallel import TPGroup, vocab_parallel_cross_entropy


@pytest.mark.parametrize("vocab,tp,expected", [(300, 1, 384), (300, 2, 512), (4096, 2, 4096),
                                               (50257, 8, 51200)])
def test_vocab_padded_like_megatron(vocab, tp, expected):
    assert padded_vocab_size(ModelConfig(vocab_size=vocab), tp) == expected


def test_padding_columns_never_enter_the_loss():
    logits = torch.randn(6, 10, requires_grad=True)
    padded = torch.cat([logits, torch.full((6, 6), 1e4)], dim=-1)  # huge garbage in padding
    targets = torch.randint(0, 10, (6,))
    loss = vocab_parallel_cross_entropy(padded, targets, real_vocab=10, tp=TPGroup())
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets))
    loss.backward()
    reference = logits.detach().clone().requires_grad_()
    F.cross_entropy(reference, targets).backward()
    torch.testing.assert_close(logits.grad, reference.grad)


def test_init_is_independent_of_other_parameters():
    """A parameter's init depends only on (seed, key): a 2-layer and a 4-layer
    model share their first layers' weights."""
    small, big = GPT(ModelConfig(num_layers=2)), GPT(ModelConfig(num_layers=4))
    initialize(small, small.cfg, seed=7)
    initialize(big, big.cfg, seed=7)
    big_params = dict(big.named_parameters())
    for key, param in small.named_parameters():
        if not key.endswith("proj.weight"):  # residual init is scaled by depth
            torch.testing.assert_close(param, big_params[key], rtol=0, atol=0)


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_changes_memory_not_math(flavour, recompute):
    """Activation recomputation (with dropout on) gives the loss and grads of
    the plain model: dropout masks are redrawn identically on recompute."""
    from megaresil.config import Flavour, Recompute

    def loss_and_grads(mode: str):
        cfg = ModelConfig(flavour=Flavour(flavour), num_layers=2, hidden_size=64, num_heads=4,
                          num_kv_heads=2 if flavour == "llama" else None, vocab_size=300,
                          max_seq_len=16, dropout=0.1, attention_dropout=0.1,
                          recompute=Recompute(mode))
        model = GPT(cfg, seed=3)
        initialize(model, cfg, seed=3)
        tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(tokens, tokens, torch.tensor([5, 6]))
        loss.backward()
        return loss, {k: p.grad for k, p in model.named_parameters()}

    base_loss, base_grads = loss_and_grads("none")
    loss, grads = loss_and_grads(recompute)
    torch.testing.assert_close(loss, base_loss, rtol=0, atol=0)
    for key in base_grads:
        torch.testing.assert_close(grads[key], base_grads[key], rtol=1e-6, atol=1e-8, msg=key)
