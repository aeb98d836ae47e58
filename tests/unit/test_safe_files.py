"""No write through a link planted in the place of a file the run writes
(issue 34 item 1): each writer refuses or replaces the link, and the file it
pointed at keeps its bytes; the launcher refuses such a run directory before
any worker starts, naming every link."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.local.shard import Shard, add_checksums, stage
from megaresil.checkpoint.local.store import NodeStore
from megaresil.checkpoint.sharded import Rect
from megaresil.config import ConfigError, LoggingConfig, load_recipe
from megaresil.events import EventLog, read_events
from megaresil.observe.goodput import write_goodput
from megaresil.observe.loggers import kept_run_id
from megaresil.observe.report import write_report
from megaresil.resilience.stragglers import StragglerDetector
from megaresil.safe_files import (LinkRefused, open_nofollow, own_dir, private_dir, refuse_links,
                                  write_atomic)
from megaresil.train.metrics import MetricsLog, StepFigures

from tests.harness.cli import ROOT
from tests.harness.journey import home, megaresil  # noqa: F401  (home: a fixture)

TINY = str(ROOT / "recipes/gpt-tiny.yaml")
KNOWN = "{\"precious\": true}\n"  # a JSON line: the old code read it as a record and appended


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A file outside the run directory that a planted link points at."""
    path = tmp_path / "elsewhere" / "precious"
    path.parent.mkdir()
    path.write_text(KNOWN)
    return path


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def untouched(target: Path) -> bool:
    return target.read_text() == KNOWN


# --- the mechanism ---------------------------------------------------------------------------

def test_an_append_refuses_a_link_and_writes_a_file_of_its_own_otherwise(tmp_path, target):
    with pytest.raises(LinkRefused, match="metrics.jsonl is a link .*Fix: remove the link"):
        open_nofollow(plant(tmp_path / "metrics.jsonl", target))
    assert untouched(target)
    with open_nofollow(tmp_path / "own.jsonl") as f:
        f.write("a\n")
    with open_nofollow(tmp_path / "own.jsonl") as f:
        f.write("b\n")
    assert (tmp_path / "own.jsonl").read_text() == "a\nb\n"
    assert stat.S_IMODE((tmp_path / "own.jsonl").stat().st_mode) == 0o644


def test_an_atomic_write_replaces_a_link_instead_of_writing_through_it(tmp_path, target):
    link = plant(tmp_path / "recipe.yaml", target)
    write_atomic(link, "model: {}\n")
    assert untouched(target)
    assert not link.is_symlink() and link.read_text() == "model: {}\n"
    assert stat.S_IMODE(link.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "recipe.yaml"]  # no temp left


def test_a_directory_of_the_run_that_is_a_link_is_refused(tmp_path, target):
    with pytest.raises(LinkRefused, match="report is a link"):
        own_dir(plant(tmp_path / "report", target.parent))
    assert own_dir(tmp_path / "a" / "b").is_dir()


def test_a_private_directory_is_this_users_alone(tmp_path, target):
    """For predictable names in /dev/shm: what another user made first is refused."""
    made = private_dir(tmp_path / "mine")
    assert stat.S_IMODE(made.stat().st_mode) & 0o077 == 0 and private_dir(made) == made
    with pytest.raises(LinkRefused):
        private_dir(plant(tmp_path / "planted", target.parent))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="not a directory of this user's own"):
        private_dir(shared)
    (tmp_path / "file").write_text("")
    with pytest.raises(PermissionError):
        private_dir(tmp_path / "file")
    if os.getuid() == 0:  # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4321, 4321)
        with pytest.raises(PermissionError):
            private_dir(theirs)


