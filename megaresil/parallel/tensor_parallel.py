"""Megatron-style tensor-parallel layers over an explicit `TPGroup`.

Every layer takes its group at construction; with tp=1 the collectives are
skipped and the layers are plain Linear/Embedding, so one model code path
serves every layout.

Activations are (B, T, C). With sequence parallelism the tensors between TP
regions are sharded along T (dim 1): an all-gather enters a column-parallel
region and a reduce-scatter leaves a row-parallel one, in place of Megatron's
identity / all-reduce pair.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megaresil.parallel.sharding import AxisShard, ShardSpec, set_spec

SEQ_DIM = 1
# A target the loss leaves out (torch's cross-entropy default, so the tp=1
# path needs nothing more): data.eod_mask_loss marks them (model/masks.py).
IGNORE_TARGET = -100


def has_values(x: torch.Tensor) -> bool:
    """Whether a collective on `x` has anything to exchange. A meta tensor
    (the memory estimate's shapes-only forward) has none, and every
    collective here writes into buffers the caller already shaped, so
    skipping it leaves the shapes of the real run."""
    return not x.is_meta


@dataclass(frozen=True)
class TPGroup:
    group: Optional[dist.ProcessGroup] = None
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False

    @property
    def active(self) -> bool:
        return self.size > 1


# --- collectives along the sequence dimension -----------------------------


def _all_gather_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    shards = [torch.empty_like(x) for _ in range(tp.size)]
    if has_values(x):
        dist.all_gather(shards, x.contiguous(), group=tp.group)
    return torch.cat(shards, dim=SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    chunks = [c.contiguous() for c in x.chunk(tp.size, dim=SEQ_DIM)]
    out = torch.empty_like(chunks[0])
    if has_values(x):
        dist.reduce_scatter(out, chunks, group=tp.group)
    return out


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    x = x.clone()
    if has_values(x):
        dist.all_reduce(x, group=tp.group)
    return x


def seq_shard(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x.chunk(tp.size, dim=SEQ_DIM)[tp.rank].contiguous()


def swap_batch_and_sequence(x: torch.Tensor) -> torch.Tensor:
    """(B, T, C) <-> (T, B, C), a view. Rank r's sequence shard (B, T/tp, C)
    becomes rank r's dim-0 shard of the (T, B, C) tensor: the shard Megatron's
    and Transformer Engine's sequence parallelism expect."""
    return x.transpose(0, 1)


# --- autograd regions -------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the input grad (the input fed all ranks)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce of partial sums forward; identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeqRegion(torch.autograd.Function):
    """All-gather along T forward; reduce-scatter of the grad backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.tp), None


class _ReduceScatterSeqRegion(torch.autograd.Function):
    """Reduce-scatter along T forward; all-gather of the grad backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.tp), None


class _GatherVocabRegion(torch.autograd.Function):
    """All-gather of the last dim forward (full logits); slice backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        shards = [torch.empty_like(x) for _ in range(tp.size)]
        if has_values(x):
            dist.all_gather(shards, x.contiguous(), group=tp.group)
        return torch.cat(shards, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


def enter_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Make the full input of a column-parallel layer available on every rank."""
    if not tp.active:
        return x
    if tp.sequence_parallel:
        return _GatherSeqRegion.apply(x, tp)
    return _CopyToRegion.apply(x, tp)


def leave_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum the partial outputs of a row-parallel layer (sequence-sharded under SP)."""
    if not tp.active:
        return x
    if tp.sequence_parallel:
        return _ReduceScatterSeqRegion.apply(x, tp)
    return _ReduceFromRegion.apply(x, tp)


def gather_vocab(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _GatherVocabRegion.apply(x, tp) if tp.active else x


# --- layers -----------------------------------------------------------------


def mark_sharded(param: nn.Parameter, dim: int, tp: TPGroup) -> nn.Parameter:
    """Record which dim this rank's slice was cut from (init and checkpoint use it)."""
    set_spec(param, ShardSpec(shards=(AxisShard(dim, "tp", tp.size, tp.rank),)))
    return param


