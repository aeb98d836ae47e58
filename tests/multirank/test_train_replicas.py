"""Silent data corruption at dp=3 on gloo: a bit flipped in one replica's
parameter or gradient is found by the replica checksum, the odd one out is
named and restored from a healthy replica, and the run goes on bit-equal to
the fault-free run; a gradient flip under the distributed optimizer reaches
every replica alike, which the checksum cannot see (docs/numerics.md)."""
from __future__ import annotations

import pytest

from tests.harness.faulted import events, losses, run_cases

DP3 = ["parallel.dp=3", "train.global_batch_size=6"]
ZERO1 = DP3 + ["optimizer.distributed=true"]
PARAM_AT_4 = 'faults=[{kind: bitflip, rank: 2, step: 4, bit: 21, seed: 3}]'
GRAD_AT_6 = 'faults=[{kind: bitflip, rank: 1, step: 6, bit: 22, target: grad}]'
CASES = {
    "reference": DP3,
    "param": DP3 + [PARAM_AT_4],
    "grad": DP3 + [GRAD_AT_6],
    "reference_zero1": ZERO1,
    "param_zero1": ZERO1 + [PARAM_AT_4],
    "grad_zero1": ZERO1 + [GRAD_AT_6],
    "unchecked": DP3 + [PARAM_AT_4, "resilience.numerics.check_interval=0"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_cases(CASES, 3, tmp_path_factory.mktemp("replicas"))




@pytest.mark.parametrize("case, rank, step", [("param", 2, 4), ("grad", 1, 6),
                                              ("param_zero1", 2, 4)])
def test_the_odd_replica_is_named_and_restored(runs, case, rank, step):
    run = runs / case
    flipped, = events(run, "fault_injected")
    assert flipped["rank"] == rank and flipped["bit"] in (21, 22), flipped
    detected, = events(run, "silent_corruption_detected")
    assert detected["step"] == step and detected["culprit"] == [rank], detected
    assert detected["how"] == "majority" and detected["tensors"], detected
    if case == "grad":  # its grad norm, so its clipping and every update differed
        assert detected["differing_tensors"] > 8 and len(detected["tensors"]) == 8, detected
    assert not events(run, "rolled_back")  # no replay: restored in place
    reference = "reference_zero1" if case.endswith("zero1") else "reference"
    assert losses(run) == losses(runs / reference)
    assert not events(runs / reference, "silent_corruption_detected")


def test_a_flip_reaching_every_replica_alike_is_beyond_the_checksum(runs):
    """Under the distributed optimizer a rank's grad rows update the weights
    every replica gathers: the replicas stay equal, the run differs."""
    run = runs / "grad_zero1"
    assert events(run, "fault_injected") and not events(run, "silent_corruption_detected")
    assert losses(run)[10] != losses(runs / "reference_zero1")[10]


def test_unchecked_a_flip_stays(runs):
    run = runs / "unchecked"
    assert not events(run, "silent_corruption_detected")
    assert losses(run)[10] != losses(runs / "reference")[10]
