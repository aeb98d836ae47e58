"""Live replacement's state handling (train/handover.py): a peer's state lands
straight in the receiver's own tensors and is checked there; a survivor's
next generation adopts the tensors it carried instead of copying them; a
shard's records are matched to a rank's tensors before anything moves; a
carried state's sum is the replica check's, and a rollback forgets what
the replicas agreed on."""
from __future__ import annotations

import contextlib
import pickle
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint import transfer
from megaresil.checkpoint.collectives import Collectives, own_group
from megaresil.checkpoint.local.shard import matched, rect_records
from megaresil.checkpoint.sharded import Rect
from megaresil.config import load_recipe
from megaresil.ports import free_port
from megaresil.train import handover
from megaresil.train.handover import Carried
from megaresil.train.progress import Progress
from megaresil.train.replicas import Agreement, ReplicaCheck, quick_checksum
from megaresil.train.state import LiveTrainingState

from tests.harness.cli import ROOT
from tests.harness.dist import spawn_ranks


def holder_rects() -> list[Rect]:
    gen = torch.Generator().manual_seed(3)
    return [Rect("model/w", (4, 3), (0, 0), torch.randn(4, 3, generator=gen)),
            Rect("model/b", (5,), (0,), torch.randn(5, generator=gen).to(torch.bfloat16)),
            Rect("optim/exp_avg/w", (3, 4), (0, 0), torch.randn(3, 4, generator=gen))]


def receiver_rects() -> list[Rect]:
    """The same tensors, fresh; the last one a transposed (non-contiguous) view."""
    return [Rect("model/w", (4, 3), (0, 0), torch.zeros(4, 3)),
            Rect("model/b", (5,), (0,), torch.zeros(5, dtype=torch.bfloat16)),
            Rect("optim/exp_avg/w", (3, 4), (0, 0), torch.zeros(4, 3).t())]


def carried(rects: list[Rect]) -> Carried:
    records, _ = rect_records(rects)
    meta = {"step": 6, "owner": 0, "world": 2, "rects": records}
    return Carried(meta, [r.tensor.contiguous() for r in rects])


def _move(rank: int, port: int, out: str, damage: bool) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", rank=rank, world_size=2, store=store,
                            timeout=timedelta(seconds=60))  # a move that hangs fails
    if damage and rank == 0:  # the second tensor's (model/b's) checksum wrong on the wire
        honest = transfer.checksum_bytes
        transfer.checksum_bytes = lambda tensors: torch.cat(
            [honest(tensors[:1]), honest([-tensors[1]]), honest(tensors[2:])])
    owner = ThreadPoolExecutor(1, initializer=own_group,
                               initargs=(dist.group.WORLD, torch.device("cpu")))
    coll = Collectives(dist.group.WORLD, owner)
    targets = receiver_rects()
    places = [t.tensor.data_ptr() for t in targets]
    try:
        meta = handover.move_state(coll, [(0, 1)], carried(holder_rects()) if rank == 0 else None,
                                   targets if rank == 1 else [])
        result = {"meta": meta, "tensors": [t.tensor for t in targets],
                  "in_place": [t.tensor.data_ptr() == p for t, p in zip(targets, places)]}
    except fmt.CheckpointError as err:
        result = {"error": str(err)}
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    owner.shutdown()
    dist.destroy_process_group()


def moved(tmp_path: Path, damage: bool) -> dict:
    spawn_ranks(_move, (free_port(), str(tmp_path), damage), 2)
    return pickle.loads((tmp_path / "rank1.pkl").read_bytes())


def test_a_peers_state_lands_in_the_receivers_own_tensors_bit_for_bit(tmp_path):
    got = moved(tmp_path, damage=False)
    for sent, arrived in zip(holder_rects(), got["tensors"]):
        assert torch.equal(sent.tensor, arrived), sent.key
    assert got["in_place"] == [True, True, True]  # the transposed target through a landing
    assert got["meta"]["step"] == 6 and [r["key"] for r in got["meta"]["rects"]] == [
        r.key for r in holder_rects()]