def test_the_launch_check_names_every_link_of_the_run(tmp_path, target):
    run, local = tmp_path / "run", tmp_path / "shm" / "run-1234"
    for name in ("metrics.jsonl", "events.jsonl", "recipe.yaml", "goodput.json"):
        plant(run / name, target)
    plant(run / "checkpoints" / "latest", target)
    plant(local / "node_0", target.parent)
    (run / "stragglers.jsonl").write_text("")  # a file of its own: fine
    with pytest.raises(ConfigError) as refused:
        refuse_links(run, run / "checkpoints", [local.parent, local])
    message = str(refused.value)
    assert message.startswith("run.dir: ") and message.endswith(
        "Fix: remove the links or choose another run.dir.")
    for name in ("metrics.jsonl", "events.jsonl", "recipe.yaml", "goodput.json",
                 "checkpoints/latest"):
        assert f"{run / name} -> {target}" in message
    assert f"{local / 'node_0'} -> {target.parent}" in message
    assert "stragglers.jsonl" not in message
    refuse_links(tmp_path / "clean", tmp_path / "clean" / "checkpoints")  # nothing there: fine


def test_a_planted_local_root_is_refused(tmp_path, target):
    local = plant(tmp_path / "shm" / "run-1234", target.parent)
    with pytest.raises(ConfigError, match="run-1234 ->"):
        refuse_links(tmp_path / "run", tmp_path / "run" / "checkpoints", [local.parent, local])


# --- the data caches (data.cache_dir, data.index_cache, data prepare --output) -----------------

def test_a_cache_lock_is_not_opened_through_a_link(tmp_path, target):
    """Opened for appending through a link, a lock created a missing target."""
    from megaresil.data.filelock import exclusive_lock

    missing = target.with_name("created")
    for planted_at in (target, missing):
        plant(tmp_path / "cache" / "entry.lock", planted_at)
        with pytest.raises(ConfigError, match=r"^data.cache_dir: .*entry.lock is a link"):
            with exclusive_lock(tmp_path / "cache" / "entry.lock", "data.cache_dir"):
                pass
        (tmp_path / "cache" / "entry.lock").unlink()
    assert untouched(target) and not missing.exists()


def test_cached_files_are_written_under_names_no_one_could_plant(tmp_path, target):
    """Shuffle indices, trained tokenizers and prepared datasets were written
    to NAME.tmpPID, opened through whatever link was planted there."""
    from megaresil.data.index_cache import ShuffleIndex
    from megaresil.data.indexed import IndexedDatasetWriter, bin_path, idx_path
    from megaresil.data.tokenizer import build_tokenizer

    pid = os.getpid()
    index = ShuffleIndex(tmp_path / "index", samples=10, seed=1)
    plant(index.path(0).with_name(f".{index.path(0).name}.tmp{pid}"), target)
    assert sorted(index.epoch(0)) == list(range(10))
    tokenizer = tmp_path / "cache" / "tokenizer.json"
    plant(tokenizer.with_name(f"tokenizer.json.tmp{pid}"), target)
    build_tokenizer("bpe", corpus_text=["to be or not to be"] * 20, vocab_size=300,
                    cache_path=tokenizer)
    assert build_tokenizer("bpe", cache_path=tokenizer).vocab_size > 256
    prefix = tmp_path / "prepared" / "corpus"
    for name in (bin_path(str(prefix)), idx_path(str(prefix))):
        plant(Path(f"{name}.tmp{pid}"), target)
    with IndexedDatasetWriter(prefix) as writer:
        writer.add_document([1, 2, 3])
        writer.finalize()
    assert Path(bin_path(str(prefix))).stat().st_size == 12
    assert untouched(target)


# --- each writer -----------------------------------------------------------------------------

def test_events_are_not_appended_through_a_link(tmp_path, target):
    plant(tmp_path / "events.jsonl", target)
    with pytest.raises(LinkRefused):
        EventLog(tmp_path, rank=0).emit("restart", kind="in_process")
    assert untouched(target)


