"""Non-finite steps at dp=2 on gloo: a NaN injected into one rank's grads is
replayed and training goes on bit-equal to the fault-free run; a persistent
one rolls back to the newest checkpoint and skips its batch, bit-equal to a
run that skipped the same batch from the start; a non-finite state is never
saved and retention keeps the newest finite checkpoint."""
from __future__ import annotations

import pytest

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.validation import read_manifest
from megaresil.events import read_metrics

from tests.harness.dist import MOE
from tests.harness.faulted import events, losses, run_cases

DP2 = ["parallel.dp=2"]
ZERO1 = DP2 + ["optimizer.distributed=true"]
SAVES = ["checkpoint.interval=2"]
G = 8  # TINY's global batch
NAN_AT_5 = 'faults=[{kind: nan, rank: 1, step: 5}]'
PERSISTENT_AT_6 = 'faults=[{kind: nan, rank: 1, step: 6, persistent: true}]'
SPIKE = ["resilience.numerics.spike_window=5"]
SPIKE_AT_9 = 'faults=[{kind: spike, rank: 1, step: 9}]'
STATE_SPIKE_AT_9 = 'faults=[{kind: spike, rank: 1, step: 9, steps: 1}]'
LEVEL_SHIFT_AT_9 = 'faults=[{kind: spike, rank: 1, step: 9, steps: 8, scale: 3}]'
LONGER = ["train.steps=16"]
CASES = {
    "reference": DP2,
    "transient": DP2 + [NAN_AT_5],
    "reference_zero1": ZERO1,
    "transient_zero1": ZERO1 + [NAN_AT_5],
    "reference_pp2": ["parallel.pp=2"],  # the loss on the last stage (rank 1) only
    "transient_pp2": ["parallel.pp=2", NAN_AT_5],
    "persistent": DP2 + SAVES + [PERSISTENT_AT_6],
    # The batch of step 6 (samples 40..47) skipped from the start.
    "skipped_from_start": DP2 + SAVES + ["resilience.numerics.skip_batches=[[40, 8]]"],
    "unchecked": DP2 + SAVES + ["checkpoint.keep=1", "resilience.numerics.enabled=false",
                                'faults=[{kind: nan, rank: 0, step: 3}]'],
    "exhausted": DP2 + SAVES + ["resilience.numerics.max_rollbacks=0", PERSISTENT_AT_6],
    # Loss spikes: rank 1's loss x10 at step 9, against a window of 5 steps.
    "spike_rollback": DP2 + SAVES + SPIKE + ["resilience.numerics.on_spike=rollback", SPIKE_AT_9],
    "spike_skip": DP2 + SPIKE + ["resilience.numerics.on_spike=skip", SPIKE_AT_9],
    "spike_warn": DP2 + SPIKE + [SPIKE_AT_9],
    # A spike on a rank that does not contribute its replica's loss: TP rank
    # 1, and a pipeline stage without the loss.
    "spike_warn_tp2": ["parallel.tp=2"] + SPIKE + [SPIKE_AT_9],
    "spike_warn_pp2": ["parallel.pp=2"] + SPIKE + ['faults=[{kind: spike, rank: 0, step: 9}]'],
    # The batch of step 9 (samples 64..71) skipped from the start; checked, no spike.
    "spike_skipped_from_start": DP2 + SPIKE + ["resilience.numerics.on_spike=rollback",
                                               "resilience.numerics.skip_batches=[[64, 8]]"],
    # Replicas that differ at dp=2: no majority, found by a replay from step 4.
    "bitflip_param": DP2 + SAVES + ['faults=[{kind: bitflip, rank: 1, step: 5, bit: 20}]'],
    "bitflip_grad": DP2 + SAVES + ['faults=[{kind: bitflip, rank: 0, step: 7, bit: 22, '
                                   'target: grad}]'],
    # Checked every 2 steps: the weight flipped after step 5's update is used
    # by step 6's forward pass before the check finds it.
    "bitflip_param_interval2": DP2 + SAVES + ["resilience.numerics.check_interval=2",
                                              'faults=[{kind: bitflip, rank: 1, step: 5, '
                                              'bit: 20}]'],
    # Spikes the state causes: rank 1's loss x10 on every attempt of step 9,
    # whatever the batch; x3 from step 9 to the end (a new level).
    "state_spike_skip": DP2 + SPIKE + ["resilience.numerics.on_spike=skip", STATE_SPIKE_AT_9],
    "state_spike_rollback": DP2 + SAVES + SPIKE + ["resilience.numerics.on_spike=rollback",
                                                   STATE_SPIKE_AT_9],
    "level_shift_warn": DP2 + SPIKE + LONGER + [LEVEL_SHIFT_AT_9],
    "level_shift_rollback": DP2 + SAVES + SPIKE + LONGER + [
        "resilience.numerics.on_spike=rollback", LEVEL_SHIFT_AT_9],
    "reference_longer": DP2 + LONGER,
    "spike_skipped_from_start_longer": DP2 + SPIKE + LONGER + [
        "resilience.numerics.on_spike=rollback", "resilience.numerics.skip_batches=[[64, 8]]"],
    # A NaN in rank 1's routing scores (its first layer with experts) at step 5.
    "reference_moe": DP2 + MOE,
    "router_nan": DP2 + MOE + ['faults=[{kind: router_nan, rank: 1, step: 5}]'],
    # A genuine divergence: after step 1 (lr 1e29) the weights overflow every
    # forward pass, on every rank and batch.
    "divergence": DP2 + ["checkpoint.interval=1", "optimizer.lr=1e30",
                         "optimizer.warmup_steps=10", "resilience.numerics.max_rollbacks=1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_cases(CASES, 2, tmp_path_factory.mktemp("numerics"))




@pytest.mark.parametrize("variant", ["", "_zero1", "_pp2"])
def test_a_transient_nan_is_replayed_bit_equal(runs, variant):
    run, reference = runs / f"transient{variant}", runs / f"reference{variant}"
    assert losses(run) == losses(reference) and sorted(losses(run)) == list(range(1, 11))
    detected, = events(run, "nonfinite_detected")
    assert detected["step"] == 5 and detected["ranks"] == [1], detected
    assert detected["what"] == "grad_norm" and detected["samples"] == [32, 40], detected
    replayed, = events(run, "step_replayed")
    assert replayed["outcome"] == "transient" and replayed["differed_ranks"] == [1], replayed
    assert not events(run, "rolled_back") and not events(reference, "nonfinite_detected")


def test_a_nan_in_routing_scores_is_caught_with_its_layer_named_and_replayed(runs):
    run, reference = runs / "router_nan", runs / "reference_moe"
    injected, = events(run, "fault_injected")
    assert injected["rank"] == 1 and injected["layer"] == "layers.1.mlp.router", injected
    # Every rank's grads took the NaN in their data-parallel mean: the
    # router says where it began.
    detected, = events(run, "nonfinite_detected")
    assert detected["step"] == 5 and detected["routers"] == [[1, "layers.1.mlp.router"]], detected
    assert detected["what"].startswith("routing scores, loss"), detected
    replayed, = events(run, "step_replayed")
    assert replayed["outcome"] == "transient", replayed
    assert losses(run) == losses(reference) and not events(reference, "nonfinite_detected")


def test_a_persistent_nan_rolls_back_and_skips_its_batch(runs):
    run = runs / "persistent"
    replayed, = events(run, "step_replayed")
    assert replayed["outcome"] == "persistent" and replayed["differed_ranks"] == [], replayed
    rolled, = events(run, "rolled_back")
    assert (rolled["step"], rolled["to_step"], rolled["rollback"]) == (6, 4, 1)
    skipped, = events(run, "samples_skipped")
    assert skipped["samples"] == [40, 48]
    # Bit-equal, from the rollback on, to a run that skipped that batch from the start.
    expected = losses(runs / "skipped_from_start")
    assert losses(run) == expected and sorted(expected) == list(range(1, 11))
    # The skip is in every later checkpoint's run record, so a resume repeats it.
    manifest = read_manifest(run / "checkpoints" / "step_0000010")
    assert manifest["skipped_batches"] == [[40, 8]]
    assert manifest["data"]["consumed_samples"] == 11 * G
    # The steps trained again after the rollback say so in metrics.jsonl.
    again = [r["step"] for r in read_metrics(run) if r.get("rollback") == 1]
    assert again == list(range(5, 11)), again


def test_rollbacks_run_out_with_one_line(runs):
    run = runs / "exhausted"
    for rank in (0, 1):
        line = (run / f"stopped.{rank}").read_text()
        assert "step 6" in line and "max_rollbacks=0" in line and "\n" not in line
    assert max(losses(run)) == 5 and not events(run, "rolled_back")


def test_a_nonfinite_state_is_never_saved(runs):
    """Unchecked (numerics off), a NaN reaches the weights at step 3: every
    later save is refused, and with checkpoint.keep=1 the step-2 checkpoint,
    the newest finite one, stays and stays `latest`."""
    run = runs / "unchecked"
    assert math_nan(losses(run)[4][0])
    refused = events(run, "checkpoint_refused")
    assert [e["step"] for e in refused] == [4, 6, 8, 10]
    assert "non-finite" in refused[0]["reason"] and "\n" not in refused[0]["reason"]
    root = run / "checkpoints"
    assert [p.name for p in fmt.committed_checkpoints(root)] == ["step_0000002"]
    assert (root / "latest").read_text().strip() == "step_0000002"
    assert not list(root.glob("*partial*"))


def math_nan(value: float) -> bool:
    return value != value


def test_a_loss_spike_rolls_back_and_skips_its_batch(runs):
    run = runs / "spike_rollback"
    spike, = events(run, "loss_spike")
    assert spike["step"] == 9 and spike["policy"] == "rollback" and spike["samples"] == [64, 72]
    assert spike["deviations"] > 6 and spike["loss"] > 5 * spike["median"], spike
    rolled, = events(run, "rolled_back")
    assert (rolled["step"], rolled["to_step"], rolled["reason"]) == (9, 8, "loss_spike")
    assert [e["samples"] for e in events(run, "samples_skipped")] == [[64, 72]]
    expected = losses(runs / "spike_skipped_from_start")
    assert losses(run) == expected and sorted(expected) == list(range(1, 11))
    assert read_manifest(run / "checkpoints" / "step_0000010")["skipped_batches"] == [[64, 8]]
    # No false alarm in the checked reference.
    assert not events(runs / "spike_skipped_from_start", "loss_spike")


def test_a_loss_spike_skipped_or_warned_of(runs):
    skipped = runs / "spike_skip"
    assert events(skipped, "loss_spike")[0]["policy"] == "skip"
    assert not events(skipped, "rolled_back")
    assert losses(skipped) == losses(runs / "spike_skipped_from_start")
    warned = runs / "spike_warn"
    spike, = events(warned, "loss_spike")
    assert spike["policy"] == "warn" and "applied" in spike["next"]
    # Only rank 1's loss as seen was scaled (the mean of the two: 5.5x), and
    # no gradient: every other step is the reference's.
    reference, seen = losses(runs / "reference"), losses(warned)
    assert 4 * reference[9][0] < seen[9][0] < 7 * reference[9][0]
    assert {s: v for s, v in seen.items() if s != 9} == {
        s: v for s, v in reference.items() if s != 9}


@pytest.mark.parametrize("case, reference", [("spike_warn_tp2", "reference"),
                                             ("spike_warn_pp2", "reference_pp2")])
def test_a_spike_on_any_rank_of_the_replica_is_seen(runs, case, reference):
    """Only TP rank 0 of the last stage hands its replica's loss to the
    checks; a spike fault on another rank scales that replica's loss all
    the same, so the drill tests the detector, not the fault's placement."""
    spike, = events(runs / case, "loss_spike")
    assert spike["step"] == 9
    seen, plain = losses(runs / case)[9][0], losses(runs / reference)[9][0]
    assert seen == pytest.approx(10 * plain, rel=1e-4)


@pytest.mark.parametrize("case, rank, step", [("bitflip_param", 1, 5), ("bitflip_grad", 0, 7)])
def test_replicas_that_differ_at_dp2_are_found_by_a_replay(runs, case, rank, step):
    run = runs / case
    flipped, = events(run, "fault_injected")
    assert flipped["rank"] == rank and flipped["before"] != flipped["after"], flipped
    detected, = events(run, "silent_corruption_detected")
    assert detected["step"] == step and detected["culprit"] is None
    rolled, = events(run, "rolled_back")
    assert rolled["reason"] == "silent_corruption" and rolled["to_step"] == step - step % 2
    attributed, = events(run, "silent_corruption_attributed")
    assert attributed["step"] == step and attributed["culprit"] == [rank], attributed
    assert losses(run) == losses(runs / "reference")  # the replay is the fault-free run
    assert not events(runs / "reference", "silent_corruption_detected")


def test_a_flip_used_before_the_check_is_not_blamed_on_the_healthy_replica(runs):
    """Checked every 2 steps, rank 1's flipped weight feeds step 6's forward
    pass before the check: its gradients reach rank 0's update too, so on
    replay both replicas' states change. The replay cannot tell which was
    corrupted and says so; it blames neither (draining rank 0's healthy
    node would be the wrong cure). The rollback restored both all the same."""
    run = runs / "bitflip_param_interval2"
    detected, = events(run, "silent_corruption_detected")
    assert detected["step"] == 6 and detected["culprit"] is None, detected
    attributed, = events(run, "silent_corruption_attributed")
    assert attributed["culprit"] == [] and attributed["unresolved"] == [[0, 1]], attributed
    assert "check_interval=2" in attributed["why"] and "check_interval=1" in attributed["why"]
    assert losses(run) == losses(runs / "reference")


def test_a_spike_that_comes_back_with_another_batch_is_applied(runs):
    """Skipped, the spike comes back at step 9 with the next batch: the state
    causes it, not a batch, so its update is applied (no second skip): the
    run ends as one that skipped the first batch from the start."""
    run = runs / "state_spike_skip"
    spikes = events(run, "loss_spike")
    assert [(e["step"], e["state_caused"]) for e in spikes] == [(9, False), (9, True)], spikes
    assert "the state" in spikes[1]["next"] and "applied" in spikes[1]["next"]
    assert [e["samples"] for e in events(run, "samples_skipped")] == [[64, 72]]
    assert_equal_but_the_spikes(run, runs / "spike_skipped_from_start", spiked={9})


def test_a_spike_the_state_causes_spends_one_rollback_not_all(runs):
    run = runs / "state_spike_rollback"
    rolled, = events(run, "rolled_back")
    assert (rolled["step"], rolled["to_step"], rolled["reason"]) == (9, 8, "loss_spike")
    assert [e["state_caused"] for e in events(run, "loss_spike")] == [False, True]
    assert not list(run.glob("stopped.*"))  # before: three rollbacks, then stopped
    assert_equal_but_the_spikes(run, runs / "spike_skipped_from_start", spiked={9})
    manifest = read_manifest(run / "checkpoints" / "step_0000010")
    assert manifest["skipped_batches"] == [[64, 8]] and "spike_skipped_at_step" not in manifest


def test_a_new_loss_level_is_taken_as_one(runs):
    """The loss x2 (one replica's x3) from step 9 on: five spikes in a row
    are a level shift; the window starts again from them, and the new level
    raises no alarm after it. The state moved, not a batch: under rollback
    one rollback is spent (the first spike's), then the spikes are applied."""
    warned = runs / "level_shift_warn"
    assert [e["step"] for e in events(warned, "loss_spike")] == [9, 10, 11, 12, 13]
    shift, = events(warned, "loss_level_shift")
    assert shift["step"] == 13 and shift["steps"] == 5, shift
    assert 1.8 * shift["median"] < shift["new_median"] < 2.2 * shift["median"], shift
    assert_equal_but_the_spikes(warned, runs / "reference_longer", spiked=set(range(9, 17)))
    rolled_back = runs / "level_shift_rollback"
    assert len(events(rolled_back, "rolled_back")) == 1
    assert [e["step"] for e in events(rolled_back, "loss_spike")] == [9, 9, 10, 11, 12, 13]
    assert [e["step"] for e in events(rolled_back, "loss_level_shift")] == [13]
    assert_equal_but_the_spikes(rolled_back, runs / "spike_skipped_from_start_longer",
                                spiked=set(range(9, 17)))


def assert_equal_but_the_spikes(run, reference, spiked: set[int]) -> None:
    """Bit-equal to `reference` at every step, but for the losses a spike
    fault scaled as the checks see them (it leaves the gradients alone)."""
    seen, expected = losses(run), losses(reference)
    assert seen.keys() == expected.keys()
    assert {s: v for s, v in seen.items() if s not in spiked} == {
        s: v for s, v in expected.items() if s not in spiked}
    assert all(seen[s][1] == expected[s][1] for s in spiked)  # the grad norms: untouched


def test_a_divergence_on_every_rank_and_batch_points_at_the_learning_rate(runs):
    """Not one bad batch or rank: every rank's loss is non-finite, and the
    batch the rollback skipped changed nothing."""
    run = runs / "divergence"
    assert len(events(run, "rolled_back")) == 1
    for rank in (0, 1):
        line = (run / f"stopped.{rank}").read_text()
        assert "diverges" in line and "optimizer.lr" in line and "\n" not in line
        assert "bad data or rank" not in line
    # One rank's persistent NaN is still that rank's or its batch's.
    assert "bad data or rank" in (runs / "exhausted" / "stopped.0").read_text()
