"""Resilience under context parallelism, through `megaresil chaos`: at cp=2,
dp=1 the two ranks hold one sequence's halves and the same model and
optimizer state (dense parameters replicated over dp and cp), so the cp
peer is what a data-parallel peer is at cp=1: the donor of a lost rank's
state, and the other replica the replica check compares."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.cli import SMALL, megaresil_cli
from megaresil.events import read_events, read_metrics

# SMALL's job with its two ranks as cp peers: each rank holds 16 of a
# sequence's 32 tokens (two chunks of 8, zig-zag).
CP2 = [*SMALL, "parallel.dp=1", "parallel.cp=2", "data.seq_len=32"]


@pytest.fixture(scope="module")
def cp_reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("cp-reference")
    megaresil_cli("train", *CP2, "checkpoint.interval=2", f"run.dir={run_dir}",
                  "logging.progress=false", timeout=300)
    return run_dir


def chaos(cli_main, root: Path, reference: Path, scenario: str) -> tuple[dict, list[dict]]:
    cli_main("chaos", *CP2, f"run.dir={root}", "--scenario", scenario,
             "--reference", str(reference), "--timeout", "240")
    report = json.loads((root / f"chaos-{scenario}.json").read_text())
    assert report["recovered"] and report["final_loss_equal"], report
    return report, read_events(report["faulted"])


def step_losses(run_dir) -> dict[int, float]:
    """Each step's loss, the last time it was trained (a replay's)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def saved_tensors(run_dir, step: int = 8) -> dict[str, list[tuple]]:
    """Every tensor shard of the checkpoint of `step`, by the checksum of
    its bytes: equal tables, bit-equal model and optimizer state."""
    manifest = json.loads((Path(run_dir) / "checkpoints" / f"step_{step:07d}" /
                           "metadata.json").read_text())
    return {key: [(s["offset"], s["shape"], s["checksum"]) for s in entry["shards"]]
            for key, entry in manifest["tensors"].items()}


def assert_bit_equal(report: dict, reference: Path) -> None:
    assert step_losses(report["faulted"]) == step_losses(reference)
    faulted, expected = saved_tensors(report["faulted"]), saved_tensors(reference)
    assert faulted == expected, sorted(k for k in expected if faulted.get(k) != expected[k])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["kill-rank-replace", "kill-rank"])
def test_a_lost_cp_rank_recovers_bit_equal(cli_main, tmp_path, cp_reference, scenario):
    """Rank 1 killed (SIGKILL) as step 5 begins. kill-rank-replace: its
    replacement takes step 4's state from rank 0's memory, its cp peer (no
    dp peer exists), and rank 0 keeps its process; kill-rank: every worker
    is relaunched and loads step 4's checkpoint at cp=2. Either way no step
    is trained twice and the run ends bit-equal to the fault-free one."""
    report, events = chaos(cli_main, tmp_path, cp_reference, scenario)
    assert report["steps_lost"] == 0, report
    loads = [(e["tier"], e["step"], e.get("from_peers")) for e in events
             if e["event"] == "checkpoint_loaded"]
    assert [r["step"] for r in read_metrics(report["faulted"]) if "loss" in r] == \
        list(range(1, 9))
    if scenario == "kill-rank-replace":
        assert report["restart_kind"] == "replace" and report["relaunches"] == 0, report
        assert loads == [("live", 4, {"1": 0})], loads
        assert len({e["process_started"] for e in events
                    if e["event"] == "generation_started"}) == 1  # rank 0 kept its process
    else:
        assert report["restart_kind"] == "relaunch", report
        assert [(tier, step) for tier, step, _ in loads] == [("global", 4)], loads
    assert_bit_equal(report, cp_reference)


@pytest.mark.slow
def test_a_bit_flip_in_a_cp_ranks_weights_is_found_and_attributed(cli_main, tmp_path,
                                                                  cp_reference):
    """A bit flipped in rank 1's weights at step 5: the cp peers' checksums
    differ; two replicas have no majority, so the check rolls back to step
    4's checkpoint and replays step 5, which names rank 1; the run ends
    bit-equal to the fault-free one, no process restarted."""
    report, events = chaos(cli_main, tmp_path, cp_reference, "bitflip-param")
    assert report["restart_kind"] == "none", report
    attributed = [e for e in events if e["event"] == "silent_corruption_attributed"]
    assert [e["culprit"] for e in attributed] == [[1]], attributed
    rolled = [e["reason"] for e in events if e["event"] == "rolled_back"]
    assert len(rolled) == 1, rolled
    assert_bit_equal(report, cp_reference)
