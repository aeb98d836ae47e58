"""Resilience under sharded data parallelism (parallel.dp_shard, FSDP2),
through `megaresil chaos`. HSDP at dp=4, dp_shard=2: ranks (0, 1) and
(2, 3) each shard the model, and rank r's dp_replicate peer r ± 2 holds the
same shard, so it is the donor of a lost rank's state and the other replica
the replica check compares (each DTensor's local shard). Full sharding at
dp=2, dp_shard=2: each rank holds the only copy of its shard; a lost rank
resumes from the checkpoints (the local tier's first, where it is on) and no
replica check runs. Each run ends bit-equal to its fault-free reference: its
losses and every checkpoint tensor's checksums (test_resilience_context's
helpers)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaresil.events import read_events, read_metrics
from tests.e2e.test_resilience_context import assert_bit_equal
from tests.harness.cli import SMALL, megaresil_cli

# SMALL's job on four ranks: two replicas of a model sharded over two, the
# global batch of 8 a micro-batch of 2 on each.
HSDP = [*SMALL, "parallel.dp=4", "parallel.dp_shard=2", "train.micro_batch_size=2"]
FULL = [*SMALL, "parallel.dp_shard=2"]  # SMALL's two ranks, each one shard


def reference(tmp_path_factory, name: str, job: list[str]) -> Path:
    run_dir = tmp_path_factory.mktemp(name)
    megaresil_cli("train", *job, "checkpoint.interval=2", f"run.dir={run_dir}",
                  "logging.progress=false", timeout=300)
    return run_dir


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory) -> Path:
    return reference(tmp_path_factory, "hsdp-reference", HSDP)


@pytest.fixture(scope="module")
def full_reference(tmp_path_factory) -> Path:
    return reference(tmp_path_factory, "full-shard-reference", FULL)


def chaos(cli_main, job: list[str], root: Path, reference: Path,
          scenario: str) -> tuple[dict, list[dict], str]:
    """The drill's report, its faulted run's events, and what it printed."""
    result = cli_main("chaos", *job, f"run.dir={root}", "--scenario", scenario,
                      "--reference", str(reference), "--timeout", "240")
    report = json.loads((root / f"chaos-{scenario}.json").read_text())
    assert report["recovered"] and report["final_loss_equal"], report
    assert report["exit_code"] == 0, report
    return report, read_events(report["faulted"]), result.stdout + result.stderr


def loads(events: list[dict]) -> list[tuple]:
    return [(e["tier"], e["step"], e.get("from_peers")) for e in events
            if e["event"] == "checkpoint_loaded"]


def trained_steps(report: dict) -> list[int]:
    return [r["step"] for r in read_metrics(report["faulted"]) if "loss" in r]


@pytest.mark.slow
def test_a_killed_hsdp_rank_relaunches_from_the_checkpoint_bit_equal(cli_main, tmp_path,
                                                                    hsdp_reference):
    """Rank 3 killed (SIGKILL) as step 5 begins: every worker is relaunched
    and loads step 4's sharded checkpoint; the run ends bit-equal."""
    report, events, _ = chaos(cli_main, HSDP, tmp_path, hsdp_reference, "kill-rank")
    assert report["restart_kind"] == "relaunch" and report["steps_lost"] == 0, report
    assert [(tier, step) for tier, step, _ in loads(events)] == [("global", 4)]
    assert trained_steps(report) == list(range(1, 9))
    assert_bit_equal(report, hsdp_reference)


@pytest.mark.slow
def test_a_lost_hsdp_rank_takes_its_shard_from_its_replica(cli_main, tmp_path, hsdp_reference):
    """kill-rank-replace under HSDP: rank 3's replacement takes step 4's
    shard (weights and moments) from rank 1's memory, its dp_replicate peer
    (config.no_live_copy finds that copy: no warning), the others keep their
    processes; no step is trained twice and the run ends bit-equal."""
    report, events, said = chaos(cli_main, HSDP, tmp_path, hsdp_reference, "kill-rank-replace")
    assert "warning: resilience.replacement.enabled" not in said
    assert report["restart_kind"] == "replace" and report["relaunches"] == 0, report
    assert report["steps_lost"] == 0, report
    assert loads(events) == [("live", 4, {"3": 1})], loads(events)
    assert trained_steps(report) == list(range(1, 9))
    assert_bit_equal(report, hsdp_reference)


@pytest.mark.slow
def test_a_corrupted_hsdp_donor_donates_nothing(cli_main, tmp_path, hsdp_reference):
    """corrupt-donor-replace under HSDP: rank 3's shard flipped at step 5
    after the check, its replica rank 1 lost at step 6 before the next: rank
    3 cannot prove its shard against the replicas' last agreement (taken over
    local shards), so it donates nothing and the job resumes from step 4's
    checkpoint, which restores both; bit-equal."""
    report, events, _ = chaos(cli_main, HSDP, tmp_path, hsdp_reference, "corrupt-donor-replace")
    assert report["restart_kind"] == "replace", report
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [(e["tier"], e["step"]) for e in loaded] == [("global", 4)], loaded
    assert "rank 3's copy cannot be proven" in loaded[0]["skipped"]["live"], loaded
    assert_bit_equal(report, hsdp_reference)

