"""A loss spike's rollback also skips the batches of the steps just before
the spike (resilience.numerics.spike_skip_window): which batches those are is
part of the training state, so live replacement carries it and checkpoints
save it. Through `megaresil train`, against the same run without the fault."""
from __future__ import annotations

import json

import pytest

from megaresil.checkpoint.offline.diff import diff_checkpoints
from megaresil.events import read_events, read_metrics
from tests.harness.cli import SMALL

# SMALL's global batch is 8 samples: step k trains on samples 8(k-1)..8k-1.
SPIKE_AT_8 = {"kind": "spike", "rank": 0, "step": 8}
ROLLBACK = [*SMALL, "train.steps=10", "logging.progress=false", "optimizer.warmup_steps=1",
            "resilience.numerics.on_spike=rollback", "resilience.numerics.spike_window=5",
            "resilience.numerics.spike_skip_window=3"]
LIVE = ["resilience.in_process=true", "resilience.replacement.enabled=true"]


def skipped(run_dir) -> list[list[int]]:
    return [e["samples"] for e in read_events(run_dir) if e["event"] == "samples_skipped"]


def final_losses(run_dir) -> dict[int, float]:
    """step -> loss, the last line of each step winning (a rollback's replay)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def assert_same_end(run_dir, reference) -> None:
    assert final_losses(run_dir) == final_losses(reference)
    last = "checkpoints/step_0000010"
    assert diff_checkpoints(reference / last, run_dir / last).identical


@pytest.mark.slow
def test_a_replacement_just_before_a_spike_skips_what_the_run_without_it_skips(cli, tmp_path):
    """Rank 1 is killed as step 7 begins and takes step 6's state from rank
    0's memory; step 8 spikes and the run rolls back to step 4's checkpoint,
    skipping the batches of steps 6, 7 and 8, as the run without the kill
    does (before: 7 and 8 only, the replacement had forgotten step 6's batch,
    and the run ended exit 0 on other weights)."""
    reference, faulted = tmp_path / "reference", tmp_path / "faulted"
    common = [*ROLLBACK, *LIVE, "checkpoint.interval=4"]
    cli("train", *common, f"run.dir={reference}", f"faults={json.dumps([SPIKE_AT_8])}")
    kill = {"kind": "kill", "rank": 1, "step": 7}
    cli("train", *common, f"run.dir={faulted}", f"faults={json.dumps([kill, SPIKE_AT_8])}")
    events = read_events(faulted)
    assert [e["kind"] for e in events if e["event"] == "restart"] == ["replace"]
    assert [(e["tier"], e["step"]) for e in events if e["event"] == "checkpoint_loaded"] == [
        ("live", 6), ("global", 4)]  # the replacement, then the spike's rollback
    assert skipped(reference) == skipped(faulted) == [[40, 48], [48, 56], [56, 64]]
    assert_same_end(faulted, reference)


@pytest.mark.slow
def test_a_resume_between_the_window_and_the_spike_skips_what_the_run_without_it_skips(
        cli, tmp_path):
    """Stopped after step 7 (saved there), resumed: step 8 spikes and the
    run rolls back to step 7's checkpoint, as the uninterrupted run does.
    The batches of steps 6 and 7 are in that checkpoint's weights: neither
    run skips them, only step 8's."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    common = [*ROLLBACK, "checkpoint.interval=7", f"faults={json.dumps([SPIKE_AT_8])}"]
    cli("train", *common, f"run.dir={reference}")
    cli("train", *common, f"run.dir={resumed}", "train.exit_at_step=7")
    cli("train", *common, f"run.dir={resumed}")
    assert skipped(reference) == skipped(resumed) == [[56, 64]]
    assert_same_end(resumed, reference)
