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