def test_a_torn_events_line_is_still_repaired_through_the_same_descriptor(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"event": "a"}\n{"event": "to')
    EventLog(tmp_path).emit("b")
    assert [e["event"] for e in read_events(tmp_path)] == ["a", "b"]


def test_metrics_are_not_appended_through_a_link(tmp_path, target):
    plant(tmp_path / "metrics.jsonl", target)
    cfg = load_recipe(TINY, ["logging.tensorboard=false", "logging.progress=false"])
    with pytest.raises(LinkRefused):
        MetricsLog(tmp_path, cfg, StepFigures(1, 1, 1.0, torch.device("cpu")), start_step=0)
    assert untouched(target)


def test_goodput_replaces_links_at_its_name_and_its_old_temporary_name(tmp_path, target):
    EventLog(tmp_path).emit("generation_started", launched_at=1.0)
    other = target.with_name("other")
    other.write_text(KNOWN)
    plant(tmp_path / "goodput.json", target)
    plant(tmp_path / "goodput.tmp", other)  # the fixed temporary name the old code wrote through
    write_goodput(tmp_path)
    assert untouched(target) and untouched(other)
    assert "goodput" in json.loads((tmp_path / "goodput.json").read_text())


def test_latest_replaces_planted_links_without_touching_their_targets(tmp_path, target):
    other = target.with_name("other")
    other.write_text(KNOWN)
    plant(tmp_path / fmt.LATEST, target)
    plant(tmp_path / f"{fmt.LATEST}.tmp", other)
    fmt.update_latest(tmp_path, "step_0000002")
    assert untouched(target) and untouched(other)
    assert (tmp_path / fmt.LATEST).read_text() == "step_0000002\n"


def test_a_tracker_run_id_is_not_read_from_or_written_through_a_link(tmp_path, target):
    plant(tmp_path / "wandb_run_id", target)
    with pytest.raises(LinkRefused):
        kept_run_id(tmp_path, "wandb_run_id", lambda: "new-id")
    assert untouched(target)
    assert kept_run_id(tmp_path, "mlflow_run_id", lambda: "new-id") == "new-id"
    assert kept_run_id(tmp_path, "mlflow_run_id", lambda: "other") == "new-id"


def test_straggler_windows_are_not_appended_through_a_link(tmp_path, target):
    plant(tmp_path / "stragglers.jsonl", target)
    detector = StragglerDetector(LoggingConfig(straggler_interval=1), rank=0, run_dir=tmp_path,
                                 events=EventLog(tmp_path))
    table = [{"steps": 1, "first": 1, "mem_peak_mb": 1.0,
              "sections": {"data": {"wall_s": 0.1, "cpu_s": 0.1}}}]
    with pytest.raises(LinkRefused):
        detector.report(1, table)
    assert untouched(target)


def local_shard(step: int) -> Shard:
    data, records = stage([Rect("model/w", (2,), (0,), torch.ones(2))], None)
    add_checksums(data, records)
    layout = {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}
    return Shard({"format": "megaresil-local-shard", "step": step, "owner": 0, "world": 1,
                  "layout": layout, "rects": records, "run": {}, "rank_state": {}}, data)


def test_the_local_tier_writes_no_shard_through_a_planted_step_directory(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plant(tmp_path / "node_0" / fmt.step_dir_name(3), elsewhere)
    with pytest.raises(fmt.CheckpointError, match="step_0000003"):
        NodeStore(tmp_path / "node_0").write(local_shard(3))
    assert list(elsewhere.iterdir()) == []
    NodeStore(tmp_path / "node_0").write(local_shard(4))  # a directory of its own: written
    assert (tmp_path / "node_0" / fmt.step_dir_name(4) / "rank_00000" / fmt.MARKER).exists()


def test_a_profile_trace_is_not_written_into_a_planted_directory(tmp_path, target):
    from megaresil.config import ProfileConfig
    from megaresil.observe.profiler import StepProfiler

    profiler = StepProfiler(ProfileConfig(enabled=True, start_step=1, steps=1), 0, tmp_path)
    plant(profiler.path.parent, target.parent)
    with pytest.raises(LinkRefused, match="profile is a link"):
        with profiler.step(1):
            torch.ones(4).sum()
    assert os.listdir(target.parent) == [target.name]


def test_a_hang_dump_is_not_written_through_a_link(tmp_path, target):
    from megaresil.resilience.watchdog.abort import dump_stacks

    dump = tmp_path / "hangs" / "generation_0" / "rank0.txt"
    plant(dump, target)
    with pytest.raises(LinkRefused):
        dump_stacks(dump, "hang in allreduce", "w")  # only the paths it names
    assert untouched(target)


def test_the_run_lock_record_is_never_written_through_a_link(tmp_path, target):
    from megaresil.run_lock import LOCK_NAME, RunLock

    lock = RunLock(tmp_path, "job")
    plant(tmp_path / f"{LOCK_NAME}.{lock.me.host}.{lock.me.pid}.{id(lock):x}", target)
    with pytest.raises(FileExistsError):
        lock._create()
    assert untouched(target) and not (tmp_path / LOCK_NAME).exists()


def small_run(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s,
                    "tokens_per_s": 100.0, "elapsed_s": float(s), "step_time_s": 1.0,
                    "time": 1000.0 + s}) + "\n" for s in (1, 2, 3)))
    (path / "events.jsonl").write_text(json.dumps(
        {"time": 1000.0, "event": "generation_started", "launched_at": 999.0}) + "\n")
    return path


