"""A run's memory per rank before launch: the arithmetic over what one rank
holds (`RankMemory`, counted from the trainer's own modules by
train/memory_census.py) and how the pipeline schedule multiplies a
micro-batch's activations. See docs/clusters.md ("Memory before launch").

A rank's peak is its state (parameters, gradient buffers, optimizer
moments, fp32 main copies) plus the activations of the micro-batches its
schedule holds at once, plus the largest transient of one forward (the
logits and their loss on the last stage). Device memory is compared with
that peak over `HEADROOM`: the CUDA context and the caching allocator's
fragmentation take the rest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from megaresil.config import PipelineSchedule

# The share of a device's memory a run's estimated peak may use: the CUDA
# context (~0.5 GiB) and the caching allocator's fragmentation (a few percent
# of a long run's reserved memory) take the rest.
HEADROOM = 0.90

PARTS = ("params", "grads", "optimizer", "main", "activations")


@dataclass(frozen=True)
class RankMemory:
    """Bytes one kind of rank holds: `ranks` are the global ranks alike."""

    ranks: tuple[int, ...]
    stage: int  # pipeline rank
    params: int
    grads: int  # the fp32 gradient buffers
    optimizer: int  # Adam's two moments, this rank's share under ZeRO-1
    main: int  # fp32 main copies of bf16 weights (their ZeRO-1 rows where sharded)
    activation_per_microbatch: int  # kept for backward by one micro-batch, all chunks
    in_flight: float  # micro-batches whose activations the schedule holds at once
    transient: int  # the largest forward's working memory beyond what it keeps

    @property
    def activations(self) -> int:
        return round(self.activation_per_microbatch * self.in_flight)

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.main + self.activations + \
            self.transient


def in_flight_microbatches(schedule: PipelineSchedule, *, pp: int, vpp: int, stage: int,
                           microbatches: int) -> float:
    """Micro-batches (whole: every chunk of the stage) whose activations a
    pipeline rank holds at its peak. 1F1B: pp - stage (its warm-up forwards
    and the one in the steady state); interleaved: its warm-up chunk
    forwards, (vpp - 1) pp + 2 (pp - 1 - stage), plus one, as vpp chunks
    make one micro-batch; GPipe: all of them. Never more than the step's."""
    if pp == 1:
        return 1
    if schedule == PipelineSchedule.gpipe:
        return microbatches
    if vpp == 1 or schedule == PipelineSchedule.one_f_one_b:
        return min(microbatches, pp - stage)
    chunk_forwards = (vpp - 1) * pp + 2 * (pp - 1 - stage) + 1
    return min(microbatches * vpp, chunk_forwards) / vpp


def mib(n: float) -> str:
    """Bytes as MiB under a GiB, else GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_memory(ranks: list[RankMemory], layout: str,
                  device_bytes: Optional[int] = None) -> str:
    """One row per kind of rank: each part and the peak."""
    head = ["ranks", "stage", *PARTS, "peak"]
    rows = [[rank_span(r.ranks), str(r.stage), *(mib(getattr(r, p)) for p in PARTS[:-1]),
             f"{mib(r.activations)} ({r.in_flight:g} mb)", mib(r.peak)] for r in ranks]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = [f"memory per rank, {layout}:"]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [head, *rows]]
    lines.append(f"  (peak adds {mib(max(r.transient for r in ranks))} at most of one "
                 "forward's working memory; activations: kept for backward × micro-batches "
                 "in flight)")
    if device_bytes:
        worst = max(r.peak for r in ranks)
        lines.append(f"  device: {mib(device_bytes)}, usable {mib(usable(device_bytes))} "
                     f"({HEADROOM:.0%}); the peak {mib(worst)} "
                     f"{'fits' if worst <= usable(device_bytes) else 'does not fit'}")
    return "\n".join(lines)


def usable(device_bytes: int) -> int:
    return int(device_bytes * HEADROOM)


def rank_span(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks[:4])) + (",…" if len(ranks) > 4 else "")


def memory_json(ranks: list[RankMemory], layout: str,
                device_bytes: Optional[int] = None) -> dict:
    """The estimate for tools: every field in bytes, per kind of rank, and
    the device's memory (None where unknown)."""
    return {"layout": layout, "headroom": HEADROOM, "device_bytes": device_bytes,
            "ranks": [asdict(r) | {"activations": r.activations, "peak": r.peak}
                      for r in ranks],
            "peak": max(r.peak for r in ranks)}
