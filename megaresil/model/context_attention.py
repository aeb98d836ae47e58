"""Causal attention over a sequence split across context-parallel ranks
(parallel/context_parallel.py: each rank holds a head and a tail chunk).

Each query chunk attends to the key chunks at or before it, block by block,
with an online softmax (outputs merged by their rows' logsumexps); the
backward recomputes each block's probabilities from the merged logsumexp
(FlashAttention's recurrence), so a layer keeps only the rank's own q, k,
v, output and logsumexp, whatever cp is. Written by hand: torch's
experimental `context_parallel` works on DTensors and CUDA's fused kernels
and takes no sliding window; this runs on any device and backend. How a
rank gets the other ranks' keys and values (parallel.cp_comm_type:
allgather, one all-gather per layer and a reduce-scatter of the grads; p2p,
a ring of cp-1 exchanges, the forward's overlapping compute), why allgather is the default
and the bytes each moves: docs/parallelism.md, "Context parallelism".
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megaresil import compat
from megaresil.config import ContextComm
from megaresil.model.masks import visible
from megaresil.parallel.context_parallel import CPGroup

# (k and v stacked: (2, B, G, chunk, D), the global chunk number)
KeyChunk = tuple[torch.Tensor, int]


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup,
                      window: Optional[int], scale: float,
                      documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of this rank's queries q (B, H, T/cp, D) over the
    whole sequence's keys, whose local part is k, v (B, G, T/cp, D), G
    dividing H (grouped-query attention); `window`: the sliding window;
    `documents` (B, T): each token of the whole window's document, a query
    seeing only keys of its own (document masking, model/masks.py)."""
    function = _RingAttention if cp.comm == ContextComm.p2p else _GatheredAttention
    with _no_autocast(q):
        out = function.apply(q.float(), k.float(), v.float(), cp,
                             _Mask(window, scale, documents))
    return out.to(q.dtype)


def _no_autocast(x: torch.Tensor) -> torch.autocast:
    return torch.autocast(x.device.type, enabled=False)


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v (..., G, T, D) repeated to `heads` heads, as SDPA's enable_gqa."""
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The grad of `_repeat`: (B, H, T, D) summed back to G heads."""
    B, H, T, D = grad.shape
    return grad if H == groups else grad.view(B, groups, H // groups, T, D).sum(dim=2)


class _Mask:
    """What decides which keys a query sees, besides causality: the
    window, the documents (B, T) or none; and the scores' scale."""

    def __init__(self, window: Optional[int], scale: float, documents: Optional[torch.Tensor]):
        self.window, self.scale, self.documents = window, scale, documents