@pytest.mark.slow
def test_a_bit_flip_in_an_hsdp_shard_is_found_and_attributed(cli_main, tmp_path,
                                                            hsdp_reference):
    """A bit flipped in rank 3's local shard at step 5: the replica check
    compares each shard with its dp_replicate peer's (rank 1's); two replicas
    have no majority, so the run rolls back to step 4's checkpoint and the
    replay names rank 3; bit-equal, no process restarted."""
    report, events, _ = chaos(cli_main, HSDP, tmp_path, hsdp_reference, "bitflip-param")
    assert report["restart_kind"] == "none", report
    flipped = [e for e in events if e["event"] == "fault_injected"]
    assert [e["rank"] for e in flipped] == [3], flipped
    detected = [e for e in events if e["event"] == "silent_corruption_detected"]
    assert [e["replicas"] for e in detected] == [[[1, 3]]], detected
    attributed = [e for e in events if e["event"] == "silent_corruption_attributed"]
    assert [e["culprit"] for e in attributed] == [[3]], attributed
    assert_bit_equal(report, hsdp_reference)


@pytest.mark.slow
def test_a_lost_fully_sharded_rank_resumes_from_the_checkpoint(cli_main, tmp_path,
                                                             full_reference):
    """kill-rank-replace at full sharding: no peer holds rank 1's shard, so
    its replacement joins and the job resumes from step 4's checkpoint, and
    says why in the shards' own words; no step lost (the fault strikes right
    after the save), bit-equal. No replica check runs: no replicas (the
    bit-flip drills refuse this layout: test_drills_chaos_peers)."""
    report, events, said = chaos(cli_main, FULL, tmp_path, full_reference, "kill-rank-replace")
    assert "dp_shard = dp = 2 each rank holds the only copy" in said  # the warning, up front
    assert report["restart_kind"] == "replace" and report["steps_lost"] == 0, report
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [(e["tier"], e["step"]) for e in loaded] == [("global", 4)], loaded
    assert "dp_shard = dp = 2" in loaded[0]["skipped"]["live"], loaded
    assert not [e for e in events if e["event"].startswith("silent_corruption")]
    assert_bit_equal(report, full_reference)


@pytest.mark.slow
def test_a_lost_fully_sharded_rank_takes_its_shard_from_the_local_tier(cli_main, tmp_path,
                                                                     full_reference):
    """kill-rank-replace at full sharding with the node-local tier on (a
    save every step, each rank's shard copied to the other simulated node):
    no live rank holds rank 1's shard, so the job resumes from the local
    tier's step 4, says why, and ends bit-equal with no step lost."""
    local = ["checkpoint.local.enabled=true", "checkpoint.local.interval=1",
             "checkpoint.local.replicas=1", "checkpoint.local.ranks_per_node=1"]
    report, events, said = chaos(cli_main, [*FULL, *local], tmp_path, full_reference,
                                 "kill-rank-replace")
    assert "(the local tier, then the global)" in said  # the warning, up front
    assert report["restart_kind"] == "replace" and report["steps_lost"] == 0, report
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [(e["tier"], e["step"]) for e in loaded] == [("local", 4)], loaded
    assert "each rank holds the only copy" in loaded[0]["skipped"]["live"], loaded
    assert_bit_equal(report, full_reference)



@pytest.mark.slow
def test_an_outvoted_hsdp_shard_is_restored_from_a_healthy_replica(cli_main, tmp_path):
    """At dp=6, dp_shard=2 each shard has three replicas: rank 5's flipped
    one is outvoted and gets the differing tensor's local shard broadcast
    from rank 1 in place, no rollback; bit-equal to the drill's own
    fault-free run (six ranks on this machine's cores: ~100 s for both)."""
    job = [*HSDP, "parallel.dp=6", "train.global_batch_size=12"]
    cli_main("chaos", *job, f"run.dir={tmp_path}", "--scenario", "bitflip-param",
             "--timeout", "300")
    report = json.loads((tmp_path / "chaos-bitflip-param.json").read_text())
    assert report["recovered"] and report["final_loss_equal"], report
    assert report["restart_kind"] == "none", report
    events = read_events(report["faulted"])
    restored = [(e["culprit"], e["how"], e["tensors"]) for e in events
                if e["event"] == "silent_corruption_detected"]
    assert restored == [([5], "majority", ["layers.0.mlp.fc.weight"])], restored
    assert not [e for e in events if e["event"] == "rolled_back"]
    assert_bit_equal(report, Path(report["reference"]))
