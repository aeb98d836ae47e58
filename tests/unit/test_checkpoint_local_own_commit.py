"""A local save returns once the rank's own shard is committed, replication
going on behind the loop; and the non-finite check a save runs on every
tensor."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint.local.shard import Shard
from megaresil.checkpoint.local.store import NodeStore
from megaresil.checkpoint.validation import all_finite, nonfinite_keys, shard_problem
from megaresil.checkpoint.sharded import Rect
from tests.unit.test_checkpoint_local_tier import FakeState, single_tier

# How long a gated write waits for the loop before it goes on by itself: a
# correct save call holds the loop for the whole write, so the gate never opens.
GATE_S = 2.0


class GatedStore(NodeStore):
    """A node directory whose shard writes wait for `gate` (at most GATE_S)
    and log when they are committed."""

    def __init__(self, root: Path, log: list):
        super().__init__(root)
        self.gate, self.log = threading.Event(), log

    def write(self, shard: Shard) -> None:
        self.gate.wait(GATE_S)
        super().write(shard)
        self.log.append(("committed", shard.step))


def test_a_save_returns_once_the_own_shard_is_committed_and_readable(tmp_path, monkeypatch):
    """Before, the loop was let go once the state was staged: a process
    killed in the next step lost the step still being written."""
    tier, _ = single_tier(tmp_path, monkeypatch)
    log: list = []
    tier.store = GatedStore(tier.store.root, log)
    state = FakeState()
    state.step = 6
    tier.save(state, 6)
    log.append(("next step", 7))
    # What a restart after a kill here reads: step 6, whole and checksummed.
    assert shard_problem(tier.store.read(6, 0)) is None
    tier.store.gate.set()
    tier.before_update()  # nothing left to wait for
    tier.wait()
    assert log == [("committed", 6), ("next step", 7)]


def test_replication_goes_on_behind_the_loop(tmp_path, monkeypatch):
    """The save call waits for the own shard only: a replication still in
    flight (a slow peer) holds the next save, not the next step."""
    tier, _ = single_tier(tmp_path, monkeypatch)
    log: list = []
    gate = threading.Event()

    def replicate(own: Shard) -> list:
        gate.wait(GATE_S)
        log.append(("replicated", own.step))
        return []
    monkeypatch.setattr(tier, "_replicate", replicate)
    state = FakeState()
    state.step = 6
    tier.save(state, 6)
    log.append(("next step", 7))
    gate.set()
    tier.wait()  # the next save's first act
    assert log == [("next step", 7), ("replicated", 6)]


def test_a_failed_own_write_still_lets_the_loop_go(tmp_path, monkeypatch):
    """A write that fails (a full /dev/shm) pauses the tier, never the run."""
    tier, _ = single_tier(tmp_path, monkeypatch)
    tier.store.full = True
    state = FakeState()
    state.step = 3
    tier.save(state, 3)
    tier.before_update()
    tier.wait()
    assert tier.pause is not None and tier.store.held() == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float64])
def test_the_finite_check_sees_any_nan_or_inf_and_is_not_fooled_by_an_overflowing_sum(dtype):
    big = torch.finfo(dtype).max
    assert all_finite(torch.full((1000,), big, dtype=dtype))  # its sum overflows
    assert all_finite(torch.empty(0, dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.ones(1000, dtype=dtype)
        t[517] = bad
        assert not all_finite(t)
    both = torch.zeros(8, dtype=dtype)
    both[0], both[1] = float("inf"), float("-inf")  # a sum of NaN, still refused
    assert not all_finite(both)


def test_nonfinite_keys_names_only_floating_rects_with_a_nan_or_inf():
    nan = torch.tensor([1.0, float("nan")])
    rects = [Rect("model/ok", (2,), (0,), torch.tensor([1.0, 2.0])),
             Rect("optim/bad", (2,), (0,), nan),
             Rect("data/int", (2,), (0,), torch.tensor([1, 2]))]
    assert nonfinite_keys(rects) == ["optim/bad"]