class _Span:
    """The attention of one query chunk (global chunk `index`, `size`
    tokens) over key chunks, one block at a time."""

    def __init__(self, index: int, size: int, mask: _Mask):
        self.index, self.size = index, size
        self.window, self.scale, self.documents = mask.window, mask.scale, mask.documents

    def places(self, chunk: int, device: torch.device) -> torch.Tensor:
        return torch.arange(chunk * self.size, (chunk + 1) * self.size, device=device)

    def sees(self, chunk: int) -> bool:
        """Whether any query of this chunk sees a key of chunk `chunk`."""
        if chunk > self.index:
            return False
        if self.window is None:
            return True
        return (self.index - chunk - 1) * self.size + 1 < self.window

    def seen(self, chunk: int, device: torch.device) -> torch.Tensor:
        """(Q, K), or (B, 1, Q, K) under document masking."""
        queries, keys = self.places(self.index, device), self.places(chunk, device)
        if self.documents is None:
            return visible(queries, keys, self.window)
        return visible(queries, keys, self.window, query_documents=self.documents[:, queries],
                       key_documents=self.documents[:, keys]).unsqueeze(1)

    def fused(self, q: torch.Tensor) -> bool:
        """Whether torch's CPU flash kernel computes the blocks: on the CPU,
        where every block is whole or causal (no window, no documents)."""
        return q.device.type == "cpu" and self.window is None and self.documents is None

    def scores(self, q: torch.Tensor, k: torch.Tensor, chunk: int) -> torch.Tensor:
        s = (q @ _repeat(k, q.shape[1]).transpose(-2, -1)) * self.scale
        return s.masked_fill(~self.seen(chunk, q.device), float("-inf"))

    def forward(self, q: torch.Tensor, kv: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, logsumexp) of the queries over one key chunk's keys."""
        if self.fused(q):
            return compat.cpu_flash_attention(q, _repeat(kv[0], q.shape[1]),
                                              _repeat(kv[1], q.shape[1]),
                                              causal=chunk == self.index, scale=self.scale)
        s = self.scores(q, kv[0], chunk)
        lse = torch.logsumexp(s, dim=-1)
        probs = torch.exp(s - _finite(lse).unsqueeze(-1))
        return probs @ _repeat(kv[1], q.shape[1]), lse

    def backward(self, q: torch.Tensor, kv: torch.Tensor, chunk: int, dout: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dq, dkv) of one block, from the rows' merged output and logsumexp."""
        heads, groups = q.shape[1], kv.shape[2]
        if self.fused(q):
            dq, dk, dv = compat.cpu_flash_attention_grads(
                dout, q, _repeat(kv[0], heads), _repeat(kv[1], heads), out, lse,
                causal=chunk == self.index, scale=self.scale)
            return dq, torch.stack([_fold(dk, groups), _fold(dv, groups)])
        delta = (dout * out).sum(dim=-1)
        probs = torch.exp(self.scores(q, kv[0], chunk) - _finite(lse).unsqueeze(-1))
        dv = probs.transpose(-2, -1) @ dout
        dscores = probs * (dout @ _repeat(kv[1], heads).transpose(-2, -1) - delta.unsqueeze(-1))
        dq = (dscores @ _repeat(kv[0], heads)) * self.scale
        dk = (dscores.transpose(-2, -1) @ q) * self.scale
        return dq, torch.stack([_fold(dk, groups), _fold(dv, groups)])


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The logsumexp with rows that see nothing (-inf) at 0, so their
    probabilities come out 0 rather than NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _merge(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same rows as one (online softmax)."""
    if out is None or lse is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    base = _finite(merged)
    return (out * torch.exp(lse - base).unsqueeze(-1)
            + block_out * torch.exp(block_lse - base).unsqueeze(-1)), merged


def _spans(cp: CPGroup, local_len: int, mask: _Mask) -> list[_Span]:
    return [_Span(index, local_len // 2, mask) for index in cp.chunk_ids()]


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head, tail = x.chunk(2, dim=-2)
    return head, tail


def _forward(q: torch.Tensor, spans: list[_Span],
             chunks: Iterator[KeyChunk]) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and logsumexp of the local queries over the key chunks as
    `chunks` yields them (each chunk's k and v, its global number)."""
    outs: list[Optional[torch.Tensor]] = [None, None]
    lses: list[Optional[torch.Tensor]] = [None, None]
    queries = _halves(q)
    for kv, chunk in chunks:
        for i, span in enumerate(spans):
            if span.sees(chunk):
                outs[i], lses[i] = _merge(outs[i], lses[i], *span.forward(queries[i], kv, chunk))
    assert all(o is not None for o in outs), "every chunk sees itself"
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)  # type: ignore[arg-type]


def _key_grads(q: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
               spans: list[_Span], kv: torch.Tensor, chunk: int,
               dq: list[torch.Tensor]) -> torch.Tensor:
    """One key chunk's (dk, dv) from every local query chunk that sees it;
    the queries' grads added into `dq` (per query chunk)."""
    dkv = torch.zeros_like(kv)
    parts = zip(_halves(q), _halves(dout), _halves(out), lse.chunk(2, dim=-1))
    for i, (span, (q_i, dout_i, out_i, lse_i)) in enumerate(zip(spans, parts)):
        if span.sees(chunk):
            dq_block, dkv_block = span.backward(q_i, kv, chunk, dout_i, out_i, lse_i)
            dq[i] += dq_block
            dkv += dkv_block
    return dkv


# Both functions compute in fp32, autocast off: the logsumexps and the
# merged outputs are sums over the whole sequence, which bf16 would round
# at every merge (FlashAttention keeps them in fp32 too).