def mark_replicated(params: Iterable[nn.Parameter], tp: TPGroup) -> None:
    """Params every TP rank holds whole. Under SP they see only this rank's
    sequence shard: their grads must be summed over the TP group (the grad
    sync does it)."""
    for param in params:
        set_spec(param, ShardSpec(grad_sum_axes=("tp",) if tp.sequence_parallel else ()))


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tp={parts}")
    return total // parts


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (output features) split over the TP group."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, *, bias: bool,
                 enter_region: bool = True):
        super().__init__()
        self.tp, self.enter_region = tp, enter_region
        local = _divide(out_features, tp.size, "output features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(local, in_features)), 0, tp)
        self.bias = mark_sharded(nn.Parameter(torch.zeros(local)), 0, tp) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = enter_tp_region(x, self.tp)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (input features) split; the input is
    already split (the output of a column-parallel layer)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, *, bias: bool):
        super().__init__()
        self.tp = tp
        local = _divide(in_features, tp.size, "input features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, local)), 1, tp)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.bias is not None:
            mark_replicated([self.bias], tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_tp_region(F.linear(x, self.weight), self.tp)
        # Bias after the reduction, so it is added once, not tp times.
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are split; out-of-range ids give zeros
    locally and the all-reduce (reduce-scatter under SP) fills them in."""

    def __init__(self, padded_vocab: int, dim: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.local_vocab = _divide(padded_vocab, tp.size, "padded vocabulary")
        self.start = tp.rank * self.local_vocab
        self.weight = mark_sharded(nn.Parameter(torch.empty(self.local_vocab, dim)), 0, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        if not self.tp.active:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.start + self.local_vocab)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        x = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp_region(x, self.tp)


# --- vocab-parallel cross-entropy --------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy and logsumexp of the logits (the z-loss reads
    it) from logits split along the vocabulary, without gathering the
    full-vocabulary logits on any rank (Megatron's algorithm)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, tp, overwrite):  # logits (N, V/tp), targets (N,)
        ctx.set_materialize_grads(False)  # an unused logsumexp adds nothing to the backward
        logits = logits.float()
        max_logit = logits.max(dim=-1).values
        if has_values(logits):
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = (logits.sub_(max_logit.unsqueeze(-1)) if overwrite
                   else logits - max_logit.unsqueeze(-1))
        local_targets = targets - vocab_start
        inside = (local_targets >= 0) & (local_targets < logits.shape[-1])
        local_targets = local_targets.masked_fill(~inside, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        target_logit = shifted[rows, local_targets].masked_fill(~inside, 0.0)
        # exp, then softmax, in the buffer of `shifted`: no second (N, V/tp) tensor.
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if has_values(logits):
            dist.all_reduce(target_logit, group=tp.group)
            dist.all_reduce(sum_exp, group=tp.group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_targets, inside)
        log_sum_exp = sum_exp.log()
        return log_sum_exp - target_logit, log_sum_exp + max_logit

    @staticmethod
    def backward(ctx, grad, grad_logsumexp):  # each (N,), or None when unused
        softmax, local_targets, inside = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        grad_logits = softmax  # the saved softmax becomes the grad, in place
        onehot = inside.to(softmax.dtype)
        if grad is None:
            grad = torch.zeros_like(onehot)
        if grad_logsumexp is None:
            grad_logits[rows, local_targets] -= onehot
            return grad_logits.mul_(grad.unsqueeze(-1)), None, None, None, None
        # d logsumexp / d logits is the softmax: (softmax - onehot) * grad + softmax * grad_lse.
        grad_logits.mul_((grad + grad_logsumexp).unsqueeze(-1))
        grad_logits[rows, local_targets] -= onehot * grad
        return grad_logits, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                                 real_vocab: int, tp: TPGroup,
                                 overwrite_logits: bool = False) -> torch.Tensor:
    """Mean loss over tokens, in fp32 whatever the logits' dtype; a target of
    IGNORE_TARGET counts in neither the sum nor the number of tokens. Padded
    vocabulary columns (global index >= real_vocab) never enter the softmax.

    `overwrite_logits`: the logits are the caller's temporary, read by nothing
    after this call and saved by no backward (a linear's output): the softmax
    is built in their buffer, as Megatron does, instead of a new (N, V/tp)
    tensor (64 MiB per micro-batch at bench/train_throughput.py's `small`,
    ~35 ms of page faults each). Were they saved for a backward after all,
    autograd's version check fails that backward rather than using them.

    At tp=1 the whole vocabulary is here and `F.cross_entropy` does the same
    sum faster (fused log-softmax, no saved softmax copy) than Megatron's
    split algorithm, which only pays off when the vocabulary is split."""
    if not tp.active:
        return F.cross_entropy(logits[..., :real_vocab].flatten(0, -2).float(), targets.flatten())
    losses, _ = _split_vocab_losses(logits, targets, real_vocab, tp, overwrite_logits)
    return _kept_mean(losses, targets)


def cross_entropy_and_logsumexp(logits: torch.Tensor, targets: torch.Tensor, *,
                                real_vocab: int, tp: TPGroup, overwrite_logits: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`vocab_parallel_cross_entropy`'s mean loss and the logsumexp of the
    logits over the whole (real) vocabulary of each token the loss counts
    (those whose target is not IGNORE_TARGET), fp32, from the same softmax:
    the z-loss's input, at no second pass over the logits."""
    if tp.active:
        losses, logsumexp = _split_vocab_losses(logits, targets, real_vocab, tp, overwrite_logits)
    else:
        logits = logits[..., :real_vocab].flatten(0, -2).float()  # (N, V)
        logsumexp = torch.logsumexp(logits, dim=-1)
        # An ignored target (negative) reads column 0; its loss is left out below.
        picked = targets.flatten().clamp(min=0).unsqueeze(-1)
        losses = logsumexp - logits.gather(-1, picked).squeeze(-1)
    return _kept_mean(losses, targets), logsumexp[targets.flatten() != IGNORE_TARGET]


def _split_vocab_losses(logits: torch.Tensor, targets: torch.Tensor, real_vocab: int,
                        tp: TPGroup, overwrite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's loss and logsumexp, (N,) each, from this rank's
    vocabulary slice, the padded columns masked out."""
    local_vocab = logits.shape[-1]
    start = tp.rank * local_vocab
    pad_from = max(0, real_vocab - start)
    if pad_from < local_vocab:
        logits = logits.clone()
        logits[..., pad_from:] = float("-inf")
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), start, tp,
                                            overwrite)


def _kept_mean(losses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean of the per-token `losses` (N,) over the targets not IGNORE_TARGET."""
    kept = targets.flatten() != IGNORE_TARGET
    return losses.masked_fill(~kept, 0.0).sum() / kept.sum()
