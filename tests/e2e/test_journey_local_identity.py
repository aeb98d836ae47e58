"""Issue 46 item 1 through the installed command: the node-local tier
resumes only its own run's shards, and only under the recipe check the
global tier has; the shards of another run in its root are never loaded,
listed or removed, and one job at a time holds the root. Each run ends
bit-equal to its fault-free reference. Item 16: a damaged local shard
passed over says so."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megaresil.checkpoint.paths import default_local_root
from megaresil.events import read_events
from megaresil.run_identity import read_run_id
from megaresil.run_lock import RunLock
from tests.harness.cli import ROOT
from tests.harness.journey import home, megaresil, with_demo_corpus  # noqa: F401  (home: a fixture)

RECIPE = str(ROOT / "recipes" / "gpt-tiny.yaml")
COMMON = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "train.steps=4",
          "checkpoint.interval=4", "data.seq_len=32", "train.eval_batches=0",
          "logging.progress=false", "logging.tensorboard=false"]
LOCAL = ["checkpoint.local.enabled=true", "checkpoint.local.interval=1"]
SHARED = [*LOCAL, "checkpoint.local.dir=shm"]  # a root the runs of a test share
# Killed as step 3 starts: local step 2 is the run's only state (no global save yet).
KILLED = ["faults=[{kind: kill, rank: 0, step: 3}]", "resilience.max_restarts=0"]
OTHER = ["optimizer.lr=0.002", "train.seed=7"]  # another run's recipe


@pytest.fixture(scope="module")
def references(tmp_path_factory, demo_corpus) -> Path:
    """The fault-free runs of the recipe (a) and of the other one (b)."""
    home = tmp_path_factory.mktemp("local-identity-references")
    with_demo_corpus(home / ".cache" / "megaresil", demo_corpus)
    megaresil("train", RECIPE, *COMMON, "run.dir=a", cwd=home)
    megaresil("train", RECIPE, *COMMON, *OTHER, "run.dir=b", cwd=home)
    return home


def killed_before_its_first_global_save(home: Path, *local: str) -> str:
    """Run `a` killed after local step 2; returns its run id."""
    killed = megaresil("train", RECIPE, *COMMON, *local, *KILLED, "run.dir=a", cwd=home,
                       check=False)
    assert killed.returncode == 1, killed.stderr
    assert not (home / "a" / "checkpoints" / "step_0000004").exists()
    return read_run_id(home / "a")


def resumes_from_local_step_2_to_its_reference(home: Path, references: Path) -> None:
    """Run `a` again as it was: its local step 2 serves, and it ends as its reference."""
    megaresil("train", RECIPE, *COMMON, *SHARED, "run.dir=a", cwd=home)
    assert loads(home / "a") == [("local", 2)]
    assert ends_as(home, "a", references / "a")


def loads(run_dir: Path) -> list[tuple[str, int]]:
    return [(e["tier"], e["step"]) for e in read_events(run_dir)
            if e["event"] == "checkpoint_loaded"]


def ends_as(home: Path, run: str, reference: Path) -> bool:
    """Whether the run's final checkpoint is bit for bit the reference's."""
    diff = megaresil("ckpt", "diff", str(reference / "checkpoints" / "step_0000004"),
                     str(home / run / "checkpoints" / "step_0000004"), cwd=home)
    return " 0 not identical" in diff.stdout


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in directory.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.journey
def test_a_rerun_with_another_recipe_is_refused_and_the_same_recipe_resumes_bit_equal(
        home, demo_corpus, references):
    """(b): against local shards, a changed recipe exits 2 as against a global checkpoint."""
    with_demo_corpus(home / ".cache" / "megaresil", demo_corpus)
    killed_before_its_first_global_save(home, *SHARED)
    refused = megaresil("train", RECIPE, *COMMON, *SHARED, *OTHER, "model.dropout=0.1",
                        "run.dir=a", cwd=home, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "checkpoint.allow_recipe_change: resuming from local step 2 (" in refused.stderr
    for key, saved in (("model.dropout", "0.0"), ("optimizer.lr", "0.003"),
                       ("train.seed", "1234")):
        assert f"\n  {key}: the checkpoint has {saved}, this recipe " in refused.stderr
    assert "Fix: use a new run.dir, or allow it: checkpoint.allow_recipe_change=[model.dropout," \
           "optimizer.lr,train.seed]" in refused.stderr
    assert "Traceback" not in refused.stderr

    resumes_from_local_step_2_to_its_reference(home, references)


@pytest.mark.slow
@pytest.mark.journey
def test_runs_sharing_a_local_root_take_turns_and_never_touch_each_others_shards(
        home, demo_corpus, references):
    """(c): another run directory with another seed and the same checkpoint.local.dir."""
    with_demo_corpus(home / ".cache" / "megaresil", demo_corpus)
    (home / "shm").mkdir()
    with RunLock(home / "shm", "another-job", key="checkpoint.local.dir"):
        busy = megaresil("train", RECIPE, *COMMON, *SHARED, "run.dir=a", cwd=home, check=False)
    assert busy.returncode == 2
    assert "checkpoint.local.dir: shm is in use by job another-job" in busy.stderr

    first = killed_before_its_first_global_save(home, *SHARED)
    held = files(home / "shm")
    assert any(name.startswith(f"run-{first}/node_0/step_0000002/") for name in held)
    second = megaresil("train", RECIPE, *COMMON, *SHARED, *OTHER, "run.dir=b", cwd=home)
    assert f"shm holds the local shards of another run (run-{first}): this run neither " \
           "loads nor removes them" in second.stderr
    assert loads(home / "b") == []  # a new run: from step 0
    assert ends_as(home, "b", references / "b")
    assert files(home / "shm") == held  # the first run's only state, as it was

    resumes_from_local_step_2_to_its_reference(home, references)


@pytest.mark.slow
@pytest.mark.journey
def test_a_run_directory_made_again_at_the_same_path_is_another_run(
        home, demo_corpus, references):
    """(a): the default root (/dev/shm) outlives the deleted run directory."""
    with_demo_corpus(home / ".cache" / "megaresil", demo_corpus)
    root = default_local_root(home / "a")
    try:
        deleted = killed_before_its_first_global_save(home, *LOCAL)
        left = files(root / f"run-{deleted}")
        assert left
        shutil.rmtree(home / "a")
        again = megaresil("train", RECIPE, *COMMON, *LOCAL, *OTHER, "run.dir=a", cwd=home)
        assert f"holds the local shards of another run (run-{deleted})" in again.stderr
        assert loads(home / "a") == []
        assert ends_as(home, "a", references / "b")
        assert files(root / f"run-{deleted}") == left  # never removed: not this run's
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.journey
def test_a_damaged_local_shard_passed_over_for_its_replica_is_reported(home, demo_corpus):
    """Item 16: rank 0's own shards damaged as step 4 starts, then the job
    fails: the restart takes rank 0's shard from its replica on the other
    node and says which copies it passed over, as for a global checkpoint.
    Step 2's replicas are committed by then (a save waits for the one
    before); step 3's may still be on their way: either step may serve."""
    with_demo_corpus(home / ".cache" / "megaresil", demo_corpus)
    faults = ("faults=[{kind: corrupt_local_checkpoint, rank: 0, step: 4}, "
              "{kind: raise, rank: 0, step: 4}]")
    run = megaresil("train", RECIPE, *COMMON, "parallel.dp=2", *SHARED,
                    "checkpoint.local.ranks_per_node=1", faults, "run.dir=a", cwd=home)
    events = read_events(home / "a")
    (loaded,) = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert (loaded["tier"], loaded["from_replicas"]) == ("local", [0]), loaded
    assert loaded["step"] in (2, 3)
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    steps = [e["step"] for e in skipped]
    assert loaded["step"] in steps and set(steps) <= {loaded["step"], 3}, skipped
    for event in skipped:
        assert (event["tier"], event["owner"]) == ("local", 0)
        assert event["path"].endswith(f"/node_0/step_{event['step']:07d}/rank_00000")
        assert "checksum mismatch" in event["reason"]
        assert f"skipped local shard {event['path']}: " in run.stderr