def _attend_and_keep(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup,
                     mask: _Mask, chunks: Callable[[torch.Tensor, CPGroup], Iterator[KeyChunk]]
                     ) -> torch.Tensor:
    """Both functions' forward: the output over the key chunks as
    `chunks` brings them, keeping what the backward recomputes from."""
    spans = _spans(cp, q.shape[-2], mask)
    out, lse = _forward(q, spans, chunks(torch.stack([k, v]), cp))
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.cp, ctx.spans = cp, spans
    return out


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup,
                mask: _Mask) -> torch.Tensor:
        return _attend_and_keep(ctx, q, k, v, cp, mask, _gathered_chunks)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cp: CPGroup = ctx.cp
        dq = [torch.zeros_like(half) for half in _halves(q)]
        with _no_autocast(q):  # a pipeline schedule runs backward inside the forward's autocast
            grads = {chunk: _key_grads(q, out, dout.float(), lse, ctx.spans, kv, chunk, dq)
                     for kv, chunk in _gathered_chunks(torch.stack([k, v]), cp)}
        # Each rank's two chunks' grads, in rank order, summed on their owner.
        sends = [torch.cat([grads[c] for c in cp.chunk_ids(rank)], dim=-2).contiguous()
                 for rank in range(cp.size)]
        dkv = torch.empty_like(sends[0])
        dist.reduce_scatter(dkv, sends, group=cp.group)
        return torch.cat(dq, dim=-2), dkv[0], dkv[1], None, None


def _gathered_chunks(kv: torch.Tensor, cp: CPGroup) -> Iterator[KeyChunk]:
    """Every rank's k and v, chunk by chunk in sequence order."""
    ranks = [torch.empty_like(kv) for _ in range(cp.size)]
    dist.all_gather(ranks, kv.contiguous(), group=cp.group)
    for chunk in range(2 * cp.size):
        rank, half = cp.owner(chunk)
        yield _halves(ranks[rank])[half], chunk


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup,
                mask: _Mask) -> torch.Tensor:
        return _attend_and_keep(ctx, q, k, v, cp, mask, _ring_chunks)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cp: CPGroup = ctx.cp
        dq = [torch.zeros_like(half) for half in _halves(q)]
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)
        # The block held at step s is rank (r - s)'s; its grads travel with
        # it, so after the last step's hop they are home.
        for step in range(cp.size):
            if step > 0:
                kv, dkv = _pass_on(torch.stack([kv, dkv]), cp)
            owner = (cp.rank - step) % cp.size
            with _no_autocast(q):
                blocks = [_key_grads(q, out, dout.float(), lse, ctx.spans, half, chunk, dq)
                          for half, chunk in zip(_halves(kv), cp.chunk_ids(owner))]
            dkv = dkv + torch.cat(blocks, dim=-2)
        (dkv,) = _pass_on(dkv.unsqueeze(0), cp)
        return torch.cat(dq, dim=-2), dkv[0], dkv[1], None, None


def _ring_chunks(kv: torch.Tensor, cp: CPGroup) -> Iterator[KeyChunk]:
    """The k and v blocks as they come round the ring, this rank's first,
    the next block's exchange started before this one's compute."""
    for step in range(cp.size):
        pending = _start_pass(kv, cp) if step < cp.size - 1 else None
        owner = (cp.rank - step) % cp.size
        for half, chunk in zip(_halves(kv), cp.chunk_ids(owner)):
            yield half, chunk
        if pending is not None:
            kv = _finish_pass(*pending)


def _start_pass(x: torch.Tensor, cp: CPGroup) -> tuple[torch.Tensor, list]:
    """Send `x` to the next rank of the ring and receive the previous one's."""
    received = torch.empty_like(x)
    assert cp.group is not None, "an active CPGroup has its process group"
    nxt = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size)
    prev = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size)
    ops = [dist.P2POp(dist.isend, x.contiguous(), nxt, cp.group),
           dist.P2POp(dist.irecv, received, prev, cp.group)]
    return received, dist.batch_isend_irecv(ops)


def _finish_pass(received: torch.Tensor, requests: list) -> torch.Tensor:
    for request in requests:
        request.wait()
    return received


def _pass_on(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    return _finish_pass(*_start_pass(x, cp))