def test_a_report_replaces_planted_links_in_its_directory(tmp_path, target):
    run = small_run(tmp_path / "run")
    for name in ("index.html", "loss.png", "summary.json"):
        plant(run / "report" / name, target)
    page = write_report(run)
    assert untouched(target)
    assert not page.is_symlink() and page.read_text().startswith("<!doctype html>")
    assert (run / "report" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_a_report_directory_that_is_a_link_is_refused(tmp_path, target):
    run = small_run(tmp_path / "run")
    plant(run / "report", target.parent)
    with pytest.raises(LinkRefused, match="report is a link"):
        write_report(run)
    assert sorted(os.listdir(target.parent)) == ["precious"]


# --- through the CLI ---------------------------------------------------------------------

SMALL = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "train.steps=2", "data.seq_len=16",
         "model.max_seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=2",
         "train.eval_batches=0", "logging.tensorboard=false", "logging.progress=false",
         "data.source=synthetic"]


def outside_files(home: Path, *names: str) -> dict[str, Path]:
    """Files outside the run directory with known content, one per name."""
    (home / "outside").mkdir()
    files = {name: home / "outside" / name for name in names}
    for path in files.values():
        path.write_text(KNOWN)
    return files


@pytest.mark.journey
def test_train_refuses_a_run_directory_with_planted_links_naming_them(home):
    targets = outside_files(home, "metrics.jsonl", "events.jsonl", "recipe.yaml")
    for name, path in targets.items():
        plant(home / "run" / name, path)
    result = megaresil("train", "gpt-tiny", *SMALL, "run.dir=run", cwd=home, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("megaresil: error: run.dir: ") and line.endswith(
        "Fix: remove the links or choose another run.dir."), result.stderr
    for name, path in targets.items():
        assert f"run/{name} -> {path}" in line
        assert untouched(path)
    assert sorted(os.listdir(home / "run")) == sorted(targets)  # nothing else written: no worker ran


@pytest.mark.journey
@pytest.mark.parametrize("planted", ["checkpoints", "checkpoints/latest",
                                     "checkpoints/step_0000002"])
def test_train_refuses_a_planted_checkpoint_root_or_latest(home, planted):
    """A planted step directory: once the save of its step failed in every
    relaunch (rmtree of a link) before the job gave up."""
    target = outside_files(home, "root")["root"]
    if planted != "checkpoints/latest":
        target = target.parent  # a directory elsewhere, where the saves would land
    plant(home / "run" / planted, target)
    result = megaresil("train", "gpt-tiny", *SMALL, "run.dir=run", cwd=home, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"run/{planted} -> {target}" in result.stderr
    assert sorted(os.listdir(home / "outside")) == ["root"] and untouched(home / "outside" / "root")


@pytest.mark.journey
def test_report_refuses_a_planted_report_directory(home):
    target = outside_files(home, "precious")["precious"]
    run = small_run(home / "run")
    plant(run / "report", target.parent)
    result = megaresil("report", "run", cwd=home, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("megaresil: error: run/report is a link (to ")
    assert sorted(os.listdir(home / "outside")) == ["precious"] and untouched(target)
