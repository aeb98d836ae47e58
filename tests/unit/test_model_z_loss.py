"""The z-loss (model/losses.py) on the output logits: its formula by hand,
the gradient it adds without changing the reported loss, train.z_loss=0
leaving the loss untouched, its record and the metrics figure of a step."""
import math

import torch
import torch.nn.functional as F

from megaresil.config import ModelConfig
from megaresil.model.gpt import GPT
from megaresil.model.init import initialize
from megaresil.model.losses import z_loss
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.tensor_parallel import (IGNORE_TARGET, TPGroup,
                                                cross_entropy_and_logsumexp)
from megaresil.train.z_loss_figure import ZLossFigure

CFG = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, vocab_size=50, max_seq_len=8)


def test_z_loss_is_the_mean_square_of_each_tokens_logsumexp():
    logits = [[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]]
    by_hand = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 2
    logsumexp = torch.logsumexp(torch.tensor(logits, dtype=torch.bfloat16), dim=-1)
    assert z_loss(logsumexp).dtype == torch.float32
    assert math.isclose(z_loss(torch.logsumexp(torch.tensor(logits), -1)).item(), by_hand,
                        rel_tol=1e-6)


def test_the_cross_entropy_and_its_logsumexp_at_tp1():
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    padded = torch.cat([logits, torch.full((6, 4), 1e4)], dim=-1)  # padding never counts
    targets = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(1))
    loss, logsumexp = cross_entropy_and_logsumexp(padded, targets, real_vocab=16, tp=TPGroup())
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets))
    torch.testing.assert_close(logsumexp, torch.logsumexp(logits, -1))


def test_ignored_targets_count_in_neither_the_loss_nor_the_z_loss():
    """data.eod_mask_loss's IGNORE_TARGET leaves a token out of both means."""
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(1))
    targets[[1, 4]] = IGNORE_TARGET
    kept = targets != IGNORE_TARGET
    loss, logsumexp = cross_entropy_and_logsumexp(logits, targets, real_vocab=16, tp=TPGroup())
    torch.testing.assert_close(loss, F.cross_entropy(logits[kept], targets[kept]))
    torch.testing.assert_close(logsumexp, torch.logsumexp(logits[kept], -1))


def model(z: float) -> GPT:
    gpt = GPT(CFG, seed=1, z_loss=z)
    initialize(gpt, CFG, seed=1)
    return gpt


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)


def grads(gpt: GPT) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in gpt.named_parameters()}


def test_the_z_loss_adds_its_gradient_not_its_value():
    """The loss the step reports stays the cross-entropy; the gradient is
    that of cross-entropy + coefficient * z-loss, computed by hand from
    the full logits."""
    tokens, targets = batch()
    on = model(0.5)
    loss = on(tokens, targets, torch.tensor([0, 1]))
    loss.backward()

    reference = model(0.0)
    logits = reference.logits(tokens).flatten(0, 1).float()  # (N, V), padding cut
    plain = F.cross_entropy(logits, targets.flatten())
    (plain + 0.5 * torch.logsumexp(logits, -1).square().mean()).backward()
    torch.testing.assert_close(loss, plain)
    for key, grad in grads(reference).items():
        torch.testing.assert_close(grads(on)[key], grad, rtol=1e-5, atol=1e-7, msg=key)
    record = on.output_z_loss
    assert record.calls == 1 and math.isclose(
        record.total.item(), torch.logsumexp(logits, -1).square().mean().item(), rel_tol=1e-6)


def test_z_loss_zero_is_the_plain_cross_entropy_bit_for_bit():
    tokens, targets = batch()
    off, plain = model(0.0), model(0.0)
    loss = off(tokens, targets, torch.tensor([0, 1]))
    loss.backward()
    expected = plain.loss(plain.stage_forward(tokens, torch.tensor([0, 1])), targets)
    expected.backward()
    assert torch.equal(loss, expected) and off.output_z_loss.calls == 0
    assert all(torch.equal(g, grads(plain)[k]) for k, g in grads(off).items())


def test_eval_reports_and_records_the_cross_entropy_alone():
    tokens, targets = batch()
    gpt = model(0.5).eval()
    with torch.no_grad():
        gpt(tokens, targets)
    assert gpt.output_z_loss.calls == 0


def test_the_steps_figure_is_the_mean_over_micro_batches_before_the_coefficient():
    layout = ParallelLayout(device=torch.device("cpu"))
    gpt = model(0.5)
    figure = ZLossFigure.of(layout, [gpt], 0.5)
    tokens, targets = batch()
    figure.begin_step()
    values = []
    for _ in range(2):
        gpt(tokens, targets, torch.tensor([0, 1]))
        values.append(gpt.output_z_loss.total.item() - sum(values))
    figure.reduce()
    assert math.isclose(figure.fields()["z_loss"], sum(values) / 2, rel_tol=1e-12)
    off = ZLossFigure.of(layout, [model(0.0)], 0.0)
    off.reduce()
    assert off.fields() == {}