def test_a_state_damaged_on_the_wire_is_refused_naming_the_tensor(tmp_path):
    got = moved(tmp_path, damage=True)
    assert "arrived from rank 0 damaged: checksum mismatch in model/b" in got["error"]


def test_records_are_matched_to_this_ranks_tensors_or_refused_naming_them():
    meta = carried(holder_rects()).meta
    pairs = matched(meta, receiver_rects())
    assert [(rec["key"], t.key) for rec, t in pairs] == [(r.key,) * 2 for r in holder_rects()]
    stranger = [*receiver_rects()[:2], Rect("model/v", (3, 4), (0, 0), torch.zeros(3, 4))]
    with pytest.raises(fmt.CheckpointError, match="model/v"):
        matched(meta, stranger)
    other_dtype = [receiver_rects()[0], Rect("model/b", (5,), (0,), torch.zeros(5)),
                   receiver_rects()[2]]
    with pytest.raises(fmt.CheckpointError, match="model/b"):
        matched(meta, other_dtype)
    twice = {**meta, "rects": [*meta["rects"], meta["rects"][0]]}
    with pytest.raises(fmt.CheckpointError, match="model/w"):
        matched(twice, receiver_rects())


def test_a_survivor_adopts_the_tensors_it_carried_where_they_fit():
    w, b = nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([w, b], fused=True)
    state = LiveTrainingState(load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", []), None,
                              [("w", w), ("b", b)], optimizer, Progress())
    kept = {"model/w": torch.randn(4, 3), "optim/exp_avg/w": torch.randn(4, 3),
            "optim/exp_avg_sq/w": torch.rand(4, 3),
            "model/b": torch.randn(5)}  # not b's shape: b is loaded as ever
    state.adopt(kept)
    assert w.data_ptr() == kept["model/w"].data_ptr() and isinstance(w, nn.Parameter)
    assert optimizer.state[w]["exp_avg"] is kept["optim/exp_avg/w"]
    assert optimizer.state[w]["exp_avg_sq"] is kept["optim/exp_avg_sq/w"]
    assert not b.any() and not optimizer.state[b]  # its zero state comes with the load


def test_a_receiver_takes_blank_moments_and_a_parameter_outside_the_optimizer_none():
    w, frozen = nn.Parameter(torch.ones(4, 3)), nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([w], fused=True)
    state = LiveTrainingState(load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", []), None,
                              [("w", w), ("frozen", frozen)], optimizer, Progress())
    blank = handover.blank_moments(state)
    assert sorted(blank) == ["optim/exp_avg/frozen", "optim/exp_avg/w",
                             "optim/exp_avg_sq/frozen", "optim/exp_avg_sq/w"]
    state.adopt(blank)
    assert optimizer.state[w]["exp_avg"] is blank["optim/exp_avg/w"] and w.all()
    assert frozen not in optimizer.state


def test_a_carried_state_is_summed_as_the_replica_check_sums_what_it_would_send():
    """The sum a donor proves itself with is taken of its host copy; the
    check takes it of the trainer's tensors (views among them)."""
    rects = holder_rects()
    rects[0] = Rect("model/w", (4, 3), (0, 0), torch.randn(5, 3)[1:])  # a view off its start
    state = carried(rects)
    cpu = torch.device("cpu")
    assert int(quick_checksum([r.tensor for r in rects], cpu)) == \
        int(quick_checksum(state.tensors, cpu))


def test_a_rollback_forgets_what_the_replicas_agreed_on():
    """A replay may reach an agreed step with another state (a rollback that
    skipped batches): the agreement must not vouch for it, nor blame it."""
    layout = SimpleNamespace(mesh=None, dp=2, rank=0, device=torch.device("cpu"),
                             replica_groups=lambda: [[0]])
    rolled = []
    check = ReplicaCheck(1, layout, lambda full: [], None, lambda s, why: rolled.append(s),
                         lambda name, step: contextlib.nullcontext(),
                         donated=lambda: [], agreement=Agreement(4, 7))
    check.compare = lambda step, full: None  # the replicas differ, no majority
    assert check.check(5, True) and rolled == [5]
    assert check.agreement is None
