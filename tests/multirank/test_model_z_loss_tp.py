"""The output z-loss under tensor parallelism: with the vocabulary split
over tp=2 (padding in the last slice), the cross-entropy, each token's
logsumexp (across both slices) and the gradients of cross-entropy plus
z-loss are those of the whole vocabulary on one rank, with targets left
out of the loss (data.eod_mask_loss) left out of the z-loss too."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaresil.model.losses import z_loss
from megaresil.parallel.tensor_parallel import (
    IGNORE_TARGET,
    TPGroup,
    cross_entropy_and_logsumexp,
    vocab_parallel_cross_entropy,
)
from megaresil.ports import free_port
from tests.harness.dist import join_group, spawn_ranks

WORLD, TOKENS, VOCAB, PADDED, COEFF = 2, 12, 30, 32, 0.5


def reference(logits: torch.Tensor, targets: torch.Tensor, coeff: float):
    """Loss, logsumexp and logits' grad on the whole vocabulary, one rank."""
    whole = logits[:, :VOCAB].clone().requires_grad_()
    loss = F.cross_entropy(whole, targets, ignore_index=IGNORE_TARGET)
    logsumexp = torch.logsumexp(whole, -1)[targets != IGNORE_TARGET]
    (loss + coeff * logsumexp.square().mean()).backward()
    return loss.detach(), logsumexp.detach(), whole.grad


def _worker(rank: int, port: int) -> None:
    join_group(rank, WORLD, port)
    try:
        g = torch.Generator().manual_seed(0)
        logits, every = torch.randn(TOKENS, PADDED, generator=g), torch.randint(0, VOCAB, (TOKENS,), generator=g)
        some = every.clone()
        some[[2, 7]] = IGNORE_TARGET
        tp = TPGroup(dist.group.WORLD, WORLD, rank)
        cut = slice(rank * PADDED // WORLD, (rank + 1) * PADDED // WORLD)
        for coeff, targets in ((COEFF, every), (0.0, every), (COEFF, some), (0.0, some)):
            local = logits[:, cut].clone().requires_grad_()
            if coeff:
                loss, logsumexp = cross_entropy_and_logsumexp(local, targets, real_vocab=VOCAB, tp=tp)
                (loss + coeff * z_loss(logsumexp)).backward()
            else:  # the path a run without z-loss takes
                loss = vocab_parallel_cross_entropy(local, targets, real_vocab=VOCAB, tp=tp)
                loss.backward()
            want_loss, want_logsumexp, want_grad = reference(logits, targets, coeff)
            torch.testing.assert_close(loss, want_loss)
            if coeff:
                torch.testing.assert_close(logsumexp, want_logsumexp)
            real = min(cut.stop, VOCAB) - cut.start
            torch.testing.assert_close(local.grad[:, :real], want_grad[:, cut.start:cut.start + real])
            assert torch.equal(local.grad[:, real:], torch.zeros_like(local.grad[:, real:]))
    finally:
        dist.destroy_process_group()


def test_z_loss_at_tp2_is_the_one_rank_z_loss():
    spawn_ranks(_worker, (free_port(),), WORLD)
